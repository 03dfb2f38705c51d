#pragma once
// Internal links between trainmem features that save or hold tensors for
// backward and the meters that count them (never installed).
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>

namespace trainmem {
class SavedTensorMeter;
} // namespace trainmem

namespace trainmem::detail {

// Names the saves made while alive outside any ATen op (a custom autograd
// Function's save_for_backward), e.g. "CheckpointInputs". Thread-local, LIFO.
class SaveLabelGuard {
 public:
  explicit SaveLabelGuard(const char* label);
  ~SaveLabelGuard();
  SaveLabelGuard(const SaveLabelGuard&) = delete;
  SaveLabelGuard& operator=(const SaveLabelGuard&) = delete;

 private:
  const char* previous_;
};

// Tells every meter active on this thread that trainmem holds `tensor` for
// backward outside autograd's saved variables (the selective-checkpoint
// cache), under `label`. Deduplicated by storage like a saved tensor.
void record_held_tensor(const char* label, const at::Tensor& tensor) noexcept;

// Note [Naming nodes by sequence number] (meter.cpp): makes `meter` name the
// nodes of saves by their sequence numbers instead of an op callback, for
// the guards opened after this call. Such a meter learns a node's name from
// name_saved_nodes() (the graph's roots at backward) or from an output saved
// after its node is attached; what is still unnamed when the guard ends is
// "(unattributed)". Not while a guard on `meter` is active.
void name_nodes_by_sequence(SavedTensorMeter& meter);
// Names the pending saves of `meter` whose nodes `roots` reach. On the thread
// that the meter's guard meters, while it is active.
void name_saved_nodes(SavedTensorMeter& meter, const torch::autograd::edge_list& roots) noexcept;

// A save still waiting for its node's name: the node's sequence number, and
// the bytes and tensors saved under it.
struct WaitingSave {
  uint64_t seq;
  int64_t bytes;
  int64_t tensors;
};
// Saves taken out of a meter unnamed, so that a later backward of the same
// step may name them (Note [Saves named by a later backward]).
struct WaitingSaves {
  uint64_t thread = 0;       // the thread that made their nodes
  std::vector<WaitingSave> saves;  // ascending sequence numbers
};
// Takes the saves `meter` still waits to name (they are then not
// "(unattributed)" when its guard ends). While its guard is active.
WaitingSaves take_waiting_saves(SavedTensorMeter& meter) noexcept;
// Saves named after their node.
struct NamedSaves {
  std::string node;
  int64_t bytes = 0;
  int64_t tensors = 0;
};
// Names the saves of `waiting` whose nodes `roots` reach, one entry per node
// name, and removes them from `waiting`.
std::vector<NamedSaves> name_waiting_saves(WaitingSaves& waiting, const torch::autograd::edge_list& roots) noexcept;

} // namespace trainmem::detail
