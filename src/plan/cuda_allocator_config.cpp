// CudaAllocatorConfig::parse(): a PYTORCH_CUDA_ALLOC_CONF string read as
// LibTorch's AcceleratorAllocatorConfig reads it, for the model of the CUDA
// caching allocator (cuda_allocator_model.cpp).
#include "trainmem/cuda_allocator_model.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <exception>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "plan/detail/cuda_allocator_limits.h"

namespace trainmem {
namespace {

using detail::kRoundUpPowerOfTwoIntervals;

int64_t parse_int(const std::string& key, const std::string& value) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == value.size() && !value.empty() && v >= 0, "CudaAllocatorConfig: expected a ",
              "non-negative integer for ", key, ", but got '", value, "'");
  return v;
}

bool parse_bool(const std::string& key, const std::string& value) {
  if (value == "True" || value == "true" || value == "1") {
    return true;
  }
  TORCH_CHECK(value == "False" || value == "false" || value == "0", "CudaAllocatorConfig: expected ",
              "True or False for ", key, ", but got '", value, "'");
  return false;
}

// roundup_power2_divisions: one number for every interval, or
// AcceleratorAllocatorConfig::parseRoundUpPower2Divisions's list form.
std::vector<int64_t> parse_roundup_power2_divisions(const std::string& key, const std::string& value) {
  std::vector<int64_t> d(kRoundUpPowerOfTwoIntervals, 0);
  auto check_pow2 = [&](int64_t v) {
    TORCH_CHECK(v == 0 || std::has_single_bit(static_cast<uint64_t>(v)),
                "CudaAllocatorConfig: expected a power of 2 in roundup_power2_divisions, but got ", v);
    return v;
  };
  if (!value.empty() && value.front() == '[') {
    std::string body = value.substr(1, value.size() - 2);
    size_t last_index = 0;
    bool first = true;
    size_t j = 0;
    while (j < body.size()) {
      size_t comma = body.find(',', j);
      std::string item = body.substr(j, comma == std::string::npos ? std::string::npos : comma - j);
      j = comma == std::string::npos ? body.size() : comma + 1;
      const size_t c2 = item.find(':');
      TORCH_CHECK(c2 != std::string::npos, "CudaAllocatorConfig: expected size:divisions in ",
                  "roundup_power2_divisions, but got '", item, "'");
      const std::string k = item.substr(0, c2);
      const int64_t v = check_pow2(parse_int(key, item.substr(c2 + 1)));
      if (k == ">") {
        std::fill(d.begin() + static_cast<int64_t>(last_index) + 1, d.end(), v);
      } else {
        const int64_t mb = check_pow2(parse_int(key, k));
        TORCH_CHECK(mb > 0, "CudaAllocatorConfig: expected a size in MiB > 0 in roundup_power2_divisions");
        size_t index = static_cast<size_t>(std::bit_width(static_cast<uint64_t>(mb)) - 1);
        index = std::min(index, static_cast<size_t>(kRoundUpPowerOfTwoIntervals - 1));
        if (first) {
          std::fill(d.begin(), d.begin() + static_cast<int64_t>(index), v);
          first = false;
        }
        d[index] = v;
        last_index = index;
      }
    }
  } else {
    std::fill(d.begin(), d.end(), check_pow2(parse_int(key, value)));
  }
  return d;
}

// AcceleratorAllocatorConfig::parseGarbageCollectionThreshold: 0 < v < 1.
double parse_gc_threshold(const std::string& value) {
  double v = 0;
  try {
    size_t used = 0;
    v = std::stod(value, &used);
    TORCH_CHECK(used == value.size(), "");
  } catch (const std::exception&) {
    TORCH_CHECK(false, "CudaAllocatorConfig: expected a number for garbage_collection_threshold, but got '",
                value, "'");
  }
  TORCH_CHECK(v > 0.0 && v < 1.0,
              "CudaAllocatorConfig: expected garbage_collection_threshold in (0.0, 1.0), but got ", value);
  return v;
}

} // namespace

CudaAllocatorConfig CudaAllocatorConfig::parse(const std::string& conf) {
  // AcceleratorAllocatorConfig::parseArgs: "key:value,key:[k:v,k:v]".
  CudaAllocatorConfig c;
  size_t i = 0;
  auto skip_spaces = [&] {
    while (i < conf.size() && std::isspace(static_cast<unsigned char>(conf[i]))) {
      ++i;
    }
  };
  while (i < conf.size()) {
    skip_spaces();
    if (i >= conf.size()) {
      break;
    }
    const size_t colon = conf.find(':', i);
    TORCH_CHECK(colon != std::string::npos, "CudaAllocatorConfig: expected key:value, but got '",
                conf.substr(i), "' in '", conf, "'");
    std::string key = conf.substr(i, colon - i);
    key.erase(std::remove_if(key.begin(), key.end(), [](unsigned char ch) { return std::isspace(ch); }),
              key.end());
    i = colon + 1;
    skip_spaces();
    std::string value;
    if (i < conf.size() && conf[i] == '[') {
      const size_t close = conf.find(']', i);
      TORCH_CHECK(close != std::string::npos, "CudaAllocatorConfig: unclosed '[' for ", key, " in '", conf, "'");
      value = conf.substr(i, close - i + 1);
      i = close + 1;
      skip_spaces();
      if (i < conf.size() && conf[i] == ',') {
        ++i;
      }
    } else {
      const size_t comma = conf.find(',', i);
      value = conf.substr(i, comma == std::string::npos ? std::string::npos : comma - i);
      i = comma == std::string::npos ? conf.size() : comma + 1;
    }
    value.erase(std::remove_if(value.begin(), value.end(), [](unsigned char ch) { return std::isspace(ch); }),
                value.end());
    if (key == "max_split_size_mb") {
      const int64_t mb = parse_int(key, value);
      // LibTorch: at least kLargeBuffer / 1 MiB (20), "MB" meaning MiB.
      TORCH_CHECK(mb > 20, "CudaAllocatorConfig: expected max_split_size_mb > 20, but got ", mb);
      c.max_split_size_bytes(mb << 20);
    } else if (key == "max_non_split_rounding_mb") {
      c.max_non_split_rounding_bytes(parse_int(key, value) << 20);
    } else if (key == "large_segment_size_mb") {
      const int64_t mb = parse_int(key, value);
      TORCH_CHECK(mb >= 2, "CudaAllocatorConfig: expected large_segment_size_mb >= 2, but got ", mb);
      c.large_segment_bytes(mb << 20);
    } else if (key == "expandable_segments") {
      c.expandable_segments(parse_bool(key, value));
    } else if (key == "roundup_power2_divisions") {
      c.roundup_power2_divisions(parse_roundup_power2_divisions(key, value));
    } else if (key == "garbage_collection_threshold") {
      c.garbage_collection_threshold(parse_gc_threshold(value));
    } else if (key == "release_lock_on_cudamalloc" ||
               key == "pinned_use_cuda_host_register" || key == "pinned_num_register_threads" ||
               key == "pinned_use_background_threads" || key == "pinned_max_round_threshold" ||
               key == "pinned_max_cached_size" || key == "backend" || key == "per_process_memory_fraction" ||
               key == "graph_capture_record_stream_reuse") {
      // Accepted, not modelled.
    } else {
      TORCH_CHECK(false, "CudaAllocatorConfig: unknown setting '", key, "' in '", conf, "'");
    }
  }
  return c;
}

} // namespace trainmem
