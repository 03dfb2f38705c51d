#include "trainmem/offload.h"

#include <mutex>
#include <unordered_map>

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "detail/storage_set.h"

// Note [Offload by storage]
// Saved tensors are often views of one buffer (q, k, v of a qkv projection).
// We copy each device storage to the host once, as raw bytes, and describe
// each saved tensor as (storage copy, offset, sizes, strides, dtype). Unpack
// copies a storage back once per backward and rebuilds every view on it with
// set_(), so views keep sharing memory on the device too. Host copies are
// released when the last saved tensor that refers to them is freed.

namespace trainmem::detail {

class OffloadHooks final : public SavedTensorHooks {
 public:
  explicit OffloadHooks(SaveOnCpuOptions options) : options_(options) {}

  void exclude(const at::Tensor& t) {
    excluded_.add(t);
  }

  struct HostStorage {
    at::Tensor bytes;                           // uint8 copy on the host
    c10::Device device = c10::Device(at::kCPU); // where it came from
    c10::weak_intrusive_ptr<c10::StorageImpl> restored{c10::intrusive_ptr<c10::StorageImpl>()};  // device copy
    std::mutex mutex;
  };
  struct Packed {
    at::Tensor kept;                   // set when the tensor stayed in place
    std::shared_ptr<HostStorage> host; // set when it was offloaded
    int64_t offset = 0;
    std::vector<int64_t> sizes, strides;
    at::ScalarType dtype = at::kFloat;
  };

  std::any pack(const at::Tensor& t) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.num_packed;
    const bool keep = !t.has_storage() || excluded_.contains(t) ||
        static_cast<int64_t>(t.storage().nbytes()) < options_.min_offload_bytes() ||
        (t.is_cpu() && !options_.copy_cpu_tensors()) || t.is_meta();
    if (keep) {
      ++stats_.num_kept;
      return Packed{t.tensor_data(), nullptr, 0, {}, {}, t.scalar_type()};
    }
    ++stats_.num_offloaded;
    const auto* key = t.storage().unsafeGetStorageImpl();
    auto it = host_.find(key);
    std::shared_ptr<HostStorage> host = it != host_.end() ? it->second.first.lock() : nullptr;
    if (!host) {
      host = std::make_shared<HostStorage>();
      host->device = t.device();
      const auto nbytes = static_cast<int64_t>(t.storage().nbytes());
      auto src = at::empty({0}, t.options().dtype(at::kByte)).set_(t.storage(), 0, {nbytes}, {1});
      const bool pin = options_.pin_memory() && !t.is_cpu() && at::hasCUDA();
      host->bytes = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(pin));
      host->bytes.copy_(src, /*non_blocking=*/pin);
      // The weak reference pins the StorageImpl's address while it is a key.
      host_.insert_or_assign(key, std::make_pair(std::weak_ptr<HostStorage>(host),
                                                 t.storage().getWeakStorageImpl()));
      stats_.offloaded_bytes += nbytes;
      ++stats_.num_storage_copies;
    }
    return Packed{at::Tensor(), host, t.storage_offset(), t.sizes().vec(), t.strides().vec(),
                  t.scalar_type()};
  }

  at::Tensor unpack(const std::any& packed) override {
    const auto& p = std::any_cast<const Packed&>(packed);
    if (p.kept.defined()) {
      return p.kept;
    }
    c10::Storage storage;
    {
      // One copy back per storage while any view of it is still alive.
      std::lock_guard<std::mutex> lock(p.host->mutex);
      auto alive = p.host->restored.lock();
      if (alive) {
        storage = c10::Storage(std::move(alive));
      } else {
        const bool non_blocking = p.host->bytes.is_pinned();
        storage = p.host->bytes.to(p.host->device, non_blocking, /*copy=*/true).storage();
        p.host->restored = storage.getWeakStorageImpl();
        std::lock_guard<std::mutex> stats_lock(mutex_);
        stats_.restored_bytes += p.host->bytes.numel();
      }
    }
    auto out = at::empty({0}, at::TensorOptions().dtype(p.dtype).device(p.host->device));
    out.set_(storage, p.offset, p.sizes, p.strides);
    return out;
  }

  // What holds a saved tensor's bytes: the tensor left in place, or its
  // storage's host copy (a meter counts it as host bytes).
  at::Tensor packed_tensor(const std::any& packed) const override {
    const auto& p = std::any_cast<const Packed&>(packed);
    return p.kept.defined() ? p.kept : p.host->bytes;
  }

  OffloadStats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

 private:
  SaveOnCpuOptions options_;
  StorageSet excluded_;
  mutable std::mutex mutex_;
  OffloadStats stats_;
  std::unordered_map<const c10::StorageImpl*,
                     std::pair<std::weak_ptr<HostStorage>, c10::weak_intrusive_ptr<c10::StorageImpl>>>
      host_;
};

} // namespace trainmem::detail

namespace trainmem {

SaveOnCpuGuard::SaveOnCpuGuard(SaveOnCpuOptions options) : SaveOnCpuGuard(nullptr, options) {}

SaveOnCpuGuard::SaveOnCpuGuard(const torch::nn::Module& module, SaveOnCpuOptions options)
    : SaveOnCpuGuard(&module, options) {}

SaveOnCpuGuard::SaveOnCpuGuard(const torch::nn::Module* module, SaveOnCpuOptions options) {
  TORCH_CHECK(options.min_offload_bytes() >= 0,
              "SaveOnCpuGuard: expected min_offload_bytes >= 0, but got ", options.min_offload_bytes());
  hooks_ = std::make_shared<detail::OffloadHooks>(options);
  if (module != nullptr) {
    for (const auto& p : module->parameters()) {
      hooks_->exclude(p);
    }
    for (const auto& b : module->buffers()) {
      hooks_->exclude(b);
    }
  }
  guard_ = std::make_unique<SavedTensorHooksGuard>(hooks_);
}

SaveOnCpuGuard::~SaveOnCpuGuard() = default;

OffloadStats SaveOnCpuGuard::stats() const {
  return hooks_->stats();
}

} // namespace trainmem
