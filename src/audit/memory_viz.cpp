// The memory_viz pickle of a CPU timeline (report.h: to_memory_viz_pickle).

#include <algorithm>
#include <cctype>
#include <cstring>
#include <unordered_map>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "trainmem/report.h"

// Note [A small pickle writer]
// pytorch.org/memory_viz and torch.cuda._memory_viz read a raw pickle of
// plain dicts, lists, strings and numbers: not torch::pickle_save's zip
// container, and not torch::jit::pickle's tagged aggregates (the viewer knows
// no GLOBAL/REDUCE). We build the snapshot as a JSON value and write it with
// protocol 2's unmemoized opcodes, which every Python unpickler reads.

namespace trainmem {
namespace {

using Json = nlohmann::ordered_json;

class PickleWriter {
 public:
  std::string finish(const Json& value) {
    out_ += "\x80\x02";
    write(value);
    out_ += '.';
    return std::move(out_);
  }

 private:
  void write(const Json& v) {
    switch (v.type()) {
      case Json::value_t::object:
        out_ += '}';
        if (!v.empty()) {
          out_ += '(';
          for (auto it = v.begin(); it != v.end(); ++it) {
            write_string(it.key());
            write(it.value());
          }
          out_ += 'u';
        }
        break;
      case Json::value_t::array:
        out_ += ']';
        if (!v.empty()) {
          out_ += '(';
          for (const auto& e : v) {
            write(e);
          }
          out_ += 'e';
        }
        break;
      case Json::value_t::string:
        write_string(v.get_ref<const std::string&>());
        break;
      case Json::value_t::boolean:
        out_ += v.get<bool>() ? '\x88' : '\x89';
        break;
      case Json::value_t::number_integer:
        write_int(v.get<int64_t>(), false);
        break;
      case Json::value_t::number_unsigned:
        write_int(static_cast<int64_t>(v.get<uint64_t>()), v.get<uint64_t>() > INT64_MAX);
        break;
      case Json::value_t::number_float: {
        out_ += 'G';
        const double d = v.get<double>();
        uint64_t bits = 0;
        std::memcpy(&bits, &d, sizeof bits);
        for (int i = 7; i >= 0; --i) {
          out_ += static_cast<char>((bits >> (8 * i)) & 0xff);  // big-endian
        }
        break;
      }
      default:
        out_ += 'N';
    }
  }
  void write_string(const std::string& s) {
    out_ += 'X';
    append_le(static_cast<uint64_t>(s.size()), 4);
    out_ += s;
  }
  // `as_unsigned`: the 64 bits are an unsigned value above INT64_MAX.
  void write_int(int64_t v, bool as_unsigned) {
    if (!as_unsigned && v >= 0 && v < 256) {
      out_ += 'K';
      out_ += static_cast<char>(v);
    } else if (!as_unsigned && v >= 0 && v < 65536) {
      out_ += 'M';
      append_le(static_cast<uint64_t>(v), 2);
    } else if (!as_unsigned && v >= INT32_MIN && v <= INT32_MAX) {
      out_ += 'J';
      append_le(static_cast<uint64_t>(static_cast<uint32_t>(v)), 4);
    } else {
      // LONG1: little-endian two's complement; an unsigned value above
      // INT64_MAX needs a ninth, zero byte so it stays positive.
      out_ += '\x8a';
      out_ += static_cast<char>(as_unsigned ? 9 : 8);
      append_le(static_cast<uint64_t>(v), 8);
      if (as_unsigned) {
        out_ += '\0';
      }
    }
  }
  void append_le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) {
      out_ += static_cast<char>((v >> (8 * i)) & 0xff);
    }
  }

  std::string out_;
};

Json frames_for(const MemoryEvent& e) {
  return Json::array({{{"filename", "trainmem"},
                       {"line", 0},
                       {"name", fmt::format("{} in {}, step {}", category_name(e.category),
                                            phase_name(e.phase), e.step)}}});
}

// PyTorch's own snapshots of profiler data (torch.cuda._memory_viz,
// _profile_to_snapshot) put the category on each alloc, lowercase; the viewer
// colours by it.
std::string category_key(Category c) {
  std::string name = category_name(c);
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return name;
}

} // namespace

// Note [CPU blocks as memory_viz segments]
// The CPU allocator has no segments, so each block is its own: every alloc is
// preceded by a segment_alloc of the same address and size, and every free is
// followed by a segment_free. memory_viz's "Allocator State History" replays
// the trace backwards from the final `segments` and needs both to find each
// block's segment. A zero-byte block is a block too: the timeline's sign
// cannot tell its alloc from its free (both are 0 B), so the first event at
// an address not live is its alloc and the next its free. A free whose alloc
// came before recording still gets its segment_free: replayed backwards, the
// block was live from the start.
std::string to_memory_viz_pickle(const Timeline& timeline) {
  Json trace = Json::array();
  std::unordered_map<uint64_t, const MemoryEvent*> live;
  for (const auto& e : timeline.events) {
    if (e.address == 0) {
      continue;  // bytes seen between steps, not a block
    }
    const auto time_us = static_cast<int64_t>(static_cast<double>(e.time_ns) / 1000.0);
    const auto it = live.find(e.address);
    const bool is_alloc = e.bytes > 0 || (e.bytes == 0 && it == live.end());
    // A free's size and category are those of its alloc when it was recorded.
    const MemoryEvent& origin = (!is_alloc && it != live.end()) ? *it->second : e;
    const int64_t size = origin.bytes > 0 ? origin.bytes : -origin.bytes;
    auto entry = [&](const char* action) {
      return Json{{"action", action}, {"addr", e.address},   {"size", size},
                  {"stream", 0},      {"time_us", time_us},  {"frames", frames_for(origin)},
                  {"category", category_key(origin.category)}};
    };
    if (is_alloc) {
      trace.push_back(entry("segment_alloc"));
      trace.push_back(entry("alloc"));
      live[e.address] = &e;
    } else {
      trace.push_back(entry("free_requested"));
      trace.push_back(entry("free_completed"));
      trace.push_back(entry("segment_free"));
      if (it != live.end()) {
        live.erase(it);
      }
    }
  }
  // The CPU allocator has no segments: each block still live is its own,
  // fully used, so blocks tile their segment exactly.
  std::vector<const MemoryEvent*> blocks;
  blocks.reserve(live.size());
  for (const auto& [address, e] : live) {
    blocks.push_back(e);
  }
  std::sort(blocks.begin(), blocks.end(), [](const auto* a, const auto* b) { return a->address < b->address; });
  Json segments = Json::array();
  for (const auto* e : blocks) {
    Json block = {{"address", e->address}, {"size", e->bytes}, {"requested_size", e->bytes},
                  {"state", "active_allocated"}, {"frames", frames_for(*e)},
                  {"category", category_key(e->category)}};
    segments.push_back({{"device", 0},
                        {"address", e->address},
                        {"total_size", e->bytes},
                        {"stream", 0},
                        {"segment_type", e->bytes >= (1 << 20) ? "large" : "small"},
                        {"allocated_size", e->bytes},
                        {"active_size", e->bytes},
                        {"requested_size", e->bytes},
                        {"blocks", Json::array({block})}});
  }
  Json snapshot = {{"segments", segments}, {"device_traces", Json::array({trace})}};
  return PickleWriter().finish(snapshot);
}

} // namespace trainmem
