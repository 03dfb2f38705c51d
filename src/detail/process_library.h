#pragma once
// torch::Library registrations that live as long as the process.
#include <memory>
#include <mutex>
#include <vector>

#include <torch/library.h>

namespace trainmem::detail {

// Takes `library` for the rest of the process: never destroyed (destroying a
// torch::Library at exit deregisters its kernels while the dispatcher may
// already be gone), and reachable from a global, so LeakSanitizer does not
// report it. Call once per registration (under the caller's std::once_flag).
inline torch::Library& keep_for_process(std::unique_ptr<torch::Library> library) {
  static std::mutex mutex;
  static auto* kept = new std::vector<std::unique_ptr<torch::Library>>();
  std::lock_guard<std::mutex> lock(mutex);
  kept->push_back(std::move(library));
  return *kept->back();
}

} // namespace trainmem::detail
