#include "app/variants.h"
#include "trainmem/models/hf_model.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include "trainmem/accountant.h"
#include "trainmem/allocator.h"
#include "trainmem/cuda_predict.h"
#include "trainmem/meter.h"
#include "trainmem/planner.h"
#include "region_planner_check.h"
#include "support/error_of.h"

namespace {

std::string data(const std::string& name) {
  return std::string(TRAINMEM_TEST_DATA_DIR) + "/" + name;
}

// Built on meta, with nothing allocated on the CPU.
trainmem::HfModel build_on_meta(const trainmem::HfConfig& config) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  const auto before = tracker.stats();
  trainmem::HfModel model;
  {
    trainmem::MetaInitGuard meta;
    model = trainmem::build_hf_model(config);
  }
  EXPECT_EQ(tracker.stats().num_allocs - before.num_allocs, 0);
  for (const auto& p : model.module->parameters()) EXPECT_TRUE(p.is_meta());
  return model;
}

at::Tensor meta_tokens(int64_t B, int64_t T) {
  return at::empty({B, T}, at::TensorOptions().dtype(at::kLong).device(at::kMeta));
}

using trainmem::testing::error_of;

TEST(HfModelTest, Gpt2SmallFromItsConfigHasExactlyItsParameters) {
  const auto config = trainmem::load_hf_config(data("gpt2.json"));
  EXPECT_EQ(config.architecture, trainmem::HfArchitecture::kGPT2);
  EXPECT_EQ(trainmem::hf_num_params(config), 124439808);
  const auto model = build_on_meta(config);
  EXPECT_EQ(trainmem::account(*model.module).num_params, 124439808);
  auto logits = model.forward(meta_tokens(2, 16));
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 16, 50257}));
}

TEST(HfModelTest, Llama2_7bFromItsConfigHasExactlyItsParameters) {
  const auto config = trainmem::load_hf_config(data("llama2_7b.json"));
  EXPECT_EQ(config.architecture, trainmem::HfArchitecture::kLlama);
  EXPECT_EQ(config.head_dim, 128);
  EXPECT_FALSE(config.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(config.norm_eps, 1e-5);
  EXPECT_EQ(trainmem::hf_num_params(config), 6738415616);
  const auto model = build_on_meta(config);
  const auto buckets = trainmem::account(*model.module);
  EXPECT_EQ(buckets.num_params, 6738415616);
  EXPECT_EQ(buckets.param_bytes, 4 * 6738415616);
  auto loss = model.loss(meta_tokens(1, 64));
  EXPECT_TRUE(loss.is_meta());
  EXPECT_EQ(loss.dim(), 0);
}

// What one training forward saves, on CPU (the meter) and predicted on meta,
// equals what transformers 5.24.0's model of the same config saves, as
// tests/hf_saved_bytes.py measured it (torch 2.13.0, CPU, fp32, sdpa, dropout
// 0, labels = tokens); ctest hf.saved_bytes_match_transformers measures it
// again wherever transformers is installed. Each case is one side of a choice
// transformers makes: gelu_new and the KV cache's copies (GPT-2, use_cache on
// and off), enable_gqa (GQA ratios 1, 2, 3) or repeat_kv (head_dim 264), or
// pack_gqa (one token), Mistral within, at and past its window, batch 1 (the
// loss's labels a view).
TEST(HfModelTest, SavedBytesEqualTransformersOnCpuAndMeta) {
  struct Case {
    const char* file;
    int64_t B, T, transformers_saved_bytes;
  };
  for (const auto& [file, B, T, expected] : {
           Case{"tiny_gpt2.json", 3, 17, 866324}, Case{"tiny_gpt2.json", 1, 9, 152940},
           Case{"tiny_gpt2_odd.json", 5, 13, 1272548}, Case{"tiny_gpt2_tanh.json", 2, 9, 142204},
           Case{"tiny_llama.json", 3, 17, 619280}, Case{"tiny_llama_tied_bias.json", 3, 17, 1146416},
           Case{"tiny_llama_gqa3.json", 1, 17, 154508}, Case{"tiny_llama_mha5.json", 3, 17, 666812},
           Case{"tiny_llama_wide_heads.json", 3, 11, 684028}, Case{"tiny_llama_wide_heads.json", 3, 1, 62188},
           Case{"tiny_mistral.json", 3, 17, 579568}, Case{"tiny_mistral.json", 3, 24, 887332},
           Case{"tiny_mistral.json", 1, 30, 373092}, Case{"tiny_qwen2.json", 3, 17, 547948},
           Case{"tiny_qwen3.json", 1, 15, 169572}}) {
    const auto config = trainmem::load_hf_config(data(file));
    const auto cpu = trainmem::build_hf_model(config);
    auto tokens = torch::empty({B, T}, torch::kLong);  // as hf_saved_bytes.py's
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T; ++t) tokens[b][t] = (7 * b + 3 * t + 1) % config.vocab_size;
    }
    trainmem::SavedTensorMeter meter(*cpu.module);
    {
      trainmem::SavedTensorMeterGuard scope(meter);
      (void)cpu.loss(tokens);
    }
    const auto meta = build_on_meta(config);
    const auto predicted =
        trainmem::predict_saved_activations(*meta.module, [&] { return meta.loss(meta_tokens(B, T)); });
    EXPECT_EQ(meter.report().saved_bytes, expected) << file << " " << B << " x " << T << " on CPU";
    EXPECT_EQ(predicted.saved_bytes, expected) << file << " " << B << " x " << T << " on meta";
  }
}

// The published 7B/8B-class configs of the other architectures: the
// parameter counts transformers 5.24.0 gives them (built on meta there too;
// tests/hf_params.py checks them against transformers where it is installed).
TEST(HfModelTest, PublishedMistralQwenConfigsHaveTransformersParameterCounts) {
  struct Published {
    const char* file;
    trainmem::HfArchitecture architecture;
    int64_t num_params;
  };
  for (const auto& [file, architecture, num_params] : {
           Published{"mistral_7b_v0.1.json", trainmem::HfArchitecture::kMistral, 7241732096},
           Published{"qwen2_7b.json", trainmem::HfArchitecture::kQwen2, 7615616512},
           Published{"qwen3_8b.json", trainmem::HfArchitecture::kQwen3, 8190735360}}) {
    const auto config = trainmem::load_hf_config(data(file));
    EXPECT_EQ(config.architecture, architecture) << file;
    EXPECT_EQ(trainmem::hf_num_params(config), num_params) << file;
    const auto model = build_on_meta(config);
    EXPECT_EQ(trainmem::account(*model.module).num_params, num_params) << file;
  }
  const auto mistral = trainmem::load_hf_config(data("mistral_7b_v0.1.json"));
  EXPECT_EQ(mistral.sliding_window, 4096);
  EXPECT_EQ(mistral.num_kv_heads, 8);
  const auto qwen2 = trainmem::load_hf_config(data("qwen2_7b.json"));
  EXPECT_TRUE(qwen2.qkv_bias);
  EXPECT_FALSE(qwen2.attention_bias);
  EXPECT_EQ(qwen2.sliding_window, 0);  // use_sliding_window false
  const auto qwen3 = trainmem::load_hf_config(data("qwen3_8b.json"));
  EXPECT_TRUE(qwen3.qk_norm);
  EXPECT_EQ(qwen3.head_dim, 128);
  // transformers' defaults where a key is missing: Qwen3's head_dim is 128
  // whatever the width, Mistral's window 4096 and its KV heads 8.
  const auto q3 = trainmem::parse_hf_config(R"({"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 10})", "inline");
  EXPECT_EQ(q3.head_dim, 128);
  const auto m = trainmem::parse_hf_config(R"({"model_type": "mistral", "hidden_size": 64, "intermediate_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 8, "vocab_size": 10})", "inline");
  EXPECT_EQ(m.sliding_window, 4096);
  EXPECT_EQ(m.num_kv_heads, 8);
  const auto off = trainmem::parse_hf_config(R"({"model_type": "mistral", "hidden_size": 64, "intermediate_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 8, "vocab_size": 10, "sliding_window": null})", "inline");
  EXPECT_EQ(off.sliding_window, 0);
  const auto sliding = error_of([] {
    trainmem::parse_hf_config(R"({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10, "use_sliding_window": true})", "inline");
  });
  EXPECT_NE(sliding.find("\"use_sliding_window\" true is not supported for qwen2"), std::string::npos) << sliding;
  const auto act = error_of([] {
    trainmem::parse_hf_config(R"({"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 10,
        "n_positions": 8, "activation_function": "quick_gelu"})", "inline");
  });
  EXPECT_NE(act.find("\"activation_function\" \"quick_gelu\" is not supported"), std::string::npos) << act;
}

// The formula and the built module agree for every option: GQA, tied head,
// attention and MLP biases, q/k/v biases, q/k norms, a wider head, n_inner.
TEST(HfModelTest, FormulaMatchesTheModuleForEveryOption) {
  for (const char* name : {"tiny_gpt2.json", "tiny_gpt2_odd.json", "tiny_gpt2_tanh.json", "tiny_llama.json",
                           "tiny_llama_tied_bias.json", "tiny_llama_gqa3.json", "tiny_llama_mha5.json",
                           "tiny_llama_wide_heads.json", "tiny_mistral.json", "tiny_qwen2.json", "tiny_qwen3.json"}) {
    const auto config = trainmem::load_hf_config(data(name));
    const auto model = build_on_meta(config);
    EXPECT_EQ(trainmem::account(*model.module).num_params, trainmem::hf_num_params(config)) << name;
  }
  // tiny_llama_tied_bias by hand: V d + L (d (H + 2 KV) hd + H hd d + (H + 2 KV) hd + d
  //   + 3 d I + 2 I + d + 2 d) + d; V 300, d 96, L 3, H 6, KV 3, hd 16, I 200.
  const int64_t d = 96, hd = 16, I = 200;
  const int64_t block = d * (6 + 6) * hd + 6 * hd * d + (6 + 6) * hd + d + 3 * d * I + 2 * I + d + 2 * d;
  EXPECT_EQ(trainmem::hf_num_params(trainmem::load_hf_config(data("tiny_llama_tied_bias.json"))),
            300 * d + 3 * block + d);
}

TEST(HfModelTest, BadConfigsNameTheKeyAndValue) {
  EXPECT_NE(error_of([] { trainmem::load_hf_config(data("bad_missing_key.json")); })
                .find("missing key \"intermediate_size\""),
            std::string::npos);
  const auto typed = error_of([] { trainmem::load_hf_config(data("bad_type.json")); });
  EXPECT_NE(typed.find("\"n_head\" must be a positive integer, but got \"four\""), std::string::npos) << typed;
  const auto arch = error_of([] { trainmem::load_hf_config(data("bad_arch.json")); });
  EXPECT_NE(arch.find("unknown architecture: \"model_type\" is \"bert\""), std::string::npos) << arch;
  const auto kv = error_of([] { trainmem::load_hf_config(data("bad_kv_heads.json")); });
  EXPECT_NE(kv.find("\"num_attention_heads\" 4 is not divisible by \"num_key_value_heads\" 3"),
            std::string::npos) << kv;
  const auto heads = error_of([] {
    trainmem::parse_hf_config(R"({"model_type": "gpt2", "n_layer": 2, "n_embd": 66, "n_head": 4,
                                  "vocab_size": 10, "n_positions": 8})", "inline");
  });
  EXPECT_NE(heads.find("inline: \"n_embd\" 66 is not divisible by \"n_head\" 4"), std::string::npos) << heads;
  const auto negative = error_of([] {
    trainmem::parse_hf_config(R"({"model_type": "gpt2", "n_layer": -2, "n_embd": 64, "n_head": 4,
                                  "vocab_size": 10, "n_positions": 8})", "inline");
  });
  EXPECT_NE(negative.find("\"n_layer\" must be a positive integer, but got -2"), std::string::npos) << negative;
  const auto flag = error_of([] {
    trainmem::parse_hf_config(R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10, "mlp_bias": "yes"})", "inline");
  });
  EXPECT_NE(flag.find("\"mlp_bias\" must be true or false, but got \"yes\""), std::string::npos) << flag;
  EXPECT_NE(error_of([] { trainmem::load_hf_config("/nonexistent/config.json"); })
                .find("cannot read the model config /nonexistent/config.json"),
            std::string::npos);
  EXPECT_NE(error_of([] { trainmem::parse_hf_config("{not json", "x.json"); }).find("x.json: not JSON"),
            std::string::npos);
  // Found by fuzzing: a number beyond a double (nlohmann's out_of_range, not a
  // parse_error) escaped as an uncaught exception and aborted the command.
  EXPECT_NE(error_of([] { trainmem::parse_hf_config("2e607", "x.json"); }).find("x.json: not JSON"),
            std::string::npos);
}

// A tiny model of each family trains on CPU: the loss on a fixed batch falls.
TEST(HfModelTest, TinyModelsTrainOnCpu) {
  for (const char* name : {"tiny_gpt2.json", "tiny_llama.json"}) {
    torch::manual_seed(0);
    const auto model = trainmem::build_hf_model(trainmem::load_hf_config(data(name)));
    torch::optim::AdamW opt(model.module->parameters(), torch::optim::AdamWOptions(3e-3));
    const auto tokens = torch::randint(256, {4, 32});
    double first = 0, last = 0;
    for (int step = 0; step < 30; ++step) {
      opt.zero_grad();
      auto loss = model.loss(tokens);
      loss.backward();
      opt.step();
      (step == 0 ? first : last) = loss.item<double>();
    }
    std::printf("%s: loss %.4f -> %.4f\n", name, first, last);
    EXPECT_NEAR(first, std::log(256.0), 0.5) << name;  // about uniform at the start
    EXPECT_LT(last, 0.5 * first) << name;
  }
}

// What a step saves is exact on meta, and its peak matches the CPU's.
// tiny_mistral at 64 tokens is past its window of 24: its mask path (the
// boolean mask SDPA converts and saves, k and v repeated) on meta as on CPU.
TEST(HfModelTest, TinyModelsStepPeakOnMetaMatchesTheCpu) {
  trainmem::CpuMemoryTracker::install();
  for (const char* name : {"tiny_gpt2.json", "tiny_llama.json", "tiny_mistral.json"}) {
    const auto config = trainmem::load_hf_config(data(name));
    torch::manual_seed(0);
    const auto cpu = trainmem::build_hf_model(config);
    const auto meta = build_on_meta(config);
    torch::optim::AdamW cpu_opt(cpu.module->parameters(), torch::optim::AdamWOptions(1e-3));
    torch::optim::AdamW meta_opt(meta.module->parameters(), torch::optim::AdamWOptions(1e-3));
    const int64_t B = 4, T = 64;
    // The CPU's first step makes the optimizer state; measure the second.
    auto tokens = torch::randint(256, {B, T});
    trainmem::measure_step_peak(*cpu.module, [&] { return cpu.loss(tokens); }, &cpu_opt);
    const auto measured = trainmem::measure_step_peak(*cpu.module, [&] { return cpu.loss(tokens); }, &cpu_opt);
    const auto predicted =
        trainmem::predict_step_peak(*meta.module, [&] { return meta.loss(meta_tokens(B, T)); }, &meta_opt);
    const double err = static_cast<double>(predicted.peak_bytes - measured.peak_bytes) /
        static_cast<double>(measured.peak_bytes);
    std::printf("%s: predicted %lld B (%s), measured %lld B (%s), error %.4f %%; saved %lld B\n", name,
                static_cast<long long>(predicted.peak_bytes), to_string(predicted.phase).c_str(),
                static_cast<long long>(measured.peak_bytes), to_string(measured.phase).c_str(), 100 * err,
                static_cast<long long>(predicted.activation_bytes));
    EXPECT_EQ(predicted.activation_bytes, measured.activation_bytes) << name;
    EXPECT_EQ(predicted.param_bytes, measured.param_bytes) << name;
    EXPECT_EQ(predicted.optimizer_state_bytes, measured.optimizer_state_bytes) << name;
    EXPECT_LT(std::abs(err), 0.005) << name;
  }
}

// The models as regions (hf_region_model): planned on meta (without a
// budget, halfway, at the smallest peak), each plan run on CPU: saved bytes
// exact, the step peak within 0.5 %, within the budget, gradients equal to
// the plain run's; and the regions compute the model's own loss.
TEST(HfModelTest, TinyModelsPlannedAsRegionsFitWhenRun) {
  for (const char* name : {"tiny_gpt2.json", "tiny_llama.json", "tiny_llama_tied_bias.json"}) {
    const auto config = trainmem::load_hf_config(data(name));
    torch::manual_seed(0);
    const auto model = trainmem::build_hf_model(config);
    torch::optim::AdamW opt(model.module->parameters(), torch::optim::AdamWOptions(1e-3));
    auto m = trainmem::hf_region_model(model, 4, 32);
    m.optimizer = &opt;
    ASSERT_EQ(static_cast<int64_t>(m.regions.size()), config.num_layers + 2) << name;
    const auto zeros = at::zeros({4, 32}, at::kLong);
    EXPECT_TRUE(at::equal(m.loss(trainmem::run_regions(m.regions, zeros, trainmem::BlockCheckpointing::none(
                                                                                  config.num_layers + 2))),
                          model.loss(zeros)))
        << name;
    trainmem::testing::check_model(name, *model.module, m, &opt);
  }
  EXPECT_THROW(trainmem::hf_region_model(trainmem::build_hf_model(trainmem::load_hf_config(data("tiny_gpt2.json"))),
                                         1, 65),
               c10::Error);
}

// Checkpointing every block of a LLaMA gives the plain run's gradients and
// keeps only the blocks' inputs (and what the loss saves).
TEST(HfModelTest, LlamaUnderACheckpointPlanGivesIdenticalGradients) {
  const auto config = trainmem::load_hf_config(data("tiny_llama.json"));
  torch::manual_seed(0);
  const auto model = trainmem::build_hf_model(config);
  const auto tokens = torch::randint(256, {2, 16});
  model.loss(tokens).backward();
  std::vector<at::Tensor> plain;
  for (const auto& p : model.module->parameters()) plain.push_back(p.grad().clone());
  model.module->zero_grad();
  for (const auto& plan : {trainmem::BlockCheckpointing::full(2), trainmem::BlockCheckpointing::segments(2, 1)}) {
    model.loss(tokens, plan).backward();
    std::vector<at::Tensor> got;
    for (const auto& p : model.module->parameters()) got.push_back(p.grad().clone());
    EXPECT_EQ(trainmem::max_abs_diff(plain, got), 0.0) << plan.name;
    model.module->zero_grad();
  }
  // Saved bytes: each checkpointed region keeps h (B, T, d), cos and sin (T, hd).
  trainmem::SavedTensorMeter none(*model.module), full(*model.module);
  {
    trainmem::SavedTensorMeterGuard scope(none);
    (void)model.loss(tokens);
  }
  {
    trainmem::SavedTensorMeterGuard scope(full);
    (void)model.loss(tokens, trainmem::BlockCheckpointing::full(2));
  }
  EXPECT_LT(full.report().saved_bytes, none.report().saved_bytes);
}


// plan --model --device cuda's library call: a LLaMA (five query and five KV
// heads: fp32 attention over grouped KV heads runs memory-efficient
// attention on CUDA, not modelled over grouped heads) planned for a CUDA
// budget of 20.2 MB allocated. 'none' predicts 20,608,000 B on CUDA (17 MB
// of it the two cuBLAS workspaces), so the planner plans again for a CPU
// peak that much under none's: a second round whose plan fits. The
// prediction is the one predict_cuda_step_peak makes of that plan by itself.
TEST(HfModelTest, RegionPlanForACudaBudget) {
  const auto config = trainmem::load_hf_config(data("tiny_llama_mha5.json"));
  const auto model = build_on_meta(config);
  auto m = trainmem::hf_region_model(model, 4, 32);
  auto adamw = [](std::vector<at::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::AdamW>(std::move(p), torch::optim::AdamWOptions(1e-3));
  };
  m.make_optimizer = adamw;
  const int64_t budget = 20200000;
  const auto r = trainmem::plan_regions_cuda(m, *model.module, trainmem::PlanOptions().budget_bytes(budget),
                                             trainmem::CudaBudgetKind::kAllocated);
  ASSERT_TRUE(r.feasible);
  EXPECT_EQ(r.num_rounds, 2);
  EXPECT_LE(r.cuda.max_memory_allocated_bytes, budget);
  EXPECT_NE(r.plan.name, "none");
  EXPECT_LT(r.planner_budget_bytes, budget);
  auto opt = adamw(model.module->parameters());
  const auto checkpointing = r.plan.checkpointing();
  const auto again = trainmem::predict_cuda_step_peak(
      *model.module, [&] { return m.loss(trainmem::run_regions(m.regions, m.input(at::kMeta), checkpointing)); },
      opt.get());
  EXPECT_EQ(again.max_memory_allocated_bytes, r.cuda.max_memory_allocated_bytes);
  EXPECT_EQ(again.max_memory_reserved_bytes, r.cuda.max_memory_reserved_bytes);
  // The plain step does not fit: that is why a plan was needed.
  const auto plain = trainmem::predict_cuda_step_peak(
      *model.module, [&] { return m.loss(trainmem::run_regions(m.regions, m.input(at::kMeta),
                                                              trainmem::BlockCheckpointing::none(
                                                                  static_cast<int64_t>(m.regions.size())))); },
      adamw(model.module->parameters()).get());
  EXPECT_GT(plain.max_memory_allocated_bytes, budget);
  // Off meta: a clear error naming the parameter.
  const auto cpu_model = trainmem::build_hf_model(config);
  auto cpu_m = trainmem::hf_region_model(cpu_model, 4, 32);
  cpu_m.make_optimizer = adamw;
  try {
    (void)trainmem::plan_regions_cuda(cpu_m, *cpu_model.module, trainmem::PlanOptions().budget_bytes(budget),
                                      trainmem::CudaBudgetKind::kAllocated);
    ADD_FAILURE() << "a CPU model was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not on the meta device"), std::string::npos) << e.what();
  }
}

// transformers' name of a parameter of our model: GPT-2's are its own under
// "transformer."; the LLaMA family's attention and MLP sit in self_attn and mlp.
std::string transformers_name(trainmem::HfArchitecture architecture, std::string n) {
  if (architecture == trainmem::HfArchitecture::kGPT2) return "transformer." + n;
  if (n.rfind("lm_head.", 0) == 0) return n;
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {".q_proj.", ".self_attn.q_proj."}, {".k_proj.", ".self_attn.k_proj."},
           {".v_proj.", ".self_attn.v_proj."}, {".o_proj.", ".self_attn.o_proj."},
           {".q_norm.", ".self_attn.q_norm."}, {".k_norm.", ".self_attn.k_norm."},
           {".gate_proj.", ".mlp.gate_proj."}, {".up_proj.", ".mlp.up_proj."},
           {".down_proj.", ".mlp.down_proj."}}) {
    if (auto at = n.find(from); at != std::string::npos) n.replace(at, from.size(), to);
  }
  return "model." + n;
}

// Must match tests/hf_llama_loss.py's is_norm_weight().
bool is_norm_weight(const std::string& name) {
  for (const char* end : {"norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight"}) {
    if (name.ends_with(end)) return true;
  }
  return false;
}

// Independent check (tests/hf_llama_loss.py runs it with transformers'
// loss, for GPT-2 and every LLaMA-family architecture): every parameter
// filled with the same values as there, by its transformers name (sorted
// index i: 0.25 sin(0.7 k + i), norms 1 + that), gives transformers' causal
// LM loss on the same tokens.
TEST(HfModelTest, LlamaLossEqualsTransformers) {
  const char* expected = std::getenv("TRAINMEM_HF_LLAMA_LOSS");
  const char* path = std::getenv("TRAINMEM_HF_CONFIG");
  if (expected == nullptr || path == nullptr) {
    GTEST_SKIP() << "run by tests/hf_llama_loss.py (ctest hf.llama_loss_matches_transformers)";
  }
  const auto model = trainmem::build_hf_model(trainmem::load_hf_config(path));
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const auto& p : model.module->named_parameters()) {
    params.emplace_back(transformers_name(model.config.architecture, p.key()), p.value());
  }
  std::sort(params.begin(), params.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& [name, p] = params[i];
      const bool norm = is_norm_weight(name);
      auto k = torch::arange(p.numel(), torch::kDouble);
      auto v = (0.25 * torch::sin(0.7 * k + static_cast<double>(i))).to(torch::kFloat);
      p.copy_((norm ? v + 1.0 : v).view_as(p));
    }
  }
  const int64_t B = 2, T = 16, V = model.config.vocab_size;
  auto tokens = torch::empty({B, T}, torch::kLong);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) tokens[b][t] = (7 * b + 3 * t) % V;
  }
  const double loss = model.loss(tokens).item<double>();
  std::printf("%s: trainmem loss %.9f, transformers %s\n", path, loss, expected);
  EXPECT_NEAR(loss, std::stod(expected), 1e-5);
}

} // namespace
