// A Hugging Face config.json read for a model's shape (Note [Models from
// config files]): parse_hf_config(), load_hf_config(), the parameter count,
// and the option sets of the modules built from it.
#include "trainmem/models/hf_model.h"

#include <fstream>
#include <sstream>
#include <string>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "detail/bounded_json.h"

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

} // namespace trainmem
