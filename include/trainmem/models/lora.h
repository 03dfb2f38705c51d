#pragma once
/// \file lora.h
/// LoRA (Hu et al. 2021) as Hugging Face PEFT's LoRA layers compute it
/// (peft 0.21.2, `lora.Linear`, kPeftVersion): a frozen base layer W and a
/// trainable low-rank update, y = W x + B(A(x)) * (alpha / r), with A an
/// (r, in) and B an (out, r) linear layer without bias, B zero-initialized.
/// apply_lora() adds the adapters to a model's linear layers by name and
/// freezes every other parameter, as `get_peft_model` does with bias "none":
/// the base weights then carry no gradient and no optimizer state, and
/// autograd saves what the adapted layers need (the input x for A, A(x) for
/// B) and nothing for the frozen products.
///
/// A model's forward calls lora_forward() for each layer that may be adapted
/// (the config-file models of hf_model.h do); a LibTorch module has no
/// forward hooks, so an adapter is a child module named "lora" of the layer
/// it adapts, and parameter names read "layers.0.q_proj.lora.lora_A.weight".
///
/// Example:
/// ```
/// auto model = trainmem::build_hf_model(trainmem::load_hf_config("tiny_llama.json"));
/// auto lora = trainmem::apply_lora(*model.module,
///     trainmem::LoraOptions().rank(16).alpha(32).targets({"q_proj", "v_proj"}));
/// lora.trainable_params;   // 2 r (d + d_kv) per layer
/// model.loss(tokens).backward();   // gradients for lora_A and lora_B only
/// ```

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "trainmem/export.h"

namespace trainmem {

/// The PEFT release whose LoRA layers these follow ("0.21.2");
/// tests/hf_saved_bytes.py --lora measures it.
inline constexpr const char* kPeftVersion = "0.21.2";

/// What apply_lora() adds, with PEFT's LoraConfig defaults (r 8, lora_alpha
/// 8, lora_dropout 0, use_rslora false).
struct LoraOptions {
  TORCH_ARG(int64_t, rank) = 8;      ///< r, the adapters' inner width
  TORCH_ARG(double, alpha) = 8.0;    ///< lora_alpha: the update is scaled by alpha / r
  /// Module names to adapt, matched as PEFT matches `target_modules`: a
  /// layer whose dotted name is the target or ends in "." + target
  /// ("q_proj" adapts every block's q_proj).
  TORCH_ARG(std::vector<std::string>, targets) = {};
  /// use_rslora: scale by alpha / sqrt(r) instead.
  TORCH_ARG(bool, rslora) = false;
};

/// One LoRA adapter: A (r, in) and B (out, r), no biases; B starts at zero,
/// A as torch.nn.Linear's default (kaiming-uniform), as PEFT initializes
/// them. forward(x) = B(A(x)) * scaling.
class TRAINMEM_API LoraImpl : public torch::nn::Cloneable<LoraImpl> {
 public:
  LoraImpl(int64_t in_features, int64_t out_features, int64_t rank, double scaling);
  void reset() override;
  /// B(A(x)) * scaling, x cast to A's dtype first when it differs (PEFT's
  /// _cast_input_dtype).
  at::Tensor forward(const at::Tensor& x);
  int64_t in_features, out_features, rank;
  double scaling;
  torch::nn::Linear lora_A{nullptr}, lora_B{nullptr};
};
TORCH_MODULE(Lora);

/// What apply_lora() did. Plain data.
struct LoraSummary {
  std::vector<std::string> adapted;  ///< the dotted names of the layers adapted, in module order
  int64_t trainable_params = 0;      ///< elements of the adapters (the only trainable parameters)
  int64_t frozen_params = 0;         ///< elements frozen (every other parameter, a tied one once)
};

/// Adds a LoRA adapter to every linear layer of `module` (torch::nn::Linear,
/// or a layer with a `weight` of (in, out) registered as trainmem's Conv1D,
/// as PEFT treats transformers' Conv1D with fan_in_fan_out) whose name
/// matches one of `options.targets()`, and sets requires_grad false on every
/// other parameter. Build the model first (on meta under a MetaInitGuard, or
/// on CPU); the adapters are made on the device of the layer's weight.
/// Throws c10::Error, changing nothing, when: no target is given; the rank
/// or alpha is not positive; a target names no layer (naming it, as PEFT's
/// "Target modules ... not found"); a matched module is not a linear layer
/// (naming it and its type); or the module has adapters already.
TRAINMEM_API LoraSummary apply_lora(torch::nn::Module& module, const LoraOptions& options);

/// The adapter apply_lora() gave `layer`, or nullptr.
TRAINMEM_API LoraImpl* lora_of(const torch::nn::Module& layer);

/// `base_output` (the layer's own forward of `x`) plus the layer's adapter's
/// update when it has one, cast back to base_output's dtype, as PEFT's
/// lora.Linear.forward: call it in a model's forward for each layer that may
/// be adapted.
TRAINMEM_API at::Tensor lora_forward(const torch::nn::Module& layer, const at::Tensor& base_output,
                                     const at::Tensor& x);

} // namespace trainmem
