#pragma once
/// \file timeline.h
/// Memory over time, coloured by what the bytes are. Every allocation and
/// free of an audited step carries a category (PyTorch's names: PARAMETER,
/// GRADIENT, OPTIMIZER_STATE, ACTIVATION, TEMPORARY, INPUT, unknown; and
/// COMMUNICATION for data-parallel buckets, BUFFER for module buffers) and a
/// phase (forward, backward, optimizer step). Audit (audit.h) records one;
/// the writers in report.h turn it into a Chrome trace, an HTML/SVG plot or
/// a memory_viz pickle.
///
/// Example:
/// ```
/// const trainmem::Timeline& t = audit.timeline();
/// for (const auto& p : trainmem::live_bytes(t, 200))
///   std::cout << p.time_ns << " " << p.total_bytes() << "\n";
/// ```

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "trainmem/export.h"

namespace trainmem {

/// What an allocation holds. Values are stable (they index arrays).
enum class Category : uint8_t {
  kParameter = 0,
  kGradient,
  kOptimizerState,
  kActivation, ///< made in forward, alive when backward starts
  kTemporary,  ///< made and freed within one phase, or freed before backward
  kInput,      ///< a tensor passed to Audit::mark_input(), or labelled so
  kUnknown,    ///< made while recording, live, but not attributable (caches)
  kBeforeAudit, ///< live before recording began and not named (a baseline)
  kCommunication, ///< buffers collectives run through (DDP's gradient buckets; distributed.h)
  /// A registered buffer of an audited module (BatchNorm's running_mean,
  /// running_var, num_batches_tracked): module state that is no parameter.
  /// Last, so that the values before it keep their numbers.
  kBuffer,
};
inline constexpr int kNumCategories = 10;

/// PyTorch's spelling: "PARAMETER", ..., "unknown"; and "before the audit",
/// "COMMUNICATION", "BUFFER" (PyTorch's memory tracker has no such
/// categories: it counts buffers with nothing, we name them).
TRAINMEM_API const char* category_name(Category category);

/// Part of a training step.
enum class Phase : uint8_t {
  kForward = 0,   ///< from the step's start to the first backward
  kBackward,      ///< inside backward() / autograd::grad()
  kOptimizerStep, ///< after the last backward until the step's end
};
inline constexpr int kNumPhases = 3;

/// "forward", "backward", "optimizer step".
TRAINMEM_API const char* phase_name(Phase phase);

/// Bytes per category, indexed by static_cast<int>(Category).
using CategoryBytes = std::array<int64_t, kNumCategories>;

/// One allocation (bytes > 0) or free (bytes < 0) inside an audited step.
struct MemoryEvent {
  int64_t time_ns = 0;   ///< since the audit started recording, in ns
  int64_t bytes = 0;     ///< + allocated, - freed, in bytes
  uint64_t address = 0;  ///< the block's address (pairs an alloc with its free)
  Category category = Category::kUnknown;
  Phase phase = Phase::kForward;
  int64_t step = 0;      ///< audited step, from 0
};

/// One phase of one step, with its peak and what was live at that peak.
struct PhaseSpan {
  Phase phase = Phase::kForward;
  /// Which one: the optimizer's name for an optimizer step ("D", "Adam"),
  /// the name given to Audit::begin_phase(); empty otherwise.
  std::string name;
  int64_t step = 0;
  int64_t begin_ns = 0;       ///< since the audit started recording, in ns
  int64_t end_ns = 0;         ///< in ns
  int64_t peak_bytes = 0;     ///< highest live bytes during the span
  CategoryBytes peak_by_category{}; ///< live bytes by category at that peak (timeline only)
  /// A backward's: what autograd saved in the forward it runs (its
  /// micro-batch, when the meter ran); -1 for other phases or unmetered.
  int64_t saved_bytes = -1;
};

/// "optimizer step (D)": the phase's name, with the span's name if any
/// ("forward (no grad)": a pass without grad over the audited parameters;
/// "optimizer step (inferred)": a step found with no optimizer added).
TRAINMEM_API std::string span_label(const PhaseSpan& span);

/// Everything recorded: live bytes by category before the first event, then
/// every event and the phases.
struct Timeline {
  std::string device = "cpu";
  CategoryBytes baseline_bytes{};   ///< live by category when recording began
  std::vector<MemoryEvent> events;  ///< oldest first
  std::vector<PhaseSpan> phases;    ///< in time order
  int64_t num_dropped_events = 0;   ///< events beyond the recording cap
};

/// Live bytes by category at one moment.
struct TRAINMEM_API TimelinePoint {
  int64_t time_ns = 0;
  CategoryBytes bytes{};
  /// Sum over categories, in bytes.
  int64_t total_bytes() const;
};

/// Live bytes by category after each event, starting with the baseline. With
/// `max_points` > 0 the series is thinned to at most about that many points,
/// keeping in each stretch the point with the most live bytes, so peaks
/// survive thinning.
TRAINMEM_API std::vector<TimelinePoint> live_bytes(const Timeline& timeline, int64_t max_points = 0);

} // namespace trainmem
