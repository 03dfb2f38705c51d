#pragma once
/// \file meter.h
/// The saved-tensor meter: exactly what autograd keeps alive between forward
/// and backward inside a scope, deduplicated by storage, with parameters
/// excluded by storage, broken down by the autograd node that saved it.
///
/// Example:
/// ```
/// trainmem::SavedTensorMeter meter(*model);          // excludes model params
/// torch::Tensor loss;
/// {
///   trainmem::SavedTensorMeterGuard scope(meter);
///   loss = model->forward(x).pow(2).mean();
/// }
/// auto r = meter.report();
/// std::cout << r.saved_bytes << " B saved for backward\n";
/// for (const auto& n : r.by_node) std::cout << n.node << " " << n.bytes << "\n";
/// loss.backward();                                     // gradients unchanged
/// ```

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainmem/export.h"
#include "trainmem/meta.h"

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace trainmem {

/// Saved bytes attributed to one autograd node type (e.g. `AddmmBackward0`).
struct NodeSavedBytes {
  std::string node;      ///< grad_fn name, or a label such as "CheckpointInputs"
  int64_t bytes = 0;     ///< bytes of storages this node saved first, in bytes
  int64_t num_tensors = 0; ///< tensors (not storages) it saved, params excluded
};

/// What a SavedTensorMeter counted. Plain data.
struct SavedTensorReport {
  /// Bytes of unique non-parameter storages saved, in bytes. A storage saved
  /// several times (q, k, v views of one qkv buffer) counts once, and a saved
  /// view counts its whole storage (what it keeps alive): a micro-batch sliced
  /// from a larger batch counts the larger batch's bytes.
  int64_t saved_bytes = 0;
  /// Of saved_bytes, bytes that stay where autograd saved them (on the
  /// device; on a CPU run that device is host memory).
  int64_t device_bytes = 0;
  /// Of saved_bytes, bytes that the active saved-tensor hooks moved to host
  /// memory (SaveOnCpuGuard, or your own pack returning a CPU copy): they no
  /// longer occupy the device while backward waits.
  int64_t host_bytes = 0;
  /// Tensors autograd saved, parameters and repeats included.
  int64_t num_tensors = 0;
  /// Unique non-parameter storages saved.
  int64_t num_storages = 0;
  /// Bytes of unique parameter storages that were saved and excluded.
  int64_t excluded_param_bytes = 0;
  /// Saved tensors excluded because their storage is a parameter's.
  int64_t num_param_tensors = 0;
  /// Of saved_bytes, leaves that require grad (or views of one) whose
  /// storage is no excluded parameter's: another network's parameters (a
  /// GAN audited with one module), an optimized input (style transfer's
  /// image). They count as saved, as autograd keeps them, but rarely are
  /// what the caller means by activations; Audit warns about them.
  int64_t unowned_leaf_bytes = 0;
  /// Bytes by saving node, largest first; sums to saved_bytes.
  std::vector<NodeSavedBytes> by_node;
  /// predict_saved_activations(): the values its forward read from meta
  /// tensors (`.item()`...), each given a documented value (Note [Scalar
  /// reads inside a prediction]); empty for a meter's own report.
  std::vector<ScalarRead> scalar_reads;
};

namespace detail {
struct MeterState;
struct MeterAccess;
} // namespace detail

/// Counts what autograd saves inside SavedTensorMeterGuard scopes. Several
/// scopes accumulate until reset(). Thread-safe to read from any thread once
/// no scope is active; pack runs on the thread that runs the forward.
///
/// The meter does not see tensors held outside autograd (your caches),
/// temporaries, or allocator overhead: it measures what backward will need,
/// not the peak. Its unpack is the identity: gradients are bit-identical with
/// and without it. It works for CPU, CUDA and meta tensors (storages are keyed
/// by identity, not by data pointer, so meta tensors dedupe too).
class TRAINMEM_API SavedTensorMeter {
 public:
  /// A meter that excludes nothing.
  SavedTensorMeter();
  /// A meter that excludes `module`'s parameters (and its buffers when
  /// `exclude_buffers`) by storage, as they are when the meter is made.
  explicit SavedTensorMeter(
      const torch::nn::Module& module,
      bool exclude_buffers = true);
  ~SavedTensorMeter();

  SavedTensorMeter(const SavedTensorMeter&) = delete;
  SavedTensorMeter& operator=(const SavedTensorMeter&) = delete;

  /// Excludes this tensor's storage from the count (a parameter living
  /// outside any module, a frozen embedding table...).
  void exclude(const at::Tensor& tensor);
  /// Excludes `module`'s parameters (and buffers) as they are now; call again
  /// after moving the module to another device.
  void exclude(const torch::nn::Module& module, bool exclude_buffers = true);

  /// What was counted so far. Throws if a scope on this meter is active.
  SavedTensorReport report() const;
  /// Forgets everything counted (keeps the exclusions). Throws if active.
  void reset();
  /// True while a SavedTensorMeterGuard on this meter is alive.
  bool active() const;

 private:
  friend class SavedTensorMeterGuard;
  friend struct detail::MeterAccess;
  std::shared_ptr<detail::MeterState> state_;
};

/// Meters the tensors autograd saves on this thread while alive. The meter
/// observes and never packs: whatever saved-tensor hooks are active (an
/// outer or inner SaveOnCpuGuard, your own SavedTensorHooksGuard) still
/// pack, and the meter counts what they keep and where (device_bytes vs
/// host_bytes); checkpointed tensors, which are not kept, are not counted.
/// The innermost guard's meter alone counts a save (nested meters count
/// their own scopes). Thread-local, RAII. Only one guard per meter at a time.
/// It may be destroyed on any thread: from another thread than the metered
/// one, the meter stops counting at once and the metered thread drops its
/// bookkeeping lazily.
///
/// Example:
/// ```
/// { trainmem::SavedTensorMeterGuard scope(meter); loss = net->forward(x).sum(); }
/// ```
class TRAINMEM_API SavedTensorMeterGuard {
 public:
  explicit SavedTensorMeterGuard(SavedTensorMeter& meter);
  ~SavedTensorMeterGuard();

  SavedTensorMeterGuard(const SavedTensorMeterGuard&) = delete;
  SavedTensorMeterGuard& operator=(const SavedTensorMeterGuard&) = delete;
  SavedTensorMeterGuard(SavedTensorMeterGuard&&) = delete;
  SavedTensorMeterGuard& operator=(SavedTensorMeterGuard&&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Text table of a report: totals, then bytes by node.
TRAINMEM_API std::string to_string(const SavedTensorReport& report);

} // namespace trainmem
