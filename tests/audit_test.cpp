#include "trainmem/audit.h"

#include <algorithm>
#include <map>
#include <string>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/rnn.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include "trainmem/allocator.h"
#include "trainmem/meter.h"
#include "trainmem/report.h"
#include "support/find_bucket.h"

namespace {

using trainmem::Category;
using trainmem::Phase;

torch::nn::Sequential gelu_mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(32, 256), torch::nn::GELU(), torch::nn::Linear(256, 32));
}

constexpr int64_t kMlpParamBytes = 4 * (32 * 256 + 256 + 256 * 32 + 32);  // 66,688

int64_t at_cat(const trainmem::TimelinePoint& p, Category c) {
  return p.bytes[static_cast<int>(c)];
}

// The last point at or before `t`.
trainmem::TimelinePoint point_at(const std::vector<trainmem::TimelinePoint>& series, int64_t t) {
  trainmem::TimelinePoint best = series.front();
  for (const auto& p : series) {
    if (p.time_ns > t) {
      break;
    }
    best = p;
  }
  return best;
}

void train_step(torch::nn::Sequential& mlp, torch::optim::SGD& opt, trainmem::Audit& audit, int micro_batches = 1) {
  auto step = audit.step();
  opt.zero_grad();
  for (int i = 0; i < micro_batches; ++i) {
    auto x = torch::randn({16, 32});
    audit.mark_input(x);
    auto loss = mlp->forward(x).pow(2).sum();
    loss.backward();
  }
  opt.step();
}

// The MLP through the audit: the meter's exact saved bytes, the static
// buckets, the phases, and a timeline whose categories and peak agree with
// the allocator byte for byte.
TEST(AuditTest, MlpStepIsExplainedByteForByte) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  auto mlp = gelu_mlp();
  torch::optim::SGD opt(mlp->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  trainmem::Audit audit(*mlp, &opt);
  train_step(mlp, opt, audit);
  const int64_t live_after = tracker.stats().allocated_bytes;

  const auto r = audit.report();
  EXPECT_EQ(r.saved_activation_bytes, 36864);
  EXPECT_EQ(r.num_params, 16672);
  ASSERT_EQ(r.buckets.size(), 3u);
  EXPECT_EQ(r.buckets[0].bytes, kMlpParamBytes);  // parameters
  EXPECT_EQ(r.buckets[1].bytes, kMlpParamBytes);  // gradients
  EXPECT_EQ(r.buckets[2].name, "optimizer state (momentum_buffer)");
  EXPECT_EQ(r.buckets[2].bytes, kMlpParamBytes);

  ASSERT_EQ(r.phases.size(), 3u);
  EXPECT_EQ(r.phases[0].phase, Phase::kForward);
  EXPECT_EQ(r.phases[1].phase, Phase::kBackward);
  EXPECT_EQ(r.phases[2].phase, Phase::kOptimizerStep);

  const auto& t = audit.timeline();
  const auto all = trainmem::live_bytes(t);
  // The series ends where the allocator is, and its top is the step's peak.
  EXPECT_EQ(all.back().total_bytes(), live_after);
  int64_t top = 0;
  for (const auto& p : all) {
    top = std::max(top, p.total_bytes());
  }
  ASSERT_EQ(r.steps.size(), 1u);
  EXPECT_EQ(top, r.steps[0].peak_bytes);
  EXPECT_EQ(r.peak_bytes, r.steps[0].peak_bytes);
  EXPECT_EQ(r.peak_by_category[static_cast<int>(Category::kParameter)], kMlpParamBytes);

  // When backward starts: the saved tensors less x (INPUT), plus the loss
  // and backward's seed gradient (ones_like(loss), made before the engine
  // starts), 4 B each.
  const auto before_backward = point_at(all, r.phases[1].begin_ns);
  EXPECT_EQ(at_cat(before_backward, Category::kActivation), 36864 - 16 * 32 * 4 + 4 + 4);
  EXPECT_EQ(at_cat(before_backward, Category::kInput), 16 * 32 * 4);
  // At the end: the new gradients and momentum buffers are named as such.
  EXPECT_EQ(at_cat(all.back(), Category::kGradient), kMlpParamBytes);
  EXPECT_EQ(at_cat(all.back(), Category::kOptimizerState), kMlpParamBytes);
  EXPECT_EQ(at_cat(all.back(), Category::kActivation), 0);
}

TEST(AuditTest, SecondStepFreesLastStepsGradientsAsGradients) {
  trainmem::CpuMemoryTracker::install();
  auto mlp = gelu_mlp();
  torch::optim::SGD opt(mlp->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  trainmem::Audit audit(*mlp, &opt);
  train_step(mlp, opt, audit);
  train_step(mlp, opt, audit);
  const auto all = trainmem::live_bytes(audit.timeline());
  // zero_grad() of step 1 frees step 0's gradients; step 1 makes new ones.
  EXPECT_EQ(at_cat(all.back(), Category::kGradient), kMlpParamBytes);
  EXPECT_EQ(at_cat(all.back(), Category::kOptimizerState), kMlpParamBytes);
  for (const auto& p : all) {
    for (auto b : p.bytes) {
      ASSERT_GE(b, 0) << "a category went negative at " << p.time_ns;
    }
  }
  EXPECT_EQ(audit.num_steps(), 2);
  EXPECT_EQ(audit.report().phases.size(), 6u);
}

// A long run takes its timeline in pieces (Note [The event log's pages]:
// each new log is reserved and populated afresh): each piece holds its own
// steps, every step of one loop logs as many events, time runs on, and each
// piece starts from what the last one ended with.
TEST(AuditTest, TakenTimelinesHoldTheirOwnSteps) {
  trainmem::CpuMemoryTracker::install();
  auto mlp = gelu_mlp();
  torch::optim::SGD opt(mlp->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  trainmem::Audit audit(*mlp, &opt);
  std::vector<trainmem::Timeline> pieces;
  for (int piece = 0; piece < 3; ++piece) {
    for (int i = 0; i < 3; ++i) {
      train_step(mlp, opt, audit);
    }
    pieces.push_back(audit.take_timeline());
    EXPECT_TRUE(audit.timeline().events.empty());
  }
  std::map<int64_t, int64_t> events_per_step;
  int64_t last_ns = -1;
  for (size_t piece = 0; piece < pieces.size(); ++piece) {
    for (const auto& e : pieces[piece].events) {
      EXPECT_GE(e.step, static_cast<int64_t>(3 * piece));
      EXPECT_LT(e.step, static_cast<int64_t>(3 * piece + 3));
      EXPECT_GE(e.time_ns, last_ns);
      last_ns = e.time_ns;
      ++events_per_step[e.step];
    }
  }
  ASSERT_EQ(events_per_step.size(), 9u);
  // Step 0 makes the momentum buffers; from step 1 on each step frees the
  // last one's gradients, in a new piece as well.
  for (int64_t step = 2; step < 9; ++step) {
    EXPECT_EQ(events_per_step[step], events_per_step[1]) << "step " << step;
  }
  // Each piece starts from what the last one ended with, by category, and
  // none goes negative.
  for (size_t piece = 1; piece < pieces.size(); ++piece) {
    const auto last = trainmem::live_bytes(pieces[piece - 1]).back();
    const auto series = trainmem::live_bytes(pieces[piece]);
    EXPECT_EQ(series.front().bytes, last.bytes) << "piece " << piece;
    EXPECT_EQ(at_cat(series.front(), Category::kGradient), kMlpParamBytes);
    EXPECT_EQ(at_cat(series.back(), Category::kOptimizerState), kMlpParamBytes);
    for (const auto& p : series) {
      for (auto b : p.bytes) {
        ASSERT_GE(b, 0) << "piece " << piece << ": a category went negative at " << p.time_ns;
      }
    }
  }
}

// The PyTorch examples' loop makes each batch before the step and frees it
// after: INPUT holds one batch at a time and no category goes negative.
TEST(AuditTest, BatchesMadeOutsideTheStepAreInputs) {
  trainmem::CpuMemoryTracker::install();
  auto mlp = gelu_mlp();
  torch::optim::SGD opt(mlp->parameters(), 0.01);
  trainmem::Audit audit(*mlp, &opt);
  for (int i = 0; i < 3; ++i) {
    auto x = torch::randn({16, 32});
    auto step = audit.step();
    audit.mark_input(x);
    opt.zero_grad();
    mlp->forward(x).pow(2).sum().backward();
    opt.step();
  }
  const auto all = trainmem::live_bytes(audit.timeline());
  for (const auto& p : all) {
    for (auto b : p.bytes) {
      ASSERT_GE(b, 0) << "a category went negative at " << p.time_ns;
    }
    ASSERT_LE(at_cat(p, Category::kInput), 16 * 32 * 4);
  }
  EXPECT_EQ(at_cat(all.back(), Category::kInput), 16 * 32 * 4);
}

TEST(AuditTest, AccumulationAlternatesForwardAndBackward) {
  trainmem::CpuMemoryTracker::install();
  auto mlp = gelu_mlp();
  torch::optim::SGD opt(mlp->parameters(), 0.01);
  trainmem::Audit audit(*mlp, &opt);
  train_step(mlp, opt, audit, 3);
  const auto r = audit.report();
  std::vector<Phase> phases;
  for (const auto& p : r.phases) {
    phases.push_back(p.phase);
  }
  const std::vector<Phase> expected = {Phase::kForward, Phase::kBackward, Phase::kForward, Phase::kBackward,
                                       Phase::kForward, Phase::kBackward, Phase::kOptimizerStep};
  EXPECT_EQ(phases, expected);
  // Saved bytes are one micro-batch's, not three.
  EXPECT_EQ(r.saved_activation_bytes, 36864);
  EXPECT_EQ(r.steps[0].saved_activation_bytes, 36864);
}

TEST(AuditTest, GradientsAreBitIdenticalWithAndWithoutAudit) {
  trainmem::CpuMemoryTracker::install();
  auto run = [](bool audited) {
    auto mlp = gelu_mlp();
    torch::manual_seed(1);
    auto x = torch::randn({16, 32});
    std::unique_ptr<trainmem::Audit> audit;
    if (audited) {
      audit = std::make_unique<trainmem::Audit>(*mlp);
      audit->begin_step();
    }
    mlp->forward(x).pow(2).sum().backward();
    if (audited) {
      audit->end_step();
    }
    std::vector<at::Tensor> g;
    for (const auto& p : mlp->parameters()) {
      g.push_back(p.grad().clone());
    }
    return g;
  };
  const auto a = run(false);
  const auto b = run(true);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::equal(a[i], b[i])) << "parameter " << i;
  }
}

TEST(AuditTest, MisuseIsAClearError) {
  trainmem::CpuMemoryTracker::install();
  auto mlp = gelu_mlp();
  trainmem::Audit audit(*mlp);
  EXPECT_THROW(audit.end_step(), c10::Error);
  audit.begin_step();
  try {
    audit.begin_step();
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("step 0 is still open"), std::string::npos) << e.what();
  }
  EXPECT_THROW(audit.report(), c10::Error);
  EXPECT_THROW(audit.mark_input(at::Tensor()), c10::Error);
  audit.end_step();
  EXPECT_EQ(audit.report().steps.size(), 1u);
  EXPECT_THROW(trainmem::Audit(*mlp, nullptr, c10::Device(c10::kMeta)), c10::Error);
  EXPECT_THROW(trainmem::Audit(*mlp, nullptr, c10::Device(c10::kCPU), trainmem::AuditOptions().max_points(1)),
               c10::Error);
  try {
    trainmem::Audit(*mlp, nullptr, c10::Device(c10::kCPU), trainmem::AuditOptions().meter_every(-1));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("meter_every >= 0 (0: the steps that differ; n: every n-th step), but got -1"),
              std::string::npos)
        << e.what();
  }
}

// Audits the 32-256-32 MLP one step per entry of `batch` (its rows), with an
// `Optimizer` made with `lr`: the report and the timeline's event count.
template <typename Optimizer>
std::pair<trainmem::AuditReport, size_t> audit_mlp_steps(const std::vector<int64_t>& batch,
                                                         trainmem::AuditOptions options, double lr) {
  torch::manual_seed(0);
  auto mlp = gelu_mlp();
  Optimizer opt(mlp->parameters(), lr);
  trainmem::Audit audit(*mlp, &opt, c10::Device(c10::kCPU), std::move(options));
  for (const auto b : batch) {
    auto audited = audit.step();
    opt.zero_grad();
    mlp->forward(torch::randn({b, 32})).pow(2).sum().backward();
    opt.step();
  }
  return std::make_pair(audit.report(), audit.timeline().events.size());
}

// AuditOptions::meter_every(3) over seven steps whose batch changes: steps
// 0, 3 and 6 are metered, each exactly as an audit that meters every step
// (2,304 B saved per sample: the MLP's 36,864 B for 16); the others
// are marked unmetered and carry the last metered figure, and none repeated
// the metered step before it (each batch differs from it), so none is
// known; the peaks and the timeline are every step's all the same.
TEST(AuditTest, MeterEveryNthStepMetersThoseStepsExactly) {
  trainmem::CpuMemoryTracker::install();
  const std::vector<int64_t> batch = {16, 8, 24, 8, 16, 24, 8};
  const auto [every, every_events] =
      audit_mlp_steps<torch::optim::SGD>(batch, trainmem::AuditOptions().meter_every(1), 0.01);
  const auto [third, third_events] =
      audit_mlp_steps<torch::optim::SGD>(batch, trainmem::AuditOptions().meter_every(3), 0.01);
  ASSERT_EQ(every.steps.size(), batch.size());
  ASSERT_EQ(third.steps.size(), batch.size());
  int64_t last_metered = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i));
    EXPECT_TRUE(every.steps[i].metered);
    EXPECT_EQ(every.steps[i].saved_activation_bytes, 2304 * batch[i]);
    EXPECT_EQ(third.steps[i].metered, i % 3 == 0);
    EXPECT_EQ(third.steps[i].repeats, -1);
    if (i % 3 == 0) {
      last_metered = every.steps[i].saved_activation_bytes;
    }
    EXPECT_EQ(third.steps[i].saved_activation_bytes, last_metered);
    EXPECT_EQ(third.steps[i].peak_bytes, every.steps[i].peak_bytes);
    EXPECT_EQ(third.steps[i].backward_peak_bytes, every.steps[i].backward_peak_bytes);
  }
  EXPECT_EQ(third_events, every_events);
  EXPECT_EQ(third.saved_activation_bytes, 2304 * 8);  // step 6's
  EXPECT_EQ(third.peak_by_category, every.peak_by_category);
  // The summary's saved bytes are over the metered steps alone (16, 8, 8).
  const auto sum = trainmem::summarize_steps(third.steps);
  EXPECT_EQ(sum.saved_activation_bytes.min, 2304 * 8);
  EXPECT_EQ(sum.saved_activation_bytes.median, 2304 * 8);
  EXPECT_EQ(sum.saved_activation_bytes.max, 2304 * 16);
  const auto note = std::find_if(third.notes.begin(), third.notes.end(),
                                 [](const std::string& n) { return n.find("meter_every") != std::string::npos; });
  ASSERT_NE(note, third.notes.end());
  EXPECT_EQ(*note,
            "the meter ran on 3 of 7 steps (AuditOptions::meter_every(3): steps 0, 3, 6, ...); 4 steps (1, 2, 4, 5) "
            "did not, and their saved bytes are not known; the saved bytes shown are step 6's");
  // Which steps were metered survives a JSON round trip.
  const auto back = trainmem::report_from_json(trainmem::to_json(third));
  ASSERT_EQ(back.steps.size(), batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    EXPECT_EQ(back.steps[i].metered, i % 3 == 0) << "step " << i;
  }
}

// The default schedule (AuditOptions::meter_every(0)) on a loop with Adam
// whose batch shrinks once (step 14, as an epoch's last batch): steps 0 and
// 1 differ (Adam makes its state in step 0), 1 and 2 are the same, so the
// meter skips steps 3 to 11, each of which repeats step 2 allocation for
// allocation; it runs again at step 12 (one in ten); step 14 makes other
// allocations, so its saved bytes are not known and steps 15 and 16 are
// metered. Every step known has an every-step audit's saved bytes exactly,
// and peaks and timeline are the same.
TEST(AuditTest, DefaultMetersTheStepsThatDiffer) {
  trainmem::CpuMemoryTracker::install();
  std::vector<int64_t> batch(20, 16);
  batch[14] = 8;
  auto run = [&](trainmem::AuditOptions options) {
    return audit_mlp_steps<torch::optim::Adam>(batch, std::move(options), 1e-3);
  };
  const auto [every, every_events] = run(trainmem::AuditOptions().meter_every(1));
  const auto [fresh, fresh_events] = run(trainmem::AuditOptions());
  ASSERT_EQ(fresh.steps.size(), batch.size());
  std::vector<int64_t> metered;
  for (size_t i = 0; i < batch.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i));
    const auto& st = fresh.steps[i];
    EXPECT_TRUE(every.steps[i].metered);
    EXPECT_EQ(every.steps[i].repeats, -1);
    EXPECT_EQ(every.steps[i].saved_activation_bytes, 2304 * batch[i]);
    if (st.metered) {
      metered.push_back(st.step);
      EXPECT_EQ(st.repeats, -1);
    }
    if (st.metered || st.repeats >= 0) {
      EXPECT_EQ(st.saved_activation_bytes, every.steps[i].saved_activation_bytes);
    }
    EXPECT_EQ(st.peak_bytes, every.steps[i].peak_bytes);
    EXPECT_EQ(st.backward_peak_bytes, every.steps[i].backward_peak_bytes);
  }
  EXPECT_EQ(metered, (std::vector<int64_t>{0, 1, 2, 12, 15, 16}));
  for (size_t i = 3; i <= 11; ++i) {
    EXPECT_EQ(fresh.steps[i].repeats, 2) << "step " << i;
  }
  EXPECT_EQ(fresh.steps[13].repeats, 12);
  EXPECT_EQ(fresh.steps[14].repeats, -1);  // batch 8: other allocations
  EXPECT_FALSE(fresh.steps[14].metered);
  for (size_t i = 17; i < batch.size(); ++i) {
    EXPECT_EQ(fresh.steps[i].repeats, 16) << "step " << i;
  }
  EXPECT_EQ(fresh_events, every_events);
  EXPECT_EQ(fresh.peak_by_category, every.peak_by_category);
  EXPECT_EQ(fresh.saved_activation_bytes, 2304 * 16);
  const auto note = std::find_if(fresh.notes.begin(), fresh.notes.end(),
                                 [](const std::string& n) { return n.find("meter_every") != std::string::npos; });
  ASSERT_NE(note, fresh.notes.end());
  EXPECT_EQ(*note,
            "the meter ran on 6 of 20 steps (AuditOptions::meter_every(0): the steps that differ); 13 more repeated "
            "the metered step before them allocation for allocation, so their saved bytes are its; 1 step (14) did "
            "not, and its saved bytes are not known; the saved bytes shown are step 16's");
  // Summaries take the known steps (19 of batch 16), not step 14's carried figure.
  const auto sum = trainmem::summarize_steps(fresh.steps);
  EXPECT_EQ(sum.saved_activation_bytes.min, 2304 * 16);
  EXPECT_EQ(sum.saved_activation_bytes.max, 2304 * 16);
  // What repeated what survives a JSON round trip; a bad "repeats" is refused.
  const auto back = trainmem::report_from_json(trainmem::to_json(fresh));
  ASSERT_EQ(back.steps.size(), batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    EXPECT_EQ(back.steps[i].metered, fresh.steps[i].metered) << "step " << i;
    EXPECT_EQ(back.steps[i].repeats, fresh.steps[i].repeats) << "step " << i;
  }
  auto j = nlohmann::json::parse(trainmem::to_json(fresh));
  j["steps"][5]["repeats"] = 5;
  try {
    trainmem::report_from_json(j.dump());
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"repeats\" of step 5 to be a whole number in [-1, 4], but got 5"),
              std::string::npos)
        << e.what();
  }
  j["steps"][5]["repeats"] = 2;
  j["steps"][2]["repeats"] = 1;
  try {
    trainmem::report_from_json(j.dump());
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("step 2 is metered, but \"repeats\" names step 1"), std::string::npos)
        << e.what();
  }
  // Without the tracker's log nothing can be compared: every step is metered.
  const auto blind = run(trainmem::AuditOptions().timeline(false)).first;
  for (const auto& st : blind.steps) {
    EXPECT_TRUE(st.metered) << "step " << st.step;
    EXPECT_EQ(st.saved_activation_bytes, 2304 * batch[static_cast<size_t>(st.step)]);
  }
}

TEST(AuditTest, ForwardOnlyStepHasOnePhase) {
  trainmem::CpuMemoryTracker::install();
  auto mlp = gelu_mlp();
  trainmem::Audit audit(*mlp, nullptr, c10::Device(c10::kCPU), trainmem::AuditOptions().timeline(false));
  {
    auto step = audit.step();
    torch::NoGradGuard no_grad;
    mlp->forward(torch::randn({16, 32}));
  }
  const auto r = audit.report();
  ASSERT_EQ(r.phases.size(), 1u);
  EXPECT_EQ(r.phases[0].phase, Phase::kForward);
  EXPECT_GT(r.steps[0].forward_peak_bytes, 0);
  EXPECT_EQ(r.steps[0].backward_peak_bytes, 0);
  EXPECT_TRUE(audit.timeline().events.empty());
  EXPECT_EQ(r.saved_activation_bytes, 0);
}

} // namespace

// Issue: step peaks counted bytes that were gone. The README's loop makes
// each batch before audit.step(); a tensor made before the audit may be
// freed between steps; a step may make the next step's batch; an RNN carries
// its hidden state across steps. In each loop every step's reported peak
// equals the allocator's own peak over the same step (one thread: the
// recorder sees every block), and at no point does a category go negative
// or "before the audit" outlive what it counts.
namespace {

struct LoopCheck {
  std::vector<int64_t> allocator_peaks;  // PeakWindow over each step
  trainmem::AuditReport report;
};

template <class Body>
LoopCheck run_loop(trainmem::Audit& audit, int steps, Body&& body) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  LoopCheck c;
  for (int i = 0; i < steps; ++i) {
    body(i, [&](auto&& inside) {
      trainmem::PeakWindow window(tracker);
      {
        auto audited = audit.step();
        inside();
      }
      c.allocator_peaks.push_back(window.peak_bytes());
    });
  }
  c.report = audit.report();
  return c;
}

void expect_peaks_equal_allocator(const LoopCheck& c, const trainmem::Timeline& t) {
  ASSERT_EQ(c.report.steps.size(), c.allocator_peaks.size());
  for (size_t i = 0; i < c.allocator_peaks.size(); ++i) {
    EXPECT_EQ(c.report.steps[i].peak_bytes, c.allocator_peaks[i]) << "step " << i;
  }
  for (const auto& p : trainmem::live_bytes(t)) {
    for (auto b : p.bytes) {
      ASSERT_GE(b, 0) << "a category went negative at " << p.time_ns;
    }
  }
}

} // namespace

TEST(AuditTest, BatchMadeBeforeTheStepCountsOnce) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  torch::nn::Linear lin(1024, 1024);
  torch::optim::SGD opt(lin->parameters(), 0.01);
  trainmem::Audit audit(*lin, &opt);
  const auto c = run_loop(audit, 3, [&](int, auto&& step) {
    auto x = torch::randn({256, 1024});  // the loader's batch, before the step
    step([&] {
      opt.zero_grad();
      lin->forward(x).pow(2).mean().backward();
      opt.step();
    });
  });
  expect_peaks_equal_allocator(c, audit.timeline());
  // Steps 1 and 2 are the same step as step 0 once gradients exist.
  EXPECT_EQ(c.report.steps[1].peak_bytes, c.report.steps[2].peak_bytes);
  EXPECT_LE(c.report.peak_bytes, *std::max_element(c.allocator_peaks.begin(), c.allocator_peaks.end()));
  // The first batch, made before the first step and freed before the
  // second, is INPUT from the start (Note [A batch made between steps]).
  const auto all = trainmem::live_bytes(audit.timeline());
  EXPECT_EQ(at_cat(all.front(), Category::kInput), 256 * 1024 * 4);
  EXPECT_EQ(at_cat(all.front(), Category::kBeforeAudit) - at_cat(all.back(), Category::kBeforeAudit), 0);
}

TEST(AuditTest, PreAuditTensorFreedBetweenStepsLeavesThePeaks) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  torch::nn::Linear lin(1024, 1024);
  torch::optim::SGD opt(lin->parameters(), 0.01);
  auto big = std::make_optional(torch::zeros({1024, 1024}));  // 4 MiB made before the audit
  trainmem::Audit audit(*lin, &opt);
  const auto c = run_loop(audit, 3, [&](int i, auto&& step) {
    if (i == 1) {
      big.reset();
    }
    auto x = torch::randn({256, 1024});
    step([&] {
      opt.zero_grad();
      lin->forward(x).pow(2).mean().backward();
      opt.step();
    });
  });
  expect_peaks_equal_allocator(c, audit.timeline());
  EXPECT_EQ(c.report.steps[0].peak_bytes - c.report.steps[2].peak_bytes, 4 * 1024 * 1024);
  const auto all = trainmem::live_bytes(audit.timeline());
  // The 4 MiB, made before the Audit, left "before the audit" when freed;
  // the first batch is INPUT from the start (Note [A batch made between steps]).
  EXPECT_EQ(at_cat(all.front(), Category::kBeforeAudit) - at_cat(all.back(), Category::kBeforeAudit),
            4 * 1024 * 1024);
  EXPECT_EQ(at_cat(all.front(), Category::kInput), 256 * 1024 * 4);
}

TEST(AuditTest, PrefetchedBatchAndCarriedStateCountOnce) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  torch::nn::Linear lin(512, 512);
  torch::optim::SGD opt(lin->parameters(), 0.01);
  trainmem::Audit audit(*lin, &opt);
  auto next = torch::randn({64, 512});  // made before the audit, used in step 0
  auto h = torch::zeros({64, 512});     // hidden state, carried across steps
  const auto c = run_loop(audit, 4, [&](int, auto&& step) {
    step([&] {
      auto x = std::exchange(next, torch::randn({64, 512}));  // prefetch the next batch inside
      opt.zero_grad();
      auto y = torch::tanh(lin->forward(x) + h);
      y.pow(2).mean().backward();
      h = y.detach();  // truncated BPTT: the state lives on, its graph does not
      opt.step();
    });
  });
  expect_peaks_equal_allocator(c, audit.timeline());
  EXPECT_EQ(c.report.steps[2].peak_bytes, c.report.steps[3].peak_bytes);
}

// The timeline pairs each free with its allocation (by the recorder's log
// numbers within a step, through the open blocks across steps): every free
// carries its allocation's bytes and category, whichever step made it.
TEST(AuditTest, EveryFreeCarriesItsAllocationsBytesAndCategory) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  torch::nn::Linear lin(256, 256);
  torch::optim::SGD opt(lin->parameters(), 0.01);
  trainmem::Audit audit(*lin, &opt);
  auto h = torch::zeros({32, 256});
  std::optional<at::Tensor> kept;  // made at step 0's end, freed in step 2
  const auto c = run_loop(audit, 4, [&](int i, auto&& step) {
    auto x = torch::randn({32, 256});
    step([&] {
      if (i == 2) {
        kept.reset();
      }
      opt.zero_grad();
      auto y = torch::tanh(lin->forward(x) + h);
      y.pow(2).mean().backward();
      h = y.detach();
      opt.step();
      if (i == 0) {
        kept = torch::ones({1000});
      }
    });
  });
  expect_peaks_equal_allocator(c, audit.timeline());
  const auto& events = audit.timeline().events;
  std::map<uint64_t, size_t> open;  // address -> its allocation's event
  int64_t paired = 0;
  std::optional<std::pair<size_t, size_t>> kept_events;
  for (size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    if (e.address == 0) {
      continue;  // a block of the baseline, freed
    }
    if (e.bytes > 0) {
      open[e.address] = i;
      continue;
    }
    auto it = open.find(e.address);
    ASSERT_NE(it, open.end()) << "a free at event " << i << " pairs with no allocation";
    const auto& a = events[it->second];
    EXPECT_EQ(a.bytes, -e.bytes) << "event " << i;
    EXPECT_EQ(a.category, e.category) << "event " << i;
    if (a.bytes == 4000 && a.step == 0 && e.step == 2) {
      kept_events = std::make_pair(it->second, i);
    }
    open.erase(it);
    ++paired;
  }
  EXPECT_GE(paired, 60);  // 76 with torch 2.13 on the CPU: the steps' own blocks
  ASSERT_TRUE(kept_events.has_value());
  // Made after the optimizer's step: held across steps, it is optimizer-step memory.
  EXPECT_EQ(events[kept_events->second].category, Category::kOptimizerState);
}

// Issue: a GAN audited with the README's one-module line counted G's weights
// as D's saved activations, silently. G's second Linear saves its weight for
// its input's gradient (128 x 128 x 4 B); G's first saves only z.
TEST(AuditTest, WarnsAboutSavedLeavesOfUnauditedNetworks) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  torch::nn::Sequential G(torch::nn::Linear(64, 128), torch::nn::ReLU(), torch::nn::Linear(128, 128));
  torch::nn::Linear D(128, 1);
  torch::optim::SGD d_opt(D->parameters(), 0.01);
  auto gan_step = [&](trainmem::Audit& audit) {
    auto audited = audit.step();
    d_opt.zero_grad();
    D->forward(G->forward(torch::randn({32, 64}))).mean().backward();
    d_opt.step();
  };
  auto has_note = [](const trainmem::AuditReport& r) {
    return std::any_of(r.notes.begin(), r.notes.end(),
                       [](const std::string& n) { return n.find("65,536 B of the saved bytes are leaves") == 0; });
  };
  {
    trainmem::Audit audit(*D, &d_opt);
    gan_step(audit);
    const auto r = audit.report();
    EXPECT_TRUE(has_note(r));
  }
  {
    trainmem::Audit audit;  // the two-network form
    audit.add_module(*G);
    audit.add_module(*D);
    audit.add_optimizer(d_opt, "D");
    gan_step(audit);
    const auto r = audit.report();
    EXPECT_FALSE(has_note(r));
    for (const auto& n : r.notes) {
      EXPECT_EQ(n.find("leaves that require grad"), std::string::npos) << n;
    }
  }
}

// Issue: neural style transfer optimizes the image, a tensor of no module,
// and add_optimizer refused it. add_optimized_input gives it a bucket of its
// own and keeps it out of the saved bytes; its gradient and Adam state count
// as such. The saved bytes equal a SavedTensorMeter's on the same forward
// with the features and the image excluded.
TEST(AuditTest, OptimizedInputHasItsOwnBucket) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  torch::nn::Sequential features(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3)), torch::nn::ReLU(),
                                 torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3)));
  for (auto& p : features->parameters()) {
    p.requires_grad_(false);  // frozen, as VGG is
  }
  auto image = torch::rand({1, 3, 32, 32}).requires_grad_(true);
  torch::optim::Adam opt({image}, 0.01);
  auto loss = [&] { return features->forward(image).pow(2).mean(); };
  {
    trainmem::Audit audit(*features);
    try {
      audit.add_optimizer(opt);
      FAIL() << "an optimizer over a tensor of no module was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("Audit::add_optimized_input"), std::string::npos) << e.what();
    }
  }
  trainmem::SavedTensorMeter meter(*features);
  meter.exclude(image);
  {
    trainmem::SavedTensorMeterGuard g(meter);
    loss().backward();
  }
  image.mutable_grad().reset();
  trainmem::Audit audit(*features);
  audit.add_optimized_input(image, "image");
  audit.add_optimizer(opt);
  for (int i = 0; i < 2; ++i) {
    auto audited = audit.step();
    opt.zero_grad();
    loss().backward();
    opt.step();
  }
  const auto r = audit.report();
  auto bucket = [&](const std::string& name) { return trainmem::testing::find_bucket(r, name).bytes; };
  constexpr int64_t kImage = 1 * 3 * 32 * 32 * 4;
  EXPECT_EQ(bucket("optimized input (image)"), kImage);
  EXPECT_EQ(bucket("parameters"), 4 * (8 * 3 * 3 * 3 + 8 + 8 * 8 * 3 * 3 + 8));
  EXPECT_EQ(bucket("gradients"), kImage);  // the frozen features have none
  EXPECT_EQ(r.saved_activation_bytes, meter.report().saved_bytes);
  EXPECT_GT(r.saved_activation_bytes, 0);
  const int64_t state = trainmem::testing::bucket_bytes_of(r, Category::kOptimizerState);
  EXPECT_EQ(state, 2 * kImage);  // exp_avg, exp_avg_sq
  for (const auto& n : r.notes) {
    EXPECT_EQ(n.find("leaves that require grad"), std::string::npos) << n;
  }
  EXPECT_THROW(audit.add_optimized_input(torch::zeros({2}), "not a leaf that requires grad"), c10::Error);
}

// A conv net's BatchNorm running statistics (running_mean,
// running_var, num_batches_tracked) are the "buffers" bucket and BUFFER on
// the timeline, to the byte; PARAMETER holds the parameters alone, and the
// categories still add up to the allocator's live bytes.
TEST(AuditTest, BatchNormBuffersAreABucketAndACategoryOfTheirOwn) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)), torch::nn::BatchNorm2d(8),
                            torch::nn::ReLU(), torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3).padding(1)),
                            torch::nn::BatchNorm2d(16), torch::nn::ReLU());
  // BatchNorm2d(C): running_mean and running_var, C fp32 each, and
  // num_batches_tracked, one int64 (8 B).
  constexpr int64_t kBuffers = (2 * 8 * 4 + 8) + (2 * 16 * 4 + 8);  // 208
  constexpr int64_t kParams = 4 * (8 * 3 * 3 * 3 + 8 + 2 * 8 + 16 * 8 * 3 * 3 + 16 + 2 * 16);  // 5,600
  int64_t storages = 0;
  for (const auto& b : net->buffers()) {
    storages += static_cast<int64_t>(b.storage().nbytes());
  }
  ASSERT_EQ(storages, kBuffers);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  trainmem::Audit audit(*net, &opt);
  for (int i = 0; i < 2; ++i) {
    auto step = audit.step();
    auto x = torch::randn({4, 3, 8, 8});  // made and freed inside the step, as the series' end needs
    audit.mark_input(x);
    opt.zero_grad();
    net->forward(x).pow(2).mean().backward();  // updates the running statistics in place
    opt.step();
  }
  const int64_t live_after = tracker.stats().allocated_bytes;
  const auto r = audit.report();
  auto bucket = [&](const std::string& name) { return trainmem::testing::find_bucket(r, name); };
  EXPECT_EQ(bucket("parameters").bytes, kParams);
  EXPECT_EQ(bucket("buffers").bytes, kBuffers);
  EXPECT_EQ(bucket("buffers").category, Category::kBuffer);
  EXPECT_EQ(r.buckets[1].name, "buffers");  // beside the parameters
  EXPECT_EQ(r.static_bytes(), kParams + kBuffers + kParams + kParams);  // + gradients + momentum

  // At the peak: the buffers are BUFFER, not PARAMETER.
  EXPECT_EQ(r.peak_by_category[static_cast<int>(Category::kBuffer)], kBuffers);
  EXPECT_EQ(r.peak_by_category[static_cast<int>(Category::kParameter)], kParams);
  for (const auto& ph : r.phases) {
    EXPECT_EQ(ph.peak_by_category[static_cast<int>(Category::kBuffer)], kBuffers) << trainmem::span_label(ph);
  }
  // The categories still add up: the series ends at the allocator's live
  // bytes, its top is the step's peak, and the peak's categories sum to it.
  const auto all = trainmem::live_bytes(audit.timeline());
  EXPECT_EQ(all.back().total_bytes(), live_after);
  EXPECT_EQ(at_cat(all.back(), Category::kBuffer), kBuffers);
  int64_t top = 0;
  for (const auto& p : all) {
    top = std::max(top, p.total_bytes());
    ASSERT_EQ(at_cat(p, Category::kBuffer), kBuffers) << "BUFFER moved at " << p.time_ns;
  }
  EXPECT_EQ(top, r.peak_bytes);
  int64_t at_peak = 0;
  for (auto b : r.peak_by_category) {
    at_peak += b;
  }
  EXPECT_EQ(at_peak, r.peak_bytes);
  // The buffers are no saved activations: the meter excludes them.
  trainmem::SavedTensorMeter meter(*net);
  {
    trainmem::SavedTensorMeterGuard g(meter);
    (void)net->forward(torch::randn({4, 3, 8, 8})).pow(2).mean();
  }
  EXPECT_EQ(r.saved_activation_bytes, meter.report().saved_bytes);

  // The reports name the category, and a JSON report reads back with it.
  EXPECT_NE(trainmem::to_text(r).find("BUFFER"), std::string::npos);
  const auto back = trainmem::report_from_json(trainmem::to_json(r));
  EXPECT_EQ(back.peak_by_category[static_cast<int>(Category::kBuffer)], kBuffers);
  EXPECT_EQ(back.buckets[1].category, Category::kBuffer);
}

namespace {

// Image captioning's decoder with an in-place op on a view (CopySlices) and
// a BatchNorm'd conv stem: ops whose nodes the audit names by sequence
// number (Note [Naming nodes by sequence number]).
struct NamingNet : torch::nn::Module {
  torch::nn::Conv2d conv{register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3)))};
  torch::nn::BatchNorm2d bn{register_module("bn", torch::nn::BatchNorm2d(8))};
  torch::nn::Linear embed{register_module("embed", torch::nn::Linear(8, 24))};
  torch::nn::LSTMCell cell{register_module("cell", torch::nn::LSTMCell(24, 24))};
  torch::nn::Linear head{register_module("head", torch::nn::Linear(24, 10))};
  at::Tensor scale{register_parameter("scale", torch::ones({24}))};
  at::Tensor forward(const at::Tensor& images) {
    auto f = torch::relu(bn->forward(conv->forward(images))).mean({2, 3});  // [4, 8]
    auto d = torch::tanh(embed->forward(f)).unsqueeze(1).expand({4, 6, 24}).contiguous();
    d.select(1, 0).sigmoid_();  // in place on a view, saving its output
    auto e = d.clone();
    e.select(1, 1).mul_(scale);  // in place on a view, saving its input (the node CopySlices wraps)
    std::optional<std::tuple<at::Tensor, at::Tensor>> s;
    std::vector<at::Tensor> hs;
    for (int64_t t = 0; t < e.size(1); ++t) {
      s = cell->forward(e.select(1, t), s);
      hs.push_back(std::get<0>(*s));
    }
    return head->forward(at::stack(hs, 1).mean(1));
  }
};

} // namespace

// The audit names saved tensors' nodes without an op callback; a meter with
// one (the public SavedTensorMeter) must find the same nodes, bytes and
// tensor counts on the same step.
TEST(AuditTest, NodesNamedWithoutAnOpCallbackMatchTheMeters) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  auto audited = std::make_shared<NamingNet>();
  torch::manual_seed(0);
  auto metered = std::make_shared<NamingNet>();
  torch::optim::Adam opt(audited->parameters(), 1e-3);
  trainmem::Audit audit(*audited, &opt);
  torch::manual_seed(1);
  const auto images = torch::randn({4, 3, 12, 12});
  const auto labels = torch::randint(0, 10, {4});
  {
    auto step = audit.step();
    opt.zero_grad();
    torch::cross_entropy_loss(audited->forward(images), labels).backward();
    opt.step();
  }
  trainmem::SavedTensorMeter meter(*metered);
  at::Tensor loss;
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    loss = torch::cross_entropy_loss(metered->forward(images), labels);
  }
  loss.backward();
  const auto expected = meter.report();
  const auto r = audit.report();
  std::map<std::string, std::pair<int64_t, int64_t>> mine, theirs;  // bytes, tensors
  std::string nodes;
  for (const auto& n : r.saved_by_node) {
    mine[n.node] = {n.bytes, n.num_tensors};
  }
  for (const auto& n : expected.by_node) {
    theirs[n.node] = {n.bytes, n.num_tensors};
    nodes += n.node + " " + std::to_string(n.bytes) + "\n";
  }
  EXPECT_EQ(mine.count("(unattributed)"), 0u);
  // Where the two differ by design: `e.select(1, 1).mul_(scale)` saves
  // `scale` (a parameter, excluded) and the slice's old values (a [4, 24]
  // f32 clone) for the MulBackward0 that CopySlices wraps; the op callback
  // names the clone after the view's regenerated grad_fn,
  // AsStridedBackward0, beside what `d.select(1, 0).sigmoid_()` saved (its
  // output: d's whole [4, 6, 24] f32 storage).
  constexpr int64_t kSlice = 4 * 24 * 4, kD = 4 * 6 * 24 * 4;
  ASSERT_EQ(theirs.count("AsStridedBackward0"), 1u) << nodes;
  ASSERT_EQ(mine.count("AsStridedBackward0"), 1u);
  EXPECT_EQ(mine["AsStridedBackward0"], std::make_pair(kD, int64_t{1}));
  EXPECT_EQ(theirs["AsStridedBackward0"], std::make_pair(kD + kSlice, int64_t{2})) << nodes;
  EXPECT_EQ(mine["MulBackward0"].first, theirs["MulBackward0"].first + kSlice);
  EXPECT_EQ(mine["MulBackward0"].second, theirs["MulBackward0"].second + 1);
  mine.erase("AsStridedBackward0");
  theirs.erase("AsStridedBackward0");
  mine.erase("MulBackward0");
  theirs.erase("MulBackward0");
  EXPECT_EQ(mine, theirs) << nodes;
  EXPECT_GE(mine.size(), 8u) << nodes;
  EXPECT_EQ(r.saved_activation_bytes, expected.saved_bytes);
}

// Note [Saves named by a later backward]: a GAN step's discriminator
// backward (on a detached fake) does not reach the generator's saves from the
// same forward; the generator's backward, later in the step, does. Its saves
// are named after its nodes (TanhBackward0: only the generator has tanh),
// and nothing is "(unattributed)".
TEST(AuditTest, SavesNamedByALaterBackwardOfTheStep) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  torch::nn::Sequential gen(torch::nn::Linear(8, 32), torch::nn::Tanh(), torch::nn::Linear(32, 16), torch::nn::Tanh());
  torch::nn::Sequential disc(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 1),
                             torch::nn::Sigmoid());
  torch::optim::Adam opt_g(gen->parameters(), 1e-3);
  torch::optim::Adam opt_d(disc->parameters(), 1e-3);
  trainmem::Audit audit;
  audit.add_module(*gen);
  audit.add_module(*disc);
  audit.add_optimizer(opt_g, "G");
  audit.add_optimizer(opt_d, "D");
  const auto real = torch::randn({64, 16});
  for (int i = 0; i < 2; ++i) {
    auto step = audit.step();
    opt_d.zero_grad();
    auto fake = gen->forward(torch::randn({64, 8}));
    auto d_loss = torch::binary_cross_entropy(disc->forward(real), torch::ones({64, 1})) +
        torch::binary_cross_entropy(disc->forward(fake.detach()), torch::zeros({64, 1}));
    d_loss.backward();
    opt_d.step();
    opt_g.zero_grad();
    torch::binary_cross_entropy(disc->forward(fake), torch::ones({64, 1})).backward();
    opt_g.step();
  }
  const auto r = audit.report();
  std::map<std::string, int64_t> by_node;
  int64_t total = 0;
  for (const auto& n : r.saved_by_node) {
    by_node[n.node] += n.bytes;
    total += n.bytes;
  }
  EXPECT_EQ(by_node.count("(unattributed)"), 0u);
  // The generator's two tanh outputs (64 x 32 and 64 x 16 floats) are saved
  // once each, by TanhBackward0.
  EXPECT_EQ(by_node["TanhBackward0"], (64 * 32 + 64 * 16) * 4);
  EXPECT_EQ(total, r.saved_activation_bytes);
}
