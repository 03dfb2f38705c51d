// What autocast on meta (Note [Autocast on meta]) costs a prediction: the
// step peak of Qwen3-8B (tests/data/qwen3_8b.json, 1 x 2048 tokens, AdamW)
// predicted on meta in fp32 and under CPU bf16 autocast, the forward's ops
// then boxed and cast through LibTorch's autocast kernels. Figures go to
// docs/benchmarks.md; never asserted in tests.
#include <ATen/autocast_mode.h>
#include <benchmark/benchmark.h>
#include <torch/optim/adamw.h>

#include "trainmem/meta.h"
#include "trainmem/models/hf_model.h"
#include "trainmem/planner.h"

namespace {

void BM_PredictQwen3_8bStep(benchmark::State& state) {
  const bool amp = state.range(0) != 0;
  const auto config = trainmem::load_hf_config(TRAINMEM_BENCH_DATA_DIR "/qwen3_8b.json");
  trainmem::HfModel model;
  {
    trainmem::MetaInitGuard meta;
    model = trainmem::build_hf_model(config);
  }
  torch::optim::AdamW opt(model.module->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto tokens = at::empty({1, 2048}, at::TensorOptions().dtype(at::kLong).device(at::kMeta));
  auto loss = [&] {
    if (!amp) {
      return model.loss(tokens);
    }
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    auto l = model.loss(tokens);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    return l;
  };
  trainmem::StepPeak peak;
  for (auto _ : state) {
    peak = trainmem::predict_step_peak(*model.module, loss, &opt);
    benchmark::DoNotOptimize(peak.peak_bytes);
  }
  state.counters["peak_bytes"] = static_cast<double>(peak.peak_bytes);
  state.counters["activation_bytes"] = static_cast<double>(peak.activation_bytes);
}
BENCHMARK(BM_PredictQwen3_8bStep)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->Iterations(3);

} // namespace
