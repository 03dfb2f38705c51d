#pragma once
/// \file checkpoint.h
/// Activation checkpointing for LibTorch: keep only a region's inputs in
/// forward and recompute the rest in backward, like
/// `torch.utils.checkpoint.checkpoint` (non-reentrant by default, reentrant on
/// request), plus `checkpoint_sequential` and the sqrt(L) segmentation.
///
/// Example:
/// ```
/// // a residual block, checkpointed: only `x` is kept for backward
/// auto y = trainmem::checkpoint([&](const at::Tensor& x) { return x + block->forward(x); }, x);
/// y.pow(2).mean().backward();   // block's forward runs again here
/// ```

#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include "trainmem/export.h"

namespace trainmem {

/// RAII tokens returned by a CheckpointContexts factory: alive while the
/// region's forward (or recompute) runs.
using ContextToken = std::shared_ptr<void>;

/// A pair of scopes entered around a checkpointed region: one for the
/// original forward, one for the recompute in backward. This is how selective
/// checkpointing plugs in (see selective.h), like PyTorch's `context_fn`.
struct TRAINMEM_API CheckpointContexts {
  std::function<ContextToken()> forward;   ///< entered around the forward
  std::function<ContextToken()> recompute; ///< entered around the recompute
};

/// Makes a fresh pair of contexts for one checkpoint call.
using ContextFn = std::function<CheckpointContexts()>;

/// Options of trainmem::checkpoint, with PyTorch's defaults.
///
/// Example:
/// ```
/// auto opts = trainmem::CheckpointOptions().use_reentrant(true).preserve_rng_state(false);
/// ```
struct CheckpointOptions {
  /// false (default): saved-tensor hooks (works with autograd::grad, inputs
  /// that need no grad, nesting, early stop). true: a custom autograd Function
  /// that reruns the region inside a nested backward.
  TORCH_ARG(bool, use_reentrant) = false;
  /// Restore the CPU and CUDA RNG states of the forward before recomputing, so
  /// recomputed dropout masks match.
  TORCH_ARG(bool, preserve_rng_state) = true;
  /// Compare shape, dtype and device of every recomputed tensor with the
  /// forward's (non-reentrant only).
  TORCH_ARG(bool, determinism_check) = true;
  /// Stop the recompute as soon as every tensor backward needs exists
  /// (non-reentrant only).
  TORCH_ARG(bool, early_stop) = true;
  /// Scopes around forward and recompute, e.g. selective checkpointing's
  /// (non-reentrant only).
  TORCH_ARG(ContextFn, context_fn) = nullptr;
};

/// A region over tensors: inputs in, outputs out.
using CheckpointFunction =
    std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

namespace detail {
TRAINMEM_API std::vector<at::Tensor> checkpoint_impl(
    const CheckpointFunction& fn,
    const std::vector<at::Tensor>& inputs,
    const CheckpointOptions& options);
template <typename T>
constexpr bool kIsModuleHolder = torch::detail::is_module_holder<std::decay_t<T>>::value;
} // namespace detail

/// Runs `fn(inputs)` keeping only `inputs` (and what `fn` saves outside
/// autograd) for backward; `fn` runs again when backward needs its saved
/// tensors. `fn` must be deterministic up to the RNG state and must not
/// depend on state that changes between forward and backward. Gradients
/// equal the plain run's bit for bit when the recompute repeats the same
/// kernels on the same inputs.
template <typename F>
  requires(!detail::kIsModuleHolder<F> &&
           std::is_invocable_r_v<std::vector<at::Tensor>, F&, const std::vector<at::Tensor>&>)
std::vector<at::Tensor> checkpoint(
    F&& fn,
    const std::vector<at::Tensor>& inputs,
    const CheckpointOptions& options = {}) {
  return detail::checkpoint_impl(CheckpointFunction(std::forward<F>(fn)), inputs, options);
}

/// Single-tensor form: `fn(input)`.
template <typename F>
  requires(!detail::kIsModuleHolder<F> && std::is_invocable_r_v<at::Tensor, F&, const at::Tensor&>)
at::Tensor checkpoint(F&& fn, const at::Tensor& input, const CheckpointOptions& options = {}) {
  return detail::checkpoint_impl(
      [f = std::forward<F>(fn)](const std::vector<at::Tensor>& in) mutable {
        return std::vector<at::Tensor>{f(in[0])};
      },
      {input}, options)[0];
}

/// Module form: checkpoints `module->forward(input)` for any module holder
/// (a TORCH_MODULE type) whose forward takes and returns one tensor.
///
/// Example:
/// ```
/// auto y = trainmem::checkpoint(block, x);
/// ```
template <typename ModuleHolder>
  requires(detail::kIsModuleHolder<ModuleHolder>)
at::Tensor checkpoint(
    ModuleHolder module,
    const at::Tensor& input,
    const CheckpointOptions& options = {}) {
  return checkpoint(
      [module](const at::Tensor& x) mutable -> at::Tensor { return module->forward(x); },
      input, options);
}

/// Splits `sequential` into `segments` chunks of consecutive modules and
/// checkpoints all but the last, like `torch.utils.checkpoint.
/// checkpoint_sequential`. Throws if segments is not in [1, size].
TRAINMEM_API at::Tensor checkpoint_sequential(
    const torch::nn::Sequential& sequential,
    int64_t segments,
    const at::Tensor& input,
    const CheckpointOptions& options = {});

/// The segment count that minimizes stored boundaries plus one recomputed
/// segment for `num_layers` layers: round(sqrt(L)), at least 1 (Chen et al.).
TRAINMEM_API int64_t sqrt_segments(int64_t num_layers);

} // namespace trainmem
