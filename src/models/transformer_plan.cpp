#include "trainmem/models/transformer_plan.h"

#include <memory>
#include <utility>

#include <ATen/ops/empty.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/pow.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/optim/adamw.h>

#include "trainmem/format.h"
#include "trainmem/meta.h"

namespace trainmem {

// ---------------------------------------------------------------------------
// The analytic model

AnalyticActivations analytic_activation_bytes(
    const TransformerOptions& o,
    int64_t batch,
    int64_t seq_len,
    const AnalyticActivationOptions& opt) {
  TORCH_CHECK(opt.element_bytes() > 0,
              "analytic_activation_bytes: expected element_bytes > 0, but got ", opt.element_bytes());
  TORCH_CHECK(batch >= 1 && seq_len >= 1, "analytic_activation_bytes: expected batch and seq_len >= 1, but got ",
              batch, " and ", seq_len);
  const int64_t L = o.num_layers(), s = seq_len, b = batch, h = o.d_model(),
                a = o.num_heads(), e = opt.element_bytes();
  const int64_t sbh = s * b * h;
  AnalyticActivations r;
  auto add = [&](std::string name, int64_t per_layer) {
    r.terms.push_back({std::move(name), per_layer * L});
    r.per_layer_bytes += per_layer;
  };
  // Korthikanti et al. (2022), Section 4.1, with the element size e instead
  // of fp16's 2 bytes: each (s, b, h) tensor costs e s b h bytes.
  add("LayerNorm inputs (2 s b h elements)", 2 * e * sbh);
  add("QKV input (s b h)", e * sbh);
  add("Q, K, V (3 s b h)", 3 * e * sbh);
  add("projection input (s b h)", e * sbh);
  add("MLP input (s b h)", e * sbh);
  add("GELU input (4 s b h)", 4 * e * sbh);
  add("GELU output (4 s b h)", 4 * e * sbh);
  if (opt.dropout()) {
    add("dropout masks after projection and MLP (2 x 1 B s b h)", 2 * sbh);
  }
  if (!opt.flash_attention()) {
    add("softmax output (a s^2 b elements)", e * a * s * s * b);
    if (opt.dropout()) {
      add("attention dropout mask (1 B a s^2 b)", a * s * s * b);
      add("dropped attention probabilities (a s^2 b)", e * a * s * s * b);
    }
  }
  r.total_bytes = r.per_layer_bytes * L;
  const int64_t per_token_channel = 16 * e + (opt.dropout() ? 2 : 0);
  r.formula = fmt::format("s b h x {} B", per_token_channel);
  if (!opt.flash_attention()) {
    r.formula += fmt::format(" + a s^2 b x {} B", e + (opt.dropout() ? 1 + e : 0));
  }
  r.formula += fmt::format(" = {} B per layer, x {} layers = {} B", with_commas(r.per_layer_bytes), L,
                           with_commas(r.total_bytes));
  return r;
}

// ---------------------------------------------------------------------------
// Planning the reference transformer

namespace {

// The reference model's training step as the generic planner sees it: its
// blocks as regions (on a meta copy: nothing allocated, whatever d_model is),
// the input (B, T, d), the loss out.pow(2).mean(), and AdamW when `adamw`.
struct TransformerRegions {
  Transformer meta{nullptr};
  RegionModel model;
};

TransformerRegions transformer_regions(const TransformerOptions& o, int64_t batch, int64_t seq_len, bool adamw) {
  TORCH_CHECK(batch >= 1 && seq_len >= 1, "expected batch and seq_len >= 1, but got ", batch, " and ", seq_len);
  TransformerRegions r;
  {
    MetaInitGuard guard;
    r.meta = Transformer(o);
  }
  r.model.regions = regions_of<TransformerBlockImpl>(r.meta->blocks);
  r.model.input = [o, batch, seq_len](c10::Device device) {
    return at::empty({batch, seq_len, o.d_model()}, at::TensorOptions().device(device));
  };
  r.model.loss = [](const at::Tensor& y) { return y.pow(2).mean(); };
  if (adamw) {
    r.model.make_optimizer = [](std::vector<at::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
      return std::make_unique<torch::optim::AdamW>(std::move(params), torch::optim::AdamWOptions(1e-3));
    };
  }
  return r;
}

} // namespace

CheckpointPlan plan_checkpointing(const TransformerOptions& o, int64_t batch, int64_t seq_len,
                                  const PlanOptions& options, bool adamw) {
  TORCH_CHECK(options.budget_bytes() >= 0,
              "plan_checkpointing: expected budget_bytes >= 0, but got ", options.budget_bytes());
  TORCH_CHECK(o.num_layers() >= 1, "plan_checkpointing: expected num_layers >= 1, but got ",
              o.num_layers());
  const auto t = transformer_regions(o, batch, seq_len, adamw);
  auto plan = plan_regions(t.model, options);
  plan.region_names.assign(plan.blocks.size(), "block");
  return plan;
}

CudaStepPrediction predict_cuda_transformer_step(
    const TransformerOptions& model,
    int64_t batch,
    int64_t seq_len,
    const BlockCheckpointing& checkpointing,
    bool adamw,
    const CudaPredictOptions& options) {
  TORCH_CHECK(batch >= 1 && seq_len >= 1, "predict_cuda_transformer_step: expected batch and seq_len >= 1, but got ",
              batch, " and ", seq_len);
  Transformer meta{nullptr};
  {
    MetaInitGuard guard;
    meta = Transformer(model);
  }
  std::unique_ptr<torch::optim::AdamW> opt;
  if (adamw) {
    opt = std::make_unique<torch::optim::AdamW>(meta->parameters(), torch::optim::AdamWOptions(1e-3));
  }
  return predict_cuda_step_peak(
      *meta,
      [&] {
        return meta->forward(at::empty({batch, seq_len, model.d_model()}, at::kMeta), checkpointing)
            .pow(2)
            .mean();
      },
      opt.get(), options);
}

CudaCheckpointPlan plan_checkpointing_cuda(
    const TransformerOptions& o,
    int64_t batch,
    int64_t seq_len,
    const PlanOptions& options,
    CudaBudgetKind kind,
    const CudaPredictOptions& cuda,
    bool adamw) {
  TORCH_CHECK(options.budget_bytes() > 0, "plan_checkpointing_cuda: expected a budget > 0, but got ",
              options.budget_bytes());
  TORCH_CHECK(o.num_layers() >= 1, "plan_checkpointing_cuda: expected num_layers >= 1, but got ",
              o.num_layers());
  auto t = transformer_regions(o, batch, seq_len, adamw);
  auto r = plan_regions_cuda(t.model, *t.meta, options, kind, cuda);
  r.plan.region_names.assign(r.plan.blocks.size(), "block");
  return r;
}

} // namespace trainmem
