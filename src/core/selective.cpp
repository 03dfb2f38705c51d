#include "trainmem/selective.h"

#include <deque>
#include <optional>
#include <unordered_map>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include "detail/attribution.h"
#include "detail/intercept.h"
#include "detail/storage_set.h"

// Note [Selective checkpoint below autograd]
// Python's SAC is a TorchDispatchMode: it sees ops after autograd has recorded
// them, so autograd above still builds every node and saves the same tensors
// in the same order during the recompute, while the mode returns a cached
// output instead of running the kernel. In a Python-less process the one free
// mode-style dispatch key below Autograd/ADInplaceOrView is DispatchKey::Fake
// (no fallback is registered for it in libtorch 2.11-2.13). We register a boxed
// fallback on it once, and include the key in the thread-local dispatch set only
// while a selective region runs, so the rest of the program never pays for it.
// Inside the fallback the key is excluded again while the real kernel runs, so
// ops a kernel calls internally are not intercepted (as a dispatch mode is
// disabled while it handles an op). Cost: one boxed call per op inside
// selective regions; nothing outside them. If a future LibTorch removes or
// claims the key, the build (kInterceptKey) or the registration (a clear
// TORCH_CHECK at first use) fails loudly, never silently. The fallback itself
// is shared with construction on the meta device: detail/intercept.h, Note
// [One interception key].

namespace trainmem {

using detail::kInterceptKey;

struct SelectiveAccess {
  static void count(SelectiveCheckpointStats* s, const std::string& op,
                    void (*f)(SelectiveOpCounts&, int64_t), int64_t bytes = 0) {
    if (s == nullptr) {
      return;
    }
    std::lock_guard<std::mutex> lock(s->mutex_);
    f(s->ops_[op], bytes);
  }
  static void policy_call(SelectiveCheckpointStats* s, bool recompute, const std::string& op) {
    if (s == nullptr) {
      return;
    }
    std::lock_guard<std::mutex> lock(s->mutex_);
    s->policy_calls_.emplace_back(recompute, op);
  }
};

namespace {

struct CachedOutputs {
  std::vector<c10::IValue> values;     // tensors held as tensor_data()
  std::vector<int64_t> versions;       // one per tensor, in order
  std::vector<c10::Device> devices;    // where offloaded tensors go back to
  bool mutated_in_region = false;      // see Note [In-place ops on cached outputs]
  bool replayed = false;               // handed to a recompute (and released)
};

// Note [In-place ops on cached outputs]
// LibTorch 2.13 runs a Linear on a (B, T, d) input as mm -> _unsafe_view ->
// add_(bias): the bias is added in place to the mm output's storage through an
// alias that does not share its version counter, so a version check alone
// cannot see it, and replaying the cached mm output would add the bias twice.
// The forward fallback therefore watches in-place ops inside the region: one
// that writes a cached storage first moves the cached value to a private copy
// (taken before the write). The replay hands the cached value over and drops
// it from the cache, so the recompute's own add_ changes nothing anyone reads
// again. The copy is made once per such op in forward; the memory held is the
// same one tensor.

// One checkpoint call's cache, shared by its forward and recompute contexts.
struct SelectiveCache {
  SelectivePolicy policy;
  std::shared_ptr<SelectiveCheckpointStats> stats;
  std::mutex mutex;
  std::unordered_map<std::string, std::deque<CachedOutputs>> cache;
  std::unordered_map<std::string, size_t> cursor; // per recompute pass
  // Cached storages still shared with tensors of the region: (op, entry).
  std::unordered_multimap<const c10::StorageImpl*, std::pair<std::string, size_t>> by_storage;
};

struct RegionState {
  SelectiveCache* cache;
  bool is_recompute;
};

bool is_save(CheckpointPolicy p) {
  return p == CheckpointPolicy::kMustSave || p == CheckpointPolicy::kPreferSave;
}
bool is_offload(CheckpointPolicy p) {
  return p == CheckpointPolicy::kMustCpuOffload || p == CheckpointPolicy::kPreferCpuOffload;
}

// Views and in-place ops return aliases of their inputs: never cached.
bool aliases_input(const c10::FunctionSchema& schema) {
  if (schema.is_mutable()) {
    return true;
  }
  for (const auto& r : schema.returns()) {
    if (r.alias_info() != nullptr) {
      return true;
    }
  }
  return false;
}

template <typename F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) {
      f(t);
    }
  }
}

// Applies f to every tensor of an op output (a tensor or a tensor list).
template <typename F>
c10::IValue map_tensors(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    return f(v.toTensor());
  }
  if (v.isTensorList()) {
    std::vector<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorVector()) {
      out.push_back(f(t));
    }
    return out;
  }
  return v;
}

// What the cache keeps of an output: an alias, or a host copy when offloading.
c10::IValue hold(const c10::IValue& v, bool offload) {
  return map_tensors(v, [offload](const at::Tensor& t) {
    if (!t.defined()) {
      return t;
    }
    return offload && !t.is_cpu() ? t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true)
                                   : t.tensor_data();
  });
}

// What the recompute gets back: the cached tensor, on its original device.
c10::IValue replay(const c10::IValue& v, const std::vector<c10::Device>& devices, size_t& i) {
  return map_tensors(v, [&](const at::Tensor& t) {
    if (!t.defined()) {
      return t;
    }
    const auto device = devices.at(i++);
    return t.device() != device ? t.to(device) : t.tensor_data();
  });
}

// Note [In-place ops on cached outputs]: before a mutable op writes a cached
// storage, the cache takes a private copy of the value it holds.
void protect_cached_storages(SelectiveCache& c, const c10::FunctionSchema& schema,
                             const torch::jit::Stack& stack, size_t num_args) {
  std::lock_guard<std::mutex> lock(c.mutex);
  if (c.by_storage.empty()) {
    return;
  }
  const size_t base = stack.size() - num_args;
  for (size_t i = 0; i < num_args; ++i) {
    const auto* alias = schema.arguments()[i].alias_info();
    const auto& arg = stack[base + i];
    if (alias == nullptr || !alias->isWrite() || !arg.isTensor() || !arg.toTensor().has_storage()) {
      continue;
    }
    const auto* written = arg.toTensor().storage().unsafeGetStorageImpl();
    auto [first, last] = c.by_storage.equal_range(written);
    for (auto it = first; it != last; ++it) {
      auto& entry = c.cache[it->second.first][it->second.second];
      at::NoGradGuard no_grad;
      c10::impl::ExcludeDispatchKeyGuard no_intercept(kInterceptKey);
      for (auto& v : entry.values) {
        if (v.isTensor()) {
          if (v.toTensor().has_storage() && v.toTensor().storage().unsafeGetStorageImpl() == written) {
            v = v.toTensor().clone();
          }
          continue;
        }
        // A list of views of one storage (an LSTM or GRU cell's unsafe_chunk
        // of its gates, which sigmoid_ and add_ then write): one copy of the
        // storage, and the same views of it, so the replayed chunks keep
        // their strides (a contiguous clone would change how the kernels
        // that read them vectorize, and the gradients' last bits).
        c10::Storage copy;
        v = map_tensors(v, [&](const at::Tensor& t) {
          if (!t.defined() || !t.has_storage() || t.storage().unsafeGetStorageImpl() != written) {
            return t;
          }
          if (!copy) {
            const auto bytes = at::empty({static_cast<int64_t>(t.storage().nbytes())},
                                         t.options().dtype(at::kByte));
            bytes.copy_(at::empty({0}, t.options().dtype(at::kByte))
                            .set_(t.storage(), 0, {static_cast<int64_t>(t.storage().nbytes())}, {1}));
            copy = bytes.storage();
          }
          return at::empty({0}, t.options()).set_(copy, t.storage_offset(), t.sizes(), t.strides());
        });
      }
      entry.mutated_in_region = true;
      entry.versions.assign(entry.versions.size(), 0);
      SelectiveAccess::count(c.stats.get(), it->second.first,
                             [](SelectiveOpCounts& n, int64_t) { ++n.num_copied_for_inplace; });
    }
    c.by_storage.erase(written);
  }
}

// A kept op's outputs, run in the region's forward: held in the cache
// (offloaded when the policy says so) for the recompute to replay.
void cache_outputs(SelectiveCache& c, const std::string& key, CheckpointPolicy policy,
                   const c10::FunctionSchema& schema, torch::jit::Stack* stack) {
  const size_t num_returns = schema.returns().size();
  CachedOutputs entry;
  detail::StorageSet bytes;
  std::vector<const c10::StorageImpl*> storages;
  for (size_t i = stack->size() - num_returns; i < stack->size(); ++i) {
    const auto& out = (*stack)[i];
    for_each_tensor(out, [&](const at::Tensor& t) {
      entry.versions.push_back(t.defined() ? t._version() : 0);
      entry.devices.push_back(t.defined() ? t.device() : c10::Device(at::kCPU));
    });
    entry.values.push_back(hold(out, is_offload(policy)));
    for_each_tensor(entry.values.back(), [&](const at::Tensor& t) {
      bytes.add(t);
      if (t.defined() && t.has_storage()) {
        storages.push_back(t.storage().unsafeGetStorageImpl());
      }
    });
  }
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    auto& queue = c.cache[key];
    for (auto* st : storages) {
      c.by_storage.emplace(st, std::make_pair(key, queue.size()));
    }
    queue.push_back(std::move(entry));
  }
  SelectiveAccess::count(c.stats.get(), key, [](SelectiveOpCounts& n, int64_t b) {
    ++n.num_cached;
    n.cached_bytes += b;
  }, bytes.bytes());
}

// A kept op in the recompute: its outputs are the forward's, from the cache.
void replay_outputs(SelectiveCache& c, const std::string& key, torch::jit::Stack* stack, size_t num_args) {
  CachedOutputs* entry = nullptr;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    auto& queue = c.cache[key];
    auto& pos = c.cursor[key];
    TORCH_CHECK(
        pos < queue.size(),
        "trainmem selective checkpoint: the recompute asked to replay ", key,
        " more often than the forward ran it (", queue.size(),
        " times); the region or the policy is not deterministic");
    entry = &queue[pos++];
    TORCH_CHECK(
        !entry->replayed,
        "trainmem selective checkpoint: the cached output of ", key,
        " was already handed to an earlier recompute; a selectively checkpointed region "
        "supports one backward (like PyTorch's), not backward with retain_graph twice");
  }
  size_t ti = 0;
  for (const auto& v : entry->values) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      const int64_t saved = entry->versions.at(ti++);
      TORCH_CHECK(
          !t.defined() || t.device() != entry->devices.at(ti - 1) || t._version() == saved,
          "Tensor cached during selective activation checkpoint has been mutated (", key,
          " output at version ", t._version(), ", cached at version ", saved,
          "). Do not modify its output in place inside or after the checkpointed region.");
    });
  }
  // The cache entry is released as it is replayed (PyTorch pops it too), so
  // the recompute uses the cached storage itself: no copy, and memory falls
  // as backward walks the region.
  torch::jit::drop(*stack, num_args);
  size_t di = 0;
  for (const auto& v : entry->values) {
    stack->push_back(replay(v, entry->devices, di));
  }
  entry->values.clear();
  entry->replayed = true;
  SelectiveAccess::count(c.stats.get(), key, [](SelectiveOpCounts& n, int64_t) { ++n.num_replayed; });
}

// One op inside a selective region; `scope` runs it further down.
void selective_handle(RegionState* region, const detail::InterceptScope& scope,
                      const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  if (schema.name() == "aten::detach" || schema.name() == "prim::device") {
    scope.call_next(op, ks, stack);
    return;
  }
  SelectiveCache& c = *region->cache;
  SelectiveOp sop;
  sop.name = schema.name();
  sop.overload = schema.overload_name().empty() ? "default" : schema.overload_name();
  const size_t num_args = schema.arguments().size();
  sop.inputs = c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - num_args, num_args);
  const std::string key = sop.full_name();
  SelectiveContext ctx{region->is_recompute};
  SelectiveAccess::policy_call(c.stats.get(), ctx.is_recompute, key);
  CheckpointPolicy policy = CheckpointPolicy::kPreferRecompute;
  try {
    policy = c.policy(ctx, sop);
  } catch (const std::exception& e) {
    TORCH_WARN("trainmem selective checkpoint: the policy threw for ", key, " (", e.what(),
               "); recomputing it");
  }
  const bool keep = (is_save(policy) || is_offload(policy)) && !aliases_input(schema);

  if (!region->is_recompute) {
    if (schema.is_mutable()) {
      protect_cached_storages(c, schema, *stack, num_args);
    }
    scope.call_next(op, ks, stack);
    SelectiveAccess::count(c.stats.get(), key, [](SelectiveOpCounts& n, int64_t) { ++n.num_forward; });
    if (!keep) {
      return;
    }
    cache_outputs(c, key, policy, schema, stack);
    return;
  }

  if (!keep) {
    scope.call_next(op, ks, stack);
    SelectiveAccess::count(c.stats.get(), key,
                           [](SelectiveOpCounts& n, int64_t) { ++n.num_recompute_executed; });
    return;
  }
  replay_outputs(c, key, stack, num_args);
}

class RegionGuard : public detail::InterceptHandler {
 private:
  // What the region's cache holds once its forward is done, for the meters
  // active on this thread (copies made for in-place ops included, the
  // storages they replaced not).
  void report_cache() noexcept {
    try {
      std::lock_guard<std::mutex> lock(state_.cache->mutex);
      for (const auto& [key, queue] : state_.cache->cache) {
        for (const auto& entry : queue) {
          for (const auto& v : entry.values) {
            for_each_tensor(v, [](const at::Tensor& t) {
              detail::record_held_tensor("SelectiveCheckpointCache", t);
            });
          }
        }
      }
    } catch (...) {
    }
  }

 public:
  RegionGuard(SelectiveCache* cache, bool recompute) : state_{cache, recompute} {
    if (recompute) {
      std::lock_guard<std::mutex> lock(cache->mutex);
      cache->cursor.clear();
    }
    scope_.emplace(*this);
  }
  ~RegionGuard() override {
    scope_.reset(); // the region ends before its cache is reported
    if (!state_.is_recompute) {
      report_cache();
    }
  }
  RegionGuard(const RegionGuard&) = delete;
  RegionGuard& operator=(const RegionGuard&) = delete;

  void handle(const detail::InterceptScope& scope, const c10::OperatorHandle& op,
              c10::DispatchKeySet ks, torch::jit::Stack* stack) override {
    selective_handle(&state_, scope, op, ks, stack);
  }

 private:
  RegionState state_;
  std::optional<detail::InterceptScope> scope_;
};

} // namespace

SelectiveOpCounts SelectiveCheckpointStats::op(const std::string& full_name) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = ops_.find(full_name);
  return it == ops_.end() ? SelectiveOpCounts{} : it->second;
}

std::map<std::string, SelectiveOpCounts> SelectiveCheckpointStats::ops() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ops_;
}

std::vector<std::pair<bool, std::string>> SelectiveCheckpointStats::policy_calls() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return policy_calls_;
}

ContextFn create_selective_checkpoint_contexts(
    SelectivePolicy policy,
    std::shared_ptr<SelectiveCheckpointStats> stats) {
  TORCH_CHECK(static_cast<bool>(policy),
              "create_selective_checkpoint_contexts: the policy is empty");
  detail::register_intercept_fallback();
  return [policy = std::move(policy), stats = std::move(stats)]() {
    auto cache = std::make_shared<SelectiveCache>();
    cache->policy = policy;
    cache->stats = stats;
    CheckpointContexts contexts;
    contexts.forward = [cache]() -> ContextToken {
      return std::make_shared<RegionGuard>(cache.get(), false);
    };
    contexts.recompute = [cache]() -> ContextToken {
      return std::make_shared<RegionGuard>(cache.get(), true);
    };
    return contexts;
  };
}

SelectivePolicy save_ops_policy(std::vector<std::string> op_names) {
  return [names = std::move(op_names)](const SelectiveContext&, const SelectiveOp& op) {
    for (const auto& n : names) {
      if (n == op.name || n == op.full_name()) {
        return CheckpointPolicy::kMustSave;
      }
    }
    return CheckpointPolicy::kPreferRecompute;
  };
}

SelectivePolicy save_matmuls_policy() {
  return save_ops_policy({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"});
}

std::string to_string(CheckpointPolicy policy) {
  switch (policy) {
    case CheckpointPolicy::kMustSave: return "must_save";
    case CheckpointPolicy::kPreferSave: return "prefer_save";
    case CheckpointPolicy::kMustRecompute: return "must_recompute";
    case CheckpointPolicy::kPreferRecompute: return "prefer_recompute";
    case CheckpointPolicy::kMustCpuOffload: return "must_cpu_offload";
    case CheckpointPolicy::kPreferCpuOffload: return "prefer_cpu_offload";
  }
  return "unknown";
}

} // namespace trainmem
