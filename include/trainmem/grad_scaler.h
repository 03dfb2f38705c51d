#pragma once
/// \file grad_scaler.h
/// Dynamic loss scaling for fp16 mixed precision, as PyTorch's
/// `torch.amp.GradScaler` (LibTorch has none): the loss is multiplied by a
/// scale so small fp16 gradients do not underflow; before the step the
/// gradients are divided by it and checked for inf/NaN with ATen's
/// `_amp_foreach_non_finite_check_and_unscale_`; a step whose gradients are
/// not finite is skipped, and `_amp_update_scale_` halves the scale then, or
/// doubles it after `growth_interval` finite steps in a row. bf16 needs none
/// of this (it has fp32's exponent range).
///
/// Example:
/// ```
/// trainmem::GradScaler scaler;                 // init scale 65536
/// for (...) {
///   opt.zero_grad();
///   at::Tensor loss;
///   {
///     at::autocast::set_autocast_enabled(at::kCUDA, true);  // fp16 autocast
///     loss = loss_fn(model->forward(x), y);
///     at::autocast::set_autocast_enabled(at::kCUDA, false);
///   }
///   scaler.scale(loss).backward();
///   scaler.unscale_(opt);                                     // before clipping
///   torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
///   scaler.step(opt);                                         // skipped on inf/NaN
///   scaler.update();
/// }
/// ```

#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "trainmem/export.h"

namespace torch::optim {
class Optimizer;
} // namespace torch::optim
namespace torch::serialize {
class InputArchive;
class OutputArchive;
} // namespace torch::serialize

namespace trainmem {

class OptimizerInBackward;

/// Options of GradScaler, PyTorch's defaults.
///
/// Example:
/// ```
/// trainmem::GradScaler scaler(trainmem::GradScalerOptions().init_scale(1024).growth_interval(100));
/// ```
struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;      ///< 2^16
  TORCH_ARG(double, growth_factor) = 2.0;       ///< scale *= this after growth_interval finite steps
  TORCH_ARG(double, backoff_factor) = 0.5;      ///< scale *= this after a step with inf/NaN
  TORCH_ARG(int64_t, growth_interval) = 2000;   ///< finite steps in a row before growing
  TORCH_ARG(bool, enabled) = true;              ///< false: every call is a pass-through
};

/// The scaler's state, as `GradScaler.state_dict()` holds it.
struct GradScalerState {
  double scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  int64_t growth_tracker = 0;  ///< finite steps in a row since the scale last changed
};

/// Dynamic loss scaling. Not thread-safe; one scaler per training loop. The
/// scale lives on the device of the first loss scaled.
class TRAINMEM_API GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  /// `loss * scale` (the scale is created on loss's device on first use).
  /// Disabled: `loss`. Throws if `loss` is undefined or not floating point.
  at::Tensor scale(const at::Tensor& loss);

  /// Divides `optimizer`'s gradients by the scale in place and records
  /// whether any is inf/NaN. Call it before clipping or inspecting gradients;
  /// at most once per optimizer between update()s (throws otherwise, as
  /// PyTorch does). Throws on fp16 gradients (keep parameters in fp32).
  void unscale_(torch::optim::Optimizer& optimizer);

  /// Unscales first if unscale_() was not called, then runs
  /// `optimizer.step()` unless a gradient was inf/NaN. Returns true if the
  /// optimizer stepped. Throws if called twice before update(). In a
  /// prediction on meta (predict_step_function) the gradients hold no
  /// values, and the step is taken, as every step without inf/NaN is.
  bool step(torch::optim::Optimizer& optimizer);

  /// Always throws: an OptimizerInBackward steps inside backward, before the
  /// scaler could unscale or skip, so its steps would use scaled gradients.
  /// Use a plain optimizer with the scaler, or bf16 (no scaling needed).
  bool step(OptimizerInBackward& optimizer);

  /// Updates the scale from the steps since the last update (ATen's
  /// `_amp_update_scale_`): backoff after any inf/NaN, growth after
  /// growth_interval finite steps. With `new_scale`, sets it instead.
  void update(std::optional<double> new_scale = std::nullopt);

  /// The current scale (the init scale before the first scale() call; 1.0 when disabled).
  double get_scale() const;
  /// Finite steps in a row since the scale last changed.
  int64_t growth_tracker() const;
  /// True if enabled.
  bool is_enabled() const { return options_.enabled(); }
  /// The scaler's own tensors that live from its first scale() on: the scale
  /// (a float32 scalar) and the growth tracker (an int32 scalar); empty
  /// before the first scale() and when disabled. A prediction of a step
  /// that uses the scaler counts them (plan_regions with
  /// RegionModel::grad_scaler).
  std::vector<at::Tensor> tensors() const;

  /// The state to save (PyTorch's state_dict keys).
  GradScalerState state_dict() const;
  /// Restores a saved state. Throws if the scale is not positive and finite.
  void load_state_dict(const GradScalerState& state);
  /// Writes the state into `archive` under "scale", "growth_factor",
  /// "backoff_factor", "growth_interval", "_growth_tracker".
  void save(torch::serialize::OutputArchive& archive) const;
  /// Reads what save() wrote.
  void load(torch::serialize::InputArchive& archive);

 private:
  struct PerOptimizer {
    bool unscaled = false;
    bool stepped = false;
    at::Tensor found_inf;  ///< float scalar on the scale's device: > 0 if inf/NaN seen
  };
  PerOptimizer& state_for(torch::optim::Optimizer& optimizer);

  GradScalerOptions options_;
  at::Tensor scale_;           ///< float32 scalar, lazily on the loss's device
  at::Tensor growth_tracker_;  ///< int32 scalar
  double init_scale_;
  int64_t init_growth_tracker_ = 0;
  std::unordered_map<const torch::optim::Optimizer*, PerOptimizer> per_optimizer_;
};

} // namespace trainmem
