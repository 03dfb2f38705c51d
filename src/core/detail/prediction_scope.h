#pragma once
// A prediction running on this thread (never installed): the plan layer's
// predictions open one around the step they run on meta. While one is open,
// a MetaInitGuard records nothing (a prediction's step is not a
// construction: Note [Init replayed on materialize]), and reads of values
// from meta tensors return documented ones and are counted (Note [Scalar
// reads inside a prediction]).
#include <memory>
#include <string>
#include <vector>

#include "core/detail/init_record.h"
#include "trainmem/meta.h"

namespace trainmem::detail {

// Thread-local RAII; nests (an inner scope's reads count in the outer one
// too).
class PredictionScope {
 public:
  PredictionScope();
  ~PredictionScope();
  PredictionScope(const PredictionScope&) = delete;
  PredictionScope& operator=(const PredictionScope&) = delete;

  // Whether a prediction is running on this thread.
  static bool active();

  // The reads of values from meta tensors in this scope so far, by op and
  // value returned, in the order first seen.
  std::vector<ScalarRead> scalar_reads() const;

  struct Impl;  // scalar_reads.cpp's

 private:
  std::unique_ptr<Impl> impl_;
};

// The line to_string() of a prediction prints for its scalar_reads ("" when
// there are none; Note [Scalar reads inside a prediction]).
std::string scalar_reads_line(const std::vector<ScalarRead>& reads);

// The Meta kernel of aten::_local_scalar_dense (`.item()`): 0 (false for a
// bool) inside a prediction, counted; outside one it throws as LibTorch does.
at::Scalar local_scalar_dense_meta(const at::Tensor& self);

} // namespace trainmem::detail
