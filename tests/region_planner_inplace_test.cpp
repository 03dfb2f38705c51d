// The region planner on models whose regions start with an in-place op (a
// ReLU(inplace) right after a cut), as tutorials write VGG-style conv nets
// and MLPs. Such a region cannot be checkpointed (its forward modifies the
// input the checkpoint keeps); the planner profiles it stored, reports its
// checkpoint and selective modes unavailable, and never chooses them.
#include <memory>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "trainmem/allocator.h"
#include "trainmem/checkpoint.h"
#include "trainmem/planner.h"
#include "region_planner_check.h"

namespace {

namespace nn = torch::nn;
using trainmem::Region;
using trainmem::RegionModel;

nn::ReLU inplace_relu() { return nn::ReLU(nn::ReLUOptions(true)); }

TEST(RegionPlannerInplaceTest, CheckpointOfARegionStartingInPlaceFailsOnCpu) {
  at::manual_seed(0);
  nn::Linear lin0(8, 8);
  nn::Sequential f(inplace_relu(), nn::Linear(8, 4));
  const auto x = at::randn({3, 8});
  auto h = lin0->forward(x);
  std::string what;
  try {
    auto y = trainmem::checkpoint([&](const at::Tensor& t) { return f->forward(t); }, h);
    y.pow(2).sum().backward();
  } catch (const c10::Error& e) {
    what = e.what_without_backtrace();
  }
  std::cout << "checkpoint of relu_ -> linear: " << (what.empty() ? "no error" : what) << "\n";
  EXPECT_FALSE(what.empty());
}

} // namespace

namespace {

using Modules = std::vector<std::shared_ptr<nn::Module>>;
using trainmem::BlockMode;
using trainmem::CheckpointPlan;
using trainmem::testing::check_model;

// The reasons the plan gives for region `i`'s unavailable checkpoint (empty:
// it is available).
std::string unavailable_checkpoint(const CheckpointPlan& plan, int64_t i) {
  for (const auto& u : plan.unavailable) {
    if (u.region == i && u.blocks == 1 && u.mode == BlockMode::kCheckpoint) return u.reason;
  }
  return {};
}

// A small VGG-style net as tutorials write it: conv, ReLU(inplace) pairs,
// max pools, a classifier; cut after each conv, so regions 1..3 start with
// the in-place ReLU.
struct SmallVggImpl : nn::Module {
  SmallVggImpl()
      : conv1(register_module("conv1", nn::Conv2d(nn::Conv2dOptions(3, 16, 3).padding(1)))),
        block2(register_module("block2", nn::Sequential(inplace_relu(), nn::Conv2d(nn::Conv2dOptions(16, 16, 3).padding(1))))),
        block3(register_module("block3", nn::Sequential(inplace_relu(), nn::MaxPool2d(nn::MaxPool2dOptions(2)),
                                                        nn::Conv2d(nn::Conv2dOptions(16, 32, 3).padding(1))))),
        head(register_module("head", nn::Sequential(inplace_relu(), nn::MaxPool2d(nn::MaxPool2dOptions(2)),
                                                    nn::Flatten(), nn::Linear(32 * 4 * 4, 10)))) {}
  nn::Conv2d conv1;
  nn::Sequential block2, block3, head;
};
TORCH_MODULE(SmallVgg);

RegionModel vgg_model(SmallVgg& net) {
  RegionModel m;
  auto named = [](const char* name, nn::Sequential s) {
    return Region(name, [s](const at::Tensor& x) mutable { return s->forward(x); }, Modules{s.ptr()});
  };
  m.regions = {Region(net->conv1), named("block2", net->block2), named("block3", net->block3),
               named("head", net->head)};
  m.input = [](c10::Device d) { return at::randn({8, 3, 16, 16}, at::TensorOptions().device(d)); };
  m.loss = [](const at::Tensor& y) {
    return at::cross_entropy_loss(y, at::zeros({8}, y.options().dtype(at::kLong)));
  };
  return m;
}

TEST(RegionPlannerInplaceTest, VggWithInplaceReluIsPlannedAroundItsInplaceRegions) {
  at::manual_seed(1);
  SmallVgg net;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto m = vgg_model(net);
  m.optimizer = &sgd;
  const auto plan = trainmem::plan_regions(m);
  std::cout << to_string(plan);
  EXPECT_EQ(unavailable_checkpoint(plan, 0), "");
  for (int64_t i = 1; i <= 3; ++i) {
    EXPECT_EQ(unavailable_checkpoint(plan, i),
              "aten::relu_ writes the region's input in place, which a checkpoint keeps") << i;
  }
  EXPECT_NE(to_string(plan).find("region 1 'block2': checkpoint"), std::string::npos) << to_string(plan);
  for (const auto& budget : {int64_t{0}, plan.min_peak_bytes}) {
    const auto p = trainmem::plan_regions(m, trainmem::PlanOptions().budget_bytes(budget));
    for (int64_t i = 1; i <= 3; ++i) {
      EXPECT_EQ(p.blocks[i].mode, BlockMode::kStore) << i << "\n" << to_string(p);
    }
  }
  check_model("small VGG, ReLU(inplace)", *net, m, &sgd, /*whole_block_variants=*/false);
  // Measured on CPU (check_model: the meter's saved bytes and the step's peak
  // equal these): the plans store every region (checkpointing conv1 alone
  // lowers no phase).
  EXPECT_EQ(plan.activation_bytes, 500'100);
  EXPECT_EQ(plan.predicted_peak_bytes, 858'560);
  EXPECT_EQ(plan.min_peak_bytes, 858'560);
}

// An MLP with in-place ReLUs, cut so each hidden region starts with one.
TEST(RegionPlannerInplaceTest, MlpWithInplaceReluIsPlannedAroundItsInplaceRegions) {
  at::manual_seed(2);
  nn::ModuleList net(nn::Sequential(nn::Linear(64, 256)), nn::Sequential(inplace_relu(), nn::Linear(256, 256)),
                     nn::Sequential(inplace_relu(), nn::Linear(256, 256)),
                     nn::Sequential(inplace_relu(), nn::Linear(256, 10)));
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  RegionModel m;
  m.regions = trainmem::regions_of(net);
  m.input = [](c10::Device d) { return at::randn({256, 64}, at::TensorOptions().device(d)); };
  m.loss = [](const at::Tensor& y) { return y.pow(2).mean(); };
  m.optimizer = &sgd;
  const auto plan = trainmem::plan_regions(m);
  std::cout << to_string(plan);
  EXPECT_EQ(unavailable_checkpoint(plan, 0), "");
  for (int64_t i = 1; i <= 3; ++i) {
    EXPECT_EQ(unavailable_checkpoint(plan, i),
              "aten::relu_ writes the region's input in place, which a checkpoint keeps") << i;
  }
  check_model("MLP, ReLU(inplace)", *net, m, &sgd, /*whole_block_variants=*/false);
  EXPECT_EQ(plan.activation_bytes, 862'208);  // measured on CPU by check_model
  EXPECT_EQ(plan.predicted_peak_bytes, 2'594'944);
}

} // namespace
