// Multi-rank audits on loopback Gloo (distributed.h, distributed_trainer.h).
// Every figure is checked against a single-process run measured here.
//
// The launcher forks: each test runs its multi-rank runs before any
// single-process reference (OpenMP's pool does not survive fork), and ctest
// runs each test in a process of its own.

#include <chrono>
#include <set>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "trainmem/distributed.h"
#include "trainmem/distributed_trainer.h"
#include "trainmem/trainer.h"

namespace trainmem {
namespace {

// Small enough for 4 ranks on 2 cores; the seed's architecture.
TransformerOptions small_model() {
  return TransformerOptions().num_layers(2).d_model(64).num_heads(4).batch(8).seq_len(16);
}

DistributedTrainerOptions small_run(int64_t nproc) {
  return DistributedTrainerOptions()
      .trainer(TrainerOptions().model(small_model()).steps(2).keep_grads(true))
      .nproc(nproc)
      .timeout_ms(30'000);
}

int64_t fp32_param_bytes(const TransformerOptions& mo) {
  return 4 * transformer_num_params(mo);
}

double max_abs_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    m = std::max(m, (a[i] - b[i]).abs().max().item<double>());
  }
  return m;
}

std::string error_of(const DistributedTrainerOptions& o, double* seconds) {
  const auto t0 = std::chrono::steady_clock::now();
  std::string message;
  try {
    (void)train_distributed(o);
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return message;
}

TEST(DistributedTest, TwoAndFourRanksMatchSingleProcess) {
  // Multi-rank runs first (they fork), then the single-process references.
  const auto two = train_distributed(small_run(2));
  const auto four = train_distributed(small_run(4));

  const auto mo = small_model();
  const auto full = train(TrainerOptions().model(mo).steps(1).keep_grads(true));
  for (const auto* run : {&two, &four}) {
    const auto& r = run->report;
    const int64_t n = r.world_size;
    SCOPED_TRACE(fmt::format("{} ranks", n));
    ASSERT_EQ(static_cast<int64_t>(r.ranks.size()), n);
    EXPECT_EQ(r.backend, "gloo");
    // The single-process run at the shard's batch, measured here.
    const auto shard = train(TrainerOptions().model(TransformerOptions(mo).batch(mo.batch() / n)).steps(2));
    for (const auto& k : r.ranks) {
      SCOPED_TRACE(fmt::format("rank {}", k.rank));
      EXPECT_EQ(k.audit.saved_activation_bytes, shard.report.saved_activation_bytes)
          << "rank " << k.audit.saved_activation_bytes << " vs single process " << shard.report.saved_activation_bytes;
      ASSERT_EQ(k.audit.steps.size(), 2u);
      for (size_t s = 0; s < 2; ++s) {
        EXPECT_EQ(k.audit.steps[s].saved_activation_bytes, shard.report.steps[s].saved_activation_bytes);
      }
      // Static buckets: the same parameters, gradients and AdamW state.
      EXPECT_EQ(k.audit.static_bytes(), shard.report.static_bytes());
      // gradient_as_bucket_view off: the buckets hold a second copy of every gradient.
      EXPECT_EQ(k.communication_bytes, fp32_param_bytes(mo));
      int64_t sum = 0;
      for (auto b : k.bucket_bytes) {
        sum += b;
      }
      EXPECT_EQ(sum, k.communication_bytes);
    }
    // ZeRO-0: every rank holds params, grads and AdamW's m and v, 16 B/param.
    EXPECT_EQ(r.predicted_static_per_rank_bytes, 4 * fp32_param_bytes(mo));
    EXPECT_EQ(r.predicted_static_per_rank_bytes, r.ranks[0].audit.static_bytes());
    EXPECT_GE(r.peak_imbalance(), 1.0);
    EXPECT_LE(r.min_peak_bytes(), r.max_peak_bytes());
    // Averaged gradients of the shards = the full batch's gradients.
    ASSERT_FALSE(run->grads.empty());
    const double diff = max_abs_diff(run->grads, full.grads);
    EXPECT_LE(diff, 1e-6) << "max |grad difference| " << diff;
  }
}

TEST(DistributedTest, GradientAsBucketViewKeepsOneCopy) {
  auto o = small_run(2);
  o.data_parallel(DataParallelOptions().gradient_as_bucket_view(true));
  const auto viewed = train_distributed(o);
  const auto copied = train_distributed(small_run(2));
  const auto mo = small_model();
  const auto full = train(TrainerOptions().model(mo).steps(1).keep_grads(true));
  EXPECT_LE(max_abs_diff(viewed.grads, full.grads), 1e-6);
  for (size_t r = 0; r < 2; ++r) {
    const auto& v = viewed.report.ranks[r];
    const auto& c = copied.report.ranks[r];
    SCOPED_TRACE(fmt::format("rank {}", r));
    // The buckets are the gradients: the gradients bucket is their storage.
    EXPECT_EQ(v.communication_bytes, fp32_param_bytes(mo));
    EXPECT_EQ(v.audit.static_bytes(), c.audit.static_bytes());
    // In the optimizer step every gradient is live: as copies next to the
    // buckets, as views inside them. So the copies' optimizer peak is one
    // gradient copy higher. Not asserted to the byte: Gloo's threads
    // allocate a few small tensors (96 B seen) at moments that vary from run
    // to run, so the two runs' peaks may differ by that much besides.
    for (size_t s = 0; s < 2; ++s) {
      const auto vp = v.audit.steps[s].optimizer_peak_bytes, cp = c.audit.steps[s].optimizer_peak_bytes;
      EXPECT_NEAR(static_cast<double>(cp - vp), static_cast<double>(fp32_param_bytes(mo)), 1024.0)
          << "step " << s << ": optimizer peak as views " << vp << " vs copies " << cp;
    }
  }
}

TEST(DistributedTest, SmallBucketCapMakesSeveralBuckets) {
  // DDP's cap, first step in one bucket, then rebuilt in gradient order.
  const int64_t cap = 100 * 1024;
  auto o = small_run(2);
  o.data_parallel(DataParallelOptions().bucket_cap_bytes(cap).first_bucket_cap_bytes(cap));
  const auto run = train_distributed(o);
  const auto mo = small_model();
  const auto full = train(TrainerOptions().model(mo).steps(1).keep_grads(true));
  EXPECT_LE(max_abs_diff(run.grads, full.grads), 1e-6);
  for (const auto& k : run.report.ranks) {
    SCOPED_TRACE(fmt::format("rank {}", k.rank));
    EXPECT_EQ(k.communication_bytes, fp32_param_bytes(mo));
    ASSERT_GT(k.bucket_bytes.size(), 1u);
    int64_t sum = 0;
    for (auto b : k.bucket_bytes) {
      sum += b;
    }
    EXPECT_EQ(sum, fp32_param_bytes(mo));
    // A bucket closes once it reaches the cap, so none holds more than the cap
    // plus one parameter (the largest here: a 64 x 256 weight, 65,536 B).
    for (auto b : k.bucket_bytes) {
      EXPECT_LT(b, cap + 64 * 256 * 4) << b;
    }
    EXPECT_EQ(k.bucket_bytes, run.report.ranks[0].bucket_bytes);
  }
}

TEST(DistributedTest, KilledRankEndsTheRunNamingIt) {
  auto o = small_run(2).fail_rank(1).fail_mode("kill");
  double seconds = 0;
  const auto message = error_of(o, &seconds);
  EXPECT_NE(message.find("rank 1 of 2 was killed by signal 9 (SIGKILL)"), std::string::npos) << message;
  // Well inside the 30 s collective timeout: the launcher saw the death.
  EXPECT_LT(seconds, 10.0) << message;
}

TEST(DistributedTest, ThrowingRankIsNamedWithItsMessage) {
  auto o = small_run(4).fail_rank(2).fail_mode("throw").fail_step(1);
  double seconds = 0;
  const auto message = error_of(o, &seconds);
  EXPECT_NE(message.find("rank 2 of 4 failed: injected failure in step 1"), std::string::npos) << message;
  EXPECT_LT(seconds, 10.0) << message;
}

TEST(DistributedTest, DisagreeingModelIsReportedNotAveraged) {
  auto o = small_run(4).fail_rank(1).fail_mode("model");
  double seconds = 0;
  const auto message = error_of(o, &seconds);
  EXPECT_NE(message.find("disagree on the model"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 1: parameter values differ from rank 0's"), std::string::npos) << message;
  // Only the rank that differs is named.
  EXPECT_EQ(message.find("rank 2: "), std::string::npos) << message;
  EXPECT_EQ(message.find("rank 3: "), std::string::npos) << message;
  EXPECT_LT(seconds, 10.0) << message;
}

TEST(DistributedTest, BadOptionsNameTheValue) {
  auto expect_error = [](const DistributedTrainerOptions& o, const std::string& text) {
    try {
      check_distributed_trainer_options(o);
      ADD_FAILURE() << "no error for " << text;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(text), std::string::npos) << e.what_without_backtrace();
    }
  };
  expect_error(small_run(0), "expected nproc >= 1, but got 0");
  expect_error(small_run(3), "expected batch 8 to split into nproc 3 equal shards");
  expect_error(small_run(2).fail_mode("explode"), "\"explode\"");
  auto acc = small_run(2);
  acc.trainer().accumulation(2);
  expect_error(acc, "expected accumulation 1 with nproc > 1");
}

// The writers, over a report made by hand: two ranks, rank 1 the worse.
DistributedReport two_rank_report() {
  DistributedReport r;
  r.title = "t";
  r.backend = "gloo";
  r.world_size = 2;
  r.config = {{"nproc", "2"}};
  r.predicted_static_per_rank_bytes = 1600;
  r.prediction = "P = 100 x 16 B";
  for (int64_t k = 0; k < 2; ++k) {
    RankReport rank;
    rank.rank = k;
    rank.communication_bytes = 400;
    rank.bucket_bytes = {400};
    rank.origin_ns = 1'000'000 + k * 2'000;
    rank.audit.title = "t";
    rank.audit.buckets = {{"parameters", Category::kParameter, 400}, {"gradients", Category::kGradient, 400}};
    rank.audit.saved_activation_bytes = 1000 + k;
    rank.audit.peak_bytes = 3000 + 1000 * k;
    StepRecord s;
    s.peak_bytes = rank.audit.peak_bytes;
    s.backward_peak_bytes = rank.audit.peak_bytes;
    s.time_ms = 1.5;
    rank.audit.steps = {s};
    PhaseSpan p;
    p.begin_ns = 0;
    p.end_ns = 1000;
    p.peak_bytes = s.peak_bytes;
    rank.audit.phases = {p};
    TimelinePoint a, b;
    a.time_ns = 0;
    b.time_ns = 1000;
    b.bytes[0] = rank.audit.peak_bytes;
    rank.audit.series = {a, b};
    r.ranks.push_back(rank);
  }
  return r;
}

TEST(DistributedTest, WritersCarryEveryRank) {
  const auto r = two_rank_report();
  EXPECT_EQ(r.worst_rank(), 1);
  EXPECT_EQ(r.max_peak_bytes(), 4000);
  EXPECT_EQ(r.min_peak_bytes(), 3000);
  EXPECT_DOUBLE_EQ(r.peak_imbalance(), 4000.0 / 3500.0);

  const auto text = to_text(r);
  EXPECT_NE(text.find("peak: max 4,000 B, min 3,000 B, imbalance (max / mean) 1.143; worst rank 1"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("predicted, ZeRO-0"), std::string::npos) << text;

  const auto back = distributed_report_from_json(to_json(r));
  ASSERT_EQ(back.ranks.size(), 2u);
  EXPECT_EQ(back.ranks[1].audit.peak_bytes, 4000);
  EXPECT_EQ(back.ranks[1].audit.saved_activation_bytes, 1001);
  EXPECT_EQ(back.ranks[1].communication_bytes, 400);
  EXPECT_EQ(back.ranks[1].origin_ns, 1'002'000);
  EXPECT_EQ(back.predicted_static_per_rank_bytes, 1600);
  EXPECT_EQ(to_json(back), to_json(r));
  const auto doc = nlohmann::json::parse(to_json(r));
  EXPECT_EQ(doc["summary"]["worst_rank"], 1);
  EXPECT_EQ(doc["ranks"][0]["report"]["schema"], "trainmem/1");

  const auto html = to_html(r);
  EXPECT_NE(html.find("Content-Security-Policy"), std::string::npos);
  EXPECT_NE(html.find("rank 1 (worst)"), std::string::npos);

  const auto trace = nlohmann::json::parse(to_chrome_trace(r));
  std::set<int> pids;
  std::set<std::string> names;
  double rank1_phase_ts = -1;
  for (const auto& e : trace["traceEvents"]) {
    pids.insert(e["pid"].get<int>());
    if (e["name"] == "process_name") {
      names.insert(e["args"]["name"].get<std::string>());
    }
    if (e["pid"] == 1 && e["ph"] == "X") {
      rank1_phase_ts = e["ts"].get<double>();
    }
  }
  EXPECT_EQ(pids, (std::set<int>{0, 1}));
  EXPECT_EQ(names, (std::set<std::string>{"rank 0", "rank 1"}));
  EXPECT_DOUBLE_EQ(rank1_phase_ts, 2.0);  // rank 1 started 2,000 ns after rank 0

  EXPECT_THROW(distributed_report_from_json("{\"schema\": \"trainmem/1\"}"), c10::Error);
  EXPECT_THROW(distributed_report_from_json("not json"), c10::Error);
}

} // namespace
} // namespace trainmem
