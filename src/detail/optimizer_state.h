#pragma once

#include <type_traits>
#include <utility>

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

} // namespace trainmem::detail
