// The capstone's training step (forward, backward, AdamW step) plain, metered,
// and under each checkpointing variant. Reported as ratios to the plain step
// in docs/benchmarks.md; never asserted in tests.
#include <benchmark/benchmark.h>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include "trainmem/allocator.h"
#include "trainmem/meter.h"
#include "trainmem/offload.h"
#include "trainmem/selective.h"
#include "trainmem/models/transformer.h"
#include "app/variants.h"

namespace {

using trainmem::kReferenceBatch;
using trainmem::kReferenceSeqLen;

struct Capstone {
  Capstone() { torch::manual_seed(0); }
  trainmem::TransformerOptions options;
  trainmem::Transformer model{options};
  torch::optim::AdamW opt{model->parameters(), torch::optim::AdamWOptions(1e-3)};
  at::Tensor x = torch::randn({kReferenceBatch, kReferenceSeqLen, options.d_model()});

  void step(const trainmem::BlockCheckpointing& plan, trainmem::SavedTensorMeter* meter) {
    opt.zero_grad();
    at::Tensor loss;
    if (meter != nullptr) {
      trainmem::SavedTensorMeterGuard scope(*meter);
      loss = model->forward(x, plan).pow(2).mean();
    } else {
      loss = model->forward(x, plan).pow(2).mean();
    }
    loss.backward();
    opt.step();
  }
};

trainmem::BlockCheckpointing variant(int64_t i, int64_t L) {
  switch (i) {
    case 1: return trainmem::BlockCheckpointing::full(L);
    case 2: return trainmem::BlockCheckpointing::every(L, 2);
    case 3: return trainmem::BlockCheckpointing::selective(L, trainmem::save_matmuls_policy());
    default: return trainmem::BlockCheckpointing::none(L);
  }
}

// Arg: 0 none (the plain step), 1 full, 2 every_2, 3 selective (save matmuls).
void BM_CapstoneStep(benchmark::State& state) {
  Capstone c;
  const auto plan = variant(state.range(0), c.options.num_layers());
  state.SetLabel(plan.name);
  for (auto _ : state) {
    c.step(plan, nullptr);
  }
}
BENCHMARK(BM_CapstoneStep)->DenseRange(0, 3)->Unit(benchmark::kMillisecond)->MinTime(2.0);

void BM_CapstoneStepMetered(benchmark::State& state) {
  Capstone c;
  const auto plan = variant(0, c.options.num_layers());
  trainmem::SavedTensorMeter meter(*c.model);
  state.SetLabel("none, metered");
  for (auto _ : state) {
    c.step(plan, &meter);
    meter.reset();
  }
}
BENCHMARK(BM_CapstoneStepMetered)->Unit(benchmark::kMillisecond)->MinTime(2.0);

} // namespace

namespace {

// Registered last: the counting allocator, once installed, stays for the
// rest of the process, so every benchmark above ran without it.
void BM_CapstoneStepTracked(benchmark::State& state) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  Capstone c;
  const auto plan = variant(0, c.options.num_layers());
  state.SetLabel("none, CPU allocator counted");
  for (auto _ : state) {
    trainmem::PeakWindow window(tracker);
    c.step(plan, nullptr);
    benchmark::DoNotOptimize(window.peak_bytes());
  }
}
BENCHMARK(BM_CapstoneStepTracked)->Unit(benchmark::kMillisecond)->MinTime(2.0);

} // namespace

namespace {

// Save-on-CPU on the capstone. On a CPU-only machine the guard copies nothing
// (arg 0: its bookkeeping cost alone); arg 1 forces the copy path
// (copy_cpu_tensors), i.e. every saved activation crosses memory twice.
void BM_CapstoneStepOffload(benchmark::State& state) {
  Capstone c;
  const bool copy = state.range(0) != 0;
  state.SetLabel(copy ? "none, save-on-CPU, copies forced" : "none, save-on-CPU (no-op on CPU)");
  const auto options = trainmem::SaveOnCpuOptions().copy_cpu_tensors(copy);
  for (auto _ : state) {
    c.opt.zero_grad();
    at::Tensor loss;
    {
      trainmem::SaveOnCpuGuard offload(*c.model, options);
      loss = c.model->forward(c.x).pow(2).mean();
    }
    loss.backward();
    c.opt.step();
  }
}
BENCHMARK(BM_CapstoneStepOffload)->DenseRange(0, 1)->Unit(benchmark::kMillisecond)->MinTime(2.0);

} // namespace
