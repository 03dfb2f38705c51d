// The region planner on a Vision Transformer written as ViT trainers write
// it: a patch embedding (a strided convolution), a class token and a learned
// positional embedding (parameters used in the embedding region), pre-LN
// encoder blocks with scaled_dot_product_attention and GELU, and a head on
// the class token. Planned on meta, run on CPU under each plan: saved bytes
// and step peaks equal the CPU's to the byte, gradients bit-identical.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>

#include "trainmem/allocator.h"
#include "trainmem/planner.h"
#include "region_planner_check.h"

namespace {

namespace nn = torch::nn;
using Modules = std::vector<std::shared_ptr<nn::Module>>;
using trainmem::PlanOptions;
using trainmem::Region;
using trainmem::RegionModel;

constexpr int64_t kDim = 64;
constexpr int64_t kHeads = 4;

struct EncoderBlockImpl : nn::Module {
  EncoderBlockImpl()
      : ln1(register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({kDim})))),
        qkv(register_module("qkv", nn::Linear(kDim, 3 * kDim))),
        proj(register_module("proj", nn::Linear(kDim, kDim))),
        ln2(register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({kDim})))),
        fc1(register_module("fc1", nn::Linear(kDim, 4 * kDim))),
        fc2(register_module("fc2", nn::Linear(4 * kDim, kDim))) {}
  at::Tensor forward(const at::Tensor& x) {
    const auto b = x.size(0), t = x.size(1);
    auto h = qkv->forward(ln1->forward(x)).view({b, t, 3, kHeads, kDim / kHeads}).permute({2, 0, 3, 1, 4});
    auto a = at::scaled_dot_product_attention(h[0], h[1], h[2]).transpose(1, 2).reshape({b, t, kDim});
    auto y = x + proj->forward(a);
    return y + fc2->forward(at::gelu(fc1->forward(ln2->forward(y))));
  }
  nn::LayerNorm ln1;
  nn::Linear qkv, proj;
  nn::LayerNorm ln2;
  nn::Linear fc1, fc2;
};
TORCH_MODULE(EncoderBlock);

// The patch embedding with the class token and the positional embedding.
struct EmbedImpl : nn::Module {
  EmbedImpl()
      : patch(register_module("patch", nn::Conv2d(nn::Conv2dOptions(3, kDim, 4).stride(4)))),
        cls(register_parameter("cls", at::zeros({1, 1, kDim}))),
        pos(register_parameter("pos", at::randn({1, 65, kDim}) * 0.02)) {}
  at::Tensor forward(const at::Tensor& images) {
    auto x = patch->forward(images).flatten(2).transpose(1, 2);  // (B, 64, D)
    return at::cat({cls.expand({x.size(0), 1, kDim}), x}, 1) + pos;
  }
  nn::Conv2d patch;
  at::Tensor cls, pos;
};
TORCH_MODULE(Embed);

struct ViTImpl : nn::Module {
  explicit ViTImpl(int64_t depth)
      : embed(register_module("embed", Embed())),
        norm(register_module("norm", nn::LayerNorm(nn::LayerNormOptions({kDim})))),
        head(register_module("head", nn::Linear(kDim, 10))) {
    for (int64_t i = 0; i < depth; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), EncoderBlock()));
    }
  }
  Embed embed;
  std::vector<EncoderBlock> blocks;
  nn::LayerNorm norm;
  nn::Linear head;
};
TORCH_MODULE(ViT);

TEST(RegionPlannerViTTest, ClassTokenAndPositionalEmbedding) {
  at::manual_seed(1);
  ViT vit(4);
  torch::optim::AdamW opt(vit->parameters(), torch::optim::AdamWOptions(1e-3));
  RegionModel m;
  m.regions.emplace_back(vit->embed);
  for (auto& b : vit->blocks) {
    m.regions.emplace_back(b);
  }
  m.regions.emplace_back("head", [vit](const at::Tensor& x) mutable {
    return vit->head->forward(vit->norm->forward(x.select(1, 0)));
  }, Modules{vit->norm.ptr(), vit->head.ptr()});
  m.input = [](c10::Device device) { return at::randn({16, 3, 32, 32}, at::TensorOptions().device(device)); };
  m.loss = [](const at::Tensor& logits) {
    return at::cross_entropy_loss(logits, at::zeros({logits.size(0)}, logits.options().dtype(at::kLong)));
  };
  m.optimizer = &opt;
  trainmem::testing::check_model("ViT", *vit, m, &opt);
  // To the byte: stored 21,266,088 B, the least peak 8,991,592 B (AdamW's
  // state, the class token and the positional embedding included).
  const auto x = m.input(at::kCPU);
  const auto free_plan = trainmem::plan_regions(m);
  for (const auto& plan : {free_plan, trainmem::plan_regions(m, PlanOptions().budget_bytes(free_plan.min_peak_bytes))}) {
    const auto checkpointing = plan.checkpointing();
    const auto measured = trainmem::measure_step_peak(*vit, [&] {
      return m.loss(trainmem::run_regions(m.regions, x.clone(), checkpointing));
    }, &opt);
    EXPECT_EQ(plan.predicted_peak_bytes, measured.peak_bytes) << to_string(plan);
    EXPECT_EQ(plan.peak_phase, measured.phase) << to_string(plan);
  }
}

} // namespace
