// trainmem_plan_scaling: what planning costs, in wall time, as the model
// grows. One JSON document on stdout (compare.py --planner prints it):
//
//   meta_70b  a GPT of LLaMA-2-70B's width and depth (gpt.h) built under
//             MetaInitGuard: construction time, parameters, bytes it would
//             need, and the process's CPU allocator traffic while building
//             (none: no storage is allocated).
//   planner   plan_checkpointing() on the reference transformer for 1 to 48
//             layers and sequence lengths 16 to 256, without a budget and
//             with a budget of 60 % of the unconstrained peak.
//
// Times are reported, never asserted.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "trainmem/allocator.h"
#include "trainmem/models/gpt.h"
#include "trainmem/meta.h"
#include "trainmem/models/transformer_plan.h"
#include "trainmem/planner.h"

namespace {

using nlohmann::json;

template <typename F>
double time_ms(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

json meta_70b() {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  const auto options = trainmem::GPTOptions::llama2_70b_shape();
  trainmem::GPT model{nullptr};
  const auto before = tracker.stats();
  const double ms = time_ms([&] {
    trainmem::MetaInitGuard meta;
    model = trainmem::GPT(options);
  });
  const auto after = tracker.stats();
  int64_t num_params = 0, param_bytes = 0, num_meta = 0, num_tensors = 0;
  for (const auto& p : model->parameters()) {
    num_params += p.numel();
    param_bytes += p.numel() * static_cast<int64_t>(p.element_size());
    num_meta += p.is_meta() ? 1 : 0;
    num_tensors += 1;
  }
  return {{"build_ms", ms},
          {"num_params", num_params},
          {"param_bytes", param_bytes},
          {"num_param_tensors", num_tensors},
          {"num_meta_param_tensors", num_meta},
          {"cpu_allocated_bytes_while_building", after.allocated_bytes - before.allocated_bytes},
          {"num_cpu_allocs_while_building", after.num_allocs - before.num_allocs}};
}

json plan_row(int64_t L, int64_t T) {
  const auto o = trainmem::TransformerOptions().num_layers(L);
  const int64_t B = 16;  // the capstone's batch
  trainmem::CheckpointPlan free_plan, tight_plan;
  const double free_ms = time_ms([&] { free_plan = trainmem::plan_checkpointing(o, B, T); });
  const int64_t budget = free_plan.predicted_peak_bytes * 6 / 10;
  const double tight_ms = time_ms([&] {
    tight_plan = trainmem::plan_checkpointing(o, B, T, trainmem::PlanOptions().budget_bytes(budget));
  });
  return {{"num_layers", L},
          {"seq_len", T},
          {"unconstrained_ms", free_ms},
          {"unconstrained_peak_bytes", free_plan.predicted_peak_bytes},
          {"budget_bytes", budget},
          {"budget_ms", tight_ms},
          {"budget_feasible", tight_plan.feasible},
          {"budget_plan", tight_plan.name},
          {"budget_peak_bytes", tight_plan.predicted_peak_bytes},
          {"num_candidates", tight_plan.num_candidates}};
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 1) {
    std::fprintf(stderr, "trainmem_plan_scaling: unexpected argument '%s' (it takes none)\n", argv[1]);
    return 2;
  }
  try {
    json doc;
    doc["meta_70b"] = meta_70b();
    json rows = json::array();
    for (int64_t L : {1, 2, 6, 12, 24, 48}) {
      rows.push_back(plan_row(L, 64));
    }
    for (int64_t T : {16, 32, 128, 256}) {
      rows.push_back(plan_row(6, T));
    }
    doc["planner"] = rows;
    std::cout << doc.dump() << "\n";
    return 0;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "trainmem_plan_scaling: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trainmem_plan_scaling: %s\n", e.what());
    return 1;
  }
}
