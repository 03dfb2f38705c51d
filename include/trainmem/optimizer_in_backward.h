#pragma once
/// \file optimizer_in_backward.h
/// The optimizer step inside backward: one optimizer per parameter, stepped
/// from a post-accumulate-grad hook the moment that parameter's gradient is
/// ready, and the gradient freed at once, so the gradient bucket never exists
/// whole (ViT-L with Adam, batch 1, as in PyTorch's tutorial on fusing the
/// optimizer step into backward: the peak drops from about 6 GB to about 4 GB).
///
/// What this breaks in PyTorch, handled here: gradient accumulation (an
/// accumulate-k mode steps on every k-th backward only) and global-norm
/// clipping (clip_grad_norm(): an exact two-pass alternative).
///
/// Example:
/// ```
/// trainmem::OptimizerInBackward oib(model->parameters(), [](std::vector<at::Tensor> p) {
///   return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-3));
/// });
/// model->forward(x).pow(2).mean().backward();   // parameters are updated here
/// ```

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainmem/export.h"

namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace trainmem {

/// Builds an optimizer over the given parameters (called once per parameter).
using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

/// Steps one optimizer per parameter from backward. While alive it owns the
/// post-accumulate-grad hook slot of each parameter (LibTorch has one slot per
/// tensor); the destructor gives it back. Hooks fire from AccumulateGrad, i.e.
/// for `backward()`, not for `torch::autograd::grad(outputs, inputs)`, on the
/// autograd engine's thread for the parameter's device.
class TRAINMEM_API OptimizerInBackward {
 public:
  /// Hooks every parameter that requires grad. `accumulation_steps` k >= 1:
  /// gradients accumulate over k backward passes and the step runs (and the
  /// gradient is freed) on every k-th. Throws if there is no parameter that
  /// requires grad, if a parameter already has a post-accumulate-grad hook, or
  /// if k < 1.
  OptimizerInBackward(
      std::vector<at::Tensor> parameters,
      OptimizerFactory factory,
      int64_t accumulation_steps = 1);
  ~OptimizerInBackward();

  OptimizerInBackward(const OptimizerInBackward&) = delete;
  OptimizerInBackward& operator=(const OptimizerInBackward&) = delete;

  /// Sets the learning rate of every per-parameter optimizer (one call drives
  /// a schedule).
  void set_lr(double lr);
  /// The learning rate of the first parameter group.
  double lr() const;
  /// Steps taken by the optimizer of parameter 0 (all step together).
  int64_t num_steps() const;
  /// The per-parameter optimizers, in the order of the parameters hooked
  /// (Audit::add_optimizer counts their state).
  std::vector<const torch::optim::Optimizer*> optimizers() const;
  /// The optimizer of one parameter (throws if it is not hooked here).
  torch::optim::Optimizer& optimizer_for(const at::Tensor& parameter);

  /// Exact global-norm clipping with the step in backward: runs
  /// `forward_backward` twice. The first pass only measures the gradients'
  /// total 2-norm (each gradient is freed as soon as it is measured, nothing
  /// steps); the second steps with every gradient scaled by
  /// min(1, max_norm / (total_norm + 1e-6)), exactly what
  /// torch::nn::utils::clip_grad_norm_ does before a plain step. Costs one
  /// extra forward and backward; never holds more than one gradient. Returns
  /// the total norm. Throws with accumulation_steps > 1.
  double clip_grad_norm(double max_norm, const std::function<void()>& forward_backward);

  struct State;

 private:
  std::shared_ptr<State> state_;
};

} // namespace trainmem
