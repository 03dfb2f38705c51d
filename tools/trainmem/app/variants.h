#pragma once
/// \file variants.h
/// The command's (and the examples' and tests') runs of the reference model:
/// its four checkpointing variants, one metered step per variant, the
/// optimizer-in-backward peaks, and gradient comparison. App code: built
/// beside the `trainmem` command, not installed and not part of the API.

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainmem/block_checkpointing.h"
#include "trainmem/meter.h"
#include "trainmem/models/transformer.h"

namespace trainmem {

/// The reference step's input (batch, seq_len) = (16, 64): the demo's, the
/// trainer's default, and the examples', tests' and benchmarks' (with
/// TransformerOptions' defaults, an input of (16, 64, 128)).
constexpr int64_t kReferenceBatch = 16;
constexpr int64_t kReferenceSeqLen = 64;

/// The reference transformer's four checkpointing variants, in this order:
/// none, full, every_2 and selective (save matmuls).
std::vector<BlockCheckpointing> reference_variants(int64_t num_layers);

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
/// optimizer stepped in backward, on a (batch, seq_len, d_model) input,
/// after one warm-up step each (so optimizer
/// state exists in both). Needs CpuMemoryTracker::install() first.
struct OptimizerInBackwardPeaks {
  int64_t plain_peak_bytes = 0; ///< zero_grad, forward, backward, step
  int64_t peak_bytes = 0;       ///< forward, backward (steps inside)
  int64_t grad_bytes = 0;       ///< the gradient bucket, for comparison
};
OptimizerInBackwardPeaks measure_optimizer_in_backward(const TransformerOptions& options, int64_t batch,
                                                       int64_t seq_len);

/// Largest absolute elementwise difference between two lists of tensors of
/// the same shapes (throws if the lists differ in length or shapes).
double max_abs_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b);

} // namespace trainmem
