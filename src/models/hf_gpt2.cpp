// GPT-2 as transformers' modeling_gpt2.py runs it (Note [Models from config
// files]): Conv1D, attention, MLP, blocks and the model.
#include "trainmem/models/hf_model.h"

#include <cmath>
#include <numbers>

#include <ATen/ops/addmm.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/tanh.h>
#include <c10/util/Exception.h>
#include <torch/nn/init.h>
#include <torch/nn/options/linear.h>
#include <torch/nn/options/normalization.h>

#include "models/detail/hf_modeling.h"

namespace trainmem {

// ---------------------------------------------------------------------------
// GPT-2 (transformers' modeling_gpt2.py)

Conv1DImpl::Conv1DImpl(int64_t nf_, int64_t nx_) : nf(nf_), nx(nx_) {
  reset();
}

void Conv1DImpl::reset() {
  TORCH_CHECK(nf > 0 && nx > 0, "Conv1D: expected nf and nx > 0, but got ", nf, " and ", nx);
  weight = register_parameter("weight", at::empty({nx, nf}));
  bias = register_parameter("bias", at::zeros({nf}));
  reset_parameters();
}

void Conv1DImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(weight, 0.0, 0.02);
  bias.zero_();
}

at::Tensor Conv1DImpl::forward(const at::Tensor& x) {
  auto size_out = x.sizes().vec();
  size_out.back() = nf;
  return at::addmm(bias, x.view({-1, x.size(-1)}), weight).view(size_out);
}

Gpt2AttentionImpl::Gpt2AttentionImpl(Gpt2Options options_) : options(options_) {
  reset();
}

void Gpt2AttentionImpl::reset() {
  const int64_t d = options.hidden_size();
  TORCH_CHECK(d % options.num_heads() == 0, "Gpt2Attention: hidden size ", d, " is not divisible by ",
              options.num_heads(), " heads");
  c_attn = register_module("c_attn", Conv1D(3 * d, d));
  c_proj = register_module("c_proj", Conv1D(d, d));
}

at::Tensor Gpt2AttentionImpl::forward(const at::Tensor& x) {
  const int64_t d = options.hidden_size(), hd = d / options.num_heads();
  const int64_t B = x.size(0), T = x.size(1);
  auto qkv = detail::adapted(c_attn, x).split(d, 2);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, -1, hd}).transpose(1, 2); };
  auto q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);  // (B, H, T, hd), views
  if (options.use_cache()) {
    k = detail::cache_copy(k);
    v = detail::cache_copy(v);
  }
  auto attn = detail::sdpa_attention(q, k, v, std::nullopt, std::pow(static_cast<double>(hd), -0.5));
  return detail::adapted(c_proj, attn);
}

Gpt2MLPImpl::Gpt2MLPImpl(Gpt2Options options_) : options(options_) {
  reset();
}

void Gpt2MLPImpl::reset() {
  const auto& a = options.activation();
  TORCH_CHECK(a == "gelu_new" || a == "gelu" || a == "gelu_pytorch_tanh" || a == "relu",
              "Gpt2MLP: unsupported activation \"", a, "\"");
  c_fc = register_module("c_fc", Conv1D(options.intermediate_size(), options.hidden_size()));
  c_proj = register_module("c_proj", Conv1D(options.hidden_size(), options.intermediate_size()));
}

at::Tensor Gpt2MLPImpl::forward(const at::Tensor& x) {
  auto h = detail::adapted(c_fc, x);
  const auto& a = options.activation();
  if (a == "gelu_new") {
    // NewGELUActivation, as written there: saves x (pow), tanh's result, 0.5 x and 1 + tanh.
    h = 0.5 * h * (1.0 + at::tanh(std::sqrt(2.0 / std::numbers::pi) * (h + 0.044715 * at::pow(h, 3.0))));
  } else if (a == "gelu") {
    h = at::gelu(h);
  } else if (a == "gelu_pytorch_tanh") {
    h = at::gelu(h, "tanh");
  } else {
    h = at::relu(h);
  }
  return detail::adapted(c_proj, h);
}

Gpt2BlockImpl::Gpt2BlockImpl(Gpt2Options options_) : options(options_) {
  reset();
}

void Gpt2BlockImpl::reset() {
  auto ln = [this] {
    return torch::nn::LayerNorm(torch::nn::LayerNormOptions({options.hidden_size()}).eps(options.layer_norm_eps()));
  };
  ln_1 = register_module("ln_1", ln());
  attn = register_module("attn", Gpt2Attention(options));
  ln_2 = register_module("ln_2", ln());
  mlp = register_module("mlp", Gpt2MLP(options));
}

at::Tensor Gpt2BlockImpl::forward(const at::Tensor& x) {
  auto h = attn->forward(ln_1->forward(x)) + x;
  return h + mlp->forward(ln_2->forward(h));
}

Gpt2Impl::Gpt2Impl(Gpt2Options options_) : options(options_) {
  reset();
}

void Gpt2Impl::reset() {
  const auto& o = options;
  TORCH_CHECK(o.vocab_size() > 0 && o.max_positions() > 0, "Gpt2: expected a vocabulary and positions > 0");
  // Registration order is construction order (materialize() redraws the same numbers).
  wte = register_module("wte", torch::nn::Embedding(o.vocab_size(), o.hidden_size()));
  wpe = register_module("wpe", torch::nn::Embedding(o.max_positions(), o.hidden_size()));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.num_layers(); ++i) {
    h->push_back(Gpt2Block(o));
  }
  ln_f = register_module(
      "ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.hidden_size()}).eps(o.layer_norm_eps())));
  reset_parameters();
}

void Gpt2Impl::reset_parameters() {
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(wte->weight, 0.0, 0.02);
  torch::nn::init::normal_(wpe->weight, 0.0, 0.02);
}

at::Tensor Gpt2Impl::embed(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "Gpt2: expected tokens of shape (B, T), but got ", tokens.sizes());
  TORCH_CHECK(tokens.size(1) <= options.max_positions(), "Gpt2: expected at most ", options.max_positions(),
              " tokens per sequence, but got ", tokens.size(1));
  auto positions = at::arange(tokens.size(1), tokens.options().dtype(at::kLong)).unsqueeze(0);  // (1, T)
  return wte->forward(tokens) + wpe->forward(positions);                                          // (B, T, d)
}

at::Tensor Gpt2Impl::head(const at::Tensor& x) {
  return at::linear(ln_f->forward(x), wte->weight);  // (B, T, V), tied to wte
}

at::Tensor Gpt2Impl::forward(const at::Tensor& tokens) {
  return run(tokens, nullptr);
}

at::Tensor Gpt2Impl::forward(const at::Tensor& tokens, const BlockCheckpointing& plan) {
  return run(tokens, &plan);
}

at::Tensor Gpt2Impl::run(const at::Tensor& tokens, const BlockCheckpointing* plan) {
  auto x = detail::run_blocks("Gpt2", options.num_layers(), embed(tokens), {}, plan,
                              [this](int64_t i, const at::Tensor& y, const std::vector<at::Tensor>&) {
                                return h[i]->as<Gpt2BlockImpl>()->forward(y);
                              });
  return head(x);
}

} // namespace trainmem
