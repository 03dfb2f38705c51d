#pragma once
// A small, stable, human-readable id for the calling thread (1, 2, 3, ...),
// used in messages and to tell which thread created a guard.
#include <atomic>
#include <cstdint>

namespace trainmem::detail {

inline uint64_t this_thread_id() {
  static std::atomic<uint64_t> next{1};
  thread_local const uint64_t id = next.fetch_add(1);
  return id;
}

} // namespace trainmem::detail
