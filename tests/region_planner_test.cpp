// The planner on any model given as regions (plan_regions): the checkpoint
// experiment's residual MLP stack (scaled down), GPT (gpt.h), a region with an op that has
// no meta kernel, the reference transformer as a client (its plans
// unchanged), and the region adapters. For each model: the saved bytes the
// plan predicts on meta equal the CPU meter's, the predicted step peak is
// within 0.5 % of the CPU measurement, a plan for a budget fits when run, and
// the gradients under every plan equal the plain run's exactly.
#include <cmath>
#include <iostream>
#include <memory>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "trainmem/allocator.h"
#include "trainmem/models/gpt.h"
#include "trainmem/meta.h"
#include "trainmem/models/transformer_plan.h"
#include "trainmem/planner.h"
#include "trainmem/models/transformer.h"
#include "region_planner_check.h"
#include "app/variants.h"

namespace {

using trainmem::kReferenceBatch;
using trainmem::kReferenceSeqLen;

using trainmem::BlockMode;
using trainmem::CheckpointPlan;
using trainmem::PlanOptions;
using trainmem::Region;
using trainmem::RegionModel;
using trainmem::testing::check_model;
using trainmem::testing::grads_under;

// The checkpoint experiment's block (examples/explain_cuda_peaks.cpp):
// x + Linear(GELU(Linear(x))), scaled down.
struct ResidualMlpImpl : torch::nn::Module {
  explicit ResidualMlpImpl(int64_t d)
      : net(register_module("net", torch::nn::Sequential(torch::nn::Linear(d, d), torch::nn::GELU(),
                                                         torch::nn::Linear(d, d)))) {}
  at::Tensor forward(const at::Tensor& x) { return x + net->forward(x); }
  torch::nn::Sequential net;
};
TORCH_MODULE(ResidualMlp);

TEST(RegionPlannerTest, ResidualMlpStackFromASequential) {
  torch::manual_seed(0);
  const int64_t d = 64;
  torch::nn::Sequential net;
  for (int i = 0; i < 8; ++i) net->push_back(ResidualMlp(d));
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-3));
  RegionModel m;
  m.regions = trainmem::regions_of(net);
  m.input = [](c10::Device device) { return at::randn({1024, 64}, at::TensorOptions().device(device)); };
  m.loss = [](const at::Tensor& y) { return y.sum(); };
  m.optimizer = &opt;
  check_model("residual MLP", *net, m, &opt);
  // Eight identical blocks: one block's profiles serve all but the first.
  const auto plan = trainmem::plan_regions(m);
  EXPECT_EQ(plan.region_names.size(), 8u);
  EXPECT_LT(plan.num_profiles, 40) << "profiles are not shared between identical regions";
  EXPECT_TRUE(plan.cpu_fallbacks.empty());
}

// Planning leaves the model as it was: parameter values and storages,
// gradients, buffers and the optimizer's state.
TEST(RegionPlannerTest, PlanningLeavesTheModelAndItsOptimizerAlone) {
  torch::manual_seed(0);
  torch::nn::Sequential net(ResidualMlp(32), ResidualMlp(32));
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-3));
  auto x = torch::randn({16, 32});
  net->forward(x).sum().backward();
  opt.step();  // state exists, gradients are set
  std::vector<at::Tensor> values, grads;
  std::vector<const void*> ptrs;
  for (const auto& p : net->parameters()) {
    values.push_back(p.detach().clone());
    grads.push_back(p.grad().clone());
    ptrs.push_back(p.data_ptr());
  }
  const auto num_state = opt.state().size();
  RegionModel m;
  m.regions = trainmem::regions_of(net);
  m.input = [](c10::Device device) { return at::empty({16, 32}, at::TensorOptions().device(device)); };
  m.loss = [](const at::Tensor& y) { return y.pow(2).mean(); };
  m.optimizer = &opt;
  const auto plan = trainmem::plan_regions(m, PlanOptions().budget_bytes(1));
  EXPECT_FALSE(plan.feasible);
  // AdamW's state: 2 x 4 B per parameter; the step's input is in the static bytes.
  int64_t param_bytes = 0;
  for (const auto& p : net->parameters()) param_bytes += p.numel() * 4;
  EXPECT_EQ(plan.static_bytes, 3 * param_bytes + 16 * 32 * 4);
  EXPECT_EQ(plan.grad_bytes, param_bytes);
  size_t i = 0;
  for (const auto& p : net->parameters()) {
    EXPECT_TRUE(p.is_cpu());
    EXPECT_EQ(p.data_ptr(), ptrs[i]);
    EXPECT_TRUE(at::equal(p, values[i]));
    EXPECT_TRUE(at::equal(p.grad(), grads[i]));
    ++i;
  }
  ASSERT_EQ(opt.state().size(), num_state);
  for (const auto& [key, state] : opt.state()) {
    auto& s = static_cast<torch::optim::AdamWParamState&>(*state);
    EXPECT_TRUE(s.exp_avg().is_cpu());
    EXPECT_EQ(s.step(), 1);
  }
  // Bad input is named.
  RegionModel empty;
  EXPECT_THROW(trainmem::plan_regions(empty), c10::Error);
  RegionModel no_loss = m;
  no_loss.loss = nullptr;
  EXPECT_THROW(trainmem::plan_regions(no_loss), c10::Error);
  EXPECT_THROW(trainmem::plan_regions(m, PlanOptions().budget_bytes(-1)), c10::Error);
  EXPECT_THROW(trainmem::run_regions(m.regions, x, trainmem::BlockCheckpointing::none(3)), c10::Error);
}

// A GPT (gpt.h) as regions: embeddings, each block, final LayerNorm and the
// tied LM head; loss cross-entropy. The head's weight is wte's: its gradient
// is counted once, from the head's backward on.
TEST(RegionPlannerTest, GptAsRegions) {
  torch::manual_seed(0);
  const auto o = trainmem::GPTOptions().vocab_size(128).context_length(64).d_model(64).num_layers(4).num_heads(4);
  trainmem::GPT gpt(o);
  torch::optim::AdamW opt(gpt->parameters(), torch::optim::AdamWOptions(1e-3));
  RegionModel m;
  m.regions.emplace_back(
      "embed",
      [gpt](const at::Tensor& tokens) mutable {
        auto pos = at::arange(tokens.size(1), tokens.options().dtype(at::kLong));
        return gpt->wte->forward(tokens) + gpt->wpe->forward(pos);
      },
      std::vector<std::shared_ptr<torch::nn::Module>>{gpt->wte.ptr(), gpt->wpe.ptr()});
  for (const auto& r : trainmem::regions_of<trainmem::TransformerBlockImpl>(gpt->transformer->blocks)) {
    m.regions.push_back(r);
  }
  m.regions.emplace_back(
      "head", [gpt](const at::Tensor& h) mutable { return at::linear(gpt->ln_f->forward(h), gpt->wte->weight); },
      std::vector<std::shared_ptr<torch::nn::Module>>{gpt->ln_f.ptr(), gpt->wte.ptr()});
  m.input = [](c10::Device device) {
    return at::zeros({8, 32}, at::TensorOptions().dtype(at::kLong).device(device));
  };
  m.loss = [](const at::Tensor& logits) {
    auto targets = at::zeros({logits.size(0) * logits.size(1)}, logits.options().dtype(at::kLong));
    return at::cross_entropy_loss(logits.flatten(0, 1), targets);
  };
  m.optimizer = &opt;
  check_model("GPT", *gpt, m, &opt);
  const auto plan = trainmem::plan_regions(m);
  int64_t param_bytes = 0;
  for (const auto& p : gpt->parameters()) param_bytes += p.numel() * 4;
  EXPECT_EQ(plan.grad_bytes, param_bytes);  // wte once
  // The regions' forward equals GPT::forward.
  auto tokens = at::randint(128, {2, 16});
  EXPECT_TRUE(at::equal(trainmem::run_regions(m.regions, tokens, trainmem::BlockCheckpointing::none(6)),
                        gpt->forward(tokens)));
}

// A region with an op that has no Meta kernel of LibTorch's (cdist with p = 1
// runs aten::_cdist_forward, CPU and CUDA only): it runs on meta through the
// fallback (Note [A meta path for ops without a meta kernel]), so nothing is
// profiled on CPU; the plan is made, fits and runs. (Before the fallback this
// region was profiled on CPU, named as aten::_cdist_forward.)
TEST(RegionPlannerTest, RegionWithoutMetaKernelRunsOnMetaThroughTheFallback) {
  torch::manual_seed(0);
  torch::nn::Linear in(32, 32), out(16, 32);
  // Its weight: 16 centers of 32 (no bias: the region does not use one, and
  // an unused parameter has no gradient to compare).
  auto centers = torch::nn::Linear(torch::nn::LinearOptions(32, 16).bias(false));
  torch::nn::Sequential holder(in, centers, out);
  // A small step: check_model's measured steps move the parameters between
  // plans, and at lr 0.1 with momentum (cdist's outputs are sums of 32
  // distances, the loss their squares) the gradients of the later plans came
  // out NaN, plain and checkpointed alike, so they could not compare equal.
  // At lr 1e-5 every plan's gradients equal the plain run's exactly.
  torch::optim::SGD opt(holder->parameters(), torch::optim::SGDOptions(1e-5).momentum(0.9));
  RegionModel m;
  m.regions.emplace_back(in);
  m.regions.emplace_back(
      "distances", [centers](const at::Tensor& x) { return at::cdist(x, centers->weight, 1.0); },
      std::vector<std::shared_ptr<torch::nn::Module>>{centers.ptr()});
  m.regions.emplace_back(out);
  m.input = [](c10::Device device) { return at::randn({256, 32}, at::TensorOptions().device(device)); };
  m.loss = [](const at::Tensor& y) { return y.pow(2).mean(); };
  m.optimizer = &opt;
  const auto plan = trainmem::plan_regions(m);
  EXPECT_TRUE(plan.cpu_fallbacks.empty()) << to_string(plan);
  check_model("cdist", *holder, m, &opt);
}

// A region whose op's output shape depends on values (masked_select), which
// no meta kernel can give: named, profiled on CPU at the planned shapes; the
// plan is still made, fits and runs.
TEST(RegionPlannerTest, RegionWithADataDependentOpIsProfiledOnCpu) {
  torch::manual_seed(0);
  torch::nn::Linear in(32, 32), mid(32, 32), out(32, 32);
  torch::nn::Sequential holder(in, mid, out);
  torch::optim::SGD opt(holder->parameters(), torch::optim::SGDOptions(1e-5).momentum(0.9));
  RegionModel m;
  m.regions.emplace_back(in);
  m.regions.emplace_back(
      "positive part",
      [mid](const at::Tensor& x) mutable { return mid->forward(x) + at::masked_select(x, x > 0).mean(); },
      std::vector<std::shared_ptr<torch::nn::Module>>{mid.ptr()});
  m.regions.emplace_back(out);
  m.input = [](c10::Device device) { return at::randn({256, 32}, at::TensorOptions().device(device)); };
  m.loss = [](const at::Tensor& y) { return y.pow(2).mean(); };
  m.optimizer = &opt;
  const auto plan = trainmem::plan_regions(m);
  ASSERT_EQ(plan.cpu_fallbacks.size(), 1u) << to_string(plan);
  EXPECT_EQ(plan.cpu_fallbacks[0].region, 1);
  EXPECT_EQ(plan.cpu_fallbacks[0].op, "aten::masked_select") << plan.cpu_fallbacks[0].reason;
  std::cout << "fallback: " << plan.cpu_fallbacks[0].op << ": " << plan.cpu_fallbacks[0].reason << "\n";
  check_model("masked_select", *holder, m, &opt);
}

// The reference transformer is a client of plan_regions: its plans are the
// ones plan_checkpointing() made before (choices, stored bytes, peaks).
TEST(RegionPlannerTest, CapstonePlansAreUnchanged) {
  const trainmem::TransformerOptions o;
  struct Expected {
    int64_t budget_mib;
    int64_t peak_bytes;
    std::vector<std::string> modes;
    std::vector<size_t> num_saved_ops;
    std::vector<int64_t> stored_bytes;
  };
  const std::vector<Expected> expected = {
      {40, 41859272, {"selective", "selective", "selective", "selective", "selective", "store"}, {1, 1, 2, 3, 3, 0},
       {2097152, 2097152, 2621440, 4718592, 4718592, 8421376}},
      {32, 33470664, {"checkpoint", "checkpoint", "selective", "selective", "selective", "store"}, {0, 0, 1, 1, 2, 0},
       {524288, 524288, 2097152, 2097152, 2621440, 8421376}},
      {48, 50280648, {"selective", "selective", "selective", "selective", "selective", "store"}, {3, 3, 3, 4, 4, 0},
       {4718592, 4718592, 4718592, 5259264, 5259264, 8421376}},
  };
  for (const auto& e : expected) {
    const auto plan = trainmem::plan_checkpointing(o, kReferenceBatch, kReferenceSeqLen, PlanOptions().budget_bytes(e.budget_mib << 20));
    ASSERT_TRUE(plan.feasible);
    EXPECT_EQ(plan.predicted_peak_bytes, e.peak_bytes) << e.budget_mib << " MiB\n" << to_string(plan);
    EXPECT_EQ(plan.min_peak_bytes, 29551560);
    ASSERT_EQ(plan.blocks.size(), 6u);
    for (size_t i = 0; i < 6; ++i) {
      EXPECT_EQ(to_string(plan.blocks[i].mode), e.modes[i]) << e.budget_mib << " MiB, block " << i;
      EXPECT_EQ(plan.blocks[i].saved_ops.size(), e.num_saved_ops[i]) << e.budget_mib << " MiB, block " << i;
      EXPECT_EQ(plan.blocks[i].stored_bytes, e.stored_bytes[i]) << e.budget_mib << " MiB, block " << i;
    }
  }
  const auto plan40 = trainmem::plan_checkpointing(o, kReferenceBatch, kReferenceSeqLen, PlanOptions().budget_bytes(40 << 20));
  EXPECT_EQ(plan40.blocks[2].saved_ops, (std::vector<std::string>{"aten::mm.default#0", "aten::mm.default#1"}));
  EXPECT_EQ(plan40.blocks[3].saved_ops,
            (std::vector<std::string>{"aten::mm.default#0", "aten::mm.default#1", "aten::mm.default#2"}));
}

// The adapters: Sequential, ModuleList (of Sequentials, or of a given type),
// AnyModule, module holders and shared_ptrs of a subclass, without casts.
TEST(RegionPlannerTest, RegionsFromContainersAndHolders) {
  torch::manual_seed(0);
  torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::ReLU());
  EXPECT_EQ(trainmem::regions_of(seq).size(), 2u);
  torch::nn::ModuleList list(torch::nn::Sequential(torch::nn::Linear(4, 4)), torch::nn::Sequential(torch::nn::ReLU()));
  EXPECT_EQ(trainmem::regions_of(list).size(), 2u);
  torch::nn::ModuleList blocks(ResidualMlp(4), ResidualMlp(4));
  const auto typed = trainmem::regions_of<ResidualMlpImpl>(blocks);
  ASSERT_EQ(typed.size(), 2u);
  auto x = torch::randn({3, 4});
  EXPECT_TRUE(at::equal(typed[1](x), blocks->ptr<ResidualMlpImpl>(1)->forward(x)));
  EXPECT_THROW(trainmem::regions_of(blocks), c10::Error);  // not Sequentials: the type is needed
  EXPECT_THROW(trainmem::regions_of<torch::nn::LinearImpl>(blocks), c10::Error);
  ResidualMlp holder(4);
  std::shared_ptr<ResidualMlpImpl> impl = holder.ptr();
  std::vector<Region> regions = {holder, impl, torch::nn::AnyModule(torch::nn::Linear(4, 4))};
  EXPECT_EQ(regions[0].modules().size(), 1u);
  EXPECT_TRUE(at::equal(regions[1](x), holder->forward(x)));
  EXPECT_EQ(regions[2](x).sizes(), x.sizes());
  EXPECT_THROW(Region("empty", Region::Forward()), c10::Error);
  EXPECT_THROW(Region("empty", Region::ListForward()), c10::Error);
}

} // namespace

namespace {

// A block whose module holds a head no loss reaches (as a U-Net's unused
// encoder head): Note [Parameters no gradient reaches].
struct BlockWithAnUnusedHeadImpl : torch::nn::Module {
  BlockWithAnUnusedHeadImpl() {
    fc = register_module("fc", torch::nn::Linear(64, 64));
    unused = register_module("unused", torch::nn::Linear(64, 1000));
  }
  at::Tensor forward(const at::Tensor& x) { return torch::relu(fc->forward(x)) + x; }
  torch::nn::Linear fc{nullptr}, unused{nullptr};
};
TORCH_MODULE(BlockWithAnUnusedHead);

} // namespace

// The planner counts no gradient and no AdamW state for parameters no loss
// reaches: its peak equals the step run on CPU (it counted 2 x 260,000 B of
// state and 260,000 B of gradient for the unused heads before).
TEST(RegionPlannerTest, ParametersNoGradientReachesCountNothing) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int i = 0; i < 3; ++i) net->push_back(BlockWithAnUnusedHead());
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-3));
  RegionModel m;
  m.regions = trainmem::regions_of(net);
  m.input = [](c10::Device device) { return at::zeros({256, 64}, at::TensorOptions().device(device)); };
  m.loss = [](const at::Tensor& y) { return y.pow(2).mean(); };
  m.optimizer = &opt;
  const auto plan = trainmem::plan_regions(m);
  const int64_t used = 3 * (64 * 64 + 64) * 4;
  EXPECT_EQ(plan.grad_bytes, used);
  const auto checkpointing = plan.checkpointing();
  auto step = [&] { return m.loss(trainmem::run_regions(m.regions, m.input(at::kCPU), checkpointing)); };
  trainmem::measure_step_peak(*net, step, &opt);
  const auto measured = trainmem::measure_step_peak(*net, step, &opt);
  std::printf("unused heads: planned %lld B, measured %lld B, state %lld B\n",
              static_cast<long long>(plan.predicted_peak_bytes), static_cast<long long>(measured.peak_bytes),
              static_cast<long long>(measured.optimizer_state_bytes));
  EXPECT_EQ(measured.optimizer_state_bytes, 2 * used);
  EXPECT_EQ(plan.predicted_peak_bytes, measured.peak_bytes);
}
