#pragma once
// torch::Library registrations that live as long as the process.
#include <memory>
#include <mutex>
#include <string>
#include <utility>
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

// Registers `fallback` for every op on `key` for the rest of the process.
// Returns "" when registered, else LibTorch's error (another library
// registered a fallback on the key first). Call once per key (under the
// caller's std::once_flag).
inline std::string register_fallback_for_process(c10::DispatchKey key, torch::CppFunction fallback) {
  try {
    keep_for_process(std::make_unique<torch::Library>(torch::Library::IMPL, "_", key, __FILE__, __LINE__))
        .fallback(std::move(fallback));
    return {};
  } catch (const std::exception& e) {
    return e.what();
  }
}

} // namespace trainmem::detail
