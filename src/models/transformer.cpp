#include "trainmem/models/transformer.h"

#include <algorithm>

#include <ATen/TensorOperators.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/util/Exception.h>
#include <torch/nn/options/linear.h>
#include <torch/nn/options/normalization.h>


namespace trainmem {

TransformerBlockImpl::TransformerBlockImpl(int64_t d_model_, int64_t num_heads_)
    : d_model(d_model_), num_heads(num_heads_) {
  reset();
}

void TransformerBlockImpl::reset() {
  TORCH_CHECK(d_model > 0, "TransformerBlock: expected d_model > 0, but got ", d_model);
  TORCH_CHECK(num_heads > 0 && d_model % num_heads == 0,
              "TransformerBlock: expected num_heads to divide d_model (", d_model,
              "), but got num_heads = ", num_heads);
  using torch::nn::LayerNormOptions;
  ln1 = register_module("ln1", torch::nn::LayerNorm(LayerNormOptions({d_model})));
  qkv = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
  proj = register_module("proj", torch::nn::Linear(d_model, d_model));
  ln2 = register_module("ln2", torch::nn::LayerNorm(LayerNormOptions({d_model})));
  fc1 = register_module("fc1", torch::nn::Linear(d_model, 4 * d_model));
  fc2 = register_module("fc2", torch::nn::Linear(4 * d_model, d_model));
}

torch::Tensor TransformerBlockImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == d_model,
              "TransformerBlock: expected input of shape (B, T, ", d_model,
              "), but got ", x.sizes());
  const int64_t B = x.size(0), T = x.size(1), hd = d_model / num_heads;
  // (B, T, 3d) -> (B, T, 3, H, hd) -> 3 x (B, H, T, hd): views of one buffer.
  auto qkv_out = qkv->forward(ln1->forward(x)).view({B, T, 3, num_heads, hd});
  auto q = qkv_out.select(2, 0).transpose(1, 2);
  auto k = qkv_out.select(2, 1).transpose(1, 2);
  auto v = qkv_out.select(2, 2).transpose(1, 2);
  auto attn = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
  // (B, H, T, hd) -> (B, T, d)
  auto h = x + proj->forward(attn.transpose(1, 2).reshape({B, T, d_model}));
  return h + fc2->forward(at::gelu(fc1->forward(ln2->forward(h))));
}

TransformerImpl::TransformerImpl(TransformerOptions options_) : options(options_) {
  reset();
}

void TransformerImpl::reset() {
  TORCH_CHECK(options.num_layers() > 0,
              "Transformer: expected num_layers > 0, but got ", options.num_layers());
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < options.num_layers(); ++i) {
    blocks->push_back(TransformerBlock(options.d_model(), options.num_heads()));
  }
}

torch::Tensor TransformerImpl::forward(torch::Tensor x) {
  for (const auto& b : *blocks) {
    x = b->as<TransformerBlockImpl>()->forward(x);
  }
  return x;
}

torch::Tensor TransformerImpl::forward(torch::Tensor x, const BlockCheckpointing& plan) {
  TORCH_CHECK(static_cast<int64_t>(plan.blocks.size()) == options.num_layers(),
              "Transformer::forward: the checkpoint plan '", plan.name, "' has ",
              plan.blocks.size(), " blocks, but the model has ", options.num_layers());
  TORCH_CHECK(plan.region_length.empty() || plan.region_length.size() == plan.blocks.size(),
              "Transformer::forward: the plan '", plan.name, "' has ", plan.region_length.size(),
              " region lengths, expected 0 or ", plan.blocks.size());
  const int64_t L = options.num_layers();
  for (int64_t i = 0; i < L;) {
    const int64_t k = plan.region_length.empty() ? 1 : std::max<int64_t>(1, plan.region_length[i]);
    if (!plan.blocks[i]) {
      x = block(i)->forward(x);
      ++i;
    } else if (k == 1) {
      x = checkpoint(block(i), x, plan.options_for(i));
      ++i;
    } else {
      TORCH_CHECK(i + k <= L, "Transformer::forward: the region of ", k, " blocks at block ", i,
                  " of plan '", plan.name, "' runs past the last block (", L, ")");
      std::vector<TransformerBlock> region;
      for (int64_t j = i; j < i + k; ++j) {
        region.push_back(block(j));
      }
      x = checkpoint(
          [region](const at::Tensor& t) mutable {
            at::Tensor y = t;
            for (auto& b : region) {
              y = b->forward(y);
            }
            return y;
          },
          x, plan.options_for(i));
      i += k;
    }
  }
  return x;
}

TransformerBlock TransformerImpl::block(int64_t i) const {
  TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(blocks->size()),
              "Transformer::block: expected 0 <= i < ", blocks->size(), ", but got ", i);
  return TransformerBlock(blocks->ptr<TransformerBlockImpl>(i));
}

int64_t transformer_num_params(const TransformerOptions& o) {
  const int64_t d = o.d_model();
  return o.num_layers() * (12 * d * d + 13 * d);
}

int64_t predicted_activation_bytes(const TransformerOptions& o, int64_t batch, int64_t seq_len) {
  TORCH_CHECK(batch >= 1 && seq_len >= 1, "predicted_activation_bytes: expected batch and seq_len >= 1, but got ",
              batch, " and ", seq_len);
  return 64 * seq_len * batch * o.d_model() * o.num_layers();
}

ActivationEstimate estimate_activation_bytes(const TransformerOptions& o, int64_t batch, int64_t seq_len) {
  TORCH_CHECK(batch >= 1 && seq_len >= 1, "estimate_activation_bytes: expected batch and seq_len >= 1, but got ",
              batch, " and ", seq_len);
  const int64_t L = o.num_layers(), B = batch, T = seq_len, d = o.d_model(),
                H = o.num_heads(), f = 4;  // fp32
  ActivationEstimate e;
  // Per layer, in (B, T, d) units: LayerNorm inputs 2, QKV input 1, q/k/v 3
  // (views of one buffer), attention output 1 (also the projection's input:
  // CPU flash attention returns it in (B, T, H, hd) layout, so the reshape is
  // a view), MLP input 1, GELU input 4, GELU output 4.
  e.terms = {
      ActivationTerm{"16 (B, T, d) tensors per layer (64 T B d)", 16 * B * T * d * f * L},
      ActivationTerm{"LayerNorm mean and rstd (2 per LayerNorm, (B, T, 1))", 2 * 2 * B * T * f * L},
      ActivationTerm{"SDPA log-sum-exp ((B, H, T))", B * H * T * f * L},
      ActivationTerm{"loss input (pow saves the output)", B * T * d * f},
  };
  for (const auto& t : e.terms) {
    e.total_bytes += t.bytes;
  }
  return e;
}

} // namespace trainmem
