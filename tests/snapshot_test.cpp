// Reads memory snapshots and replays them through CudaCachingAllocatorModel.
// The CS336 snapshots (2.7B-parameter Transformer LM on a GPU, batch 4,
// ctx 128) are read from $TRAINMEM_SNAPSHOT_DIR/cs336/ (default: the CMake
// cache variable TRAINMEM_SNAPSHOT_DIR); tests skip when they are absent.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include "trainmem/snapshot.h"

#ifndef TRAINMEM_SNAPSHOT_DIR
#define TRAINMEM_SNAPSHOT_DIR "/work/snapshots"
#endif

namespace {

using trainmem::parse_snapshot;

// A snapshot with one 2 MiB small segment holding one 1,000 B request, and
// a trace: segment_alloc then alloc. Protocol 4 with FRAME, MEMOIZE, BINGET.
std::string tiny_pickle() {
  std::string p = "\x80\x04\x95";
  p += std::string(8, '\0');
  auto str = [&](const std::string& s) {
    p += '\x8c';
    p += static_cast<char>(s.size());
    p += s;
    p += '\x94';
  };
  auto i4 = [&](int32_t v) {
    p += 'J';
    for (int k = 0; k < 4; ++k) p += static_cast<char>((v >> (8 * k)) & 0xff);
  };
  p += "}\x94(";  // root
  str("segments");
  p += "]\x94}\x94(";
  str("address"); i4(1 << 20);
  str("total_size"); i4(2 << 20);
  str("stream"); p += 'K'; p += '\0';
  str("segment_type"); str("small");
  str("blocks");
  p += "]\x94(}\x94(";
  p += "h\x04"; i4(1 << 20);  // BINGET "address" (memo 4)
  str("size"); p += "M"; p += '\x00'; p += '\x04';  // 1024
  str("requested_size"); i4(1000);
  str("state"); str("active_allocated");
  p += "u}\x94(";
  p += "h\x04"; i4((1 << 20) + 1024);
  p += "h\x0c"; i4((2 << 20) - 1024);  // BINGET "size" (memo 12)
  p += "h\x0d"; p += "K"; p += '\0';
  p += "h\x0e"; str("inactive");
  p += "ueu";   // end block 2, blocks list, segment dict
  p += "a";     // append segment
  str("device_traces");
  p += "]\x94]\x94(}\x94(";
  str("action"); str("segment_alloc");
  str("addr"); i4(1 << 20);
  p += "h\x0c"; i4(2 << 20);
  p += "u}\x94(h\x16"; str("alloc");
  p += "h\x18"; i4(1 << 20);
  p += "h\x0c"; i4(1000);
  p += "ueau.";
  return p;
}

std::string cs336(const std::string& name) {
  const char* env = std::getenv("TRAINMEM_SNAPSHOT_DIR");
  return std::string(env && *env ? env : TRAINMEM_SNAPSHOT_DIR) + "/cs336/" + name;
}

} // namespace

TEST(SnapshotTest, ReadsHandWrittenPickle) {
  const auto s = parse_snapshot(tiny_pickle());
  ASSERT_EQ(s.segments.size(), 1u);
  EXPECT_EQ(s.segments[0].total_bytes, 2 << 20);
  EXPECT_EQ(s.segments[0].segment_type, "small");
  ASSERT_EQ(s.segments[0].blocks.size(), 2u);
  EXPECT_EQ(s.segments[0].blocks[0].size_bytes, 1024);
  EXPECT_EQ(s.segments[0].blocks[0].requested_bytes, 1000);
  EXPECT_EQ(s.segments[0].blocks[1].state, "inactive");
  ASSERT_EQ(s.traces.size(), 2u);
  EXPECT_EQ(s.traces[0].action, "segment_alloc");
  EXPECT_EQ(s.traces[1].size_bytes, 1000);
}

TEST(SnapshotTest, ReplaysHandWrittenPickleExactly) {
  const auto r = trainmem::replay_snapshot(parse_snapshot(tiny_pickle()));
  EXPECT_TRUE(r.matches) << r.mismatch;
  EXPECT_EQ(r.recorded.peak_reserved_bytes, 2 << 20);
  EXPECT_EQ(r.model.peak_reserved_bytes, 2 << 20);
  EXPECT_EQ(r.recorded.num_segment_allocs, 1);
  EXPECT_EQ(r.model.num_segment_allocs, 1);
  EXPECT_EQ(r.model.peak_allocated_bytes, 1024);
}

TEST(SnapshotTest, RejectsEveryTruncation) {
  const auto p = tiny_pickle();
  for (size_t n = 0; n < p.size(); ++n) {
    EXPECT_THROW(parse_snapshot(p.substr(0, n)), c10::Error) << "prefix of " << n << " bytes";
  }
  try {
    parse_snapshot(p.substr(0, 40));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("byte"), std::string::npos) << e.what();
  }
}

TEST(SnapshotTest, RejectsCorruptedBytesWithoutCrashing) {
  const auto p = tiny_pickle();
  int num_errors = 0;
  for (size_t k = 0; k < p.size(); ++k) {
    for (int b : {0x00, 0x7f, 0xff, int('c'), int('R')}) {
      auto q = p;
      q[k] = static_cast<char>(b);
      try {
        parse_snapshot(q);
      } catch (const c10::Error&) {
        ++num_errors;
      }
    }
  }
  EXPECT_GT(num_errors, 0);
}

TEST(SnapshotTest, RejectsDeepNestingAndHostileSizes) {
  EXPECT_THROW(parse_snapshot("\x80\x02" + std::string(5000, '(')), c10::Error);
  EXPECT_THROW(parse_snapshot(std::string("\x80\x02X\xff\xff\xff\x7f", 7)), c10::Error);
  EXPECT_THROW(parse_snapshot(std::string("\x80\x02]\x94.", 5)), c10::Error);  // a list, not a snapshot
  EXPECT_THROW(parse_snapshot(std::string("\x80\x02h\x05.", 5)), c10::Error);  // memo never stored
  EXPECT_THROW(parse_snapshot(std::string("\x80\x02\x63os\nsystem\n.", 14)), c10::Error);  // GLOBAL
}

// Containers are closed once placed in another (Note [The snapshot
// reader]): a pickle that changes one after, puts one inside itself, or
// nests appends deeper than 1000 is refused, never read as a cycle.
TEST(SnapshotTest, RejectsCyclesAndLateChanges) {
  auto message = [](const std::string& p) {
    try {
      parse_snapshot(p);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(std::string("\x80\x02]2a.", 5)).find("inside itself"), std::string::npos);
  // L0 (memo 0) is appended to L1, then L1 popped and 1 appended to L0.
  EXPECT_NE(message(std::string("\x80\x02]\x94]h\x00" "a0K\x01" "a.", 14)).find("already placed"), std::string::npos);
  const std::string deep = "\x80\x02" + std::string(1100, ']') + std::string(1099, 'a') + ".";
  EXPECT_NE(message(deep).find("deeper than 1000"), std::string::npos);
}

// What torch's pickles do: every dict and list memoised, a frame dict or a
// whole frames list that recurs read back with BINGET. Both entries get the
// same kept stack: the Python frame first, then the C++ op past the
// allocator's plumbing.
TEST(SnapshotTest, SharedFramesThroughTheMemo) {
  std::string p = "\x80\x04";
  int memo = 0;
  auto put = [&] {
    p += '\x94';
    return memo++;
  };
  auto str = [&](const std::string& s) {
    p += '\x8c';
    p += static_cast<char>(s.size());
    p += s;
  };
  auto get = [&](int idx) {
    p += 'h';
    p += static_cast<char>(idx);
  };
  auto frame = [&](const std::string& name, const std::string& file, int line) {
    p += "}";
    const int m = put();
    p += "(";
    str("name"); str(name); str("filename"); str(file); str("line"); p += 'K'; p += static_cast<char>(line);
    p += "u";
    return m;
  };
  p += "}";
  put();
  p += "(";
  str("segments"); p += "]"; put();
  str("device_traces"); p += "]"; put(); p += "]"; put(); p += "(";
  p += "}"; put(); p += "(";
  str("action"); str("alloc"); str("addr"); p += "K\x40"; str("size"); p += "K\x20";
  str("frames"); p += "]";
  const int frames = put();
  p += "(";
  const int alloc_frame = frame("CUDACachingAllocator::malloc", "", 0);
  frame("at::native::mm", "", 0);
  frame("forward", "model.py", 7);
  get(alloc_frame);
  p += "eu";
  p += "}"; put(); p += "(";
  str("action"); str("free_completed"); str("addr"); p += "K\x40"; str("size"); p += "K\x20";
  str("frames"); get(frames);
  p += "ueau.";
  const auto s = parse_snapshot(p);
  ASSERT_EQ(s.traces.size(), 2u);
  EXPECT_EQ(s.traces[0].stack, s.traces[1].stack);
  const auto& f = s.frames(s.traces[1]);
  ASSERT_EQ(f.size(), 2u);
  EXPECT_EQ(f[0].filename, "model.py");
  EXPECT_EQ(f[0].line, 7);
  EXPECT_EQ(f[1].name, "at::native::mm");
  EXPECT_EQ(trainmem::frame_label(f), "model.py:7 forward");
  EXPECT_TRUE(s.frames(trainmem::TraceEntry{}).empty());
}

TEST(SnapshotTest, ReadMissingFileNamesIt) {
  try {
    trainmem::read_snapshot("/nonexistent/x.pickle");
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/x.pickle"), std::string::npos);
  }
}

// The figures below were measured by this replay and checked against
// Python: pickle.load of the same file, reserved walked back from
// the final segments through segment_alloc/segment_free.
TEST(SnapshotTest, ReplaysCs336ForwardMixedExactly) {
  const auto path = cs336("memory_ctx128_forward_mixed.pickle");
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no snapshot at " << path;
  const auto r = trainmem::replay_snapshot(trainmem::read_snapshot(path));
  EXPECT_EQ(r.num_events, 5992);
  EXPECT_EQ(r.preexisting_reserved_bytes, 13763608576);
  EXPECT_EQ(r.recorded.peak_reserved_bytes, 24245174272);
  EXPECT_EQ(r.recorded.num_segment_allocs, 461);
  EXPECT_EQ(r.recorded.num_segment_frees, 0);
  EXPECT_EQ(r.recorded.peak_requested_bytes, 23873313792);
  EXPECT_TRUE(r.matches) << r.mismatch;
  EXPECT_EQ(r.model.peak_reserved_bytes, r.recorded.peak_reserved_bytes);
  EXPECT_EQ(r.model.num_segment_allocs, 461);
  EXPECT_EQ(r.model.peak_allocated_bytes, 24024505344);
}

TEST(SnapshotTest, ReplaysCs336FullStepExactly) {
  const auto path = cs336("memory_ctx128_fullstep.pickle");
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no snapshot at " << path;
  const auto r = trainmem::replay_snapshot(trainmem::read_snapshot(path));
  EXPECT_EQ(r.num_events, 19342);
  EXPECT_EQ(r.recorded.peak_reserved_bytes, 61111009280);
  EXPECT_EQ(r.recorded.num_segment_allocs, 783);
  EXPECT_EQ(r.recorded.peak_requested_bytes, 54802667524);
  EXPECT_TRUE(r.matches) << r.mismatch;
  EXPECT_EQ(r.model.peak_reserved_bytes, 61111009280);
  EXPECT_EQ(r.model.num_segment_allocs, 783);
  EXPECT_EQ(r.model.peak_allocated_bytes, 55079000576);
  EXPECT_EQ(r.model_free_at_peak_bytes, 61111009280 - 55079000576);
  ASSERT_FALSE(r.stranded_at_peak.empty());
  EXPECT_EQ(r.stranded_at_peak[0].free_bytes, 78643200);
  const auto w = trainmem::what_if_snapshot(trainmem::read_snapshot(path), {"expandable_segments:True"});
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].peak_reserved_bytes, 55511613440);
}

// Two recordings of the CS336 repository bear this name (docs/cli.md):
// cs336_systems/memory_logs/'s, a torch.compile'd forward (2,896,391 B), and
// memory_files/'s, an eager one (1,037,065 B). Each is held to its own
// figures (events, cudaMalloc calls and the peak reserved as Python's pickle
// module counts them, tests/oracle/snapshot_figures.py).
TEST(SnapshotTest, ReplaysCs336ForwardExactly) {
  const auto path = cs336("memory_ctx128_forward.pickle");
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no snapshot at " << path;
  struct Figures {
    int64_t events, peak_reserved, mallocs, model_peak_allocated;
  };
  std::optional<Figures> want;
  const auto size = std::filesystem::file_size(path);
  if (size == 2'896'391) {
    want = Figures{8227, 17'878'220'800, 178, 17'738'153'984};
  } else if (size == 1'037'065) {
    want = Figures{4657, 19'667'091'456, 289, 19'498'420'224};
  }
  ASSERT_TRUE(want) << path << " has " << size << " B: neither recording of that name";
  const auto r = trainmem::replay_snapshot(trainmem::read_snapshot(path));
  EXPECT_EQ(r.num_events, want->events);
  EXPECT_EQ(r.recorded.peak_reserved_bytes, want->peak_reserved);
  EXPECT_EQ(r.recorded.num_segment_allocs, want->mallocs);
  // Seeded with the segments live before recording at their addresses, the
  // model puts every alloc at its recorded address (before that, re-allocating
  // those blocks into its own layout, it diverged at event 1,993 of the
  // compiled forward).
  EXPECT_TRUE(r.matches) << r.mismatch;
  EXPECT_EQ(r.model.peak_reserved_bytes, want->peak_reserved);
  EXPECT_EQ(r.model.num_segment_allocs, want->mallocs);
  EXPECT_EQ(r.model.peak_allocated_bytes, want->model_peak_allocated);
}

// Everything live at the recorded requested peak, grouped by where it was
// allocated (what `snapshot --diff` compares): the groups sum to the peak,
// in every recording present.
TEST(SnapshotTest, LiveAtPeakByFrameSumsToThePeak) {
  int checked = 0;
  for (const char* name : {"memory_ctx128_forward.pickle", "memory_ctx128_forward_mixed.pickle",
                           "memory_ctx128_fullstep.pickle", "memory_ctx512_fullstep_.pickle"}) {
    const auto path = cs336(name);
    if (!std::filesystem::exists(path)) continue;
    const auto r = trainmem::replay_snapshot(trainmem::read_snapshot(path));
    int64_t sum = 0;
    for (const auto& g : r.live_at_peak_by_frame) sum += g.requested_bytes;
    EXPECT_EQ(sum, r.recorded.peak_requested_bytes) << name;
    ASSERT_FALSE(r.live_at_peak_by_frame.empty());
    for (size_t k = 1; k < r.live_at_peak_by_frame.size(); ++k) {
      EXPECT_GE(r.live_at_peak_by_frame[k - 1].requested_bytes, r.live_at_peak_by_frame[k].requested_bytes);
    }
    ++checked;
  }
  if (checked == 0) GTEST_SKIP() << "no CS336 snapshot under " << cs336("");
}

// The input make fuzz first crashed on (tests/data/fuzz/): a small snapshot
// whose what-if on a 64 MiB device with expandable segments asked for more
// than the segment's address space. Parsed, replayed and what-if'd: no crash.
TEST(SnapshotTest, FuzzFoundInputsEndCleanly) {
  const std::string path = std::string(TRAINMEM_TEST_DATA_DIR) + "/fuzz/snapshot_expandable_past_space.pickle";
  try {
    const auto snap = trainmem::read_snapshot(path);
    trainmem::replay_snapshot(snap);
    const auto w = trainmem::what_if_snapshot(snap, {"expandable_segments:True"}, 64LL << 20);
    ASSERT_EQ(w.size(), 1u);
    EXPECT_GE(w[0].num_ooms, 1);
  } catch (const c10::Error& e) {
    SUCCEED() << e.what();  // a clear error is as good
  }
}
