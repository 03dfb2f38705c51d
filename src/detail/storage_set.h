#pragma once
// A set of storages that sums their bytes once each (never installed).
// Keyed by StorageImpl identity, not data pointer, so meta tensors (null data)
// dedupe too; holds weak references so an address is never reused by another
// storage while it is in the set.
#include <unordered_map>

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>

namespace trainmem::detail {

class StorageSet {
 public:
  // Adds t's storage; returns true if it was new. Storage-less tensors
  // (sparse) count their logical size and are always new.
  bool add(const at::Tensor& t) {
    if (!t.defined()) {
      return false;
    }
    if (!t.has_storage()) {
      bytes_ += t.numel() * static_cast<int64_t>(t.element_size());
      return true;
    }
    const auto& s = t.storage();
    if (!seen_.emplace(s.unsafeGetStorageImpl(), s.getWeakStorageImpl()).second) {
      return false;
    }
    bytes_ += static_cast<int64_t>(s.nbytes());
    return true;
  }
  bool contains(const at::Tensor& t) const {
    return t.defined() && t.has_storage() &&
        seen_.count(t.storage().unsafeGetStorageImpl()) != 0;
  }
  int64_t bytes() const { return bytes_; }
  int64_t size() const { return static_cast<int64_t>(seen_.size()); }
  void clear() {
    seen_.clear();
    bytes_ = 0;
  }

 private:
  std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> seen_;
  int64_t bytes_ = 0;
};

} // namespace trainmem::detail
