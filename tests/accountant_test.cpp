#include "trainmem/accountant.h"
#include "trainmem/meta.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
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

// fp32 AdamW state is exactly 2 * 4 * P bytes after the first
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

// Module buffers (BatchNorm's running statistics) are a bucket of
// their own, exact to the byte, and never counted as parameters.
TEST(AccountantTest, BuffersAreABucketOfTheirOwn) {
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3)), torch::nn::BatchNorm2d(8),
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3)), torch::nn::BatchNorm2d(16));
  // BatchNorm2d(C): running_mean and running_var, C fp32 each, and
  // num_batches_tracked, one int64.
  constexpr int64_t kBuffers = (2 * 8 * 4 + 8) + (2 * 16 * 4 + 8);  // 208
  int64_t storages = 0;
  for (const auto& b : net->buffers()) {
    storages += static_cast<int64_t>(b.storage().nbytes());
  }
  ASSERT_EQ(storages, kBuffers);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto b = trainmem::account(*net, opt);
  EXPECT_EQ(b.buffer_bytes, kBuffers);
  EXPECT_EQ(b.num_buffers, 6);
  const int64_t params = 4 * (8 * 3 * 3 * 3 + 8 + 8 + 8 + 16 * 8 * 3 * 3 + 16 + 16 + 16);  // conv w, b; bn w, b
  EXPECT_EQ(b.param_bytes, params);  // the buffers are not parameters
  EXPECT_EQ(b.total_bytes(), params + kBuffers);
  EXPECT_EQ(b.predicted_total_bytes(), params + kBuffers + 2 * params);  // gradients + momentum
  const auto text = trainmem::to_string(b);
  EXPECT_NE(text.find("buffers "), std::string::npos) << text;
  EXPECT_NE(text.find(" 208 B  (6 tensors)"), std::string::npos) << text;

  // A buffer on a parameter's storage is counted once, as the parameter.
  auto lin = torch::nn::Linear(4, 4);
  lin->register_buffer("alias", lin->weight.detach().view(-1));
  lin->register_buffer("own", torch::zeros({3}));
  const auto l = trainmem::account(*lin);
  EXPECT_EQ(l.param_bytes, 4 * (16 + 4));
  EXPECT_EQ(l.buffer_bytes, 3 * 4);
  EXPECT_EQ(l.num_buffers, 1);
  EXPECT_EQ(trainmem::account(*torch::nn::Linear(4, 4)).buffer_bytes, 0);
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

// A Linear(1000, 1000) on the meta device plans
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

// A module with buffers (BatchNorm's running statistics) gets a
// last formula term "buffers" of their stored bytes, which no ZeRO stage
// shards (FSDP and DeepSpeed keep buffers whole on every rank) and no offload
// moves. The net of BuffersAreABucketOfTheirOwn: 1,440 parameters, 208 B of
// buffers.
TEST(AccountantTest, FormulasOfAModelWithBuffersHaveABufferTerm) {
  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3)), torch::nn::BatchNorm2d(8),
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3)), torch::nn::BatchNorm2d(16));
  constexpr int64_t P = 8 * 3 * 3 * 3 + 8 + 8 + 8 + 16 * 8 * 3 * 3 + 16 + 16 + 16;  // 1,440
  constexpr int64_t kBuffers = (2 * 8 * 4 + 8) + (2 * 16 * 4 + 8);                  // 208
  ASSERT_EQ(trainmem::account(*net).buffer_bytes, kBuffers);
  const auto f = trainmem::predict_static_bytes(*net, trainmem::Recipe::kFp32AdamW);
  EXPECT_EQ(f.num_params, P);
  EXPECT_EQ(f.total_bytes, 23248);  // 16 B x 1,440 + 208 B
  ASSERT_EQ(f.terms.size(), 5u);
  EXPECT_EQ(f.terms.back().name, "buffers");
  EXPECT_EQ(f.terms.back().bucket, trainmem::Bucket::kBuffers);
  EXPECT_EQ(f.terms.back().bytes, kBuffers);
  EXPECT_FALSE(f.terms.back().shard_first);
  const auto text = trainmem::to_string(f);
  EXPECT_NE(text.find("P = 1,440 x (4 parameters (fp32) + 4 gradients (fp32) + 4 AdamW exp_avg (fp32) + 4 "
                      "AdamW exp_avg_sq (fp32)) + 208 B buffers = 23,248 B"),
            std::string::npos)
      << text;
  // Every recipe, Adafactor included, ends with the same term, after the
  // parameters' terms as they were.
  for (auto recipe : {trainmem::Recipe::kMixedAdamW, trainmem::Recipe::kFp32SGD, trainmem::Recipe::kFp32Adafactor}) {
    const auto g = trainmem::predict_static_bytes(*net, recipe);
    EXPECT_EQ(g.terms.back().bytes, kBuffers) << trainmem::to_string(recipe);
    if (recipe != trainmem::Recipe::kFp32Adafactor) {
      EXPECT_EQ(g.total_bytes, trainmem::predict_static_bytes(P, recipe).total_bytes + kBuffers);
    }
  }
  EXPECT_EQ(trainmem::predict_static_bytes(*net, trainmem::Recipe::kFp32SGD).total_bytes, 8 * P + kBuffers);
  // Replicated at every stage, on the device even with everything offloaded.
  // ZeRO-3 over 4 ranks: 360 elements of each per-element term per rank.
  const auto z3 = trainmem::shard_static_bytes(
      f, trainmem::ShardingOptions().zero_stage(3).world_size(4).offload_optimizer(true).offload_parameters(true));
  ASSERT_EQ(z3.terms.size(), 5u);
  EXPECT_FALSE(z3.terms.back().sharded);
  EXPECT_FALSE(z3.terms.back().on_host);
  EXPECT_EQ(z3.terms.back().per_rank_bytes, kBuffers);
  EXPECT_EQ(z3.device_per_rank_bytes, kBuffers);    // the buffers alone
  EXPECT_EQ(z3.host_per_rank_bytes, 4 * 4 * 360);   // parameter, gradient, m and v shards
  for (int64_t stage : {0, 1, 2}) {
    const auto z = trainmem::shard_static_bytes(f, trainmem::ShardingOptions().zero_stage(stage).world_size(4));
    EXPECT_EQ(z.terms.back().per_rank_bytes, kBuffers) << stage;
  }
  EXPECT_NE(trainmem::to_string(z3).find("replicated (buffers)"), std::string::npos) << trainmem::to_string(z3);
  // No buffers, no term (the formulas of most nets keep their terms).
  EXPECT_EQ(trainmem::predict_static_bytes(*torch::nn::Linear(4, 4), trainmem::Recipe::kFp32AdamW).terms.size(), 4u);
}

TEST(AccountantTest, AdafactorKeepsFactoredState) {
  torch::nn::Linear lin(300, 200);  // weight (200, 300), bias (200)
  auto f = trainmem::predict_static_bytes(*lin, trainmem::Recipe::kFp32Adafactor);
  const int64_t P = 200 * 300 + 200;
  // params + grads + (row 200 + col 300) for the weight + 200 for the bias.
  EXPECT_EQ(f.total_bytes, 4 * P + 4 * P + 4 * (200 + 300) + 4 * 200);
}

} // namespace

namespace {

constexpr int64_t kP = 7000000000;  // divisible by 8: shards are exact
constexpr int64_t kN = 8;

trainmem::ShardedStatic zero(trainmem::Recipe recipe, int64_t stage, bool offload = false,
                             int64_t largest_layer = 0) {
  return trainmem::shard_static_bytes(
      trainmem::predict_static_bytes(kP, recipe),
      trainmem::ShardingOptions().zero_stage(stage).world_size(kN).offload_optimizer(offload).largest_layer_params(
          largest_layer));
}

std::vector<std::string> differing_terms(const trainmem::PublishedFormula& f) {
  std::vector<std::string> out;
  for (const auto& t : f.terms) {
    if (!t.differs.empty()) out.push_back(t.name);
  }
  return out;
}

TEST(AccountantTest, FormulaTermsCarryTheirBuckets) {
  const auto f = trainmem::predict_static_bytes(10, trainmem::Recipe::kMixedAdamW);
  std::vector<trainmem::Bucket> buckets;
  for (const auto& t : f.terms) buckets.push_back(t.bucket);
  using trainmem::Bucket;
  EXPECT_EQ(buckets, (std::vector<Bucket>{Bucket::kParameters, Bucket::kGradients, Bucket::kOptimizerState,
                                          Bucket::kOptimizerState, Bucket::kOptimizerState}));
}

// ZeRO per rank for mixed-precision AdamW (2 + 2 + 12), P = 7e9, N = 8:
// exactly the paper's (Rajbhandari et al. 2020, K = 12) at every stage.
TEST(AccountantTest, ZeroStagesMatchThePaper) {
  const int64_t expected[] = {16 * kP, 4 * kP + 12 * kP / kN, 2 * kP + 14 * kP / kN, 16 * kP / kN};
  EXPECT_EQ(expected[1], 38500000000);
  EXPECT_EQ(expected[2], 26250000000);
  EXPECT_EQ(expected[3], 14000000000);
  for (int64_t stage = 0; stage <= 3; ++stage) {
    const auto r = zero(trainmem::Recipe::kMixedAdamW, stage);
    EXPECT_EQ(r.device_per_rank_bytes, expected[stage]) << trainmem::to_string(r);
    EXPECT_EQ(r.host_per_rank_bytes, 0);
    if (stage == 0) continue;
    const auto paper = trainmem::published_formula(
        static_cast<trainmem::Published>(static_cast<int>(trainmem::Published::kZeroPaperStage1) + stage - 1));
    EXPECT_EQ(paper.device_per_rank_bytes(kP, kN), expected[stage]) << paper.formula;
    EXPECT_TRUE(differing_terms(paper).empty());
    EXPECT_EQ(paper.sharding.zero_stage(), stage);
  }
  EXPECT_NE(trainmem::to_string(zero(trainmem::Recipe::kMixedAdamW, 2)).find("26,250,000,000"),
            std::string::npos);
}

// DeepSpeed's estimator assumes an fp32 gradient partition (18 = 2 + 4 + 4 + 8
// sharded): 4 P / N above ours at ZeRO-2, 2 P / N above ours at ZeRO-3 (it
// keeps the partition at 4 B where ours keeps 2 B). With the optimizer
// offloaded its GPU figures are ours exactly.
TEST(AccountantTest, DeepSpeedEstimatorReconciled) {
  const int64_t largest = 50257 * 4096;  // a GPT-3 6.7B-shaped embedding
  const auto ds2 = trainmem::published_formula(trainmem::Published::kDeepSpeedZero2);
  EXPECT_EQ(ds2.formula, "2 P + 18 P / N");
  EXPECT_EQ(ds2.device_per_rank_bytes(kP, kN), 2 * kP + 18 * kP / kN);
  EXPECT_EQ(ds2.device_per_rank_bytes(kP, kN) - zero(trainmem::Recipe::kMixedAdamW, 2).device_per_rank_bytes,
            4 * kP / kN);
  EXPECT_EQ(differing_terms(ds2), std::vector<std::string>{"fp32 gradients"});

  const auto ds3 = trainmem::published_formula(trainmem::Published::kDeepSpeedZero3);
  EXPECT_EQ(ds3.formula, "4 x largest layer + 18 P / N");
  const auto ours3 = zero(trainmem::Recipe::kMixedAdamW, 3, false, largest);
  EXPECT_EQ(ours3.device_per_rank_bytes, 4 * largest + 16 * kP / kN) << trainmem::to_string(ours3);
  EXPECT_EQ(ds3.device_per_rank_bytes(kP, kN, largest) - ours3.device_per_rank_bytes, 2 * kP / kN);
  EXPECT_EQ(differing_terms(ds3), std::vector<std::string>{"fp32 gradient partition"});

  const auto ours2_off = zero(trainmem::Recipe::kMixedAdamW, 2, true);
  EXPECT_EQ(ours2_off.device_per_rank_bytes, 2 * kP);
  EXPECT_EQ(ours2_off.host_per_rank_bytes, 14 * kP / kN);
  EXPECT_EQ(trainmem::published_formula(trainmem::Published::kDeepSpeedZero2Offload).device_per_rank_bytes(kP, kN),
            ours2_off.device_per_rank_bytes);

  const auto ours3_off = zero(trainmem::Recipe::kMixedAdamW, 3, true, largest);
  EXPECT_EQ(ours3_off.device_per_rank_bytes, 4 * largest + 2 * kP / kN);
  EXPECT_EQ(ours3_off.host_per_rank_bytes, 14 * kP / kN);
  EXPECT_EQ(trainmem::published_formula(trainmem::Published::kDeepSpeedZero3OffloadOptimizer)
                .device_per_rank_bytes(kP, kN, largest),
            ours3_off.device_per_rank_bytes);

  const auto ours3_all = trainmem::shard_static_bytes(
      trainmem::predict_static_bytes(kP, trainmem::Recipe::kMixedAdamW),
      trainmem::ShardingOptions().zero_stage(3).world_size(kN).offload_optimizer(true).offload_parameters(true)
          .largest_layer_params(largest));
  EXPECT_EQ(ours3_all.device_per_rank_bytes, 4 * largest);
  EXPECT_EQ(ours3_all.host_per_rank_bytes, 16 * kP / kN);
  EXPECT_EQ(trainmem::published_formula(trainmem::Published::kDeepSpeedZero3OffloadAll)
                .device_per_rank_bytes(kP, kN, largest),
            ours3_all.device_per_rank_bytes);
}

// Megatron keeps fp32 main gradients: 18 B/param, 6 + 12/d with its
// distributed optimizer (ZeRO-1), 2 B/param above our mixed recipe; in fp32
// its 8 + 8/d is ours exactly.
TEST(AccountantTest, MegatronReconciled) {
  const auto m18 = trainmem::published_formula(trainmem::Published::kMegatronBf16Fp32Grads);
  EXPECT_EQ(m18.device_per_rank_bytes(kP, kN), 18 * kP);
  EXPECT_EQ(m18.device_per_rank_bytes(kP, kN) - zero(trainmem::Recipe::kMixedAdamW, 0).device_per_rank_bytes,
            2 * kP);
  const auto dist = trainmem::published_formula(trainmem::Published::kMegatronDistributedBf16Fp32Grads);
  EXPECT_EQ(dist.formula, "6 + 12 / d");
  EXPECT_EQ(dist.device_per_rank_bytes(kP, kN), 6 * kP + 12 * kP / kN);
  EXPECT_EQ(dist.device_per_rank_bytes(kP, kN) - zero(trainmem::Recipe::kMixedAdamW, 1).device_per_rank_bytes,
            2 * kP);
  EXPECT_EQ(differing_terms(dist), std::vector<std::string>{"fp32 main gradients"});
  const auto fp32 = trainmem::published_formula(trainmem::Published::kMegatronDistributedFp32);
  EXPECT_EQ(fp32.recipe, trainmem::Recipe::kFp32AdamW);
  EXPECT_EQ(fp32.device_per_rank_bytes(kP, kN), zero(trainmem::Recipe::kFp32AdamW, 1).device_per_rank_bytes);
  EXPECT_EQ(fp32.device_per_rank_bytes(kP, kN), 8 * kP + 8 * kP / kN);
  EXPECT_TRUE(differing_terms(fp32).empty());
  EXPECT_EQ(trainmem::all_published_formulas().size(), 11u);
  for (auto which : trainmem::all_published_formulas()) {
    EXPECT_FALSE(trainmem::published_formula(which).source.empty());
  }
}

TEST(AccountantTest, ShardsArePaddedAndRecipesWithoutStateShardNothingAtStageOne) {
  // 10 elements over 4 ranks: each holds ceil(10 / 4) = 3 of every sharded buffer.
  const auto r = trainmem::shard_static_bytes(trainmem::predict_static_bytes(10, trainmem::Recipe::kMixedAdamW),
                                              trainmem::ShardingOptions().zero_stage(3).world_size(4));
  EXPECT_EQ(r.device_per_rank_bytes, 16 * 3);
  const auto sgd = trainmem::shard_static_bytes(trainmem::predict_static_bytes(kP, trainmem::Recipe::kFp32SGD),
                                                trainmem::ShardingOptions().zero_stage(1).world_size(kN));
  EXPECT_EQ(sgd.device_per_rank_bytes, 8 * kP);
  const auto bf16 = trainmem::shard_static_bytes(
      trainmem::predict_static_bytes(kP, trainmem::Recipe::kPureBf16AdamW),
      trainmem::ShardingOptions().zero_stage(2).world_size(kN));
  EXPECT_EQ(bf16.device_per_rank_bytes, 2 * kP + 10 * kP / kN);
  // Adafactor's factored state has no per-element size: ceil(bytes / N).
  torch::nn::Linear lin(300, 200);
  const auto ada = trainmem::predict_static_bytes(*lin, trainmem::Recipe::kFp32Adafactor);
  const auto ada1 = trainmem::shard_static_bytes(ada, trainmem::ShardingOptions().zero_stage(1).world_size(3));
  const int64_t P = 200 * 300 + 200;
  EXPECT_EQ(ada1.device_per_rank_bytes, 8 * P + (4 * (200 + 300 + 200) + 2) / 3);
}

TEST(AccountantTest, ShardingRejectsImpossibleOptions) {
  const auto f = trainmem::predict_static_bytes(100, trainmem::Recipe::kMixedAdamW);
  using trainmem::ShardingOptions;
  EXPECT_THROW(trainmem::shard_static_bytes(f, ShardingOptions().zero_stage(4)), c10::Error);
  EXPECT_THROW(trainmem::shard_static_bytes(f, ShardingOptions().world_size(0)), c10::Error);
  EXPECT_THROW(trainmem::shard_static_bytes(f, ShardingOptions().offload_optimizer(true)), c10::Error);
  EXPECT_THROW(trainmem::shard_static_bytes(f, ShardingOptions().zero_stage(2).offload_parameters(true)),
               c10::Error);
  try {
    trainmem::shard_static_bytes(f, ShardingOptions().zero_stage(5));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("but got 5"), std::string::npos) << e.what();
  }
}

// Every published formula beside ours at P = 7e9, N = 8: the difference is
// exactly what the terms marked as differing say.
TEST(AccountantTest, EveryPublishedFormulaReconciles) {
  const int64_t largest = 50257 * 4096;
  using trainmem::Published;
  const std::vector<std::pair<Published, int64_t>> expected = {
      {Published::kZeroPaperStage1, 0},
      {Published::kZeroPaperStage2, 0},
      {Published::kZeroPaperStage3, 0},
      {Published::kDeepSpeedZero2, 4 * kP / kN},  // fp32 gradient partition
      {Published::kDeepSpeedZero2Offload, 0},
      {Published::kDeepSpeedZero3, 2 * kP / kN},  // its gradient partition at 4 B, ours 2 B
      {Published::kDeepSpeedZero3OffloadOptimizer, 0},
      {Published::kDeepSpeedZero3OffloadAll, 0},
      {Published::kMegatronBf16Fp32Grads, 2 * kP},  // fp32 main gradients
      {Published::kMegatronDistributedBf16Fp32Grads, 2 * kP},
      {Published::kMegatronDistributedFp32, 0},
  };
  ASSERT_EQ(expected.size(), trainmem::all_published_formulas().size());
  for (const auto& [which, difference] : expected) {
    const auto r = trainmem::reconcile(which, kP, kN, largest);
    EXPECT_EQ(r.difference_bytes, difference) << trainmem::to_string(r);
    EXPECT_EQ(r.published_bytes - r.ours.device_per_rank_bytes, r.difference_bytes);
    bool any_differs = false;
    for (const auto& t : r.published.terms) any_differs |= !t.differs.empty() && !t.on_host;
    EXPECT_EQ(any_differs, difference != 0) << r.published.source;
  }
  const auto ds2 = trainmem::to_string(trainmem::reconcile(Published::kDeepSpeedZero2, kP, kN));
  EXPECT_NE(ds2.find("3,500,000,000"), std::string::npos) << ds2;
  EXPECT_NE(ds2.find("fp32 gradients: DeepSpeed keeps"), std::string::npos) << ds2;
}

} // namespace
