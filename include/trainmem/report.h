#pragma once
/// \file report.h
/// The audit report as plain data, and its writers: text, JSON (schema
/// "trainmem/1", docs/report.md), self-contained HTML with an inline SVG plot,
/// Chrome-trace/Perfetto JSON, and the memory_viz pickle that
/// pytorch.org/memory_viz and `python -m torch.cuda._memory_viz` read.
///
/// Example:
/// ```
/// trainmem::AuditReport r = audit.report();
/// std::cout << trainmem::to_text(r);
/// std::ofstream("report.html") << trainmem::to_html(r);
/// std::ofstream("trace.json") << trainmem::to_chrome_trace(r);
/// std::ofstream("snapshot.pickle", std::ios::binary)
///     << trainmem::to_memory_viz_pickle(audit.timeline());
/// ```

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "trainmem/export.h"
#include "trainmem/device.h"
#include "trainmem/format.h"  // with_commas, human_bytes (declared here before)
#include "trainmem/meter.h"
#include "trainmem/timeline.h"

namespace trainmem {

/// One static bucket (parameters, gradients, optimizer state...).
struct BucketBytes {
  std::string name;     ///< "parameters", "gradients", "optimizer state (exp_avg)"...
  Category category = Category::kUnknown;
  int64_t bytes = 0;    ///< in bytes, unique storages
};

/// One audited training step.
struct StepRecord {
  int64_t step = 0;               ///< from 0
  double time_ms = 0;             ///< wall time of the step, in milliseconds
  int64_t peak_bytes = 0;         ///< highest live bytes in the step
  int64_t forward_peak_bytes = 0; ///< highest live bytes in its forward phases
  int64_t backward_peak_bytes = 0;
  int64_t optimizer_peak_bytes = 0; ///< 0 when the step had no optimizer phase
  int64_t saved_activation_bytes = 0; ///< what autograd saved (meter), in bytes
  /// The meter ran in this step. False: it did not (AuditOptions::meter(),
  /// meter_every()), and saved_activation_bytes is the last metered step's.
  bool metered = true;
  /// A skipped step: the metered step whose allocations it repeated one for
  /// one (count, sizes and order, as the CPU tracker saw them), so its
  /// saved_activation_bytes are exact. -1: metered, or not known to repeat
  /// one (its saved_activation_bytes are then the last metered step's, not
  /// its own).
  int64_t repeats = -1;
};

/// Everything an audit found. Plain data: fill it yourself to render your own.
struct TRAINMEM_API AuditReport {
  std::string schema = "trainmem/1";
  std::string title = "train";
  /// Settings of the run, shown as given ("layers" -> "6", ...).
  std::vector<std::pair<std::string, std::string>> config;
  std::string device = "cpu";
  int64_t num_params = 0;
  std::vector<BucketBytes> buckets;          ///< static buckets, largest categories first
  int64_t saved_activation_bytes = 0;   ///< last step's saved tensors (meter), in bytes
  /// Of saved_activation_bytes, what stays on the device where it was saved.
  int64_t saved_device_bytes = 0;
  /// Of saved_activation_bytes, what saved-tensor hooks moved to host memory
  /// (offload).
  int64_t saved_host_bytes = 0;
  std::vector<NodeSavedBytes> saved_by_node; ///< top producers of saved bytes
  int64_t predicted_activation_bytes = -1;   ///< a prediction to compare with, or -1
  std::vector<StepRecord> steps;
  int64_t peak_bytes = 0;               ///< highest live bytes over all steps
  CategoryBytes peak_by_category{};     ///< what was live at that peak (timeline only)
  DeviceMemoryStats device_stats;       ///< at the end of the audit
  Fragmentation fragmentation;          ///< of device_stats
  std::vector<PhaseSpan> phases;        ///< every phase of every step
  std::vector<TimelinePoint> series;    ///< live bytes over time, thinned
  std::vector<std::string> notes;       ///< caveats worth reading

  /// Sum of bucket bytes, in bytes.
  int64_t static_bytes() const;
};

/// Minimum, median and maximum of one figure over steps (the median of an
/// even count is the lower middle value: always one step's own figure).
struct StepStat {
  int64_t min = 0;
  int64_t median = 0;
  int64_t max = 0;
};

/// Steps summarized phase by phase: what a long run's report shows instead
/// of one row per step.
struct StepSummary {
  int64_t num_steps = 0;
  StepStat peak_bytes;
  StepStat forward_peak_bytes;
  StepStat backward_peak_bytes;
  StepStat optimizer_peak_bytes;
  StepStat saved_activation_bytes;
  StepStat time_us; ///< wall time per step, in microseconds
};

/// Summarizes `steps` (all of them; saved_activation_bytes over the metered
/// ones and those that repeated one, zeros when none is). Throws if `steps` is empty.
TRAINMEM_API StepSummary summarize_steps(const std::vector<StepRecord>& steps);

/// Steps shown one row each in text and HTML; past it, the first few rows
/// and a min / median / max summary.
inline constexpr int64_t kMaxStepRows = 8;
/// Nodes of saved_by_node shown one row each in text; the rest are one
/// "other (N nodes)" row, so that the rows sum to the saved bytes.
inline constexpr size_t kMaxNodeRows = 8;

/// A table a person reads in a terminal.
TRAINMEM_API std::string to_text(const AuditReport& report);

/// One JSON document (schema "trainmem/1"); `indent` < 0 prints one line.
TRAINMEM_API std::string to_json(const AuditReport& report, int indent = 2);

/// Reads a document written by to_json(). Throws c10::Error naming what is
/// wrong (not JSON, another schema, a missing or mistyped key).
TRAINMEM_API AuditReport report_from_json(const std::string& json);

/// A self-contained HTML page: a Content-Security-Policy that forbids every
/// fetch, an inline SVG stacked-area plot of live bytes by category with
/// phase bands, the buckets, the steps and the top saved-tensor producers.
TRAINMEM_API std::string to_html(const AuditReport& report);

/// Chrome Trace Event JSON (chrome://tracing, ui.perfetto.dev): one counter
/// track per category (bytes) and one slice per phase.
TRAINMEM_API std::string to_chrome_trace(const AuditReport& report);

/// A memory_viz snapshot of a CPU timeline as a raw pickle: device_traces
/// with segment_alloc / alloc / free_requested / free_completed /
/// segment_free actions (each CPU block is its own segment; each entry has a
/// lowercase `category` key, as PyTorch's profiler snapshots do, and frames
/// naming category and phase), and one segment per block still live at the end.
TRAINMEM_API std::string to_memory_viz_pickle(const Timeline& timeline);

} // namespace trainmem
