#include "trainmem/grad_scaler.h"

#include <cmath>
#include <map>
#include <tuple>

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>
#include <ATen/ops/full.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

namespace trainmem {

// Note [GradScaler as torch.amp.GradScaler]
// Each method follows torch/amp/grad_scaler.py line by line so that the same
// weights, losses and overflows give the same scales, the same skipped steps
// and bit-identical parameters (tests/grad_scaler_test.cpp checks this
// against the Python class): the scale is a float32 scalar tensor and the
// growth tracker an int32 one on the loss's device; unscaling multiplies by
// `scale.double().reciprocal().float()`; gradients are grouped by device and
// dtype, one `_amp_foreach_non_finite_check_and_unscale_` per group, each
// device with its own copy of found_inf; update() adds the optimizers'
// found_inf and calls `_amp_update_scale_`.

GradScaler::GradScaler(GradScalerOptions options) : options_(options), init_scale_(options.init_scale()) {
  TORCH_CHECK(options_.init_scale() > 0 && std::isfinite(options_.init_scale()),
              "GradScaler: expected init_scale > 0 and finite, but got ", options_.init_scale());
  TORCH_CHECK(options_.growth_factor() > 1.0, "GradScaler: expected growth_factor > 1, but got ",
              options_.growth_factor());
  TORCH_CHECK(options_.backoff_factor() < 1.0 && options_.backoff_factor() > 0.0,
              "GradScaler: expected 0 < backoff_factor < 1, but got ", options_.backoff_factor());
  TORCH_CHECK(options_.growth_interval() > 0, "GradScaler: expected growth_interval > 0, but got ",
              options_.growth_interval());
}

at::Tensor GradScaler::scale(const at::Tensor& loss) {
  TORCH_CHECK(loss.defined(), "GradScaler::scale: the loss is undefined");
  if (!options_.enabled()) {
    return loss;
  }
  TORCH_CHECK(loss.is_floating_point(), "GradScaler::scale: expected a floating-point loss, but got ",
              loss.scalar_type());
  if (!scale_.defined()) {
    scale_ = at::full({}, init_scale_, loss.options().dtype(at::kFloat));
    growth_tracker_ = at::full({}, init_growth_tracker_, loss.options().dtype(at::kInt));
  }
  return loss * scale_.to(loss.device());
}

std::vector<at::Tensor> GradScaler::tensors() const {
  if (!scale_.defined()) {
    return {};
  }
  return {scale_, growth_tracker_};
}

GradScaler::PerOptimizer& GradScaler::state_for(torch::optim::Optimizer& optimizer) {
  return per_optimizer_[&optimizer];
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    return;
  }
  TORCH_CHECK(scale_.defined(), "GradScaler::unscale_: there is no scale yet; call scale(loss) earlier in the ",
              "iteration");
  auto& st = state_for(optimizer);
  TORCH_CHECK(!st.unscaled, "GradScaler::unscale_: unscale_() has already been called on this optimizer since ",
              "the last update()");
  TORCH_CHECK(!st.stepped, "GradScaler::unscale_: unscale_() is being called after step()");
  const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  const at::Tensor found_inf = at::full({}, 0.0, scale_.options().dtype(at::kFloat));
  std::map<std::tuple<c10::DeviceType, c10::DeviceIndex, c10::ScalarType>, std::vector<at::Tensor>> groups;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      const at::Tensor& g = p.grad();
      if (!g.defined()) {
        continue;
      }
      TORCH_CHECK(g.scalar_type() != at::kHalf, "GradScaler::unscale_: attempting to unscale FP16 gradients ",
                  "(keep the parameters in fp32 and let autocast cast them)");
      TORCH_CHECK(!g.is_sparse(), "GradScaler::unscale_: sparse gradients are not supported");
      groups[{g.device().type(), g.device().index(), g.scalar_type()}].push_back(g);
    }
  }
  std::map<std::pair<c10::DeviceType, c10::DeviceIndex>, at::Tensor> per_device_found_inf;
  std::map<std::pair<c10::DeviceType, c10::DeviceIndex>, at::Tensor> per_device_inv_scale;
  for (auto& [key, grads] : groups) {
    const std::pair<c10::DeviceType, c10::DeviceIndex> dev{std::get<0>(key), std::get<1>(key)};
    const c10::Device device(dev.first, dev.second);
    if (per_device_found_inf.count(dev) == 0) {
      per_device_found_inf[dev] = found_inf.to(found_inf.options().device(device), /*non_blocking=*/false, /*copy=*/true);
      per_device_inv_scale[dev] = inv_scale.to(inv_scale.options().device(device), /*non_blocking=*/false, /*copy=*/true);
    }
    at::_amp_foreach_non_finite_check_and_unscale_(grads, per_device_found_inf[dev], per_device_inv_scale[dev]);
  }
  // One found_inf per optimizer, on the scale's device: the sum over devices.
  at::Tensor combined;
  for (auto& [dev, f] : per_device_found_inf) {
    combined = combined.defined() ? combined + f.to(scale_.device()) : f.to(scale_.device());
  }
  st.found_inf = combined;  // undefined when no parameter had a gradient
  st.unscaled = true;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  TORCH_CHECK(scale_.defined(), "GradScaler::step: there is no scale yet; call scale(loss) earlier in the ",
              "iteration");
  auto& st = state_for(optimizer);
  TORCH_CHECK(!st.stepped, "GradScaler::step: step() has already been called since the last update()");
  if (!st.unscaled) {
    unscale_(optimizer);
  }
  TORCH_CHECK(st.found_inf.defined(), "GradScaler::step: no inf checks were recorded for this optimizer ",
              "(no parameter has a gradient)");
  bool stepped = false;
  // On meta (a prediction) found_inf holds no value: the step is taken, as
  // every step without inf/NaN is.
  if (st.found_inf.is_meta() || st.found_inf.item<float>() == 0.0f) {
    optimizer.step();
    stepped = true;
  }
  st.stepped = true;
  return stepped;
}

bool GradScaler::step(OptimizerInBackward& /*optimizer*/) {
  TORCH_CHECK(false, "GradScaler::step: an OptimizerInBackward steps inside backward, before the scaler can ",
              "unscale its gradients or skip a step with inf/NaN; use a plain optimizer with GradScaler, or ",
              "bf16 autocast, which needs no loss scaling");
  return false;
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!options_.enabled()) {
    return;
  }
  TORCH_CHECK(scale_.defined(), "GradScaler::update: there is no scale yet; call scale(loss) earlier in the ",
              "iteration");
  if (new_scale.has_value()) {
    TORCH_CHECK(*new_scale > 0 && std::isfinite(*new_scale), "GradScaler::update: expected a new scale > 0 and ",
                "finite, but got ", *new_scale);
    scale_.fill_(*new_scale);
  } else {
    at::Tensor combined;
    for (auto& [opt, st] : per_optimizer_) {
      if (!st.found_inf.defined()) {
        continue;
      }
      if (combined.defined()) {
        combined.add_(st.found_inf);
      } else {
        combined = st.found_inf;
      }
    }
    TORCH_CHECK(combined.defined(), "GradScaler::update: no inf checks were recorded prior to update() ",
                "(call unscale_() or step() first)");
    at::_amp_update_scale_(scale_, growth_tracker_, combined, options_.growth_factor(),
                           options_.backoff_factor(), options_.growth_interval());
  }
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled()) {
    return 1.0;
  }
  return scale_.defined() ? static_cast<double>(scale_.item<float>()) : init_scale_;
}

int64_t GradScaler::growth_tracker() const {
  return growth_tracker_.defined() ? static_cast<int64_t>(growth_tracker_.item<int32_t>()) : init_growth_tracker_;
}

GradScalerState GradScaler::state_dict() const {
  GradScalerState s;
  s.scale = get_scale();
  s.growth_factor = options_.growth_factor();
  s.backoff_factor = options_.backoff_factor();
  s.growth_interval = options_.growth_interval();
  s.growth_tracker = growth_tracker();
  return s;
}

void GradScaler::load_state_dict(const GradScalerState& s) {
  TORCH_CHECK(s.scale > 0 && std::isfinite(s.scale), "GradScaler::load_state_dict: expected a scale > 0 and ",
              "finite, but got ", s.scale);
  TORCH_CHECK(s.growth_interval > 0, "GradScaler::load_state_dict: expected growth_interval > 0, but got ",
              s.growth_interval);
  init_scale_ = s.scale;
  if (scale_.defined()) {
    scale_.fill_(s.scale);
  }
  options_.growth_factor(s.growth_factor).backoff_factor(s.backoff_factor).growth_interval(s.growth_interval);
  init_growth_tracker_ = s.growth_tracker;
  if (growth_tracker_.defined()) {
    growth_tracker_.fill_(s.growth_tracker);
  }
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  const auto s = state_dict();
  archive.write("scale", c10::IValue(s.scale));
  archive.write("growth_factor", c10::IValue(s.growth_factor));
  archive.write("backoff_factor", c10::IValue(s.backoff_factor));
  archive.write("growth_interval", c10::IValue(s.growth_interval));
  archive.write("_growth_tracker", c10::IValue(s.growth_tracker));
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  GradScalerState s;
  c10::IValue v;
  archive.read("scale", v);
  s.scale = v.toDouble();
  archive.read("growth_factor", v);
  s.growth_factor = v.toDouble();
  archive.read("backoff_factor", v);
  s.backoff_factor = v.toDouble();
  archive.read("growth_interval", v);
  s.growth_interval = v.toInt();
  archive.read("_growth_tracker", v);
  s.growth_tracker = v.toInt();
  load_state_dict(s);
}

} // namespace trainmem
