#include "app/variants.h"
#include "trainmem/models/gpt.h"

#include <chrono>
#include <cstdio>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "trainmem/accountant.h"
#include "trainmem/allocator.h"
#include "trainmem/meta.h"
#include "trainmem/planner.h"

namespace {

trainmem::GPT build_on_meta(const trainmem::GPTOptions& options) {
  trainmem::MetaInitGuard meta;
  return trainmem::GPT(options);
}

// Seed 000's worked example, built rather than assumed: GPT-2 small has
// 124,439,808 parameters, 1,991,036,928 B at 16 B/param, and building it on
// meta allocates nothing.
TEST(GptTest, Gpt2SmallHasExactParameterCountAndBytes) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  const auto before = tracker.stats();
  auto model = build_on_meta(trainmem::GPTOptions::gpt2_small());
  const auto after = tracker.stats();
  EXPECT_EQ(after.num_allocs - before.num_allocs, 0);
  const auto b = trainmem::account(*model);
  EXPECT_EQ(b.num_params, 124439808);
  EXPECT_EQ(trainmem::gpt_num_params(trainmem::GPTOptions::gpt2_small()), 124439808);
  EXPECT_EQ(b.param_bytes, 4 * 124439808);
  const auto f = trainmem::predict_static_bytes(*model, trainmem::Recipe::kFp32AdamW);
  EXPECT_EQ(f.total_bytes, 1991036928) << trainmem::to_string(f);
  // The LM head is tied: no parameter of its own, the largest layer is wte.
  EXPECT_EQ(model->named_parameters().size(), 2u + 12u * 12u + 2u);
  EXPECT_EQ(trainmem::largest_layer_params(*model), 50257 * 768);
}

// "A 7 B model needs 112 GB of static memory": exactly so for a configuration
// with exactly 7e9 parameters; GPT-3 6.7B's shape lands at 106.5 GB.
TEST(GptTest, SevenBillionReports112GB) {
  auto model = build_on_meta(trainmem::GPTOptions::exact_7b());
  EXPECT_EQ(trainmem::account(*model).num_params, 7000000000);
  const auto mixed = trainmem::predict_static_bytes(*model, trainmem::Recipe::kMixedAdamW);
  EXPECT_EQ(mixed.total_bytes, 112000000000);  // 112 GB, 104.3 GiB
  std::printf("%s\n", trainmem::to_string(mixed).c_str());

  // ZeRO-3 over 8 ranks: 16 P / 8 plus the gathered largest layer (wte,
  // V x d, at 2 + 2 B per element), DeepSpeed's "4 x largest layer".
  const int64_t largest = trainmem::largest_layer_params(*model);
  EXPECT_EQ(largest, 52758 * 4480);
  const auto z3 = trainmem::shard_static_bytes(
      mixed, trainmem::ShardingOptions().zero_stage(3).world_size(8).largest_layer_params(largest));
  EXPECT_EQ(z3.device_per_rank_bytes, 14000000000 + 4 * 236355840) << trainmem::to_string(z3);

  auto gpt3 = build_on_meta(trainmem::GPTOptions::gpt3_6_7b());
  EXPECT_EQ(trainmem::account(*gpt3).num_params, 6658404352);
  EXPECT_EQ(trainmem::predict_static_bytes(*gpt3, trainmem::Recipe::kMixedAdamW).total_bytes,
            106534469632);
}

// A 70 B-class model builds on meta with no allocation (time printed, not
// asserted).
TEST(GptTest, SeventyBillionBuildsOnMetaWithoutAllocating) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  const auto options = trainmem::GPTOptions::llama2_70b_shape();
  const auto before = tracker.stats();
  const auto t0 = std::chrono::steady_clock::now();
  auto model = build_on_meta(options);
  const auto t1 = std::chrono::steady_clock::now();
  const auto after = tracker.stats();
  std::printf("70B-class GPT on meta: %.1f ms, %lld allocations, %lld B\n",
              std::chrono::duration<double, std::milli>(t1 - t0).count(),
              static_cast<long long>(after.num_allocs - before.num_allocs),
              static_cast<long long>(after.allocated_bytes - before.allocated_bytes));
  EXPECT_EQ(after.num_allocs - before.num_allocs, 0);
  EXPECT_EQ(after.allocated_bytes - before.allocated_bytes, 0);
  EXPECT_EQ(trainmem::account(*model).num_params, 64728743936);
  EXPECT_EQ(trainmem::gpt_num_params(options), 64728743936);
  EXPECT_EQ(trainmem::predict_static_bytes(*model, trainmem::Recipe::kMixedAdamW).total_bytes,
            16 * 64728743936);
}

TEST(GptTest, ForwardGivesLogitsAndTheHeadIsTied) {
  const auto options = trainmem::GPTOptions().vocab_size(97).context_length(16).d_model(32).num_layers(2).num_heads(4);
  torch::manual_seed(0);
  trainmem::GPT model(options);
  EXPECT_EQ(trainmem::account(*model).num_params, trainmem::gpt_num_params(options));
  auto tokens = torch::randint(97, {3, 10});
  auto logits = model->forward(tokens);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{3, 10, 97}));
  auto loss = at::cross_entropy_loss(logits.flatten(0, 1), tokens.flatten());
  loss.backward();
  // Rows of wte for tokens never seen get gradient through the head only.
  EXPECT_GT(model->wte->weight.grad().abs().sum().item<double>(), 0.0);
  EXPECT_THROW(model->forward(torch::randint(97, {1, 17})), c10::Error);

  auto checkpointed = model->forward(tokens, trainmem::BlockCheckpointing::full(2));
  EXPECT_EQ(trainmem::max_abs_diff({checkpointed}, {logits}), 0.0);
}

// A GPT built on meta runs forward on meta: shapes, no data. LibTorch's C++
// has no meta kernel for Embedding's index_select (meta.h adds it) nor for
// LayerNorm and CPU flash attention (planner.h adds those).
TEST(GptTest, ForwardOnMetaGivesShapes) {
  auto model = build_on_meta(trainmem::GPTOptions::gpt2_small());
  trainmem::enable_cpu_meta_kernels();
  auto& tracker = trainmem::CpuMemoryTracker::install();
  const auto before = tracker.stats();
  auto tokens = at::zeros({2, 1024}, at::TensorOptions().dtype(at::kLong).device(at::kMeta));
  auto logits = model->forward(tokens);
  EXPECT_TRUE(logits.is_meta());
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 1024, 50257}));
  EXPECT_EQ(tracker.stats().num_allocs - before.num_allocs, 0);
}

// GPT's own init (embeddings at N(0, 0.02)) runs after its children's in
// materialize(), as in a CPU construction: the same values after the same seed.
TEST(GptTest, MaterializedEqualsCpuBuilt) {
  const auto options = trainmem::GPTOptions().vocab_size(97).context_length(16).d_model(32).num_layers(2).num_heads(4);
  torch::manual_seed(11);
  trainmem::GPT reference(options);
  torch::manual_seed(11);
  auto model = build_on_meta(options);
  trainmem::materialize(*model, at::kCPU);
  EXPECT_EQ(trainmem::max_abs_diff(model->parameters(), reference->parameters()), 0.0);
  EXPECT_LT(model->wte->weight.std().item<double>(), 0.03);
}

} // namespace
