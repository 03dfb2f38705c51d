#include "trainmem/accountant.h"
#include "trainmem/meta.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/output-archive.h>

namespace {

int64_t state_bytes(const trainmem::StaticBuckets& b, const std::string& name) {
  for (const auto& s : b.state_by_name) {
    if (s.name == name) return s.bytes;
  }
  return 0;
}

void one_step(torch::nn::Module& model, torch::optim::Optimizer& opt, const at::Tensor& x) {
  opt.zero_grad();
  auto& seq = dynamic_cast<torch::nn::SequentialImpl&>(model);
  seq.forward(x).pow(2).mean().backward();
  opt.step();
}

// Seed fence 1: fp32 AdamW state is exactly 2 * 4 * P bytes after the first
// step (LibTorch keeps `step` as a plain integer: no bytes), created lazily.
TEST(AccountantTest, AdamWStateIsTwiceParamBytes) {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(64, 64));
  const int64_t P = 64 * 64 + 64;
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto before = trainmem::account(*model, opt);
  EXPECT_EQ(before.num_params, P);
  EXPECT_EQ(before.param_bytes, 4 * P);
  EXPECT_EQ(before.optimizer_state_bytes, 0);  // lazily created
  EXPECT_EQ(before.grad_bytes, 0);
  EXPECT_EQ(before.predicted_grad_bytes, 4 * P);
  EXPECT_EQ(before.predicted_optimizer_state_bytes, 2 * 4 * P);
  EXPECT_EQ(before.optimizer, "AdamW");

  one_step(*model, opt, torch::randn({8, 64}));
  auto after = trainmem::account(*model, opt);
  EXPECT_EQ(after.optimizer_state_bytes, 2 * 4 * P) << trainmem::to_string(after);
  EXPECT_EQ(after.grad_bytes, 4 * P);
  EXPECT_EQ(state_bytes(after, "exp_avg"), 4 * P);
  EXPECT_EQ(state_bytes(after, "exp_avg_sq"), 4 * P);
  EXPECT_EQ(after.total_bytes(), 16 * P);
  EXPECT_EQ(after.predicted_total_bytes(), 16 * P);
}

struct OptimizerCase {
  const char* label;  // test name suffix
  const char* name;
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)> make;
  int64_t state_per_param_bytes;  // after one step, per fp32 parameter element
};

class AccountantOptimizerTest : public ::testing::TestWithParam<OptimizerCase> {};

TEST_P(AccountantOptimizerTest, StateMatchesAnalyticCount) {
  const auto& c = GetParam();
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(16, 8), torch::nn::Linear(8, 4));
  const int64_t P = 16 * 8 + 8 + 8 * 4 + 4;
  auto opt = c.make(model->parameters());
  const auto predicted = trainmem::account(*model, *opt).predicted_optimizer_state_bytes;
  one_step(*model, *opt, torch::randn({3, 16}));
  const auto b = trainmem::account(*model, *opt);
  EXPECT_EQ(b.optimizer, c.name);
  EXPECT_EQ(b.optimizer_state_bytes, c.state_per_param_bytes * P) << trainmem::to_string(b);
  EXPECT_EQ(predicted, c.state_per_param_bytes * P);
}

INSTANTIATE_TEST_SUITE_P(
    AllKnown, AccountantOptimizerTest,
    ::testing::Values(
        OptimizerCase{"Adam", "Adam", [](auto p) { return std::make_unique<torch::optim::Adam>(p); }, 8},
        OptimizerCase{"AdamAmsgrad", "Adam", [](auto p) {
          return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions().amsgrad(true)); }, 12},
        OptimizerCase{"AdamWAmsgrad", "AdamW", [](auto p) {
          return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions().amsgrad(true)); }, 12},
        OptimizerCase{"SGD", "SGD", [](auto p) {
          return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1)); }, 0},
        OptimizerCase{"SGDMomentum", "SGD", [](auto p) {
          return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9)); }, 4},
        OptimizerCase{"RMSprop", "RMSprop", [](auto p) { return std::make_unique<torch::optim::RMSprop>(p); }, 4},
        OptimizerCase{"RMSpropCenteredMomentum", "RMSprop", [](auto p) {
          return std::make_unique<torch::optim::RMSprop>(
              p, torch::optim::RMSpropOptions().momentum(0.9).centered(true)); }, 12},
        OptimizerCase{"Adagrad", "Adagrad", [](auto p) { return std::make_unique<torch::optim::Adagrad>(p); }, 4}),
    [](const ::testing::TestParamInfo<OptimizerCase>& info) { return std::string(info.param.label); });

TEST(AccountantTest, LbfgsHistoryIsCountedTensorByTensor) {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(6, 3));
  const int64_t P = 6 * 3 + 3;
  torch::optim::LBFGS opt(model->parameters(), torch::optim::LBFGSOptions(0.1).max_iter(4));
  auto x = torch::randn({5, 6});
  opt.step([&] {
    opt.zero_grad();
    auto loss = model->forward(x).pow(2).mean();
    loss.backward();
    return loss;
  });
  const auto b = trainmem::account(*model, opt);
  EXPECT_EQ(b.optimizer, "LBFGS");
  EXPECT_EQ(state_bytes(b, "d"), 4 * P);
  EXPECT_EQ(state_bytes(b, "prev_flat_grad"), 4 * P);
  int64_t dirs = 0;
  for (const auto& s : b.state_by_name) {
    if (s.name == "old_dirs") dirs = s.num_tensors;
  }
  EXPECT_GT(dirs, 0);
  EXPECT_EQ(state_bytes(b, "old_dirs"), dirs * 4 * P);
  EXPECT_EQ(state_bytes(b, "old_stps"), dirs * 4 * P);
  EXPECT_LE(b.optimizer_state_bytes, b.predicted_optimizer_state_bytes);
}

// An optimizer trainmem does not know: its state is walked through its own
// serialize(), never counted as zero.
struct TwoBufferState : torch::optim::OptimizerCloneableParamState<TwoBufferState> {
  at::Tensor a, b;
  void serialize(torch::serialize::OutputArchive& ar) const override {
    ar.write("a", a, /*is_buffer=*/true);
    ar.write("b", b, /*is_buffer=*/true);
  }
};
struct NoSerializeState : torch::optim::OptimizerCloneableParamState<NoSerializeState> {
  at::Tensor a;
};
template <typename State>
struct ToyOptimizer : torch::optim::Optimizer {
  explicit ToyOptimizer(std::vector<at::Tensor> params)
      : Optimizer(std::move(params), std::make_unique<torch::optim::SGDOptions>(0.1)) {}
  at::Tensor step(LossClosure) override {
    for (auto& p : param_groups_[0].params()) {
      auto s = std::make_unique<State>();
      s->a = at::zeros_like(p);
      if constexpr (std::is_same_v<State, TwoBufferState>) s->b = at::zeros({3});
      state_[p.unsafeGetTensorImpl()] = std::move(s);
    }
    return {};
  }
};

TEST(AccountantTest, UnknownOptimizerIsWalkedGenerically) {
  torch::nn::Sequential model(torch::nn::Linear(5, 2));
  ToyOptimizer<TwoBufferState> opt(model->parameters());
  opt.step(nullptr);
  const auto b = trainmem::account(*model, opt);
  EXPECT_NE(b.optimizer.find("ToyOptimizer"), std::string::npos) << b.optimizer;
  EXPECT_EQ(state_bytes(b, "a"), 4 * (5 * 2 + 2));
  EXPECT_EQ(state_bytes(b, "b"), 2 * 4 * 3);
  EXPECT_EQ(b.optimizer_state_bytes, 4 * (5 * 2 + 2) + 2 * 4 * 3);
}

TEST(AccountantTest, UnreadableStateIsAnErrorNotZero) {
  torch::nn::Sequential model(torch::nn::Linear(5, 2));
  ToyOptimizer<NoSerializeState> opt(model->parameters());
  opt.step(nullptr);
  try {
    (void)trainmem::account(*model, opt);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("NoSerializeState"), std::string::npos) << e.what();
  }
}

TEST(AccountantTest, RejectsOptimizerOfAnotherModule) {
  torch::nn::Linear a(3, 3), b(3, 3);
  torch::optim::SGD opt(b->parameters(), torch::optim::SGDOptions(0.1));
  try {
    (void)trainmem::account(*a, opt);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("2 of the optimizer's 2 parameters"), std::string::npos)
        << e.what();
  }
}

TEST(AccountantTest, SharedParametersCountOnceAndFrozenHaveNoGradient) {
  torch::nn::Linear shared(10, 10);
  torch::nn::Sequential model(shared, torch::nn::Linear(10, 2));
  model->push_back("again", shared);  // the same module twice
  const int64_t P = 10 * 10 + 10 + 10 * 2 + 2;
  auto b = trainmem::account(*model);
  EXPECT_EQ(b.num_params, P);
  EXPECT_EQ(b.param_bytes, 4 * P);

  shared->weight.set_requires_grad(false);  // frozen, as with LoRA
  b = trainmem::account(*model);
  EXPECT_EQ(b.num_trainable_params, P - 100);
  EXPECT_EQ(b.predicted_grad_bytes, 4 * (P - 100));
  auto f = trainmem::predict_static_bytes(*model, trainmem::Recipe::kFp32AdamW);
  EXPECT_EQ(f.total_bytes, 16 * (P - 100) + 4 * 100);
}

// Seed fence 2, planning part: a Linear(1000, 1000) on the meta device plans
// 4,004,000 bytes with no data, and propagates shapes.
TEST(AccountantTest, MetaLinearPlansExactBytesWithoutData) {
  torch::nn::Linear lin(1000, 1000);
  auto* weight_impl = lin->weight.unsafeGetTensorImpl();
  trainmem::to_meta(*lin);
  EXPECT_EQ(lin->weight.unsafeGetTensorImpl(), weight_impl);  // identity kept
  EXPECT_TRUE(lin->weight.requires_grad());
  const auto b = trainmem::account(*lin);
  EXPECT_EQ(b.param_bytes, 4004000);
  EXPECT_TRUE(lin->weight.is_meta());
  EXPECT_EQ(lin->weight.data_ptr(), nullptr);
  auto y = lin->forward(at::empty({7, 1000}, at::TensorOptions().device(at::kMeta)));
  EXPECT_TRUE(y.is_meta());
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{7, 1000}));
}

TEST(AccountantTest, FormulasShowTheirTerms) {
  // GPT-2 small at 16 B/param (seed 000's worked example).
  auto gpt2 = trainmem::predict_static_bytes(124439808, trainmem::Recipe::kFp32AdamW);
  EXPECT_EQ(gpt2.total_bytes, 1991036928);
  EXPECT_EQ(gpt2.bytes_per_param, 16.0);
  ASSERT_EQ(gpt2.terms.size(), 4u);

  // Mixed precision saves nothing over fp32: 2 + 2 + 12, the 12 sharded first.
  auto mixed = trainmem::predict_static_bytes(7000000000, trainmem::Recipe::kMixedAdamW);
  EXPECT_EQ(mixed.total_bytes, 112000000000);  // 112 GB, 104.3 GiB
  int64_t shard_first = 0;
  for (const auto& t : mixed.terms) shard_first += t.shard_first ? t.bytes : 0;
  EXPECT_EQ(shard_first, 12 * 7000000000);

  EXPECT_EQ(trainmem::predict_static_bytes(1000, trainmem::Recipe::kPureBf16AdamW).total_bytes, 12000);
  EXPECT_EQ(trainmem::predict_static_bytes(1000, trainmem::Recipe::kFp32SGD).total_bytes, 8000);
  EXPECT_EQ(trainmem::predict_static_bytes(1000, trainmem::Recipe::kFp32SGDMomentum).total_bytes, 12000);
  EXPECT_NE(trainmem::to_string(gpt2).find("1,991,036,928"), std::string::npos) << trainmem::to_string(gpt2);
  EXPECT_THROW(trainmem::predict_static_bytes(-5, trainmem::Recipe::kFp32AdamW), c10::Error);
}

TEST(AccountantTest, AdafactorKeepsFactoredState) {
  torch::nn::Linear lin(300, 200);  // weight (200, 300), bias (200)
  auto f = trainmem::predict_static_bytes(*lin, trainmem::Recipe::kFp32Adafactor);
  const int64_t P = 200 * 300 + 200;
  // params + grads + (row 200 + col 300) for the weight + 200 for the bias.
  EXPECT_EQ(f.total_bytes, 4 * P + 4 * P + 4 * (200 + 300) + 4 * 200);
}

} // namespace
