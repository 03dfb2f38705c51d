// The CUDA caching-allocator model against the allocator's documented rules
// (c10/cuda/CUDACachingAllocator.cpp, LibTorch 2.13). Every expected figure is
// worked by hand in the comment beside it.
#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include "trainmem/cuda_allocator_model.h"

namespace {

constexpr int64_t KiB = 1024;
constexpr int64_t MiB = 1024 * 1024;

using trainmem::CudaAllocatorConfig;
using trainmem::CudaCachingAllocatorModel;

TEST(CudaAllocatorModelTest, RoundsTo512Bytes) {
  CudaCachingAllocatorModel m;
  EXPECT_EQ(m.round_size(1), 512);                 // minimum block
  EXPECT_EQ(m.round_size(512), 512);
  EXPECT_EQ(m.round_size(513), 1024);              // next multiple of 512
  EXPECT_EQ(m.round_size(4), 512);                 // a float scalar takes a 512 B block
  EXPECT_EQ(m.round_size(4 * MiB + 1), 4 * MiB + 512);
  const auto a = m.malloc(1000);
  EXPECT_NE(a, 0u);
  EXPECT_EQ(m.stats().allocated_bytes, 1024);      // block size, not request
  EXPECT_EQ(m.stats().requested_bytes, 1000);
  EXPECT_EQ(m.malloc(0), 0u);                      // size 0: a null pointer, nothing allocated
  EXPECT_EQ(m.stats().num_allocs, 1);
}

TEST(CudaAllocatorModelTest, SmallPoolPacksInto2MiBSegments) {
  CudaCachingAllocatorModel m;
  // 1,024 B blocks: 2 MiB / 1,024 B = 2,048 of them share one small segment.
  std::vector<uint64_t> a;
  for (int i = 0; i < 2048; ++i) {
    a.push_back(m.malloc(1024));
  }
  EXPECT_EQ(m.stats().reserved_bytes, 2 * MiB);
  EXPECT_EQ(m.stats().num_segments, 1);
  EXPECT_EQ(a[1] - a[0], 1024u);                    // the split hands out the low end
  EXPECT_EQ(m.stats().inactive_split_bytes, 0);    // the last block took the rest exactly
  m.malloc(1024);                                  // the 2,049th needs a second segment
  EXPECT_EQ(m.stats().reserved_bytes, 4 * MiB);
  // A 1 MiB request is still small (<= 1 MiB): it fits in the 2,047 KiB the
  // second segment has left.
  m.malloc(1 * MiB);
  EXPECT_EQ(m.stats().reserved_bytes, 4 * MiB);
  // Another 1 MiB does not (1,023 KiB left): a third small segment.
  m.malloc(1 * MiB);
  EXPECT_EQ(m.stats().reserved_bytes, 6 * MiB);
  // 1 MiB + 1 B rounds to 1 MiB + 512 B: large pool, a 20 MiB segment.
  m.malloc(1 * MiB + 1);
  EXPECT_EQ(m.stats().reserved_bytes, 26 * MiB);
}

TEST(CudaAllocatorModelTest, LargePoolSegmentSizes) {
  CudaCachingAllocatorModel m;
  EXPECT_EQ(m.allocation_size(512), 2 * MiB);          // small
  EXPECT_EQ(m.allocation_size(1 * MiB), 2 * MiB);      // small (<= 1 MiB)
  EXPECT_EQ(m.allocation_size(1 * MiB + 512), 20 * MiB);
  EXPECT_EQ(m.allocation_size(10 * MiB - 512), 20 * MiB);  // < 10 MiB: 20 MiB segment
  EXPECT_EQ(m.allocation_size(10 * MiB), 10 * MiB);        // >= 10 MiB: rounded to 2 MiB
  EXPECT_EQ(m.allocation_size(11 * MiB + 512), 12 * MiB);
  // 4 MiB: a 20 MiB segment, split (the rest, 16 MiB, is more than 1 MiB).
  m.malloc(4 * MiB);
  EXPECT_EQ(m.stats().reserved_bytes, 20 * MiB);
  EXPECT_EQ(m.stats().allocated_bytes, 4 * MiB);
  EXPECT_EQ(m.stats().inactive_split_bytes, 16 * MiB);
  // A second 4 MiB comes from the same segment: 12 MiB stay free in it.
  m.malloc(4 * MiB);
  EXPECT_EQ(m.stats().reserved_bytes, 20 * MiB);
  EXPECT_EQ(m.stats().inactive_split_bytes, 12 * MiB);
  // 11 MiB + 1 B, rounded to 11 MiB + 512 B, fits in the segment's free
  // 12 MiB; the rest (1 MiB - 512 B) is not more than 1 MiB, so no split:
  // the block handed out is all 12 MiB.
  m.malloc(11 * MiB + 1);
  EXPECT_EQ(m.stats().reserved_bytes, 20 * MiB);
  EXPECT_EQ(m.stats().allocated_bytes, 8 * MiB + 12 * MiB);
  EXPECT_EQ(m.stats().requested_bytes, 8 * MiB + 11 * MiB + 1);
  // On a fresh allocator it gets a segment of its own, rounded to 2 MiB: 12 MiB.
  CudaCachingAllocatorModel fresh;
  fresh.malloc(11 * MiB + 1);
  EXPECT_EQ(fresh.stats().reserved_bytes, 12 * MiB);
  EXPECT_EQ(fresh.stats().allocated_bytes, 12 * MiB);
}

TEST(CudaAllocatorModelTest, ReusesTheBestFitBlock) {
  CudaCachingAllocatorModel m;
  const auto a = m.malloc(12 * MiB);   // segments of 12, 16 and 14 MiB (>= 10 MiB: exact)
  const auto b = m.malloc(16 * MiB);
  const auto c = m.malloc(14 * MiB);
  m.free(a);
  m.free(b);
  m.free(c);
  EXPECT_EQ(m.stats().reserved_bytes, 42 * MiB);  // cached, not returned
  EXPECT_EQ(m.stats().allocated_bytes, 0);
  // 13 MiB: the smallest free block that fits is c's 14 MiB; the rest (1 MiB)
  // is not more than 1 MiB, so the whole 14 MiB block is handed out.
  const auto d = m.malloc(13 * MiB);
  EXPECT_EQ(d, c);
  EXPECT_EQ(m.stats().allocated_bytes, 14 * MiB);
  EXPECT_EQ(m.stats().reserved_bytes, 42 * MiB);
  // 5 MiB: best fit is a's 12 MiB block, split (7 MiB left > 1 MiB).
  const auto e = m.malloc(5 * MiB);
  EXPECT_EQ(e, a);
  EXPECT_EQ(m.stats().allocated_bytes, 19 * MiB);
  EXPECT_EQ(m.stats().inactive_split_bytes, 7 * MiB);
  EXPECT_EQ(m.stats().num_device_allocs, 3);
}

TEST(CudaAllocatorModelTest, FreedBlocksMergeWithFreeNeighbours) {
  CudaCachingAllocatorModel m;
  const auto a = m.malloc(4 * MiB);  // one 20 MiB segment: [a 4][b 4][c 4][free 8]
  const auto b = m.malloc(4 * MiB);
  const auto c = m.malloc(4 * MiB);
  EXPECT_EQ(b - a, static_cast<uint64_t>(4 * MiB));
  m.free(b);  // [a][free 4][c][free 8]
  EXPECT_EQ(m.stats().inactive_split_bytes, 12 * MiB);
  auto segs = m.segments();
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(segs[0].blocks.size(), 4u);
  m.free(a);  // [free 8][c][free 8]: a merged with b's block
  segs = m.segments();
  EXPECT_EQ(segs[0].blocks.size(), 3u);
  EXPECT_EQ(segs[0].blocks[0].size_bytes, 8 * MiB);
  m.free(c);  // all merged: one free 20 MiB block, no longer split
  segs = m.segments();
  ASSERT_EQ(segs[0].blocks.size(), 1u);
  EXPECT_EQ(segs[0].blocks[0].size_bytes, 20 * MiB);
  EXPECT_EQ(m.stats().inactive_split_bytes, 0);
  // A request of 19 MiB takes the whole 20 MiB block (1 MiB left is not > 1 MiB).
  m.malloc(19 * MiB);
  EXPECT_EQ(m.stats().allocated_bytes, 20 * MiB);
  EXPECT_EQ(m.stats().reserved_bytes, 20 * MiB);
}

TEST(CudaAllocatorModelTest, BlocksAreReusedOnTheirStreamOnly) {
  CudaCachingAllocatorModel m;
  m.free(m.malloc(4 * MiB, /*stream=*/0));
  m.malloc(4 * MiB, /*stream=*/1);  // stream 0's cached segment is not used
  EXPECT_EQ(m.stats().reserved_bytes, 40 * MiB);
  m.malloc(4 * MiB, /*stream=*/0);  // this one is
  EXPECT_EQ(m.stats().reserved_bytes, 40 * MiB);
}

TEST(CudaAllocatorModelTest, MaxSplitSizeKeepsOversizeBlocksWhole) {
  CudaCachingAllocatorModel m(CudaAllocatorConfig::parse("max_split_size_mb:64"));
  EXPECT_EQ(m.config().max_split_size_bytes(), 64 * MiB);
  m.free(m.malloc(100 * MiB));  // an oversize 100 MiB segment, cached
  // 30 MiB (< 64 MiB) may not take an oversize block: a new 30 MiB segment.
  const auto a = m.malloc(30 * MiB);
  EXPECT_EQ(m.stats().reserved_bytes, 130 * MiB);
  m.free(a);
  // 90 MiB (>= 64 MiB) may take a cached oversize block less than 20 MiB larger:
  // 100 < 90 + 20, so the 100 MiB block, unsplit.
  const auto b = m.malloc(90 * MiB);
  EXPECT_EQ(m.stats().allocated_bytes, 100 * MiB);
  EXPECT_EQ(m.stats().reserved_bytes, 130 * MiB);
  m.free(b);
  // 70 MiB: 100 >= 70 + 20, too much rounding: a new 70 MiB segment.
  m.malloc(70 * MiB);
  EXPECT_EQ(m.stats().allocated_bytes, 70 * MiB);
  EXPECT_EQ(m.stats().reserved_bytes, 200 * MiB);
  // Without max_split_size the 70 MiB request would have split the 100 MiB block
  // (30 MiB left > 1 MiB): nothing new reserved.
  CudaCachingAllocatorModel plain;
  plain.free(plain.malloc(100 * MiB));
  plain.malloc(70 * MiB);
  EXPECT_EQ(plain.stats().reserved_bytes, 100 * MiB);
  EXPECT_EQ(plain.stats().allocated_bytes, 70 * MiB);
}

TEST(CudaAllocatorModelTest, ExpandableSegmentsGrowByPages) {
  CudaCachingAllocatorModel m(CudaAllocatorConfig::parse("expandable_segments:True"));
  // 4 MiB: one large expandable segment, one 20 MiB page mapped.
  const auto a = m.malloc(4 * MiB);
  EXPECT_EQ(m.stats().reserved_bytes, 20 * MiB);
  // 18 MiB: 16 MiB are free after a, one more page makes 36 MiB; split freely.
  const auto b = m.malloc(18 * MiB);
  EXPECT_EQ(b - a, static_cast<uint64_t>(4 * MiB));  // contiguous in the one segment
  EXPECT_EQ(m.stats().reserved_bytes, 40 * MiB);
  EXPECT_EQ(m.stats().allocated_bytes, 22 * MiB);
  // A request that ends 512 B short of the mapped end is split (>= 512 B left),
  // where a plain large segment would not split a remainder of <= 1 MiB.
  const auto c = m.malloc(18 * MiB - 512);
  EXPECT_EQ(c - b, static_cast<uint64_t>(18 * MiB));
  EXPECT_EQ(m.stats().allocated_bytes, 40 * MiB - 512);
  EXPECT_EQ(m.stats().reserved_bytes, 40 * MiB);
  // Small requests grow a small expandable segment by 2 MiB pages.
  m.malloc(1000);
  EXPECT_EQ(m.stats().reserved_bytes, 42 * MiB);
  // empty_cache() unmaps whole free pages: free a, b, c and the large
  // segment's two pages go back.
  m.free(a);
  m.free(b);
  m.free(c);
  m.empty_cache();
  EXPECT_EQ(m.stats().reserved_bytes, 2 * MiB);
  // The same requests without expandable segments: 20 + 18 + 18 + 2 MiB.
  CudaCachingAllocatorModel plain;
  plain.malloc(4 * MiB);
  plain.malloc(18 * MiB);
  plain.malloc(18 * MiB - 512);
  plain.malloc(1000);
  EXPECT_EQ(plain.stats().reserved_bytes, 58 * MiB);
}

TEST(CudaAllocatorModelTest, RoundupPower2Divisions) {
  CudaCachingAllocatorModel four(CudaAllocatorConfig::parse("roundup_power2_divisions:4"));
  // 1,200 B: 4 divisions apply only above 512 B x 4 = 2,048 B: plain 512 B rounding.
  EXPECT_EQ(four.round_size(1200), 1536);
  // 5,000 B: between 4,096 and 8,192, divisions of 1,024 B: 5,120 B.
  EXPECT_EQ(four.round_size(5000), 5120);
  // 3 MiB + 1 B: between 2 and 4 MiB, divisions of 512 KiB: 3.5 MiB.
  EXPECT_EQ(four.round_size(3 * MiB + 1), 3 * MiB + 512 * KiB);
  EXPECT_EQ(four.round_size(4 * MiB), 4 * MiB);  // a power of two stays
  // List form, keys in MiB: up to 256 MiB 1 division, [512 MiB, 1 GiB) 2, above 4.
  CudaCachingAllocatorModel list(CudaAllocatorConfig::parse("roundup_power2_divisions:[256:1,512:2,>:4]"));
  EXPECT_EQ(list.round_size(300 * MiB + 1), 300 * MiB + 512);          // 1 division: 512 B rounding
  EXPECT_EQ(list.round_size(600 * MiB + 1), 768 * MiB);                // 2 divisions of 512 MiB
  EXPECT_EQ(list.round_size(1536 * MiB + 1), 1792 * MiB);              // 4 divisions of 1 GiB
}

TEST(CudaAllocatorModelTest, DeviceCapacityFreesCacheThenFails) {
  CudaCachingAllocatorModel m(CudaAllocatorConfig().device_bytes(64 * MiB));
  m.free(m.malloc(30 * MiB));  // 30 MiB cached
  // 40 MiB: no cached block fits and 30 + 40 > 64: the cache is released
  // (the unsplit 30 MiB segment) and the allocation retried.
  const auto a = m.malloc(40 * MiB);
  EXPECT_NE(a, 0u);
  EXPECT_EQ(m.stats().num_alloc_retries, 1);
  EXPECT_EQ(m.stats().reserved_bytes, 40 * MiB);
  EXPECT_EQ(m.stats().num_device_frees, 1);
  // 30 MiB more cannot fit (40 + 30 > 64) and nothing is cached: out of memory.
  EXPECT_EQ(m.malloc(30 * MiB), 0u);
  EXPECT_EQ(m.stats().num_ooms, 1);
  EXPECT_EQ(m.stats().allocated_bytes, 40 * MiB);
}

// garbage_collection_threshold on a 100 MiB device (as with a memory
// fraction set). Large pool get_free_block calls: 1 (a), 2 (b); a and b are
// freed after call 2 (age base 2). c (40 MiB): call 3 finds no cached block
// of 40 MiB; reserved 60 MiB > 0.5 x 100 MiB, so the whole free segments at
// least as old as the average (ages 1 and 1, average 1) are returned: both,
// 60 MiB reclaimed against a 10 MiB target. Then c's 40 MiB segment. Without
// the threshold, c fits beside the cache: reserved peaks at 100 MiB.
TEST(CudaAllocatorModelTest, GarbageCollectionThresholdReturnsOldSegments) {
  auto run = [](const CudaAllocatorConfig& c) {
    CudaCachingAllocatorModel m(c);
    const auto a = m.malloc(30 * MiB);
    const auto b = m.malloc(30 * MiB);
    m.free(a);
    m.free(b);
    EXPECT_NE(m.malloc(40 * MiB), 0u);
    return m.stats();
  };
  const auto gc = run(CudaAllocatorConfig::parse("garbage_collection_threshold:0.5").device_bytes(100 * MiB));
  EXPECT_EQ(gc.num_device_frees, 2);
  EXPECT_EQ(gc.reserved_bytes, 40 * MiB);
  EXPECT_EQ(gc.peak_reserved_bytes, 60 * MiB);
  EXPECT_EQ(gc.num_alloc_retries, 0);
  const auto plain = run(CudaAllocatorConfig().device_bytes(100 * MiB));
  EXPECT_EQ(plain.num_device_frees, 0);
  EXPECT_EQ(plain.peak_reserved_bytes, 100 * MiB);
  // No device size (no memory fraction): the threshold does nothing, as on a GPU.
  const auto unbounded = run(CudaAllocatorConfig::parse("garbage_collection_threshold:0.5"));
  EXPECT_EQ(unbounded.peak_reserved_bytes, 100 * MiB);
  // The younger of two free segments stays: a is reused (call 3, exact fit)
  // and freed again at age base 3; b, freed at base 2, is older. Call 4 (c)
  // finds nothing; ages a 1, b 2, average 1.5: only b goes.
  CudaCachingAllocatorModel m(CudaAllocatorConfig::parse("garbage_collection_threshold:0.5").device_bytes(100 * MiB));
  const auto a = m.malloc(30 * MiB);
  const auto b = m.malloc(30 * MiB);
  m.free(a);
  m.free(b);
  m.free(m.malloc(30 * MiB));
  EXPECT_NE(m.malloc(40 * MiB), 0u);
  EXPECT_EQ(m.stats().num_device_frees, 1);
  EXPECT_EQ(m.stats().reserved_bytes, 70 * MiB);
}

TEST(CudaAllocatorModelTest, ReplayGivesPeaksOfATrace) {
  // A sawtooth: three 8 MiB activations, then freed in reverse while 4 MiB
  // gradients appear.
  std::vector<trainmem::AllocationEvent> t;
  for (uint64_t i = 1; i <= 3; ++i) {
    t.push_back({8 * MiB, i});
  }
  for (uint64_t i = 3; i >= 1; --i) {
    t.push_back({4 * MiB, 10 + i});
    t.push_back({-8 * MiB, i});
  }
  t.push_back({-1, 999});  // a free of something allocated before: ignored
  CudaCachingAllocatorModel m;
  const auto r = trainmem::replay(t, m);
  // Peak allocated: 3 x 8 + 4 = 28 MiB, at the first gradient (event 3).
  EXPECT_EQ(r.peak_allocated_bytes, 28 * MiB);
  EXPECT_EQ(r.peak_event, 3);
  // Reserved: 8 MiB < 10 MiB gets a 20 MiB segment, split: the second 8 MiB
  // shares it (4 MiB left, > 1 MiB: split), the third needs a new segment;
  // the 4 MiB gradient fits in the first segment's 4 MiB rest. 40 MiB.
  EXPECT_EQ(r.peak_reserved_bytes, 40 * MiB);
  EXPECT_EQ(r.stats.allocated_bytes, 12 * MiB);
  EXPECT_NEAR(r.fragmentation, 1.0 - 28.0 / 40.0, 1e-12);
}

TEST(CudaAllocatorModelTest, RejectsBadInput) {
  EXPECT_THROW(CudaAllocatorConfig::parse("max_split_size_mb:abc"), c10::Error);
  EXPECT_THROW(CudaAllocatorConfig::parse("max_split_size_mb:10"), c10::Error);  // must be > 20
  EXPECT_THROW(CudaAllocatorConfig::parse("expandable_segment:True"), c10::Error);  // misspelt key
  EXPECT_THROW(CudaAllocatorConfig::parse("roundup_power2_divisions:3"), c10::Error);  // not a power of 2
  EXPECT_NO_THROW(CudaAllocatorConfig::parse("garbage_collection_threshold:0.6,expandable_segments:False"));
  EXPECT_THROW(CudaAllocatorConfig::parse("garbage_collection_threshold:1.5"), c10::Error);  // must be in (0, 1)
  EXPECT_THROW(CudaAllocatorConfig::parse("garbage_collection_threshold:x"), c10::Error);
  CudaCachingAllocatorModel m;
  EXPECT_THROW(m.malloc(-1), c10::Error);
  EXPECT_THROW(m.free(12345), c10::Error);
}

} // namespace

TEST(CudaAllocatorModelTest, AddsSegmentsAtGivenAddresses) {
  trainmem::CudaCachingAllocatorModel cuda;
  const uint64_t base = 0x10000000;
  // A 20 MiB large segment: 4 MiB allocated, 16 MiB free.
  cuda.add_segment(base, 20 << 20, /*large_pool=*/true, 0,
                   {{base, 4 << 20, 4 << 20, true}, {base + (4 << 20), 16 << 20, 0, false}});
  EXPECT_EQ(cuda.stats().reserved_bytes, 20 << 20);
  EXPECT_EQ(cuda.stats().allocated_bytes, 4 << 20);
  EXPECT_EQ(cuda.stats().num_device_allocs, 0);
  EXPECT_EQ(cuda.malloc(2 << 20), base + (4 << 20));  // served from the free block
  cuda.free(base);                                      // the pre-existing block frees by address
  cuda.set_next_segment_address(0x40000000);
  EXPECT_EQ(cuda.malloc(30 << 20), 0x40000000u);       // a new cudaMalloc at the given address
  EXPECT_EQ(cuda.stats().num_device_allocs, 1);
  EXPECT_THROW(cuda.add_segment(0x80000000, 2 << 20, false, 0, {{0x80000000, 1 << 20, 0, false}}), c10::Error);
}

// An expandable segment whose first 20 MiB page was mapped before the model
// started (add_expandable_segment), an 8 MiB block live in it: 16 MiB more
// take the free 12 MiB left in that page and one more page mapped right
// after it (find_expandable_block takes the free block before the unmapped
// space), so the block starts at base + 8 MiB and the run grows to 40 MiB.
// Runs not whole pages from the base are refused, named.
TEST(CudaAllocatorModelTest, AddsExpandableSegmentsMappedBefore) {
  CudaCachingAllocatorModel m(CudaAllocatorConfig::parse("expandable_segments:True"));
  const uint64_t base = uint64_t{1} << 36;
  m.add_expandable_segment(base, /*large_pool=*/true, 0,
                           {{{base, 8 * MiB, 8 * MiB, true}, {base + 8 * MiB, 12 * MiB, 0, false}}});
  EXPECT_EQ(m.stats().reserved_bytes, 20 * MiB);
  EXPECT_EQ(m.stats().allocated_bytes, 8 * MiB);
  EXPECT_TRUE(m.is_allocated(base));
  EXPECT_EQ(m.malloc(16 * MiB), base + 8 * MiB);
  EXPECT_EQ(m.stats().num_device_allocs, 1);
  EXPECT_EQ(m.stats().reserved_bytes, 40 * MiB);
  const auto segs = m.segments();
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_TRUE(segs[0].expandable);
  EXPECT_EQ(segs[0].total_bytes, 40 * MiB);
  m.free(base);
  EXPECT_FALSE(m.is_allocated(base));
  CudaCachingAllocatorModel other(CudaAllocatorConfig::parse("expandable_segments:True"));
  try {
    other.add_expandable_segment(base, true, 0, {{{base + MiB, 20 * MiB, 0, false}}});
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("is not whole pages of 20971520 B from the segment's base"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

// Found by fuzzing (make fuzz): an expandable segment reserves address space
// for 1 1/8 of the device; a request larger than that ran off its end (a
// null block, SIGSEGV). It is out of memory, as on a GPU.
TEST(CudaAllocatorModelTest, ExpandableRequestBeyondTheAddressSpaceIsOutOfMemory) {
  CudaCachingAllocatorModel m(CudaAllocatorConfig::parse("expandable_segments:True").device_bytes(64 * MiB));
  EXPECT_EQ(m.malloc(100 * MiB), 0u);  // 64 MiB x 9/8 = 72 MiB of address space
  EXPECT_EQ(m.stats().num_ooms, 1);
  EXPECT_NE(m.malloc(30 * MiB), 0u);  // what fits still does
  EXPECT_EQ(m.stats().allocated_bytes, 30 * MiB);
}
