// RecipeStep: a planned step with a GradScaler or fp32 master weights, and
// that step run whole on meta (Note [Planned steps with a scaler or master
// weights]).
#include "trainmem/planner.h"

#include <algorithm>
#include <functional>
#include <vector>

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "plan/detail/plan_internal.h"

namespace trainmem::detail {

// Note [Planned steps with a scaler or master weights]
// A step with fp16 autocast runs a GradScaler (grad_scaler.h): the loss
// scaled, backward, the gradients unscaled and checked for inf/NaN, the
// step, the scale updated. A bf16 model trained with fp32 master weights
// (master_weights.h; Note [bf16 weights with fp32 master weights]) runs
// backward in bf16, then MasterWeights::step: each bf16 gradient converted
// into its master's fp32 gradient and freed, the optimizer's step on the
// masters, the masters copied back. Neither is the planner's backward and
// optimizer step, so with RegionModel::grad_scaler or master_weights:
// - the static terms of the search (Note [Checkpoint planner]) are the
//   recipe's: the scaler's scale and growth tracker, or the masters and the
//   optimizer's state over them, beside the state; the optimizer phase's
//   transient is the recipe's whole step after backward (unscale_, step,
//   update; or the masters' step), profiled on meta;
// - every plan is then weighed by its whole step on meta, run as the
//   recipe runs it (RecipeStep, predicted as predict_step_function does:
//   a warm-up step, then the measured one, its forward, backward and
//   optimizer windows read from the meta allocator), as Note [Regions with
//   several tensors] does for regions that carry tensors: the plan reports
//   that step's peak and phase, and a plan within the budget is one whose
//   whole step is (the search's limit lowered by the excess, at most 4
//   rounds). The composition differs from it by the scaled loss and the
//   scaler's temporaries (a few bytes), and by the cast cache where a
//   weight is used by two regions;
// - the scaler's own tensors, made by the warm-up step and live through the
//   measured one, count in its peak (predict_step_function leaves them out
//   of its start: they are no module's or optimizer's), as do unscale_'s
//   found-inf flag and inverse scale inside the step. The forward returns
//   the loss alone, so the last region's output is freed before backward
//   where the loss keeps none of it. The fp16 step keeps
//   the loss to its end and frees the scaled loss after backward; the
//   master step frees the loss after backward, with or without a scaler
//   (fp16 weights: MasterWeights::step with the scaler unscaling the
//   masters' gradients): estimate_model's steps
//   (Note [fp16 autocast as a step function]), so `plan --model` and
//   `estimate --model` predict the same step.
// plan_regions_cuda predicts the same step on CUDA
// (predict_cuda_step_function). Where the whole step has no meta path, the
// plan throws rather than report a composition without these bytes.
RecipeStep::RecipeStep(const RegionModel& model, const std::vector<at::Tensor>& params, const char* who) {
  if (model.grad_scaler) {
    scaler_.emplace(*model.grad_scaler);
  }
  if (model.master_weights) {
    TORCH_CHECK(model.optimizer == nullptr && static_cast<bool>(model.make_optimizer), who,
                ": RegionModel::master_weights needs make_optimizer (called with the masters' optimized() "
                "tensors), not an optimizer over the model's own parameters");
    std::vector<at::Tensor> trainable;
    for (const auto& p : params) {
      if (p.requires_grad()) {
        trainable.push_back(p);
      }
    }
    masters_.emplace(trainable);
    made_ = model.make_optimizer((*masters_)->optimized());
  } else if (model.optimizer != nullptr) {
    opt_ = model.optimizer;
  } else if (model.make_optimizer) {
    made_ = model.make_optimizer(params);
  }
  if (made_) {
    opt_ = made_.get();
  }
  TORCH_CHECK(opt_ != nullptr, who, ": RegionModel::", model.master_weights ? "make_optimizer returned null"
              : "grad_scaler needs an optimizer (RegionModel::optimizer or make_optimizer) for the scaler to step");
}

void RecipeStep::run(const std::vector<torch::nn::Module*>& modules, const std::function<at::Tensor()>& forward,
                     const std::function<void(StepPoint)>& mark) {
  const auto at = [&](StepPoint point) {
    if (mark) {
      mark(point);
    }
  };
  at(StepPoint::kBegin);
  for (auto* m : modules) {
    for (auto& p : m->parameters()) {
      p.mutable_grad().reset();
    }
  }
  at::Tensor loss = forward();
  if (scaler_) {
    at::Tensor scaled = scaler_->scale(loss);
    at(StepPoint::kBackward);
    scaled.backward();
    scaled.reset();
    if (masters_) {
      loss.reset();  // fp16 masters: the loss freed after backward, as the bf16 master step frees it
    }
  } else {
    at(StepPoint::kBackward);
    loss.backward();
    loss.reset();
  }
  at(StepPoint::kOptimizerStep);
  optimizer_step();
  at(StepPoint::kEnd);
}

void RecipeStep::optimizer_step() {
  if (scaler_ && masters_) {
    (void)(*masters_)->step(*opt_, *scaler_);
  } else if (scaler_) {
    scaler_->unscale_(*opt_);
    scaler_->step(*opt_);
    scaler_->update();
  } else if (masters_) {
    (*masters_)->step(*opt_);
  } else {
    opt_->step();
  }
}

void RecipeStep::prime(c10::Device device) {
  if (scaler_ && scaler_->tensors().empty()) {
    (void)scaler_->scale(at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device)));
  }
}

int64_t RecipeStep::scaler_bytes() const {
  int64_t bytes = 0;
  if (scaler_) {
    for (const auto& t : scaler_->tensors()) {
      bytes += storage_bytes(t);
    }
  }
  return bytes;
}

// The whole step with its scaler or masters on meta (Note [Planned steps
// with a scaler or master weights]): a warm-up step, then the measured one,
// as predict_step_function runs them, its phase windows read from the meta
// allocator; the scaler's own tensors counted.
StepPeak recipe_step_on_meta(const RegionModel& model, torch::nn::Module& all, const std::vector<at::Tensor>& params,
                             const std::function<at::Tensor()>& forward) {
  RecipeStep recipe(model, params, "plan_regions");
  std::vector<torch::nn::Module*> modules = {&all};
  if (recipe.masters() != nullptr) {
    modules.push_back(recipe.masters());
  }
  auto& meta = MetaAllocator::get();
  int calls = 0;
  int64_t start_live = 0;
  StepPeak r;
  const auto mark = [&](StepPoint point) {
    if (calls != 2) {
      return;  // the warm-up step
    }
    switch (point) {
      case StepPoint::kBegin:
        start_live = meta.live_bytes();
        break;
      case StepPoint::kBackward:
        r.forward_peak_bytes = meta.peak_bytes() - start_live;
        meta.reset_peak();
        break;
      case StepPoint::kOptimizerStep:
        r.backward_peak_bytes = meta.peak_bytes() - start_live;
        meta.reset_peak();
        break;
      case StepPoint::kEnd:
        r.optimizer_peak_bytes = meta.peak_bytes() - start_live;
        break;
      default:
        break;
    }
  };
  const auto f = predict_step_function_locked(modules, {&recipe.optimizer()}, [&] {
    ++calls;
    recipe.run(modules, forward, mark);
  }, /*warmup_steps=*/1);
  TORCH_CHECK(calls == 2, "plan_regions: the step ran ", calls, " times; expected a warm-up and a measured one");
  const int64_t base = f.start_bytes + recipe.scaler_bytes();
  r.forward_peak_bytes += base;
  r.backward_peak_bytes += base;
  r.optimizer_peak_bytes += base;
  r.peak_bytes = std::max({r.forward_peak_bytes, r.backward_peak_bytes, r.optimizer_peak_bytes});
  r.phase = r.peak_bytes == r.backward_peak_bytes  ? StepPhase::kBackward
            : r.peak_bytes == r.forward_peak_bytes ? StepPhase::kForward
                                                   : StepPhase::kOptimizerStep;
  r.param_bytes = f.param_bytes;
  r.buffer_bytes = f.buffer_bytes;
  r.optimizer_state_bytes = f.optimizer_state_bytes;
  r.grad_bytes = -1;
  r.transient_bytes = -1;
  r.scalar_reads = f.scalar_reads;
  return r;
}

} // namespace trainmem::detail
