#pragma once
/// \file transformer.h
/// The reference model of the demo, the CLI and the tests: the seed's
/// capstone, a stack of pre-LN transformer blocks (LayerNorm -> QKV Linear ->
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

#include "trainmem/checkpoint.h"
#include "trainmem/meter.h"
#include "trainmem/selective.h"

namespace trainmem {

/// Shape of the reference transformer. Defaults are the seed's capstone.
struct TransformerOptions {
  TORCH_ARG(int64_t, num_layers) = 6; ///< blocks
  TORCH_ARG(int64_t, d_model) = 128;  ///< model width
  TORCH_ARG(int64_t, num_heads) = 4;  ///< attention heads (d_model % heads == 0)
  TORCH_ARG(int64_t, batch) = 16;     ///< B of the demo's input
  TORCH_ARG(int64_t, seq_len) = 64;   ///< T of the demo's input
};

/// Which blocks of a Transformer are checkpointed, and how. The seed's four
/// variants are none(), full(), every(k) and selective(policy).
///
/// Example:
/// ```
/// auto y = model->forward(x, trainmem::BlockCheckpointing::every(6, 2));
/// ```
struct BlockCheckpointing {
  std::vector<bool> blocks;       ///< blocks[i]: checkpoint block i
  CheckpointOptions options;      ///< options of each checkpoint call
  /// Empty (every checkpointed block uses `options`), or one entry per block:
  /// the options of block i's checkpoint call (a selective policy per block).
  std::vector<CheckpointOptions> block_options;
  /// Empty (each checkpointed block is a region of its own), or one entry per
  /// block: region_length[i] = k > 1 checkpoints blocks i .. i + k - 1 as one
  /// region (blocks[i] must be set; the entries of the blocks it covers are
  /// ignored), so only block i's input is kept for all k (Chen et al.).
  std::vector<int64_t> region_length;
  std::string name = "none";      ///< "none", "full", "every_2", "selective"...

  /// The options block i is checkpointed with: block_options[i] when set,
  /// else `options`.
  const CheckpointOptions& options_for(int64_t i) const;
  /// Checkpoints block i selectively under `policy` (its cache holds what the
  /// policy saves; the rest is recomputed), leaving the other blocks as they
  /// are. Throws if i is out of range.
  BlockCheckpointing& set_block_policy(int64_t i, SelectivePolicy policy);

  /// No checkpointing.
  static BlockCheckpointing none(int64_t num_layers);
  /// Every block.
  static BlockCheckpointing full(int64_t num_layers);
  /// Blocks 0, k, 2k, ... (every_2 checkpoints every other block).
  static BlockCheckpointing every(int64_t num_layers, int64_t k);
  /// Every block, selectively: `policy`'s saved op outputs are cached.
  static BlockCheckpointing selective(int64_t num_layers, SelectivePolicy policy);
  /// The given blocks.
  static BlockCheckpointing chosen(int64_t num_layers, const std::vector<int64_t>& which);
  /// checkpoint_sequential's split: `num_segments` runs of L / num_segments
  /// consecutive blocks (the last takes the rest), all but the last
  /// checkpointed as one region each. Throws unless 1 <= num_segments <= L.
  static BlockCheckpointing segments(int64_t num_layers, int64_t num_segments);
  /// segments(L, sqrt_segments(L)): Chen et al.'s sqrt(L) rule.
  static BlockCheckpointing sqrt(int64_t num_layers);
  /// The variant a name gives: "none", "full", "every_<k>" (k >= 1) or
  /// "selective" (save matmuls), the names the other constructors set.
  /// Throws c10::Error naming `name` otherwise.
  static BlockCheckpointing named(int64_t num_layers, const std::string& name);
  /// The seed's four variants, in its order: none, full, every_2 and
  /// selective (save matmuls).
  static std::vector<BlockCheckpointing> seed_variants(int64_t num_layers);
};

/// One pre-LN block. forward: (B, T, d) -> (B, T, d).
class TransformerBlockImpl : public torch::nn::Cloneable<TransformerBlockImpl> {
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
class TransformerImpl : public torch::nn::Cloneable<TransformerImpl> {
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
int64_t transformer_num_params(const TransformerOptions& options);

/// The seed's first-order activation estimate for this block in fp32 with
/// SDPA and no dropout: 16 saved elements per token and channel, i.e.
/// 64 * T * B * d bytes per layer (Korthikanti et al.'s 34 in fp16 with
/// dropout, less the masks and the attention term, at 4-byte elements).
int64_t predicted_activation_bytes(const TransformerOptions& options);

/// One term of the exact saved-activation count of the reference transformer.
struct ActivationTerm {
  std::string name; ///< what autograd keeps, e.g. "LayerNorm mean and rstd"
  int64_t bytes = 0; ///< in bytes, over all layers
};

/// The exact bytes autograd saves for one forward of the reference transformer
/// in fp32 with loss `out.pow(2).mean()`, no checkpointing: the seed's
/// 64 * T * B * d per layer plus every byte the first-order estimate leaves
/// out (LayerNorm's per-token mean and rstd, SDPA's per-row log-sum-exp, and
/// the loss's input).
struct ActivationEstimate {
  std::vector<ActivationTerm> terms;
  int64_t total_bytes = 0; ///< sum of the terms, in bytes
};
ActivationEstimate estimate_activation_bytes(const TransformerOptions& options);

/// One metered training step of the reference model: forward under `plan`
/// inside a SavedTensorMeter scope, loss `out.pow(2).mean()`, backward.
struct VariantRun {
  std::string name;              ///< the plan's name
  SavedTensorReport saved;       ///< what autograd (and SAC's cache) kept
  std::vector<at::Tensor> grads; ///< parameter gradients, in parameters() order
  /// CPU peak live bytes of the step (forward and backward), from the
  /// CpuMemoryTracker; -1 when the tracker is not installed.
  int64_t peak_bytes = -1;
  /// peak_bytes less the live bytes when the step started: what the step
  /// itself added, in bytes (peak_bytes also counts whatever else is alive,
  /// e.g. the gradient clones of earlier VariantRuns); -1 without the tracker.
  int64_t peak_above_start_bytes = -1;
};

/// Runs one metered step of `model` on `x` under `plan`. Gradients are
/// cleared before and after, so runs can be compared.
VariantRun run_variant(Transformer& model, const at::Tensor& x, const BlockCheckpointing& plan);

/// CPU peaks of the reference model's AdamW training step, plain and with the
/// optimizer stepped in backward, after one warm-up step each (so optimizer
/// state exists in both). Needs CpuMemoryTracker::install() first.
struct OptimizerInBackwardPeaks {
  int64_t plain_peak_bytes = 0; ///< zero_grad, forward, backward, step
  int64_t peak_bytes = 0;       ///< forward, backward (steps inside)
  int64_t grad_bytes = 0;       ///< the gradient bucket, for comparison
};
OptimizerInBackwardPeaks measure_optimizer_in_backward(const TransformerOptions& options);

/// Largest absolute elementwise difference between two lists of tensors of
/// the same shapes (throws if the lists differ in length or shapes).
double max_abs_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b);

} // namespace trainmem
