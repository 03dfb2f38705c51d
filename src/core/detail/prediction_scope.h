#pragma once
// A prediction running on this thread (never installed): the plan layer's
// predictions open one around the step they run on meta. While one is open,
// a MetaInitGuard records nothing (a prediction's step is not a
// construction: Note [Init replayed on materialize]).
#include "core/detail/init_record.h"

namespace trainmem::detail {

// Thread-local RAII; nests.
class PredictionScope {
 public:
  PredictionScope() { ++depth(); }
  ~PredictionScope() { --depth(); }
  PredictionScope(const PredictionScope&) = delete;
  PredictionScope& operator=(const PredictionScope&) = delete;

  // Whether a prediction is running on this thread.
  static bool active() { return depth() > 0; }

 private:
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
  InitRecordPause not_a_construction_;
};

} // namespace trainmem::detail
