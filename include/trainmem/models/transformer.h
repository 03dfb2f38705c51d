#pragma once
/// \file transformer.h
/// The reference model of the demo, the CLI and the tests: the reference
/// transformer, a stack of pre-LN transformer blocks (LayerNorm -> QKV Linear ->
/// causal scaled-dot-product attention -> projection; LayerNorm ->
/// Linear(d, 4d) -> GELU -> Linear(4d, d); residuals, no dropout).
///
/// Its parameter count is L * (12 d^2 + 13 d): 1,189,632 for the defaults.
///
/// Example:
/// ```
/// trainmem::Transformer model(trainmem::TransformerOptions().num_layers(6));
/// auto x = torch::randn({16, 64, 128});                     // (B, T, d)
/// auto loss = model->forward(x).pow(2).mean();
/// ```

#include <cstdint>
#include <string>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "trainmem/export.h"
#include "trainmem/block_checkpointing.h"
#include "trainmem/checkpoint.h"
#include "trainmem/meter.h"
#include "trainmem/selective.h"

namespace trainmem {

/// Shape of the reference transformer. Defaults: 6 blocks, d_model 128, 4
/// heads. The input's batch B and length T are the caller's: the functions
/// below that count a step's bytes take them.
struct TransformerOptions {
  TORCH_ARG(int64_t, num_layers) = 6; ///< blocks
  TORCH_ARG(int64_t, d_model) = 128;  ///< model width
  TORCH_ARG(int64_t, num_heads) = 4;  ///< attention heads (d_model % heads == 0)
};

/// One pre-LN block. forward: (B, T, d) -> (B, T, d).
class TRAINMEM_API TransformerBlockImpl : public torch::nn::Cloneable<TransformerBlockImpl> {
 public:
  explicit TransformerBlockImpl(int64_t d_model = 128, int64_t num_heads = 4);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);

  int64_t d_model;
  int64_t num_heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(TransformerBlock);

/// The stack of blocks. forward: (B, T, d) -> (B, T, d).
class TRAINMEM_API TransformerImpl : public torch::nn::Cloneable<TransformerImpl> {
 public:
  explicit TransformerImpl(TransformerOptions options = {});
  void reset() override;
  torch::Tensor forward(torch::Tensor x);
  /// forward with the blocks `plan` names checkpointed. Throws if the plan
  /// has a different number of blocks.
  torch::Tensor forward(torch::Tensor x, const BlockCheckpointing& plan);

  TransformerOptions options;
  torch::nn::ModuleList blocks{nullptr};
  /// Block i as its concrete type.
  TransformerBlock block(int64_t i) const;
};
TORCH_MODULE(Transformer);

/// L * (12 d^2 + 13 d): the parameter count of a TransformerOptions.
TRAINMEM_API int64_t transformer_num_params(const TransformerOptions& options);

/// The first-order activation estimate for this block in fp32 with
/// SDPA and no dropout, for an input of `batch` sequences of `seq_len`
/// tokens: 16 saved elements per token and channel, i.e. 64 * T * B * d
/// bytes per layer (Korthikanti et al.'s 34 in fp16 with dropout, less the
/// masks and the attention term, at 4-byte elements).
TRAINMEM_API int64_t predicted_activation_bytes(const TransformerOptions& options, int64_t batch, int64_t seq_len);

/// One term of the exact saved-activation count of the reference transformer.
struct ActivationTerm {
  std::string name; ///< what autograd keeps, e.g. "LayerNorm mean and rstd"
  int64_t bytes = 0; ///< in bytes, over all layers
};

/// The exact bytes autograd saves for one forward of the reference transformer
/// on a (batch, seq_len, d_model) input in fp32 with loss
/// `out.pow(2).mean()`, no checkpointing: the first-order
/// 64 * T * B * d per layer plus every byte the first-order estimate leaves
/// out (LayerNorm's per-token mean and rstd, SDPA's per-row log-sum-exp, and
/// the loss's input).
struct ActivationEstimate {
  std::vector<ActivationTerm> terms;
  int64_t total_bytes = 0; ///< sum of the terms, in bytes
};
TRAINMEM_API ActivationEstimate estimate_activation_bytes(const TransformerOptions& options, int64_t batch,
                                                          int64_t seq_len);

} // namespace trainmem
