// libFuzzer target: the config.json reader (`trainmem estimate --model`).
// Any bytes end in a config or a c10::Error naming the problem (exit 2),
// never a crash: a config nested 100,000 deep overflowed the JSON parser's
// stack before the bounded reader (detail::parse_bounded_json).
#include <cstddef>
#include <cstdint>
#include <string>

#include <c10/util/Exception.h>

#include "trainmem/models/hf_model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto config = trainmem::parse_hf_config(std::string(reinterpret_cast<const char*>(data), size), "fuzz.json");
    trainmem::hf_num_params(config);
  } catch (const c10::Error&) {
    // a clear error: what the command reports with exit 2
  }
  return 0;
}
