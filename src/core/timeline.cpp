#include "trainmem/timeline.h"

#include <algorithm>

#include <c10/util/Exception.h>

namespace trainmem {

const char* category_name(Category category) {
  switch (category) {
    case Category::kParameter: return "PARAMETER";
    case Category::kGradient: return "GRADIENT";
    case Category::kOptimizerState: return "OPTIMIZER_STATE";
    case Category::kActivation: return "ACTIVATION";
    case Category::kTemporary: return "TEMPORARY";
    case Category::kInput: return "INPUT";
    case Category::kUnknown: return "unknown";
    case Category::kBeforeAudit: return "before the audit";
    case Category::kCommunication: return "COMMUNICATION";
    case Category::kBuffer: return "BUFFER";
  }
  return "unknown";
}

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kForward: return "forward";
    case Phase::kBackward: return "backward";
    case Phase::kOptimizerStep: return "optimizer step";
  }
  return "unknown";
}

std::string span_label(const PhaseSpan& span) {
  std::string label = phase_name(span.phase);
  if (!span.name.empty()) {
    label += " (" + span.name + ")";
  }
  return label;
}

int64_t TimelinePoint::total_bytes() const {
  int64_t sum = 0;
  for (auto b : bytes) {
    sum += b;
  }
  return sum;
}

std::vector<TimelinePoint> live_bytes(const Timeline& timeline, int64_t max_points) {
  TORCH_CHECK(max_points >= 0, "live_bytes: expected max_points >= 0, but got ", max_points);
  const size_t total = timeline.events.size() + 1;  // the baseline, then one point per event
  const bool thin = max_points > 0 && static_cast<int64_t>(total) > max_points;
  std::vector<TimelinePoint> out;
  out.reserve(thin ? static_cast<size_t>(max_points) + 1 : total);
  TimelinePoint p;
  p.time_ns = timeline.events.empty() ? 0 : timeline.events.front().time_ns;
  p.bytes = timeline.baseline_bytes;
  if (!thin) {
    out.push_back(p);
    for (const auto& e : timeline.events) {
      p.time_ns = e.time_ns;
      p.bytes[static_cast<int>(e.category)] += e.bytes;
      out.push_back(p);
    }
    return out;
  }
  // Keep the first and last points, and the fullest point of each stretch:
  // a plot of the thinned series still shows every peak's height. One pass,
  // never the whole series in memory (a long run has millions of events).
  const size_t stretches = static_cast<size_t>(std::max<int64_t>(max_points - 2, 1));
  const size_t n = total - 2;  // points strictly between the first and the last
  out.push_back(p);
  size_t stretch = 0;
  size_t hi = 1 + n / stretches;  // end (exclusive) of the current stretch
  bool have_best = false;
  TimelinePoint best;
  for (size_t i = 1; i < total; ++i) {
    const auto& e = timeline.events[i - 1];
    p.time_ns = e.time_ns;
    p.bytes[static_cast<int>(e.category)] += e.bytes;
    if (i == total - 1) {
      break;  // the last point, added below
    }
    while (i >= hi && stretch + 1 < stretches) {
      if (have_best) {
        out.push_back(best);
        have_best = false;
      }
      ++stretch;
      hi = 1 + (stretch + 1) * n / stretches;
    }
    if (!have_best || p.total_bytes() > best.total_bytes()) {
      best = p;
      have_best = true;
    }
  }
  if (have_best) {
    out.push_back(best);
  }
  out.push_back(p);
  return out;
}

} // namespace trainmem
