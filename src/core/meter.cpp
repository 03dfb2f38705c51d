#include "trainmem/meter.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <string_view>
#include <typeinfo>
#include <unordered_map>

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/flat_hash_map.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/tensor.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include "core/detail/prediction_scope.h"
#include "detail/attribution.h"
#include "detail/node_type.h"
#include "detail/save_observer.h"
#include "detail/thread_id.h"
#include "trainmem/hooks.h"

// Note [Naming TorchScript's graph nodes]
// A TorchScript module run with grad soon executes differentiable graphs: one
// interpreter op, with no RecordFunction of its own, that captures its inputs
// (before running) and outputs (after) as saved variables of one
// DifferentiableGraphBackward node, outside any ATen op. So saves made
// outside any op and unlabelled form a group: it takes the node's name from
// the first saved output whose grad_fn is a differentiable graph, collects
// the names of the top-level ops that run meanwhile (the graph's ops, which
// build no autograd graph themselves), and ends at the next op that builds
// graph, at a save of another node, or when the scope ends:
// "DifferentiableGraphBackward(aten::linear, aten::relu)". Without such a
// node (a custom C++ autograd Function) the group is "CppFunction".

// Note [Attributing saved tensors to autograd nodes]
// A pack hook receives only the tensor: not the node being built. The node
// exists once the op that saves returns: its outputs carry it as grad_fn. So
// the meter queues each pack as "pending" and, while a scope is active on the
// thread, a thread-local RecordFunction callback (which sees outputs) hands the
// pending bytes to the first output's grad_fn name when the innermost ATen op
// ends. Saves made outside any op (custom autograd Functions, whose
// save_for_backward runs after the function's forward) are attributed at once
// to the label a trainmem feature set with detail::SaveLabelGuard, or to
// "CppFunction" otherwise.

// Note [Naming nodes by sequence number]
// An op callback costs every op of the metered code a RecordFunction (about
// 0.3 us with its outputs boxed, docs/benchmarks.md): on a step of 2,000 tiny
// ops that is a tenth of the step. A meter made with
// name_nodes_by_sequence() (the audit's) adds none outside TorchScript. It
// uses what autograd already keeps: an autograd kernel makes its node (which
// takes the thread's next sequence number) before it saves inputs and
// outputs, and the ops it redispatches to make no node (but one: an in-place
// op that needs its input's old values clones it through autograd, so a
// saved clone whose CloneBackward0 is the newest node was saved by the node
// before). So at a save the saving node is the last one made on the thread,
// number at::sequence_number::peek() - 1 (a custom Function's node too: its
// forward runs without grad, and save_for_backward follows). The save waits under
// that number; an output saved after its node is attached names it at once;
// the rest are named when backward begins, by a walk of the graph from its
// roots (nodes only lead to older nodes of the thread, so the walk stops
// below the oldest number waiting). A node that an in-place op on a view
// wraps in CopySlices is reached through the wrapper and named as itself
// (MulBackward0), where the op callback names the op's output's grad_fn, the
// view's regenerated AsStridedBackward0. Saves whose node backward never
// reaches (no backward inside the guard, a branch the loss does not use)
// end "(unattributed)".
// TorchScript's differentiable graphs save outside any op and must be named
// by their ops (Note [Naming TorchScript's graph nodes]), so while a
// TorchScript function runs (a callback on that scope alone, which ATen's
// ops never pay for) the op callback is on as for any meter.

namespace trainmem {
namespace detail {

namespace {
using StorageKey = const c10::StorageImpl*;
using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;

thread_local const char* tls_save_label = nullptr;
thread_local int64_t tls_op_depth = 0;
// TorchScript functions running on this thread (Note [Naming nodes by sequence number]).
thread_local int64_t tls_script_depth = 0;

// Walks the graph from `roots` to the nodes of `saves` (ascending sequence
// numbers, made on `thread`) and calls found(i, node) once for each save i
// whose node it reaches. Nodes only lead to older nodes of the thread, so
// the walk stops below the oldest save.
template <typename Found>
void walk_to_saves(const std::vector<WaitingSave>& saves, uint64_t thread, const torch::autograd::edge_list& roots,
                   Found&& found) {
  if (saves.empty()) {
    return;
  }
  const uint64_t lo = saves.front().seq;
  const uint64_t hi = at::sequence_number::peek();  // no node of the thread is newer
  if (hi <= lo) {
    return;
  }
  std::vector<bool> hit(saves.size(), false);
  size_t named = 0;
  auto name = [&](uint64_t seq, const torch::autograd::Node& node) {
    auto it = std::lower_bound(saves.begin(), saves.end(), seq,
                               [](const WaitingSave& n, uint64_t s) { return n.seq < s; });
    if (it != saves.end() && it->seq == seq) {
      const auto i = static_cast<size_t>(it - saves.begin());
      if (!hit[i]) {
        hit[i] = true;
        ++named;
        found(i, node);
      }
    }
  };
  std::vector<bool> visited(hi - lo, false);
  std::vector<torch::autograd::Node*> stack;
  for (const auto& e : roots) {
    stack.push_back(e.function.get());
  }
  while (!stack.empty() && named < saves.size()) {
    auto* node = stack.back();
    stack.pop_back();
    if (node == nullptr || node->thread_id() != thread) {
      continue;
    }
    const uint64_t seq = node->sequence_nr();
    if (seq < lo || seq >= hi || visited[seq - lo]) {
      continue;  // older than any waiting save (its inputs are older still), or seen
    }
    visited[seq - lo] = true;
    name(seq, *node);
    if (typeid(*node) == typeid(torch::autograd::CopySlices)) {
      const auto& fn = static_cast<const torch::autograd::CopySlices*>(node)->fn;
      if (fn) {
        name(fn->sequence_nr(), *fn);  // reached only through its wrapper
      }
    }
    for (const auto& e : node->next_edges()) {
      stack.push_back(e.function.get());
    }
  }
}
} // namespace

struct MeterState {
  std::mutex mutex;
  // Weak references pin the StorageImpl objects (not their data), so an
  // address is never reused for another storage while it is a key here.
  // Flat maps keep their room when cleared: a loop's steps insert as many
  // storages each and allocate nothing for them after the first.
  ska::flat_hash_map<StorageKey, WeakStorage> excluded;
  ska::flat_hash_map<StorageKey, WeakStorage> seen;
  ska::flat_hash_map<StorageKey, WeakStorage> excluded_seen;
  SavedTensorReport totals;
  std::unordered_map<std::string, NodeSavedBytes> by_node;
  // Packs whose node is not known yet, tagged with the op depth they were
  // made at. Deeper ops end first, so an op's own packs are at the tail.
  struct Pending {
    int64_t depth;
    int64_t bytes;
  };
  std::vector<Pending> pending;
  // pending.back().depth, or -1 when nothing is pending: read without the
  // lock at every op end, so the ops that save nothing (most) never lock.
  std::atomic<int64_t> pending_depth{-1};
  std::atomic<bool> active{false};
  // Set when the guard ended on another thread than the one it meters: that
  // thread's callbacks skip (and later drop) this state.
  std::atomic<bool> closed{false};
  // Note [Naming nodes by sequence number]: set before a guard opens.
  bool by_sequence = false;
  // Saves waiting for their node's name, by node sequence number (ascending:
  // the numbers only grow on a thread), and the thread that made them.
  using Numbered = WaitingSave;
  std::vector<Numbered> numbered;
  uint64_t numbered_thread = 0;
  // Node names by node type, for the types whose name is the type's own
  // (autograd's generated nodes): Node::name() makes a string at each call.
  // Keyed by the type_info's address (type_index would hash the mangled
  // name at each lookup); node-based, so an entry stays put when another is
  // added. Each keeps where its bytes go in by_node while by_node is not
  // cleared (by_node_epoch), so an attribution hashes no string either.
  struct TypeName {
    std::string name;
    NodeSavedBytes* entry = nullptr;
    uint64_t entry_epoch = 0;
  };
  std::unordered_map<const std::type_info*, TypeName> type_names;
  uint64_t by_node_epoch = 1;

  // Under `mutex`: the cached name of the node's type, or nullptr (a type
  // whose name is not cached: call node.name()).
  TypeName* type_name(const torch::autograd::Node& node) {
    const std::type_info* type = &typeid(node);
    if (auto it = type_names.find(type); it != type_names.end()) {
      return &it->second;
    }
    // Only generated nodes' names are fixed by their type.
    if (!is_generated_node_type(*type)) {
      return nullptr;
    }
    return &type_names.emplace(type, TypeName{node.name()}).first->second;
  }

  void attribute(TypeName& type, int64_t bytes, int64_t tensors) {
    if (type.entry_epoch != by_node_epoch) {
      type.entry = &entry_for(type.name);
      type.entry_epoch = by_node_epoch;
    }
    type.entry->bytes += bytes;
    type.entry->num_tensors += tensors;
  }

  void exclude(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) {
      return;
    }
    const auto& storage = t.storage();
    std::lock_guard<std::mutex> lock(mutex);
    excluded.emplace(
        storage.unsafeGetStorageImpl(), storage.getWeakStorageImpl());
  }

  NodeSavedBytes& entry_for(const std::string& node) {
    auto& entry = by_node[node];
    if (entry.node.empty()) {
      entry.node = node;
    }
    return entry;
  }

  void attribute(const std::string& node, int64_t bytes, int64_t tensors) {
    auto& entry = entry_for(node);
    entry.bytes += bytes;
    entry.num_tensors += tensors;
  }

  // Counts one tensor saved for backward (or held for it, with a label).
  // `kept` holds its bytes now: the tensor itself, or a copy that hooks made
  // (a host copy when offloaded).
  void record(const at::Tensor& t, const at::Tensor& kept, const char* label, int64_t depth) {
    if (!t.defined() || closed.load(std::memory_order_relaxed)) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex);
    totals.num_tensors += 1;
    int64_t new_bytes = 0;
    if (t.has_storage()) {
      const auto& storage = t.storage();
      StorageKey key = storage.unsafeGetStorageImpl();
      if (excluded.count(key) != 0) {
        totals.num_param_tensors += 1;
        if (excluded_seen.find(key) == excluded_seen.end()) {
          excluded_seen.emplace(key, storage.getWeakStorageImpl());
          totals.excluded_param_bytes += static_cast<int64_t>(storage.nbytes());
        }
        return;
      }
      if (seen.find(key) == seen.end()) {
        seen.emplace(key, storage.getWeakStorageImpl());
        new_bytes = static_cast<int64_t>(storage.nbytes());
        totals.num_storages += 1;
      }
    } else {
      // Sparse and other storage-less layouts: count the logical size.
      new_bytes = t.numel() * static_cast<int64_t>(t.element_size());
      totals.num_storages += 1;
    }
    totals.saved_bytes += new_bytes;
    if (new_bytes > 0 && t.requires_grad()) {
      at::Tensor leaf;
      if (t.is_leaf()) {
        leaf = t;
      } else if (t.is_view()) {
        leaf = t._base();
      }
      if (leaf.defined() && leaf.is_leaf()) {
        totals.unowned_leaf_bytes += new_bytes;
      }
    }
    const bool moved_to_host = kept.defined() && kept.has_storage() && kept.is_cpu() &&
        (!t.has_storage() || kept.storage().unsafeGetStorageImpl() != t.storage().unsafeGetStorageImpl());
    (moved_to_host ? totals.host_bytes : totals.device_bytes) += new_bytes;
    if (label != nullptr) {
      attribute(label, new_bytes, 1);
    } else if (depth == 0 && by_sequence && tls_script_depth == 0) {
      add_numbered(t, new_bytes);
    } else if (depth == 0) {
      add_to_group(t, new_bytes);
    } else {
      pending.push_back({depth, new_bytes});
      pending_depth.store(depth, std::memory_order_relaxed);
    }
  }

  // Under `mutex` (Note [Naming nodes by sequence number]).
  void add_numbered(const at::Tensor& t, int64_t bytes) {
    const uint64_t seq = at::sequence_number::peek() - 1;
    numbered_thread = at::RecordFunction::currentThreadId();
    if (numbered.empty() || numbered.back().seq != seq) {
      numbered.push_back({seq, 0, 0});
    }
    numbered.back().bytes += bytes;
    numbered.back().tensors += 1;
    // An output saved after set_history: its node (read from the autograd
    // meta as is, never regenerated as a view's grad_fn() would) is the one saving.
    const auto* meta = torch::autograd::impl::get_autograd_meta(t);
    if (meta == nullptr || !meta->grad_fn_ || meta->grad_fn_->sequence_nr() != seq ||
        meta->grad_fn_->thread_id() != numbered_thread) {
      return;
    }
    TypeName* type = type_name(*meta->grad_fn_);
    const std::string uncached = type == nullptr ? meta->grad_fn_->name() : std::string();
    const std::string& name = type != nullptr ? type->name : uncached;
    if (name == "CloneBackward0") {
      // An in-place op's kernel saving the original `self`: it clones it
      // (through autograd) after making its own node, which is the one before.
      auto n = numbered.back();
      numbered.pop_back();
      n.seq = seq - 1;
      if (!numbered.empty() && numbered.back().seq == n.seq) {
        numbered.back().bytes += n.bytes;
        numbered.back().tensors += n.tensors;
      } else {
        numbered.push_back(n);
      }
      return;
    }
    const auto& n = numbered.back();
    if (type != nullptr) {
      attribute(*type, n.bytes, n.tensors);
    } else {
      attribute(name, n.bytes, n.tensors);
    }
    numbered.pop_back();
  }

  // Under `mutex`: names the waiting saves whose nodes `roots` reach.
  void name_numbered(const torch::autograd::edge_list& roots) {
    if (numbered.empty()) {
      return;
    }
    struct Named {
      TypeName* type = nullptr;
      std::string name;  // a type whose name is not cached
      bool set = false;
    };
    std::vector<Named> names(numbered.size());
    walk_to_saves(numbered, numbered_thread, roots, [&](size_t i, const torch::autograd::Node& node) {
      auto& slot = names[i];
      slot.type = type_name(node);
      if (slot.type == nullptr) {
        slot.name = node.name();
      }
      slot.set = true;
    });
    size_t kept = 0;
    for (size_t i = 0; i < numbered.size(); ++i) {
      if (names[i].type != nullptr) {
        attribute(*names[i].type, numbered[i].bytes, numbered[i].tensors);
      } else if (names[i].set) {
        attribute(names[i].name, numbered[i].bytes, numbered[i].tensors);
      } else {
        numbered[kept++] = numbered[i];
      }
    }
    numbered.resize(kept);
  }

  // Under `mutex`: what is still waiting when the guard ends.
  void drop_numbered() {
    for (const auto& n : numbered) {
      attribute("(unattributed)", n.bytes, n.tensors);
    }
    numbered.clear();
  }

  // Unlabelled saves outside any op (Note [Naming TorchScript's graph nodes]).
  struct Group {
    const void* node = nullptr;  // the DifferentiableGraphBackward, once seen
    std::string name;
    std::vector<std::string> ops;
    int64_t bytes = 0;
    int64_t tensors = 0;
  };
  Group group;
  std::atomic<bool> group_open{false};

  // Under `mutex`.
  void add_to_group(const at::Tensor& t, int64_t bytes) {
    const auto* fn = t.grad_fn().get();
    std::string name = fn != nullptr ? fn->name() : std::string();
    const bool graph = name.find("DifferentiableGraph") != std::string::npos;
    // A save without a graph node (a graph's integer output, max_pool's
    // indices) stays in the open group; another graph's node starts a new one.
    if (group_open.load() && group.node != nullptr && graph && fn != group.node) {
      close_group_locked();
    }
    if (!group_open.load()) {
      // The graph's ops may have run before its first save (a graph that
      // keeps only outputs): they are the ops seen since the last one that
      // built graph.
      group.ops = std::move(recent_ops);
      recent_ops.clear();
    }
    group_open.store(true);
    if (graph && group.node == nullptr) {
      group.node = fn;
      const auto colon = name.rfind("::");
      group.name = colon == std::string::npos ? name : name.substr(colon + 2);
    }
    group.bytes += bytes;
    group.tensors += 1;
  }

  void close_group_locked() {
    if (!group_open.load()) {
      return;
    }
    std::string name = "CppFunction";
    if (!group.name.empty()) {
      name = group.name + "(";
      for (size_t i = 0; i < group.ops.size(); ++i) {
        name += (i > 0 ? ", " : "") + group.ops[i];
      }
      name += ")";
    }
    attribute(name, group.bytes, group.tensors);
    group = Group();
    group_open.store(false);
  }

  // A top-level op ended while a group is open: one that builds graph ends
  // the group; another is one of the graph's own ops.
  // Ops run with grad that built no graph since the last one that did (a
  // differentiable graph's own ops, before any save opened a group).
  std::vector<std::string> recent_ops;

  // Takes the op's name as RecordFunction keeps it: a string is made only
  // when it is kept (most top-level ops build graph, or the list is full).
  void group_op_ended(std::string_view op, bool builds_graph) {
    std::lock_guard<std::mutex> lock(mutex);
    if (builds_graph) {
      if (group_open.load() || !recent_ops.empty()) {
        close_group_locked();
        recent_ops.clear();
      }
      return;
    }
    if (op == "aten::detach" || op == "aten::detach_") {
      return;  // the executor detaching a graph's inputs: bookkeeping, not what it runs
    }
    auto& ops = group_open.load() ? group.ops : recent_ops;
    if (ops.size() < 6 && std::find(ops.begin(), ops.end(), op) == ops.end()) {
      ops.emplace_back(op);
    }
  }

  void close_group() {
    std::lock_guard<std::mutex> lock(mutex);
    close_group_locked();
  }

  // True when packs made at op depth >= `depth` await a node name. Lock-free:
  // pending is pushed and popped on the thread whose scope is active.
  bool has_pending(int64_t depth) const {
    return pending_depth.load(std::memory_order_relaxed) >= depth;
  }

  // Attributes the packs made at op depth >= `depth` to `node`.
  void flush_pending(const std::string& node, int64_t depth) {
    std::lock_guard<std::mutex> lock(mutex);
    int64_t bytes = 0, tensors = 0;
    while (!pending.empty() && pending.back().depth >= depth) {
      bytes += pending.back().bytes;
      tensors += 1;
      pending.pop_back();
    }
    pending_depth.store(pending.empty() ? -1 : pending.back().depth, std::memory_order_relaxed);
    if (tensors != 0) {
      attribute(node, bytes, tensors);
    }
  }
};

namespace {

thread_local std::vector<std::shared_ptr<MeterState>> tls_meters;
thread_local std::optional<at::CallbackHandle> tls_callback;
thread_local std::optional<at::CallbackHandle> tls_script_callback;

std::string node_name(const at::RecordFunction& fn) {
  for (const auto& out : fn.outputs()) {
    if (out.isTensor()) {
      const auto& t = out.toTensor();
      if (t.defined() && t.grad_fn()) {
        return t.grad_fn()->name();
      }
    } else if (out.isTensorList()) {
      for (const at::Tensor& t : out.toTensorVector()) {
        if (t.defined() && t.grad_fn()) {
          return t.grad_fn()->name();
        }
      }
    }
  }
  return fn.name();
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction&) {
  ++tls_op_depth;
  return nullptr;
}

// The packs made while this op was the innermost one running (its autograd
// kernel saves inputs before it redispatches and outputs after; the ops its
// kernels call run one level deeper and end first).
bool builds_graph(const at::RecordFunction& fn) {
  for (const auto& out : fn.outputs()) {
    if (out.isTensor() && out.toTensor().defined() && out.toTensor().grad_fn()) {
      return true;
    }
  }
  return false;
}

void on_op_end(const at::RecordFunction& fn, at::ObserverContext*) {
  const int64_t depth = tls_op_depth--;
  try {
    if (depth == 1) {
      for (const auto& meter : tls_meters) {
        if (!meter->closed.load() && c10::GradMode::is_enabled()) {
          meter->group_op_ended(fn.name(), builds_graph(fn));
        }
      }
    }
    for (const auto& meter : tls_meters) {
      if (!meter->closed.load(std::memory_order_relaxed) && meter->has_pending(depth)) {
        meter->flush_pending(node_name(fn), depth);
      }
    }
  } catch (const std::exception& e) {
    TORCH_WARN("trainmem meter: could not attribute saved tensors: ", e.what());
  }
}

void sync_callbacks();

// A TorchScript function starts or ends (Note [Naming nodes by sequence number]).
std::unique_ptr<at::ObserverContext> on_script_start(const at::RecordFunction&) {
  if (tls_script_depth++ == 0) {
    try {
      sync_callbacks();
    } catch (const std::exception& e) {
      TORCH_WARN("trainmem meter: ", e.what());
    }
  }
  return nullptr;
}

void on_script_end(const at::RecordFunction&, at::ObserverContext*) {
  if (--tls_script_depth == 0) {
    try {
      for (const auto& meter : tls_meters) {
        if (meter->by_sequence && !meter->closed.load()) {
          meter->close_group();  // the graph's ops end with the function
        }
      }
      sync_callbacks();
    } catch (const std::exception& e) {
      TORCH_WARN("trainmem meter: ", e.what());
    }
  }
}

// The op callback is on while a meter that names by op end is active on this
// thread, or one that names by sequence number inside a TorchScript function;
// the TorchScript callback while one of the latter is.
void sync_callbacks() {
  bool by_op = false;
  bool by_sequence = false;
  for (const auto& m : tls_meters) {
    if (!m->closed.load()) {
      (m->by_sequence ? by_sequence : by_op) = true;
    }
  }
  const bool ops = by_op || (by_sequence && tls_script_depth > 0);
  if (ops && !tls_callback) {
    tls_callback = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&on_op_start, &on_op_end).needsOutputs(true).scopes({at::RecordScope::FUNCTION}));
  } else if (!ops && tls_callback) {
    at::removeCallback(*tls_callback);
    tls_callback.reset();
  }
  if (by_sequence && !tls_script_callback) {
    tls_script_callback = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&on_script_start, &on_script_end).scopes({at::RecordScope::TORCHSCRIPT_FUNCTION}));
  } else if (!by_sequence && tls_script_callback) {
    at::removeCallback(*tls_script_callback);
    tls_script_callback.reset();
  }
}

class MeterObserver final : public SaveObserver {
 public:
  explicit MeterObserver(std::shared_ptr<MeterState> state) : state_(std::move(state)) {}

  void on_save(const at::Tensor& saved, const at::Tensor& kept) noexcept override {
    if (!kept.defined()) {
      return;  // nothing is kept (checkpointed): backward recomputes it
    }
    try {
      // Outside any op: a trainmem feature's label, or a group to name
      // (Note [Naming TorchScript's graph nodes]).
      const char* label = tls_op_depth == 0 ? tls_save_label : nullptr;
      state_->record(saved, kept, label, tls_op_depth);
    } catch (const std::exception& e) {
      TORCH_WARN("trainmem meter: a saved tensor was not counted: ", e.what());
    } catch (...) {
    }
  }

 private:
  std::shared_ptr<MeterState> state_;
};

void exclude_module(MeterState& state, const torch::nn::Module& module, bool buffers) {
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    state.exclude(p);
  }
  if (buffers) {
    for (const auto& b : module.buffers(/*recurse=*/true)) {
      state.exclude(b);
    }
  }
}

} // namespace

SaveLabelGuard::SaveLabelGuard(const char* label) : previous_(tls_save_label) {
  tls_save_label = label;
}

SaveLabelGuard::~SaveLabelGuard() {
  tls_save_label = previous_;
}

void record_held_tensor(const char* label, const at::Tensor& tensor) noexcept {
  try {
    for (const auto& meter : tls_meters) {
      meter->record(tensor, tensor, label, tls_op_depth);
    }
  } catch (const std::exception& e) {
    TORCH_WARN("trainmem meter: a held tensor was not counted: ", e.what());
  }
}

} // namespace detail

SavedTensorMeter::SavedTensorMeter()
    : state_(std::make_shared<detail::MeterState>()) {}

SavedTensorMeter::SavedTensorMeter(
    const torch::nn::Module& module,
    bool exclude_buffers)
    : SavedTensorMeter() {
  detail::exclude_module(*state_, module, exclude_buffers);
}

SavedTensorMeter::~SavedTensorMeter() = default;

void SavedTensorMeter::exclude(const at::Tensor& tensor) {
  state_->exclude(tensor);
}

void SavedTensorMeter::exclude(const torch::nn::Module& module, bool exclude_buffers) {
  detail::exclude_module(*state_, module, exclude_buffers);
}

SavedTensorReport SavedTensorMeter::report() const {
  TORCH_CHECK(
      !state_->active.load(),
      "SavedTensorMeter::report() called while a SavedTensorMeterGuard on this "
      "meter is active; read the meter after the guard's scope ends");
  std::lock_guard<std::mutex> lock(state_->mutex);
  SavedTensorReport r = state_->totals;
  r.by_node.clear();
  for (const auto& [name, entry] : state_->by_node) {
    r.by_node.push_back(entry);
  }
  std::sort(r.by_node.begin(), r.by_node.end(), [](const auto& a, const auto& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : a.node < b.node;
  });
  return r;
}

void SavedTensorMeter::reset() {
  TORCH_CHECK(
      !state_->active.load(),
      "SavedTensorMeter::reset() called while a SavedTensorMeterGuard on this "
      "meter is active");
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->seen.clear();
  state_->excluded_seen.clear();
  state_->totals = SavedTensorReport{};
  state_->by_node.clear();
  ++state_->by_node_epoch;
  state_->pending.clear();
  state_->pending_depth.store(-1);
  state_->numbered.clear();
  state_->group = detail::MeterState::Group();
  state_->group_open.store(false);
  state_->recent_ops.clear();
}

bool SavedTensorMeter::active() const {
  return state_->active.load();
}

struct SavedTensorMeterGuard::Impl {
  std::shared_ptr<detail::MeterState> state;
  std::optional<detail::SaveObserverGuard> observer;
  uint64_t thread = detail::this_thread_id();
};

namespace detail {
namespace {
// Drops the states of guards that ended on other threads, and the op
// callback once no meter is left on this thread.
void prune_meters() {
  auto& meters = tls_meters;
  meters.erase(std::remove_if(meters.begin(), meters.end(),
                              [](const auto& m) { return m->closed.load(); }),
               meters.end());
  sync_callbacks();
}
} // namespace
} // namespace detail

SavedTensorMeterGuard::SavedTensorMeterGuard(SavedTensorMeter& meter)
    : impl_(std::make_unique<Impl>()) {
  impl_->state = meter.state_;
  TORCH_CHECK(
      !impl_->state->active.exchange(true),
      "SavedTensorMeterGuard: this meter already has an active scope; use one "
      "guard per meter at a time");
  try {
    // Drop the states of guards that ended elsewhere (this meter's too, if
    // its last guard ended on another thread) before reopening this one.
    detail::prune_meters();
    impl_->state->closed.store(false);
    impl_->observer.emplace(std::make_shared<detail::MeterObserver>(impl_->state));
    detail::tls_meters.push_back(impl_->state);
    detail::sync_callbacks();
  } catch (...) {
    impl_->observer.reset();
    impl_->state->active.store(false);
    throw;
  }
}

SavedTensorMeterGuard::~SavedTensorMeterGuard() {
  try {
    if (impl_->thread == detail::this_thread_id()) {
      auto& meters = detail::tls_meters;
      meters.erase(std::remove(meters.begin(), meters.end(), impl_->state), meters.end());
      detail::prune_meters();
    } else {
      // The metered thread's list cannot be touched from here: it skips the
      // state from now on and drops it at its next meter guard.
      impl_->state->closed.store(true);
    }
    impl_->state->flush_pending("(unattributed)", 0);
    impl_->state->close_group();
    {
      std::lock_guard<std::mutex> lock(impl_->state->mutex);
      impl_->state->drop_numbered();
    }
  } catch (...) {
    // Never throw from a destructor.
  }
  impl_->observer.reset();  // safe from any thread (hooks.cpp drops it lazily)
  impl_->state->active.store(false);
}

namespace detail {

struct MeterAccess {
  static MeterState& state(SavedTensorMeter& meter) {
    return *meter.state_;
  }
};

void name_nodes_by_sequence(SavedTensorMeter& meter) {
  auto& state = MeterAccess::state(meter);
  TORCH_CHECK(!state.active.load(), "trainmem meter: cannot change how a meter names nodes while its guard is active");
  state.by_sequence = true;
}

WaitingSaves take_waiting_saves(SavedTensorMeter& meter) noexcept {
  auto& state = MeterAccess::state(meter);
  WaitingSaves out;
  try {
    std::lock_guard<std::mutex> lock(state.mutex);
    out.thread = state.numbered_thread;
    out.saves = std::move(state.numbered);
    state.numbered.clear();
  } catch (const std::exception& e) {
    TORCH_WARN("trainmem meter: waiting saves were not taken: ", e.what());
  }
  return out;
}

std::vector<NamedSaves> name_waiting_saves(WaitingSaves& waiting, const torch::autograd::edge_list& roots) noexcept {
  std::vector<NamedSaves> named;
  try {
    std::vector<std::string> names(waiting.saves.size());
    walk_to_saves(waiting.saves, waiting.thread, roots,
                  [&](size_t i, const torch::autograd::Node& node) { names[i] = node.name(); });
    size_t kept = 0;
    for (size_t i = 0; i < waiting.saves.size(); ++i) {
      const auto& w = waiting.saves[i];
      if (names[i].empty()) {
        waiting.saves[kept++] = w;
        continue;
      }
      auto it = std::find_if(named.begin(), named.end(), [&](const auto& n) { return n.node == names[i]; });
      if (it == named.end()) {
        named.push_back({names[i], 0, 0});
        it = named.end() - 1;
      }
      it->bytes += w.bytes;
      it->tensors += w.tensors;
    }
    waiting.saves.resize(kept);
  } catch (const std::exception& e) {
    TORCH_WARN("trainmem meter: saved tensors were not named: ", e.what());
  }
  return named;
}

void name_saved_nodes(SavedTensorMeter& meter, const torch::autograd::edge_list& roots) noexcept {
  auto& state = MeterAccess::state(meter);
  try {
    std::lock_guard<std::mutex> lock(state.mutex);
    state.name_numbered(roots);
  } catch (const std::exception& e) {
    TORCH_WARN("trainmem meter: saved tensors were not named: ", e.what());
  }
}

} // namespace detail

std::string to_string(const SavedTensorReport& r) {
  std::string out = fmt::format(
      "saved for backward: {} B in {} storages ({} tensors); parameters "
      "excluded: {} B ({} tensors)\n",
      r.saved_bytes, r.num_storages, r.num_tensors, r.excluded_param_bytes,
      r.num_param_tensors);
  if (r.host_bytes > 0) {
    out += fmt::format("  where: {} B stay on the device, {} B offloaded to the host\n", r.device_bytes,
                       r.host_bytes);
  }
  for (const auto& n : r.by_node) {
    out += fmt::format(
        "  {:<44} {:>14} B {:>6} tensors\n", n.node, n.bytes, n.num_tensors);
  }
  return out + detail::scalar_reads_line(r.scalar_reads);
}

} // namespace trainmem
