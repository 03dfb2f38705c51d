// estimate_model() (models/estimate.h) and LoRA (models/lora.h), held to an
// independent count: the same model with the same precision, checkpointing
// and LoRA built on CPU and stepped for real, its live bytes counted by the
// CpuMemoryTracker. (tests/hf_saved_bytes.py holds the saved bytes and
// parameters to transformers and peft.)
#include "trainmem/models/estimate.h"

#include <cstdio>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "trainmem/allocator.h"
#include "trainmem/block_checkpointing.h"
#include "trainmem/grad_scaler.h"
#include "trainmem/master_weights.h"
#include "trainmem/models/lora.h"
#include "trainmem/models/transformer.h"
#include "trainmem/meta.h"
#include "trainmem/planner.h"
#include "support/error_of.h"

namespace {

std::string data(const std::string& name) {
  return std::string(TRAINMEM_TEST_DATA_DIR) + "/" + name;
}

using trainmem::testing::error_of;

// The step a user writes on CPU for `o`, run for real: the model built and
// initialized on CPU, moved to bf16 for kBf16 (fp16 for kFp16), adapted by LoRA, its loss
// under CPU autocast for kBf16Autocast and checkpointed as `o` names. The
// second of two AdamW steps is measured (the first makes the state).
trainmem::StepPeak measured_on_cpu(const trainmem::HfConfig& config, const trainmem::ModelEstimateOptions& o) {
  torch::manual_seed(0);
  auto model = trainmem::build_hf_model(config);
  if (o.precision() == trainmem::Precision::kBf16) {
    model.module->to(at::kBFloat16);
  } else if (o.precision() == trainmem::Precision::kFp16) {
    model.module->to(at::kHalf);
  }
  if (o.lora()) {
    trainmem::apply_lora(*model.module, *o.lora());
  }
  std::vector<at::Tensor> trainable;
  for (const auto& p : model.module->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(1e-3));
  const auto plan = trainmem::BlockCheckpointing::named(config.num_layers, o.checkpoint());
  auto step = [&] {
    // Made in the step, as estimate_model's tokens are: the embedding saves them.
    const auto tokens = torch::randint(config.vocab_size, {o.batch(), o.seq_len()});
    auto loss = [&] { return o.checkpoint() == "none" ? model.loss(tokens) : model.loss(tokens, plan); };
    return o.precision() == trainmem::Precision::kBf16Autocast
               ? trainmem::run_under_autocast(at::kCPU, at::kBFloat16, loss)
               : loss();
  };
  trainmem::measure_step_peak(*model.module, step, &opt);
  return trainmem::measure_step_peak(*model.module, step, &opt);
}

struct Case {
  const char* config;
  trainmem::ModelEstimateOptions options;
  const char* what;
};

// Every option of estimate_model, alone and together, on three
// architectures: saved bytes, parameters, optimizer state and the step
// peak equal the CPU's to the byte. (GPT-2's position ids, an arange its
// embedding saves, were 8 T bytes under the CPU's until predict_step_peak
// counted storages that grow: Note [Meta storages that grow].)
TEST(ModelEstimateTest, EveryOptionEqualsTheCpuStep) {
  trainmem::CpuMemoryTracker::install();
  using trainmem::Precision;
  const auto base = trainmem::ModelEstimateOptions().batch(2).seq_len(24);
  const auto lora = trainmem::LoraOptions().rank(4).alpha(16).targets({"q_proj", "v_proj"});
  const Case cases[] = {
      {"tiny_llama.json", base, "fp32"},
      {"tiny_llama.json", trainmem::ModelEstimateOptions(base).precision(Precision::kBf16), "bf16"},
      {"tiny_llama.json", trainmem::ModelEstimateOptions(base).precision(Precision::kBf16Autocast), "bf16-autocast"},
      {"tiny_llama.json", trainmem::ModelEstimateOptions(base).checkpoint("full"), "full checkpointing"},
      {"tiny_llama.json", trainmem::ModelEstimateOptions(base).checkpoint("every_2"), "every_2"},
      {"tiny_llama.json", trainmem::ModelEstimateOptions(base).checkpoint("selective"), "selective"},
      {"tiny_llama.json", trainmem::ModelEstimateOptions(base).lora(lora), "LoRA"},
      {"tiny_llama.json",
       trainmem::ModelEstimateOptions(base).lora(lora).checkpoint("full").precision(Precision::kBf16Autocast),
       "LoRA, full, bf16-autocast"},
      {"tiny_qwen3.json", trainmem::ModelEstimateOptions(base).lora(lora).precision(Precision::kBf16), "LoRA, bf16"},
      {"tiny_gpt2.json",
       trainmem::ModelEstimateOptions(base).lora(trainmem::LoraOptions().rank(8).targets({"c_attn", "c_proj"}))
           .checkpoint("full"),
       "LoRA on Conv1D, full"},
      {"tiny_gpt2.json", base, "fp32"},
      {"tiny_gpt2.json", trainmem::ModelEstimateOptions(base).precision(Precision::kBf16), "bf16"},
      {"tiny_gpt2.json", trainmem::ModelEstimateOptions(base).seq_len(48).batch(1).precision(Precision::kBf16),
       "bf16, 1 x 48"},
      {"tiny_gpt2.json", trainmem::ModelEstimateOptions(base).precision(Precision::kBf16Autocast), "bf16-autocast"},
      {"tiny_gpt2.json", trainmem::ModelEstimateOptions(base).checkpoint("full"), "full checkpointing"},
      {"tiny_gpt2_tanh.json", trainmem::ModelEstimateOptions(base).precision(Precision::kBf16), "bf16"},
      {"tiny_llama.json", trainmem::ModelEstimateOptions(base).precision(Precision::kFp16), "fp16"},
      {"tiny_qwen3.json",
       trainmem::ModelEstimateOptions(base).lora(lora).checkpoint("every_2").precision(Precision::kFp16),
       "LoRA, every_2, fp16"},
      {"tiny_gpt2.json", trainmem::ModelEstimateOptions(base).precision(Precision::kFp16), "fp16"},
  };
  for (const auto& c : cases) {
    const auto config = trainmem::load_hf_config(data(c.config));
    const auto e = trainmem::estimate_model(config, c.options);
    const auto cpu = measured_on_cpu(config, c.options);
    std::printf("%s, %s: saved %lld B (CPU %lld), step peak %lld B (CPU %lld) in the %s, state %lld B\n", c.config,
                c.what, static_cast<long long>(e.saved_bytes), static_cast<long long>(cpu.activation_bytes),
                static_cast<long long>(e.step_peak.peak_bytes), static_cast<long long>(cpu.peak_bytes),
                trainmem::to_string(e.step_peak.phase).c_str(),
                static_cast<long long>(e.step_peak.optimizer_state_bytes));
    EXPECT_EQ(e.saved_bytes, e.step_peak.activation_bytes) << c.config << ", " << c.what;
    EXPECT_EQ(e.step_peak.activation_bytes, cpu.activation_bytes) << c.config << ", " << c.what;
    EXPECT_EQ(e.step_peak.param_bytes, cpu.param_bytes) << c.config << ", " << c.what;
    EXPECT_EQ(e.step_peak.optimizer_state_bytes, cpu.optimizer_state_bytes) << c.config << ", " << c.what;
    EXPECT_EQ(e.step_peak.peak_bytes, cpu.peak_bytes) << c.config << ", " << c.what;
  }
}

// fp16 autocast with a GradScaler, predicted as a step function (Note [fp16
// autocast as a step function]): the same step run on CPU with a real
// GradScaler, measured by measure_step_function, to the byte.
TEST(ModelEstimateTest, Fp16AutocastWithAGradScalerEqualsTheCpuStep) {
  trainmem::CpuMemoryTracker::install();
  for (const char* name : {"tiny_llama.json", "tiny_gpt2.json"}) {
    for (const bool full : {false, true}) {
      const auto config = trainmem::load_hf_config(data(name));
      const auto o = trainmem::ModelEstimateOptions().batch(2).seq_len(24).precision(
          trainmem::Precision::kFp16Autocast).checkpoint(full ? "full" : "none");
      const auto e = trainmem::estimate_model(config, o);
      torch::manual_seed(0);
      auto model = trainmem::build_model(config, o);
      torch::optim::AdamW opt(model.module->parameters(), torch::optim::AdamWOptions(1e-3));
      trainmem::GradScaler scaler;
      const auto plan = trainmem::BlockCheckpointing::named(config.num_layers, o.checkpoint());
      const auto measured = trainmem::measure_step_function({model.module.get()}, {&opt}, [&] {
        for (auto& p : model.module->parameters()) p.mutable_grad().reset();
        // The batch made inside the loss, as estimate_model's is: it is gone
        // with the graph, before the optimizer step.
        const auto loss = trainmem::run_under_autocast(at::kCPU, at::kHalf, [&] {
          const auto tokens = torch::randint(config.vocab_size, {o.batch(), o.seq_len()});
          return full ? model.loss(tokens, plan) : model.loss(tokens);
        });
        scaler.scale(loss).backward();
        scaler.unscale_(opt);
        scaler.step(opt);
        scaler.update();
      });
      std::printf("%s fp16-autocast, checkpointing %s: predicted %lld B, measured %lld B\n", name,
                  o.checkpoint().c_str(), static_cast<long long>(e.step_peak.peak_bytes),
                  static_cast<long long>(measured.peak_bytes));
      EXPECT_FALSE(e.step_phases_split);
      EXPECT_EQ(e.step_peak.optimizer_state_bytes, measured.optimizer_state_bytes) << name;
      EXPECT_EQ(e.step_peak.peak_bytes, measured.peak_bytes) << name << " " << o.checkpoint();
    }
  }
}

// A bf16 model with fp32 master weights (Note [bf16 weights with fp32 master
// weights]), predicted as a step function: the same step run on CPU with
// MasterWeights, measured by measure_step_function, to the byte; with LoRA
// the fp32 adapters get no masters.
TEST(ModelEstimateTest, Bf16WithFp32MasterWeightsEqualsTheCpuStep) {
  trainmem::CpuMemoryTracker::install();
  struct MasterCase {
    const char* config;
    const char* checkpoint;
    bool lora;
  };
  for (const auto& c : {MasterCase{"tiny_llama.json", "none", false}, MasterCase{"tiny_llama.json", "full", false},
                        MasterCase{"tiny_gpt2.json", "none", false}, MasterCase{"tiny_qwen3.json", "none", true}}) {
    const auto config = trainmem::load_hf_config(data(c.config));
    auto o = trainmem::ModelEstimateOptions().batch(2).seq_len(24).precision(trainmem::Precision::kBf16Master)
                 .checkpoint(c.checkpoint);
    if (c.lora) {
      o.lora(trainmem::LoraOptions().rank(4).targets({"q_proj", "v_proj"}));
    }
    const auto e = trainmem::estimate_model(config, o);
    torch::manual_seed(0);
    auto model = trainmem::build_model(config, o);
    std::vector<at::Tensor> trainable;
    for (const auto& p : model.module->parameters()) {
      if (p.requires_grad()) trainable.push_back(p);
    }
    trainmem::MasterWeights masters(trainable);
    torch::optim::AdamW opt(masters->optimized(), torch::optim::AdamWOptions(1e-3));
    const auto plan = trainmem::BlockCheckpointing::named(config.num_layers, o.checkpoint());
    const auto measured = trainmem::measure_step_function({model.module.get(), masters.get()}, {&opt}, [&] {
      for (auto& p : model.module->parameters()) p.mutable_grad().reset();
      // The batch made inside the loss, as estimate_model's is: gone with the
      // graph, before the optimizer step.
      [&] {
        const auto tokens = torch::randint(config.vocab_size, {o.batch(), o.seq_len()});
        return o.checkpoint() == "none" ? model.loss(tokens) : model.loss(tokens, plan);
      }().backward();  // the loss gone too
      masters->step(opt);
    });
    std::printf("%s bf16-master, checkpointing %s%s: predicted %lld B, measured %lld B (parameters %lld B, state "
                "%lld B)\n",
                c.config, c.checkpoint, c.lora ? ", LoRA" : "", static_cast<long long>(e.step_peak.peak_bytes),
                static_cast<long long>(measured.peak_bytes), static_cast<long long>(measured.param_bytes),
                static_cast<long long>(measured.optimizer_state_bytes));
    EXPECT_FALSE(e.step_phases_split);
    EXPECT_EQ(e.step_peak.param_bytes, measured.param_bytes) << c.config;
    EXPECT_EQ(e.step_peak.optimizer_state_bytes, measured.optimizer_state_bytes) << c.config;
    EXPECT_EQ(e.step_peak.peak_bytes, measured.peak_bytes) << c.config << " " << c.checkpoint;
    if (!c.lora) {
      // bf16 weights (2 B) and fp32 masters (4 B) per parameter; AdamW's two
      // fp32 moments (8 B; its step count is no tensor in LibTorch).
      EXPECT_EQ(measured.param_bytes, 6 * e.num_params) << c.config;
      EXPECT_EQ(measured.optimizer_state_bytes, 8 * e.num_params) << c.config;
    }
  }
}

// fp16 weights with fp32 masters and a GradScaler (DeepSpeed's fp16 mode,
// apex's O2): the loss scaled, each fp16 gradient made its master's fp32
// one, unscaled by the scaler, AdamW's step on the masters, the masters
// copied back (MasterWeights::step with the scaler). The same step on CPU,
// its scaler at scale 1 so that no step is skipped (a skipped step makes no
// AdamW state; the prediction always steps), to the byte.
TEST(ModelEstimateTest, Fp16WithFp32MasterWeightsAndAGradScalerEqualsTheCpuStep) {
  trainmem::CpuMemoryTracker::install();
  for (const char* name : {"tiny_llama.json", "tiny_gpt2.json"}) {
    for (const char* checkpoint : {"none", "full"}) {
      const auto config = trainmem::load_hf_config(data(name));
      const auto o = trainmem::ModelEstimateOptions().batch(2).seq_len(24).precision(
          trainmem::Precision::kFp16Master).checkpoint(checkpoint);
      const auto e = trainmem::estimate_model(config, o);
      torch::manual_seed(0);
      auto model = trainmem::build_model(config, o);
      ASSERT_EQ(model.module->parameters()[0].scalar_type(), at::kHalf);
      trainmem::MasterWeights masters(model.module->parameters());
      torch::optim::AdamW opt(masters->optimized(), torch::optim::AdamWOptions(1e-3));
      trainmem::GradScaler scaler(trainmem::GradScalerOptions().init_scale(1.0));
      const auto plan = trainmem::BlockCheckpointing::named(config.num_layers, o.checkpoint());
      int steps = 0;
      const auto measured = trainmem::measure_step_function({model.module.get(), masters.get()}, {&opt}, [&] {
        for (auto& p : model.module->parameters()) p.mutable_grad().reset();
        scaler.scale([&] {
          const auto tokens = torch::randint(config.vocab_size, {o.batch(), o.seq_len()});
          return o.checkpoint() == "none" ? model.loss(tokens) : model.loss(tokens, plan);
        }()).backward();  // the loss and the scaled loss gone
        steps += masters->step(opt, scaler) ? 1 : 0;
      });
      std::printf("%s fp16-master, checkpointing %s: predicted %lld B, measured %lld B\n", name, checkpoint,
                  static_cast<long long>(e.step_peak.peak_bytes), static_cast<long long>(measured.peak_bytes));
      EXPECT_EQ(steps, 2) << "a CPU step was skipped";
      EXPECT_FALSE(e.step_phases_split);
      // fp16 weights (2 B) and fp32 masters (4 B); AdamW's fp32 moments (8 B).
      EXPECT_EQ(measured.param_bytes, 6 * e.num_params) << name;
      EXPECT_EQ(e.step_peak.param_bytes, measured.param_bytes) << name;
      EXPECT_EQ(e.step_peak.optimizer_state_bytes, 8 * e.num_params) << name;
      EXPECT_EQ(e.step_peak.optimizer_state_bytes, measured.optimizer_state_bytes) << name;
      EXPECT_EQ(e.step_peak.peak_bytes, measured.peak_bytes) << name << " " << checkpoint;
    }
  }
}

// estimate() of the reference transformer's step, as `trainmem estimate`
// asks it: static buckets of parameters, gradients and AdamW's two moments
// (4 + 4 + 8 B per parameter), the saved bytes of the exact term-by-term
// count, and a step peak equal to the same step measured on CPU, to the byte.
TEST(ModelEstimateTest, EstimateOfTheReferenceTransformerEqualsTheCpuStep) {
  trainmem::CpuMemoryTracker::install();
  const trainmem::TransformerOptions o;
  const int64_t batch = 16, seq_len = 64;
  trainmem::Transformer meta{nullptr};
  {
    trainmem::MetaInitGuard guard;
    meta = trainmem::Transformer(o);
  }
  torch::optim::AdamW meta_opt(meta->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto e = trainmem::estimate(*meta, [&] {
    return meta->forward(at::empty({batch, seq_len, o.d_model()}, at::kMeta)).pow(2).mean();
  }, meta_opt);
  torch::manual_seed(0);
  trainmem::Transformer cpu(o);
  torch::optim::AdamW cpu_opt(cpu->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto measured = trainmem::measure_step_peak(*cpu, [&] {
    return cpu->forward(torch::randn({batch, seq_len, o.d_model()})).pow(2).mean();
  }, &cpu_opt);
  std::printf("reference transformer, estimate(): step peak predicted %lld B, measured %lld B\n",
              static_cast<long long>(e.step_peak.peak_bytes), static_cast<long long>(measured.peak_bytes));
  EXPECT_EQ(e.step_peak.peak_bytes, measured.peak_bytes) << trainmem::to_string(e.step_peak);
  EXPECT_EQ(e.step_peak.phase, measured.phase);
  EXPECT_EQ(e.step_peak.activation_bytes, measured.activation_bytes);
  EXPECT_TRUE(e.step_phases_split);
  EXPECT_EQ(e.saved_bytes, measured.activation_bytes);
  EXPECT_EQ(e.saved_bytes, trainmem::estimate_activation_bytes(o, batch, seq_len).total_bytes);
  const int64_t params = trainmem::transformer_num_params(o);
  EXPECT_EQ(e.buckets.num_params, params);
  EXPECT_EQ(e.buckets.param_bytes, 4 * params);
  EXPECT_EQ(e.buckets.predicted_grad_bytes, 4 * params);
  EXPECT_EQ(e.buckets.predicted_optimizer_state_bytes, 8 * params);
  EXPECT_EQ(e.buckets.predicted_total_bytes(), 16 * params);
  EXPECT_FALSE(e.cuda.has_value());
  EXPECT_FALSE(e.assumptions.empty());
}

// estimate() refuses what it cannot predict, naming it.
TEST(ModelEstimateTest, EstimateRefusesMasterWeightsAndNoMicroBatches) {
  torch::nn::Linear lin(4, 2);
  trainmem::to_meta(*lin);
  torch::optim::AdamW opt(lin->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto loss = [&] { return lin->forward(at::empty({3, 4}, at::kMeta)).sum(); };
  const auto master = error_of([&] {
    trainmem::estimate(*lin, loss, opt, trainmem::EstimateOptions().precision(trainmem::Precision::kBf16Master));
  });
  EXPECT_NE(master.find("but got bf16-master"), std::string::npos) << master;
  const auto none = error_of([&] { trainmem::estimate(*lin, loss, opt, trainmem::EstimateOptions().accumulation(0)); });
  EXPECT_NE(none.find("expected accumulation >= 1, but got 0"), std::string::npos) << none;
}

}  // namespace
