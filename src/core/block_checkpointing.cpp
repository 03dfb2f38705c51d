#include "trainmem/block_checkpointing.h"

#include <cmath>

#include <c10/util/Exception.h>

namespace trainmem {

BlockCheckpointing BlockCheckpointing::none(int64_t n) {
  return chosen(n, {});
}

BlockCheckpointing BlockCheckpointing::full(int64_t n) {
  auto p = every(n, 1);
  p.name = "full";
  return p;
}

BlockCheckpointing BlockCheckpointing::every(int64_t n, int64_t k) {
  TORCH_CHECK(k >= 1, "BlockCheckpointing::every: expected k >= 1, but got ", k);
  std::vector<int64_t> which;
  for (int64_t i = 0; i < n; i += k) {
    which.push_back(i);
  }
  auto p = chosen(n, which);
  p.name = "every_" + std::to_string(k);
  return p;
}

BlockCheckpointing BlockCheckpointing::selective(int64_t n, SelectivePolicy policy) {
  auto p = full(n);
  p.options.context_fn(create_selective_checkpoint_contexts(std::move(policy)));
  p.name = "selective";
  return p;
}

BlockCheckpointing BlockCheckpointing::chosen(int64_t n, const std::vector<int64_t>& which) {
  TORCH_CHECK(n >= 1, "BlockCheckpointing: expected num_layers >= 1, but got ", n);
  BlockCheckpointing p;
  p.blocks.assign(n, false);
  for (auto i : which) {
    TORCH_CHECK(i >= 0 && i < n, "BlockCheckpointing: block ", i, " is out of range [0, ", n, ")");
    p.blocks[i] = true;
  }
  p.name = which.empty() ? "none" : "chosen";
  return p;
}

BlockCheckpointing BlockCheckpointing::segments(int64_t n, int64_t num_segments) {
  TORCH_CHECK(num_segments >= 1 && num_segments <= n,
              "BlockCheckpointing::segments: expected 1 <= num_segments <= ", n,
              " (the number of blocks), but got ", num_segments);
  auto p = none(n);
  p.region_length.assign(n, 1);
  const int64_t size = n / num_segments;
  for (int64_t s = 0, begin = 0; s + 1 < num_segments; ++s, begin += size) {
    p.blocks[begin] = true;
    p.region_length[begin] = size;
  }
  p.name = "segments_" + std::to_string(num_segments);
  return p;
}

BlockCheckpointing BlockCheckpointing::sqrt(int64_t n) {
  auto p = segments(n, sqrt_segments(n));
  p.name = "sqrt";
  return p;
}

BlockCheckpointing BlockCheckpointing::named(int64_t n, const std::string& name) {
  if (name == "none") {
    return none(n);
  }
  if (name == "full") {
    return full(n);
  }
  if (name == "selective") {
    return selective(n, save_matmuls_policy());
  }
  const std::string prefix = "every_";
  const auto digits = name.substr(std::min(prefix.size(), name.size()));
  const bool every_k = name.rfind(prefix, 0) == 0 && !digits.empty() && digits.size() <= 9 &&
      digits[0] != '0' && std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
  TORCH_CHECK(every_k, "expected checkpoint none, full, every_<k> (k >= 1) or selective, but got \"", name, "\"");
  return every(n, std::stoll(digits));
}

const CheckpointOptions& BlockCheckpointing::options_for(int64_t i) const {
  TORCH_CHECK(block_options.empty() || block_options.size() == blocks.size(),
              "BlockCheckpointing: block_options has ", block_options.size(),
              " entries, expected 0 or ", blocks.size());
  return block_options.empty() ? options : block_options.at(i);
}

BlockCheckpointing& BlockCheckpointing::set_block_policy(int64_t i, SelectivePolicy policy) {
  const auto n = static_cast<int64_t>(blocks.size());
  TORCH_CHECK(i >= 0 && i < n, "BlockCheckpointing::set_block_policy: block ", i,
              " is out of range [0, ", n, ")");
  if (block_options.empty()) {
    block_options.assign(blocks.size(), options);
  }
  blocks[i] = true;
  block_options[i] = options;
  block_options[i].context_fn(create_selective_checkpoint_contexts(std::move(policy)));
  return *this;
}

} // namespace trainmem
