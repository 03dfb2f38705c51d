#pragma once
/// \file hf_model.h
/// Real architectures from a Hugging Face style `config.json` (a local file;
/// nothing is downloaded), each computed op for op as Hugging Face
/// transformers 5.24.0 computes it (kHfTransformersVersion; CPU, fp32,
/// attn_implementation "sdpa", dropout 0, a training forward with labels):
/// the same parameters, and the same tensors saved for backward. GPT-2
/// (`model_type` "gpt2": GPT2LMHeadModel, Conv1D as addmm, gelu_new, its
/// attention path) and the LLaMA family: "llama" (RMSNorm, rotary position
/// embeddings, grouped-query attention through SDPA, SwiGLU MLP), "mistral"
/// (LLaMA with a sliding window), "qwen2" (q, k, v biases) and "qwen3"
/// (per-head q and k RMSNorm). Build them on the meta device (meta.h's
/// MetaInitGuard) to count and plan them with no allocation, or on CPU to
/// train them.
///
/// Example:
/// ```
/// auto config = trainmem::load_hf_config("llama-2-7b/config.json");
/// trainmem::HfModel model;
/// {
///   trainmem::MetaInitGuard meta;                 // nothing allocated
///   model = trainmem::build_hf_model(config);
/// }
/// trainmem::account(*model.module).num_params;   // 6,738,415,616
/// auto tokens = at::empty({1, 4096}, at::TensorOptions().dtype(at::kLong).device(at::kMeta));
/// auto loss = model.loss(tokens);                // next-token cross-entropy, on meta
/// ```

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "trainmem/export.h"
#include "trainmem/models/gpt.h"
#include "trainmem/meta.h"
#include "trainmem/planner.h"
#include "trainmem/models/transformer.h"

namespace trainmem {

/// The transformers release whose modeling code these models follow op for
/// op ("5.24.0"); tests/hf_saved_bytes.py measures it.
inline constexpr const char* kHfTransformersVersion = "5.24.0";

/// The architectures a config can name.
enum class HfArchitecture {
  kGPT2,    ///< `model_type` "gpt2" (GPT2LMHeadModel)
  kLlama,   ///< `model_type` "llama" (LlamaForCausalLM: LLaMA 1/2/3, TinyLlama, ...)
  kMistral, ///< `model_type` "mistral" (MistralForCausalLM: LLaMA with `sliding_window`)
  kQwen2,   ///< `model_type` "qwen2" (Qwen2ForCausalLM: LLaMA with q, k, v biases)
  kQwen3,   ///< `model_type` "qwen3" (Qwen3ForCausalLM: LLaMA with per-head q, k RMSNorm)
};

/// "gpt2", "llama", "mistral", "qwen2", "qwen3".
TRAINMEM_API std::string to_string(HfArchitecture architecture);

/// transformers' class of the architecture: "GPT2LMHeadModel",
/// "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
/// "Qwen3ForCausalLM".
TRAINMEM_API std::string hf_class_name(HfArchitecture architecture);

/// What a config.json says about the model's shape, with Hugging Face's
/// defaults for the optional keys. Plain data.
struct HfConfig {
  HfArchitecture architecture = HfArchitecture::kGPT2;
  std::string source;                ///< where it was read from (for messages)
  int64_t vocab_size = 0;            ///< `vocab_size`
  int64_t hidden_size = 0;           ///< `n_embd` / `hidden_size`
  int64_t num_layers = 0;            ///< `n_layer` / `num_hidden_layers`
  int64_t num_heads = 0;             ///< `n_head` / `num_attention_heads`
  int64_t num_kv_heads = 0;          ///< `num_key_value_heads` (default: num_heads); GPT-2: num_heads
  int64_t head_dim = 0;              ///< `head_dim` (default: hidden_size / num_heads)
  int64_t intermediate_size = 0;     ///< `intermediate_size`; GPT-2: 4 n_embd (`n_inner` null)
  int64_t max_positions = 0;         ///< `n_positions` / `max_position_embeddings` (default 2048)
  double norm_eps = 1e-5;            ///< `layer_norm_epsilon` / `rms_norm_eps` (default 1e-6)
  double rope_theta = 10000.0;       ///< `rope_theta` (LLaMA; default 10000)
  bool tie_word_embeddings = true;   ///< `tie_word_embeddings` (GPT-2: true; LLaMA default false)
  bool attention_bias = false;       ///< `attention_bias` (LLaMA, Qwen3: q, k, v and o projections)
  bool mlp_bias = false;             ///< `mlp_bias` (LLaMA: gate, up and down projections)
  bool qkv_bias = false;             ///< Qwen2: q, k and v projections biased, o not (always)
  bool qk_norm = false;              ///< Qwen3: RMSNorm over each head of q and k (always)
  int64_t sliding_window = 0;        ///< Mistral `sliding_window` (default 4096; null: 0, none)
  bool use_cache = true;             ///< `use_cache` (default true: the forward fills a DynamicCache,
                                     ///< whose torch.cat copies of k and v attention then reads)
  std::string activation = "silu";   ///< GPT-2 `activation_function` (default "gelu_new": also
                                     ///< "gelu", "gelu_pytorch_tanh", "relu"); LLaMA `hidden_act` ("silu")
};

/// Parses a config.json's text. `source` names it in messages. Throws
/// c10::Error naming the key and its value for a missing or ill-typed key
/// ("config.json: \"n_head\" must be a positive integer, but got \"twelve\""),
/// an unknown architecture (the `model_type` or `architectures` value), a
/// hidden size not divisible by the heads, or heads not divisible by the
/// key-value heads. Required: GPT-2 `n_layer`, `n_embd`, `n_head`,
/// `vocab_size`, `n_positions`; LLaMA `hidden_size`, `intermediate_size`,
/// `num_hidden_layers`, `num_attention_heads`, `vocab_size`. Other keys
/// are optional with Hugging Face's defaults; keys this model does not
/// change the shape for (dropout, initializer_range, torch_dtype...) are
/// ignored.
TRAINMEM_API HfConfig parse_hf_config(const std::string& json_text, const std::string& source = "config.json");

/// Reads and parses the config.json at `path`. Throws if it cannot be read
/// (naming the path) or as parse_hf_config().
TRAINMEM_API HfConfig load_hf_config(const std::string& path);

/// The parameter count by formula (unique elements; a tied head counts once).
/// GPT-2: V d + C d + L (4 d^2 + 2 d I + 9 d + I) + 2 d (I = 4 d: L (12 d^2
/// + 13 d)). LLaMA: V d [embedding] + L (d
/// (H + 2 KV) hd + H hd d [attention] + 3 d I [SwiGLU] + 2 d [norms] + biases)
/// + d [final norm] + V d [head, unless tied]: 6,738,415,616 for LLaMA-2-7B;
/// Qwen2 adds (H + 2 KV) hd q, k, v biases per layer, Qwen3 2 hd q, k norms.
TRAINMEM_API int64_t hf_num_params(const HfConfig& config);

/// Shape of a LLaMA-family model (see HfConfig for the keys).
struct LlamaOptions {
  TORCH_ARG(int64_t, vocab_size) = 32000;
  TORCH_ARG(int64_t, hidden_size) = 4096;
  TORCH_ARG(int64_t, intermediate_size) = 11008;
  TORCH_ARG(int64_t, num_layers) = 32;
  TORCH_ARG(int64_t, num_heads) = 32;
  TORCH_ARG(int64_t, num_kv_heads) = 32;
  TORCH_ARG(int64_t, head_dim) = 128;
  TORCH_ARG(int64_t, max_positions) = 4096;
  TORCH_ARG(double, rms_norm_eps) = 1e-5;
  TORCH_ARG(double, rope_theta) = 10000.0;
  TORCH_ARG(bool, tie_word_embeddings) = false;
  TORCH_ARG(bool, attention_bias) = false;
  TORCH_ARG(bool, mlp_bias) = false;
  TORCH_ARG(bool, qkv_bias) = false;       ///< Qwen2: q, k, v biased, o not
  TORCH_ARG(bool, qk_norm) = false;        ///< Qwen3: q_norm, k_norm over head_dim
  TORCH_ARG(int64_t, sliding_window) = 0;  ///< Mistral; 0: none
  TORCH_ARG(bool, use_cache) = true;       ///< k, v copied as DynamicCache::update does
};

/// Shape of a GPT-2 (GPT2LMHeadModel). Defaults are GPT-2 small.
struct Gpt2Options {
  TORCH_ARG(int64_t, vocab_size) = 50257;
  TORCH_ARG(int64_t, max_positions) = 1024;
  TORCH_ARG(int64_t, hidden_size) = 768;
  TORCH_ARG(int64_t, num_layers) = 12;
  TORCH_ARG(int64_t, num_heads) = 12;
  TORCH_ARG(int64_t, intermediate_size) = 3072;  ///< `n_inner` (default 4 d)
  TORCH_ARG(double, layer_norm_eps) = 1e-5;
  TORCH_ARG(std::string, activation) = "gelu_new";
  TORCH_ARG(bool, use_cache) = true;             ///< k, v copied as DynamicCache::update does
};

/// transformers' Conv1D: a linear layer with its weight transposed, (nx, nf),
/// and a bias (nf), computed as addmm(bias, x.view(-1, nx), weight).
/// forward: (..., nx) -> (..., nf).
class TRAINMEM_API Conv1DImpl : public torch::nn::Cloneable<Conv1DImpl>, public Reinitializable {
 public:
  explicit Conv1DImpl(int64_t nf = 1, int64_t nx = 1);
  void reset() override;
  /// The weight to N(0, 0.02), the bias to zeros.
  void reset_parameters() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t nf, nx;
  at::Tensor weight; ///< (nx, nf)
  at::Tensor bias;   ///< (nf)
};
TORCH_MODULE(Conv1D);

/// GPT2Attention: c_attn (d -> 3 d), split into q, k, v heads, causal SDPA
/// (scale hd^-1/2), c_proj. forward: (B, T, d) -> (B, T, d).
class TRAINMEM_API Gpt2AttentionImpl : public torch::nn::Cloneable<Gpt2AttentionImpl> {
 public:
  explicit Gpt2AttentionImpl(Gpt2Options options = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  Gpt2Options options;
  Conv1D c_attn{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(Gpt2Attention);

/// GPT2MLP: c_fc (d -> I), the activation, c_proj (I -> d).
class TRAINMEM_API Gpt2MLPImpl : public torch::nn::Cloneable<Gpt2MLPImpl> {
 public:
  explicit Gpt2MLPImpl(Gpt2Options options = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  Gpt2Options options;
  Conv1D c_fc{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(Gpt2MLP);

/// GPT2Block: x + attn(ln_1(x)), then h + mlp(ln_2(h)). forward: (B, T, d)
/// -> (B, T, d).
class TRAINMEM_API Gpt2BlockImpl : public torch::nn::Cloneable<Gpt2BlockImpl> {
 public:
  explicit Gpt2BlockImpl(Gpt2Options options = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  Gpt2Options options;
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  Gpt2Attention attn{nullptr};
  Gpt2MLP mlp{nullptr};
};
TORCH_MODULE(Gpt2Block);

/// GPT2LMHeadModel: token and position embeddings, L blocks, ln_f, an LM
/// head tied to wte. Parameter names are transformers' without its
/// "transformer." prefix. forward: tokens (B, T) int64, T <= max_positions
/// -> logits (B, T, V).
class TRAINMEM_API Gpt2Impl : public torch::nn::Cloneable<Gpt2Impl>, public Reinitializable {
 public:
  explicit Gpt2Impl(Gpt2Options options = {});
  void reset() override;
  /// The embeddings to N(0, 0.02) (transformers' initializer_range).
  void reset_parameters() override;
  at::Tensor forward(const at::Tensor& tokens);
  /// forward with the blocks `plan` names checkpointed.
  at::Tensor forward(const at::Tensor& tokens, const BlockCheckpointing& plan);
  /// wte(tokens) + wpe(positions (1, T)).
  at::Tensor embed(const at::Tensor& tokens);
  /// ln_f, then the tied head.
  at::Tensor head(const at::Tensor& h);
  Gpt2Options options;
  torch::nn::Embedding wte{nullptr}; ///< (V, d), also the LM head
  torch::nn::Embedding wpe{nullptr}; ///< (C, d)
  torch::nn::ModuleList h{nullptr};  ///< L Gpt2Blocks
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  at::Tensor run(const at::Tensor& tokens, const BlockCheckpointing* plan);
};
TORCH_MODULE(Gpt2);

/// Root-mean-square LayerNorm as Hugging Face's LlamaRMSNorm computes it:
/// w * x * rsqrt(mean(x^2, -1) + eps) (the statistics in fp32). forward:
/// (..., d) -> (..., d).
class TRAINMEM_API RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl>, public Reinitializable {
 public:
  explicit RMSNormImpl(int64_t dim = 1, double eps = 1e-6);
  void reset() override;
  /// The weight to ones.
  void reset_parameters() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t dim;
  double eps;
  at::Tensor weight; ///< (d)
};
TORCH_MODULE(RMSNorm);

/// One LLaMA-family decoder block: x + o(attn(rope(q), rope(k), v)) over
/// RMSNorm(x), then h + down(silu(gate(.)) * up(.)) over RMSNorm(h) (Qwen3:
/// q and k RMSNormed per head before rope). Attention is causal SDPA as
/// transformers' sdpa_attention_forward calls it: grouped-query heads go to
/// SDPA as they are (enable_gqa) where its use_gqa_in_sdpa allows (no mask,
/// head_dim <= 256, on CPU and CUDA), else they are repeated to the query
/// heads first (repeat_kv's copy). A sliding window (Mistral) takes a mask
/// once the sequence reaches it (T >= window): then no enable_gqa and
/// no is_causal. forward: x (B, T, d), cos and sin (T, head_dim) -> (B, T, d).
class TRAINMEM_API LlamaBlockImpl : public torch::nn::Cloneable<LlamaBlockImpl> {
 public:
  explicit LlamaBlockImpl(LlamaOptions options = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  LlamaOptions options;
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  ///< Qwen3 only (over head_dim)
};
TORCH_MODULE(LlamaBlock);

/// A LLaMA causal LM: embedding, L blocks, final RMSNorm, LM head (tied to
/// the embedding when `tie_word_embeddings`). forward: tokens (B, T) int64,
/// T <= max_positions -> logits (B, T, V).
class TRAINMEM_API LlamaImpl : public torch::nn::Cloneable<LlamaImpl>, public Reinitializable {
 public:
  explicit LlamaImpl(LlamaOptions options = {});
  void reset() override;
  /// The embedding to N(0, 0.02) (Hugging Face's initializer_range).
  void reset_parameters() override;
  at::Tensor forward(const at::Tensor& tokens);
  /// forward with the blocks `plan` names checkpointed (as Transformer::forward).
  at::Tensor forward(const at::Tensor& tokens, const BlockCheckpointing& plan);
  /// Rotary cos and sin for positions 0 .. T-1, (T, head_dim) each, made in
  /// fp32 and returned in `options`' dtype.
  std::pair<at::Tensor, at::Tensor> rotary(int64_t T, const at::TensorOptions& options) const;
  LlamaOptions options;
  torch::nn::Embedding embed_tokens{nullptr}; ///< (V, d)
  torch::nn::ModuleList layers{nullptr};      ///< L LlamaBlocks
  RMSNorm norm{nullptr};                      ///< final norm over d
  torch::nn::Linear lm_head{nullptr};         ///< (V, d), none when tied

 private:
  at::Tensor run(const at::Tensor& tokens, const BlockCheckpointing* plan);
  at::Tensor run_blocks(at::Tensor h, const at::Tensor& tokens, const BlockCheckpointing* plan);
};
TORCH_MODULE(Llama);

/// The LlamaOptions of a LLaMA-family config (llama, mistral, qwen2, qwen3).
/// Throws if `config` is GPT-2.
TRAINMEM_API LlamaOptions llama_options(const HfConfig& config);
/// The Gpt2Options of a GPT-2 config. Throws if `config` is not one.
TRAINMEM_API Gpt2Options gpt2_options(const HfConfig& config);
/// The GPTOptions (gpt.h) of a GPT-2 config's shape, for trainmem's own GPT
/// (build_hf_model does not use it: its MLP and attention save less
/// than transformers' GPT-2). Throws if `config` is not GPT-2 or its MLP is
/// not 4 d.
TRAINMEM_API GPTOptions gpt_options(const HfConfig& config);

/// A causal LM built from a config: the module (Gpt2Impl or LlamaImpl) and
/// its forward and loss.
struct TRAINMEM_API HfModel {
  HfConfig config;
  std::shared_ptr<torch::nn::Module> module;
  /// Logits (B, T, V) of tokens (B, T) int64.
  at::Tensor forward(const at::Tensor& tokens) const;
  /// Logits with the blocks `plan` names checkpointed.
  at::Tensor forward(const at::Tensor& tokens, const BlockCheckpointing& plan) const;
  /// Next-token cross-entropy of `tokens`, as Hugging Face's causal-LM loss
  /// computes it: labels are the tokens shifted left, the last position
  /// ignored (-100); the logits are not copied. A scalar.
  at::Tensor loss(const at::Tensor& tokens) const;
  /// The same loss with the blocks `plan` names checkpointed.
  at::Tensor loss(const at::Tensor& tokens, const BlockCheckpointing& plan) const;
};

/// Builds the model `config` describes on the current device: under a
/// MetaInitGuard on meta (nothing allocated), else on CPU and initialized.
/// Calls enable_cpu_meta_kernels() (planner.h) first, so a forward on meta
/// saves what the CPU's would (flash attention, LayerNorm layouts).
///
/// Example:
/// ```
/// auto model = trainmem::build_hf_model(trainmem::load_hf_config("tiny_llama.json"));
/// model.loss(torch::randint(256, {4, 32})).backward();
/// ```
TRAINMEM_API HfModel build_hf_model(const HfConfig& config);

/// `model`'s training step as plan_regions() sees it: the embedding (GPT-2:
/// token + position), one region per block ("h.i": Gpt2Block; "layers.i":
/// LlamaBlock), and the final norm with the LM head; the input is `batch` x
/// `seq_len` tokens (zeros), the loss is the causal-LM cross-entropy of
/// HfModel::loss (labels of the same shape, the last position ignored). A LLaMA block's region makes its own rotary cos
/// and sin ((T, head_dim) each, which its backward keeps), where
/// LlamaImpl::forward shares one pair: the plan counts what run_regions()
/// runs. No optimizer is set (add one, or `make_optimizer`). Throws if
/// `seq_len` exceeds the model's positions or `batch` < 1.
///
/// Example:
/// ```
/// auto model = trainmem::build_hf_model(trainmem::load_hf_config("tiny_llama.json"));
/// auto m = trainmem::hf_region_model(model, 4, 32);
/// m.make_optimizer = [](std::vector<at::Tensor> p) { return std::make_unique<torch::optim::AdamW>(p); };
/// auto plan = trainmem::plan_regions(m, trainmem::PlanOptions().budget_bytes(8 << 20));
/// ```
TRAINMEM_API RegionModel hf_region_model(const HfModel& model, int64_t batch, int64_t seq_len);

} // namespace trainmem
