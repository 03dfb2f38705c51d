// Steps within a step: a PPO-style update (a no-grad rollout, then 3 epochs
// x 20 minibatches, one Adam step each) inside one audit.step().
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include "trainmem/allocator.h"
#include "trainmem/audit.h"
#include "trainmem/meter.h"
#include "trainmem/report.h"

namespace {

using trainmem::Category;

constexpr int64_t kObs = 32;
constexpr int64_t kActions = 6;
constexpr int64_t kRollout = 640;
constexpr int64_t kMinibatches = 20;
constexpr int64_t kMinibatch = kRollout / kMinibatches;  // 32
constexpr int64_t kEpochs = 3;

torch::nn::Sequential policy() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(kObs, 64), torch::nn::Tanh(), torch::nn::Linear(64, 64),
                               torch::nn::Tanh(), torch::nn::Linear(64, kActions));
}

// The update, as a library runs it: the caller can wrap only the whole call.
void ppo_update(torch::nn::Sequential& net, torch::optim::Optimizer& opt) {
  at::Tensor obs, actions, old_logp, adv;
  {
    torch::NoGradGuard no_grad;
    obs = torch::randn({kRollout, kObs});
    const auto logits = net->forward(obs);
    actions = at::multinomial(at::softmax(logits, 1), 1);
    old_logp = at::log_softmax(logits, 1).gather(1, actions);
    adv = torch::randn({kRollout, 1});
  }
  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    const auto perm = at::randperm(kRollout);
    for (int64_t mb = 0; mb < kMinibatches; ++mb) {
      const auto idx = perm.narrow(0, mb * kMinibatch, kMinibatch);
      const auto o = obs.index_select(0, idx);
      const auto a = actions.index_select(0, idx);
      const auto olp = old_logp.index_select(0, idx);
      const auto ad = adv.index_select(0, idx);
      opt.zero_grad();
      const auto logp = at::log_softmax(net->forward(o), 1).gather(1, a);
      const auto ratio = at::exp(logp - olp);
      const auto loss = -at::minimum(ratio * ad, at::clamp(ratio, 0.8, 1.2) * ad).mean();
      loss.backward();
      opt.step();
    }
  }
}

int64_t at_cat(const trainmem::CategoryBytes& b, Category c) {
  return b[static_cast<int>(c)];
}

int64_t bytes_of(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) {
    n += t.numel() * static_cast<int64_t>(t.element_size());
  }
  return n;
}

std::vector<const trainmem::PhaseSpan*> spans_of(const trainmem::AuditReport& r, int64_t step) {
  std::vector<const trainmem::PhaseSpan*> out;
  for (const auto& p : r.phases) {
    if (p.step == step) {
      out.push_back(&p);
    }
  }
  return out;
}

// By hand: the policy's 6,662 parameters, Adam's two moments of each, the
// rollout (obs 640 x 32 floats, actions 640 int64, old log-probs and
// advantages 640 floats each), one epoch's permutation (640 int64) and a
// minibatch's copies (32 x 32 floats, 32 int64, 32 + 32 floats).
constexpr int64_t kParamBytes = (32 * 64 + 64 + 64 * 64 + 64 + 64 * 6 + 6) * 4;  // 26,648
constexpr int64_t kObsBytes = kRollout * kObs * 4;                                // 81,920
constexpr int64_t kRolloutBytes = kObsBytes + kRollout * 8 + 2 * kRollout * 4;     // 92,160
constexpr int64_t kMinibatchBytes = kMinibatch * kObs * 4 + kMinibatch * 8 + 2 * kMinibatch * 4;  // 4,608
constexpr int64_t kUpdateInputBytes = kRolloutBytes + kRollout * 8 + kMinibatchBytes;              // 101,888

// Note [Steps within a step]: at every moment of a PPO update inside one
// audited step the categories are what a by-hand count says.
TEST(AuditInnerStepsTest, PpoUpdateInsideOneStepHasTrueCategories) {
  trainmem::CpuMemoryTracker::install();
  auto net = policy();
  ASSERT_EQ(bytes_of(net->parameters()), kParamBytes);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
  trainmem::Audit audit(*net, &opt);
  for (int i = 0; i < 2; ++i) {
    auto step = audit.step();
    ppo_update(net, opt);
  }
  const auto r = audit.report();
  const auto spans = spans_of(r, 1);
  // The rollout is a pass without grad, never an optimizer step; then 60
  // times forward, backward, Adam.
  ASSERT_EQ(spans.size(), 1u + 3u * kEpochs * kMinibatches);
  EXPECT_EQ(trainmem::span_label(*spans[0]), "forward (no grad)");
  for (size_t i = 1; i < spans.size(); i += 3) {
    EXPECT_EQ(trainmem::span_label(*spans[i]), "forward") << i;
    EXPECT_EQ(trainmem::span_label(*spans[i + 1]), "backward") << i;
    EXPECT_EQ(trainmem::span_label(*spans[i + 2]), "optimizer step (Adam)") << i;
  }

  // The step's peak is the rollout's: the last step's gradients (freed by
  // the first zero_grad), the observations (INPUT) and the policy's two
  // 640 x 64 hidden layers (TEMPORARY: freed by the rollout itself).
  const auto& top = spans[0]->peak_by_category;
  EXPECT_EQ(spans[0]->peak_bytes, r.steps[1].peak_bytes);
  EXPECT_EQ(at_cat(top, Category::kParameter), kParamBytes);
  EXPECT_EQ(at_cat(top, Category::kGradient), kParamBytes);
  EXPECT_EQ(at_cat(top, Category::kOptimizerState), 2 * kParamBytes);
  EXPECT_EQ(at_cat(top, Category::kInput), kObsBytes);
  EXPECT_EQ(at_cat(top, Category::kTemporary), 2 * kRollout * 64 * 4);
  EXPECT_EQ(at_cat(top, Category::kActivation), 0);
  EXPECT_EQ(spans[0]->peak_bytes, 4 * kParamBytes + kObsBytes + 2 * kRollout * 64 * 4);  // 516,192

  // Each Adam step's peak: every gradient (GRADIENT, though the next
  // zero_grad frees them), the rollout, the permutation and the
  // minibatch's copies (INPUT, though made after the last Adam step).
  for (size_t i = 3; i < spans.size(); i += 3) {
    const auto& at_step = spans[i]->peak_by_category;
    EXPECT_EQ(at_cat(at_step, Category::kGradient), kParamBytes) << i;
    EXPECT_EQ(at_cat(at_step, Category::kOptimizerState), 2 * kParamBytes) << i;
    EXPECT_EQ(at_cat(at_step, Category::kInput), kUpdateInputBytes) << i;
    EXPECT_EQ(at_cat(at_step, Category::kUnknown), 0) << i;
  }
  // Each forward's peak holds its own activations, and no gradient (zero_grad freed them).
  for (size_t i = 1; i < spans.size(); i += 3) {
    EXPECT_GT(at_cat(spans[i]->peak_by_category, Category::kActivation), 0) << i;
    EXPECT_EQ(at_cat(spans[i]->peak_by_category, Category::kGradient), 0) << i;
    EXPECT_EQ(at_cat(spans[i]->peak_by_category, Category::kInput), kUpdateInputBytes) << i;
  }
}

// Each backward of the update reports what its minibatch saved: the same as
// a SavedTensorMeter around one minibatch's forward.
TEST(AuditInnerStepsTest, EachBackwardReportsItsMinibatchSavedBytes) {
  trainmem::CpuMemoryTracker::install();
  auto net = policy();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
  int64_t one_minibatch = 0;
  {
    const auto o = torch::randn({kMinibatch, kObs});
    const auto a = torch::randint(kActions, {kMinibatch, 1}, torch::kLong);
    const auto olp = torch::randn({kMinibatch, 1});
    const auto ad = torch::randn({kMinibatch, 1});
    trainmem::SavedTensorMeter meter(*net);  // parameters excluded, as the audit does
    {
      trainmem::SavedTensorMeterGuard guard(meter);
      const auto logp = at::log_softmax(net->forward(o), 1).gather(1, a);
      const auto ratio = at::exp(logp - olp);
      const auto loss = -at::minimum(ratio * ad, at::clamp(ratio, 0.8, 1.2) * ad).mean();
    }
    one_minibatch = meter.report().saved_bytes;
  }
  // The minibatch's observations (4,096 B), both tanh outputs (8,192 B
  // each), the log-softmax (768 B), the action indices (256 B) and four
  // 32-float vectors of the clipped loss (512 B).
  ASSERT_EQ(one_minibatch, 22'016);
  trainmem::Audit audit(*net, &opt, c10::Device(c10::kCPU), trainmem::AuditOptions().meter_every(1));
  {
    auto step = audit.step();
    ppo_update(net, opt);
  }
  const auto r = audit.report();
  int64_t backwards = 0;
  for (const auto& p : r.phases) {
    if (p.phase == trainmem::Phase::kBackward) {
      ++backwards;
      EXPECT_EQ(p.saved_bytes, one_minibatch);
    } else {
      EXPECT_EQ(p.saved_bytes, -1);
    }
  }
  EXPECT_EQ(backwards, kEpochs * kMinibatches);
  EXPECT_EQ(r.steps[0].saved_activation_bytes, one_minibatch);
  const auto text = trainmem::to_text(r);
  EXPECT_NE(text.find("60 metered, saved 22,016 / 22,016 / 22,016 B"), std::string::npos) << text;
  const auto back = trainmem::report_from_json(trainmem::to_json(r));
  for (size_t i = 0; i < r.phases.size(); ++i) {
    EXPECT_EQ(back.phases[i].saved_bytes, r.phases[i].saved_bytes) << i;
  }
}

// Note [Optimizer state inferred from lifetimes]: a loop whose optimizer the
// audit is not given. Its step is found by its ops, and what it makes that
// lives on is OPTIMIZER_STATE, as with the optimizer added.
TEST(AuditInnerStepsTest, OptimizerNotAddedIsInferred) {
  trainmem::CpuMemoryTracker::install();
  auto run = [](bool add_optimizer) {
    auto net = policy();
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
    trainmem::Audit audit(*net, add_optimizer ? &opt : nullptr);
    torch::manual_seed(1);
    for (int i = 0; i < 3; ++i) {
      const auto x = torch::randn({kMinibatch, kObs});
      auto step = audit.step();
      opt.zero_grad();
      net->forward(x).pow(2).mean().backward();
      opt.step();
    }
    return audit.report();
  };
  const auto inferred = run(false);
  const auto given = run(true);
  const trainmem::BucketBytes* state = nullptr;
  for (const auto& b : inferred.buckets) {
    if (b.name == "optimizer state (inferred)") {
      state = &b;
    }
  }
  ASSERT_NE(state, nullptr);
  EXPECT_EQ(state->bytes, 2 * kParamBytes);
  EXPECT_EQ(state->category, Category::kOptimizerState);
  ASSERT_EQ(inferred.phases.size(), given.phases.size());
  for (size_t i = 0; i < inferred.phases.size(); ++i) {
    const auto& a = inferred.phases[i];
    const auto& b = given.phases[i];
    EXPECT_EQ(a.phase, b.phase) << i;
    if (b.phase == trainmem::Phase::kOptimizerStep) {
      EXPECT_EQ(trainmem::span_label(a), "optimizer step (inferred)");
    }
    EXPECT_EQ(a.peak_bytes, b.peak_bytes) << i;
    for (int c = 0; c < trainmem::kNumCategories; ++c) {
      EXPECT_EQ(a.peak_by_category[c], b.peak_by_category[c])
          << i << " " << trainmem::category_name(static_cast<Category>(c));
    }
  }
  EXPECT_EQ(at_cat(inferred.peak_by_category, Category::kOptimizerState), 2 * kParamBytes);
  const bool noted = std::any_of(inferred.notes.begin(), inferred.notes.end(), [](const std::string& n) {
    return n.find("optimizer state inferred from lifetimes") != std::string::npos;
  });
  EXPECT_TRUE(noted);
}

} // namespace
