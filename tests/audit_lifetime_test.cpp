// Objects an Audit points at that come and go while it runs: an optimizer
// made per epoch, one rebuilt by a scheduler, one dropped before report(),
// a module destroyed before report() (Note [Optimizers that come and go]).
// `make sanitize` runs these under ASan: report() must never read freed
// memory.
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include "trainmem/allocator.h"
#include "trainmem/audit.h"
#include "trainmem/report.h"
#include "support/find_bucket.h"

namespace {

using trainmem::testing::find_bucket;

torch::nn::Sequential mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(32, 256), torch::nn::GELU(), torch::nn::Linear(256, 32));
}

constexpr int64_t kMlpParamBytes = 4 * (32 * 256 + 256 + 256 * 32 + 32);  // 66,688

at::Tensor batch(int64_t i) {
  return at::randn({8, 32}, at::TensorOptions().dtype(at::kFloat)).mul_(static_cast<double>(i % 3 + 1));
}

template <typename Opt>
void train_step(torch::nn::Sequential& net, Opt& opt, int64_t i) {
  opt.zero_grad();
  auto x = batch(i);
  net->forward(x).pow(2).mean().backward();
  opt.step();
}

void expect_same_parameters(torch::nn::Sequential& a, torch::nn::Sequential& b) {
  const auto pa = a->parameters();
  const auto pb = b->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(at::equal(pa[i], pb[i])) << "parameter " << i;
  }
}

int64_t count_phases(const trainmem::AuditReport& r, const std::string& name) {
  int64_t n = 0;
  for (const auto& p : r.phases) {
    n += p.name == name ? 1 : 0;
  }
  return n;
}

bool has_note(const trainmem::AuditReport& r, const std::string& text) {
  for (const auto& n : r.notes) {
    if (n.find(text) != std::string::npos) {
      return true;
    }
  }
  return false;
}

// A segmentation trainer's loop: a new Adam each epoch, on the stack (so
// often at the last one's address), added to the audit each time.
TEST(AuditLifetimeTest, AnOptimizerMadePerEpochIsFollowed) {
  trainmem::CpuMemoryTracker::install();
  auto net = mlp();
  auto twin = mlp();
  trainmem::Audit audit(net);
  at::manual_seed(1);
  int64_t i = 0;
  for (int epoch = 0; epoch < 3; ++epoch) {
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
    audit.add_optimizer(opt);  // accepted: another Adam, perhaps at the same address
    for (int b = 0; b < 3; ++b, ++i) {
      auto step = audit.step();
      train_step(net, opt, i);
    }
  }
  at::manual_seed(1);
  i = 0;
  for (int epoch = 0; epoch < 3; ++epoch) {
    torch::optim::Adam opt(twin->parameters(), torch::optim::AdamOptions(1e-2));
    for (int b = 0; b < 3; ++b, ++i) {
      train_step(twin, opt, i);
    }
  }
  expect_same_parameters(net, twin);

  const auto r = audit.report();  // the last Adam is gone too
  ASSERT_EQ(r.steps.size(), 9u);
  EXPECT_EQ(count_phases(r, "Adam"), 9) << "each step's update is the phase 'Adam', never 'Adam #2'";
  // The state as of the last step: exp_avg and exp_avg_sq, once.
  EXPECT_EQ(find_bucket(r, "optimizer state (exp_avg)").bytes, kMlpParamBytes);
  EXPECT_EQ(find_bucket(r, "optimizer state (exp_avg_sq)").bytes, kMlpParamBytes);
  EXPECT_TRUE(has_note(r, "'Adam' 2 times: before step 3")) << ::testing::PrintToString(r.notes);
  EXPECT_TRUE(has_note(r, "before step 6")) << ::testing::PrintToString(r.notes);
  // Each epoch's first step makes its Adam's state: 2 x 66,688 B more at
  // its update's end than the steps that follow (their state was there).
  for (int64_t s : {0, 3, 6}) {
    EXPECT_GT(r.steps[static_cast<size_t>(s)].optimizer_peak_bytes, 0) << "step " << s;
  }
}

// A loop that drops its optimizer before report(): the figures are those of
// the last step.
TEST(AuditLifetimeTest, AnOptimizerDroppedBeforeReportKeepsItsLastFigures) {
  trainmem::CpuMemoryTracker::install();
  auto net = mlp();
  trainmem::Audit audit(net);
  {
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    audit.add_optimizer(opt);
    for (int64_t i = 0; i < 3; ++i) {
      auto step = audit.step();
      train_step(net, opt, i);
    }
  }
  const auto r = audit.report();
  EXPECT_EQ(find_bucket(r, "optimizer state (momentum_buffer)").bytes, kMlpParamBytes);
  EXPECT_EQ(count_phases(r, "SGD"), 3);
  EXPECT_FALSE(has_note(r, "replaced or destroyed")) << "nothing could see it go before report()";
}

// A scheduler that rebuilds the optimizer on the heap with a new learning
// rate, re-added each time; then once more without adding it: the last one
// added is seen to be destroyed (its state is gone), and never read again.
TEST(AuditLifetimeTest, AnOptimizerRebuiltByASchedulerIsReplacedOrSeenGone) {
  trainmem::CpuMemoryTracker::install();
  auto net = mlp();
  auto twin = mlp();
  trainmem::Audit audit(net);
  auto make = [](torch::nn::Sequential& n, double lr) {
    return std::make_unique<torch::optim::Adam>(n->parameters(), torch::optim::AdamOptions(lr));
  };
  at::manual_seed(2);
  auto opt = make(net, 1e-2);
  audit.add_optimizer(*opt, "adam");
  for (int64_t i = 0; i < 8; ++i) {
    if (i == 2) {
      opt = make(net, 5e-3);  // made before the old one is destroyed: another address
      audit.add_optimizer(*opt);
    } else if (i == 4) {
      opt.reset();  // destroyed first: the new one may reuse its address
      opt = make(net, 2e-3);
      audit.add_optimizer(*opt);
    } else if (i == 6) {
      opt = make(net, 1e-3);  // not added
    }
    auto step = audit.step();
    train_step(net, *opt, i);
  }
  at::manual_seed(2);
  auto topt = make(twin, 1e-2);
  for (int64_t i = 0; i < 8; ++i) {
    if (i == 2 || i == 4 || i == 6) {
      topt = make(twin, i == 2 ? 5e-3 : i == 4 ? 2e-3 : 1e-3);
    }
    train_step(twin, *topt, i);
  }
  expect_same_parameters(net, twin);

  const auto r = audit.report();
  EXPECT_EQ(count_phases(r, "adam"), 6) << "steps 0-5: the name passes to the optimizer that replaces it";
  EXPECT_TRUE(has_note(r, "'adam' 3 times")) << ::testing::PrintToString(r.notes);
  EXPECT_TRUE(has_note(r, "before step 2 (another optimizer was added over its parameters")) << ::testing::PrintToString(r.notes);
  EXPECT_TRUE(has_note(r, "before step 6 (destroyed; its state then 133,376 B)")) << ::testing::PrintToString(r.notes);
  // No optimizer added is alive at the last step: the one not added is
  // inferred from its step's ops (Note [Optimizer state inferred from
  // lifetimes]), the same Adam over the same parameters.
  for (const auto& b : r.buckets) {
    if (b.category == trainmem::Category::kOptimizerState) {
      EXPECT_EQ(b.name, "optimizer state (inferred)");
      EXPECT_EQ(b.bytes, 133'376);
    }
  }
  EXPECT_TRUE(has_note(r, "no optimizer was added")) << ::testing::PrintToString(r.notes);
}

// The same optimizer added twice stays one: its state is counted once.
TEST(AuditLifetimeTest, TheSameOptimizerAddedTwiceIsOne) {
  trainmem::CpuMemoryTracker::install();
  auto net = mlp();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  trainmem::Audit audit(net, &opt);
  {
    auto step = audit.step();
    train_step(net, opt, 0);
  }
  audit.add_optimizer(opt);  // with state now
  audit.add_optimizer(opt, "renamed");
  {
    auto step = audit.step();
    train_step(net, opt, 1);
  }
  const auto r = audit.report();
  EXPECT_EQ(find_bucket(r, "optimizer state (exp_avg)").bytes, kMlpParamBytes);
  EXPECT_EQ(count_phases(r, "Adam"), 1);
  EXPECT_EQ(count_phases(r, "renamed"), 1);
  EXPECT_FALSE(has_note(r, "replaced or destroyed"));
}

// A module destroyed before report(): skipped, with a note, never read.
TEST(AuditLifetimeTest, AModuleDestroyedBeforeReportIsSkipped) {
  trainmem::CpuMemoryTracker::install();
  auto net = mlp();
  trainmem::Audit audit(net);
  {
    torch::nn::Linear head(32, 4);
    audit.add_module(head);
    auto step = audit.step();
    head->forward(net->forward(batch(0))).sum().backward();
  }
  const auto r = audit.report();
  EXPECT_EQ(find_bucket(r, "parameters").bytes, kMlpParamBytes);
  EXPECT_EQ(find_bucket(r, "gradients").bytes, kMlpParamBytes);
  EXPECT_TRUE(has_note(r, "1 audited module was destroyed before report()")) << ::testing::PrintToString(r.notes);
}

} // namespace
