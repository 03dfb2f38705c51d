#include "trainmem/selective.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/options/linear.h>

#include "trainmem/meter.h"

namespace {

torch::nn::Sequential bias_free_mlp() {
  torch::manual_seed(0);
  using torch::nn::LinearOptions;
  return torch::nn::Sequential(torch::nn::Linear(LinearOptions(32, 128).bias(false)), torch::nn::GELU(),
                               torch::nn::Linear(LinearOptions(128, 32).bias(false)));
}

std::vector<at::Tensor> grads(const at::Tensor& x, torch::nn::Module& m) {
  std::vector<at::Tensor> g{x.grad().clone()};
  for (const auto& p : m.parameters()) g.push_back(p.grad().clone());
  return g;
}

// A policy that MUST_SAVEs aten::mm reproduces the reference
// gradients, and is consulted again during recompute, where GELU re-runs.
TEST(SelectiveTest, SavesMatmulsAndConsultsThePolicyInRecompute) {
  auto mlp = bias_free_mlp();
  auto x = torch::randn({16, 32}).requires_grad_();
  mlp->forward(x).pow(2).sum().backward();
  const auto ref = grads(x, *mlp);
  x.mutable_grad().reset();
  mlp->zero_grad();

  std::vector<std::pair<bool, std::string>> log;
  auto policy = [&](const trainmem::SelectiveContext& ctx, const trainmem::SelectiveOp& op) {
    log.emplace_back(ctx.is_recompute, op.full_name());
    return op.full_name() == "aten::mm.default" ? trainmem::CheckpointPolicy::kMustSave
                                                : trainmem::CheckpointPolicy::kPreferRecompute;
  };
  auto stats = std::make_shared<trainmem::SelectiveCheckpointStats>();
  auto opts = trainmem::CheckpointOptions().context_fn(
      trainmem::create_selective_checkpoint_contexts(policy, stats));
  trainmem::checkpoint(mlp, x, opts).pow(2).sum().backward();
  const auto got = grads(x, *mlp);
  ASSERT_EQ(ref.size(), got.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(ref[i].equal(got[i])) << "gradient " << i;

  std::vector<std::string> fwd_ops, re_ops;
  for (const auto& [rec, op] : log) (rec ? re_ops : fwd_ops).push_back(op);
  EXPECT_EQ(std::count(fwd_ops.begin(), fwd_ops.end(), "aten::mm.default"), 2);
  EXPECT_NE(std::find(re_ops.begin(), re_ops.end(), "aten::gelu.default"), re_ops.end());
  EXPECT_EQ(stats->policy_calls(), log);

  // The saved op is not executed again. The first mm is replayed; the
  // recompute stops early inside the second mm's autograd kernel, once its
  // inputs (the last tensors saved) exist, so that mm is never reached.
  const auto mm = stats->op("aten::mm.default");
  EXPECT_EQ(mm.num_forward, 2);
  EXPECT_EQ(mm.num_cached, 2);
  EXPECT_EQ(mm.num_replayed, 1);
  EXPECT_EQ(mm.num_recompute_executed, 0);
  EXPECT_EQ(mm.cached_bytes, 4 * (16 * 128 + 16 * 32));
  const auto gelu = stats->op("aten::gelu.default");
  EXPECT_EQ(gelu.num_forward, 1);
  EXPECT_EQ(gelu.num_recompute_executed, 1);
  EXPECT_EQ(gelu.num_replayed, 0);
}

// The cache is visible to an outer meter under its own name, so the
// "selective" figure needs no hand-added matmul bytes.
TEST(SelectiveTest, CacheIsVisibleToTheMeter) {
  auto mlp = bias_free_mlp();
  auto x = torch::randn({16, 32}).requires_grad_();
  trainmem::SavedTensorMeter meter(*mlp);
  auto opts = trainmem::CheckpointOptions().context_fn(
      trainmem::create_selective_checkpoint_contexts(trainmem::save_matmuls_policy()));
  at::Tensor loss;
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    loss = trainmem::checkpoint(mlp, x, opts).pow(2).sum();
  }
  const auto r = meter.report();
  int64_t cache = -1, inputs = -1;
  for (const auto& n : r.by_node) {
    if (n.node == "SelectiveCheckpointCache") cache = n.bytes;
    if (n.node == "CheckpointInputs") inputs = n.bytes;
  }
  EXPECT_EQ(cache, 4 * (16 * 128 + 16 * 32)) << trainmem::to_string(r);
  EXPECT_EQ(inputs, 4 * 16 * 32);
  // input + mm outputs (the second is also pow's input: one storage).
  EXPECT_EQ(r.saved_bytes, 4 * (16 * 32 + 16 * 128 + 16 * 32));
  loss.backward();
}

// Linear on a 3-D input runs mm -> _unsafe_view -> add_(bias): the bias is
// added in place to the cached mm output through an alias with its own
// version counter. The cache must keep the pre-add value (Note [In-place ops
// on cached outputs]) or the replay would add the bias twice.
TEST(SelectiveTest, InPlaceOpsInsideTheRegionKeepTheCacheIntact) {
  torch::manual_seed(0);
  torch::nn::Linear lin(8, 8);
  auto x = torch::randn({2, 3, 8}).requires_grad_();
  auto fn = [&](const at::Tensor& in) { return lin->forward(in).exp(); };
  fn(x).sum().backward();
  const auto ref = lin->weight.grad().clone();
  const auto ref_x = x.grad().clone();
  lin->zero_grad();
  x.mutable_grad().reset();
  auto stats = std::make_shared<trainmem::SelectiveCheckpointStats>();
  auto opts = trainmem::CheckpointOptions().context_fn(
      trainmem::create_selective_checkpoint_contexts(trainmem::save_matmuls_policy(), stats));
  trainmem::checkpoint(fn, x, opts).sum().backward();
  EXPECT_GE(stats->op("aten::mm.default").num_replayed + stats->op("aten::addmm.default").num_replayed, 1);
  EXPECT_TRUE(lin->weight.grad().equal(ref));
  EXPECT_TRUE(x.grad().equal(ref_x));
}

// A cached output modified in place after the region, before backward, is
// reported instead of silently giving wrong gradients.
TEST(SelectiveTest, CacheMutatedAfterTheRegionIsAnError) {
  auto w = torch::randn({8, 8}).requires_grad_();
  auto fn = [&](const std::vector<at::Tensor>& in) {
    auto y = at::mm(in[0], w);
    return std::vector<at::Tensor>{y, y.exp()};  // exp saves its output
  };
  auto opts = trainmem::CheckpointOptions().context_fn(
      trainmem::create_selective_checkpoint_contexts(trainmem::save_matmuls_policy()));
  auto outs = trainmem::checkpoint(fn, std::vector<at::Tensor>{torch::randn({4, 8})}, opts);
  {
    at::NoGradGuard no_grad;
    outs[0].mul_(2);
  }
  try {
    outs[1].sum().backward();
    FAIL() << "a mutated cache entry must be reported";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Tensor cached during selective activation checkpoint has been mutated"),
              std::string::npos) << e.what();
  }
}

TEST(SelectiveTest, SaveOpsPolicyMatchesNamesAndOverloads) {
  auto policy = trainmem::save_ops_policy({"aten::gelu", "aten::add.Tensor"});
  trainmem::SelectiveContext ctx;
  EXPECT_EQ(policy(ctx, {"aten::gelu", "default", {}}), trainmem::CheckpointPolicy::kMustSave);
  EXPECT_EQ(policy(ctx, {"aten::add", "Tensor", {}}), trainmem::CheckpointPolicy::kMustSave);
  EXPECT_EQ(policy(ctx, {"aten::add", "Scalar", {}}), trainmem::CheckpointPolicy::kPreferRecompute);
  EXPECT_EQ(trainmem::to_string(trainmem::CheckpointPolicy::kMustCpuOffload), "must_cpu_offload");
  EXPECT_THROW(trainmem::create_selective_checkpoint_contexts(nullptr), c10::Error);
}

TEST(SelectiveTest, InterceptionIsOffOutsideRegions) {
  auto stats = std::make_shared<trainmem::SelectiveCheckpointStats>();
  auto ctx_fn = trainmem::create_selective_checkpoint_contexts(trainmem::save_matmuls_policy(), stats);
  auto w = torch::randn({4, 4}).requires_grad_();
  (void)at::mm(torch::randn({2, 4}), w);  // outside any region: not seen
  EXPECT_TRUE(stats->ops().empty());
  auto contexts = ctx_fn();
  {
    auto token = contexts.forward();
    (void)at::mm(torch::randn({2, 4}), w);
  }
  EXPECT_EQ(stats->op("aten::mm.default").num_forward, 1);
  (void)at::mm(torch::randn({2, 4}), w);
  EXPECT_EQ(stats->op("aten::mm.default").num_forward, 1);
}

} // namespace

namespace {
// Without early stop the recompute runs the whole region: every saved mm is
// replayed, none executed.
TEST(SelectiveTest, WithoutEarlyStopEverySavedOpIsReplayed) {
  auto mlp = bias_free_mlp();
  auto x = torch::randn({16, 32}).requires_grad_();
  auto stats = std::make_shared<trainmem::SelectiveCheckpointStats>();
  auto opts = trainmem::CheckpointOptions().early_stop(false).context_fn(
      trainmem::create_selective_checkpoint_contexts(trainmem::save_matmuls_policy(), stats));
  trainmem::checkpoint(mlp, x, opts).pow(2).sum().backward();
  const auto mm = stats->op("aten::mm.default");
  EXPECT_EQ(mm.num_replayed, 2);
  EXPECT_EQ(mm.num_recompute_executed, 0);
}
} // namespace
