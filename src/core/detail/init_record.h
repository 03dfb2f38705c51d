#pragma once
// The record of what a construction under a MetaInitGuard ran, and its replay
// on a real device by materialize() (never installed). See docs/design.md,
// Note [Init replayed on materialize].
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/Device.h>
#include <c10/core/DispatchKeySet.h>

namespace trainmem::detail {

class InterceptScope;
struct InitRecord;

// Starts a record on this thread if none is being made and recording is not
// paused (the outermost MetaInitGuard calls it); returns whether it did, and
// then end_init_record() must follow on this thread. The record lives on in
// the meta tensors it made (each carries it), and dies with the last of them.
bool begin_init_record();
void end_init_record();

// Runs `op` further down (scope.call_next) and, when this thread is making a
// record, appends it to the record if it is a factory or reads a tensor the
// record made, tagging the meta tensors it returns.
void call_recorded(const InterceptScope& scope, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                   torch::jit::Stack* stack, bool factory);

// Thread-local RAII: while alive, nothing is recorded on this thread (a
// prediction's step on meta, to_meta()). Nests.
class InitRecordPause {
 public:
  InitRecordPause();
  ~InitRecordPause();
  InitRecordPause(const InitRecordPause&) = delete;
  InitRecordPause& operator=(const InitRecordPause&) = delete;
};

// Whether `t` is a meta tensor that a record made (its values can be replayed).
bool has_init_record(const at::Tensor& t);

// Drops the record a tensor carries (it was given other storage or values).
void drop_init_record(const at::Tensor& t);

// Replays, on `device`, the records that made `tensors` (named meta tensors,
// each has_init_record()), in the order they were recorded, and returns each
// one's real counterpart, in order. Throws, naming the tensor and the op, if
// some step cannot be replayed; nothing is changed then.
std::vector<at::Tensor> replay_init(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                    c10::Device device);

} // namespace trainmem::detail
