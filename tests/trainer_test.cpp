#include "app/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "app/variants.h"
#include "trainmem/models/transformer.h"

namespace {

trainmem::TrainerOptions one_step() {
  return trainmem::TrainerOptions().steps(1);
}

int64_t bucket(const trainmem::AuditReport& r, const std::string& name) {
  for (const auto& b : r.buckets) {
    if (b.name == name) {
      return b.bytes;
    }
  }
  return -1;
}

// The defaults are the capstone's: the audit measures what the demo
// explains (none = 51,052,544 B), with AdamW's state after the first step.
TEST(TrainerTest, DefaultsAreTheCapstone) {
  const auto run = trainmem::train(trainmem::TrainerOptions());
  const auto& r = run.report;
  EXPECT_EQ(r.num_params, 1189632);
  EXPECT_EQ(bucket(r, "parameters"), 4758528);
  EXPECT_EQ(bucket(r, "gradients"), 4758528);
  EXPECT_EQ(bucket(r, "optimizer state (exp_avg)"), 4758528);
  EXPECT_EQ(bucket(r, "optimizer state (exp_avg_sq)"), 4758528);
  EXPECT_EQ(r.saved_activation_bytes, 51052544);
  EXPECT_EQ(r.predicted_activation_bytes, 50331648);
  ASSERT_EQ(r.steps.size(), 2u);
  ASSERT_EQ(r.phases.size(), 6u);
  for (const auto& s : r.steps) {
    EXPECT_EQ(s.saved_activation_bytes, 51052544);
    // The peak holds at least the parameters and what backward needs.
    EXPECT_GT(s.peak_bytes, 4758528 + 51052544) << "step " << s.step;
  }
  EXPECT_EQ(run.losses.size(), 2u);
  EXPECT_LT(run.losses[1], run.losses[0]);  // it trains
}

TEST(TrainerTest, CheckpointVariantsSaveWhatTheDemoExplains) {
  EXPECT_EQ(trainmem::train(one_step().checkpoint("full")).report.saved_activation_bytes, 3670016);
  EXPECT_EQ(trainmem::train(one_step().checkpoint("every_2")).report.saved_activation_bytes, 27361280);
  EXPECT_EQ(trainmem::train(one_step().checkpoint("selective")).report.saved_activation_bytes, 31981568);
}

// Gradient accumulation: k micro-batches give the full batch's
// gradients, and backward holds one micro-batch's activations.
TEST(TrainerTest, AccumulationMatchesTheFullBatch) {
  const auto full = trainmem::train(one_step().keep_grads(true));
  const auto acc = trainmem::train(one_step().keep_grads(true).accumulation(4));
  ASSERT_EQ(full.grads.size(), acc.grads.size());
  const double diff = trainmem::max_abs_diff(full.grads, acc.grads);
  EXPECT_LT(diff, 1e-6) << "max abs diff " << diff;
  EXPECT_EQ(acc.report.saved_activation_bytes, 51052544 / 4);
  EXPECT_LT(acc.report.steps[0].peak_bytes, full.report.steps[0].peak_bytes);
  EXPECT_NEAR(acc.losses[0], full.losses[0], 1e-6);
  // The four micro-batches were made before the audit: their bytes move from
  // unknown to INPUT at the step's start, in time order with the rest.
  const auto& events = acc.timeline.events;
  for (size_t i = 1; i < events.size(); ++i) {
    ASSERT_LE(events[i - 1].time_ns, events[i].time_ns) << "event " << i;
  }
  const auto series = trainmem::live_bytes(acc.timeline);
  EXPECT_EQ(series.back().bytes[static_cast<int>(trainmem::Category::kInput)], 4 * 4 * 64 * 128 * 4);
}

TEST(TrainerTest, PrecisionRungs) {
  const auto bf16 = trainmem::train(one_step().precision(trainmem::Precision::kBf16));
  EXPECT_EQ(bucket(bf16.report, "parameters"), 1189632 * 2);
  EXPECT_EQ(bucket(bf16.report, "gradients"), 1189632 * 2);
  EXPECT_EQ(bucket(bf16.report, "optimizer state (exp_avg)"), 1189632 * 2);
  // Pure bf16 halves the fp32 run's activations, except SDPA's log-sum-exp
  // (kept in fp32: half of its 98,304 B stays) and the loss's input (the
  // loss is taken in fp32, so pow saves the fp32 copy: 524,288 B, not half).
  EXPECT_EQ(bf16.report.saved_activation_bytes, 51052544 / 2 + 98304 / 2 + 524288 / 2);

  const auto amp = trainmem::train(one_step().precision(trainmem::Precision::kBf16Autocast));
  EXPECT_EQ(bucket(amp.report, "parameters"), 1189632 * 4);
  EXPECT_GT(amp.report.saved_activation_bytes, 51052544 / 2);
  EXPECT_LT(amp.report.saved_activation_bytes, 51052544);
}

TEST(TrainerTest, OptimizerInBackwardFreesGradients) {
  const auto run = trainmem::train(one_step().optimizer_in_backward(true));
  EXPECT_EQ(bucket(run.report, "gradients"), 0);
  EXPECT_EQ(bucket(run.report, "optimizer state (exp_avg)"), 4758528);
  ASSERT_EQ(run.report.phases.size(), 3u);
}

TEST(TrainerTest, BadOptionsNameTheValue) {
  auto message = [](const trainmem::TrainerOptions& o) {
    try {
      trainmem::check_trainer_options(o);
    } catch (const c10::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  using trainmem::TrainerOptions;
  using trainmem::TransformerOptions;
  EXPECT_NE(message(TrainerOptions().model(TransformerOptions().num_heads(5))).find("d_model 128 and heads 5"),
            std::string::npos);
  EXPECT_NE(message(TrainerOptions().checkpoint("every_0")).find("\"every_0\""), std::string::npos);
  EXPECT_NE(message(TrainerOptions().optimizer("lion")).find("\"lion\""), std::string::npos);
  EXPECT_NE(message(TrainerOptions().accumulation(3)).find("batch 16 to split into accumulation 3"),
            std::string::npos);
  EXPECT_NE(message(TrainerOptions().device("tpu")).find("\"tpu\""), std::string::npos);
  EXPECT_NE(message(TrainerOptions().steps(0)).find("steps >= 1, but got 0"), std::string::npos);
  EXPECT_THROW(trainmem::parse_precision("fp8"), c10::Error);
  EXPECT_EQ(trainmem::parse_precision("bf16-autocast"), trainmem::Precision::kBf16Autocast);
}

// On a GPU the same audit reads the caching allocator: exact static bytes,
// the capstone's saved bytes (nearly), and peaks per phase from its peak statistics.
TEST(TrainerCudaTest, CapstoneOnTheGpu) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const auto run = trainmem::train(one_step().device("cuda"));
  const auto& r = run.report;
  EXPECT_EQ(r.device, "cuda:0");
  EXPECT_EQ(bucket(r, "parameters"), 4758528);
  // CUDA's attention kernels save other side tensors than CPU's (seeds,
  // log-sum-exp layout): within 2 % of the CPU count, not byte for byte.
  EXPECT_NEAR(static_cast<double>(r.saved_activation_bytes) / 51052544.0, 1.0, 0.02);
  ASSERT_EQ(r.steps.size(), 1u);
  EXPECT_GT(r.steps[0].backward_peak_bytes, 4758528 + 51052544);
  EXPECT_GE(r.device_stats.reserved_bytes, r.device_stats.allocated_bytes);
  EXPECT_TRUE(r.series.empty());  // no CPU timeline on CUDA
}

} // namespace
