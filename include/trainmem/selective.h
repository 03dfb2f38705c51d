#pragma once
/// \file selective.h
/// Selective activation checkpointing (SAC): inside a checkpointed region, a
/// policy decides per ATen op whether its output is saved (cached in forward
/// and replayed, not re-executed, in the recompute) or recomputed, like
/// `torch.utils.checkpoint.create_selective_checkpoint_contexts`.
///
/// Ops are intercepted below autograd (docs/design.md, Note [Selective
/// checkpoint below autograd]), so the policy sees the decomposed ops that
/// kernels run (`aten::mm`, `aten::addmm`,
/// `aten::_scaled_dot_product_flash_attention_for_cpu`, ...), exactly like
/// Python's TorchDispatchMode-based implementation.
///
/// Example:
/// ```
/// auto opts = trainmem::CheckpointOptions().context_fn(
///     trainmem::create_selective_checkpoint_contexts(trainmem::save_matmuls_policy()));
/// auto y = trainmem::checkpoint(block, x, opts);   // matmuls cached, the rest recomputed
/// ```

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "trainmem/export.h"
#include "trainmem/checkpoint.h"

namespace trainmem {

/// What to do with one op's output (PyTorch's names, C++ spelling).
enum class CheckpointPolicy {
  kMustSave,          ///< cache the output; replay it in the recompute
  kPreferSave,        ///< same as kMustSave in eager mode
  kMustRecompute,     ///< execute the op again in the recompute
  kPreferRecompute,   ///< same as kMustRecompute in eager mode
  kMustCpuOffload,    ///< cache the output in host memory, copy it back on replay
  kPreferCpuOffload,  ///< same as kMustCpuOffload in eager mode
};

/// The op a policy is asked about.
struct SelectiveOp {
  std::string name;     ///< "aten::mm"
  std::string overload; ///< "default", "Tensor", "out"...
  c10::ArrayRef<c10::IValue> inputs; ///< the op's arguments
  /// "aten::mm.default", the spelling of PyTorch's `str(op)` with "::".
  std::string full_name() const {
    return name + "." + overload;
  }
};

/// What the policy knows about the call.
struct SelectiveContext {
  bool is_recompute = false; ///< true while backward recomputes the region
};

/// Decides per op. Runs on the thread that runs the region (forward) or its
/// backward (recompute); must not throw.
using SelectivePolicy =
    std::function<CheckpointPolicy(const SelectiveContext&, const SelectiveOp&)>;

/// Counts of one op inside selective regions.
struct SelectiveOpCounts {
  int64_t num_forward = 0;            ///< executions in forward
  int64_t num_cached = 0;             ///< outputs cached in forward
  int64_t num_replayed = 0;           ///< recompute calls served from the cache
  int64_t num_recompute_executed = 0; ///< recompute calls executed again
  int64_t cached_bytes = 0;           ///< bytes of cached outputs (storages)
  /// Cached outputs the cache copied because an in-place op of the region
  /// then wrote their storage (a Linear's bias add_ on its mm, an LSTM
  /// cell's sigmoid_ on its gates): the replay hands back the values as
  /// cached, not as written.
  int64_t num_copied_for_inplace = 0;
};

/// Per-op counts, filled by the regions that share it. Thread-safe.
class TRAINMEM_API SelectiveCheckpointStats {
 public:
  /// Counts of `op` ("aten::mm.default"); zeros if never seen.
  SelectiveOpCounts op(const std::string& full_name) const;
  /// All ops seen, by full name.
  std::map<std::string, SelectiveOpCounts> ops() const;
  /// Every (is_recompute, op full name) the policy was asked, in order.
  std::vector<std::pair<bool, std::string>> policy_calls() const;

 private:
  friend struct SelectiveAccess;
  mutable std::mutex mutex_;
  std::map<std::string, SelectiveOpCounts> ops_;
  std::vector<std::pair<bool, std::string>> policy_calls_;
};

/// The contexts that make a checkpoint selective under `policy`: give the
/// result to CheckpointOptions::context_fn. Each checkpoint call gets its own
/// cache, freed with the region's saved tensors. A cached output modified in
/// place before the recompute is an error. Outputs of view and in-place ops
/// are never cached (they alias their inputs): they always recompute.
TRAINMEM_API ContextFn create_selective_checkpoint_contexts(
    SelectivePolicy policy,
    std::shared_ptr<SelectiveCheckpointStats> stats = nullptr);

/// Saves the outputs of matrix multiplies (aten::mm, addmm, bmm, baddbmm) and
/// recomputes everything else: Megatron-style, the expensive FLOPs are kept.
TRAINMEM_API SelectivePolicy save_matmuls_policy();

/// Saves the outputs of the named ops ("aten::mm" for every overload, or
/// "aten::mm.default" for one) and recomputes the rest.
TRAINMEM_API SelectivePolicy save_ops_policy(std::vector<std::string> op_names);

/// "must_save", "prefer_recompute", ...
TRAINMEM_API std::string to_string(CheckpointPolicy policy);

} // namespace trainmem
