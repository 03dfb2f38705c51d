// What autocast on meta (Note [Autocast on meta]) costs a prediction: the
// step peak of Qwen3-8B (tests/data/qwen3_8b.json, 1 x 2048 tokens, AdamW)
// predicted on meta in fp32 and under CPU bf16 autocast, the forward's ops
// then boxed and cast through LibTorch's autocast kernels. Figures go to
// docs/benchmarks.md; never asserted in tests.
#include <ATen/autocast_mode.h>
#include <benchmark/benchmark.h>
#include <torch/optim/adamw.h>

#include "trainmem/meta.h"
#include "trainmem/models/estimate.h"
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

namespace {

// "Will it fit" for a fine-tune: estimate_model() (models/estimate.h) of
// Qwen3-8B at 1 x 2048 tokens under bf16 autocast with full checkpointing and
// LoRA r 16 on the attention projections, on the CPU's kernels and on CUDA
// (the H100's cuBLAS workspace). Arg: 0 CPU figures only, 1 with CUDA.
void BM_EstimateQwen3_8bLoraCheckpointed(benchmark::State& state) {
  const auto config = trainmem::load_hf_config(TRAINMEM_BENCH_DATA_DIR "/qwen3_8b.json");
  auto o = trainmem::ModelEstimateOptions()
               .batch(1)
               .seq_len(2048)
               .precision(trainmem::Precision::kBf16Autocast)
               .checkpoint("full")
               .lora(trainmem::LoraOptions().rank(16).alpha(32).targets({"q_proj", "k_proj", "v_proj", "o_proj"}));
  if (state.range(0) != 0) {
    o.cuda(trainmem::CudaPredictOptions().cublas_workspace_bytes(trainmem::kCublasWorkspaceHopperBytes));
  }
  trainmem::ModelEstimate e;
  for (auto _ : state) {
    e = trainmem::estimate_model(config, o);
    benchmark::DoNotOptimize(e.step_peak.peak_bytes);
  }
  state.counters["step_peak_bytes"] = static_cast<double>(e.step_peak.peak_bytes);
  if (e.cuda) {
    state.counters["cuda_reserved_bytes"] = static_cast<double>(e.cuda->max_memory_reserved_bytes);
  }
}
BENCHMARK(BM_EstimateQwen3_8bLoraCheckpointed)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->Iterations(2);

// A LLaMA-2-7B plan for a budget (1 x 4096 tokens, fp32 AdamW, 110 GiB):
// plan_regions() on model_regions(), on meta.
void BM_PlanLlama2_7bForABudget(benchmark::State& state) {
  const auto config = trainmem::load_hf_config(TRAINMEM_BENCH_DATA_DIR "/llama2_7b.json");
  const auto o = trainmem::ModelEstimateOptions().batch(1).seq_len(4096);
  trainmem::HfModel model;
  {
    trainmem::MetaInitGuard meta;
    model = trainmem::build_model(config, o);
  }
  auto m = trainmem::model_regions(model, o);
  torch::optim::AdamW opt(model.module->parameters(), torch::optim::AdamWOptions(1e-3));
  m.optimizer = &opt;
  trainmem::CheckpointPlan plan;
  for (auto _ : state) {
    plan = trainmem::plan_regions(m, trainmem::PlanOptions().budget_bytes(int64_t{110} << 30));
    benchmark::DoNotOptimize(plan.predicted_peak_bytes);
  }
  state.counters["predicted_peak_bytes"] = static_cast<double>(plan.predicted_peak_bytes);
  state.counters["recompute_share"] = plan.forward_cost > 0 ? plan.recompute_cost / plan.forward_cost : 0.0;
}
BENCHMARK(BM_PlanLlama2_7bForABudget)->Unit(benchmark::kMillisecond)->Iterations(2);

} // namespace
