// The model of the CUDA caching allocator (Note [A model of the CUDA caching
// allocator]); its config is read in cuda_allocator_config.cpp, a trace is
// replayed through it in cuda_replay.cpp.
#include "trainmem/cuda_allocator_model.h"

#include <algorithm>
#include <bit>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>

#include <c10/util/Exception.h>

#include "plan/detail/cuda_allocator_limits.h"

namespace trainmem {

// Note [A model of the CUDA caching allocator]
// Each function below mirrors the one of c10/cuda/CUDACachingAllocator.cpp
// named in its comment (read in PyTorch's source; the constants are those of
// c10/core/AllocatorConfig.h in the installed 2.13 wheel), garbage
// collection by `garbage_collection_threshold` included (it acts when the
// device's size is set). What is left out: cross-stream uses (record_stream
// events), CUDA graph pools and IPC. Addresses are made up: each new segment
// starts 2 MiB past the end of the previous one.

namespace {

using detail::kRoundUpPowerOfTwoIntervals;

constexpr int64_t kMinBlockSize = 512;       // all sizes are rounded to at least 512 B
constexpr int64_t kSmallSize = 1048576;      // largest "small" allocation is 1 MiB
constexpr int64_t kSmallBuffer = 2097152;    // "small" allocations are packed in 2 MiB blocks
constexpr int64_t kMinLargeAlloc = 10485760; // allocations between 1 and 10 MiB may use kLargeBuffer
constexpr int64_t kRoundLarge = 2097152;     // round up large allocations to 2 MiB

struct Pool;

struct Block {
  uint64_t ptr = 0;
  uint64_t base = 0;  // the segment's first address (expandable pages are aligned to it)
  int64_t size = 0;
  int64_t requested = 0;
  int64_t stream = 0;
  Pool* pool = nullptr;
  bool allocated = false;
  bool mapped = true;
  bool expandable = false;
  Block* prev = nullptr;
  Block* next = nullptr;
  int64_t gc_count_base = 0;  // its pool's get_free_blocks_call_count when it became free
  bool is_split() const { return prev != nullptr || next != nullptr; }
};

struct BySize {
  bool operator()(const Block* a, const Block* b) const {
    return std::tie(a->stream, a->size, a->ptr) < std::tie(b->stream, b->size, b->ptr);
  }
};
struct ByAddress {
  bool operator()(const Block* a, const Block* b) const {
    return std::tie(a->stream, a->ptr) < std::tie(b->stream, b->ptr);
  }
};

struct Pool {
  explicit Pool(bool s) : small(s) {}
  bool small;
  std::set<Block*, BySize> blocks;       // free, mapped
  std::set<Block*, ByAddress> unmapped;  // expandable address space without pages
  int64_t get_free_blocks_call_count = 0;  // counted while garbage collection is on
  // BlockPool::insert_into_blocks(): a free block's age starts now.
  void insert(Block* b) {
    b->gc_count_base = get_free_blocks_call_count;
    blocks.insert(b);
  }
  int64_t gc_count(const Block* b) const { return get_free_blocks_call_count - b->gc_count_base; }
};

int64_t round_up(int64_t n, int64_t to) {
  return (n + to - 1) / to * to;
}

// roundup_power2_next_division()
int64_t next_division(int64_t size, int64_t divisions) {
  const auto u = static_cast<uint64_t>(size);
  if (std::has_single_bit(u)) {
    return size;
  }
  const uint64_t floor = std::bit_floor(u);
  const uint64_t step = floor >> (std::bit_width(static_cast<uint64_t>(divisions)) - 1);
  if (step == 0) {
    return static_cast<int64_t>(floor << 1);
  }
  const uint64_t rounded = u & ~(step - 1);
  return static_cast<int64_t>(rounded == u ? u : rounded + step);
}

} // namespace

struct CudaCachingAllocatorModel::Impl {
  explicit Impl(CudaAllocatorConfig c) : config(std::move(c)), small(true), large(false) {}
  ~Impl() {
    std::set<Block*> all;
    for (auto* p : {&small, &large}) {
      all.insert(p->blocks.begin(), p->blocks.end());
      all.insert(p->unmapped.begin(), p->unmapped.end());
    }
    for (auto& [ptr, b] : active) {
      all.insert(b);
    }
    for (Block* b : all) {
      delete b;
    }
  }

  CudaAllocatorConfig config;
  Pool small;
  Pool large;
  std::unordered_map<uint64_t, Block*> active;
  CudaAllocatorStats s;
  uint64_t next_address = 0x7f0000000000ULL;
  uint64_t pinned_address = 0;

  // A block of a segment that was there before the model started: allocated
  // (counted, freeable by address) or free in `pool`.
  void take_seeded(Block* b, Pool& pool) {
    if (b->allocated) {
      active[b->ptr] = b;
      add(s.allocated_bytes, s.peak_allocated_bytes, b->size);
      add(s.requested_bytes, s.peak_requested_bytes, b->requested);
    } else {
      pool.insert(b);
    }
  }

  // add_segment(): a segment that was there before the model started.
  void add_segment(uint64_t address, int64_t total_bytes, bool large_pool, int64_t stream,
                   const std::vector<CudaBlockInfo>& blocks) {
    TORCH_CHECK(total_bytes > 0, "CudaCachingAllocatorModel::add_segment: expected a size > 0, but got ", total_bytes);
    int64_t sum = 0;
    for (const auto& bi : blocks) sum += bi.size_bytes;
    TORCH_CHECK(sum == total_bytes && !blocks.empty() && blocks.front().address == address,
                "CudaCachingAllocatorModel::add_segment: expected blocks tiling the ", total_bytes,
                " B segment at ", address, ", but they cover ", sum, " B");
    Pool& pool = large_pool ? large : small;
    Block* prev = nullptr;
    for (const auto& bi : blocks) {
      auto* b = new Block();
      b->ptr = bi.address;
      b->base = address;
      b->size = bi.size_bytes;
      b->requested = bi.requested_bytes;
      b->stream = stream;
      b->pool = &pool;
      b->allocated = bi.allocated;
      b->prev = prev;
      if (prev != nullptr) prev->next = b;
      prev = b;
      take_seeded(b, pool);
      if (!b->allocated && blocks.size() > 1) add_inactive_split(b->size);
    }
    add_reserved(total_bytes);
    s.num_segments += 1;
  }

  int64_t max_split() const { return config.max_split_size_bytes(); }

  // round_size()
  int64_t round_size(int64_t size) const {
    if (size < kMinBlockSize) {
      return kMinBlockSize;
    }
    const int64_t divisions = this->divisions(size);
    if (divisions > 1 && size > kMinBlockSize * divisions) {
      return next_division(size, divisions);
    }
    return round_up(size, kMinBlockSize);
  }

  // AcceleratorAllocatorConfig::roundup_power2_divisions(size)
  int64_t divisions(int64_t size) const {
    const auto& d = config.roundup_power2_divisions();
    if (d.empty()) {
      return 0;
    }
    const int64_t log_size = std::bit_width(static_cast<uint64_t>(size)) - 1;
    const int64_t interval_start = 20;  // 1 MiB
    int64_t index = log_size > interval_start ? log_size - interval_start : 0;
    index = std::min<int64_t>(index, static_cast<int64_t>(d.size()) - 1);
    return d[static_cast<size_t>(index)];
  }

  // get_allocation_size()
  int64_t allocation_size(int64_t size) const {
    if (size <= kSmallSize) {
      return kSmallBuffer;
    }
    if (size < kMinLargeAlloc) {
      return config.large_segment_bytes();
    }
    return round_up(size, kRoundLarge);
  }

  Pool& pool_for(int64_t size) { return size <= kSmallSize ? small : large; }

  void add(int64_t& current, int64_t& peak, int64_t amount) {
    current += amount;
    peak = std::max(peak, current);
  }
  void add_inactive_split(int64_t amount) {
    add(s.inactive_split_bytes, s.peak_inactive_split_bytes, amount);
  }
  void add_reserved(int64_t amount) { add(s.reserved_bytes, s.peak_reserved_bytes, amount); }

  uint64_t new_address(int64_t size) {
    if (pinned_address != 0) {  // set_next_segment_address(): a recorded cudaMalloc's address
      const uint64_t a = pinned_address;
      pinned_address = 0;
      return a;
    }
    const uint64_t a = next_address;
    next_address += static_cast<uint64_t>(round_up(size, kRoundLarge) + kRoundLarge);
    return a;
  }

  // get_free_block()
  Block* get_free_block(Pool& pool, int64_t size, int64_t stream) {
    if (gc_on()) {
      ++pool.get_free_blocks_call_count;  // block reuse intervals, for garbage_collect_cached_blocks()
    }
    Block key;
    key.stream = stream;
    key.size = size;
    key.ptr = 0;
    auto it = pool.blocks.lower_bound(&key);
    if (it == pool.blocks.end() || (*it)->stream != stream) {
      return nullptr;
    }
    if ((*it)->expandable) {
      if (config.expandable_segments()) {
        // Best fit by the size a block could grow to (its unmapped tail counted).
        auto expandable_size = [](Block* b) {
          return b->size + (b->next != nullptr && !b->next->mapped ? b->next->size : 0);
        };
        auto next = std::next(it);
        while ((*it)->expandable && next != pool.blocks.end() && (*next)->stream == stream &&
               expandable_size(*next) < expandable_size(*it)) {
          it = next++;
        }
      } else {
        do {
          ++it;
        } while (it != pool.blocks.end() && (*it)->expandable && (*it)->stream == stream);
        if (it == pool.blocks.end() || (*it)->stream != stream) {
          return nullptr;
        }
      }
    }
    // Do not return an oversized block for a large request.
    if (size < max_split() && (*it)->size >= max_split()) {
      return nullptr;
    }
    // Allow an oversized block to be rounded up, within a limit.
    if (size >= max_split() && (*it)->size >= size + config.max_non_split_rounding_bytes()) {
      return nullptr;
    }
    Block* b = *it;
    pool.blocks.erase(it);
    return b;
  }

  // alloc_block(), the cudaMalloc path
  Block* alloc_block(Pool& pool, int64_t size, int64_t alloc_size, int64_t stream, bool retry) {
    if (retry) {
      s.num_alloc_retries += 1;
    }
    if (config.expandable_segments()) {
      return try_allocate_expandable_block(pool, size, stream);
    }
    if (config.device_bytes() > 0 && s.reserved_bytes + alloc_size > config.device_bytes()) {
      return nullptr;
    }
    auto* b = new Block();
    b->ptr = new_address(alloc_size);
    b->base = b->ptr;
    b->size = alloc_size;
    b->stream = stream;
    b->pool = &pool;
    add_reserved(alloc_size);
    s.num_segments += 1;
    s.num_device_allocs += 1;
    return b;
  }

  // release_block(): cudaFree of a whole, free, unsplit segment
  void release_block(Block* b) {
    b->pool->blocks.erase(b);
    add_reserved(-b->size);
    s.num_segments -= 1;
    s.num_device_frees += 1;
    delete b;
  }

  // Garbage collection runs only with a memory fraction set
  // (set_per_process_memory_fraction): here, a device size.
  bool gc_on() const { return config.garbage_collection_threshold() > 0.0 && config.device_bytes() > 0; }

  // garbage_collect_cached_blocks(): above threshold x the device's memory,
  // cudaFree the large pool's whole free segments at least as old as their
  // average age (get_free_block calls since each became free), repeatedly,
  // until the reserved bytes above the threshold are reclaimed or nothing
  // more can be.
  void garbage_collect_cached_blocks() {
    const auto threshold =
        static_cast<int64_t>(config.garbage_collection_threshold() * static_cast<double>(config.device_bytes()));
    if (s.reserved_bytes <= threshold) {
      return;
    }
    const int64_t target = s.reserved_bytes - threshold;
    int64_t reclaimed = 0;
    int64_t total_age = 0;
    int64_t freeable = 0;
    for (const Block* b : large.blocks) {
      if (!b->is_split()) {
        total_age += large.gc_count(b);
        ++freeable;
      }
    }
    bool freed = true;
    while (reclaimed < target && freed && freeable > 0) {
      const double age_threshold = static_cast<double>(total_age) / static_cast<double>(freeable);
      freed = false;
      std::vector<Block*> old;
      for (Block* b : large.blocks) {
        if (!b->is_split() && !b->expandable && static_cast<double>(large.gc_count(b)) >= age_threshold) {
          old.push_back(b);
        }
      }
      for (Block* b : old) {
        freed = true;
        reclaimed += b->size;
        total_age -= large.gc_count(b);
        --freeable;
        release_block(b);
      }
    }
  }

  // release_available_cached_blocks(): oversize blocks only
  bool release_available_cached_blocks(Pool& pool, int64_t size, int64_t stream) {
    if (max_split() == std::numeric_limits<int64_t>::max()) {
      return false;
    }
    Block key;
    key.stream = stream;
    key.size = std::max(size, max_split());
    auto it = pool.blocks.lower_bound(&key);
    if (it == pool.blocks.end() || (*it)->stream != stream || (*it)->expandable) {
      if (it == pool.blocks.begin()) {
        return false;
      }
      int64_t released = 0;
      --it;  // the largest block of this stream
      while (released < key.size && (*it)->size >= max_split() && (*it)->stream == stream) {
        auto cur = it;
        const bool first = cur == pool.blocks.begin();
        if (!first) {
          --it;
        }
        if (!(*cur)->expandable && !(*cur)->is_split()) {
          released += (*cur)->size;
          release_block(*cur);
        }
        if (first) {
          break;
        }
      }
      return released >= key.size;
    }
    if ((*it)->is_split()) {
      return false;
    }
    release_block(*it);
    return true;
  }

  // release_cached_blocks(): every unsplit free segment, both pools
  bool release_cached_blocks() {
    for (Pool* p : {&large, &small}) {
      std::vector<Block*> whole;
      for (Block* b : p->blocks) {
        if (!b->is_split() && !b->expandable) {
          whole.push_back(b);
        }
      }
      for (Block* b : whole) {
        release_block(b);
      }
    }
    unmap_free_pages();
    return true;
  }

  int64_t page_size(const Pool& pool) const { return pool.small ? kSmallBuffer : config.large_segment_bytes(); }

  // An expandable segment's address space: 1 1/8 of the device, in whole
  // pages (1 TiB without a capacity).
  int64_t expandable_space(const Pool& pool) const {
    const int64_t page = page_size(pool);
    return config.device_bytes() > 0 ? (config.device_bytes() + config.device_bytes() / 8) / page * page
                                     : (1LL << 40) / page * page;
  }

  // add_expandable_segment(): an expandable segment mapped before the model
  // started, its pages mapped where `ranges` say (each tiled by its blocks),
  // the rest of its address space from `base` unmapped.
  void add_expandable_segment(uint64_t base, bool large_pool, int64_t stream,
                              const std::vector<std::vector<CudaBlockInfo>>& ranges) {
    Pool& pool = large_pool ? large : small;
    const auto page = static_cast<uint64_t>(page_size(pool));
    const auto end = base + static_cast<uint64_t>(expandable_space(pool));
    const char* who = "CudaCachingAllocatorModel::add_expandable_segment";
    Block* prev = nullptr;
    const auto link = [&](Block* b) {
      b->base = base;
      b->stream = stream;
      b->pool = &pool;
      b->expandable = true;
      b->prev = prev;
      if (prev != nullptr) prev->next = b;
      prev = b;
    };
    const auto unmapped = [&](uint64_t from, uint64_t to) {
      auto* b = new Block();
      b->ptr = from;
      b->size = static_cast<int64_t>(to - from);
      b->mapped = false;
      link(b);
      pool.unmapped.insert(b);
    };
    uint64_t at = base;
    for (const auto& blocks : ranges) {
      TORCH_CHECK(!blocks.empty(), who, ": a mapped range without blocks");
      const uint64_t from = blocks.front().address;
      int64_t bytes = 0;
      for (const auto& bi : blocks) {
        TORCH_CHECK(bi.address == from + static_cast<uint64_t>(bytes) && bi.size_bytes > 0, who,
                    ": expected blocks tiling the range at ", from, ", but block at ", bi.address, " is not next");
        bytes += bi.size_bytes;
      }
      const uint64_t to = from + static_cast<uint64_t>(bytes);
      TORCH_CHECK(from >= at && (from - base) % page == 0 && bytes % static_cast<int64_t>(page) == 0 && to <= end,
                  who, ": the range of ", bytes, " B at ", from, " is not whole pages of ", page,
                  " B from the segment's base ", base, " after the range before it");
      if (from > at) unmapped(at, from);
      for (const auto& bi : blocks) {
        auto* b = new Block();
        b->ptr = bi.address;
        b->size = bi.size_bytes;
        b->requested = bi.requested_bytes;
        b->allocated = bi.allocated;
        link(b);
        take_seeded(b, pool);
      }
      add_reserved(bytes);
      at = to;
    }
    if (at < end) unmapped(at, end);
    for (Block* b = prev; b != nullptr; b = b->prev) {
      if (b->mapped && !b->allocated && b->is_split()) add_inactive_split(b->size);
    }
  }

  // find_expandable_block()
  Block* find_expandable_block(Pool& pool, int64_t size, int64_t stream) {
    auto allocatable = [](Block* b) { return b != nullptr && !b->allocated; };
    auto has_space = [&](Block* b) {
      int64_t bytes = 0;
      while (bytes < size && allocatable(b)) {
        bytes += b->size;
        b = b->next;
      }
      return bytes >= size;
    };
    Block key;
    key.stream = stream;
    key.ptr = 0;
    for (auto it = pool.unmapped.lower_bound(&key); it != pool.unmapped.end() && (*it)->stream == stream; ++it) {
      Block* c = *it;
      if (allocatable(c->prev)) {
        c = c->prev;
      }
      if (has_space(c)) {
        return c;
      }
    }
    // A new segment.
    const int64_t space = expandable_space(pool);
    auto* c = new Block();
    c->ptr = new_address(space);
    c->base = c->ptr;
    c->size = space;
    c->stream = stream;
    c->pool = &pool;
    c->mapped = false;
    c->expandable = true;
    pool.unmapped.insert(c);
    return c;
  }

  // map_block(): map whole pages at the start of an unmapped block
  bool map_block(Block* to_map, int64_t size) {
    const int64_t page = page_size(*to_map->pool);
    const int64_t mapped = std::min(to_map->size, round_up(size, page));
    if (config.device_bytes() > 0 && s.reserved_bytes + mapped > config.device_bytes()) {
      return false;
    }
    Pool& pool = *to_map->pool;
    pool.unmapped.erase(to_map);
    to_map->mapped = true;
    if (mapped < to_map->size) {
      auto* rest = new Block();
      rest->ptr = to_map->ptr + static_cast<uint64_t>(mapped);
      rest->base = to_map->base;
      rest->size = to_map->size - mapped;
      rest->stream = to_map->stream;
      rest->pool = &pool;
      rest->mapped = false;
      rest->expandable = true;
      rest->prev = to_map;
      rest->next = to_map->next;
      if (to_map->next != nullptr) {
        to_map->next->prev = rest;
      }
      to_map->next = rest;
      pool.unmapped.insert(rest);
      to_map->size = mapped;
    }
    try_merge(to_map, to_map->prev, pool);
    try_merge(to_map, to_map->next, pool);
    pool.insert(to_map);
    add_reserved(mapped);
    s.num_device_allocs += 1;
    return true;
  }

  // try_allocate_expandable_block()
  Block* try_allocate_expandable_block(Pool& pool, int64_t size, int64_t stream) {
    Block* c = find_expandable_block(pool, size, stream);
    if (!c->mapped && !map_block(c, std::min(c->size, size))) {
      return nullptr;
    }
    while (c->size < size) {
      Block* n = c->next;
      if (n == nullptr) {
        return nullptr;  // the segment's address space ends before the request does: out of memory
      }
      if (!map_block(n, std::min(size - c->size, n->size))) {
        return nullptr;
      }
      c = n;  // map_block merged c into n
    }
    pool.blocks.erase(c);
    return c;
  }

  // Unmaps the whole pages inside free blocks of expandable segments
  // (release_expandable_segment / unmap_block).
  void unmap_free_pages() {
    for (Pool* p : {&large, &small}) {
      std::vector<Block*> free_expandable;
      for (Block* b : p->blocks) {
        if (b->expandable) {
          free_expandable.push_back(b);
        }
      }
      const auto page = static_cast<uint64_t>(page_size(*p));
      for (Block* b : free_expandable) {
        const uint64_t offset = b->ptr - b->base;
        const uint64_t begin = b->base + (offset + page - 1) / page * page;
        const uint64_t end = b->base + (offset + static_cast<uint64_t>(b->size)) / page * page;
        if (end <= begin) {
          continue;
        }
        p->blocks.erase(b);
        // [b: head][mid: unmapped][tail]
        Block* mid = b;
        if (begin > b->ptr) {
          mid = new Block(*b);
          mid->ptr = begin;
          mid->size = b->size - static_cast<int64_t>(begin - b->ptr);
          b->size = static_cast<int64_t>(begin - b->ptr);
          mid->prev = b;
          mid->next = b->next;
          if (b->next != nullptr) {
            b->next->prev = mid;
          }
          b->next = mid;
          p->insert(b);
        }
        if (mid->ptr + static_cast<uint64_t>(mid->size) > end) {
          auto* tail = new Block(*mid);
          tail->ptr = end;
          tail->size = static_cast<int64_t>(mid->ptr + static_cast<uint64_t>(mid->size) - end);
          mid->size = static_cast<int64_t>(end - mid->ptr);
          tail->prev = mid;
          tail->next = mid->next;
          if (mid->next != nullptr) {
            mid->next->prev = tail;
          }
          mid->next = tail;
          p->insert(tail);
        }
        mid->mapped = false;
        add_reserved(-mid->size);
        s.num_device_frees += 1;
        p->unmapped.insert(mid);
        Block* prev = mid->prev;
        Block* next = mid->next;
        if (prev != nullptr && !prev->mapped) {
          p->unmapped.erase(prev);
          p->unmapped.erase(mid);
          merge_into(mid, prev);
          p->unmapped.insert(mid);
        }
        if (next != nullptr && !next->mapped) {
          p->unmapped.erase(next);
          p->unmapped.erase(mid);
          merge_into(mid, next);
          p->unmapped.insert(mid);
        }
      }
    }
  }

  // Absorbs neighbour `src` into `dst` (no pool bookkeeping).
  static void merge_into(Block* dst, Block* src) {
    if (dst->prev == src) {
      dst->ptr = src->ptr;
      dst->prev = src->prev;
      if (dst->prev != nullptr) {
        dst->prev->next = dst;
      }
    } else {
      dst->next = src->next;
      if (dst->next != nullptr) {
        dst->next->prev = dst;
      }
    }
    dst->size += src->size;
    delete src;
  }

  // try_merge_blocks()
  int64_t try_merge(Block* dst, Block* src, Pool& pool) {
    if (src == nullptr || src->allocated || dst->mapped != src->mapped) {
      return 0;
    }
    const int64_t subsumed = src->size;
    if (src->mapped) {
      pool.blocks.erase(src);
    } else {
      pool.unmapped.erase(src);
    }
    merge_into(dst, src);
    return subsumed;
  }

  // should_split()
  bool should_split(const Block* b, int64_t size) const {
    const int64_t remaining = b->size - size;
    if (b->pool->small || config.expandable_segments()) {
      return remaining >= kMinBlockSize;
    }
    return size < max_split() && remaining > kSmallSize;
  }

  // alloc_found_block()
  Block* alloc_found_block(Block* block, int64_t size, int64_t requested, bool split) {
    Pool& pool = *block->pool;
    const bool already_split = block->is_split();
    if (split) {
      Block* remaining = block;
      block = new Block();
      block->ptr = remaining->ptr;
      block->base = remaining->base;
      block->size = size;
      block->stream = remaining->stream;
      block->pool = &pool;
      block->expandable = remaining->expandable;
      block->prev = remaining->prev;
      if (block->prev != nullptr) {
        block->prev->next = block;
      }
      block->next = remaining;
      remaining->prev = block;
      remaining->ptr += static_cast<uint64_t>(size);
      remaining->size -= size;
      pool.insert(remaining);
      if (already_split && !block->expandable) {
        add_inactive_split(-block->size);  // an inactive split block shrinks by `size`
      } else if (!block->expandable) {
        add_inactive_split(remaining->size);  // a new inactive split block
      }
    } else if (already_split && !block->expandable) {
      add_inactive_split(-block->size);  // a split block becomes active
    }
    block->allocated = true;
    block->requested = requested;
    active[block->ptr] = block;
    s.num_allocs += 1;
    add(s.allocated_bytes, s.peak_allocated_bytes, block->size);
    add(s.requested_bytes, s.peak_requested_bytes, requested);
    return block;
  }

  uint64_t malloc(int64_t bytes, int64_t stream) {
    TORCH_CHECK(bytes >= 0, "CudaCachingAllocatorModel::malloc: expected a size >= 0, but got ", bytes);
    if (bytes == 0) {
      return 0;  // CUDACachingAllocator::allocate hands out a null pointer
    }
    const int64_t size = round_size(bytes);
    Pool& pool = pool_for(size);
    const int64_t alloc_size = allocation_size(size);
    Block* b = get_free_block(pool, size, stream);
    if (b == nullptr && gc_on()) {
      garbage_collect_cached_blocks();
    }
    if (b == nullptr) {
      b = alloc_block(pool, size, alloc_size, stream, false);
    }
    if (b == nullptr && release_available_cached_blocks(pool, size, stream)) {
      b = alloc_block(pool, size, alloc_size, stream, false);
    }
    if (b == nullptr && release_cached_blocks()) {
      b = alloc_block(pool, size, alloc_size, stream, true);
    }
    if (b == nullptr) {
      s.num_ooms += 1;
      return 0;
    }
    return alloc_found_block(b, size, bytes, should_split(b, size))->ptr;
  }

  // free() and free_block()
  void free(uint64_t address) {
    auto it = active.find(address);
    TORCH_CHECK(it != active.end(), "CudaCachingAllocatorModel::free: no block is allocated at address ",
                address);
    Block* block = it->second;
    active.erase(it);
    block->allocated = false;
    s.num_frees += 1;
    s.allocated_bytes -= block->size;
    s.requested_bytes -= block->requested;
    block->requested = 0;
    Pool& pool = *block->pool;
    int64_t inactive_change = 0;
    for (Block* candidate : {block->prev, block->next}) {
      const int64_t subsumed = try_merge(block, candidate, pool);
      if (subsumed > 0) {
        inactive_change -= subsumed;
      }
    }
    pool.insert(block);
    if (block->is_split()) {
      inactive_change += block->size;
    }
    if (!block->expandable) {
      add_inactive_split(inactive_change);
    }
  }

  std::vector<CudaSegmentInfo> segments() const {
    std::vector<const Block*> heads;
    auto consider = [&](const Block* b) {
      if (b->mapped && (b->prev == nullptr || !b->prev->mapped)) {
        heads.push_back(b);
      }
    };
    for (const Pool* p : {&small, &large}) {
      for (const Block* b : p->blocks) {
        consider(b);
      }
    }
    for (const auto& [ptr, b] : active) {
      consider(b);
    }
    std::vector<CudaSegmentInfo> out;
    for (const Block* h : heads) {
      CudaSegmentInfo seg;
      seg.address = h->ptr;
      seg.large_pool = !h->pool->small;
      seg.expandable = h->expandable;
      seg.stream = h->stream;
      for (const Block* b = h; b != nullptr && b->mapped; b = b->next) {
        seg.blocks.push_back({b->ptr, b->size, b->requested, b->allocated});
        seg.total_bytes += b->size;
        seg.allocated_bytes += b->allocated ? b->size : 0;
      }
      out.push_back(std::move(seg));
    }
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.address < b.address; });
    return out;
  }
};

CudaCachingAllocatorModel::CudaCachingAllocatorModel(CudaAllocatorConfig config)
    : impl_(std::make_unique<Impl>(std::move(config))) {
  const auto& d = impl_->config.roundup_power2_divisions();
  TORCH_CHECK(d.empty() || static_cast<int64_t>(d.size()) == kRoundUpPowerOfTwoIntervals,
              "CudaCachingAllocatorModel: expected 0 or 16 roundup_power2_divisions, but got ", d.size());
  TORCH_CHECK(impl_->config.max_split_size_bytes() > 0 && impl_->config.large_segment_bytes() > 0 &&
                  impl_->config.device_bytes() >= 0 && impl_->config.max_non_split_rounding_bytes() >= 0,
              "CudaCachingAllocatorModel: sizes must be positive (max_split_size_bytes ",
              impl_->config.max_split_size_bytes(), ", large_segment_bytes ", impl_->config.large_segment_bytes(),
              ", device_bytes ", impl_->config.device_bytes(), ")");
}
CudaCachingAllocatorModel::~CudaCachingAllocatorModel() = default;
CudaCachingAllocatorModel::CudaCachingAllocatorModel(CudaCachingAllocatorModel&&) noexcept = default;
CudaCachingAllocatorModel& CudaCachingAllocatorModel::operator=(CudaCachingAllocatorModel&&) noexcept = default;

uint64_t CudaCachingAllocatorModel::malloc(int64_t bytes, int64_t stream) {
  return impl_->malloc(bytes, stream);
}
void CudaCachingAllocatorModel::free(uint64_t address) {
  impl_->free(address);
}
bool CudaCachingAllocatorModel::is_allocated(uint64_t address) const {
  return impl_->active.count(address) != 0;
}
void CudaCachingAllocatorModel::add_expandable_segment(uint64_t base, bool large_pool, int64_t stream,
                                                       const std::vector<std::vector<CudaBlockInfo>>& ranges) {
  impl_->add_expandable_segment(base, large_pool, stream, ranges);
}
void CudaCachingAllocatorModel::set_next_segment_address(uint64_t address) {
  impl_->pinned_address = address;
}
void CudaCachingAllocatorModel::add_segment(uint64_t address, int64_t total_bytes, bool large_pool, int64_t stream,
                                            const std::vector<CudaBlockInfo>& blocks) {
  impl_->add_segment(address, total_bytes, large_pool, stream, blocks);
}
void CudaCachingAllocatorModel::empty_cache() {
  impl_->release_cached_blocks();
}
void CudaCachingAllocatorModel::reset_peak() {
  auto& s = impl_->s;
  s.peak_allocated_bytes = s.allocated_bytes;
  s.peak_reserved_bytes = s.reserved_bytes;
  s.peak_requested_bytes = s.requested_bytes;
  s.peak_inactive_split_bytes = s.inactive_split_bytes;
}
CudaAllocatorStats CudaCachingAllocatorModel::stats() const {
  return impl_->s;
}
std::vector<CudaSegmentInfo> CudaCachingAllocatorModel::segments() const {
  return impl_->segments();
}
const CudaAllocatorConfig& CudaCachingAllocatorModel::config() const {
  return impl_->config;
}
int64_t CudaCachingAllocatorModel::round_size(int64_t bytes) const {
  return impl_->round_size(bytes);
}
int64_t CudaCachingAllocatorModel::allocation_size(int64_t rounded_bytes) const {
  return impl_->allocation_size(rounded_bytes);
}

} // namespace trainmem
