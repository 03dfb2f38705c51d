// The capstone's training step (forward, backward, AdamW step) with and
// without trainmem's instruments. Reported as ratios in docs/benchmarks.md;
// never asserted in tests.
#include <benchmark/benchmark.h>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include "trainmem/meter.h"
#include "trainmem/transformer.h"

namespace {

struct Capstone {
  trainmem::TransformerOptions options;
  trainmem::Transformer model{options};
  torch::optim::AdamW opt{model->parameters(), torch::optim::AdamWOptions(1e-3)};
  at::Tensor x = torch::randn({options.batch(), options.seq_len(), options.d_model()});
};

void BM_CapstoneStep(benchmark::State& state) {
  torch::manual_seed(0);
  Capstone c;
  for (auto _ : state) {
    c.opt.zero_grad();
    c.model->forward(c.x).pow(2).mean().backward();
    c.opt.step();
  }
}
BENCHMARK(BM_CapstoneStep)->Unit(benchmark::kMillisecond)->MinTime(2.0);

void BM_CapstoneStepMetered(benchmark::State& state) {
  torch::manual_seed(0);
  Capstone c;
  trainmem::SavedTensorMeter meter(*c.model);
  for (auto _ : state) {
    c.opt.zero_grad();
    at::Tensor loss;
    {
      trainmem::SavedTensorMeterGuard scope(meter);
      loss = c.model->forward(c.x).pow(2).mean();
    }
    loss.backward();
    c.opt.step();
    meter.reset();
  }
}
BENCHMARK(BM_CapstoneStepMetered)->Unit(benchmark::kMillisecond)->MinTime(2.0);

} // namespace
