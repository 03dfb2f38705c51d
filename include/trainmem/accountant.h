#pragma once
/// \file accountant.h
/// The static buckets of a training step: parameters, buffers (BatchNorm's
/// running statistics), gradients and optimizer state, read exactly from a
/// module and a `torch::optim` optimizer, and predicted by formula per
/// precision recipe before anything runs.
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

#include <torch/arg.h>

#include "trainmem/export.h"

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
  /// Bytes of unique buffer storages (`module.buffers()`: BatchNorm's
  /// running_mean, running_var, num_batches_tracked), less any storage a
  /// parameter holds (counted there). Module state that is no parameter: it
  /// has no gradient and no optimizer state, and no recipe predicts it.
  int64_t buffer_bytes = 0;
  /// Buffer tensors counted (one per unique storage).
  int64_t num_buffers = 0;
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

  /// param_bytes + buffer_bytes + grad_bytes + optimizer_state_bytes, in bytes.
  int64_t total_bytes() const {
    return param_bytes + buffer_bytes + grad_bytes + optimizer_state_bytes;
  }
  /// param_bytes + buffer_bytes + predicted gradient and optimizer state bytes.
  int64_t predicted_total_bytes() const {
    return param_bytes + buffer_bytes + predicted_grad_bytes +
        (predicted_optimizer_state_bytes > 0 ? predicted_optimizer_state_bytes
                                             : 0);
  }
};

/// Reads the static buckets of `module` alone (no optimizer).
TRAINMEM_API StaticBuckets account(const torch::nn::Module& module);
/// Reads the static buckets of `module` and `optimizer`. Throws if the
/// optimizer has no parameters, or if it has parameters that are not in
/// `module` (the message says how many).
TRAINMEM_API StaticBuckets account(
    const torch::nn::Module& module,
    const torch::optim::Optimizer& optimizer);

/// Text table of the buckets.
TRAINMEM_API std::string to_string(const StaticBuckets& buckets);

/// Training recipes whose static bytes per parameter have a closed form.
enum class Recipe {
  kFp32AdamW,      ///< fp32 params, grads, m and v: 4 + 4 + 8 = 16 B/param
  kMixedAdamW,     ///< bf16/fp16 params and grads, fp32 master, m, v: 2+2+12
  kPureBf16AdamW,  ///< bf16 params and grads updated directly, fp32 m, v: 12
  kFp32SGD,        ///< fp32 params and grads, no state: 8 B/param
  kFp32SGDMomentum, ///< plus a momentum buffer: 12 B/param
  kFp32Adafactor,  ///< fp32 params, grads, factored second moment (row + col)
};

/// Which static bucket a formula term belongs to; ZeRO shards them in the
/// order kOptimizerState (stage 1), kGradients (2), kParameters (3).
enum class Bucket {
  kParameters,     ///< the weights the model computes with
  kGradients,      ///< their gradients
  kOptimizerState, ///< optimizer-side: master weights, moments
  /// Module buffers (BatchNorm's running statistics): never sharded, every
  /// rank keeps them whole (Note [Buffers are replicated] in accountant.cpp).
  kBuffers,
};

/// One term of a static-bytes formula.
struct FormulaTerm {
  std::string name;         ///< "parameters", "gradients", "master weights"...
  double bytes_per_param = 0; ///< bytes per parameter element (Adafactor: average)
  int64_t bytes = 0;        ///< this term in bytes
  bool shard_first = false; ///< optimizer-side bytes ZeRO-1 shards first
  Bucket bucket = Bucket::kOptimizerState; ///< its bucket (shard_first == kOptimizerState)
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
TRAINMEM_API StaticFormula predict_static_bytes(int64_t num_params, Recipe recipe);
/// Predicts the static bytes of `module`'s trainable parameters under `recipe`
/// (Adafactor: row (rows, 1) and column (1, cols) state for each matrix, a
/// full second moment for vectors). Frozen parameters count as parameters
/// only. When the module has buffers (BatchNorm's running statistics), a last
/// term "buffers" (Bucket::kBuffers) holds their bytes as they are stored
/// (the accountant's StaticBuckets::buffer_bytes; no recipe changes them).
TRAINMEM_API StaticFormula predict_static_bytes(const torch::nn::Module& module, Recipe recipe);

/// "fp32 AdamW", "mixed-precision AdamW", ...
TRAINMEM_API std::string to_string(Recipe recipe);
/// "P = 1,189,632 x (4 params + 4 grads + 8 AdamW m,v) = 19,034,112 B".
TRAINMEM_API std::string to_string(const StaticFormula& formula);

/// How the static buckets are split across data-parallel ranks: ZeRO
/// (Rajbhandari et al. 2020) stage 1 shards the optimizer state, stage 2 also
/// the gradients, stage 3 also the parameters (PyTorch FSDP: SHARD_GRAD_OP is
/// stage 2, FULL_SHARD stage 3; Megatron's distributed optimizer is stage 1).
///
/// Example:
/// ```
/// auto f = trainmem::predict_static_bytes(7000000000, trainmem::Recipe::kMixedAdamW);
/// auto r = trainmem::shard_static_bytes(f, trainmem::ShardingOptions().zero_stage(2).world_size(8));
/// r.device_per_rank_bytes;   // 2 P + 14 P / 8 = 26,250,000,000
/// ```
struct ShardingOptions {
  TORCH_ARG(int64_t, zero_stage) = 0;  ///< 0 (replicated), 1, 2 or 3
  TORCH_ARG(int64_t, world_size) = 1;  ///< N, data-parallel ranks
  /// Optimizer state in host memory (ZeRO-Offload; stage >= 1). At stage >= 2
  /// the rank's gradient shard goes to the host too (the CPU optimizer reads
  /// it there), as DeepSpeed does.
  TORCH_ARG(bool, offload_optimizer) = false;
  /// Parameter shards in host memory too (ZeRO-Infinity; stage 3 only).
  TORCH_ARG(bool, offload_parameters) = false;
  /// Elements of the largest module's own parameters: at stage 3 a rank
  /// gathers one module's full parameters and their gradients at a time, a
  /// working buffer of (parameter + gradient bytes per element) x this. 0 to
  /// leave it out. See largest_layer_params().
  TORCH_ARG(int64_t, largest_layer_params) = 0;
};

/// One term of a sharded prediction.
struct ShardedTerm {
  std::string name;          ///< the recipe term's name, or the stage-3 gather buffer's
  Bucket bucket = Bucket::kParameters; ///< its bucket
  int64_t total_bytes = 0;   ///< the whole term, unsharded, in bytes
  bool sharded = false;      ///< split across the world size at this stage
  bool on_host = false;      ///< kept in host memory (offloaded)
  bool working = false;      ///< a per-layer working buffer, not a bucket (stage-3 gather)
  /// What one rank holds, in bytes: the whole term, or its shard. A shard of
  /// a per-element term is ceil(P / N) elements (the flat buffer padded to a
  /// multiple of N, as DeepSpeed and FSDP pad); other terms ceil(bytes / N).
  int64_t per_rank_bytes = 0;
};

/// Per-rank static bytes of a recipe under sharding. Plain data.
struct ShardedStatic {
  StaticFormula formula;            ///< the unsharded recipe
  ShardingOptions options;          ///< how it is sharded
  std::vector<ShardedTerm> terms;   ///< the recipe's terms, then the gather buffer
  int64_t device_per_rank_bytes = 0; ///< accelerator memory per rank, in bytes
  int64_t host_per_rank_bytes = 0;   ///< host memory per rank (offloaded terms), in bytes
};

/// Splits `formula`'s terms across `options.world_size()` ranks. Throws on a
/// stage outside 0..3, a world size below 1, offload at stage 0, or parameter
/// offload below stage 3.
TRAINMEM_API ShardedStatic shard_static_bytes(const StaticFormula& formula, const ShardingOptions& options);

/// Elements of the largest parameter set one module owns directly (DeepSpeed's
/// "largest layer", what ZeRO-3 gathers at once): max over submodules of their
/// own (non-recursive) parameters, each tensor counted once.
TRAINMEM_API int64_t largest_layer_params(const torch::nn::Module& module);

/// "mixed-precision AdamW, ZeRO-2 over 8 ranks: 26,250,000,000 B per rank
/// on the device, 0 B on the host" and one line per term.
TRAINMEM_API std::string to_string(const ShardedStatic& sharded);

/// One term of a published per-rank formula.
struct PublishedTerm {
  std::string name;           ///< as the source names it
  double bytes_per_param = 0; ///< bytes per parameter element (per largest-layer element for gather terms)
  bool sharded = false;       ///< divided by the world size
  bool on_host = false;       ///< host memory
  bool per_largest_layer = false; ///< scales with the largest layer, not P
  /// Empty when our recipe has the same term at the same stage; otherwise
  /// how ours differs, in one sentence.
  std::string differs;
};

/// A published static-memory formula as named terms, with where its
/// assumptions differ from ours. Plain data.
struct TRAINMEM_API PublishedFormula {
  std::string source;               ///< "DeepSpeed estimate_zero2_model_states_mem_needs"...
  std::string formula;              ///< as published: "2P + 18P/N"
  Recipe recipe = Recipe::kMixedAdamW; ///< our closest recipe
  ShardingOptions sharding;         ///< our closest sharding (world size taken from the call)
  std::vector<PublishedTerm> terms; ///< the published terms
  /// Device bytes per rank by the published formula: replicated terms x P,
  /// plus floor(sharded bytes-per-param x P / N), plus the largest-layer
  /// terms x `largest_layer_params` (DeepSpeed's integer arithmetic).
  int64_t device_per_rank_bytes(int64_t num_params, int64_t world_size,
                                int64_t largest_layer_params = 0) const;
};

/// Which published formula.
enum class Published {
  kZeroPaperStage1,     ///< Rajbhandari et al. 2020, P_os: (2 + 2) P + K P / N, K = 12
  kZeroPaperStage2,     ///< P_os+g: 2 P + (2 + K) P / N
  kZeroPaperStage3,     ///< P_os+g+p: (2 + 2 + K) P / N
  kDeepSpeedZero2,      ///< DeepSpeed's estimator, ZeRO-2: 2 P + 18 P / N
  kDeepSpeedZero2Offload, ///< ZeRO-2, optimizer on CPU: 2 P on the device
  kDeepSpeedZero3,      ///< ZeRO-3: 4 x largest layer + 18 P / N
  kDeepSpeedZero3OffloadOptimizer, ///< ZeRO-3, optimizer on CPU: 4 x largest layer + 2 P / N
  kDeepSpeedZero3OffloadAll, ///< ZeRO-3, optimizer and parameters on CPU: 4 x largest layer
  kMegatronBf16Fp32Grads, ///< Megatron, bf16 params, fp32 grads: 18
  kMegatronDistributedBf16Fp32Grads, ///< with the distributed optimizer: 6 + 12 / d
  kMegatronDistributedFp32, ///< fp32 params and grads, distributed optimizer: 8 + 8 / d
};

/// The published formula, its terms and our differences.
TRAINMEM_API PublishedFormula published_formula(Published which);
/// Every Published value, in enum order.
TRAINMEM_API std::vector<Published> all_published_formulas();

/// A published formula beside ours at the same size. Plain data.
struct Reconciliation {
  PublishedFormula published;      ///< the formula, its terms and differences
  int64_t published_bytes = 0;     ///< device bytes per rank by the published formula
  ShardedStatic ours;              ///< our closest recipe and sharding, same P and N
  int64_t difference_bytes = 0;    ///< published_bytes - ours.device_per_rank_bytes
};

/// Evaluates `which` and our closest recipe and sharding for `num_params`
/// parameters over `world_size` ranks (`largest_layer_params` counts for ours
/// only where the published formula has a gather term).
///
/// Example:
/// ```
/// auto r = trainmem::reconcile(trainmem::Published::kDeepSpeedZero2, 7000000000, 8);
/// r.difference_bytes;   // 3,500,000,000: DeepSpeed's fp32 gradient partition, 4 P / N
/// ```
TRAINMEM_API Reconciliation reconcile(Published which, int64_t num_params, int64_t world_size,
                         int64_t largest_layer_params = 0);

/// Both figures, the difference and the terms that explain it.
TRAINMEM_API std::string to_string(const Reconciliation& reconciliation);

} // namespace trainmem
