// trainmem snapshot: read a memory snapshot recorded on a GPU, check the
// allocator model against it, and replay it under other allocator settings.
#include <algorithm>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "trainmem/report.h"
#include "trainmem/snapshot.h"

namespace trainmem::cli {
namespace {

nlohmann::json figures_json(const SnapshotFigures& f) {
  return {{"peak_reserved_bytes", f.peak_reserved_bytes},
          {"peak_requested_bytes", f.peak_requested_bytes},
          {"peak_allocated_bytes", f.peak_allocated_bytes},
          {"num_segment_allocs", f.num_segment_allocs},
          {"num_segment_frees", f.num_segment_frees},
          {"peak_event", f.peak_event},
          {"allocated_at_peak_reserved_bytes", f.allocated_at_peak_reserved_bytes}};
}

// An allocation with no frames was live before recording began.
std::string where(const std::vector<SnapshotFrame>& frames) {
  return frames.empty() ? std::string("(before recording)") : frame_label(frames);
}

// What is live at OTHER's requested peak, by where it was allocated, minus
// the same at THIS one's: the places that grew, most first (frames name the
// category and phase in trainmem's own snapshots).
std::vector<LiveByFrame> grown(const SnapshotReplay& self, const SnapshotReplay& other) {
  std::map<std::string, LiveByFrame> by;
  for (const auto& x : other.live_at_peak_by_frame) by[x.frame] = x;
  for (const auto& x : self.live_at_peak_by_frame) {
    auto& e = by[x.frame];
    e.frame = x.frame;
    e.requested_bytes -= x.requested_bytes;
    e.num_allocations -= x.num_allocations;
  }
  std::vector<LiveByFrame> out;
  for (auto& [k, v] : by) {
    if (v.requested_bytes > 0) out.push_back(v);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.requested_bytes > b.requested_bytes; });
  return out;
}

// The trace's oom, explained (Note [An oom in a recording]).
void print_oom(const SnapshotOom& o) {
  std::cout << "out of memory at event " << with_commas(o.event) << ": " << with_commas(o.requested_bytes)
            << " B requested; the device had " << with_commas(o.device_free_bytes)
            << " B free (recorded), the allocator "
            << with_commas(o.reserved_bytes) << " B reserved: " << with_commas(o.device_total_bytes)
            << " B in all (the recording gives no device total)\n";
  std::cout << "  " << with_commas(o.allocated_bytes) << " B allocated, " << with_commas(o.free_in_segments_bytes)
            << " B free inside segments, the largest free block " << with_commas(o.largest_free_block_bytes)
            << " B (model, replayed to that event)\n";
  std::cout << "  live then, by where allocated:\n";
  for (size_t k = 0; k < o.live_by_frame.size() && k < 10; ++k) {
    const auto& g = o.live_by_frame[k];
    std::cout << "    " << with_commas(g.requested_bytes) << " B  (" << g.num_allocations << " allocations)  "
              << g.frame << "\n";
  }
}

void print_text(const std::string& title, const Snapshot& snap, const SnapshotReplay& r,
                const std::vector<SnapshotWhatIf>& w, int64_t device_bytes) {
  std::cout << title << ": " << with_commas(r.num_events) << " events, " << snap.segments.size()
            << " segments at the end, " << with_commas(r.num_preexisting_blocks) << " blocks live before recording ("
            << with_commas(r.preexisting_reserved_bytes) << " B reserved)\n";
  std::cout << "                          recorded          model\n";
  auto row = [](const char* name, int64_t a, int64_t b) {
    std::cout << "  " << name << std::string(24 - std::string(name).size(), ' ') << with_commas(a) << "  "
              << with_commas(b) << "\n";
  };
  row("peak reserved B", r.recorded.peak_reserved_bytes, r.model.peak_reserved_bytes);
  row("peak requested B", r.recorded.peak_requested_bytes, r.model.peak_requested_bytes);
  row("peak allocated B", r.recorded.peak_allocated_bytes, r.model.peak_allocated_bytes);
  row("cudaMalloc calls", r.recorded.num_segment_allocs, r.model.num_segment_allocs);
  row("cudaFree calls", r.recorded.num_segment_frees, r.model.num_segment_frees);
  row("peak reserved at event", r.recorded.peak_event, r.model.peak_event);
  if (snap.alloc_conf && !snap.alloc_conf->empty()) {
    std::cout << "replayed under the recording's PYTORCH_CUDA_ALLOC_CONF: " << *snap.alloc_conf << "\n";
  }
  std::cout << "replay: " << (r.matches ? "matches" : "diverges") << (r.matches ? "" : ": " + r.mismatch) << "\n";
  if (r.oom) print_oom(*r.oom);
  std::cout << "largest allocations live at the requested peak:\n";
  for (const auto& a : r.top_live_at_peak) {
    std::cout << "  " << with_commas(a.requested_bytes) << " B  " << where(a.frames) << "\n";
  }
  std::cout << "model at its reserved peak: " << with_commas(r.model_free_at_peak_bytes)
            << " B free inside segments, " << with_commas(r.model_free_in_unused_segments_bytes)
            << " B of it in segments with nothing allocated; partly used segments with the most free bytes:\n";
  for (const auto& st : r.stranded_at_peak) {
    std::cout << "  " << with_commas(st.free_bytes) << " B free of " << with_commas(st.total_bytes) << " B ("
              << (st.large_pool ? "large" : "small") << ", " << st.num_allocated_blocks << " allocated; largest from "
              << where(st.frames) << ")\n";
  }
  if (!w.empty()) {
    std::cout << "what if (replayed from an empty allocator"
              << (device_bytes > 0 ? " on a device of " + with_commas(device_bytes) + " B" : std::string()) << "):\n";
    // The lowest peak among the settings under which every request fit.
    size_t best = w.size();
    for (size_t k = 0; k < w.size(); ++k) {
      if (w[k].num_ooms == 0 && (best == w.size() || w[k].peak_reserved_bytes < w[best].peak_reserved_bytes)) {
        best = k;
      }
    }
    for (size_t k = 0; k < w.size(); ++k) {
      std::cout << "  " << (w[k].alloc_conf.empty() ? std::string("(defaults)") : w[k].alloc_conf)
                << ": peak reserved " << with_commas(w[k].peak_reserved_bytes) << " B, reserved-allocated "
                << with_commas(w[k].peak_reserved_bytes - w[k].allocated_at_peak_reserved_bytes) << " B, "
                << with_commas(w[k].num_segment_allocs) << " cudaMalloc"
                << (w[k].num_ooms > 0 ? ", " + with_commas(w[k].num_ooms) + " out of memory" : std::string())
                << (r.oom ? (w[k].num_ooms == 0 ? ", avoids the OOM" : ", the OOM stays") : "")
                << (k == best ? "  <- lowest" : "") << "\n";
    }
  }
}

nlohmann::json replay_json(const SnapshotReplay& r) {
  return {{"matches", r.matches},
          {"first_mismatch", r.first_mismatch ? nlohmann::json(*r.first_mismatch) : nlohmann::json()},
          {"mismatch", r.mismatch},
          {"num_events", r.num_events},
          {"recorded", figures_json(r.recorded)},
          {"model", figures_json(r.model)},
          {"model_free_at_peak_bytes", r.model_free_at_peak_bytes},
          {"model_free_in_unused_segments_bytes", r.model_free_in_unused_segments_bytes}};
}

nlohmann::json oom_json(const SnapshotOom& o) {
  nlohmann::json live = nlohmann::json::array();
  for (size_t k = 0; k < o.live_by_frame.size() && k < 10; ++k) {
    const auto& g = o.live_by_frame[k];
    live.push_back({{"frame", g.frame}, {"bytes", g.requested_bytes}, {"num_allocations", g.num_allocations}});
  }
  return {{"event", o.event},
          {"requested_bytes", o.requested_bytes},
          {"device_free_bytes", o.device_free_bytes},
          {"reserved_bytes", o.reserved_bytes},
          {"device_total_bytes", o.device_total_bytes},
          {"allocated_bytes", o.allocated_bytes},
          {"free_in_segments_bytes", o.free_in_segments_bytes},
          {"largest_free_block_bytes", o.largest_free_block_bytes},
          {"live_by_frame", live}};
}

// One device of the recording: its replay and its what-ifs.
struct DeviceRun {
  int64_t device = 0;
  // The device's part, when the recording has several (else the whole
  // recording is the device's). Held by value: a pointer into it
  // would dangle once the run is moved into its vector.
  std::optional<Snapshot> own;
  SnapshotReplay replay;
  std::vector<SnapshotWhatIf> what_if;
  int64_t what_if_device_bytes = 0;
};

nlohmann::json what_if_json(const DeviceRun& d) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& x : d.what_if) {
    out.push_back({{"alloc_conf", x.alloc_conf},
                   {"peak_reserved_bytes", x.peak_reserved_bytes},
                   {"allocated_at_peak_reserved_bytes", x.allocated_at_peak_reserved_bytes},
                   {"num_segment_allocs", x.num_segment_allocs},
                   {"num_ooms", x.num_ooms},
                   {"avoids_oom", d.replay.oom ? nlohmann::json(x.num_ooms == 0) : nlohmann::json()}});
  }
  return out;
}

nlohmann::json device_json(const DeviceRun& d) {
  return {{"device", d.device},
          {"replay", replay_json(d.replay)},
          {"what_if_device_bytes", d.what_if_device_bytes},
          {"what_if", what_if_json(d)},
          {"oom", d.replay.oom ? oom_json(*d.replay.oom) : nlohmann::json()}};
}

// Each device replayed against its own segments and trace; the what-ifs on
// `device_bytes`, else, after an oom, on the device size it recorded.
std::vector<DeviceRun> run_devices(const Snapshot& snap, const CudaAllocatorConfig& recorded_config,
                                   const std::vector<std::string>& confs, int64_t device_bytes) {
  std::vector<DeviceRun> out;
  auto devices = snapshot_devices(snap);
  if (devices.empty()) devices.push_back(0);
  for (const int64_t dev : devices) {
    DeviceRun d;
    d.device = dev;
    if (devices.size() > 1) d.own = device_snapshot(snap, dev);
    const Snapshot& part = d.own ? *d.own : snap;
    d.replay = replay_snapshot(part, recorded_config);
    d.what_if_device_bytes = device_bytes > 0 ? device_bytes : d.replay.oom ? d.replay.oom->device_total_bytes : 0;
    d.what_if = what_if_snapshot(part, confs, d.what_if_device_bytes);
    out.push_back(std::move(d));
  }
  return out;
}

struct SnapshotFlags {
  std::string input, diff, device_memory;
  std::vector<std::string> confs;
  bool json = false;
};

Snapshot load_snapshot(const std::string& path) {
  try {
    return read_snapshot(path);
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  }
}

// The settings replayed: the recorded ones ("") and each --alloc-conf, or,
// without any, a default set of what-ifs.
std::vector<std::string> snapshot_confs(const SnapshotFlags& f, int64_t device_bytes) {
  std::vector<std::string> confs{""};
  for (const auto& c : f.confs) {
    try {
      CudaAllocatorConfig::parse(c);
    } catch (const c10::Error& e) {
      throw UsageError("--alloc-conf " + c + ": " + e.what_without_backtrace());
    }
    confs.push_back(c);
  }
  if (f.confs.empty()) {
    confs = {"", "expandable_segments:True", "max_split_size_mb:128", "roundup_power2_divisions:4"};
    if (device_bytes > 0) {
      confs.push_back("garbage_collection_threshold:0.8");  // acts only on a device of known size
    }
  }
  return confs;
}

// The recording's own allocator settings, when it names any: the replay
// follows the rules the GPU ran under.
CudaAllocatorConfig recorded_config_of(const Snapshot& snap, const std::string& input) {
  CudaAllocatorConfig recorded_config;
  if (snap.alloc_conf && !snap.alloc_conf->empty()) {
    try {
      recorded_config = CudaAllocatorConfig::parse(*snap.alloc_conf);
    } catch (const c10::Error& e) {
      throw UsageError(input + ": its PYTORCH_CUDA_ALLOC_CONF \"" + *snap.alloc_conf +
                       "\" is not one the model knows: " + e.what_without_backtrace());
    }
  }
  return recorded_config;
}

nlohmann::json snapshot_json(const SnapshotFlags& f, const Snapshot& snap, const std::vector<DeviceRun>& runs,
                             const std::optional<SnapshotReplay>& other) {
  const auto& r = runs.front().replay;
  nlohmann::json j;
  j["kind"] = "snapshot";
  j["file"] = f.input;
  j["num_events"] = r.num_events;
  j["recorded_alloc_conf"] = snap.alloc_conf ? nlohmann::json(*snap.alloc_conf) : nlohmann::json();
  // Device 0 (or the only one) at the top, as before devices were read.
  j["replay"] = replay_json(r);
  j["what_if"] = what_if_json(runs.front());
  j["oom"] = r.oom ? oom_json(*r.oom) : nlohmann::json();
  j["devices"] = nlohmann::json::array();
  for (const auto& d : runs) j["devices"].push_back(device_json(d));
  if (other) {
    nlohmann::json grew = nlohmann::json::array();
    for (const auto& g : grown(r, *other)) {
      grew.push_back({{"frame", g.frame}, {"bytes", g.requested_bytes}, {"num_allocations", g.num_allocations}});
    }
    j["diff"] = {{"file", f.diff},
                 {"peak_reserved_bytes", other->recorded.peak_reserved_bytes - r.recorded.peak_reserved_bytes},
                 {"peak_requested_bytes", other->recorded.peak_requested_bytes - r.recorded.peak_requested_bytes},
                 {"num_segment_allocs", other->recorded.num_segment_allocs - r.recorded.num_segment_allocs},
                 {"grew_at_peak", grew}};
  }
  return j;
}

void print_snapshot(const SnapshotFlags& f, const Snapshot& snap, const std::vector<DeviceRun>& runs,
                    const std::optional<SnapshotReplay>& other) {
  const auto& r = runs.front().replay;
  for (const auto& d : runs) {
    if (runs.size() > 1) std::cout << (&d == &runs.front() ? "" : "\n");
    const std::string title = runs.size() > 1
        ? "snapshot " + f.input + ", device " + std::to_string(d.device) + " of " + std::to_string(runs.size())
        : "snapshot " + f.input;
    print_text(title, d.own ? *d.own : snap, d.replay, d.what_if, d.what_if_device_bytes);
  }
  if (other) {
    std::cout << "diff " << f.diff << " - " << f.input << ": peak reserved "
              << with_commas(other->recorded.peak_reserved_bytes - r.recorded.peak_reserved_bytes)
              << " B, peak requested "
              << with_commas(other->recorded.peak_requested_bytes - r.recorded.peak_requested_bytes)
              << " B, cudaMalloc calls "
              << (other->recorded.num_segment_allocs - r.recorded.num_segment_allocs) << "\n";
    const auto g = grown(r, *other);
    std::cout << "live at the requested peak, grown by where it was allocated (" << f.diff << " - " << f.input
              << "):\n";
    for (size_t k = 0; k < g.size() && k < 10; ++k) {
      std::cout << "  +" << with_commas(g[k].requested_bytes) << " B  (" << g[k].num_allocations << " allocations)  "
                << g[k].frame << "\n";
    }
  }
}

void run_snapshot(const SnapshotFlags& f) {
  const int64_t device_bytes = f.device_memory.empty() ? 0 : parse_bytes(f.device_memory);
  if (!f.device_memory.empty() && device_bytes <= 0) {
    throw UsageError("--device-memory: expected a size > 0, but got \"" + f.device_memory + "\"");
  }
  const Snapshot snap = load_snapshot(f.input);
  const auto confs = snapshot_confs(f, device_bytes);
  const auto runs = run_devices(snap, recorded_config_of(snap, f.input), confs, device_bytes);
  std::optional<SnapshotReplay> other;
  if (!f.diff.empty()) other = replay_snapshot(load_snapshot(f.diff));
  if (f.json) {
    std::cout << snapshot_json(f, snap, runs, other).dump(2) << "\n";
    return;
  }
  print_snapshot(f, snap, runs, other);
}

} // namespace

void add_snapshot_command(CLI::App& app) {
  auto f = std::make_shared<SnapshotFlags>();
  auto* sub = app.add_subcommand(
      "snapshot", "check the CUDA allocator model against a memory snapshot recorded on a GPU (_dump_snapshot)");
  sub->add_option("FILE", f->input, "a pickle written by torch.cuda.memory._dump_snapshot")->required();
  sub->add_option("--alloc-conf", f->confs, "replay under this PYTORCH_CUDA_ALLOC_CONF too (repeatable)");
  sub->add_option("--diff", f->diff, "compare with another snapshot");
  sub->add_option("--device-memory", f->device_memory,
                  "what-if on a device of this size (80GB, 141GiB): requests that do not fit fail, and "
                  "garbage_collection_threshold acts");
  sub->add_flag("--json", f->json, "print one JSON document");
  sub->callback([f] { run_snapshot(*f); });
}

} // namespace trainmem::cli
