#pragma once
/// \file accountant.h
/// The static buckets of a training step: parameters, gradients and optimizer
/// state, read exactly from a module and a `torch::optim` optimizer, and
/// predicted by formula per precision recipe before anything runs.
///
/// Example:
/// ```
/// auto model = trainmem::Transformer(trainmem::TransformerOptions());
/// torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
/// auto before = trainmem::account(*model, opt);   // state 0 B, predicted 8 B/param
/// ... one training step ...
/// auto after = trainmem::account(*model, opt);    // state exactly 2 * 4 * P B
/// std::cout << trainmem::to_string(after);
/// ```

#include <cstdint>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
} // namespace torch::nn
namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace trainmem {

/// Bytes of one kind of optimizer state (e.g. "exp_avg"), summed over params.
struct StateBytes {
  std::string name;        ///< state field, as the optimizer names it
  int64_t bytes = 0;       ///< in bytes, unique storages
  int64_t num_tensors = 0; ///< tensors of this field
};

/// The static buckets of a module and (optionally) its optimizer. Plain data.
struct StaticBuckets {
  /// Unique parameter elements (a parameter shared by two modules counts once).
  int64_t num_params = 0;
  /// Elements of parameters that require grad (frozen ones have no gradient
  /// and no optimizer state).
  int64_t num_trainable_params = 0;
  /// Bytes of unique parameter storages.
  int64_t param_bytes = 0;
  /// Bytes of the `.grad` tensors that exist now (0 before the first backward
  /// or after `zero_grad()`, which sets them to undefined).
  int64_t grad_bytes = 0;
  /// Bytes the gradients will take: trainable parameters at their dtype.
  int64_t predicted_grad_bytes = 0;
  /// Bytes of optimizer state tensors that exist now, read from the optimizer
  /// (0 before the first step: state is created lazily, as in PyTorch).
  /// LibTorch keeps Adam's `step` as a plain integer, so it adds no bytes.
  int64_t optimizer_state_bytes = 0;
  /// Bytes the optimizer state will take after its first step, from the
  /// optimizer's type and options; -1 when no optimizer was given. For LBFGS,
  /// an upper bound (its history fills up over steps).
  int64_t predicted_optimizer_state_bytes = -1;
  /// Optimizer type ("AdamW", "SGD", ... or the C++ type name of an unknown
  /// one, whose state is walked generically through its serializer).
  std::string optimizer;
  /// Optimizer state by field, largest first.
  std::vector<StateBytes> state_by_name;

  /// param_bytes + grad_bytes + optimizer_state_bytes, in bytes.
  int64_t total_bytes() const {
    return param_bytes + grad_bytes + optimizer_state_bytes;
  }
  /// param_bytes + predicted gradient and optimizer state bytes.
  int64_t predicted_total_bytes() const {
    return param_bytes + predicted_grad_bytes +
        (predicted_optimizer_state_bytes > 0 ? predicted_optimizer_state_bytes
                                             : 0);
  }
};

/// Reads the static buckets of `module` alone (no optimizer).
StaticBuckets account(const torch::nn::Module& module);
/// Reads the static buckets of `module` and `optimizer`. Throws if the
/// optimizer has no parameters, or if it has parameters that are not in
/// `module` (the message says how many).
StaticBuckets account(
    const torch::nn::Module& module,
    const torch::optim::Optimizer& optimizer);

/// Text table of the buckets.
std::string to_string(const StaticBuckets& buckets);

/// Training recipes whose static bytes per parameter have a closed form.
enum class Recipe {
  kFp32AdamW,      ///< fp32 params, grads, m and v: 4 + 4 + 8 = 16 B/param
  kMixedAdamW,     ///< bf16/fp16 params and grads, fp32 master, m, v: 2+2+12
  kPureBf16AdamW,  ///< bf16 params and grads updated directly, fp32 m, v: 12
  kFp32SGD,        ///< fp32 params and grads, no state: 8 B/param
  kFp32SGDMomentum, ///< plus a momentum buffer: 12 B/param
  kFp32Adafactor,  ///< fp32 params, grads, factored second moment (row + col)
};

/// One term of a static-bytes formula.
struct FormulaTerm {
  std::string name;         ///< "parameters", "gradients", "master weights"...
  double bytes_per_param = 0; ///< bytes per parameter element (Adafactor: average)
  int64_t bytes = 0;        ///< this term in bytes
  bool shard_first = false; ///< optimizer-side bytes ZeRO-1 shards first
};

/// A static-bytes prediction with its terms shown.
struct StaticFormula {
  Recipe recipe;
  int64_t num_params = 0;         ///< parameter elements the formula covers
  std::vector<FormulaTerm> terms; ///< in the order of the formula
  int64_t total_bytes = 0;        ///< sum of the terms, in bytes
  double bytes_per_param = 0;     ///< total_bytes / num_params
};

/// Predicts the static bytes of `num_params` parameters under `recipe`.
/// Adafactor needs shapes: use the Module overload for it.
StaticFormula predict_static_bytes(int64_t num_params, Recipe recipe);
/// Predicts the static bytes of `module`'s trainable parameters under `recipe`
/// (Adafactor: row (rows, 1) and column (1, cols) state for each matrix, a
/// full second moment for vectors). Frozen parameters count as parameters
/// only.
StaticFormula predict_static_bytes(const torch::nn::Module& module, Recipe recipe);

/// "fp32 AdamW", "mixed-precision AdamW", ...
std::string to_string(Recipe recipe);
/// "P = 1,189,632 x (4 params + 4 grads + 8 AdamW m,v) = 19,034,112 B".
std::string to_string(const StaticFormula& formula);

} // namespace trainmem
