// A batch made between steps is INPUT, the first step's included (Note [A
// batch made between steps]); a data set held in memory across the steps
// is not.
#include <algorithm>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include "trainmem/allocator.h"
#include "trainmem/audit.h"
#include "trainmem/report.h"

namespace {

using trainmem::Category;

constexpr int64_t kBatch = 64;
// The batch's bytes: 64 x 784 float inputs and 64 int64 targets.
constexpr int64_t kBatchBytes = kBatch * 784 * 4 + kBatch * 8;  // 201,216

torch::nn::Sequential mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(784, 128), torch::nn::ReLU(), torch::nn::Linear(128, 10),
                               torch::nn::LogSoftmax(1));
}

int64_t at_cat(const trainmem::CategoryBytes& b, Category c) {
  return b[static_cast<int>(c)];
}

// The categories at step `step`'s highest point: its highest phase's.
trainmem::CategoryBytes step_peak(const trainmem::AuditReport& r, int64_t step) {
  const trainmem::PhaseSpan* top = nullptr;
  for (const auto& p : r.phases) {
    if (p.step == step && (top == nullptr || p.peak_bytes > top->peak_bytes)) {
      top = &p;
    }
  }
  EXPECT_NE(top, nullptr) << "step " << step;
  return top == nullptr ? trainmem::CategoryBytes{} : top->peak_by_category;
}

bool has_before_audit_note(const trainmem::AuditReport& r) {
  return std::any_of(r.notes.begin(), r.notes.end(), [](const std::string& n) {
    return n.find("before the audit began") != std::string::npos;
  });
}

namespace F = torch::nn::functional;

// The README's loop: each batch is made before audit.step(), between steps.
TEST(AuditInputTest, BatchMadeBetweenStepsIsInputAtEachPeak) {
  trainmem::CpuMemoryTracker::install();
  auto net = mlp();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
  trainmem::Audit audit(*net, &opt);
  for (int i = 0; i < 3; ++i) {
    auto data = torch::randn({kBatch, 784});
    auto target = torch::randint(10, {kBatch}, torch::kLong);
    auto audited = audit.step();
    opt.zero_grad();
    F::nll_loss(net->forward(data), target).backward();
    opt.step();
  }
  const auto r = audit.report();
  ASSERT_EQ(r.steps.size(), 3u);
  for (int64_t step = 0; step < 3; ++step) {
    const auto peak = step_peak(r, step);
    EXPECT_EQ(at_cat(peak, Category::kInput), kBatchBytes) << "step " << step;
    EXPECT_EQ(at_cat(peak, Category::kUnknown), 0) << "step " << step;
    EXPECT_EQ(at_cat(peak, Category::kBeforeAudit), 0) << "step " << step;
  }
  EXPECT_EQ(at_cat(r.peak_by_category, Category::kInput), kBatchBytes);
  EXPECT_EQ(at_cat(r.peak_by_category, Category::kUnknown), 0);
  EXPECT_FALSE(has_before_audit_note(r));
}

// A data set made after the Audit but before the first step, kept across
// every step and read by each (its batches are views): no INPUT, it stays
// "before the audit" with its note.
TEST(AuditInputTest, DataSetHeldAcrossStepsIsNotInput) {
  trainmem::CpuMemoryTracker::install();
  auto net = mlp();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
  trainmem::Audit audit(*net, &opt);
  auto images = torch::randn({3 * kBatch, 784});
  auto labels = torch::randint(10, {3 * kBatch}, torch::kLong);
  const int64_t data_set_bytes = 3 * kBatchBytes;  // 603,648
  for (int i = 0; i < 3; ++i) {
    auto audited = audit.step();
    opt.zero_grad();
    F::nll_loss(net->forward(images.narrow(0, i * kBatch, kBatch)), labels.narrow(0, i * kBatch, kBatch))
        .backward();
    opt.step();
  }
  const auto r = audit.report();
  ASSERT_EQ(r.steps.size(), 3u);
  for (int64_t step = 0; step < 3; ++step) {
    const auto peak = step_peak(r, step);
    EXPECT_EQ(at_cat(peak, Category::kInput), 0) << "step " << step;
    EXPECT_EQ(at_cat(peak, Category::kBeforeAudit), data_set_bytes) << "step " << step;
  }
  EXPECT_TRUE(has_before_audit_note(r));
}

// mark_input() still names a batch made inside the step.
TEST(AuditInputTest, MarkInputStillNamesABatchMadeInTheStep) {
  trainmem::CpuMemoryTracker::install();
  auto net = mlp();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
  trainmem::Audit audit(*net, &opt);
  for (int i = 0; i < 2; ++i) {
    auto audited = audit.step();
    auto data = torch::randn({kBatch, 784});
    auto target = torch::randint(10, {kBatch}, torch::kLong);
    audit.mark_input(data);
    audit.mark_input(target);
    opt.zero_grad();
    F::nll_loss(net->forward(data), target).backward();
    opt.step();
  }
  const auto r = audit.report();
  for (int64_t step = 0; step < 2; ++step) {
    EXPECT_EQ(at_cat(step_peak(r, step), Category::kInput), kBatchBytes) << "step " << step;
  }
}

} // namespace
