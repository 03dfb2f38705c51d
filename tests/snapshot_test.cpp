// Reads memory snapshots and replays them through CudaCachingAllocatorModel.
// The CS336 snapshots (2.7B-parameter Transformer LM on a GPU, batch 4,
// ctx 128) are read from $TRAINMEM_SNAPSHOT_DIR/cs336/ (default: the CMake
// cache variable TRAINMEM_SNAPSHOT_DIR); tests skip when they are absent.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <utility>
#include <vector>
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

namespace {

// A real recording gathered outside the repository (no licence allows a
// copy): $TRAINMEM_SNAPSHOT_DIR/recordings/OWNER+REPO/FILE.
std::string recording(const std::string& name) {
  const char* env = std::getenv("TRAINMEM_SNAPSHOT_DIR");
  return std::string(env && *env ? env : TRAINMEM_SNAPSHOT_DIR) + "/recordings/" + name;
}

// A stripped copy stored in the repository (tests/data/recordings/, each
// with a NOTE): always present.
std::string stored(const std::string& name) {
  return std::string(TRAINMEM_TEST_DATA_DIR) + "/recordings/" + name;
}

const char* const kConstructorSun = "Constructor-Sun+code_location/memory_snapshot.pickle";

} // namespace

// Three GPUs of one DataParallel process in one pickle (github.com/
// Constructor-Sun/code_location, 52e52b2), expandable segments. Each device
// is replayed against its own segments and trace; before, the recorded peak
// reserved was every device's segments summed (114,628,231,168 B, the sum
// of the three peaks below) and the replay diverged at event 1.
TEST(SnapshotTest, ReplaysEachDeviceOfAThreeGpuRecording) {
  const auto path = recording(kConstructorSun);
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no recording at " << path;
  const auto snap = trainmem::read_snapshot(path);
  ASSERT_EQ(trainmem::snapshot_devices(snap), (std::vector<int64_t>{0, 1, 2}));
  ASSERT_TRUE(snap.alloc_conf);
  const auto config = trainmem::CudaAllocatorConfig::parse(*snap.alloc_conf);
  EXPECT_TRUE(config.expandable_segments());
  struct Figures {
    int64_t device, events, peak_reserved, maps, unmaps, peak_requested;
  };
  for (const auto& want : {Figures{0, 6445, 8'541'700'096, 175, 0, 8'456'473'388},
                           Figures{1, 596, 84'202'749'952, 40, 6, 84'063'351'764},
                           Figures{2, 882, 21'883'781'120, 78, 0, 21'564'645'800}}) {
    const auto r = trainmem::replay_snapshot(trainmem::device_snapshot(snap, want.device), config);
    EXPECT_EQ(r.num_events, want.events) << "device " << want.device;
    EXPECT_EQ(r.recorded.peak_reserved_bytes, want.peak_reserved) << "device " << want.device;
    EXPECT_EQ(r.recorded.peak_requested_bytes, want.peak_requested) << "device " << want.device;
    // segment_map/segment_unmap count as cudaMalloc/cudaFree.
    EXPECT_EQ(r.recorded.num_segment_allocs, want.maps) << "device " << want.device;
    EXPECT_EQ(r.recorded.num_segment_frees, want.unmaps) << "device " << want.device;
    EXPECT_TRUE(r.matches) << "device " << want.device << ": " << r.mismatch;
    EXPECT_EQ(r.model.peak_reserved_bytes, want.peak_reserved) << "device " << want.device;
    EXPECT_EQ(r.model.num_segment_allocs, want.maps) << "device " << want.device;
    EXPECT_EQ(r.model.num_segment_frees, want.unmaps) << "device " << want.device;
  }
  // The snapshot as a whole replays device 0.
  EXPECT_EQ(trainmem::replay_snapshot(snap, config).recorded.peak_reserved_bytes, 8'541'700'096);
}

// Device 1's trace holds an oom: six segment_unmaps (the cache released),
// one map and alloc of 5,308,694,528 B, then the same request again, which
// failed with 95,682,560 B free on the device.
TEST(SnapshotTest, ExplainsTheOomOfARecording) {
  const auto path = recording(kConstructorSun);
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no recording at " << path;
  const auto snap = trainmem::device_snapshot(trainmem::read_snapshot(path), 1);
  const auto r = trainmem::replay_snapshot(snap, trainmem::CudaAllocatorConfig::parse(*snap.alloc_conf));
  ASSERT_TRUE(r.oom);
  const auto& o = *r.oom;
  EXPECT_EQ(o.event, 421);
  EXPECT_EQ(o.requested_bytes, 5'308'694'528);
  EXPECT_EQ(o.device_free_bytes, 95'682'560);
  EXPECT_EQ(o.reserved_bytes, 84'202'749'952);
  EXPECT_EQ(o.device_total_bytes, 84'298'432'512);
  EXPECT_EQ(o.allocated_bytes, 84'063'358'976);
  EXPECT_EQ(o.free_in_segments_bytes, 139'390'976);
  EXPECT_EQ(o.largest_free_block_bytes, 17'313'792);
  ASSERT_FALSE(o.live_by_frame.empty());
  EXPECT_EQ(o.live_by_frame[0].requested_bytes, 31'867'719'984);
  EXPECT_NE(o.live_by_frame[0].frame.find("models.py:174 update_nodes"), std::string::npos);
  // On a device of the recorded size the recording's own setting fails the
  // same request once; none of the others avoids an OOM either.
  const auto w = trainmem::what_if_snapshot(
      snap, {"", "expandable_segments:True", "max_split_size_mb:128", "roundup_power2_divisions:4"},
      o.device_total_bytes);
  ASSERT_EQ(w.size(), 4u);
  EXPECT_EQ(w[0].num_ooms, 2);
  EXPECT_EQ(w[1].num_ooms, 1);
  EXPECT_EQ(w[1].peak_reserved_bytes, 84'202'749'952);
  EXPECT_EQ(w[2].num_ooms, 1);
  EXPECT_EQ(w[3].num_ooms, 3);
}

// A compiled step recorded after warm-up (stored copy of
// bcrafton/assignment2-systems): no segment event, 447 blocks live before
// recording. It diverged at event 0 (4,081,057,792 B modelled against
// 4,238,344,192 B reserved): blocks freed in the trace took the size of
// the free block left at their address (Note [A block's size before
// recording]) and their segments went unseeded.
TEST(SnapshotTest, StoredCopyOfACompiledStepBegunMidRunReplaysExactly) {
  const auto r = trainmem::replay_snapshot(trainmem::read_snapshot(stored("bcrafton_cs336_compiled_step.pickle")));
  EXPECT_EQ(r.num_events, 6486);
  EXPECT_EQ(r.num_preexisting_blocks, 447);
  EXPECT_EQ(r.preexisting_reserved_bytes, 4'238'344'192);
  EXPECT_EQ(r.recorded.peak_reserved_bytes, 4'238'344'192);
  EXPECT_EQ(r.recorded.peak_requested_bytes, 3'849'232'640);
  EXPECT_EQ(r.recorded.num_segment_allocs, 0);
  EXPECT_TRUE(r.matches) << r.mismatch;
  EXPECT_EQ(r.model.peak_reserved_bytes, 4'238'344'192);
  EXPECT_EQ(r.model.peak_allocated_bytes, 3'861'684'736);
}

// A training run begun mid-run (stored copy of Wedsonlin/assignment2-systems):
// a live block's unsplit 983,040 B remainder shows only in where event 179's
// 8 MiB alloc lands; without it the model put that alloc in another segment.
TEST(SnapshotTest, StoredCopyOfATrainingRunBegunMidRunReplaysExactly) {
  const auto r =
      trainmem::replay_snapshot(trainmem::read_snapshot(stored("wedsonlin_cs336_medium_512_training.pickle")));
  EXPECT_EQ(r.num_events, 22332);
  EXPECT_EQ(r.num_preexisting_blocks, 664);
  EXPECT_EQ(r.preexisting_reserved_bytes, 12'593'397'760);
  EXPECT_EQ(r.recorded.peak_reserved_bytes, 12'660'506'624);
  EXPECT_EQ(r.recorded.peak_requested_bytes, 12'426'629'128);
  EXPECT_EQ(r.recorded.num_segment_allocs, 1);
  EXPECT_TRUE(r.matches) << r.mismatch;
  EXPECT_EQ(r.model.num_segment_allocs, 1);
  EXPECT_EQ(r.model.peak_allocated_bytes, 12'434'494'464);
}

// Private pools (vLLM's CUDA graphs, stored copy of volcengine/verl) and the
// 2.0-era format, whose blocks carry no address (Yiyi-philosophy/LLM-inference).
TEST(SnapshotTest, StoredCopiesOfPrivatePoolsAndTheOldFormatAreRead) {
  const auto verl = trainmem::read_snapshot(stored("verl_private_pools.pickle"));
  std::set<std::pair<int64_t, int64_t>> pools;
  for (const auto& s : verl.segments) pools.insert(s.pool_id);
  EXPECT_EQ(pools, (std::set<std::pair<int64_t, int64_t>>{{0, 0}, {0, 1}, {0, 2}}));
  const auto r = trainmem::replay_snapshot(verl);
  EXPECT_EQ(r.num_events, 0);
  EXPECT_EQ(r.recorded.peak_reserved_bytes, 26'189'234'176);
  EXPECT_EQ(r.recorded.peak_requested_bytes, 25'483'614'352);
  EXPECT_TRUE(r.matches) << r.mismatch;
  const auto old = trainmem::read_snapshot(stored("yiyi_torch20_oom_snapshot.pickle"));
  ASSERT_FALSE(old.segments.empty());
  for (const auto& s : old.segments) {
    ASSERT_FALSE(s.blocks.empty());
    EXPECT_EQ(s.blocks.front().address, s.address);  // blocks tile the segment
  }
  const auto o = trainmem::replay_snapshot(old);
  EXPECT_TRUE(o.matches) << o.mismatch;
  EXPECT_EQ(o.recorded.peak_reserved_bytes, 11'844'714'496);
  EXPECT_EQ(o.recorded.peak_requested_bytes, 11'840'159'744);
}

namespace {

using trainmem::SnapshotBlock;
using trainmem::SnapshotSegment;
using trainmem::TraceEntry;

constexpr int64_t kMiB = 1 << 20;

SnapshotSegment expandable_segment(uint64_t address, const char* type, std::vector<SnapshotBlock> blocks) {
  SnapshotSegment sg;
  sg.address = address;
  sg.segment_type = type;
  sg.expandable = true;
  for (const auto& b : blocks) sg.total_bytes += b.size_bytes;
  sg.blocks = std::move(blocks);
  return sg;
}

} // namespace

// Note [Expandable segments mapped before recording], on a recording made
// by hand by the allocator's rules (expandable_segments:True, 20 MiB large
// pages): 20 MiB mapped before recording at B holding an 8 MiB block live
// then. The trace allocates 4 MiB (the front of the free 12 MiB, at B + 8
// MiB), then 16 MiB: find_expandable_block takes the free 8 MiB left at B +
// 12 MiB with the unmapped space after it and maps one 20 MiB page at B + 20
// MiB (segment_map), and the block starts at B + 12 MiB. The final snapshot
// shows one 40 MiB run. Unseeded, the 8 MiB block mapped pages of its own
// and the replay diverged at the first alloc.
TEST(SnapshotTest, ReplaysExpandablePagesMappedBeforeRecording) {
  const uint64_t B = uint64_t{1} << 36;
  trainmem::Snapshot snap;
  snap.alloc_conf = "expandable_segments:True";
  snap.segments.push_back(expandable_segment(B, "large", {{B, 8 * kMiB, 8 * kMiB, "active_allocated"},
                                                          {B + 8 * kMiB, 4 * kMiB, 4 * kMiB, "active_allocated"},
                                                          {B + 12 * kMiB, 16 * kMiB, 16 * kMiB, "active_allocated"},
                                                          {B + 28 * kMiB, 12 * kMiB, 0, "inactive"}}));
  snap.traces = {TraceEntry{"alloc", B + 8 * kMiB, 4 * kMiB}, TraceEntry{"segment_map", B + 20 * kMiB, 20 * kMiB},
                 TraceEntry{"alloc", B + 12 * kMiB, 16 * kMiB}};
  const auto config = trainmem::CudaAllocatorConfig::parse(*snap.alloc_conf);
  const auto r = trainmem::replay_snapshot(snap, config);
  EXPECT_EQ(r.num_preexisting_blocks, 1);
  EXPECT_EQ(r.preexisting_reserved_bytes, 20 * kMiB);
  EXPECT_EQ(r.recorded.peak_reserved_bytes, 40 * kMiB);
  EXPECT_EQ(r.recorded.num_segment_allocs, 1);
  EXPECT_TRUE(r.matches) << r.mismatch;
  EXPECT_EQ(r.model.peak_reserved_bytes, 40 * kMiB);
  EXPECT_EQ(r.model.num_segment_allocs, 1);
  EXPECT_EQ(r.model.peak_allocated_bytes, 28 * kMiB);
}

// The two-GPU form of albi2/thesis-text-to-SQL's dump_snapshot.pickle at
// b4c280e (expandable_segments:True, an empty trace on each device), its
// segments written here as the file has them: device 0 a 2 MiB small run with
// two 15,872 B blocks and a 40 MiB large run with the 8,519,680 B cuBLAS
// workspace 16,120,832 B in. The replay modelled 23,068,672 B reserved (each
// live block mapping pages of its own) against 44,040,192 B recorded.
TEST(SnapshotTest, ReplaysASnapshotOfExpandableSegmentsWithoutATrace) {
  trainmem::Snapshot snap;
  snap.alloc_conf = "expandable_segments:True,max_split_size_mb:128";
  const uint64_t S = 17'213'423'616, L = 39'606'812'672;
  snap.segments.push_back(expandable_segment(S, "small", {{S, 180'224, 256, "inactive"},
                                                          {S + 180'224, 15'872, 15'704, "active_allocated"},
                                                          {S + 196'096, 15'872, 15'704, "active_allocated"},
                                                          {S + 211'968, 1'885'184, 0, "inactive"}}));
  snap.segments.push_back(expandable_segment(L, "large", {{L, 16'120'832, 0, "inactive"},
                                                          {L + 16'120'832, 8'519'680, 8'519'680, "active_allocated"},
                                                          {L + 24'640'512, 17'302'528, 0, "inactive"}}));
  const auto r = trainmem::replay_snapshot(snap, trainmem::CudaAllocatorConfig::parse(*snap.alloc_conf));
  EXPECT_EQ(r.num_preexisting_blocks, 3);
  EXPECT_EQ(r.recorded.peak_reserved_bytes, 44'040'192);
  EXPECT_TRUE(r.matches) << r.mismatch;
  EXPECT_EQ(r.model.peak_reserved_bytes, 44'040'192);
  EXPECT_EQ(r.model.peak_allocated_bytes, 8'519'680 + 2 * 15'872);
}

// Ten streams on one device (github.com/Maphsge4/select_n at 04d383c, no
// licence: read from $TRAINMEM_SNAPSHOT_DIR/recordings, skipped elsewhere): a
// compute stream and eight load streams, 242 switches between them, each
// stream's free blocks reused by that stream alone. Replayed exactly:
// 584 cudaMalloc and 579 cudaFree at the recorded events, every block at its
// recorded address, peak reserved 22,519,218,176 B.
TEST(SnapshotTest, ReplaysARecordingWithTenStreams) {
  const auto path = recording("Maphsge4+select_n/snapshot_04d383c.pickle");
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no recording at " << path;
  const auto snap = trainmem::read_snapshot(path);
  std::set<int64_t> streams;
  for (const auto& e : snap.traces) streams.insert(e.stream);
  EXPECT_EQ(streams.size(), 10u);
  const auto r = trainmem::replay_snapshot(snap);
  EXPECT_EQ(r.num_events, 10327);
  EXPECT_EQ(r.recorded.num_segment_allocs, 584);
  EXPECT_EQ(r.recorded.num_segment_frees, 579);
  EXPECT_EQ(r.recorded.peak_reserved_bytes, 22'519'218'176);
  EXPECT_TRUE(r.matches) << r.mismatch;
  EXPECT_EQ(r.model.num_segment_allocs, 584);
  EXPECT_EQ(r.model.peak_reserved_bytes, 22'519'218'176);
  EXPECT_EQ(r.model.peak_requested_bytes, 20'802'383'104);
}
