#include "trainmem/meter.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/rnn.h>

#include "trainmem/allocator.h"
#include "trainmem/hooks.h"
#include "trainmem/meta.h"

namespace {

int64_t node_bytes(const trainmem::SavedTensorReport& r, const std::string& node) {
  for (const auto& n : r.by_node) {
    if (n.node == node) {
      return n.bytes;
    }
  }
  return -1;
}

torch::nn::Sequential gelu_mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(32, 256), torch::nn::GELU(),
                               torch::nn::Linear(256, 32));
}

// A 32 -> 256 -> 32 MLP at batch 16 saves x, the
// first Linear's output, the GELU output and the MLP output (pow's input).
TEST(MeterTest, CountsMlpExactly) {
  auto mlp = gelu_mlp();
  auto x = torch::randn({16, 32}).requires_grad_();
  trainmem::SavedTensorMeter meter(*mlp);
  at::Tensor loss;
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    loss = mlp->forward(x).pow(2).sum();
  }
  const auto r = meter.report();
  const int64_t expected = 4 * (16 * 32 + 2 * 16 * 256 + 16 * 32);
  EXPECT_EQ(r.saved_bytes, expected) << trainmem::to_string(r);
  EXPECT_EQ(r.saved_bytes, 36864);
  EXPECT_EQ(r.num_storages, 4);
  // Each addmm saves its input and W.T (a view of the weight: excluded).
  EXPECT_EQ(r.num_param_tensors, 2);
  EXPECT_EQ(r.excluded_param_bytes, 4 * (32 * 256 + 256 * 32));
  EXPECT_EQ(node_bytes(r, "AddmmBackward0"), 4 * (16 * 32 + 16 * 256));
  EXPECT_EQ(node_bytes(r, "GeluBackward0"), 4 * 16 * 256);
  EXPECT_EQ(node_bytes(r, "PowBackward0"), 4 * 16 * 32);
  int64_t sum = 0;
  for (const auto& n : r.by_node) sum += n.bytes;
  EXPECT_EQ(sum, r.saved_bytes);
  loss.backward();
}

// addmm saves W.T, a plain view that is not the Parameter tensor: an exclusion
// by tensor identity (Python's isinstance filter) misses it, ours does not.
TEST(MeterTest, ExcludesTransposedWeightByStorage) {
  torch::nn::Linear lin(8, 4);
  auto x = torch::randn({2, 8}).requires_grad_();
  std::vector<at::Tensor> packed;
  {
    trainmem::SavedTensorHooksGuard guard(
        [&](const at::Tensor& t) -> std::any {
          packed.push_back(t.tensor_data());
          return t.tensor_data();
        },
        [](const std::any& p) { return std::any_cast<at::Tensor>(p); });
    auto y = lin->forward(x);
    (void)y;
  }
  ASSERT_EQ(packed.size(), 2u);  // x and W.T
  const auto& wt = packed[1];
  EXPECT_NE(wt.unsafeGetTensorImpl(), lin->weight.unsafeGetTensorImpl());
  EXPECT_TRUE(wt.is_same_size(lin->weight.t()));
  EXPECT_TRUE(wt.is_alias_of(lin->weight));

  trainmem::SavedTensorMeter meter(*lin);
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    auto y = lin->forward(x);
    (void)y;
  }
  const auto r = meter.report();
  EXPECT_EQ(r.saved_bytes, 4 * 2 * 8);  // x alone
  EXPECT_EQ(r.num_param_tensors, 1);
  EXPECT_EQ(r.excluded_param_bytes, 4 * 8 * 4);
}

// q, k, v are views of one qkv buffer: several saved tensors, one storage.
TEST(MeterTest, DeduplicatesViewsOfOneStorage) {
  auto base = torch::randn({2, 5, 24}).requires_grad_();
  trainmem::SavedTensorMeter meter;
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    auto qkv = base.exp().view({2, 5, 3, 2, 4});  // (B, T, 3, H, hd); exp saves it
    auto q = qkv.select(2, 0).transpose(1, 2);
    auto k = qkv.select(2, 1).transpose(1, 2);
    auto v = qkv.select(2, 2).transpose(1, 2);
    auto s = (q * k * v).sum();  // each mul saves both operands
    (void)s;
  }
  const auto r = meter.report();
  // The qkv storage once (exp's result, q, k, v), plus q * k once.
  EXPECT_EQ(r.saved_bytes, 4 * (2 * 5 * 24) + 4 * (2 * 2 * 5 * 4));
  EXPECT_EQ(r.num_storages, 2);
  EXPECT_EQ(r.num_tensors, 5);
}

TEST(MeterTest, GradientsAreBitIdentical) {
  auto mlp = gelu_mlp();
  auto x = torch::randn({16, 32}).requires_grad_();
  mlp->forward(x).pow(2).sum().backward();
  std::vector<at::Tensor> ref{x.grad().clone()};
  for (const auto& p : mlp->parameters()) ref.push_back(p.grad().clone());
  x.mutable_grad().reset();
  mlp->zero_grad();

  trainmem::SavedTensorMeter meter(*mlp);
  at::Tensor loss;
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    loss = mlp->forward(x).pow(2).sum();
  }
  loss.backward();
  std::vector<at::Tensor> got{x.grad()};
  for (const auto& p : mlp->parameters()) got.push_back(p.grad());
  ASSERT_EQ(ref.size(), got.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_TRUE(ref[i].equal(got[i])) << "gradient " << i << " differs";
  }
}

TEST(MeterTest, CountsMetaTensors) {
  torch::nn::Linear lin(32, 64);
  trainmem::to_meta(*lin);
  auto x = at::empty({16, 32}, at::TensorOptions().device(at::kMeta)).requires_grad_();
  trainmem::SavedTensorMeter meter(*lin);
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    auto y = at::gelu(lin->forward(x));
    (void)y;
  }
  const auto r = meter.report();
  ASSERT_EQ(lin->weight.data_ptr(), nullptr);
  // x (saved by addmm) and the Linear output (saved by gelu).
  EXPECT_EQ(r.saved_bytes, 4 * (16 * 32 + 16 * 64)) << trainmem::to_string(r);
  EXPECT_EQ(r.excluded_param_bytes, 4 * 32 * 64);
}

TEST(MeterTest, ReadingWhileActiveIsAnError) {
  trainmem::SavedTensorMeter meter;
  trainmem::SavedTensorMeterGuard scope(meter);
  try {
    (void)meter.report();
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("while a SavedTensorMeterGuard"), std::string::npos);
  }
  EXPECT_THROW(trainmem::SavedTensorMeterGuard again(meter), c10::Error);
  EXPECT_TRUE(meter.active());
}

TEST(MeterTest, AccumulatesScopesUntilReset) {
  auto x = torch::randn({10}).requires_grad_();
  trainmem::SavedTensorMeter meter;
  for (int i = 0; i < 2; ++i) {
    trainmem::SavedTensorMeterGuard scope(meter);
    auto y = x.exp();  // a new 40-byte storage each time
    (void)y;
  }
  EXPECT_EQ(meter.report().saved_bytes, 80);
  meter.reset();
  EXPECT_EQ(meter.report().saved_bytes, 0);
  EXPECT_EQ(trainmem::num_active_saved_tensor_hooks(), 0);
}

// With hooks, autograd no longer checks saved tensors' versions; the meter's
// unpack does, so an in-place change still fails loudly instead of giving a
// silently wrong gradient.
TEST(MeterTest, DetectsInPlaceModificationOfSavedTensor) {
  auto x = torch::randn({4}).requires_grad_();
  trainmem::SavedTensorMeter meter;
  at::Tensor y, loss;
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    y = x.exp();        // saves its result
    loss = y.sum();
  }
  {
    at::NoGradGuard no_grad;
    y.add_(1);
  }
  try {
    loss.backward();
    FAIL() << "backward must detect the in-place change";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("modified by an inplace operation"), std::string::npos)
        << e.what();
  }
}

// A custom Function that builds graph in its forward (newer nodes than its
// own before its saves) and saves an input, an inner result and its output.
struct SavesInsideForward : torch::autograd::Function<SavesInsideForward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    at::Tensor inner;
    {
      at::AutoGradMode grad(true);
      inner = (x.detach().requires_grad_() * 2).sin();
    }
    auto y = x * 3;
    ctx->save_for_backward({x, inner, y});
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {grads[0] * 3 + 0 * saved[1].detach() * saved[2].detach()};
  }
};

// Every kind of save the meter's adapter decides on (Note [A plain save keeps
// its own tensor], hooks.cpp): outputs, inputs made by the op just before,
// an in-place op that clones its input (mul_, and copysign_, which saves its
// result too), in-place ops on views (CopySlices), views of leaves and of
// results, a _foreach op (a node per element), a custom Function and an
// LSTMCell. Returns a loss over all of them.
at::Tensor every_kind_of_save(const at::Tensor& x, const at::Tensor& w, torch::nn::LSTMCell& cell) {
  auto h = x.exp().sigmoid().tanh() * w;               // outputs, then inputs one op old
  auto a = h * 1;
  a.mul_(w);                                           // clones a's old value
  auto b = h * 1;
  b.copysign_(w);                                      // clones, and saves its result
  auto c = h * 1;
  c.select(0, 1).mul_(w.select(0, 1));                 // in place on a view
  c.narrow(0, 0, 2).exp_();                            // saves its result, a view
  auto d = at::mm(h.t(), w);                           // a view of a result, a view of a leaf
  auto f = at::_foreach_mul(std::vector<at::Tensor>{a, b}, std::vector<at::Tensor>{c, d.t()});
  auto g = SavesInsideForward::apply(f[0] + f[1]);
  auto [hy, cy] = cell->forward(g.narrow(1, 0, 3), std::nullopt);
  return g.sum() + hy.sum() + cy.tanh().sum();
}

TEST(MeterTest, SavesKeptWholeLeakNoGraphAndChangeNoGradient) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  torch::nn::LSTMCell cell(3, 5);
  const auto x = torch::randn({4, 4}).requires_grad_();
  const auto w = torch::randn({4, 4}).requires_grad_();
  auto plain_loss = every_kind_of_save(x, w, cell);
  plain_loss.backward();
  const auto x_grad = x.grad().clone();
  const auto w_grad = w.grad().clone();
  const auto cell_grad = cell->weight_hh.grad().clone();
  plain_loss = at::Tensor();
  x.mutable_grad().reset();
  w.mutable_grad().reset();
  cell->zero_grad();

  trainmem::SavedTensorMeter meter(*cell);
  for (const bool backward : {false, true}) {
    const int64_t before = tracker.stats().allocated_bytes;
    {
      at::Tensor loss;
      {
        trainmem::SavedTensorMeterGuard scope(meter);
        loss = every_kind_of_save(x, w, cell);
      }
      EXPECT_GT(meter.report().saved_bytes, 0);
      if (backward) {
        loss.backward();
        EXPECT_TRUE(at::equal(x.grad(), x_grad));
        EXPECT_TRUE(at::equal(w.grad(), w_grad));
        EXPECT_TRUE(at::equal(cell->weight_hh.grad(), cell_grad));
        x.mutable_grad().reset();
        w.mutable_grad().reset();
        cell->zero_grad();
      }
    }
    meter.reset();
    // A reference cycle through a saved output would keep its graph and
    // every tensor the graph saved.
    EXPECT_EQ(tracker.stats().allocated_bytes, before) << (backward ? "after backward" : "without backward");
  }
}

TEST(MeterTest, NestedMetersCountTheirOwnScopes) {
  auto x = torch::randn({8}).requires_grad_();
  trainmem::SavedTensorMeter outer, inner;
  {
    trainmem::SavedTensorMeterGuard a(outer);
    auto y = x.exp();  // outer
    {
      trainmem::SavedTensorMeterGuard b(inner);
      auto z = x.sin();  // inner: saves x
      (void)z;
    }
    auto w = y.tanh();  // outer: saves its result
    (void)w;
  }
  EXPECT_EQ(outer.report().saved_bytes, 64);
  EXPECT_EQ(inner.report().saved_bytes, 32);
  EXPECT_EQ(node_bytes(inner.report(), "SinBackward0"), 32);
  EXPECT_EQ(node_bytes(outer.report(), "TanhBackward0"), 32);
}

} // namespace
