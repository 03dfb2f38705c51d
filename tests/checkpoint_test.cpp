#include "trainmem/checkpoint.h"

#include <functional>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include "trainmem/meter.h"
#include "trainmem/selective.h"

namespace {

using Grads = std::vector<at::Tensor>;

torch::nn::Sequential gelu_mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(32, 256), torch::nn::GELU(),
                               torch::nn::Linear(256, 32));
}

Grads grads_of(const at::Tensor& x, torch::nn::Module& m) {
  Grads g{x.grad().defined() ? x.grad().clone() : at::Tensor()};
  for (const auto& p : m.parameters()) g.push_back(p.grad().clone());
  return g;
}

void clear_grads(const at::Tensor& x, torch::nn::Module& m) {
  if (x.grad().defined()) x.mutable_grad().reset();
  m.zero_grad();
}

// Runs `loss()` plainly, backward, and returns the gradients of x and m's
// parameters, leaving them cleared for the run under test.
Grads plain_grads(const at::Tensor& x, torch::nn::Module& m, const std::function<at::Tensor()>& loss) {
  loss().backward();
  auto g = grads_of(x, m);
  clear_grads(x, m);
  return g;
}

void expect_identical(const Grads& a, const Grads& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << "gradient " << i;
    if (a[i].defined()) {
      EXPECT_TRUE(a[i].equal(b[i])) << "gradient " << i << " max diff "
                                    << (a[i] - b[i]).abs().max().item<float>();
    }
  }
}

// Only the region's input (and pow's input
// outside the region) is kept, and the gradients are identical.
TEST(CheckpointTest, KeepsOnlyTheInputsWithIdenticalGradients) {
  auto mlp = gelu_mlp();
  auto x = torch::randn({16, 32}).requires_grad_();
  const auto ref = plain_grads(x, *mlp, [&] { return mlp->forward(x).pow(2).sum(); });

  trainmem::SavedTensorMeter meter(*mlp);
  at::Tensor loss;
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    loss = trainmem::checkpoint(mlp, x).pow(2).sum();
  }
  const auto r = meter.report();
  EXPECT_EQ(r.saved_bytes, 4 * (16 * 32 + 16 * 32)) << trainmem::to_string(r);
  ASSERT_FALSE(r.by_node.empty());
  bool labelled = false;
  for (const auto& n : r.by_node) labelled |= n.node == "CheckpointInputs" && n.bytes == 4 * 16 * 32;
  EXPECT_TRUE(labelled) << trainmem::to_string(r);
  loss.backward();
  expect_identical(ref, grads_of(x, *mlp));
}

TEST(CheckpointTest, WorksWhenNoInputRequiresGrad) {
  auto mlp = gelu_mlp();
  auto x = torch::randn({16, 32});
  const auto ref = plain_grads(x, *mlp, [&] { return mlp->forward(x).pow(2).sum(); });
  trainmem::checkpoint(mlp, x).pow(2).sum().backward();
  expect_identical(ref, grads_of(x, *mlp));
}

TEST(CheckpointTest, WorksWithAutogradGradAndBackwardInputs) {
  auto mlp = gelu_mlp();
  auto x = torch::randn({16, 32}).requires_grad_();
  auto w = mlp->parameters()[0];
  auto ref = torch::autograd::grad({mlp->forward(x).pow(2).sum()}, {x, w});
  auto got = torch::autograd::grad({trainmem::checkpoint(mlp, x).pow(2).sum()}, {x, w});
  expect_identical(ref, got);

  // backward(inputs=...): only w gets a gradient.
  trainmem::checkpoint(mlp, x).pow(2).sum().backward({}, false, false, {w});
  EXPECT_FALSE(x.grad().defined());
  EXPECT_TRUE(w.grad().equal(ref[1]));
}

TEST(CheckpointTest, NestedCheckpointsGiveIdenticalGradients) {
  auto mlp = gelu_mlp();
  auto x = torch::randn({16, 32}).requires_grad_();
  const auto ref = plain_grads(x, *mlp, [&] { return mlp->forward(x).exp().sum(); });
  auto inner = [&](const at::Tensor& h) { return mlp[2]->as<torch::nn::Linear>()->forward(h); };
  auto outer = [&](const at::Tensor& in) {
    auto h = at::gelu(mlp[0]->as<torch::nn::Linear>()->forward(in));
    return trainmem::checkpoint(inner, h).exp();
  };
  trainmem::checkpoint(outer, x).sum().backward();
  expect_identical(ref, grads_of(x, *mlp));
}

TEST(CheckpointTest, PreservesRngStateForDropout) {
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(8, 64), torch::nn::Dropout(0.5), torch::nn::Linear(64, 4));
  auto x = torch::randn({5, 8}).requires_grad_();
  torch::manual_seed(123);
  const auto ref = plain_grads(x, *net, [&] { return net->forward(x).pow(2).sum(); });

  torch::manual_seed(123);
  auto loss = trainmem::checkpoint(net, x).pow(2).sum();
  (void)torch::rand({100});  // advance the RNG between forward and backward
  loss.backward();
  expect_identical(ref, grads_of(x, *net));

  // Without preservation the recomputed mask differs: different gradients.
  clear_grads(x, *net);
  torch::manual_seed(123);
  loss = trainmem::checkpoint(net, x, trainmem::CheckpointOptions().preserve_rng_state(false))
             .pow(2).sum();
  (void)torch::rand({100});
  loss.backward();
  EXPECT_FALSE(ref[1].equal(net->parameters()[0].grad()));
}

TEST(CheckpointTest, DeterminismCheckNamesTheMismatch) {
  auto w = torch::randn({4, 4}).requires_grad_();
  int calls = 0;
  auto fn = [&](const at::Tensor& x) {
    ++calls;
    auto h = calls == 1 ? x : x.to(at::kDouble).to(at::kFloat).view({2, 8}).view({4, 4});
    return (h.exp() * w).sum(1);  // exp saves its output
  };
  auto loss = trainmem::checkpoint(fn, torch::randn({4, 4})).sum();
  // Same shapes and dtypes: passes. Now change a dtype on recompute.
  loss.backward();
  calls = 0;
  auto fn2 = [&](const at::Tensor& x) {
    ++calls;
    auto h = calls == 1 ? x : x.to(at::kDouble);
    return (h.exp() * w).sum(1);
  };
  loss = trainmem::checkpoint(fn2, torch::randn({4, 4})).sum();
  try {
    loss.backward();
    FAIL() << "a dtype change on recompute must be caught";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("Recomputed values for the following tensors have different metadata"),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("tensor at position"), std::string::npos) << msg;
  }
}

TEST(CheckpointTest, DifferentNumberOfSavedTensorsIsAnError) {
  auto w = torch::randn({3}).requires_grad_();
  int calls = 0;
  auto fewer = [&](const at::Tensor& x) {
    ++calls;
    auto y = x * w;                          // saves x (w needs grad)
    return calls == 1 ? (y.exp() * 1).sum(0, true) : (y * 1).sum(0, true);  // exp saves once
  };
  auto loss = trainmem::checkpoint(fewer, torch::randn({3}), trainmem::CheckpointOptions().early_stop(false)).sum();
  try {
    loss.backward();
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("A different number of tensors was saved"), std::string::npos)
        << e.what();
  }
  calls = 0;
  auto more = [&](const at::Tensor& x) {
    ++calls;
    auto y = x * w;
    return calls == 1 ? y.sum(0, true) : y.exp().exp().sum(0, true);
  };
  loss = trainmem::checkpoint(more, torch::randn({3}), trainmem::CheckpointOptions().early_stop(false)).sum();
  try {
    loss.backward();
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("trying to save more tensors during recomputation"),
              std::string::npos) << e.what();
  }
}

TEST(CheckpointTest, BackwardTwiceWithoutRetainGraphIsAnError) {
  auto mlp = gelu_mlp();
  auto x = torch::randn({4, 32}).requires_grad_();
  auto loss = trainmem::checkpoint(mlp, x).pow(2).sum();
  loss.backward();
  try {
    loss.backward();
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Trying to backward through the graph a second time"),
              std::string::npos) << e.what();
  }
  // With retain_graph the second backward recomputes again and accumulates.
  clear_grads(x, *mlp);
  loss = trainmem::checkpoint(mlp, x).pow(2).sum();
  loss.backward({}, /*retain_graph=*/true);
  auto once = x.grad().clone();
  loss.backward();
  EXPECT_TRUE(x.grad().equal(once * 2));
}

TEST(CheckpointTest, ReentrantGivesIdenticalGradientsAndRejectsGrad) {
  auto mlp = gelu_mlp();
  auto x = torch::randn({16, 32}).requires_grad_();
  const auto ref = plain_grads(x, *mlp, [&] { return mlp->forward(x).pow(2).sum(); });
  const auto reentrant = trainmem::CheckpointOptions().use_reentrant(true);
  trainmem::SavedTensorMeter meter(*mlp);
  at::Tensor loss;
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    loss = trainmem::checkpoint(mlp, x, reentrant).pow(2).sum();
  }
  EXPECT_EQ(meter.report().saved_bytes, 4 * (16 * 32 + 16 * 32));
  loss.backward();
  expect_identical(ref, grads_of(x, *mlp));

  try {
    (void)torch::autograd::grad({trainmem::checkpoint(mlp, x, reentrant).sum()}, {x});
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("incompatible with .grad()"), std::string::npos) << e.what();
  }
}

TEST(CheckpointTest, SequentialCheckpointsAllButTheLastSegment) {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int i = 0; i < 8; ++i) {
    net->push_back(torch::nn::Linear(16, 16));
    net->push_back(torch::nn::Tanh());
  }
  auto x = torch::randn({4, 16}).requires_grad_();
  const auto ref = plain_grads(x, *net, [&] { return net->forward(x).sum(); });

  trainmem::SavedTensorMeter meter(*net);
  at::Tensor loss;
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    loss = trainmem::checkpoint_sequential(net, 4, x).sum();
  }
  // 3 checkpointed segments keep their input (3 x 4x16 floats); the last
  // segment (Linear, Tanh, Linear, Tanh) keeps its input and 2 Tanh outputs
  // (the second Linear's input is the first Tanh's output: counted once).
  EXPECT_EQ(meter.report().saved_bytes, 4 * 64 * (3 + 3)) << trainmem::to_string(meter.report());
  loss.backward();
  expect_identical(ref, grads_of(x, *net));

  EXPECT_THROW(trainmem::checkpoint_sequential(net, 0, x), c10::Error);
  try {
    (void)trainmem::checkpoint_sequential(net, 17, x);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("but got segments = 17"), std::string::npos) << e.what();
  }
  EXPECT_EQ(trainmem::sqrt_segments(16), 4);
  EXPECT_EQ(trainmem::sqrt_segments(6), 2);
  EXPECT_EQ(trainmem::sqrt_segments(1), 1);
}

// A conv net with BatchNorm and dropout, built the same way each time.
torch::nn::Sequential bn_net() {
  using namespace torch::nn;
  torch::manual_seed(5);
  return Sequential(Conv2d(Conv2dOptions(3, 8, 3).padding(1)), BatchNorm2d(8), ReLU(),
                    Dropout(0.3), Conv2d(Conv2dOptions(8, 4, 3).padding(1)), BatchNorm2d(4),
                    ReLU());
}

struct BnStep {
  Grads grads;
  std::vector<at::Tensor> buffers;  // running_mean, running_var, num_batches_tracked of each BN
  at::Tensor next_random;           // the RNG's next draw after the step
};

// Two training steps' forward and backward (no optimizer): the second sees
// the running statistics the first left.
BnStep bn_steps(const std::function<at::Tensor(torch::nn::Sequential&, const at::Tensor&)>& forward) {
  auto net = bn_net();
  torch::manual_seed(11);
  auto x = torch::randn({4, 3, 8, 8}).requires_grad_();
  for (int step = 0; step < 2; ++step) {
    clear_grads(x, *net);
    auto loss = forward(net, x).pow(2).mean();
    (void)torch::rand({7});  // the RNG moves between forward and backward
    loss.backward();
  }
  BnStep r{grads_of(x, *net), {}, torch::rand({4})};
  for (const auto& b : net->buffers()) r.buffers.push_back(b.clone());
  return r;
}

void expect_same_step(const BnStep& ref, const BnStep& got) {
  expect_identical(ref.grads, got.grads);
  ASSERT_EQ(ref.buffers.size(), got.buffers.size());
  ASSERT_EQ(ref.buffers.size(), 6u);
  for (size_t i = 0; i < ref.buffers.size(); ++i) {
    EXPECT_TRUE(ref.buffers[i].equal(got.buffers[i]))
        << "buffer " << i << ": " << ref.buffers[i] << " vs " << got.buffers[i];
  }
  EXPECT_TRUE(ref.next_random.equal(got.next_random));
}

// Note [Recompute does not change state]: BatchNorm's running statistics and
// num_batches_tracked move once per step under every kind of checkpoint, and
// dropout's recomputed mask is the forward's (gradients identical).
TEST(CheckpointTest, BatchNormStatisticsUpdateOncePerStep) {
  const auto plain = bn_steps([](torch::nn::Sequential& net, const at::Tensor& x) { return net->forward(x); });
  EXPECT_EQ(plain.buffers[2].item<int64_t>(), 2);  // num_batches_tracked: two steps
  EXPECT_EQ(plain.buffers[5].item<int64_t>(), 2);
  {
    SCOPED_TRACE("non-reentrant");
    expect_same_step(plain, bn_steps([](torch::nn::Sequential& net, const at::Tensor& x) {
                       return trainmem::checkpoint(net, x);
                     }));
  }
  {
    SCOPED_TRACE("non-reentrant, no early stop");
    expect_same_step(plain, bn_steps([](torch::nn::Sequential& net, const at::Tensor& x) {
                       return trainmem::checkpoint(net, x, trainmem::CheckpointOptions().early_stop(false));
                     }));
  }
  {
    SCOPED_TRACE("reentrant");
    expect_same_step(plain, bn_steps([](torch::nn::Sequential& net, const at::Tensor& x) {
                       return trainmem::checkpoint(net, x, trainmem::CheckpointOptions().use_reentrant(true));
                     }));
  }
  {
    SCOPED_TRACE("checkpoint_sequential");
    expect_same_step(plain, bn_steps([](torch::nn::Sequential& net, const at::Tensor& x) {
                       return trainmem::checkpoint_sequential(net, 3, x);
                     }));
  }
  {
    SCOPED_TRACE("selective");
    expect_same_step(plain, bn_steps([](torch::nn::Sequential& net, const at::Tensor& x) {
                       auto opts = trainmem::CheckpointOptions().context_fn(
                           trainmem::create_selective_checkpoint_contexts(trainmem::save_matmuls_policy()));
                       return trainmem::checkpoint(net, x, opts);
                     }));
  }
}

// The copy is of state from outside the region only: a buffer the region
// makes and writes in place is its own (nothing restored, gradients right).
TEST(CheckpointTest, RecomputeKeepsInPlaceWritesOnItsOwnTensors) {
  auto counter = torch::zeros({1}, torch::kLong);
  auto w = torch::randn({4, 4}).requires_grad_();
  auto x = torch::randn({2, 4}).requires_grad_();
  auto region = [&](const at::Tensor& in) {
    counter.add_(1);                       // state outside: restored after recompute
    auto h = at::mm(in, w);
    h.mul_(2).relu_();                      // its own tensor: written in place as usual
    return h;
  };
  auto plain = region(x).sum();
  plain.backward();
  const auto gx = x.grad().clone(), gw = w.grad().clone();
  x.mutable_grad().reset();
  w.mutable_grad().reset();
  counter.zero_();
  trainmem::checkpoint(region, x).sum().backward();
  EXPECT_EQ(counter.item<int64_t>(), 1);  // not 2
  EXPECT_TRUE(gx.equal(x.grad()));
  EXPECT_TRUE(gw.equal(w.grad()));
}

} // namespace
