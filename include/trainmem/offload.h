#pragma once
/// \file offload.h
/// Save-on-CPU: the tensors autograd saves inside a scope go to host memory
/// and come back as backward needs them, like
/// `torch.autograd.graph.save_on_cpu`, with three differences a demanding
/// user wants: parameters and tensors already on the CPU are never copied;
/// a storage shared by several saved tensors (q, k, v views of one qkv
/// buffer) crosses the bus once each way; tensors under a size threshold stay
/// where they are.
///
/// On a CPU-only machine every saved tensor is already on the CPU, so the
/// guard saves nothing and copies nothing: it is a no-op, by design.
///
/// Example:
/// ```
/// torch::Tensor loss;
/// {
///   trainmem::SaveOnCpuGuard offload(trainmem::SaveOnCpuOptions().pin_memory(true));
///   loss = model->forward(x_cuda).pow(2).mean();   // activations go to host RAM
/// }
/// loss.backward();                                  // ... and come back here
/// ```

#include <cstdint>
#include <memory>

#include <torch/arg.h>

#include "trainmem/export.h"
#include "trainmem/hooks.h"

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace trainmem {

/// Options of SaveOnCpuGuard.
struct SaveOnCpuOptions {
  /// Pinned host buffers and non_blocking copies (when CUDA is present).
  TORCH_ARG(bool, pin_memory) = false;
  /// Tensors whose storage is smaller stay on the device, in bytes
  /// (torchtune uses 1024).
  TORCH_ARG(int64_t, min_offload_bytes) = 1024;
  /// Copy CPU tensors too (to a separate host buffer). Saves nothing; it
  /// exists so the copy and dedup paths can be exercised without a GPU.
  TORCH_ARG(bool, copy_cpu_tensors) = false;
};

/// Counters of one SaveOnCpuGuard's offload.
struct OffloadStats {
  int64_t num_packed = 0;         ///< tensors autograd saved in the scope
  int64_t num_kept = 0;           ///< left in place (CPU, parameter, small)
  int64_t num_offloaded = 0;      ///< tensors that went to the host
  int64_t offloaded_bytes = 0;    ///< bytes copied to the host (unique storages)
  int64_t num_storage_copies = 0; ///< storages copied to the host
  int64_t restored_bytes = 0;     ///< bytes copied back (unique storages)
};

namespace detail {
class OffloadHooks;
} // namespace detail

/// Offloads saved tensors to host memory while alive. Thread-local and RAII
/// (it is a SavedTensorHooksGuard); the copies come back during backward,
/// after the scope ended.
class TRAINMEM_API SaveOnCpuGuard {
 public:
  explicit SaveOnCpuGuard(SaveOnCpuOptions options = {});
  /// Also never offloads `module`'s parameters and buffers.
  SaveOnCpuGuard(const torch::nn::Module& module, SaveOnCpuOptions options = {});
  ~SaveOnCpuGuard();

  SaveOnCpuGuard(const SaveOnCpuGuard&) = delete;
  SaveOnCpuGuard& operator=(const SaveOnCpuGuard&) = delete;

  /// What was offloaded so far (restored_bytes grows during backward).
  OffloadStats stats() const;

 private:
  SaveOnCpuGuard(const torch::nn::Module* module, SaveOnCpuOptions options);
  std::shared_ptr<detail::OffloadHooks> hooks_;
  std::unique_ptr<SavedTensorHooksGuard> guard_;
};

} // namespace trainmem
