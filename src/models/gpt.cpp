#include "trainmem/models/gpt.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/linear.h>
#include <c10/util/Exception.h>
#include <torch/nn/init.h>
#include <torch/nn/options/embedding.h>
#include <torch/nn/options/normalization.h>

namespace trainmem {

GPTOptions GPTOptions::gpt2_small() {
  return GPTOptions();
}

GPTOptions GPTOptions::gpt3_6_7b() {
  return GPTOptions().vocab_size(50257).context_length(2048).d_model(4096).num_layers(32).num_heads(32);
}

GPTOptions GPTOptions::exact_7b() {
  return GPTOptions().vocab_size(52758).context_length(4096).d_model(4480).num_layers(28).num_heads(35);
}

GPTOptions GPTOptions::llama2_70b_shape() {
  return GPTOptions().vocab_size(32000).context_length(4096).d_model(8192).num_layers(80).num_heads(64);
}

int64_t gpt_num_params(const GPTOptions& o) {
  const int64_t d = o.d_model();
  return o.vocab_size() * d + o.context_length() * d + o.num_layers() * (12 * d * d + 13 * d) + 2 * d;
}

GPTImpl::GPTImpl(GPTOptions options_) : options(options_) {
  reset();
}

void GPTImpl::reset() {
  TORCH_CHECK(options.vocab_size() > 0, "GPT: expected vocab_size > 0, but got ", options.vocab_size());
  TORCH_CHECK(options.context_length() > 0, "GPT: expected context_length > 0, but got ",
              options.context_length());
  // Registration order is construction order, so materialize() redraws the
  // same random numbers as a CPU construction (meta.h).
  wte = register_module("wte", torch::nn::Embedding(options.vocab_size(), options.d_model()));
  wpe = register_module("wpe", torch::nn::Embedding(options.context_length(), options.d_model()));
  transformer = register_module(
      "transformer", Transformer(TransformerOptions()
                                     .num_layers(options.num_layers())
                                     .d_model(options.d_model())
                                     .num_heads(options.num_heads())));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({options.d_model()})));
  reset_parameters();
}

void GPTImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(wte->weight, 0.0, 0.02);
  torch::nn::init::normal_(wpe->weight, 0.0, 0.02);
}

torch::Tensor GPTImpl::embed(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "GPT: expected tokens of shape (B, T), but got ", tokens.sizes());
  TORCH_CHECK(tokens.size(1) <= options.context_length(), "GPT: expected at most ",
              options.context_length(), " tokens per sequence, but got ", tokens.size(1));
  auto positions = at::arange(tokens.size(1), tokens.options().dtype(at::kLong)); // (T)
  return wte->forward(tokens) + wpe->forward(positions);                          // (B, T, d)
}

torch::Tensor GPTImpl::head(const torch::Tensor& h) {
  return at::linear(ln_f->forward(h), wte->weight); // (B, T, V), tied to wte
}

torch::Tensor GPTImpl::forward(const torch::Tensor& tokens) {
  return head(transformer->forward(embed(tokens)));
}

torch::Tensor GPTImpl::forward(const torch::Tensor& tokens, const BlockCheckpointing& plan) {
  return head(transformer->forward(embed(tokens), plan));
}

} // namespace trainmem
