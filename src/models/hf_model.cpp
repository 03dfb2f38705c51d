#include "trainmem/models/hf_model.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <numbers>
#include <sstream>

#include <ATen/core/Reduction.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/nn/init.h>
#include <torch/nn/options/linear.h>
#include <torch/nn/options/normalization.h>

#include "trainmem/checkpoint.h"
#include "trainmem/models/lora.h"
#include "trainmem/planner.h"

#include "detail/bounded_json.h"

// Note [Models from config files]
// A config.json is read for the shape only: the keys that change a parameter
// or an activation. Required keys have no Hugging Face default that could
// describe a real model (the width, depth, heads, vocabulary); optional keys
// take the defaults of transformers' GPT2Config, LlamaConfig, MistralConfig,
// Qwen2Config and Qwen3Config (5.24.0). Every error names the file, the key
// and the value found, since a config is usually edited by hand.
//
// The modules follow transformers 5.24.0's modeling code op for op where
// memory depends on it, as a training forward with labels runs it (CPU,
// fp32, attn_implementation "sdpa", dropout 0), so that autograd saves the
// same tensors (tests/hf_saved_bytes.py measures transformers' side):
// - GPT-2: Conv1D is addmm on the (B T, nx) view; c_attn's output split into
//   q, k, v views; gelu_new written out as NewGELUActivation does
//   (0.5 x (1 + tanh(c (x + 0.044715 x^3)))), which saves x, tanh's result,
//   0.5 x and 1 + tanh: four (B, T, I) tensors where a fused GELU saves one.
// - The KV cache: with `use_cache` true (every config's default) the model
//   makes a DynamicCache even in training, and its first update is torch.cat
//   of an empty tensor and k (and v): contiguous copies that SDPA reads and
//   saves. For GPT-2 that is two (B, T, d) copies per layer beyond the c_attn
//   output q is a view of; for the LLaMA family the copies replace tensors of
//   the same size. The cache holds nothing that autograd does not.
// - Attention (sdpa_attention_forward): grouped-query k and v go to SDPA
//   with enable_gqa where use_gqa_in_sdpa allows it (no mask, head_dim <=
//   256 on CPU and CUDA), else repeat_kv copies them to the query heads (or,
//   for one query token, pack_gqa folds the query heads onto the KV heads);
//   is_causal without a mask. Mistral's sliding-window mask is made once
//   T >= sliding_window (masking_utils' _ignore_causal_mask_sdpa stops
//   skipping it there): a boolean (B, 1, T, T) expanded view, which SDPA
//   converts to a float mask and saves, per layer; k and v repeated.
// - LLaMA family: RMSNorm's fp32 statistics, rotary cos/sin computed once per
//   forward and shared by the blocks, Qwen3's q/k RMSNorm over the (B, T, H,
//   hd) view before the transpose.
// - The loss over the unshifted logits with shifted labels (no logits copy).

namespace trainmem {

std::string to_string(HfArchitecture architecture) {
  switch (architecture) {
    case HfArchitecture::kGPT2:
      return "gpt2";
    case HfArchitecture::kLlama:
      return "llama";
    case HfArchitecture::kMistral:
      return "mistral";
    case HfArchitecture::kQwen2:
      return "qwen2";
    case HfArchitecture::kQwen3:
      return "qwen3";
  }
  return "unknown";
}

std::string hf_class_name(HfArchitecture architecture) {
  switch (architecture) {
    case HfArchitecture::kGPT2:
      return "GPT2LMHeadModel";
    case HfArchitecture::kLlama:
      return "LlamaForCausalLM";
    case HfArchitecture::kMistral:
      return "MistralForCausalLM";
    case HfArchitecture::kQwen2:
      return "Qwen2ForCausalLM";
    case HfArchitecture::kQwen3:
      return "Qwen3ForCausalLM";
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

// model_type, transformers' class names.
struct KnownArchitecture {
  const char* model_type;
  const char* causal_lm;
  const char* base;
  HfArchitecture architecture;
};
constexpr KnownArchitecture kKnown[] = {
    {"gpt2", "GPT2LMHeadModel", "GPT2Model", HfArchitecture::kGPT2},
    {"llama", "LlamaForCausalLM", "LlamaModel", HfArchitecture::kLlama},
    {"mistral", "MistralForCausalLM", "MistralModel", HfArchitecture::kMistral},
    {"qwen2", "Qwen2ForCausalLM", "Qwen2Model", HfArchitecture::kQwen2},
    {"qwen3", "Qwen3ForCausalLM", "Qwen3Model", HfArchitecture::kQwen3},
};
constexpr const char* kKnownTypes = "\"gpt2\", \"llama\", \"mistral\", \"qwen2\", \"qwen3\"";

HfArchitecture architecture_of(const json& j, const std::string& source) {
  if (j.contains("model_type")) {
    const auto& v = j.at("model_type");
    TORCH_CHECK(v.is_string(), source, ": \"model_type\" must be a string, but got ", shown(v));
    const auto t = v.get<std::string>();
    for (const auto& k : kKnown) {
      if (t == k.model_type) {
        return k.architecture;
      }
    }
    TORCH_CHECK(false, source, ": unknown architecture: \"model_type\" is ", shown(v), "; known: ", kKnownTypes);
  }
  if (j.contains("architectures")) {
    const auto& v = j.at("architectures");
    TORCH_CHECK(v.is_array() && !v.empty() && v.at(0).is_string(), source,
                ": \"architectures\" must be a list of class names, but got ", shown(v));
    const auto t = v.at(0).get<std::string>();
    for (const auto& k : kKnown) {
      if (t == k.causal_lm || t == k.base) {
        return k.architecture;
      }
    }
    TORCH_CHECK(false, source, ": unknown architecture: \"architectures\" is ", shown(v),
                "; known: GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                "Qwen3ForCausalLM");
  }
  TORCH_CHECK(false, source, ": missing key \"model_type\" (or \"architectures\"): cannot tell ",
              "the architecture; known: ", kKnownTypes);
}

std::string string_or(const Reader& r, const char* key, const std::string& fallback) {
  if (!r.has(key)) {
    return fallback;
  }
  const auto& v = r.j.at(key);
  TORCH_CHECK(v.is_string(), r.source, ": \"", key, "\" must be a string, but got ", shown(v));
  return v.get<std::string>();
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
    c.norm_eps = r.positive_number_or("layer_norm_epsilon", 1e-5);
    c.tie_word_embeddings = r.bool_or("tie_word_embeddings", true);
    TORCH_CHECK(c.tie_word_embeddings, source,
                ": \"tie_word_embeddings\" false is not supported for gpt2 (its head is the "
                "token embedding)");
    c.use_cache = r.bool_or("use_cache", true);
    c.activation = string_or(r, "activation_function", "gelu_new");
    TORCH_CHECK(c.activation == "gelu_new" || c.activation == "gelu" || c.activation == "gelu_pytorch_tanh" ||
                    c.activation == "relu",
                source, ": \"activation_function\" ", shown(r.j.at("activation_function")),
                " is not supported; known: \"gelu_new\", \"gelu\", \"gelu_pytorch_tanh\", \"relu\"");
    TORCH_CHECK(!r.bool_or("scale_attn_by_inverse_layer_idx", false), source,
                ": \"scale_attn_by_inverse_layer_idx\" true is not supported");
    TORCH_CHECK(!r.bool_or("add_cross_attention", false), source, ": \"add_cross_attention\" true is not supported");
    return c;
  }
  c.hidden_size = r.positive_int("hidden_size");
  c.intermediate_size = r.positive_int("intermediate_size");
  c.num_layers = r.positive_int("num_hidden_layers");
  c.num_heads = r.positive_int("num_attention_heads");
  c.vocab_size = r.positive_int("vocab_size");
  // The defaults of LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config (a
  // missing key; null means the query heads everywhere).
  const bool llama = c.architecture == HfArchitecture::kLlama;
  const bool mistral = c.architecture == HfArchitecture::kMistral;
  const int64_t kv_default = llama ? c.num_heads : mistral ? 8 : 32;
  c.num_kv_heads = r.j.contains("num_key_value_heads") ? r.positive_int_or("num_key_value_heads", c.num_heads)
                                                       : kv_default;
  c.max_positions = r.positive_int_or("max_position_embeddings", llama ? 2048 : mistral ? 131072 : 32768);
  c.norm_eps = r.positive_number_or("rms_norm_eps", 1e-6);
  c.rope_theta = r.positive_number_or("rope_theta", 10000.0);
  c.tie_word_embeddings = r.bool_or("tie_word_embeddings", false);
  c.use_cache = r.bool_or("use_cache", true);
  c.activation = string_or(r, "hidden_act", "silu");
  TORCH_CHECK(c.activation == "silu", source, ": \"hidden_act\" ", shown(r.j.at("hidden_act")),
              " is not supported; known: \"silu\"");
  switch (c.architecture) {
    case HfArchitecture::kLlama:
      c.attention_bias = r.bool_or("attention_bias", false);
      c.mlp_bias = r.bool_or("mlp_bias", false);
      break;
    case HfArchitecture::kMistral:
      c.sliding_window = r.has("sliding_window") ? r.positive_int("sliding_window") : 0;
      if (!r.j.contains("sliding_window")) {
        c.sliding_window = 4096;  // MistralConfig's default; null turns it off
      }
      TORCH_CHECK(!r.has("layer_types"), source,
                  ": \"layer_types\" is not supported for mistral (transformers builds it as Ministral)");
      break;
    case HfArchitecture::kQwen2:
    case HfArchitecture::kQwen3:
      c.qkv_bias = c.architecture == HfArchitecture::kQwen2;
      c.attention_bias = c.architecture == HfArchitecture::kQwen3 && r.bool_or("attention_bias", false);
      c.qk_norm = c.architecture == HfArchitecture::kQwen3;
      TORCH_CHECK(!r.bool_or("use_sliding_window", false), source,
                  ": \"use_sliding_window\" true is not supported for ", to_string(c.architecture));
      break;
    case HfArchitecture::kGPT2:
      break;
  }
  if (r.has("head_dim")) {
    c.head_dim = r.positive_int("head_dim");
  } else if (c.architecture == HfArchitecture::kQwen3 && !r.j.contains("head_dim")) {
    c.head_dim = 128;  // Qwen3Config's default, whatever the width
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
  const int64_t d = c.hidden_size, V = c.vocab_size, I = c.intermediate_size;
  if (c.architecture == HfArchitecture::kGPT2) {
    return V * d + c.max_positions * d + c.num_layers * (4 * d * d + 2 * d * I + 9 * d + I) + 2 * d;
  }
  const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  int64_t block = d * (q + 2 * kv) + q * d + 3 * d * I + 2 * d;
  if (c.attention_bias) {
    block += q + 2 * kv + d;
  } else if (c.qkv_bias) {
    block += q + 2 * kv;
  }
  if (c.qk_norm) {
    block += 2 * c.head_dim;
  }
  if (c.mlp_bias) {
    block += 2 * I + d;
  }
  return V * d + c.num_layers * block + d + (c.tie_word_embeddings ? 0 : V * d);
}

LlamaOptions llama_options(const HfConfig& c) {
  TORCH_CHECK(c.architecture != HfArchitecture::kGPT2, c.source,
              ": expected a llama-family config (llama, mistral, qwen2, qwen3), but got ", to_string(c.architecture));
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
      .mlp_bias(c.mlp_bias)
      .qkv_bias(c.qkv_bias)
      .qk_norm(c.qk_norm)
      .sliding_window(c.sliding_window)
      .use_cache(c.use_cache);
}

Gpt2Options gpt2_options(const HfConfig& c) {
  TORCH_CHECK(c.architecture == HfArchitecture::kGPT2, c.source, ": expected a gpt2 config, but got ",
              to_string(c.architecture));
  return Gpt2Options()
      .vocab_size(c.vocab_size)
      .max_positions(c.max_positions)
      .hidden_size(c.hidden_size)
      .num_layers(c.num_layers)
      .num_heads(c.num_heads)
      .intermediate_size(c.intermediate_size)
      .layer_norm_eps(c.norm_eps)
      .activation(c.activation)
      .use_cache(c.use_cache);
}

GPTOptions gpt_options(const HfConfig& c) {
  TORCH_CHECK(c.architecture == HfArchitecture::kGPT2, c.source, ": expected a gpt2 config, but got ",
              to_string(c.architecture));
  TORCH_CHECK(c.intermediate_size == 4 * c.hidden_size, c.source, ": \"n_inner\" ", c.intermediate_size,
              " has no GPTOptions (GPT blocks have an MLP of 4 n_embd = ", 4 * c.hidden_size, ")");
  return GPTOptions()
      .vocab_size(c.vocab_size)
      .context_length(c.max_positions)
      .d_model(c.hidden_size)
      .num_layers(c.num_layers)
      .num_heads(c.num_heads);
}

// ---------------------------------------------------------------------------
// What transformers' modeling code shares: the KV cache's copies, attention
// through SDPA, checkpointed runs of blocks

namespace {

// A layer's forward with its LoRA adapter's update when apply_lora() gave it
// one (lora.h), as PEFT's lora.Linear wraps the layer.
template <typename Holder>
at::Tensor adapted(const Holder& layer, const at::Tensor& x) {
  return lora_forward(*layer, layer.ptr()->forward(x), x);
}

// DynamicLayer::update (cache_utils.py) on its first call: torch.cat of an
// empty 1-D tensor and the new k or v along the sequence: a contiguous copy,
// which attention then reads (so autograd saves the copy). transformers
// makes this cache whenever `use_cache` is true, in training too.
at::Tensor cache_copy(const at::Tensor& x) {
  return at::cat({at::empty({0}, x.options()), x}, -2);
}

// (B, KV, T, hd) -> (B, KV * n_rep, T, hd), as transformers' repeat_kv.
at::Tensor repeat_kv(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) {
    return x;
  }
  const int64_t B = x.size(0), KV = x.size(1), T = x.size(2), hd = x.size(3);
  return x.unsqueeze(2).expand({B, KV, n_rep, T, hd}).reshape({B, KV * n_rep, T, hd});
}

// sdpa_attention.py's use_gqa_in_sdpa on CPU and CUDA (not XPU or MPS): the
// KV heads go to SDPA as they are (enable_gqa) without a mask and with a
// head_dim of at most 256, or whenever TRANSFORMERS_SDPA_FORCE_GQA is "1".
bool use_gqa_in_sdpa(const std::optional<at::Tensor>& mask, const at::Tensor& k, const at::Tensor& v) {
  const char* force = std::getenv("TRANSFORMERS_SDPA_FORCE_GQA");
  if (force != nullptr && std::string(force) == "1") {
    return true;
  }
  return !mask.has_value() && k.size(-1) == v.size(-1) && k.size(-1) <= 256;
}

// sdpa_attention_forward (integrations/sdpa_attention.py) in a training
// forward, with the projection's reshape after it: q (B, H, T, hd), k and v
// (B, KV, T, hd), an optional boolean mask (B, 1, T, T) -> (B, T, H hd).
at::Tensor sdpa_attention(const at::Tensor& q, at::Tensor k, at::Tensor v, const std::optional<at::Tensor>& mask,
                          double scale) {
  const int64_t B = q.size(0), T = q.size(2), n_rep = q.size(1) / k.size(1);
  bool gqa = false;
  at::Tensor query = q;
  if (n_rep > 1) {
    if (use_gqa_in_sdpa(mask, k, v)) {
      gqa = true;
    } else if (T == 1) {
      // pack_gqa: one query token, (B, H, 1, hd) -> (B, KV, n_rep, hd); a mask
      // shared by the heads (ours: (B, 1, T, T)) as it is.
      query = q.reshape({B, q.size(1) / n_rep, n_rep, q.size(3)});
    } else {
      k = repeat_kv(k, n_rep);
      v = repeat_kv(v, n_rep);
    }
  }
  const bool is_causal = T > 1 && !mask.has_value();
  auto out = at::scaled_dot_product_attention(query, k, v, mask, /*dropout_p=*/0.0, is_causal, scale, gqa);
  out = out.reshape({out.size(0), -1, T, v.size(-1)}).transpose(1, 2).contiguous();  // (B, T, H, hd)
  return out.reshape({B, T, -1}).contiguous();
}

// transformers' sliding-window causal mask as sdpa_mask builds it: position
// q sees k when k <= q and q - k < window; (1, 1, T, T) expanded to B.
at::Tensor sliding_window_mask(int64_t B, int64_t T, int64_t window, const at::TensorOptions& options) {
  auto pos = at::arange(T, options.dtype(at::kLong));
  auto q = pos.unsqueeze(1), k = pos.unsqueeze(0);
  return ((k <= q) & (k > q - window)).view({1, 1, T, T}).expand({B, 1, T, T});  // structured ops: run on meta
}

// Runs blocks 0 .. L-1 on h, checkpointing the regions `plan` names (as
// Transformer::forward): each region's inputs are h and `shared`.
using BlockFn = std::function<at::Tensor(int64_t, const at::Tensor&, const std::vector<at::Tensor>&)>;
at::Tensor run_blocks(const char* model, int64_t L, at::Tensor h, const std::vector<at::Tensor>& shared,
                      const BlockCheckpointing* plan, const BlockFn& block) {
  if (plan != nullptr) {
    TORCH_CHECK(static_cast<int64_t>(plan->blocks.size()) == L, model, "::forward: the checkpoint plan '",
                plan->name, "' has ", plan->blocks.size(), " blocks, but the model has ", L);
    TORCH_CHECK(plan->region_length.empty() || static_cast<int64_t>(plan->region_length.size()) == L, model,
                "::forward: the plan '", plan->name, "' has ", plan->region_length.size(),
                " region lengths, expected 0 or ", L);
  }
  for (int64_t i = 0; i < L;) {
    const bool ckpt = plan != nullptr && plan->blocks[i];
    const int64_t k = !ckpt || plan->region_length.empty() ? 1 : std::max<int64_t>(1, plan->region_length[i]);
    if (!ckpt) {
      h = block(i, h, shared);
      ++i;
      continue;
    }
    TORCH_CHECK(i + k <= L, model, "::forward: the region of ", k, " blocks at block ", i, " of plan '",
                plan->name, "' runs past the last block (", L, ")");
    std::vector<at::Tensor> in{h};
    in.insert(in.end(), shared.begin(), shared.end());
    h = checkpoint(
        [block, i, k](const std::vector<at::Tensor>& x) {
          at::Tensor y = x[0];
          const std::vector<at::Tensor> rest(x.begin() + 1, x.end());
          for (int64_t j = i; j < i + k; ++j) {
            y = block(j, y, rest);
          }
          return std::vector<at::Tensor>{y};
        },
        in, plan->options_for(i))[0];
    i += k;
  }
  return h;
}

} // namespace

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
  auto qkv = adapted(c_attn, x).split(d, 2);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, -1, hd}).transpose(1, 2); };
  auto q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);  // (B, H, T, hd), views
  if (options.use_cache()) {
    k = cache_copy(k);
    v = cache_copy(v);
  }
  auto attn = sdpa_attention(q, k, v, std::nullopt, std::pow(static_cast<double>(hd), -0.5));
  return adapted(c_proj, attn);
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
  auto h = adapted(c_fc, x);
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
  return adapted(c_proj, h);
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
  auto x = run_blocks("Gpt2", options.num_layers(), embed(tokens), {}, plan,
                      [this](int64_t i, const at::Tensor& y, const std::vector<at::Tensor>&) {
                        return h[i]->as<Gpt2BlockImpl>()->forward(y);
                      });
  return head(x);
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
  auto q = adapted(q_proj, n).view({B, T, -1, hd});            // (B, T, H, hd)
  auto k = adapted(k_proj, n).view({B, T, -1, hd});            // (B, T, KV, hd)
  if (o.qk_norm()) {
    q = q_norm->forward(q);
    k = k_norm->forward(k);
  }
  q = q.transpose(1, 2);                                       // (B, H, T, hd)
  k = k.transpose(1, 2);                                       // (B, KV, T, hd)
  auto v = adapted(v_proj, n).view({B, T, -1, hd}).transpose(1, 2);
  q = q * cos + rotate_half(q) * sin;                          // cos, sin (T, hd)
  k = k * cos + rotate_half(k) * sin;
  if (o.use_cache()) {
    k = cache_copy(k);
    v = cache_copy(v);
  }
  // Mistral: a mask from the window on (create_sliding_window_causal_mask does
  // not skip it once kv_length >= sliding_window).
  std::optional<at::Tensor> mask;
  if (o.sliding_window() > 0 && T >= o.sliding_window()) {
    mask = sliding_window_mask(B, T, o.sliding_window(), x.options());
  }
  auto attn = sdpa_attention(q, k, v, mask, std::pow(static_cast<double>(hd), -0.5));  // (B, T, H hd)
  auto h = x + adapted(o_proj, attn);
  auto m = post_attention_layernorm->forward(h);
  return h + adapted(down_proj, at::silu(adapted(gate_proj, m)) * adapted(up_proj, m));
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
  auto [cos, sin] = rotary(tokens.size(1), h.options());
  std::vector<at::Tensor> shared{cos.to(h.scalar_type()), sin.to(h.scalar_type())};
  return trainmem::run_blocks("Llama", options.num_layers(), h, shared, plan,
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
  return lm_head ? adapted(lm_head, h) : at::linear(h, embed_tokens->weight);  // (B, T, V)
}

// ---------------------------------------------------------------------------
// Models from configs

at::Tensor HfModel::forward(const at::Tensor& tokens) const {
  TORCH_CHECK(module != nullptr, "HfModel: no module (build it with build_hf_model)");
  if (config.architecture == HfArchitecture::kGPT2) {
    return std::dynamic_pointer_cast<Gpt2Impl>(module)->forward(tokens);
  }
  return std::dynamic_pointer_cast<LlamaImpl>(module)->forward(tokens);
}

at::Tensor HfModel::forward(const at::Tensor& tokens, const BlockCheckpointing& plan) const {
  TORCH_CHECK(module != nullptr, "HfModel: no module (build it with build_hf_model)");
  if (config.architecture == HfArchitecture::kGPT2) {
    return std::dynamic_pointer_cast<Gpt2Impl>(module)->forward(tokens, plan);
  }
  return std::dynamic_pointer_cast<LlamaImpl>(module)->forward(tokens, plan);
}

namespace {

// transformers' ForCausalLMLoss (loss_utils.py): the logits upcast to fp32
// (a copy for a model in bf16, none in fp32 or under autocast, whose linear
// layer's bf16 logits cross_entropy casts the same way), the labels padded with
// -100 to (B, T + 1), shifted left by a slice made contiguous (a copy, but
// for a batch of 1, where the slice already is: nll_loss then saves the
// padded (T + 1) storage), cross-entropy over the flattened logits (no copy
// of them).
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  const at::Tensor upcast = logits.to(at::kFloat);
  auto shift_labels = at::constant_pad_nd(labels, {0, 1}, -100).slice(1, 1).contiguous();  // (B, T)
  return at::cross_entropy_loss(upcast.view({-1, upcast.size(-1)}), shift_labels.view({-1}), std::nullopt,
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
    m.module = Gpt2(gpt2_options(config)).ptr();
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
    auto gpt = std::dynamic_pointer_cast<Gpt2Impl>(model.module);
    m.regions.emplace_back(
        "embed", [gpt](const at::Tensor& tokens) { return gpt->embed(tokens); },
        Modules{gpt->wte.ptr(), gpt->wpe.ptr()});
    for (size_t i = 0; i < gpt->h->size(); ++i) {
      auto block = std::dynamic_pointer_cast<Gpt2BlockImpl>(gpt->h->ptr(i));
      m.regions.emplace_back(
          fmt::format("h.{}", i), [block](const at::Tensor& h) { return block->forward(h); }, Modules{block});
    }
    m.regions.emplace_back("head", [gpt](const at::Tensor& h) { return gpt->head(h); },
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
          return llama->lm_head ? adapted(llama->lm_head, x) : at::linear(x, llama->embed_tokens->weight);
        },
        std::move(head));
  }
  m.input = [batch, seq_len](c10::Device device) {
    return at::zeros({batch, seq_len}, at::TensorOptions().dtype(at::kLong).device(device));
  };
  // causal_lm_loss on the zero tokens of `input` as labels.
  m.loss = [](const at::Tensor& logits) {
    return causal_lm_loss(logits, at::zeros({logits.size(0), logits.size(1)}, logits.options().dtype(at::kLong)));
  };
  return m;
}

} // namespace trainmem
