// replay(): a trace of allocations and frees run through a
// CudaCachingAllocatorModel, its peaks and fragmentation
// (cuda_allocator_model.h).
#include "trainmem/cuda_allocator_model.h"

#include <unordered_map>

namespace trainmem {

CudaReplay replay(const std::vector<AllocationEvent>& events, CudaCachingAllocatorModel& model) {
  model.reset_peak();
  CudaReplay r;
  r.peak_allocated_bytes = model.stats().allocated_bytes;
  r.peak_reserved_bytes = model.stats().reserved_bytes;
  r.slack_at_peak_reserved_bytes = model.stats().reserved_bytes - model.stats().allocated_bytes;
  std::unordered_map<uint64_t, uint64_t> address_of;  // trace id -> model address
  for (size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    if (e.bytes > 0) {
      const uint64_t a = model.malloc(e.bytes, e.stream);
      if (a != 0) {
        address_of[e.id] = a;
      }
    } else if (e.bytes < 0) {
      auto it = address_of.find(e.id);
      if (it == address_of.end()) {
        continue;
      }
      model.free(it->second);
      address_of.erase(it);
    }
    const auto s = model.stats();
    if (s.allocated_bytes > r.peak_allocated_bytes) {
      r.peak_allocated_bytes = s.allocated_bytes;
      r.peak_event = static_cast<int64_t>(i);
    }
    if (s.reserved_bytes > r.peak_reserved_bytes) {
      r.peak_reserved_bytes = s.reserved_bytes;
      r.slack_at_peak_reserved_bytes = s.reserved_bytes - s.allocated_bytes;
    }
  }
  r.stats = model.stats();
  r.fragmentation = r.peak_reserved_bytes > 0
      ? 1.0 - static_cast<double>(r.peak_allocated_bytes) / static_cast<double>(r.peak_reserved_bytes)
      : 0.0;
  return r;
}

} // namespace trainmem
