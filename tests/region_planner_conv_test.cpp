// The region planner on conv nets: the PyTorch C++ examples' MNIST convnet
// (cpp/mnist), the DCGAN discriminator and generator (cpp/dcgan's shapes) and
// a ResNet-style net with BatchNorm. Each is planned on meta (meta.h's conv,
// batch norm and pooling kernels), then run on CPU under each plan: saved
// bytes equal the meter's, the step peak is within 0.5 % of the CPU's, a
// budget plan fits, and gradients equal the plain run's (check_model).
#include <memory>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "trainmem/allocator.h"
#include "trainmem/planner.h"
#include "region_planner_check.h"
#include "support/basic_block.h"
#include "support/mnist_net.h"

namespace {

namespace F = torch::nn::functional;
namespace nn = torch::nn;
using Modules = std::vector<std::shared_ptr<nn::Module>>;
using trainmem::CheckpointPlan;
using trainmem::PlanOptions;
using trainmem::Region;
using trainmem::RegionModel;
using trainmem::testing::check_model;
using trainmem::testing::MnistNet;

// Every region was profiled on meta: none fell back to the CPU. A fallback
// names the op whose meta kernel is missing.
void expect_all_on_meta(const RegionModel& m, const std::string& name) {
  const auto plan = trainmem::plan_regions(m);
  for (const auto& f : plan.cpu_fallbacks) {
    ADD_FAILURE() << name << ": region " << f.region << " was profiled on CPU: " << f.op
                  << " has no meta kernel (" << f.reason << ")";
  }
}


// pytorch/examples cpp/mnist's Net (tests/support/mnist_net.h), cut into four
// regions.
TEST(RegionPlannerConvTest, MnistConvnet) {
  at::manual_seed(1);
  MnistNet net;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));
  RegionModel m;
  m.regions = {
      Region("conv1",
             [net](const at::Tensor& x) mutable {
               return at::relu(F::max_pool2d(net->conv1->forward(x), F::MaxPool2dFuncOptions(2)));
             },
             Modules{net->conv1.ptr()}),
      Region("conv2",
             [net](const at::Tensor& x) mutable {
               return at::relu(F::max_pool2d(net->conv2_drop->forward(net->conv2->forward(x)),
                                             F::MaxPool2dFuncOptions(2)));
             },
             Modules{net->conv2.ptr(), net->conv2_drop.ptr()}),
      Region("fc1",
             [net](const at::Tensor& x) mutable {
               auto h = at::relu(net->fc1->forward(x.view({-1, 320})));
               return F::dropout(h, F::DropoutFuncOptions().p(0.5).training(net->is_training()));
             },
             Modules{net->fc1.ptr()}),
      Region("fc2", [net](const at::Tensor& x) mutable { return at::log_softmax(net->fc2->forward(x), 1); },
             Modules{net->fc2.ptr()}),
  };
  m.input = [](c10::Device device) { return at::randn({64, 1, 28, 28}, at::TensorOptions().device(device)); };
  m.loss = [](const at::Tensor& out) {
    return at::nll_loss(out, at::zeros({out.size(0)}, out.options().dtype(at::kLong)));
  };
  m.optimizer = &sgd;
  // Saved bytes are exact (3,401,220 B, as the Python oracle says). The
  // CPU's peak is inside conv2's convolution_backward, whose oneDNN kernel
  // allocates about 1 MB of scratch: the meta kernel measures it once on CPU
  // (Note [CPU convolution scratch] in meta_kernels.cpp). The
  // prediction is 4,752,596 B, the CPU's 4,752,600 B (the loss scalar); without
  // the scratch it would be 4.96 % low.
  check_model("MNIST convnet", *net, m, &sgd);
  expect_all_on_meta(m, "MNIST convnet");
}

// cpp/dcgan's discriminator: a Sequential, one region per module.
TEST(RegionPlannerConvTest, DcganDiscriminator) {
  at::manual_seed(1);
  nn::Sequential d(
      nn::Conv2d(nn::Conv2dOptions(1, 64, 4).stride(2).padding(1).bias(false)),
      nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(0.2)),
      nn::Conv2d(nn::Conv2dOptions(64, 128, 4).stride(2).padding(1).bias(false)), nn::BatchNorm2d(128),
      nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(0.2)),
      nn::Conv2d(nn::Conv2dOptions(128, 256, 4).stride(2).padding(1).bias(false)), nn::BatchNorm2d(256),
      nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(0.2)),
      nn::Conv2d(nn::Conv2dOptions(256, 1, 3).stride(1).padding(0).bias(false)), nn::Sigmoid());
  torch::optim::Adam opt(d->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.5}));
  RegionModel m;
  m.regions = trainmem::regions_of(d);
  m.input = [](c10::Device device) { return at::randn({32, 1, 28, 28}, at::TensorOptions().device(device)); };
  m.loss = [](const at::Tensor& out) {
    auto real = at::full({out.size(0)}, 0.9, out.options());  // cpp/dcgan's label smoothing
    return at::binary_cross_entropy(out.reshape(-1), real);
  };
  m.optimizer = &opt;
  // Saved bytes exact; peaks with the convolutions' CPU scratch (see
  // MnistConvnet): 'none' predicted 18,937,860 B, CPU 18,937,988 B
  // (-0.0007 %; -11.07 % before the scratch was measured).
  check_model("DCGAN discriminator", *d, m, &opt);
  expect_all_on_meta(m, "DCGAN discriminator");
}

// cpp/dcgan's generator: noise (B, 100, 1, 1) -> 4x4 -> 7x7 -> 14x14 -> 28x28.
struct DcganGeneratorImpl : nn::Module {
  explicit DcganGeneratorImpl(int64_t noise)
      : conv1(register_module("conv1", nn::ConvTranspose2d(nn::ConvTranspose2dOptions(noise, 256, 4).bias(false)))),
        bn1(register_module("bn1", nn::BatchNorm2d(256))),
        conv2(register_module(
            "conv2", nn::ConvTranspose2d(nn::ConvTranspose2dOptions(256, 128, 3).stride(2).padding(1).bias(false)))),
        bn2(register_module("bn2", nn::BatchNorm2d(128))),
        conv3(register_module(
            "conv3", nn::ConvTranspose2d(nn::ConvTranspose2dOptions(128, 64, 4).stride(2).padding(1).bias(false)))),
        bn3(register_module("bn3", nn::BatchNorm2d(64))),
        conv4(register_module(
            "conv4", nn::ConvTranspose2d(nn::ConvTranspose2dOptions(64, 1, 4).stride(2).padding(1).bias(false)))) {}
  nn::ConvTranspose2d conv1;
  nn::BatchNorm2d bn1;
  nn::ConvTranspose2d conv2;
  nn::BatchNorm2d bn2;
  nn::ConvTranspose2d conv3;
  nn::BatchNorm2d bn3;
  nn::ConvTranspose2d conv4;
};
TORCH_MODULE(DcganGenerator);

TEST(RegionPlannerConvTest, DcganGenerator) {
  at::manual_seed(1);
  DcganGenerator g(100);
  torch::optim::Adam opt(g->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.5}));
  auto up = [](nn::ConvTranspose2d conv, nn::BatchNorm2d bn, const std::string& name) {
    return Region(
        name, [conv, bn](const at::Tensor& x) mutable { return at::relu(bn->forward(conv->forward(x))); },
        Modules{conv.ptr(), bn.ptr()});
  };
  RegionModel m;
  m.regions = {up(g->conv1, g->bn1, "up1"), up(g->conv2, g->bn2, "up2"), up(g->conv3, g->bn3, "up3"),
               Region("out", [g](const at::Tensor& x) mutable { return at::tanh(g->conv4->forward(x)); },
                      Modules{g->conv4.ptr()})};
  m.input = [](c10::Device device) { return at::randn({32, 100, 1, 1}, at::TensorOptions().device(device)); };
  m.loss = [](const at::Tensor& out) { return out.pow(2).mean(); };
  m.optimizer = &opt;
  // Saved bytes exact; peaks with the transposed convolutions' CPU scratch
  // (see MnistConvnet): 'none' predicted 19,260,420 B, CPU 19,260,424 B
  // ('none' -0.59 % before the scratch was measured).
  check_model("DCGAN generator", *g, m, &opt);
  expect_all_on_meta(m, "DCGAN generator");
}

// A ResNet-style net: a conv + BatchNorm stem, residual blocks (the last one
// downsamples, with a 1x1 projection), global average pooling and a linear
// head. Blocks are their own module type: regions by shared_ptr and holder.
using trainmem::testing::BasicBlock;

// The stem: conv + BatchNorm + ReLU (a Sequential cannot hold a Sequential).
struct StemImpl : nn::Module {
  StemImpl()
      : conv(register_module("conv", nn::Conv2d(nn::Conv2dOptions(3, 16, 3).padding(1).bias(false)))),
        bn(register_module("bn", nn::BatchNorm2d(16))) {}
  at::Tensor forward(const at::Tensor& x) { return at::relu(bn->forward(conv->forward(x))); }
  nn::Conv2d conv;
  nn::BatchNorm2d bn;
};
TORCH_MODULE(Stem);

TEST(RegionPlannerConvTest, ResNetStyleWithBatchNorm) {
  at::manual_seed(1);
  nn::Sequential net(
      Stem(),
      BasicBlock(16, 16, 1), BasicBlock(16, 16, 1), BasicBlock(16, 32, 2));
  nn::Linear fc(32, 10);
  net->push_back(fc);  // registered beside the others: one module owns all parameters
  // The head: pooling and the linear layer, as one region.
  RegionModel m;
  auto seq = trainmem::regions_of(net);
  m.regions.assign(seq.begin(), seq.end() - 1);
  m.regions.emplace_back(
      "head", [fc](const at::Tensor& x) mutable { return fc->forward(at::adaptive_avg_pool2d(x, {1, 1}).flatten(1)); },
      Modules{fc.ptr()});
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(5e-4));
  m.input = [](c10::Device device) { return at::randn({16, 3, 32, 32}, at::TensorOptions().device(device)); };
  m.loss = [](const at::Tensor& logits) {
    return at::cross_entropy_loss(logits, at::zeros({logits.size(0)}, logits.options().dtype(at::kLong)));
  };
  m.optimizer = &sgd;
  // Saved bytes exact; peaks with the convolutions' CPU scratch (see
  // MnistConvnet): 'none' predicted 16,649,596 B, CPU 16,649,600 B; the
  // smallest peak's plan 9,932,796 B vs 9,932,800 B (-9.45 % and -13.26 %
  // before the scratch was measured).
  check_model("ResNet-style", *net, m, &sgd);
  expect_all_on_meta(m, "ResNet-style");
  // Identical blocks share their profiles: blocks 1 and 2 are one structure.
  const auto plan = trainmem::plan_regions(m);
  EXPECT_EQ(plan.region_names[1], plan.region_names[2]);
}

// Plain conv nets at 8 x 3 x 160 x 160, one region per module of a
// Sequential: Conv2d(3x3, padding 1) [+ BatchNorm2d] + ReLU, 3 -> 16 -> 32 ->
// 64 channels, 2x2 max pooling between.
nn::Sequential plain_conv_net(bool batch_norm) {
  nn::Sequential net;
  auto layer = [&](int64_t in, int64_t out) {
    net->push_back(nn::Conv2d(nn::Conv2dOptions(in, out, 3).padding(1).bias(!batch_norm)));
    if (batch_norm) net->push_back(nn::BatchNorm2d(out));
    net->push_back(nn::ReLU());
  };
  layer(3, 16);
  net->push_back(nn::MaxPool2d(nn::MaxPool2dOptions(2)));
  layer(16, 32);
  net->push_back(nn::MaxPool2d(nn::MaxPool2dOptions(2)));
  layer(32, 64);
  return net;
}

// `net`'s modules as regions, then `head` (whose Linear `fc` joins `net`, so
// `net` owns every parameter); cross entropy against class 0.
RegionModel plain_conv_model(nn::Sequential net, Region head, nn::Linear fc) {
  RegionModel m;
  m.regions = trainmem::regions_of(net);
  m.regions.push_back(std::move(head));
  net->push_back(fc);
  m.input = [](c10::Device device) { return at::randn({8, 3, 160, 160}, at::TensorOptions().device(device)); };
  m.loss = [](const at::Tensor& logits) {
    return at::cross_entropy_loss(logits, at::zeros({logits.size(0)}, logits.options().dtype(at::kLong)));
  };
  return m;
}

Region pooled_head(nn::Linear fc) {
  return Region(
      "head", [fc](const at::Tensor& x) mutable { return fc->forward(at::adaptive_avg_pool2d(x, {1, 1}).flatten(1)); },
      Modules{fc.ptr()});
}

struct BudgetRun {
  CheckpointPlan plan;
  trainmem::StepPeak measured;
};

// Plans `m` for `fraction` of its unbudgeted plan's predicted peak and runs
// the plan's step on CPU as check_model does (the input made in the step).
BudgetRun plan_at_fraction(const std::string& name, nn::Module& module, RegionModel& m,
                           torch::optim::Optimizer* opt, double fraction) {
  trainmem::CpuMemoryTracker::install();
  const auto x = m.input(at::kCPU);
  const auto free_plan = trainmem::plan_regions(m);
  const auto budget = static_cast<int64_t>(fraction * static_cast<double>(free_plan.predicted_peak_bytes));
  BudgetRun r;
  r.plan = trainmem::plan_regions(m, PlanOptions().budget_bytes(budget));
  const auto checkpointing = r.plan.checkpointing();
  r.measured = trainmem::measure_step_peak(module, [&] {
    return m.loss(trainmem::run_regions(m.regions, x.clone(), checkpointing));
  }, opt);
  std::cout << name << " at " << fraction << " of " << free_plan.predicted_peak_bytes << " B: '" << r.plan.name
            << "' " << (r.plan.feasible ? "fits" : "does not fit") << ", predicted " << r.plan.predicted_peak_bytes
            << " B (" << to_string(r.plan.peak_phase) << "), measured " << r.measured.peak_bytes << " B ("
            << to_string(r.measured.phase) << ")\n";
  EXPECT_EQ(r.plan.activation_bytes, r.measured.activation_bytes) << name << " at " << fraction;
  if (r.plan.feasible) {
    EXPECT_LE(r.measured.peak_bytes, budget) << name << " at " << fraction << "\n" << to_string(r.plan);
  } else {
    EXPECT_EQ(r.plan.predicted_peak_bytes, r.plan.min_peak_bytes) << name << " at " << fraction;
  }
  return r;
}

// Checkpointed Conv + BatchNorm segments were under-predicted: the CPU's
// native_batch_norm_backward allocates its grad_input twice on its
// contiguous path (Note [CPU batch norm scratch] in meta_kernels.cpp), so a
// BatchNorm backward in a recompute was 13 MB (8 x 16 x 160 x 160 floats)
// over the plan. Without that scratch (2 threads): at 70 % a plan of
// 46,902,656 B "fit" a 48,881,190 B budget and measured 55,182,016 B
// (-15.0 %); at 80 %, 53,612,288 B vs 56,733,568 B (-5.5 %) over its
// 55,864,217 B budget; 'none' -512 B (the forward's statistics, made twice).
// With it: every plan's prediction equals the CPU's, and 55,182,016 B is the
// smallest reachable peak, so 70 % has no plan.
TEST(RegionPlannerConvTest, PlainConvNetWithBatchNormSegments) {
  at::manual_seed(1);
  auto net = plain_conv_net(/*batch_norm=*/true);
  nn::Linear fc(64, 10);
  auto m = plain_conv_model(net, pooled_head(fc), fc);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  m.optimizer = &sgd;
  for (double fraction : {0.7, 0.8}) {
    const auto r = plan_at_fraction("conv+BN", *net, m, &sgd, fraction);
    EXPECT_EQ(r.plan.predicted_peak_bytes, r.measured.peak_bytes) << "at " << fraction << "\n" << to_string(r.plan);
    EXPECT_EQ(r.plan.peak_phase, r.measured.phase);
    EXPECT_NE(r.plan.name, "none");  // checkpointed segments
  }
  check_model("conv+BN", *net, m, &sgd);
  expect_all_on_meta(m, "conv+BN");
}

// The same net without BatchNorm (biased convolutions): exact before and after.
TEST(RegionPlannerConvTest, PlainConvNetWithoutBatchNormSegments) {
  at::manual_seed(1);
  auto net = plain_conv_net(/*batch_norm=*/false);
  nn::Linear fc(64, 10);
  auto m = plain_conv_model(net, pooled_head(fc), fc);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  m.optimizer = &sgd;
  for (double fraction : {0.7, 0.8}) {
    const auto r = plan_at_fraction("conv", *net, m, &sgd, fraction);
    EXPECT_EQ(r.plan.predicted_peak_bytes, r.measured.peak_bytes) << "at " << fraction << "\n" << to_string(r.plan);
  }
  check_model("conv", *net, m, &sgd);
}

// The net without BatchNorm, with a head that flattens the 64 x 40 x 40
// features into a Linear (5.7 M parameters) under Adam: plans that checkpoint
// have their peak in Adam's step, where the step's input (made in the step,
// freed with the graph in backward) is not live (Note [Checkpoint planner]).
// Counted live, it would put every plan's peak in Adam's step at
// 140,461,440 B (2,457,600 B over, the 8 x 3 x 160 x 160 input), so no
// checkpointing would seem to help and every budget would get 'none', which
// the CPU measures at 138,885,000 B (in backward; +1.14 %). Not counted:
// 'none' is exact, and checkpointing lowers the peak to Adam's step,
// predicted 138,003,840 B; the CPU is 12 B above there, as in every Adam
// step: each Tensor-Scalar op makes a CPU scalar (8 B) and its float copy
// (4 B), CPU tensors that a meta profile does not count.
TEST(RegionPlannerConvTest, PlainConvNetWithoutBatchNormPeakInAdamStep) {
  at::manual_seed(1);
  auto net = plain_conv_net(/*batch_norm=*/false);
  nn::Linear fc(64 * 40 * 40, 56);
  auto m = plain_conv_model(
      net, Region("head", [fc](const at::Tensor& x) mutable { return fc->forward(x.flatten(1)); }, Modules{fc.ptr()}),
      fc);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  m.optimizer = &adam;
  constexpr int64_t kAdamCpuScalars = 12;
  for (double fraction : {0.7, 0.8, 0.995}) {
    const auto r = plan_at_fraction("conv, Adam", *net, m, &adam, fraction);
    EXPECT_EQ(r.plan.peak_phase, trainmem::StepPhase::kOptimizerStep) << "at " << fraction;
    EXPECT_EQ(r.measured.phase, trainmem::StepPhase::kOptimizerStep) << "at " << fraction;
    EXPECT_EQ(r.measured.peak_bytes - r.plan.predicted_peak_bytes, kAdamCpuScalars)
        << "at " << fraction << "\n" << to_string(r.plan);
  }
  check_model("conv, Adam", *net, m, &adam);
}

} // namespace
