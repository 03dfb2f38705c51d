// materialize() of a module built under a MetaInitGuard replays what its
// construction ran (Note [Init replayed on materialize]): the values, bit for
// bit, of a CPU construction after the same seed, each tensor keeping its
// identity; what cannot be replayed is refused, naming the tensor and the op.
#include "trainmem/meta.h"

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/rnn.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include "trainmem/allocator.h"
#include "trainmem/models/gpt.h"
#include "trainmem/models/transformer.h"
#include "support/error_of.h"

namespace {

using trainmem::testing::error_of;

// Every parameter and buffer of `a` is on the CPU and equal, bit for bit, to
// the one of the same name in `b`.
void expect_bit_equal(torch::nn::Module& a, torch::nn::Module& b) {
  auto check = [](const auto& x, const auto& y) {
    ASSERT_EQ(x.size(), y.size());
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(x[i].key(), y[i].key());
      const at::Tensor& u = x[i].value();
      const at::Tensor& v = y[i].value();
      ASSERT_TRUE(u.is_cpu()) << x[i].key() << " is on " << u.device();
      EXPECT_TRUE(torch::equal(u, v)) << x[i].key() << ": max |difference| "
                                      << (u.to(at::kDouble) - v.to(at::kDouble)).abs().max().item<double>();
    }
  };
  check(a.named_parameters(), b.named_parameters());
  check(a.named_buffers(), b.named_buffers());
}

// Builds with `make` twice after the same seed, on the CPU and under a
// MetaInitGuard, and materializes the second on the CPU.
template <typename M>
std::pair<M, M> cpu_and_materialized(const std::function<M()>& make, uint64_t seed) {
  torch::manual_seed(seed);
  M cpu = make();
  torch::manual_seed(seed);
  M meta{nullptr};
  {
    trainmem::MetaInitGuard guard;
    meta = make();
  }
  for (const auto& p : meta->parameters()) {
    EXPECT_TRUE(p.is_meta());
  }
  trainmem::materialize(*meta, at::kCPU);
  return {cpu, meta};
}

// A PPO policy as C++ RL libraries write it: a CNN trunk, actor and critic
// heads, each weight orthogonal (gain sqrt(2); 0.01 for the actor, 1 for the
// critic) and each bias 0.
struct PolicyImpl : torch::nn::Module {
  PolicyImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 16, 8).stride(4)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 4).stride(2)));
    fc = register_module("fc", torch::nn::Linear(32 * 3 * 3, 64));
    actor = register_module("actor", torch::nn::Linear(64, 6));
    critic = register_module("critic", torch::nn::Linear(64, 1));
    torch::NoGradGuard no_grad;
    for (auto* w : {&conv1->weight, &conv2->weight, &fc->weight}) {
      torch::nn::init::orthogonal_(*w, std::sqrt(2.0));
    }
    torch::nn::init::orthogonal_(actor->weight, 0.01);
    torch::nn::init::orthogonal_(critic->weight, 1.0);
    for (auto* b : {&conv1->bias, &conv2->bias, &fc->bias, &actor->bias, &critic->bias}) {
      torch::nn::init::constant_(*b, 0);
    }
  }
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    auto h = torch::relu(conv2(torch::relu(conv1(x)))).flatten(1);
    h = torch::relu(fc(h));
    return {actor(h), critic(h)};
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc{nullptr}, actor{nullptr}, critic{nullptr};
};
TORCH_MODULE(Policy);

at::Tensor policy_loss(Policy& p, const at::Tensor& obs) {
  auto [logits, value] = p->forward(obs);
  return -torch::log_softmax(logits, -1).select(1, 2).mean() + value.pow(2).mean();
}

TEST(MaterializeTest, PpoPolicyEqualsCpuBuildAndItsOptimizerSteps) {
  torch::manual_seed(5);
  Policy cpu;
  torch::manual_seed(5);
  Policy meta{nullptr};
  {
    trainmem::MetaInitGuard guard;
    meta = Policy();
  }
  std::vector<const c10::TensorImpl*> impls;
  for (const auto& p : meta->parameters()) impls.push_back(p.unsafeGetTensorImpl());
  // An optimizer made on the meta module steps the materialized tensors.
  torch::optim::Adam meta_adam(meta->parameters(), torch::optim::AdamOptions(1e-3));
  trainmem::materialize(*meta, at::kCPU);
  expect_bit_equal(*meta, *cpu);
  // LibTorch's own init would differ: the orthogonal actor has rows of norm 0.01.
  EXPECT_NEAR(meta->actor->weight.norm(2, 1).max().item<double>(), 0.01, 1e-6);
  const auto params = meta->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].unsafeGetTensorImpl(), impls[i]);
    EXPECT_TRUE(params[i].requires_grad());
  }
  torch::optim::Adam cpu_adam(cpu->parameters(), torch::optim::AdamOptions(1e-3));
  const auto obs = torch::rand({2, 4, 36, 36});
  for (auto [model, adam] : {std::make_pair(&meta, &meta_adam), std::make_pair(&cpu, &cpu_adam)}) {
    adam->zero_grad();
    policy_loss(*model, obs).backward();
    adam->step();
  }
  expect_bit_equal(*meta, *cpu);
  EXPECT_FALSE(torch::equal(meta->fc->bias, torch::zeros({64})));  // it stepped
}

// Each of LibTorch's initializers, a copy_ under no_grad from a real tensor
// (made before the guard, and computed under it on the CPU), one through
// .data(), a tied parameter, views of one storage and a buffer.
struct CustomInitImpl : torch::nn::Module {
  explicit CustomInitImpl(const at::Tensor& table) {
    a = register_module("a", torch::nn::Linear(6, 5));
    b = register_module("b", torch::nn::Linear(5, 4));
    c = register_module("c", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3)));
    emb = register_module("emb", torch::nn::Embedding(10, 4));
    auto flat = torch::empty({10});
    u = register_parameter("u", flat.narrow(0, 0, 4));
    v = register_parameter("v", flat.narrow(0, 4, 6));
    copied = register_parameter("copied", torch::empty({3, 4}));
    doubled = register_parameter("doubled", torch::empty({3, 4}));
    tied = register_parameter("tied", emb->weight);
    steps = register_buffer("steps", torch::arange(0, 8, torch::kLong).reshape({2, 4}));
    torch::NoGradGuard no_grad;
    torch::nn::init::kaiming_uniform_(a->weight, 0.0, torch::kFanOut);
    torch::nn::init::uniform_(a->bias, -0.3, 0.2);
    torch::nn::init::kaiming_normal_(b->weight);
    torch::nn::init::zeros_(b->bias);
    torch::nn::init::xavier_uniform_(c->weight, 1.5);
    torch::nn::init::normal_(c->bias, 1.0, 0.5);
    torch::nn::init::xavier_normal_(emb->weight);
    torch::nn::init::constant_(u, 0.25);
    v.data().normal_(3.0, 2.0);
    copied.copy_(table);
    doubled.copy_(table * 2 + 1);  // runs on the CPU under the guard: a constant
    tied.mul_(0.5);
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::nn::Conv2d c{nullptr};
  torch::nn::Embedding emb{nullptr};
  at::Tensor u, v, copied, doubled, tied, steps;
};
TORCH_MODULE(CustomInit);

TEST(MaterializeTest, CustomInitsEqualCpuBuild) {
  const at::Tensor table = torch::arange(12, torch::kFloat).reshape({3, 4}).sin();
  auto [cpu, meta] = cpu_and_materialized<CustomInit>([&] { return CustomInit(table); }, 17);
  expect_bit_equal(*meta, *cpu);
  EXPECT_EQ(meta->tied.unsafeGetTensorImpl(), meta->emb->weight.unsafeGetTensorImpl());
  EXPECT_EQ(meta->u.storage().unsafeGetStorageImpl(), meta->v.storage().unsafeGetStorageImpl());
  EXPECT_EQ(meta->v.storage_offset(), 4);
  EXPECT_EQ(meta->u.storage().nbytes(), 40u);
}

TEST(MaterializeTest, BundledTransformerAndGptEqualCpuBuild) {
  const auto topts = trainmem::TransformerOptions().num_layers(2).d_model(32).num_heads(4);
  auto [t_cpu, t_meta] = cpu_and_materialized<trainmem::Transformer>(
      [&] { return trainmem::Transformer(topts); }, 7);
  expect_bit_equal(*t_meta, *t_cpu);
  const auto gopts = trainmem::GPTOptions().vocab_size(97).context_length(16).d_model(32).num_layers(2).num_heads(4);
  auto [g_cpu, g_meta] = cpu_and_materialized<trainmem::GPT>([&] { return trainmem::GPT(gopts); }, 11);
  expect_bit_equal(*g_meta, *g_cpu);
}

struct RecurrentImpl : torch::nn::Module {
  RecurrentImpl() {
    lstm = register_module("lstm", torch::nn::LSTM(torch::nn::LSTMOptions(8, 16).num_layers(2)));
    torch::NoGradGuard no_grad;
    torch::nn::init::orthogonal_(lstm->named_parameters()["weight_hh_l0"]);
  }
  torch::nn::LSTM lstm{nullptr};
};
TORCH_MODULE(Recurrent);

TEST(MaterializeTest, LstmEqualsCpuBuildAndRuns) {
  auto [cpu, meta] = cpu_and_materialized<Recurrent>([] { return Recurrent(); }, 23);
  expect_bit_equal(*meta, *cpu);
  const auto x = torch::randn({5, 2, 8});
  EXPECT_TRUE(torch::equal(std::get<0>(meta->lstm->forward(x)), std::get<0>(cpu->lstm->forward(x))));
}

// A module built under one guard, one child replaced under a second: the
// replay draws the first construction's numbers (the replaced child's
// included) before the second's, as the CPU did.
TEST(MaterializeTest, PartlyReplacedModuleEqualsCpuBuild) {
  auto build = [] {
    return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Linear(8, 3));
  };
  torch::manual_seed(29);
  auto cpu = build();
  auto cpu_new = torch::nn::Linear(8, 3);
  {
    torch::NoGradGuard no_grad;
    torch::nn::init::orthogonal_(cpu_new->weight);
  }
  cpu->replace_module("1", cpu_new);
  torch::manual_seed(29);
  torch::nn::Sequential meta{nullptr};
  {
    trainmem::MetaInitGuard guard;
    meta = build();
  }
  {
    trainmem::MetaInitGuard guard;
    auto lin = torch::nn::Linear(8, 3);
    torch::NoGradGuard no_grad;
    torch::nn::init::orthogonal_(lin->weight);
    meta->replace_module("1", lin);
  }
  trainmem::materialize(*meta, at::kCPU);
  expect_bit_equal(*meta, *cpu);
}

// A copy from a meta tensor made outside the guard cannot be replayed: the
// refusal names the parameter and the op, and nothing is allocated.
TEST(MaterializeTest, RefusesATensorFromOutsideTheRecordNamingParameterAndOp) {
  const auto outside = torch::empty({3, 4}, at::TensorOptions().device(at::kMeta));
  torch::nn::Linear lin{nullptr};
  {
    trainmem::MetaInitGuard guard;
    lin = torch::nn::Linear(4, 3);
    torch::NoGradGuard no_grad;
    lin->weight.copy_(outside);
  }
  const std::string m = error_of([&] { trainmem::materialize(*lin, at::kCPU); });
  EXPECT_NE(m.find("cannot give weight the values"), std::string::npos) << m;
  EXPECT_NE(m.find("aten::copy_ read a meta tensor of size [3, 4] not made under the MetaInitGuard"),
            std::string::npos)
      << m;
  EXPECT_EQ(m.find("bias"), std::string::npos) << m;
  EXPECT_TRUE(lin->weight.is_meta());
  EXPECT_TRUE(lin->bias.is_meta());
}

// A real tensor the construction copied, changed before materialize(): the
// replay would copy other values, so it refuses.
TEST(MaterializeTest, RefusesARealTensorChangedSinceTheConstruction) {
  auto table = torch::ones({3, 4});
  torch::nn::Linear lin{nullptr};
  {
    trainmem::MetaInitGuard guard;
    lin = torch::nn::Linear(4, 3);
    torch::NoGradGuard no_grad;
    lin->weight.copy_(table);
  }
  table.add_(1);
  const std::string m = error_of([&] { trainmem::materialize(*lin, at::kCPU); });
  EXPECT_NE(m.find("cannot give weight the values its construction gave: aten::copy_ read a real tensor of "
                   "size [3, 4] that was changed after the construction (version 0, now 1)"),
            std::string::npos)
      << m;
  EXPECT_TRUE(lin->weight.is_meta());
}

// The record lives in the meta tensors: it holds what the construction read
// (here a real table) until they are materialized or destroyed, no longer.
TEST(MaterializeTest, RecordLivesAsLongAsTheMetaTensors) {
  auto make = [](c10::weak_intrusive_ptr<c10::TensorImpl>& watch) {
    auto table = torch::ones({3, 4});
    watch = c10::weak_intrusive_ptr<c10::TensorImpl>(table.getIntrusivePtr());
    trainmem::MetaInitGuard guard;
    torch::nn::Linear lin(4, 3);
    torch::NoGradGuard no_grad;
    lin->weight.copy_(table);
    return lin;
  };
  c10::weak_intrusive_ptr<c10::TensorImpl> watch(c10::intrusive_ptr<c10::TensorImpl>{});
  {
    auto lin = make(watch);
    EXPECT_FALSE(watch.expired());  // the record keeps the table to replay the copy
  }
  EXPECT_TRUE(watch.expired());  // destroyed with the module
  auto lin = make(watch);
  EXPECT_FALSE(watch.expired());
  trainmem::materialize(*lin, at::kCPU);
  EXPECT_TRUE(watch.expired());  // dropped by materialize
  EXPECT_TRUE(torch::equal(lin->weight, torch::ones({3, 4})));
}

// load_into() replays nothing: the checkpoint's values win, and the record
// is dropped.
TEST(MaterializeTest, LoadIntoTakesTheCheckpointAndDropsTheRecord) {
  auto make = [] {
    torch::nn::Linear lin(4, 3);
    torch::NoGradGuard no_grad;
    torch::nn::init::orthogonal_(lin->weight);
    return lin;
  };
  torch::manual_seed(3);
  auto source = make();
  source->weight.data().add_(1);
  torch::nn::Linear lin{nullptr};
  {
    trainmem::MetaInitGuard guard;
    lin = make();
  }
  trainmem::load_into(*lin, [&](const std::string& name) { return source->named_parameters()[name].detach(); },
                      at::kCPU);
  expect_bit_equal(*lin, *source);
  trainmem::materialize(*lin, at::kCPU);  // nothing on meta: nothing replayed or reset
  expect_bit_equal(*lin, *source);
}

// A module moved with to_meta() has no construction to replay: its built-in
// reset runs as before; under a parent built on meta it is refused by name.
TEST(MaterializeTest, ModuleMovedWithToMetaIsResetAndMixingIsRefused) {
  torch::nn::Linear moved(4, 3);
  trainmem::to_meta(*moved);
  torch::manual_seed(13);
  trainmem::materialize(*moved, at::kCPU);
  torch::manual_seed(13);
  torch::nn::Linear fresh(4, 3);
  expect_bit_equal(*moved, *fresh);

  torch::nn::Linear half{nullptr};
  {
    trainmem::MetaInitGuard guard;
    half = torch::nn::Linear(4, 3);
  }
  half->bias.set_data(torch::empty({3}, at::TensorOptions().device(at::kMeta)));
  EXPECT_THROW(
      {
        try {
          trainmem::materialize(*half, at::kCPU);
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("owns weight, made under a MetaInitGuard"), std::string::npos)
              << e.what();
          throw;
        }
      },
      c10::Error);
}

} // namespace

namespace {

struct OrthogonalStackImpl : torch::nn::Module {
  OrthogonalStackImpl() {
    for (int i = 0; i < 4; ++i) {
      auto lin = register_module("l" + std::to_string(i), torch::nn::Linear(128, 128));
      torch::NoGradGuard no_grad;
      torch::nn::init::orthogonal_(lin->weight);
    }
  }
};
TORCH_MODULE(OrthogonalStack);

// The replay frees each temporary after its last use: its peak is a CPU
// construction's, not the sum of every temporary the construction made.
TEST(MaterializeTest, ReplayPeakIsACpuConstructionsPeak) {
  auto& tracker = trainmem::CpuMemoryTracker::install();
  const int64_t param_bytes = 4 * (128 * 128 + 128) * 4;  // 264,192 B
  int64_t cpu_peak = 0;
  {
    const int64_t base = tracker.stats().allocated_bytes;
    trainmem::PeakWindow window(tracker);
    const int64_t allocs = tracker.stats().num_allocs;
    OrthogonalStack cpu;
    cpu_peak = window.peak_bytes() - base;
    EXPECT_EQ(tracker.stats().allocated_bytes - base, param_bytes);
    EXPECT_GT(tracker.stats().num_allocs - allocs, 8);  // temporaries besides the 8 tensors
  }
  OrthogonalStack meta{nullptr};
  {
    trainmem::MetaInitGuard guard;
    meta = OrthogonalStack();
  }
  const int64_t base = tracker.stats().allocated_bytes;
  trainmem::PeakWindow window(tracker);
  trainmem::materialize(*meta, at::kCPU);
  const int64_t replay_peak = window.peak_bytes() - base;
  EXPECT_EQ(tracker.stats().allocated_bytes - base, param_bytes);
  EXPECT_EQ(replay_peak, cpu_peak) << "replay " << replay_peak << " B, CPU construction " << cpu_peak << " B";
}

} // namespace

namespace {

// A read of values that failed on meta (aten::equal) and that the
// constructor caught: what it did next may differ from a CPU construction, so
// what is written after it is refused, what came before is not.
TEST(MaterializeTest, RefusesWhatFollowsAReadThatFailedOnMeta) {
  torch::nn::Sequential seq{nullptr};
  {
    trainmem::MetaInitGuard guard;
    torch::nn::Linear first(4, 4);
    EXPECT_THROW(torch::equal(first->weight, first->weight), c10::Error);
    seq = torch::nn::Sequential(first, torch::nn::Linear(4, 2));
  }
  const std::string m = error_of([&] { trainmem::materialize(*seq, at::kCPU); });
  EXPECT_NE(m.find("materialize: cannot give 1.weight the values its construction gave: aten::equal threw on "
                   "meta, where a CPU construction runs it"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("nor 1.bias"), std::string::npos) << m;
  EXPECT_EQ(m.find("0.weight"), std::string::npos) << m;
  EXPECT_TRUE(seq->ptr(0)->parameters()[0].is_meta());
}

} // namespace
