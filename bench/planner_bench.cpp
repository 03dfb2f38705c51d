// What plan_checkpointing() (the region planner on the reference transformer)
// costs as the model deepens: 6, 24, 96, 400 and 1,600 layers, without a
// budget and with 60 % of the unconstrained peak. Identical blocks share
// their profiles, so the cost is one block's profiling plus the dynamic
// program. Figures go to docs/benchmarks.md; never asserted in tests.
#include <benchmark/benchmark.h>

#include "trainmem/models/transformer_plan.h"
#include "trainmem/planner.h"
#include "trainmem/models/transformer.h"
#include "app/variants.h"

namespace {

using trainmem::kReferenceBatch;
using trainmem::kReferenceSeqLen;

void BM_PlanCheckpointing(benchmark::State& state) {
  const auto o = trainmem::TransformerOptions().num_layers(state.range(0));
  const bool budget = state.range(1) != 0;
  const int64_t peak = trainmem::plan_checkpointing(o, kReferenceBatch, kReferenceSeqLen).predicted_peak_bytes;
  const auto options = trainmem::PlanOptions().budget_bytes(budget ? peak * 6 / 10 : 0);
  trainmem::CheckpointPlan plan;
  for (auto _ : state) {
    plan = trainmem::plan_checkpointing(o, kReferenceBatch, kReferenceSeqLen, options);
    benchmark::DoNotOptimize(plan.predicted_peak_bytes);
  }
  state.counters["num_profiles"] = static_cast<double>(plan.num_profiles);
  state.counters["num_candidates"] = static_cast<double>(plan.num_candidates);
  state.counters["feasible"] = plan.feasible ? 1 : 0;
}
BENCHMARK(BM_PlanCheckpointing)
    ->ArgsProduct({{6, 24, 96, 400, 1600}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);

} // namespace
