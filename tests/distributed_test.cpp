// Multi-rank audits on loopback Gloo (distributed.h, distributed_trainer.h).
// Every figure is checked against a single-process run measured here.
//
// The launcher forks: each test runs its multi-rank runs before any
// single-process reference (OpenMP's pool does not survive fork), and ctest
// runs each test in a process of its own.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <set>

#include <pthread.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "trainmem/allocator.h"
#include "trainmem/distributed.h"
#include "app/distributed_trainer.h"
#include "app/trainer.h"

namespace trainmem {
namespace {

// Small enough for 4 ranks on 2 cores; the capstone's architecture, on an
// input of (8, 16, 64).
TransformerOptions small_model() {
  return TransformerOptions().num_layers(2).d_model(64).num_heads(4);
}
constexpr int64_t kSmallBatch = 8;

TrainerOptions small_trainer() {
  return TrainerOptions().model(small_model()).batch(kSmallBatch).seq_len(16);
}

DistributedTrainerOptions small_run(int64_t nproc) {
  return DistributedTrainerOptions()
      .trainer(small_trainer().steps(2).keep_grads(true))
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
  const auto full = train(small_trainer().steps(1).keep_grads(true));
  for (const auto* run : {&two, &four}) {
    const auto& r = run->report;
    const int64_t n = r.world_size;
    SCOPED_TRACE(fmt::format("{} ranks", n));
    ASSERT_EQ(static_cast<int64_t>(r.ranks.size()), n);
    EXPECT_EQ(r.backend, "gloo");
    // The single-process run at the shard's batch, measured here.
    const auto shard = train(small_trainer().batch(kSmallBatch / n).steps(2));
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

// The threads of this process (Linux: one entry each in /proc/self/task).
int thread_count() {
  int n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    ++n;
  }
  return n;
}

std::atomic<int> g_most_threads_at_fork{0};

// The launcher forks its ranks before it starts the store's server thread
// (or any other): a thread running at fork() may hold a lock that the
// child, which has none of the parent's other threads, then waits on for
// ever (a 4-rank run in CI once had a rank that never reached the store).
TEST(DistributedTest, RanksAreForkedFromASingleThread) {
  ASSERT_EQ(thread_count(), 1) << "this test must start with one thread";
  ASSERT_EQ(pthread_atfork([] { g_most_threads_at_fork = std::max(g_most_threads_at_fork.load(), thread_count()); },
                           nullptr, nullptr),
            0);
  const auto run = train_distributed(small_run(4));
  EXPECT_EQ(run.report.ranks.size(), 4u);
  EXPECT_EQ(g_most_threads_at_fork.load(), 1);
}

TEST(DistributedTest, GradientAsBucketViewKeepsOneCopy) {
  auto o = small_run(2);
  o.data_parallel(DataParallelOptions().gradient_as_bucket_view(true));
  const auto viewed = train_distributed(o);
  const auto copied = train_distributed(small_run(2));
  const auto mo = small_model();
  const auto full = train(small_trainer().steps(1).keep_grads(true));
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
      std::cout << fmt::format("rank {} step {}: optimizer peak as views {} B, as copies {} B, difference {} B\n", r,
                               s, vp, cp, cp - vp);
      EXPECT_NEAR(static_cast<double>(cp - vp), static_cast<double>(fp32_param_bytes(mo)), 1024.0)
          << "step " << s << ": optimizer peak as views " << vp << " vs copies " << cp;
    }
  }
}

TEST(DistributedTest, CallerTensorsDoNotCountInRanks) {
  // The ranks are forked from this process: what it holds (tracked by the
  // CPU tracker) is inherited, but it is not the ranks' (Note [Blocks
  // inherited through fork]). Before the fix every rank's peaks were higher
  // by the bytes held here.
  CpuMemoryTracker::install();
  const auto without = train_distributed(small_run(2));
  const int64_t held_bytes = 4 * 1024 * 1024;
  const auto held = at::empty({held_bytes}, at::kByte);
  ASSERT_GE(CpuMemoryTracker::install().stats().allocated_bytes, held_bytes);
  const auto with = train_distributed(small_run(2));
  for (size_t r = 0; r < 2; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const auto& a = without.report.ranks[r].audit;
    const auto& b = with.report.ranks[r].audit;
    ASSERT_EQ(a.steps.size(), b.steps.size());
    // Gloo's threads allocate a few small tensors at moments that vary (96 B seen).
    EXPECT_NEAR(static_cast<double>(b.peak_bytes - a.peak_bytes), 0.0, 1024.0)
        << "peak " << b.peak_bytes << " with " << held_bytes << " B held here, " << a.peak_bytes << " without";
    for (size_t s = 0; s < a.steps.size(); ++s) {
      EXPECT_NEAR(static_cast<double>(b.steps[s].optimizer_peak_bytes - a.steps[s].optimizer_peak_bytes), 0.0, 1024.0)
          << "step " << s;
    }
  }
  EXPECT_EQ(held.numel(), held_bytes);
}

TEST(DistributedTest, SmallBucketCapMakesSeveralBuckets) {
  // DDP's cap, first step in one bucket, then rebuilt in gradient order.
  const int64_t cap = 100 * 1024;
  auto o = small_run(2);
  o.data_parallel(DataParallelOptions().bucket_cap_bytes(cap).first_bucket_cap_bytes(cap));
  const auto run = train_distributed(o);
  const auto mo = small_model();
  const auto full = train(small_trainer().steps(1).keep_grads(true));
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

TEST(DistributedTest, CommunicationBuffersHaveTheirOwnCategory) {
  // The buckets are made before the audit and rebuilt between steps 0 and 1:
  // in every rank's timeline, its peaks and its trace they are COMMUNICATION.
  const auto copied = train_distributed(small_run(2).trainer(small_trainer().steps(2)));
  auto view_options = small_run(2);
  view_options.data_parallel(DataParallelOptions().gradient_as_bucket_view(true));
  const auto viewed = train_distributed(view_options);
  const int comm = static_cast<int>(Category::kCommunication);
  const int unknown = static_cast<int>(Category::kUnknown);
  for (const auto& k : copied.report.ranks) {
    SCOPED_TRACE(fmt::format("rank {}", k.rank));
    ASSERT_EQ(k.communication_bytes, fp32_param_bytes(small_model()));
    // At the start (the buckets of the first step), at every step's peak
    // and at the end (the rebuilt buckets): exactly the buckets' bytes.
    ASSERT_FALSE(k.audit.series.empty());
    EXPECT_EQ(k.audit.series.front().bytes[comm], k.communication_bytes);
    EXPECT_EQ(k.audit.series.back().bytes[comm], k.communication_bytes);
    EXPECT_EQ(k.audit.peak_by_category[comm], k.communication_bytes);
    for (const auto& span : k.audit.phases) {
      EXPECT_EQ(span.peak_by_category[comm], k.communication_bytes) << span_label(span) << " of step " << span.step;
      // Before, the rebuilt buckets were "unknown" (made between steps).
      EXPECT_LT(span.peak_by_category[unknown], 1024) << span_label(span) << " of step " << span.step;
    }
  }
  // The trace's counters (one process per rank) carry the category.
  const auto trace = nlohmann::json::parse(to_chrome_trace(copied.report));
  int64_t counters = 0;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "C") {
      ++counters;
      ASSERT_TRUE(e["args"].contains("COMMUNICATION")) << e.dump();
      EXPECT_LE(e["args"]["COMMUNICATION"].get<int64_t>(), 2 * fp32_param_bytes(small_model())) << e.dump();
    }
  }
  EXPECT_GT(counters, 0);
  // As bucket views the buffers are the gradients' storage: GRADIENT, no COMMUNICATION.
  for (const auto& k : viewed.report.ranks) {
    SCOPED_TRACE(fmt::format("viewed rank {}", k.rank));
    for (const auto& p : k.audit.series) {
      ASSERT_EQ(p.bytes[comm], 0);
    }
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

TEST(DistributedTest, FirstBucketCapFollowsDdp) {
  // torch/nn/parallel/distributed.py (_BucketCapacityConfig.create): the
  // 1 MiB first bucket only while bucket_cap_mb is not given.
  const int64_t mib = 1024 * 1024;
  DataParallelOptions unset;
  EXPECT_EQ(unset.effective_bucket_cap_bytes(), 25 * mib);
  EXPECT_EQ(unset.effective_first_bucket_cap_bytes(), mib);
  const auto given25 = DataParallelOptions().bucket_cap_bytes(25 * mib);
  EXPECT_EQ(given25.effective_bucket_cap_bytes(), 25 * mib);
  EXPECT_EQ(given25.effective_first_bucket_cap_bytes(), 25 * mib);
  const auto small = DataParallelOptions().bucket_cap_bytes(104857);
  EXPECT_EQ(small.effective_first_bucket_cap_bytes(), 104857);
  const auto both = DataParallelOptions().bucket_cap_bytes(4 * mib).first_bucket_cap_bytes(mib / 2);
  EXPECT_EQ(both.effective_bucket_cap_bytes(), 4 * mib);
  EXPECT_EQ(both.effective_first_bucket_cap_bytes(), mib / 2);
}

// NCCL ranks (Note [NCCL ranks]): on a GPU machine with a CUDA build, one
// rank per device, at most 2 (1 on a one-GPU machine: NCCL refuses two ranks
// on one device). Skips, saying why, everywhere else.
TEST(DistributedCudaTest, NcclRanksMatchSingleProcess) {
  if (!nccl_available()) {
    GTEST_SKIP() << "this trainmem was built without NCCL (a CPU LibTorch, or no USE_C10D_NCCL / nccl.h)";
  }
  const int64_t devices = cuda_device_count_before_fork();
  if (devices == 0) {
    GTEST_SKIP() << "no CUDA device visible: NCCL ranks need a GPU";
  }
  const int64_t nproc = std::min<int64_t>(devices, 2);
  auto o = small_run(nproc);
  o.trainer().device("cuda");
  const auto run = train_distributed(o);  // forks before this process touches CUDA
  const auto mo = small_model();
  EXPECT_EQ(run.report.backend, "nccl");
  ASSERT_EQ(static_cast<int64_t>(run.report.ranks.size()), nproc);
  const auto shard = train(small_trainer().batch(kSmallBatch / nproc).steps(2).device("cuda"));
  const auto full = train(small_trainer().steps(1).keep_grads(true).device("cuda"));
  for (const auto& k : run.report.ranks) {
    SCOPED_TRACE(fmt::format("rank {} of {}", k.rank, nproc));
    EXPECT_EQ(k.audit.device, fmt::format("cuda:{}", k.rank));
    EXPECT_EQ(k.audit.saved_activation_bytes, shard.report.saved_activation_bytes);
    EXPECT_EQ(k.audit.static_bytes(), shard.report.static_bytes());
    EXPECT_EQ(k.communication_bytes, fp32_param_bytes(mo));
  }
  std::vector<at::Tensor> full_cpu;
  for (const auto& g : full.grads) {
    full_cpu.push_back(g.to(at::kCPU));
  }
  EXPECT_LE(max_abs_diff(run.grads, full_cpu), 1e-5);
  // More ranks than devices is refused before anything is forked.
  auto too_many = small_run(2 * devices <= 8 ? 2 * devices : 8);
  too_many.trainer().device("cuda");
  double seconds = 0;
  const auto message = error_of(too_many, &seconds);
  EXPECT_NE(message.find("NCCL needs one CUDA device per rank"), std::string::npos) << message;
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
