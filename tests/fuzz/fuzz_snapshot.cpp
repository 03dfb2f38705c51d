// libFuzzer target: the snapshot reader and its replay on any bytes. A
// hostile, truncated or non-snapshot input must end in c10::Error (the
// command's exit 2), never a crash, a hang or unbounded memory.
#include <cstddef>
#include <cstdint>
#include <string>

#include <c10/util/Exception.h>

#include "trainmem/snapshot.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto snap = trainmem::parse_snapshot(std::string(reinterpret_cast<const char*>(data), size));
    trainmem::replay_snapshot(snap);
    trainmem::what_if_snapshot(snap, {"expandable_segments:True"}, 64LL << 20);
  } catch (const c10::Error&) {
    // a clear error: what the command reports with exit 2
  }
  return 0;
}
