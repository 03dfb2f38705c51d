// The region planner on a model with skip connections: a U-Net with a
// ResNet-style encoder (BasicBlocks with BatchNorm), three decoder stages
// that each concatenate an encoder stage's features, and an encoder
// classification head the segmentation loss never reaches (unused
// parameters, as in segmentation trainers built on a classification
// backbone). It is planned split into encoder and decoder stages, each a
// region over several tensors (Note [Regions with several tensors]), then
// run on CPU under each plan: saved bytes and step peaks equal the CPU's to
// the byte, a budget plan fits, and gradients equal the plain run's.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "trainmem/allocator.h"
#include "trainmem/meta.h"
#include "trainmem/planner.h"
#include "region_planner_check.h"
#include "support/basic_block.h"
#include "support/error_of.h"

namespace {

namespace nn = torch::nn;
using Modules = std::vector<std::shared_ptr<nn::Module>>;
using T = trainmem::Region::Tensors;
using trainmem::PlanOptions;
using trainmem::Region;
using trainmem::RegionModel;

using trainmem::testing::BasicBlock;
using trainmem::testing::error_of;

// conv 3x3 + BatchNorm + ReLU over the upsampled features and the skip.
struct DecoderStageImpl : nn::Module {
  DecoderStageImpl(int64_t in, int64_t skip, int64_t out)
      : conv(register_module("conv", nn::Conv2d(nn::Conv2dOptions(in + skip, out, 3).padding(1).bias(false)))),
        bn(register_module("bn", nn::BatchNorm2d(out))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& skip) {
    auto up = at::upsample_nearest2d(x, {skip.size(2), skip.size(3)});
    return at::relu(bn->forward(conv->forward(at::cat({up, skip}, 1))));
  }
  nn::Conv2d conv;
  nn::BatchNorm2d bn;
};
TORCH_MODULE(DecoderStage);

struct UNetImpl : nn::Module {
  UNetImpl()
      : stem_conv(register_module("stem_conv", nn::Conv2d(nn::Conv2dOptions(3, 16, 3).padding(1).bias(false)))),
        stem_bn(register_module("stem_bn", nn::BatchNorm2d(16))),
        enc1(register_module("enc1", BasicBlock(16, 32, 2))),
        enc2(register_module("enc2", BasicBlock(32, 64, 2))),
        enc3(register_module("enc3", BasicBlock(64, 64, 2))),
        classifier(register_module("classifier", nn::Linear(64, 1000))),  // never used by the loss
        dec3(register_module("dec3", DecoderStage(64, 64, 64))),
        dec2(register_module("dec2", DecoderStage(64, 32, 32))),
        dec1(register_module("dec1", DecoderStage(32, 16, 16))),
        head(register_module("head", nn::Conv2d(nn::Conv2dOptions(16, 2, 1)))) {}

  // The plain forward, for the gradients the plans must reproduce.
  at::Tensor forward(const at::Tensor& x) {
    auto e0 = at::relu(stem_bn->forward(stem_conv->forward(x)));
    auto e1 = enc1->forward(e0);
    auto e2 = enc2->forward(e1);
    auto e3 = enc3->forward(e2);
    return head->forward(dec1->forward(dec2->forward(dec3->forward(e3, e2), e1), e0));
  }

  // Encoder stages return their features twice (the next stage's input and
  // the skip a decoder stage takes); the skips ride along in slots 1...
  std::vector<Region> regions() {
    auto self = std::static_pointer_cast<UNetImpl>(shared_from_this());
    return {
        Region("stem", [self](const T& xs) -> T {
          auto e0 = at::relu(self->stem_bn->forward(self->stem_conv->forward(xs[0])));
          return {e0, e0};
        }, Modules{stem_conv.ptr(), stem_bn.ptr()}),
        Region("enc1", [self](const T& xs) -> T {
          auto e1 = self->enc1->forward(xs[0]);
          return {e1, xs[1], e1};
        }, Modules{enc1.ptr()}),
        Region("enc2", [self](const T& xs) -> T {
          auto e2 = self->enc2->forward(xs[0]);
          return {e2, xs[1], xs[2], e2};
        }, Modules{enc2.ptr()}),
        Region("enc3", [self](const T& xs) -> T {
          return {self->enc3->forward(xs[0]), xs[1], xs[2], xs[3]};
        }, Modules{enc3.ptr(), classifier.ptr()}),  // the encoder's own head, unused here
        Region("dec3", [self](const T& xs) -> T {
          return {self->dec3->forward(xs[0], xs[3]), xs[1], xs[2]};
        }, Modules{dec3.ptr()}),
        Region("dec2", [self](const T& xs) -> T {
          return {self->dec2->forward(xs[0], xs[2]), xs[1]};
        }, Modules{dec2.ptr()}),
        Region("dec1", [self](const T& xs) -> T { return {self->dec1->forward(xs[0], xs[1])}; },
               Modules{dec1.ptr()}),
        head,
    };
  }

  nn::Conv2d stem_conv;
  nn::BatchNorm2d stem_bn;
  BasicBlock enc1, enc2, enc3;
  nn::Linear classifier;
  DecoderStage dec3, dec2, dec1;
  nn::Conv2d head;
};
TORCH_MODULE(UNet);

RegionModel unet_model(UNet net, torch::optim::Optimizer* opt) {
  RegionModel m;
  m.regions = net->regions();
  m.input = [](c10::Device device) { return at::randn({4, 3, 32, 32}, at::TensorOptions().device(device)); };
  m.loss = [](const at::Tensor& logits) {
    auto target = at::zeros({logits.size(0), logits.size(2), logits.size(3)}, logits.options().dtype(at::kLong));
    return at::cross_entropy_loss(logits, target);
  };
  m.optimizer = opt;
  return m;
}

// The planned step, run on CPU: `plan`'s checkpointing of the regions.
trainmem::StepPeak measure(UNet& net, const RegionModel& m, torch::optim::Optimizer& opt, const at::Tensor& x,
                           const trainmem::CheckpointPlan& plan) {
  const auto checkpointing = plan.checkpointing();
  return trainmem::measure_step_peak(*net, [&] {
    return m.loss(trainmem::run_regions(m.regions, x.clone(), checkpointing));
  }, &opt);
}

TEST(RegionPlannerSkipTest, UNetRunsAsItsPlainForward) {
  at::manual_seed(1);
  UNet net;
  const auto m = unet_model(net, nullptr);
  const auto x = at::randn({4, 3, 32, 32});
  at::NoGradGuard no_grad;
  net->eval();
  EXPECT_TRUE(at::equal(net->forward(x), trainmem::run_regions(m.regions, x, trainmem::BlockCheckpointing::none(8))));
}

// Planned split into encoder and decoder stages, against the CPU. The
// regions' composition is exact for plans that store or checkpoint single
// regions; the least-peak plan checkpoints enc2..dec2 as one segment that
// carries the stem's features e0 to dec1, and there the composition is
// under the CPU's peak by the bytes a carried gradient keeps (Note [Regions
// with several tensors]): e0's gradient is a slice of dec1's
// concatenation's gradient, which stays whole (4 x 48 x 32 x 32 floats)
// until the stem's backward takes it, where the regions' profiles see e0's
// 4 x 16 x 32 x 32. So plan_regions weighs such a model's plans by their
// whole step on meta, which has it exactly: every plan's predicted peak is
// the CPU's, and a plan made for a budget fits it when run.
TEST(RegionPlannerSkipTest, UNetWithSkipConnectionsPlans) {
  at::manual_seed(1);
  UNet net;
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  auto m = unet_model(net, &adam);
  UNet twin{nullptr};
  {
    trainmem::MetaInitGuard meta;
    twin = UNet();
  }
  torch::optim::Adam twin_adam(twin->parameters(), torch::optim::AdamOptions(1e-3));
  const auto tm = unet_model(twin, &twin_adam);

  trainmem::CpuMemoryTracker::install();
  const auto x = m.input(at::kCPU);
  const auto free_plan = trainmem::plan_regions(m);
  // The classifier (64 x 1000 + 1000) gets no gradient and no Adam state
  // (Note [Parameters no gradient reaches]).
  int64_t trained = 0;
  for (const auto& p : net->parameters()) {
    trained += p.numel();
  }
  trained -= 64 * 1000 + 1000;
  EXPECT_EQ(free_plan.grad_bytes, trained * 4);
  EXPECT_EQ(free_plan.region_names[0], "stem");
  EXPECT_EQ(free_plan.region_names[6], "dec1");
  constexpr int64_t kCatGradient = 4 * 48 * 32 * 32 * 4;
  constexpr int64_t kE0 = 4 * 16 * 32 * 32 * 4;
  for (double fraction : {1.0, 0.8, 0.79, 0.7}) {
    const auto budget = static_cast<int64_t>(fraction * static_cast<double>(free_plan.predicted_peak_bytes));
    const auto plan = trainmem::plan_regions(m, PlanOptions().budget_bytes(fraction < 1.0 ? budget : 0));
    const auto checkpointing = plan.checkpointing();
    // Gradients first: the measured steps below move the parameters.
    trainmem::testing::expect_equal_grads(
        trainmem::testing::grads_under(*net, m, x, trainmem::BlockCheckpointing::none(8)),
        trainmem::testing::grads_under(*net, m, x, checkpointing), "U-Net " + plan.name);
    const auto measured = measure(net, m, adam, x, plan);
    (void)trainmem::predict_step_peak(*twin, [&] {  // warm-up: Adam's state exists from here on
      return tm.loss(trainmem::run_regions(tm.regions, tm.input(at::kMeta), checkpointing));
    }, &twin_adam);
    const auto whole = trainmem::predict_step_peak(*twin, [&] {
      return tm.loss(trainmem::run_regions(tm.regions, tm.input(at::kMeta), checkpointing));
    }, &twin_adam);
    std::cout << "U-Net at " << fraction << ": '" << plan.name << "' " << (plan.feasible ? "fits" : "does not fit")
              << ", predicted " << plan.predicted_peak_bytes << " B (" << to_string(plan.peak_phase)
              << "; composed " << plan.composed_peak_bytes << " B, " << plan.whole_step_rounds
              << " round(s)), measured " << measured.peak_bytes << " B (" << to_string(measured.phase) << ")\n";
    EXPECT_EQ(plan.activation_bytes, measured.activation_bytes) << fraction << "\n" << to_string(plan);
    EXPECT_EQ(whole.peak_bytes, measured.peak_bytes) << fraction;
    EXPECT_EQ(plan.predicted_peak_bytes, measured.peak_bytes) << fraction << "\n" << to_string(plan);
    EXPECT_EQ(plan.peak_phase, measured.phase) << fraction;
    EXPECT_GE(plan.whole_step_rounds, 1);
    if (plan.blocks[2].region_blocks == 4) {  // enc2..dec2 as one segment, carrying e0
      EXPECT_GT(plan.predicted_peak_bytes, plan.composed_peak_bytes) << to_string(plan);
      EXPECT_LE(plan.predicted_peak_bytes - plan.composed_peak_bytes, kCatGradient - kE0) << to_string(plan);
    } else {
      EXPECT_EQ(plan.predicted_peak_bytes, plan.composed_peak_bytes) << to_string(plan);
    }
    if (fraction < 1.0 && plan.feasible) {
      EXPECT_LE(measured.peak_bytes, budget) << fraction;
      EXPECT_NE(plan.name, "none") << fraction;
    }
  }
  // A budget 200,000 B above the least-peak plan's composed 6,778,672 B.
  const int64_t tight = free_plan.min_peak_bytes + 200000;
  const auto tight_plan = trainmem::plan_regions(m, PlanOptions().budget_bytes(tight));
  const auto tight_measured = measure(net, m, adam, x, tight_plan);
  std::cout << to_string(tight_plan) << "measured " << tight_measured.peak_bytes << " B\n";
  EXPECT_EQ(tight_plan.predicted_peak_bytes, tight_measured.peak_bytes);
  EXPECT_GE(tight_plan.whole_step_rounds, 2);  // the first plan's whole step ran over
  if (tight_plan.feasible) {
    EXPECT_LE(tight_measured.peak_bytes, tight);
  }
}

// The planner names what it cannot take, region by region.
TEST(RegionPlannerSkipTest, RefusesBoundariesItCannotPlan) {
  at::manual_seed(1);
  nn::Linear a(8, 8), b(8, 8);
  RegionModel m;
  m.input = [](c10::Device device) { return at::randn({2, 8}, at::TensorOptions().device(device)); };
  m.loss = [](const at::Tensor& y) { return y.sum(); };
  auto two = Region("two", [a](const T& xs) mutable -> T {
    auto h = a->forward(xs[0]);
    return {h, h * 2};
  }, Modules{a.ptr()});
  // A one-tensor region after one that returns two.
  m.regions = {two, b};
  std::string refusal = error_of([&] { trainmem::plan_regions(m); });
  EXPECT_NE(refusal.find("region 1 ('torch::nn::LinearImpl') takes one tensor, but region 0 returns 2"),
            std::string::npos)
      << refusal;
  // The last region returning two.
  m.regions = {b, two};
  refusal = error_of([&] { trainmem::plan_regions(m); });
  EXPECT_NE(refusal.find("the last region ('two') returns 2 tensors; the loss takes one"), std::string::npos)
      << refusal;
  // Two different tensors on one storage.
  m.regions = {Region("chunks", [a](const T& xs) mutable -> T {
                 auto c = a->forward(xs[0]).chunk(2, 1);
                 return {c[0], c[1]};
               }, Modules{a.ptr()}),
               Region("add", [](const T& xs) -> T { return {xs[0] + xs[1]}; })};
  refusal = error_of([&] { trainmem::plan_regions(m); });
  EXPECT_NE(refusal.find("region 0 ('chunks') returns two different tensors on one storage (slots 0 and 1)"),
            std::string::npos)
      << refusal;
  // run_regions names a one-tensor region given several.
  refusal = error_of(
      [&] { trainmem::run_regions({two, b}, at::randn({2, 8}), trainmem::BlockCheckpointing::none(2)); });
  EXPECT_NE(refusal.find("takes one tensor, but was given 2"), std::string::npos) << refusal;
}

} // namespace

