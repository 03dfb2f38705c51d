#pragma once

#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

namespace trainmem::detail {

// Sets an optimizer's state aside for the guard's lifetime (an empty state
// meanwhile) and puts it back, also when an exception leaves: what a planning
// or prediction step makes in it is dropped. plan_regions and
// plan_regions_cuda step the user's optimizer this way.
class OptimizerStateAside {
 public:
  explicit OptimizerStateAside(torch::optim::Optimizer& opt) : state_(opt.state()) { std::swap(saved_, state_); }
  ~OptimizerStateAside() { std::swap(saved_, state_); }
  OptimizerStateAside(const OptimizerStateAside&) = delete;
  OptimizerStateAside& operator=(const OptimizerStateAside&) = delete;

 private:
  decltype(std::declval<torch::optim::Optimizer&>().state()) state_;
  std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())> saved_;
};

// Note [Predictions leave no trace]
// A prediction runs a step of the user's own module and optimizer on meta.
// It must leave them as it found them: a meta exp_avg left in the
// optimizer's state, or a meta .grad kept by materialize(), makes the next
// real step fail ("Expected all tensors to be on the same device, but found
// at least two devices, meta and cpu"). For its lifetime this guard sets the
// optimizer's state aside, and on exit puts back every parameter's gradient
// (the tensor it had, or none) and every buffer's values (BatchNorm's running
// statistics and num_batches_tracked; real devices only: meta holds none).
class StepStateGuard {
 public:
  StepStateGuard(torch::nn::Module& module, torch::optim::Optimizer* optimizer) {
    if (optimizer != nullptr) {
      state_.emplace(*optimizer);
    }
    for (const auto& p : module.parameters(/*recurse=*/true)) {
      grads_.emplace_back(p, p.grad());
    }
    for (const auto& b : module.buffers(/*recurse=*/true)) {
      if (b.defined() && !b.is_meta()) {
        buffers_.emplace_back(b, b.clone());
      }
    }
  }
  ~StepStateGuard() {
    try {
      at::NoGradGuard no_grad;
      for (auto& [p, g] : grads_) {
        p.mutable_grad() = g;
      }
      for (auto& [b, copy] : buffers_) {
        b.copy_(copy);
      }
    } catch (...) {
      // a destructor must not throw; what could not be restored stays
    }
  }
  StepStateGuard(const StepStateGuard&) = delete;
  StepStateGuard& operator=(const StepStateGuard&) = delete;

 private:
  std::optional<OptimizerStateAside> state_;
  std::vector<std::pair<at::Tensor, at::Tensor>> grads_;    // parameter, its gradient before
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers_;  // buffer, its values before
};

} // namespace trainmem::detail
