// The LLaMA family (LLaMA, Mistral, Qwen2, Qwen3) as transformers'
// modeling code runs it (Note [Models from config files]): RMSNorm, blocks
// with rotary attention and the gated MLP, and the model.
#include "trainmem/models/hf_model.h"

#include <cmath>

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/silu.h>
#include <c10/util/Exception.h>
#include <torch/nn/init.h>
#include <torch/nn/options/linear.h>
#include <torch/nn/options/normalization.h>

#include "models/detail/hf_modeling.h"

namespace trainmem {

// ---------------------------------------------------------------------------
// LLaMA modules

RMSNormImpl::RMSNormImpl(int64_t dim_, double eps_) : dim(dim_), eps(eps_) {
  reset();
}

void RMSNormImpl::reset() {
  TORCH_CHECK(dim > 0, "RMSNorm: expected dim > 0, but got ", dim);
  weight = register_parameter("weight", at::ones({dim}));
}

void RMSNormImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  weight.fill_(1.0);
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  const auto dtype = x.scalar_type();
  auto h = x.to(at::kFloat);
  auto variance = h.pow(2).mean({-1}, /*keepdim=*/true);  // (..., 1)
  h = h * at::rsqrt(variance + eps);
  return weight * h.to(dtype);
}

LlamaBlockImpl::LlamaBlockImpl(LlamaOptions options_) : options(options_) {
  reset();
}

void LlamaBlockImpl::reset() {
  const auto& o = options;
  const int64_t d = o.hidden_size(), q = o.num_heads() * o.head_dim(), kv = o.num_kv_heads() * o.head_dim();
  auto linear = [](int64_t in, int64_t out, bool bias) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
  };
  const bool qkv_bias = o.attention_bias() || o.qkv_bias();
  input_layernorm = register_module("input_layernorm", RMSNorm(d, o.rms_norm_eps()));
  q_proj = register_module("q_proj", linear(d, q, qkv_bias));
  k_proj = register_module("k_proj", linear(d, kv, qkv_bias));
  v_proj = register_module("v_proj", linear(d, kv, qkv_bias));
  o_proj = register_module("o_proj", linear(q, d, o.attention_bias()));
  if (o.qk_norm()) {
    q_norm = register_module("q_norm", RMSNorm(o.head_dim(), o.rms_norm_eps()));
    k_norm = register_module("k_norm", RMSNorm(o.head_dim(), o.rms_norm_eps()));
  }
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(d, o.rms_norm_eps()));
  gate_proj = register_module("gate_proj", linear(d, o.intermediate_size(), o.mlp_bias()));
  up_proj = register_module("up_proj", linear(d, o.intermediate_size(), o.mlp_bias()));
  down_proj = register_module("down_proj", linear(o.intermediate_size(), d, o.mlp_bias()));
}

namespace {

// (x1, x2) -> (-x2, x1) over the last dim.
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

} // namespace

at::Tensor LlamaBlockImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto& o = options;
  const int64_t B = x.size(0), T = x.size(1), hd = o.head_dim();
  auto n = input_layernorm->forward(x);                        // (B, T, d)
  auto q = detail::adapted(q_proj, n).view({B, T, -1, hd});    // (B, T, H, hd)
  auto k = detail::adapted(k_proj, n).view({B, T, -1, hd});    // (B, T, KV, hd)
  if (o.qk_norm()) {
    q = q_norm->forward(q);
    k = k_norm->forward(k);
  }
  q = q.transpose(1, 2);                                       // (B, H, T, hd)
  k = k.transpose(1, 2);                                       // (B, KV, T, hd)
  auto v = detail::adapted(v_proj, n).view({B, T, -1, hd}).transpose(1, 2);
  q = q * cos + rotate_half(q) * sin;                          // cos, sin (T, hd)
  k = k * cos + rotate_half(k) * sin;
  if (o.use_cache()) {
    k = detail::cache_copy(k);
    v = detail::cache_copy(v);
  }
  // Mistral: a mask from the window on (create_sliding_window_causal_mask does
  // not skip it once kv_length >= sliding_window).
  std::optional<at::Tensor> mask;
  if (o.sliding_window() > 0 && T >= o.sliding_window()) {
    mask = detail::sliding_window_mask(B, T, o.sliding_window(), x.options());
  }
  auto attn = detail::sdpa_attention(q, k, v, mask, std::pow(static_cast<double>(hd), -0.5));  // (B, T, H hd)
  auto h = x + detail::adapted(o_proj, attn);
  auto m = post_attention_layernorm->forward(h);
  return h + detail::adapted(down_proj, at::silu(detail::adapted(gate_proj, m)) * detail::adapted(up_proj, m));
}

LlamaImpl::LlamaImpl(LlamaOptions options_) : options(options_) {
  reset();
}

void LlamaImpl::reset() {
  const auto& o = options;
  TORCH_CHECK(o.num_heads() % o.num_kv_heads() == 0, "Llama: num_heads ", o.num_heads(),
              " is not divisible by num_kv_heads ", o.num_kv_heads());
  TORCH_CHECK(o.head_dim() % 2 == 0, "Llama: expected an even head_dim, but got ", o.head_dim());
  // Registration order is construction order (materialize() redraws the same numbers).
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(o.vocab_size(), o.hidden_size()));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.num_layers(); ++i) {
    layers->push_back(LlamaBlock(o));
  }
  norm = register_module("norm", RMSNorm(o.hidden_size(), o.rms_norm_eps()));
  if (!o.tie_word_embeddings()) {
    lm_head = register_module(
        "lm_head", torch::nn::Linear(torch::nn::LinearOptions(o.hidden_size(), o.vocab_size()).bias(false)));
  }
  reset_parameters();
}

void LlamaImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(embed_tokens->weight, 0.0, 0.02);
}

std::pair<at::Tensor, at::Tensor> LlamaImpl::rotary(int64_t T, const at::TensorOptions& opts) const {
  const int64_t hd = options.head_dim();
  auto f = opts.dtype(at::kFloat);
  // inv_freq = 1 / theta^(2i / hd), i < hd / 2; freqs = positions x inv_freq
  auto inv_freq = at::pow(options.rope_theta(), at::arange(0, hd, 2, f) / static_cast<double>(hd)).reciprocal();
  auto freqs = at::arange(T, f).unsqueeze(1) * inv_freq.unsqueeze(0);  // (T, hd / 2)
  auto emb = at::cat({freqs, freqs}, -1);                                 // (T, hd)
  // As LlamaRotaryEmbedding.forward: made in fp32, returned in the
  // activations' dtype, the fp32 tables freed here (a copy for a bf16 model).
  const auto dtype = opts.dtype().toScalarType();
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

at::Tensor LlamaImpl::run_blocks(at::Tensor h, const at::Tensor& tokens, const BlockCheckpointing* plan) {
  auto [cos, sin] = rotary(tokens.size(1), h.options());
  return detail::run_blocks("Llama", options.num_layers(), h, {std::move(cos), std::move(sin)}, plan,
                            [this](int64_t i, const at::Tensor& y, const std::vector<at::Tensor>& cs) {
                              return layers[i]->as<LlamaBlockImpl>()->forward(y, cs[0], cs[1]);
                            });
}

at::Tensor LlamaImpl::forward(const at::Tensor& tokens) {
  return run(tokens, nullptr);
}

at::Tensor LlamaImpl::forward(const at::Tensor& tokens, const BlockCheckpointing& plan) {
  return run(tokens, &plan);
}

at::Tensor LlamaImpl::run(const at::Tensor& tokens, const BlockCheckpointing* plan) {
  TORCH_CHECK(tokens.dim() == 2, "Llama: expected tokens of shape (B, T), but got ", tokens.sizes());
  TORCH_CHECK(tokens.size(1) <= options.max_positions(), "Llama: expected at most ",
              options.max_positions(), " tokens per sequence, but got ", tokens.size(1));
  auto h = run_blocks(embed_tokens->forward(tokens), tokens, plan);   // (B, T, d)
  h = norm->forward(h);
  return lm_head ? detail::adapted(lm_head, h) : at::linear(h, embed_tokens->weight);  // (B, T, V)
}

} // namespace trainmem
