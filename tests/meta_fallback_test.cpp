// The meta path for ops LibTorch has no Meta kernel for (Note [A meta path for
// ops without a meta kernel], src/core/meta_fallback.cpp): the ops a policy
// loss runs (logsumexp's abs.out, where, comparisons, logical ops, gather,
// clamp, min and max with indices, a Categorical's and a Normal's log_prob and
// entropy, PPO's clipped loss) predicted on meta and held to the same step on
// CPU, to the byte: saved bytes against a SavedTensorMeter on CPU, the step's
// peak against measure_step_peak. Data-dependent outputs are refused, naming
// the op; a prediction that throws leaves nothing behind.
#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "trainmem/allocator.h"
#include "trainmem/meta.h"
#include "trainmem/meter.h"
#include "trainmem/planner.h"
#include "support/error_of.h"

namespace {

const at::TensorOptions kMeta = at::TensorOptions().device(at::kMeta);

using trainmem::testing::error_of;

// ---------------------------------------------------------------------------
// Op by op: the meta call gives the CPU call's sizes, strides, dtypes and
// storage bytes.

void expect_same_layout(const at::Tensor& meta, const at::Tensor& cpu, const std::string& what) {
  ASSERT_TRUE(meta.defined()) << what;
  ASSERT_TRUE(meta.is_meta()) << what;
  EXPECT_EQ(meta.sizes(), cpu.sizes()) << what;
  EXPECT_EQ(meta.strides(), cpu.strides()) << what;
  EXPECT_EQ(meta.scalar_type(), cpu.scalar_type()) << what;
  EXPECT_EQ(meta.storage_offset(), cpu.storage_offset()) << what;
  EXPECT_EQ(meta.storage().nbytes(), cpu.storage().nbytes()) << what;
}

TEST(MetaFallbackTest, OpsWithoutAMetaKernelGiveTheCpusLayouts) {
  trainmem::register_meta_kernels();
  // A transposed input and a broadcast condition: TensorIterator's layout.
  auto x = at::randn({6, 4}).t();
  auto c = at::randn({1, 6}) > 0;
  auto mx = at::empty_strided(x.sizes(), x.strides(), kMeta);
  auto mc = at::empty({1, 6}, kMeta.dtype(at::kBool));
  expect_same_layout(at::where(mc, mx, mx), at::where(c, x, x), "where.self");
  expect_same_layout(at::where(mc, mx, 0.5), at::where(c, x, 0.5), "where.ScalarOther");
  expect_same_layout(at::abs(mx), at::abs(x), "abs (abs.out)");
  expect_same_layout(at::logical_and(mc, mx), at::logical_and(c, x), "logical_and");
  expect_same_layout(at::logical_not(mx), at::logical_not(x), "logical_not");
  expect_same_layout(at::logsumexp(mx, {1}, true), at::logsumexp(x, {1}, true), "logsumexp");
  expect_same_layout(at::max(mx), at::max(x), "max (full)");
  expect_same_layout(at::flip(mx, {0}), at::flip(x, {0}), "flip");
  expect_same_layout(at::dot(mx.select(1, 0), mx.select(1, 1)), at::dot(x.select(1, 0), x.select(1, 1)), "dot");
  expect_same_layout(at::std(mx, {0}, true, true), at::std(x, {0}, true, true), "std");
  // out=: the meta out grows to the CPU's size.
  auto out = at::empty({0}, kMeta);
  auto cpu_out = at::empty({0});
  at::abs_out(out, mx);
  at::abs_out(cpu_out, x);
  expect_same_layout(out, cpu_out, "abs.out");
  // In place: the argument itself comes back.
  auto y = at::empty({4, 6}, kMeta);
  auto& same = y.logical_not_();
  EXPECT_TRUE(same.is_same(y));
  // Dtypes: a comparison's bool, an index's long.
  auto [values, indices] = at::max(mx, 1);
  EXPECT_EQ(indices.scalar_type(), at::kLong);
}

TEST(MetaFallbackTest, DataDependentOutputsAreRefusedNamingTheOp) {
  trainmem::register_meta_kernels();
  const auto x = at::empty({4, 5}, kMeta);
  const auto nonzero = error_of([&] { at::nonzero(x); });
  EXPECT_NE(nonzero.find("trainmem: aten::nonzero has no meta kernel and its output shape depends on values"),
            std::string::npos)
      << nonzero;
  const auto masked = error_of([&] { at::masked_select(x, x > 0); });
  EXPECT_NE(masked.find("trainmem: aten::masked_select has no meta kernel and its output shape depends on values"),
            std::string::npos)
      << masked;
  const auto item = error_of([&] { x.sum().item<float>(); });
  EXPECT_NE(item.find("aten::_local_scalar_dense has no meta kernel and its output shape depends on values"),
            std::string::npos)
      << item;
  const auto unique = error_of([&] { at::_unique2(x); });
  EXPECT_NE(unique.find("aten::_unique2 has no meta kernel and its output shape depends on values"), std::string::npos)
      << unique;
  // find_missing_meta_kernel() names it as a missing meta kernel.
  const auto missing = trainmem::find_missing_meta_kernel([&] { at::nonzero(x); });
  ASSERT_TRUE(missing.has_value());
  EXPECT_EQ(missing->op, "aten::nonzero") << missing->message;
}

// A draw on meta leaves the CPU generator where it was.
TEST(MetaFallbackTest, RandomOpsLeaveTheCpuGeneratorAsItWas) {
  trainmem::register_meta_kernels();
  torch::manual_seed(7);
  const auto before = at::randn({4});
  torch::manual_seed(7);
  const auto probs = at::empty({3, 5}, kMeta);
  const auto drawn = at::multinomial(probs, 2, /*replacement=*/true);
  EXPECT_EQ(drawn.sizes(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(drawn.scalar_type(), at::kLong);
  EXPECT_TRUE(at::equal(at::randn({4}), before));
}

// Above the cap, a pointwise op runs on a shrunk shape and keeps the CPU's
// layout at the full one; another op is refused, naming the op.
TEST(MetaFallbackTest, AboveTheCapPointwiseOpsRunOnASmallerShape) {
  trainmem::register_meta_kernels();
  setenv("TRAINMEM_META_FALLBACK_MAX_BYTES", "4096", 1);
  struct Unset {
    ~Unset() { unsetenv("TRAINMEM_META_FALLBACK_MAX_BYTES"); }
  } unset;
  auto x = at::randn({64, 3, 40}).permute({2, 0, 1});
  auto c = at::randn({64, 1}) > 0;
  auto mx = at::empty_strided(x.sizes(), x.strides(), kMeta);
  auto mc = at::empty({64, 1}, kMeta.dtype(at::kBool));
  expect_same_layout(at::where(mc, mx, mx), at::where(c, x, x), "where.self, shrunk");
  expect_same_layout(at::logical_not(mx), at::logical_not(x), "logical_not, shrunk");
  const auto refused = error_of([&] { at::flip(mx, {0}); });
  EXPECT_NE(refused.find("trainmem: aten::flip has no meta kernel, and its CPU kernel's stand-ins would take about"),
            std::string::npos)
      << refused;
  EXPECT_NE(refused.find("not a pointwise op"), std::string::npos) << refused;
}

// ---------------------------------------------------------------------------
// Whole steps, to the byte: saved bytes and the step's peak (Adam), meta
// against CPU.

struct Figures {
  int64_t saved_bytes = 0;
  int64_t peak_bytes = 0;
};

// `loss(on_meta)` runs the module's forward and the loss on meta tensors
// (made with an explicit device, or without one under predict_step_peak's
// guard) or on CPU data.
Figures expect_exact(const std::string& what, torch::nn::Module& cpu, torch::nn::Module& meta,
                     const std::function<at::Tensor(bool on_meta)>& loss) {
  trainmem::CpuMemoryTracker::install();
  trainmem::SavedTensorMeter meter(cpu);
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    auto l = loss(false);
  }
  const auto predicted_saved = trainmem::predict_saved_activations(meta, [&] { return loss(true); });
  EXPECT_EQ(predicted_saved.saved_bytes, meter.report().saved_bytes) << what;
  EXPECT_EQ(predicted_saved.num_storages, meter.report().num_storages) << what;
  torch::optim::Adam cpu_opt(cpu.parameters(), torch::optim::AdamOptions(1e-3));
  torch::optim::Adam meta_opt(meta.parameters(), torch::optim::AdamOptions(1e-3));
  const auto measured = trainmem::measure_step_peak(cpu, [&] { return loss(false); }, &cpu_opt);
  const auto predicted = trainmem::predict_step_peak(meta, [&] { return loss(true); }, &meta_opt);
  EXPECT_EQ(predicted.peak_bytes, measured.peak_bytes) << what << "\npredicted\n"
                                                       << trainmem::to_string(predicted) << "measured\n"
                                                       << trainmem::to_string(measured);
  EXPECT_EQ(predicted.forward_peak_bytes, measured.forward_peak_bytes) << what;
  EXPECT_EQ(predicted.backward_peak_bytes, measured.backward_peak_bytes) << what;
  EXPECT_EQ(predicted.optimizer_peak_bytes, measured.optimizer_peak_bytes) << what;
  EXPECT_EQ(predicted.activation_bytes, measured.activation_bytes) << what;
  std::printf("%s: saved %lld B (CPU %lld B), step peak %lld B (CPU %lld B)\n", what.c_str(),
              static_cast<long long>(predicted_saved.saved_bytes),
              static_cast<long long>(meter.report().saved_bytes), static_cast<long long>(predicted.peak_bytes),
              static_cast<long long>(measured.peak_bytes));
  return {predicted_saved.saved_bytes, predicted.peak_bytes};
}

constexpr int64_t kBatch = 64, kObs = 24, kHidden = 64, kActions = 6;

at::TensorOptions on(bool meta) {
  return meta ? kMeta : at::TensorOptions();
}

// The data a loss needs: observations, actions (valid indices), advantages,
// returns and old log-probabilities.
struct Batch {
  at::Tensor obs, actions, advantages, returns, old_logp;
};

Batch batch(bool meta, int64_t obs = kObs) {
  const auto o = on(meta);
  Batch b;
  b.obs = at::randn({kBatch, obs}, o);
  b.actions = meta ? at::empty({kBatch}, o.dtype(at::kLong)) : at::randint(kActions, {kBatch}, o.dtype(at::kLong));
  b.advantages = at::randn({kBatch}, o);
  b.returns = at::randn({kBatch}, o);
  b.old_logp = at::randn({kBatch}, o);
  return b;
}

// A small MLP policy: logits (or means) and a value.
struct PolicyImpl : torch::nn::Module {
  explicit PolicyImpl(int64_t obs = kObs, int64_t out = kActions) {
    body = register_module("body", torch::nn::Sequential(torch::nn::Linear(obs, kHidden), torch::nn::Tanh(),
                                                          torch::nn::Linear(kHidden, kHidden), torch::nn::Tanh()));
    pi = register_module("pi", torch::nn::Linear(kHidden, out));
    v = register_module("v", torch::nn::Linear(kHidden, 1));
    log_std = register_parameter("log_std", torch::zeros({out}));
  }
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& obs) {
    const auto h = body->forward(obs);
    return {pi->forward(h), v->forward(h).squeeze(-1)};
  }
  torch::nn::Sequential body{nullptr};
  torch::nn::Linear pi{nullptr}, v{nullptr};
  at::Tensor log_std;
};
TORCH_MODULE(Policy);

std::pair<Policy, Policy> twins() {
  torch::manual_seed(0);
  Policy cpu;
  torch::manual_seed(0);
  Policy meta;
  trainmem::to_meta(*meta);
  return {cpu, meta};
}

// torch.distributions.Categorical(logits=...): logits normalised by
// logsumexp; log_prob gathers; entropy from clamped logits and softmax.
at::Tensor categorical_logits(const at::Tensor& logits) {
  return logits - logits.logsumexp(-1, /*keepdim=*/true);
}
at::Tensor categorical_log_prob(const at::Tensor& norm_logits, const at::Tensor& actions) {
  return norm_logits.gather(-1, actions.unsqueeze(-1)).squeeze(-1);
}
at::Tensor categorical_entropy(const at::Tensor& norm_logits) {
  const auto logits = norm_logits.clamp_min(std::numeric_limits<float>::lowest());
  const auto probs = norm_logits.softmax(-1);
  return -(logits * probs).sum(-1);
}

// torch.distributions.Normal(loc, scale).log_prob and .entropy.
at::Tensor normal_log_prob(const at::Tensor& loc, const at::Tensor& scale, const at::Tensor& value) {
  const auto var = scale.pow(2);
  return -((value - loc).pow(2)) / (2 * var) - scale.log() - std::log(std::sqrt(2 * M_PI));
}
at::Tensor normal_entropy(const at::Tensor& scale) {
  return 0.5 + 0.5 * std::log(2 * M_PI) + at::log(scale);
}

TEST(MetaFallbackTest, CategoricalLogProbAndEntropyAreExact) {
  auto [cpu, meta] = twins();
  const auto f = expect_exact("categorical", *cpu, *meta, [&](bool m) {
    auto& net = m ? meta : cpu;
    const auto b = batch(m);
    const auto logits = categorical_logits(net->forward(b.obs).first);
    return -(categorical_log_prob(logits, b.actions) * b.advantages).mean() - 0.01 * categorical_entropy(logits).mean();
  });
  EXPECT_GT(f.saved_bytes, 0);
}

TEST(MetaFallbackTest, NormalLogProbAndEntropyAreExact) {
  auto [cpu, meta] = twins();
  expect_exact("normal", *cpu, *meta, [&](bool m) {
    auto& net = m ? meta : cpu;
    const auto b = batch(m);
    const auto mu = net->forward(b.obs).first;
    const auto scale = net->log_std.exp().expand_as(mu);
    const auto a = at::randn({kBatch, kActions}, on(m));
    return -(normal_log_prob(mu, scale, a).sum(-1) * b.advantages).mean() - 0.01 * normal_entropy(scale).sum(-1).mean();
  });
}

// One op at a time, on the policy's logits.
void expect_op_exact(const std::string& what, const std::function<at::Tensor(const at::Tensor& y, bool m)>& op) {
  auto [cpu, meta] = twins();
  expect_exact(what, *cpu, *meta, [&](bool m) {
    auto& net = m ? meta : cpu;
    return op(net->forward(batch(m).obs).first, m);
  });
}

TEST(MetaFallbackTest, LogsumexpIsExact) {
  expect_op_exact("logsumexp", [](const at::Tensor& y, bool) { return y.logsumexp(-1).pow(2).mean(); });
  expect_op_exact("logsumexp keepdim, dims 0 and 1",
                  [](const at::Tensor& y, bool) { return at::logsumexp(y, {0, 1}, true).sum(); });
}

TEST(MetaFallbackTest, WhereIsExact) {
  expect_op_exact("where", [](const at::Tensor& y, bool) { return at::where(y > 0, y, y * 0.1).pow(2).mean(); });
  expect_op_exact("where, a scalar other", [](const at::Tensor& y, bool) { return at::where(y > 0, y, 0.0).sum(); });
}

// where's CPU kernel casts an operand to the result's type while it runs
// (here a float operand to double: 64 x 512 x 8 B), after its output: scratch
// the meta call holds, measured on the stand-ins. It is the forward's peak
// (1,110,016 B here): without it the prediction fell 262,136 B short.
TEST(MetaFallbackTest, WhereHoldsItsCpuKernelsScratch) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  torch::nn::Linear cpu(kObs, 512);
  torch::nn::Linear meta(kObs, 512);
  trainmem::to_meta(*meta);
  torch::optim::Adam cpu_opt(cpu->parameters(), torch::optim::AdamOptions(1e-3));
  torch::optim::Adam meta_opt(meta->parameters(), torch::optim::AdamOptions(1e-3));
  auto loss = [&](bool m) {
    const auto y = (m ? meta : cpu)->forward(batch(m).obs);
    return at::where(y > 0, y, y.to(at::kDouble)).sum();
  };
  const auto measured = trainmem::measure_step_peak(*cpu, [&] { return loss(false); }, &cpu_opt);
  const auto predicted = trainmem::predict_step_peak(*meta, [&] { return loss(true); }, &meta_opt);
  EXPECT_EQ(predicted.phase, trainmem::StepPhase::kForward);
  EXPECT_EQ(predicted.forward_peak_bytes, measured.forward_peak_bytes);
  EXPECT_EQ(predicted.peak_bytes, measured.peak_bytes);
  std::printf("where with a cast: forward peak %lld B (CPU %lld B), step peak %lld B (CPU %lld B)\n",
              static_cast<long long>(predicted.forward_peak_bytes), static_cast<long long>(measured.forward_peak_bytes),
              static_cast<long long>(predicted.peak_bytes), static_cast<long long>(measured.peak_bytes));
}

TEST(MetaFallbackTest, ComparisonsAreExact) {
  expect_op_exact("gt, le, eq", [](const at::Tensor& y, bool) {
    const auto keep = y.gt(-0.5).to(at::kFloat) + y.le(0.5).to(at::kFloat) + y.eq(y.detach()).to(at::kFloat);
    return (y * keep).pow(2).mean();
  });
}

TEST(MetaFallbackTest, LogicalOpsAreExact) {
  expect_op_exact("logical_and, or, not", [](const at::Tensor& y, bool) {
    const auto inside = at::logical_and(y.gt(-0.5), y.le(0.5));
    const auto mask = at::logical_or(inside, at::logical_not(y.eq(y.detach())));
    return at::where(mask, y, y.pow(2)).mean();
  });
}

TEST(MetaFallbackTest, GatherIsExact) {
  expect_op_exact("gather", [](const at::Tensor& y, bool m) {
    const auto idx = m ? at::empty({kBatch, 2}, kMeta.dtype(at::kLong)) : at::randint(kActions, {kBatch, 2});
    return y.log_softmax(-1).gather(1, idx).sum();
  });
}

TEST(MetaFallbackTest, ClampIsExact) {
  expect_op_exact("clamp", [](const at::Tensor& y, bool) { return y.clamp(-0.2, 0.2).pow(2).mean(); });
  expect_op_exact("clamp, tensor bounds", [](const at::Tensor& y, bool m) {
    const auto lo = at::full({kActions}, -0.3, on(m));
    return at::clamp(y, lo, lo.neg()).sum();
  });
}

TEST(MetaFallbackTest, MinAndMaxWithIndicesAreExact) {
  expect_op_exact("max.dim, min.dim", [](const at::Tensor& y, bool) {
    const auto [hi, hi_at] = y.max(1);
    const auto [lo, lo_at] = at::min(y, 0, /*keepdim=*/true);
    return hi.sum() - lo.sum() + 0 * hi_at.sum() + 0 * lo_at.sum();
  });
  expect_op_exact("max, min (full), maximum, minimum", [](const at::Tensor& y, bool) {
    return y.max() - y.min() + at::maximum(y, y.flip(0)).mean() + at::minimum(y, y * 2).mean();
  });
}

// PPO's loss (Schulman et al. 2017) as CleanRL writes it: the clipped
// surrogate, the value loss and the entropy bonus, a Categorical policy.
at::Tensor ppo_loss(const at::Tensor& logits_raw, const at::Tensor& value, const Batch& b, double eps = 0.2) {
  const auto logits = categorical_logits(logits_raw);
  const auto logp = categorical_log_prob(logits, b.actions);
  const auto ratio = (logp - b.old_logp).exp();
  const auto surr1 = ratio * b.advantages;
  const auto surr2 = ratio.clamp(1 - eps, 1 + eps) * b.advantages;
  const auto policy_loss = -at::min(surr1, surr2).mean();
  const auto value_loss = 0.5 * (value - b.returns).pow(2).mean();
  return policy_loss + 0.5 * value_loss - 0.01 * categorical_entropy(logits).mean();
}

TEST(MetaFallbackTest, PpoClippedLossOfAnMlpPolicyIsExact) {
  auto [cpu, meta] = twins();
  expect_exact("PPO, MLP policy", *cpu, *meta, [&](bool m) {
    auto& net = m ? meta : cpu;
    const auto b = batch(m);
    const auto [logits, value] = net->forward(b.obs);
    return ppo_loss(logits, value, b);
  });
}

// Note [References held above the interceptor]: inside a step function
// (predict_step_function holds autocast on meta across the step, a boxed
// fallback above autograd) the engine sums a gradient used twice in place on
// meta, as on the CPU. Here h (256 x 128 fp32, 128 KiB) feeds two heads; its
// two gradients meet at the backward's peak, where an out-of-place sum was
// one h more on meta (the PPO update of tests/predict_scalar_read_test.cpp:
// 14,808 B predicted against the CPU's 13,016 B).
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() {
    body = register_module("body", torch::nn::Linear(8, 128));
    a = register_module("a", torch::nn::Linear(128, 4));
    b = register_module("b", torch::nn::Linear(128, 1));
  }
  torch::nn::Linear body{nullptr}, a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoHeads);

void two_heads_step(TwoHeads& net, torch::optim::SGD& sgd, const at::Tensor& x) {
  const auto h = torch::tanh(net->body(x));
  const auto loss = net->a(h).pow(2).mean() + net->b(h).pow(2).mean();
  sgd.zero_grad();
  loss.backward();
  sgd.step();
}

TEST(MetaFallbackTest, AGradientUsedTwiceSumsInPlaceInAStepFunction) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  TwoHeads cpu;
  TwoHeads meta;
  trainmem::to_meta(*meta);
  torch::optim::SGD cpu_sgd(cpu->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD meta_sgd(meta->parameters(), torch::optim::SGDOptions(0.1));
  const auto x = at::randn({256, 8});
  const auto x_meta = at::empty({256, 8}, kMeta);
  const auto measured =
      trainmem::measure_step_function({cpu.get()}, {&cpu_sgd}, [&] { two_heads_step(cpu, cpu_sgd, x); });
  const auto predicted =
      trainmem::predict_step_function({meta.get()}, {&meta_sgd}, [&] { two_heads_step(meta, meta_sgd, x_meta); });
  EXPECT_EQ(predicted.start_bytes, measured.start_bytes);
  EXPECT_EQ(predicted.peak_bytes, measured.peak_bytes) << "predicted\n"
                                                       << trainmem::to_string(predicted) << "measured\n"
                                                       << trainmem::to_string(measured);
  EXPECT_EQ(predicted.end_bytes, measured.end_bytes);
  std::printf("two heads in a step function: step peak %lld B (CPU %lld B)\n",
              static_cast<long long>(predicted.peak_bytes), static_cast<long long>(measured.peak_bytes));
}

// A small Atari-style CNN policy (84 x 84 frames scaled down to 36 x 36).
struct CnnPolicyImpl : torch::nn::Module {
  CnnPolicyImpl() {
    using torch::nn::Conv2dOptions;
    conv = register_module("conv", torch::nn::Sequential(torch::nn::Conv2d(Conv2dOptions(4, 16, 8).stride(4)),
                                                         torch::nn::ReLU(),
                                                         torch::nn::Conv2d(Conv2dOptions(16, 32, 4).stride(2)),
                                                         torch::nn::ReLU(), torch::nn::Flatten()));
    fc = register_module("fc", torch::nn::Linear(32 * 3 * 3, 128));
    pi = register_module("pi", torch::nn::Linear(128, kActions));
    v = register_module("v", torch::nn::Linear(128, 1));
  }
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& frames) {
    const auto h = fc->forward(conv->forward(frames)).relu();
    return {pi->forward(h), v->forward(h).squeeze(-1)};
  }
  torch::nn::Sequential conv{nullptr};
  torch::nn::Linear fc{nullptr}, pi{nullptr}, v{nullptr};
};
TORCH_MODULE(CnnPolicy);

TEST(MetaFallbackTest, PpoClippedLossOfACnnPolicyIsExact) {
  torch::manual_seed(0);
  CnnPolicy cpu;
  torch::manual_seed(0);
  CnnPolicy meta;
  trainmem::to_meta(*meta);
  expect_exact("PPO, CNN policy", *cpu, *meta, [&](bool m) {
    auto& net = m ? meta : cpu;
    auto b = batch(m);
    b.obs = at::randn({kBatch, 4, 36, 36}, on(m)) / 255.0;
    const auto [logits, value] = net->forward(b.obs);
    return ppo_loss(logits, value, b);
  });
}

TEST(MetaFallbackTest, NonzeroInALossIsRefusedNamingTheOp) {
  auto [cpu, meta] = twins();
  torch::optim::Adam opt(meta->parameters(), torch::optim::AdamOptions(1e-3));
  const auto e = error_of([&] {
    trainmem::predict_step_peak(*meta, [&] {
      const auto y = meta->forward(at::randn({kBatch, kObs})).first;
      return y.sum() + at::nonzero(y > 0).size(0);
    }, &opt);
  });
  EXPECT_NE(e.find("trainmem: aten::nonzero has no meta kernel and its output shape depends on values"),
            std::string::npos)
      << e;
  const auto saved = error_of([&] {
    trainmem::predict_saved_activations(*meta, [&] {
      const auto y = meta->forward(at::randn({kBatch, kObs}, kMeta)).first;
      return at::masked_select(y, y > 0).sum();
    });
  });
  EXPECT_NE(saved.find("trainmem: aten::masked_select has no meta kernel and its output shape depends on values"),
            std::string::npos)
      << saved;
}

}  // namespace
