// MasterWeights (master_weights.h): fp32 masters of a bf16 model's weights,
// held to a by-hand AdamW over fp32 copies, bit for bit.
#include "trainmem/master_weights.h"

#include <limits>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "trainmem/grad_scaler.h"

namespace {

TEST(MasterWeightsTest, StepsTheMastersAndCopiesThemIntoTheWeights) {
  torch::manual_seed(0);
  torch::nn::Linear lin(8, 4);
  lin->to(at::kBFloat16);
  auto extra = torch::randn({3}).requires_grad_();  // fp32 already: no master
  std::vector<at::Tensor> trainable = lin->parameters();
  trainable.push_back(extra);
  trainmem::MasterWeights masters(trainable);
  ASSERT_EQ(masters->parameters().size(), 2u);  // weight and bias
  ASSERT_EQ(masters->optimized().size(), 3u);
  EXPECT_TRUE(masters->optimized()[2].is_same(extra));
  for (const auto& m : masters->parameters()) {
    EXPECT_EQ(m.scalar_type(), at::kFloat);
  }
  // The reference: fp32 copies stepped by AdamW on the bf16 gradients made fp32.
  std::vector<at::Tensor> ref;
  for (const auto& p : trainable) {
    ref.push_back(p.detach().to(at::kFloat).clone());
  }
  torch::optim::AdamW opt(masters->optimized(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ref_opt(ref, torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 3; ++step) {
    const auto x = torch::randn({5, 8}).to(at::kBFloat16);
    lin->zero_grad();
    extra.mutable_grad().reset();
    (lin->forward(x).to(at::kFloat).pow(2).mean() + extra.sum()).backward();
    for (size_t i = 0; i < trainable.size(); ++i) {
      ref[i].mutable_grad() = trainable[i].grad().to(at::kFloat);
    }
    masters->step(opt);
    ref_opt.step();
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_FALSE(trainable[i].grad().defined()) << "the bf16 gradient is freed";
      EXPECT_FALSE(masters->optimized()[i].grad().defined()) << "the master's gradient is freed";
      EXPECT_TRUE(at::equal(masters->optimized()[i], ref[i])) << "step " << step << ", tensor " << i;
      EXPECT_TRUE(at::equal(trainable[i], ref[i].to(at::kBFloat16))) << "step " << step << ", tensor " << i;
    }
    EXPECT_TRUE(at::equal(extra, ref[2]));
  }
  // AdamW's moments are fp32, the masters' dtype.
  const auto& state = opt.state();
  ASSERT_EQ(state.size(), 3u);
  for (const auto& [key, s] : state) {
    const auto& adamw = static_cast<const torch::optim::AdamWParamState&>(*s);
    EXPECT_EQ(adamw.exp_avg().scalar_type(), at::kFloat);
  }
}

// fp16 weights with a GradScaler: the masters step on the unscaled fp32
// gradients (SGD, lr 1: master - grad), the weights get the masters rounded
// to fp16; an inf gradient skips the step (masters and weights unchanged,
// their gradients freed all the same) and halves the scale.
TEST(MasterWeightsTest, StepsWithAGradScalerOnUnscaledGradients) {
  torch::nn::Linear lin(torch::nn::LinearOptions(2, 1).bias(false));
  {
    at::NoGradGuard no_grad;
    lin->weight.copy_(torch::tensor({{0.5f, -0.25f}}));
  }
  lin->to(at::kHalf);
  trainmem::MasterWeights masters(lin->parameters());
  torch::optim::SGD opt(masters->optimized(), torch::optim::SGDOptions(1.0));
  trainmem::GradScaler scaler(trainmem::GradScalerOptions().init_scale(1024.0));
  const auto x = torch::tensor({{1.0f, 2.0f}}).to(at::kHalf);
  scaler.scale(lin->forward(x).to(at::kFloat).sum()).backward();  // d/dw = x, scaled by 1024
  EXPECT_TRUE(masters->step(opt, scaler));
  const auto want = torch::tensor({{0.5f - 1.0f, -0.25f - 2.0f}});
  EXPECT_TRUE(at::equal(masters->optimized()[0], want)) << masters->optimized()[0];
  EXPECT_TRUE(at::equal(lin->weight, want.to(at::kHalf)));
  EXPECT_FALSE(lin->weight.grad().defined());
  EXPECT_FALSE(masters->optimized()[0].grad().defined());
  lin->weight.mutable_grad() = torch::full({1, 2}, std::numeric_limits<float>::infinity()).to(at::kHalf);
  EXPECT_FALSE(masters->step(opt, scaler));
  EXPECT_TRUE(at::equal(masters->optimized()[0], want));
  EXPECT_TRUE(at::equal(lin->weight, want.to(at::kHalf)));
  EXPECT_FALSE(masters->optimized()[0].grad().defined());
  EXPECT_EQ(scaler.get_scale(), 512.0);
}

TEST(MasterWeightsTest, RejectsIntegerTensors) {
  const auto ids = at::zeros({4}, at::kLong);
  try {
    trainmem::MasterWeights m(std::vector<at::Tensor>{ids});
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("trainable tensor 0 is not a floating-point tensor"),
              std::string::npos);
  }
}

} // namespace
