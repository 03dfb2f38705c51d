#pragma once
/// \file master_weights.h
/// fp32 master weights for a model held in bf16 (or fp16): the mixed-precision
/// recipe of ZeRO and of apex's O2, 2 + 2 + 12 bytes per parameter (the bf16
/// weight and gradient; the fp32 master weight and AdamW's two fp32 moments).
/// The optimizer steps the masters; the model computes in bf16. LibTorch's
/// optimizers keep their state in the dtype of what they step, so an AdamW
/// over the bf16 weights themselves (pure bf16) keeps bf16 moments and loses
/// small updates to rounding; this keeps them in fp32.
///
/// Example:
/// ```
/// model->to(at::kBFloat16);
/// trainmem::MasterWeights masters(model->parameters());
/// torch::optim::AdamW opt(masters->optimized(), torch::optim::AdamWOptions(1e-4));
/// for (...) {
///   opt.zero_grad();                    // nothing: the masters' gradients were freed
///   model->zero_grad();                 // the bf16 gradients to none
///   loss_fn(model->forward(x), y).backward();
///   masters->step(opt);                 // grads to fp32, step, weights from masters
/// }
/// // fp16 weights: the loss scaled, the masters' gradients unscaled.
/// //   scaler.scale(loss).backward(); masters->step(opt, scaler);
/// ```

#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "trainmem/export.h"

namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace trainmem {

class GradScaler;


/// fp32 masters of the bf16 and fp16 tensors among `trainable` (registered
/// as this module's parameters, "master0", "master1"... by position, so a
/// prediction counts them as it counts the model's: pass the module beside
/// the model). Tensors already fp32 (PEFT's LoRA adapters) get no master:
/// they are optimized as they are.
class TRAINMEM_API MasterWeightsImpl : public torch::nn::Module {
 public:
  explicit MasterWeightsImpl(const std::vector<at::Tensor>& trainable);

  /// What an optimizer should step, in `trainable`'s order: each
  /// low-precision tensor's master, and the fp32 tensors themselves.
  const std::vector<at::Tensor>& optimized() const { return optimized_; }

  /// After backward: each low-precision gradient is converted into its
  /// master's fp32 gradient and freed, one at a time; then
  /// `optimizer.step()`; then each master is copied into its weight (rounded
  /// to bf16) and its gradient freed. A weight without a gradient keeps its
  /// master's gradient undefined (the optimizer skips it).
  void step(torch::optim::Optimizer& optimizer);
  /// The same with a GradScaler (fp16 weights: DeepSpeed's fp16 mode,
  /// apex's O2): the gradients converted, then `scaler.unscale_(optimizer)`
  /// (on the masters' fp32 gradients), `scaler.step(optimizer)` (skipped on
  /// inf/NaN) and `scaler.update()`, then the masters copied into the
  /// weights and their gradients freed. Returns whether the optimizer
  /// stepped.
  bool step(torch::optim::Optimizer& optimizer, GradScaler& scaler);

 private:
  std::vector<at::Tensor> weights_;    // the low-precision trainable tensors
  std::vector<at::Tensor> masters_;    // their fp32 masters, same order
  std::vector<at::Tensor> optimized_;  // masters, and fp32 trainable tensors
  void to_master_grads();
  void from_masters();
};
TORCH_MODULE(MasterWeights);

} // namespace trainmem
