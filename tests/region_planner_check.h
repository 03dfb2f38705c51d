// Checks shared by the region planner's tests (region_planner_test.cpp,
// region_planner_conv_test.cpp): a model planned on meta, then run on CPU
// under each plan, measured and compared.
#pragma once
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "trainmem/allocator.h"
#include "trainmem/planner.h"

namespace trainmem::testing {

using trainmem::PlanOptions;
using trainmem::RegionModel;

// The gradients of the parameters that require one (a frozen parameter has
// none: style transfer's features).
inline std::vector<at::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<at::Tensor> g;
  for (const auto& p : m.parameters()) {
    if (!p.requires_grad()) continue;
    g.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  }
  return g;
}

// One step's gradients under `plan` (forward, loss, backward; no optimizer),
// from the same parameters and the same random state each time (dropout
// draws the same masks; a checkpoint replays them in its recompute).
inline std::vector<at::Tensor> grads_under(torch::nn::Module& module, const RegionModel& m, const at::Tensor& x,
                                           const trainmem::BlockCheckpointing& plan) {
  for (auto& p : module.parameters()) p.mutable_grad().reset();
  at::manual_seed(1234);
  m.loss(trainmem::run_regions(m.regions, x, plan)).backward();
  auto g = grads_of(module);
  for (auto& p : module.parameters()) p.mutable_grad().reset();
  return g;
}

inline void expect_equal_grads(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                               const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    // A parameter no loss reaches has no gradient in either run.
    ASSERT_EQ(a[i].defined(), b[i].defined()) << what << ": gradient " << i;
    if (!a[i].defined()) {
      continue;
    }
    EXPECT_TRUE(at::equal(a[i], b[i])) << what << ": gradient " << i << " differs by "
                                       << (a[i] - b[i]).abs().max().item<double>();
  }
}

inline double rel_err(int64_t predicted, int64_t measured) {
  return static_cast<double>(predicted - measured) / static_cast<double>(measured);
}

// Plans `m` without a budget, with the smallest reachable peak, and with a
// budget halfway; runs each on CPU and checks bytes, peak and gradients.
// `module` owns every parameter of the regions; `opt` is the optimizer in
// `m` (or null). The predicted peak is within 0.5 % of the measured one, and
// a plan made for a budget (other than the smallest peak's) stays within it.
// `whole_block_variants`: also compare the gradients of full(n) and
// segments(n, 2) checkpointing (false where those cannot run: a region that
// starts in place, see region_planner_inplace_test.cpp).
inline void check_model(const std::string& name, torch::nn::Module& module, RegionModel& m,
                        torch::optim::Optimizer* opt, bool whole_block_variants = true) {
  constexpr double peak_tolerance = 0.005;
  trainmem::CpuMemoryTracker::install();
  const auto x = m.input(at::kCPU);
  const auto n = static_cast<int64_t>(m.regions.size());
  const auto free_plan = trainmem::plan_regions(m);
  ASSERT_TRUE(free_plan.feasible) << name;
  // Without a budget nothing is recomputed: the plan stores every region, or
  // caches all a selective region needs when that lowers the peak at no
  // recompute (an LSTM's oneDNN layers, whose order of frees in backward
  // then differs), never above the plain run's peak.
  EXPECT_EQ(free_plan.recompute_cost, 0.0) << name << "\n" << to_string(free_plan);
  const auto stored = trainmem::plan_regions(m, PlanOptions().selective(false));
  EXPECT_EQ(stored.name, "none") << name;
  EXPECT_LE(free_plan.predicted_peak_bytes, stored.predicted_peak_bytes) << name;
  const int64_t mid = (free_plan.predicted_peak_bytes + free_plan.min_peak_bytes) / 2;
  const auto mid_plan = trainmem::plan_regions(m, PlanOptions().budget_bytes(mid));
  const auto min_plan = trainmem::plan_regions(m, PlanOptions().budget_bytes(free_plan.min_peak_bytes));
  ASSERT_TRUE(mid_plan.feasible) << name;
  ASSERT_TRUE(min_plan.feasible) << name;
  EXPECT_LE(mid_plan.predicted_peak_bytes, mid) << name;
  for (const auto* plan : {&free_plan, &mid_plan, &min_plan}) {
    const auto checkpointing = plan->checkpointing();
    // Gradients first: the measured steps below move the parameters.
    expect_equal_grads(grads_under(module, m, x, trainmem::BlockCheckpointing::none(n)),
                       grads_under(module, m, x, checkpointing), name + " " + plan->name);
    const auto measured = trainmem::measure_step_peak(module, [&] {
      return m.loss(trainmem::run_regions(m.regions, x.clone(), checkpointing));
    }, opt);
    const double err = rel_err(plan->predicted_peak_bytes, measured.peak_bytes);
    std::cout << name << " '" << plan->name << "' (budget " << plan->budget_bytes << " B): predicted "
              << plan->predicted_peak_bytes << " B (" << to_string(plan->peak_phase) << "), measured "
              << measured.peak_bytes << " B (" << to_string(measured.phase) << "), error " << 100.0 * err
              << " %; saved " << plan->activation_bytes << " / " << measured.activation_bytes << " B\n";
    EXPECT_EQ(plan->activation_bytes, measured.activation_bytes) << name << " " << plan->name;
    EXPECT_LT(std::abs(err), peak_tolerance) << name << " " << plan->name << "\n" << to_string(*plan);
    if (plan->budget_bytes > 0 && plan != &min_plan) {
      EXPECT_LE(measured.peak_bytes, plan->budget_bytes) << name << " " << plan->name;
    }
  }
  if (!whole_block_variants) {
    return;
  }
  // Whole-block variants too.
  const auto plain = grads_under(module, m, x, trainmem::BlockCheckpointing::none(n));
  expect_equal_grads(plain, grads_under(module, m, x, trainmem::BlockCheckpointing::full(n)), name + " full");
  if (n >= 2) {
    expect_equal_grads(plain, grads_under(module, m, x, trainmem::BlockCheckpointing::segments(n, 2)),
                       name + " segments_2");
  }
}

} // namespace trainmem::testing
