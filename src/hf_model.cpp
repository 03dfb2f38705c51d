#include "trainmem/hf_model.h"

#include <fstream>
#include <sstream>

#include <ATen/core/Reduction.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/nn/init.h>
#include <torch/nn/options/linear.h>

#include "trainmem/checkpoint.h"
#include "trainmem/planner.h"

#include "detail/bounded_json.h"

// Note [Models from config files]
// A config.json is read for the shape only: the keys that change a parameter
// or an activation. Required keys have no Hugging Face default that could
// describe a real model (the width, depth, heads, vocabulary); optional keys
// take the defaults of transformers' GPT2Config / LlamaConfig. Every error
// names the file, the key and the value found, since a config is usually
// edited by hand. The LLaMA modules follow transformers' modeling_llama.py
// op for op where memory depends on it: RMSNorm's fp32 statistics, rotary
// cos/sin computed once per forward and shared by the blocks, repeat_kv's
// expand + reshape (a copy when KV heads < heads) before causal SDPA, and a
// loss over the unshifted logits with shifted labels (no logits copy).

namespace trainmem {

std::string to_string(HfArchitecture architecture) {
  switch (architecture) {
    case HfArchitecture::kGPT2:
      return "gpt2";
    case HfArchitecture::kLlama:
      return "llama";
  }
  return "unknown";
}

namespace {

using json = nlohmann::json;

std::string shown(const json& v) {
  return v.dump();
}

struct Reader {
  const json& j;
  const std::string& source;

  bool has(const char* key) const {
    return j.contains(key) && !j.at(key).is_null();
  }

  int64_t positive_int(const char* key) const {
    TORCH_CHECK(j.contains(key), source, ": missing key \"", key, "\"");
    return positive_int_value(key, j.at(key));
  }

  int64_t positive_int_value(const char* key, const json& v) const {
    TORCH_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, source, ": \"", key,
                "\" must be a positive integer, but got ", shown(v));
    return v.get<int64_t>();
  }

  int64_t positive_int_or(const char* key, int64_t fallback) const {
    return has(key) ? positive_int_value(key, j.at(key)) : fallback;
  }

  double positive_number_or(const char* key, double fallback) const {
    if (!has(key)) {
      return fallback;
    }
    const auto& v = j.at(key);
    TORCH_CHECK(v.is_number() && v.get<double>() > 0, source, ": \"", key,
                "\" must be a positive number, but got ", shown(v));
    return v.get<double>();
  }

  bool bool_or(const char* key, bool fallback) const {
    if (!has(key)) {
      return fallback;
    }
    const auto& v = j.at(key);
    TORCH_CHECK(v.is_boolean(), source, ": \"", key, "\" must be true or false, but got ", shown(v));
    return v.get<bool>();
  }
};

HfArchitecture architecture_of(const json& j, const std::string& source) {
  if (j.contains("model_type")) {
    const auto& v = j.at("model_type");
    TORCH_CHECK(v.is_string(), source, ": \"model_type\" must be a string, but got ", shown(v));
    const auto t = v.get<std::string>();
    if (t == "gpt2") {
      return HfArchitecture::kGPT2;
    }
    if (t == "llama") {
      return HfArchitecture::kLlama;
    }
    TORCH_CHECK(false, source, ": unknown architecture: \"model_type\" is ", shown(v),
                "; known: \"gpt2\", \"llama\"");
  }
  if (j.contains("architectures")) {
    const auto& v = j.at("architectures");
    TORCH_CHECK(v.is_array() && !v.empty() && v.at(0).is_string(), source,
                ": \"architectures\" must be a list of class names, but got ", shown(v));
    const auto t = v.at(0).get<std::string>();
    if (t == "GPT2LMHeadModel" || t == "GPT2Model") {
      return HfArchitecture::kGPT2;
    }
    if (t == "LlamaForCausalLM" || t == "LlamaModel") {
      return HfArchitecture::kLlama;
    }
    TORCH_CHECK(false, source, ": unknown architecture: \"architectures\" is ", shown(v),
                "; known: GPT2LMHeadModel, LlamaForCausalLM");
  }
  TORCH_CHECK(false, source, ": missing key \"model_type\" (or \"architectures\"): cannot tell ",
              "the architecture; known: \"gpt2\", \"llama\"");
}

} // namespace

HfConfig parse_hf_config(const std::string& json_text, const std::string& source) {
  // A config.json is flat (rope_scaling and the like nest a level or two).
  constexpr int kMaxConfigDepth = 16;
  const json j = detail::parse_bounded_json(json_text, kMaxConfigDepth, source);
  TORCH_CHECK(j.is_object(), source, ": expected a JSON object, but got ", shown(j).substr(0, 40));
  const Reader r{j, source};
  HfConfig c;
  c.source = source;
  c.architecture = architecture_of(j, source);
  if (c.architecture == HfArchitecture::kGPT2) {
    c.num_layers = r.positive_int("n_layer");
    c.hidden_size = r.positive_int("n_embd");
    c.num_heads = r.positive_int("n_head");
    c.vocab_size = r.positive_int("vocab_size");
    c.max_positions = r.positive_int("n_positions");
    c.num_kv_heads = c.num_heads;
    TORCH_CHECK(c.hidden_size % c.num_heads == 0, source, ": \"n_embd\" ", c.hidden_size,
                " is not divisible by \"n_head\" ", c.num_heads);
    c.head_dim = c.hidden_size / c.num_heads;
    c.intermediate_size = r.positive_int_or("n_inner", 4 * c.hidden_size);
    TORCH_CHECK(c.intermediate_size == 4 * c.hidden_size, source, ": \"n_inner\" ",
                c.intermediate_size, " is not supported (GPT blocks have an MLP of 4 n_embd = ",
                4 * c.hidden_size, ")");
    c.norm_eps = r.positive_number_or("layer_norm_epsilon", 1e-5);
    c.tie_word_embeddings = r.bool_or("tie_word_embeddings", true);
    TORCH_CHECK(c.tie_word_embeddings, source,
                ": \"tie_word_embeddings\" false is not supported for gpt2 (its head is the "
                "token embedding)");
    return c;
  }
  c.hidden_size = r.positive_int("hidden_size");
  c.intermediate_size = r.positive_int("intermediate_size");
  c.num_layers = r.positive_int("num_hidden_layers");
  c.num_heads = r.positive_int("num_attention_heads");
  c.vocab_size = r.positive_int("vocab_size");
  c.num_kv_heads = r.positive_int_or("num_key_value_heads", c.num_heads);
  c.max_positions = r.positive_int_or("max_position_embeddings", 2048);
  c.norm_eps = r.positive_number_or("rms_norm_eps", 1e-6);
  c.rope_theta = r.positive_number_or("rope_theta", 10000.0);
  c.tie_word_embeddings = r.bool_or("tie_word_embeddings", false);
  c.attention_bias = r.bool_or("attention_bias", false);
  c.mlp_bias = r.bool_or("mlp_bias", false);
  if (r.has("head_dim")) {
    c.head_dim = r.positive_int("head_dim");
  } else {
    TORCH_CHECK(c.hidden_size % c.num_heads == 0, source, ": \"hidden_size\" ", c.hidden_size,
                " is not divisible by \"num_attention_heads\" ", c.num_heads);
    c.head_dim = c.hidden_size / c.num_heads;
  }
  TORCH_CHECK(c.num_heads % c.num_kv_heads == 0, source, ": \"num_attention_heads\" ", c.num_heads,
              " is not divisible by \"num_key_value_heads\" ", c.num_kv_heads);
  TORCH_CHECK(c.head_dim % 2 == 0, source, ": the head dimension ", c.head_dim,
              " must be even for rotary embeddings");
  return c;
}

HfConfig load_hf_config(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "cannot read the model config ", path, ": no such file or not readable");
  std::stringstream text;
  text << in.rdbuf();
  return parse_hf_config(text.str(), path);
}

int64_t hf_num_params(const HfConfig& c) {
  if (c.architecture == HfArchitecture::kGPT2) {
    return gpt_num_params(gpt_options(c));
  }
  const int64_t d = c.hidden_size, V = c.vocab_size, I = c.intermediate_size;
  const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  int64_t block = d * (q + 2 * kv) + q * d + 3 * d * I + 2 * d;
  if (c.attention_bias) {
    block += q + 2 * kv + d;
  }
  if (c.mlp_bias) {
    block += 2 * I + d;
  }
  return V * d + c.num_layers * block + d + (c.tie_word_embeddings ? 0 : V * d);
}

LlamaOptions llama_options(const HfConfig& c) {
  TORCH_CHECK(c.architecture == HfArchitecture::kLlama, c.source, ": expected a llama config, but got ",
              to_string(c.architecture));
  return LlamaOptions()
      .vocab_size(c.vocab_size)
      .hidden_size(c.hidden_size)
      .intermediate_size(c.intermediate_size)
      .num_layers(c.num_layers)
      .num_heads(c.num_heads)
      .num_kv_heads(c.num_kv_heads)
      .head_dim(c.head_dim)
      .max_positions(c.max_positions)
      .rms_norm_eps(c.norm_eps)
      .rope_theta(c.rope_theta)
      .tie_word_embeddings(c.tie_word_embeddings)
      .attention_bias(c.attention_bias)
      .mlp_bias(c.mlp_bias);
}

GPTOptions gpt_options(const HfConfig& c) {
  TORCH_CHECK(c.architecture == HfArchitecture::kGPT2, c.source, ": expected a gpt2 config, but got ",
              to_string(c.architecture));
  return GPTOptions()
      .vocab_size(c.vocab_size)
      .context_length(c.max_positions)
      .d_model(c.hidden_size)
      .num_layers(c.num_layers)
      .num_heads(c.num_heads);
}

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
  input_layernorm = register_module("input_layernorm", RMSNorm(d, o.rms_norm_eps()));
  q_proj = register_module("q_proj", linear(d, q, o.attention_bias()));
  k_proj = register_module("k_proj", linear(d, kv, o.attention_bias()));
  v_proj = register_module("v_proj", linear(d, kv, o.attention_bias()));
  o_proj = register_module("o_proj", linear(q, d, o.attention_bias()));
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

// (B, KV, T, hd) -> (B, KV * n_rep, T, hd), as transformers' repeat_kv.
at::Tensor repeat_kv(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) {
    return x;
  }
  const int64_t B = x.size(0), KV = x.size(1), T = x.size(2), hd = x.size(3);
  return x.unsqueeze(2).expand({B, KV, n_rep, T, hd}).reshape({B, KV * n_rep, T, hd});
}

} // namespace

at::Tensor LlamaBlockImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto& o = options;
  const int64_t B = x.size(0), T = x.size(1), H = o.num_heads(), KV = o.num_kv_heads(), hd = o.head_dim();
  auto n = input_layernorm->forward(x);                                // (B, T, d)
  auto q = q_proj->forward(n).view({B, T, H, hd}).transpose(1, 2);     // (B, H, T, hd)
  auto k = k_proj->forward(n).view({B, T, KV, hd}).transpose(1, 2);    // (B, KV, T, hd)
  auto v = v_proj->forward(n).view({B, T, KV, hd}).transpose(1, 2);    // (B, KV, T, hd)
  q = q * cos + rotate_half(q) * sin;                                   // cos, sin (T, hd)
  k = k * cos + rotate_half(k) * sin;
  k = repeat_kv(k, H / KV);
  v = repeat_kv(v, H / KV);
  auto attn = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/std::nullopt, /*dropout_p=*/0.0,
                                               /*is_causal=*/true);    // (B, H, T, hd)
  auto h = x + o_proj->forward(attn.transpose(1, 2).reshape({B, T, H * hd}));
  auto m = post_attention_layernorm->forward(h);
  return h + down_proj->forward(at::silu(gate_proj->forward(m)) * up_proj->forward(m));
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
  return {emb.cos(), emb.sin()};
}

at::Tensor LlamaImpl::run_blocks(at::Tensor h, const at::Tensor& tokens, const BlockCheckpointing* plan) {
  const int64_t L = options.num_layers();
  auto [cos, sin] = rotary(tokens.size(1), h.options());
  cos = cos.to(h.scalar_type());
  sin = sin.to(h.scalar_type());
  auto block = [this](int64_t i) { return layers[i]->as<LlamaBlockImpl>(); };
  if (plan != nullptr) {
    TORCH_CHECK(static_cast<int64_t>(plan->blocks.size()) == L, "Llama::forward: the checkpoint plan '",
                plan->name, "' has ", plan->blocks.size(), " blocks, but the model has ", L);
    TORCH_CHECK(plan->region_length.empty() || static_cast<int64_t>(plan->region_length.size()) == L,
                "Llama::forward: the plan '", plan->name, "' has ", plan->region_length.size(),
                " region lengths, expected 0 or ", L);
  }
  for (int64_t i = 0; i < L;) {
    const bool ckpt = plan != nullptr && plan->blocks[i];
    const int64_t k = !ckpt || plan->region_length.empty() ? 1 : std::max<int64_t>(1, plan->region_length[i]);
    if (!ckpt) {
      h = block(i)->forward(h, cos, sin);
      ++i;
      continue;
    }
    TORCH_CHECK(i + k <= L, "Llama::forward: the region of ", k, " blocks at block ", i, " of plan '",
                plan->name, "' runs past the last block (", L, ")");
    std::vector<LlamaBlockImpl*> region;
    for (int64_t j = i; j < i + k; ++j) {
      region.push_back(block(j));
    }
    h = checkpoint(
        [region](const std::vector<at::Tensor>& in) {
          at::Tensor y = in[0];
          for (auto* b : region) {
            y = b->forward(y, in[1], in[2]);
          }
          return std::vector<at::Tensor>{y};
        },
        std::vector<at::Tensor>{h, cos, sin}, plan->options_for(i))[0];
    i += k;
  }
  return h;
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
  return lm_head ? lm_head->forward(h) : at::linear(h, embed_tokens->weight);  // (B, T, V)
}

// ---------------------------------------------------------------------------
// Models from configs

at::Tensor HfModel::forward(const at::Tensor& tokens) const {
  TORCH_CHECK(module != nullptr, "HfModel: no module (build it with build_hf_model)");
  if (config.architecture == HfArchitecture::kGPT2) {
    return std::dynamic_pointer_cast<GPTImpl>(module)->forward(tokens);
  }
  return std::dynamic_pointer_cast<LlamaImpl>(module)->forward(tokens);
}

at::Tensor HfModel::forward(const at::Tensor& tokens, const BlockCheckpointing& plan) const {
  TORCH_CHECK(module != nullptr, "HfModel: no module (build it with build_hf_model)");
  if (config.architecture == HfArchitecture::kGPT2) {
    return std::dynamic_pointer_cast<GPTImpl>(module)->forward(tokens, plan);
  }
  return std::dynamic_pointer_cast<LlamaImpl>(module)->forward(tokens, plan);
}

namespace {

// Hugging Face's ForCausalLMLoss: labels shifted left, the last position
// ignored, cross-entropy over the flattened logits (no copy of them).
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& tokens) {
  auto labels = at::constant_pad_nd(tokens.slice(1, 1), {0, 1}, -100);  // (B, T)
  return at::cross_entropy_loss(logits.flatten(0, 1), labels.flatten(), std::nullopt,
                                at::Reduction::Mean, -100);
}

} // namespace

at::Tensor HfModel::loss(const at::Tensor& tokens) const {
  return causal_lm_loss(forward(tokens), tokens);
}

at::Tensor HfModel::loss(const at::Tensor& tokens, const BlockCheckpointing& plan) const {
  return causal_lm_loss(forward(tokens, plan), tokens);
}

HfModel build_hf_model(const HfConfig& config) {
  // On meta, SDPA and LayerNorm then save what the CPU's kernels save (and
  // causal attention does not fall into the math path's missing `where`).
  enable_cpu_meta_kernels();
  HfModel m;
  m.config = config;
  if (config.architecture == HfArchitecture::kGPT2) {
    m.module = GPT(gpt_options(config)).ptr();
  } else {
    m.module = Llama(llama_options(config)).ptr();
  }
  return m;
}

RegionModel hf_region_model(const HfModel& model, int64_t batch, int64_t seq_len) {
  TORCH_CHECK(model.module != nullptr, "hf_region_model: no module (build it with build_hf_model)");
  const int64_t positions = model.config.max_positions;  // both option sets take it from here
  TORCH_CHECK(batch >= 1, "hf_region_model: expected a batch >= 1, but got ", batch);
  TORCH_CHECK(seq_len >= 2 && seq_len <= positions, "hf_region_model: expected a sequence length in [2, ",
              positions, "], but got ", seq_len);
  using Modules = std::vector<std::shared_ptr<torch::nn::Module>>;
  RegionModel m;
  if (model.config.architecture == HfArchitecture::kGPT2) {
    auto gpt = std::dynamic_pointer_cast<GPTImpl>(model.module);
    m.regions.emplace_back(
        "embed",
        [gpt](const at::Tensor& tokens) {
          auto pos = at::arange(tokens.size(1), tokens.options().dtype(at::kLong));
          return gpt->wte->forward(tokens) + gpt->wpe->forward(pos);
        },
        Modules{gpt->wte.ptr(), gpt->wpe.ptr()});
    for (auto& r : regions_of<TransformerBlockImpl>(gpt->transformer->blocks)) {
      m.regions.push_back(std::move(r));
    }
    m.regions.emplace_back(
        "head", [gpt](const at::Tensor& h) { return at::linear(gpt->ln_f->forward(h), gpt->wte->weight); },
        Modules{gpt->ln_f.ptr(), gpt->wte.ptr()});
  } else {
    auto llama = std::dynamic_pointer_cast<LlamaImpl>(model.module);
    m.regions.emplace_back(
        "embed", [llama](const at::Tensor& tokens) { return llama->embed_tokens->forward(tokens); },
        Modules{llama->embed_tokens.ptr()});
    for (size_t i = 0; i < llama->layers->size(); ++i) {
      auto block = std::dynamic_pointer_cast<LlamaBlockImpl>(llama->layers->ptr(i));
      // As run_blocks: the tables in fp32, then in the activations' dtype.
      m.regions.emplace_back(
          fmt::format("layers.{}", i),
          [llama, block](const at::Tensor& h) {
            auto [cos, sin] = llama->rotary(h.size(1), h.options());
            return block->forward(h, cos.to(h.scalar_type()), sin.to(h.scalar_type()));
          },
          Modules{block});
    }
    Modules head{llama->norm.ptr()};
    if (llama->lm_head) {
      head.push_back(llama->lm_head.ptr());
    } else {
      head.push_back(llama->embed_tokens.ptr());
    }
    m.regions.emplace_back(
        "head",
        [llama](const at::Tensor& h) {
          auto x = llama->norm->forward(h);
          return llama->lm_head ? llama->lm_head->forward(x) : at::linear(x, llama->embed_tokens->weight);
        },
        std::move(head));
  }
  m.input = [batch, seq_len](c10::Device device) {
    return at::zeros({batch, seq_len}, at::TensorOptions().dtype(at::kLong).device(device));
  };
  // causal_lm_loss on the zero tokens of `input`: zero labels, the last position ignored.
  m.loss = [](const at::Tensor& logits) {
    auto labels = at::constant_pad_nd(
        at::zeros({logits.size(0), logits.size(1) - 1}, logits.options().dtype(at::kLong)), {0, 1}, -100);
    return at::cross_entropy_loss(logits.flatten(0, 1), labels.flatten(), std::nullopt, at::Reduction::Mean,
                                  -100);
  };
  return m;
}

} // namespace trainmem
