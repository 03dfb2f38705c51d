// The step the predictions run (predict_step_peak and predict_cuda_step_peak
// on meta, measure_step_peak on CPU), and the meta copies of a checkpoint's
// RNG states. Plan layer; not installed.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "core/detail/checkpoint_state.h"
#include "detail/optimizer_state.h"

namespace trainmem::detail {

// Where a step is, in order. A caller's mark sees each point of each step
// (the warm-up step's too).
enum class StepPoint {
  kBegin,          // before the gradients are set to none
  kForward,        // gradients none; loss_fn() is next
  kBackward,       // loss_fn() returned; backward is next
  kOptimizerStep,  // backward done and the loss freed; optimizer->step() is next
  kEnd,            // the step is done
};

using StepMark = std::function<void(int step, StepPoint point)>;

struct StepOptions {
  const char* who = "step";   // names the caller in errors
  bool on_meta = true;        // backward with BackwardOnMeta, the loss a meta tensor; else loss.backward()
  bool first_step = false;    // with an optimizer: the first step alone, without a warm-up step
  bool forward_only = false;  // one step that stops after the forward (all points marked there)
  // On meta: whose autocast applies when both CUDA's and the CPU's are
  // enabled (Note [Autocast on meta]); the prediction's device.
  c10::DeviceType autocast_device = c10::kCPU;
};

// Note [A step twice with an optimizer]
// A prediction (or measurement) runs the user's step: every parameter's
// gradient to none (and the optimizer's zero_grad()), loss_fn(), backward,
// optimizer->step(). With an optimizer it runs it twice, and the second step
// is the one that counts: the first makes the optimizer's state (AdamW's
// exp_avg and exp_avg_sq), which every later step starts with; the first
// step alone (first_step) is what a fresh optimizer's first step costs.
// `mark` is told of each point of each step (StepPoint); a counter opens its
// phase windows there, a trace notes its event index. Returns the forward's
// output with forward_only (the trace keeps it alive past its end), else an
// undefined tensor.
at::Tensor run_steps(torch::nn::Module& module, const std::function<at::Tensor()>& loss_fn,
                     torch::optim::Optimizer* optimizer, const StepOptions& options, const StepMark& mark);

// run_steps() on meta (options.on_meta set): the one meta-step engine of
// predict_step_peak and predict_cuda_step_peak.
at::Tensor run_meta_step(torch::nn::Module& module, const std::function<at::Tensor()>& loss_fn,
                         torch::optim::Optimizer* optimizer, StepOptions options, const StepMark& mark);

// A step function's arguments checked (predict_step_function,
// measure_step_function, predict_cuda_step_function): throws naming `who` and
// the bad value for an empty step, no module, a null module or optimizer, or
// warmup_steps < 0.
void check_step_function_args(const std::vector<torch::nn::Module*>& modules,
                              const std::vector<torch::optim::Optimizer*>& optimizers,
                              const std::function<void()>& step, int64_t warmup_steps, const char* who);

// Note [Predictions leave no trace], for a step function's modules and
// optimizers: each module's gradients and buffers, each optimizer's state.
struct StepFunctionStateGuard {
  StepFunctionStateGuard(const std::vector<torch::nn::Module*>& modules,
                         const std::vector<torch::optim::Optimizer*>& optimizers);
  std::vector<std::unique_ptr<StepStateGuard>> modules_;
  std::vector<std::unique_ptr<OptimizerStateAside>> states_;
};

// Note [Checkpoint RNG copies on meta]
// A checkpoint that preserves RNG state keeps CPU copies of generator states
// (Note [Checkpoint RNG copies] in checkpoint_state.h): its stash, from the
// forward until the region's backward is done (5,056 B per checkpointed
// region with LibTorch's mt19937 CPU generator), and while the region is
// recomputed, the fork's copy of the current state (5,056 B). They are CPU
// tensors even on meta, so a meta count misses them. This observer holds a
// meta tensor of each copy's bytes for as long as the checkpoint keeps the
// copy. predict_step_peak sees both (a real CPU run keeps them); the region
// profiler sees only the fork, for the planner adds each checkpointed
// region's stash on its own (Note [Checkpoint planner]).
class MetaRngCopies final : public RngCopyObserver {
 public:
  MetaRngCopies(bool stash, bool fork) : stash_(stash), fork_(fork) {}
  std::shared_ptr<void> hold(RngCopy copy, int64_t bytes) override;

 private:
  bool stash_;
  bool fork_;
};

} // namespace trainmem::detail
