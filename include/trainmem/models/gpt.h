#pragma once
/// \file gpt.h
/// A GPT-2-style language model built from the reference transformer's
/// blocks: token and position embeddings, L pre-LN blocks (transformer.h),
/// a final LayerNorm, and an LM head tied to the token embedding (no
/// parameters of its own). Its parameter count is
/// V d + C d + L (12 d^2 + 13 d) + 2 d: 124,439,808 for GPT-2 small.
///
/// Build big ones on the meta device (meta.h) to plan them without data.
///
/// Example:
/// ```
/// trainmem::GPT model(trainmem::GPTOptions::gpt2_small());
/// auto tokens = torch::randint(50257, {4, 128});          // (B, T) int64
/// auto logits = model->forward(tokens);                   // (B, T, V)
/// auto loss = torch::cross_entropy_loss(logits.flatten(0, 1), tokens.flatten());
/// ```

#include <cstdint>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "trainmem/export.h"
#include "trainmem/meta.h"
#include "trainmem/models/transformer.h"

namespace trainmem {

/// Shape of a GPT. Defaults are GPT-2 small (124 M).
struct TRAINMEM_API GPTOptions {
  /// GPT-2 small: V 50257, C 1024, d 768, L 12, 12 heads; 124,439,808 params.
  static GPTOptions gpt2_small();
  /// GPT-3 6.7B's shape (Brown et al. 2020, table 2.1): V 50257, C 2048,
  /// d 4096, L 32, 32 heads; 6,658,404,352 params in these blocks.
  static GPTOptions gpt3_6_7b();
  /// Exactly 7,000,000,000 parameters, for the "7 B = 112 GB" figure: V 52758,
  /// C 4096, d 4480, L 28, 35 heads (head dim 128). Not a published model.
  static GPTOptions exact_7b();
  /// LLaMA-2-70B's width and depth (d 8192, L 80, 64 heads, V 32000, C 4096)
  /// in these blocks (GELU MLP of 4 d, full multi-head attention, tied head):
  /// 64,728,743,936 params, not LLaMA-2-70B's 69 B (SwiGLU MLP of 28672, GQA).
  static GPTOptions llama2_70b_shape();

  TORCH_ARG(int64_t, vocab_size) = 50257;    ///< V, tokens
  TORCH_ARG(int64_t, context_length) = 1024; ///< C, positions
  TORCH_ARG(int64_t, d_model) = 768;         ///< d, model width
  TORCH_ARG(int64_t, num_layers) = 12;       ///< L, blocks
  TORCH_ARG(int64_t, num_heads) = 12;        ///< heads (divides d_model)
};

/// V d + C d + L (12 d^2 + 13 d) + 2 d: the parameter count of a GPTOptions.
TRAINMEM_API int64_t gpt_num_params(const GPTOptions& options);

/// The model. forward: tokens (B, T) int64 with T <= context_length ->
/// logits (B, T, V) in the embedding's dtype.
class TRAINMEM_API GPTImpl : public torch::nn::Cloneable<GPTImpl>, public Reinitializable {
 public:
  explicit GPTImpl(GPTOptions options = {});
  /// Builds the submodules and initializes them (reset_parameters()).
  void reset() override;
  /// GPT-2's embedding init: token and position embeddings N(0, 0.02); the
  /// blocks and the final LayerNorm keep their own modules' init.
  void reset_parameters() override;
  /// Logits of `tokens`.
  torch::Tensor forward(const torch::Tensor& tokens);
  /// Logits with the blocks that `plan` names checkpointed.
  torch::Tensor forward(const torch::Tensor& tokens, const BlockCheckpointing& plan);

  GPTOptions options;
  torch::nn::Embedding wte{nullptr}; ///< (V, d) token embedding, also the LM head
  torch::nn::Embedding wpe{nullptr}; ///< (C, d) position embedding
  Transformer transformer{nullptr};  ///< the L blocks
  torch::nn::LayerNorm ln_f{nullptr}; ///< final LayerNorm over d

 private:
  torch::Tensor embed(const torch::Tensor& tokens);
  torch::Tensor head(const torch::Tensor& h);
};
TORCH_MODULE(GPT);

} // namespace trainmem
