// What a construction under a MetaInitGuard ran, recorded op by op, and its
// replay on a real device by materialize() (Note [Init replayed on
// materialize]).
#include "core/detail/init_record.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "detail/intercept.h"

// Note [Init replayed on materialize]
// A constructor's own init (orthogonal_, kaiming_normal_, constant_, a copy_
// under no_grad) runs on meta as no-ops, so materialize() cannot get its
// values by calling the modules' reset_parameters(): that would be
// LibTorch's defaults. As torchdistx's deferred_init does, the outermost
// MetaInitGuard records every op that is a factory or reads a tensor the
// record made, boxed (the operator and its arguments), in order; meta
// tensors are referenced by a value id carried on the tensor itself (a
// c10::BackendMeta tag holding the record), real tensors are kept as
// constants with their version. The record therefore lives exactly as long
// as the meta tensors it made: nothing holds a tensor, and a meta storage is
// held weakly (its address stays unique; its bytes are not held). When the
// last tagged tensor dies or is given real storage (materialize(),
// load_into(), to_empty() drop the tag), the record goes with it.
//
// materialize() replays the records that made the module's meta tensors
// (with the older records they read), oldest first, every step in order, on
// the device: a meta device argument becomes the device, each value id a
// real tensor, each real value released after its last use (the replay's
// peak is the module plus the live temporaries, as a CPU construction's).
// Views and in-place ops replay as themselves (weight.view_as(q).copy_(q)
// writes the weight's real storage). Every step is replayed, the other
// modules' of the same record too, so the generator is drawn in the order a
// CPU construction drew it: after the same torch::manual_seed the values are
// bit-identical on CPU. Each parameter and buffer then adopts its real
// counterpart's storage in place (shallow_copy_from), keeping its TensorImpl.
//
// What cannot be replayed is refused, naming the tensor and the op, before
// anything is allocated: an op that read a meta tensor from outside the
// record (taints what it wrote, and what is computed from that, by meta
// storage); an op that returned a value read from meta tensors (a bool or a
// scalar), or threw on meta and was caught (control flow after it may
// differ), or drew random numbers out of order (a real tensor's, or a step
// that cannot be replayed): everything written after it is refused. At replay, a constant changed since (its
// version moved) or an op the device has no kernel for is refused in the same
// words, and nothing is changed. Predictions, find_missing_meta_kernel() and
// to_meta() run with recording paused (their meta steps are not a
// construction).

namespace trainmem::detail {

namespace {
std::atomic<int64_t> next_record_seq{0};
} // namespace

// One tensor in a step's arguments: a value of a record, or a constant.
struct InitSlot {
  InitRecord* record = nullptr; // this record or one it holds in `deps`
  int64_t id = -1;
  at::Tensor constant;  // a real tensor, or undefined
  int64_t version = -1; // the constant's version when recorded (-1: none kept)
};

enum class InitArgKind { kValue, kTensor, kTensorList, kOptionalTensorList };

struct InitArg {
  InitArgKind kind = InitArgKind::kValue;
  c10::IValue value;
  std::vector<InitSlot> slots;
};

struct InitStep {
  explicit InitStep(const c10::OperatorHandle& o) : op(o) {}
  c10::OperatorHandle op;
  std::vector<InitArg> args;
  std::vector<std::vector<int64_t>> outputs;   // per return: its tensors' ids (-1: none)
  std::string skip;                            // why it cannot be replayed ("" if it can)
  std::vector<const c10::StorageImpl*> touched; // meta storages it read or wrote
};

struct InitStorage {
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> held; // the address stays this storage's
  std::string taint;     // why what it holds cannot be replayed ("" if it can)
  int64_t last_step = -1;
};

struct InitRecord : c10::intrusive_ptr_target {
  int64_t seq = next_record_seq++;
  std::vector<InitStep> steps;
  int64_t num_values = 0;
  std::vector<c10::intrusive_ptr<InitRecord>> deps; // older records whose tensors it read
  std::unordered_map<const c10::StorageImpl*, InitStorage> storages;
  std::string hazard; // set once: what is written after it is refused
  bool drew_random = false;
};

namespace {

// The tag a recorded meta tensor carries: its record and its value id. A
// shallow copy (detach, .data()) shares it: the same value.
struct InitTag final : c10::BackendMeta {
  InitTag(c10::intrusive_ptr<InitRecord> r, int64_t i) : record(std::move(r)), id(i) {}
  c10::intrusive_ptr<InitRecord> record;
  int64_t id;
};

thread_local c10::intrusive_ptr<InitRecord> tls_record;
thread_local int tls_paused = 0;

InitTag* tag_of(const at::Tensor& t) {
  if (!t.defined()) {
    return nullptr;
  }
  return dynamic_cast<InitTag*>(t.unsafeGetTensorImpl()->get_backend_meta());
}

std::string op_name(const c10::OperatorHandle& op) {
  const auto& s = op.schema();
  return s.overload_name().empty() ? s.name() : s.name() + "." + s.overload_name();
}

bool draws_random(const c10::FunctionSchema& schema) {
  for (const auto& a : schema.arguments()) {
    if (a.real_type()->str().find("Generator") != std::string::npos) {
      return true;
    }
  }
  const std::string& name = schema.name();
  return name.rfind("aten::rand", 0) == 0 || name == "aten::normal" || name == "aten::bernoulli" ||
      name == "aten::native_dropout" || name == "aten::multinomial" || name == "aten::poisson";
}

// Ops that return a non-tensor computed from metadata only (is_same_size,
// is_pinned, ...; not is_nonzero, which reads a value).
bool reads_metadata_only(const std::string& name) {
  static const std::unordered_set<std::string> ops = {
      "aten::is_same_size", "aten::is_set_to", "aten::_has_compatible_shallow_copy_type",
      "aten::_has_same_storage_numel", "aten::is_coalesced", "aten::_nnz", "aten::dense_dim",
      "aten::sparse_dim", "aten::output_nr", "aten::_version", "aten::is_leaf", "aten::retains_grad",
      "aten::result_type", "aten::_fused_sdp_choice", "aten::_debug_has_internal_overlap",
      "aten::sym_size", "aten::sym_numel", "aten::sym_stride", "aten::sym_storage_offset"};
  return ops.count(name) > 0 || (name.rfind("aten::is_", 0) == 0 && name != "aten::is_nonzero");
}

InitStorage& storage_state(InitRecord& rec, const at::Tensor& t) {
  const c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  InitStorage& s = rec.storages[impl];
  if (!s.held) {
    s.held.emplace(t.storage().getWeakStorageImpl());
  }
  return s;
}

} // namespace

bool begin_init_record() {
  if (tls_record || tls_paused > 0) {
    return false;
  }
  tls_record = c10::make_intrusive<InitRecord>();
  return true;
}

void end_init_record() {
  tls_record.reset();
}

InitRecordPause::InitRecordPause() {
  ++tls_paused;
}

InitRecordPause::~InitRecordPause() {
  --tls_paused;
}

bool has_init_record(const at::Tensor& t) {
  return t.defined() && t.is_meta() && tag_of(t) != nullptr;
}

void drop_init_record(const at::Tensor& t) {
  if (tag_of(t) != nullptr) {
    t.unsafeGetTensorImpl()->set_backend_meta(c10::intrusive_ptr<c10::BackendMeta>());
  }
}

namespace {

// A recorded call's arguments read into its step: each meta tensor by its
// record's value id (this record's, or an older one's, which becomes a
// dependency), each real one as a constant; and what that says about the
// call: whether it involves the record, why it cannot be replayed.
struct ArgReader {
  ArgReader(const c10::OperatorHandle& o, InitRecord* r, bool factory) : op(o), rec(r), involved(factory) {}

  const c10::OperatorHandle& op;
  InitRecord* rec;
  bool involved;
  bool real_args = false;
  std::string skip;       // an argument the replay cannot make
  std::string taint_in;   // an argument whose values cannot be replayed
  std::vector<std::pair<const c10::TensorImpl*, InitSlot>> inputs;  // meta arguments
  std::vector<const c10::StorageImpl*> read;

  InitSlot slot_of(const at::Tensor& t) {
    InitSlot s;
    if (!t.defined()) {
      return s;
    }
    if (!t.is_meta()) {
      real_args = true;
      s.constant = t;
      const auto& vc = t.unsafeGetTensorImpl()->version_counter();
      s.version = vc.enabled() ? static_cast<int64_t>(vc.current_version()) : -1;
      return s;
    }
    read.push_back(t.storage().unsafeGetStorageImpl());
    if (InitTag* tag = tag_of(t)) {
      InitRecord* r = tag->record.get();
      involved = true;
      if (r != rec) {
        if (r->seq > rec->seq) {
          if (skip.empty()) {
            skip = fmt::format("{} read a meta tensor that another thread's MetaInitGuard made", op_name(op));
          }
        } else if (std::none_of(rec->deps.begin(), rec->deps.end(),
                                [&](const auto& d) { return d.get() == r; })) {
          rec->deps.push_back(tag->record);
        }
      }
      if (auto it = r->storages.find(read.back()); it != r->storages.end() && taint_in.empty()) {
        taint_in = it->second.taint;
      }
      s.record = r;
      s.id = tag->id;
    } else if (skip.empty()) {
      skip = fmt::format("{} read a meta tensor of size {} not made under the MetaInitGuard", op_name(op),
                         t.sizes());
    }
    inputs.emplace_back(t.unsafeGetTensorImpl(), s);
    return s;
  }

  // The `n` arguments from `base` on the stack, into step.args.
  void read_args(const torch::jit::Stack& stack, size_t base, size_t n, InitStep& step) {
    for (size_t i = 0; i < n; ++i) {
      const c10::IValue& v = stack[base + i];
      InitArg a;
      if (v.isTensor()) {
        a.kind = InitArgKind::kTensor;
        a.slots.push_back(slot_of(v.toTensor()));
      } else if (v.isTensorList()) {
        a.kind = InitArgKind::kTensorList;
        for (const at::Tensor& t : v.toTensorList().vec()) {
          a.slots.push_back(slot_of(t));
        }
      } else if (v.isList() && std::any_of(v.toListRef().begin(), v.toListRef().end(),
                                           [](const c10::IValue& e) { return e.isTensor(); })) {
        a.kind = InitArgKind::kOptionalTensorList;  // Tensor?[]
        for (const c10::IValue& e : v.toListRef()) {
          a.slots.push_back(e.isTensor() ? slot_of(e.toTensor()) : InitSlot{});
        }
      } else {
        a.value = v;
      }
      step.args.push_back(std::move(a));
    }
  }
};

// The arguments the op writes (Tensor(a!)), held for the call.
std::vector<at::Tensor> written_args(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t base,
                                     size_t n) {
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < n; ++i) {
    const auto* alias = schema.arguments()[i].alias_info();
    if (alias == nullptr || !alias->isWrite()) {
      continue;
    }
    const c10::IValue& v = stack[base + i];
    if (v.isTensor()) {
      written.push_back(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) {
        written.push_back(t);
      }
    }
  }
  return written;
}

// The call's returns, into step.outputs: each meta tensor tagged with a new
// value id of `rec` (an argument written in place keeps its own); each
// appended to `written`. Returns why control flow after the call may differ
// from a CPU construction ("" if it cannot).
std::string record_outputs(const c10::OperatorHandle& op, const torch::jit::Stack& stack, const ArgReader& args,
                           std::vector<at::Tensor>& written, InitStep& step) {
  InitRecord* rec = args.rec;
  const auto& schema = op.schema();
  const size_t num_returns = schema.returns().size();
  const size_t rbase = stack.size() - num_returns;
  std::string read_back;
  auto output_id = [&](const at::Tensor& t) -> int64_t {
    if (!t.defined()) {
      return -1;
    }
    if (!t.is_meta()) {
      read_back = fmt::format("{} returned a real tensor computed from meta tensors, which hold no values",
                              op_name(op));
      return -1;
    }
    written.push_back(t);
    for (const auto& [impl, slot] : args.inputs) {
      if (impl == t.unsafeGetTensorImpl()) {
        if (slot.record == rec) {
          return slot.id;  // in place: the same value
        }
        if (slot.record == nullptr) {
          return -1;  // a meta tensor from outside stays outside
        }
        break;  // an older record's tensor written here becomes this record's
      }
    }
    const int64_t id = rec->num_values++;
    t.unsafeGetTensorImpl()->set_backend_meta(c10::make_intrusive<InitTag>(tls_record, id));
    return id;
  };
  for (size_t i = 0; i < num_returns; ++i) {
    const c10::IValue& v = stack[rbase + i];
    std::vector<int64_t> ids;
    if (v.isTensor()) {
      ids.push_back(output_id(v.toTensor()));
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) {
        ids.push_back(output_id(t));
      }
    } else if (!v.isNone() && !reads_metadata_only(schema.name())) {
      read_back = fmt::format("{} returned a value read from meta tensors, which hold none (control flow "
                              "after it may differ from a CPU construction)",
                              op_name(op));
    }
    step.outputs.push_back(std::move(ids));
  }
  return read_back;
}

// The storages the step read and wrote: their last step, the taint of what
// it wrote, and the older records' storages it changed.
void note_storages(const c10::OperatorHandle& op, InitRecord& rec, const ArgReader& args,
                   const std::vector<at::Tensor>& written, const std::string& taint, InitStep& step) {
  const int64_t index = static_cast<int64_t>(rec.steps.size());
  for (const c10::StorageImpl* s : args.read) {
    if (auto it = rec.storages.find(s); it != rec.storages.end()) {
      it->second.last_step = index;
    }
  }
  for (const at::Tensor& t : written) {
    if (!t.is_meta()) {
      continue;
    }
    InitStorage& s = storage_state(rec, t);
    s.last_step = index;
    if (!taint.empty() && s.taint.empty()) {
      s.taint = taint;
    }
    step.touched.push_back(t.storage().unsafeGetStorageImpl());
    // An older record's storage written here: its tensors that keep that
    // record's tag (all but those returned, which are now this record's) no
    // longer hold what that record makes.
    for (const auto& dep : rec.deps) {
      if (auto it = dep->storages.find(t.storage().unsafeGetStorageImpl());
          it != dep->storages.end() && it->second.taint.empty()) {
        it->second.taint = fmt::format("{} changed it under a later MetaInitGuard", op_name(op));
      }
    }
  }
  step.touched.insert(step.touched.end(), args.read.begin(), args.read.end());
}

} // namespace

void call_recorded(const InterceptScope& scope, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                   torch::jit::Stack* stack, bool factory) {
  InitRecord* rec = tls_record.get();
  if (rec == nullptr || tls_paused > 0) {
    scope.call_next(op, ks, stack);
    return;
  }
  // Nothing here may dispatch an op: this thread's ops come back to us.
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t base = stack->size() - n;
  InitStep step(op);
  ArgReader args(op, rec, factory);
  args.read_args(*stack, base, n, step);
  if (!args.involved) {
    // A real tensor's draw between recorded draws: the replay would draw in
    // another order than a CPU construction.
    if (args.real_args && rec->drew_random && rec->hazard.empty() && draws_random(schema)) {
      rec->hazard = fmt::format("{} drew random numbers for a real tensor between the construction's draws",
                                op_name(op));
    }
    scope.call_next(op, ks, stack);
    return;
  }
  std::vector<at::Tensor> written = written_args(schema, *stack, base, n);

  try {
    scope.call_next(op, ks, stack);
  } catch (...) {
    // Nothing is recorded; a construction that goes on (it caught this) may
    // take another path than a CPU construction, where the op ran.
    if (rec->hazard.empty()) {
      rec->hazard = fmt::format("{} threw on meta, where a CPU construction runs it (control flow after it "
                                "may differ)",
                                op_name(op));
    }
    throw;
  }

  const std::string read_back = record_outputs(op, *stack, args, written, step);
  const std::string taint = !args.skip.empty() ? args.skip : !args.taint_in.empty() ? args.taint_in : rec->hazard;
  note_storages(op, *rec, args, written, taint, step);
  step.skip = args.skip;
  const bool random = draws_random(schema);
  if (!args.skip.empty() && random && rec->hazard.empty()) {
    rec->hazard = fmt::format("{} drew random numbers and cannot be replayed ({})", op_name(op), args.skip);
  }
  rec->drew_random = rec->drew_random || (args.skip.empty() && random);
  rec->steps.push_back(std::move(step));
  if (!read_back.empty() && rec->hazard.empty()) {
    rec->hazard = read_back;
  }
}

namespace {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// The records that made `tensors`, with the older ones they read, oldest first.
std::vector<InitRecord*> records_oldest_first(const NamedTensors& tensors) {
  std::vector<InitRecord*> order;
  std::unordered_set<const InitRecord*> seen;
  std::vector<InitRecord*> todo;
  for (const auto& [name, t] : tensors) {
    InitTag* tag = tag_of(t);
    TORCH_INTERNAL_ASSERT(tag != nullptr && t.is_meta(), "replay_init: ", name, " has no record");
    todo.push_back(tag->record.get());
  }
  while (!todo.empty()) {
    InitRecord* r = todo.back();
    todo.pop_back();
    if (seen.insert(r).second) {
      order.push_back(r);
      for (const auto& d : r->deps) {
        todo.push_back(d.get());
      }
    }
  }
  std::sort(order.begin(), order.end(), [](const InitRecord* a, const InitRecord* b) { return a->seq < b->seq; });
  return order;
}

// Refuses what the records already know they cannot replay, before anything
// is allocated.
void check_untainted(const NamedTensors& tensors) {
  std::vector<std::string> refused;
  for (const auto& [name, t] : tensors) {
    InitRecord* r = tag_of(t)->record.get();
    auto it = r->storages.find(t.storage().unsafeGetStorageImpl());
    if (it != r->storages.end() && !it->second.taint.empty()) {
      refused.push_back(name + " the values its construction gave: " + it->second.taint);
    }
  }
  const size_t shown = std::min<size_t>(refused.size(), 4);
  TORCH_CHECK(refused.empty(), "materialize: cannot give ",
              fmt::format("{}", fmt::join(refused.begin(), refused.begin() + static_cast<std::ptrdiff_t>(shown), "; nor ")),
              refused.size() > shown ? fmt::format(" (and {} more)", refused.size() - shown) : "",
              "; nothing was allocated. Initialize it after materialize(), or load it with load_into()");
}

// One replay of `order`'s steps on `device`: each record's values (`env`,
// by record and value id), each released after its last use (a global step
// index; the wanted ones kept).
class Replay {
 public:
  Replay(const NamedTensors& tensors, std::vector<InitRecord*> order, c10::Device device)
      : tensors_(tensors), order_(std::move(order)), device_(device) {
    for (size_t k = 0; k < order_.size(); ++k) {
      at_of_[order_[k]] = k;
    }
    note_last_uses();
  }

  // Replays every step, oldest record first, in order.
  void run() {
    at::NoGradGuard no_grad;
    int64_t g = 0;
    for (size_t k = 0; k < order_.size(); ++k) {
      const auto& steps = order_[k]->steps;
      for (size_t local = 0; local < steps.size(); ++local, ++g) {
        const InitStep& step = steps[local];
        bool ready = step.skip.empty();
        torch::jit::Stack stack = arguments(k, static_cast<int64_t>(local), step, ready);
        if (ready) {
          call(k, static_cast<int64_t>(local), step, stack);
        }
        stack.clear();
        release_after(k, step, g);
      }
    }
  }

  // The real counterparts of the wanted tensors, in order.
  std::vector<at::Tensor> results() const {
    std::vector<at::Tensor> real;
    real.reserve(tensors_.size());
    for (const auto& [name, t] : tensors_) {
      InitTag* tag = tag_of(t);
      at::Tensor r = env_[at_of_.at(tag->record.get())][static_cast<size_t>(tag->id)];
      TORCH_CHECK(r.defined(), "materialize: cannot give ", name,
                  " the values its construction gave: a step that made it could not be replayed; nothing was "
                  "changed");
      TORCH_CHECK(r.sizes() == t.sizes() && r.scalar_type() == t.scalar_type(), "materialize: the replay gave ",
                  name, " size ", r.sizes(), " and dtype ", r.scalar_type(), ", but it has size ", t.sizes(),
                  " and dtype ", t.scalar_type(), " on meta");
      real.push_back(std::move(r));
    }
    return real;
  }

 private:
  // Each value's last use (a global step index); the wanted ones are kept.
  void note_last_uses() {
    constexpr int64_t kKeep = std::numeric_limits<int64_t>::max();
    last_.resize(order_.size());
    env_.resize(order_.size());
    for (size_t k = 0; k < order_.size(); ++k) {
      last_[k].assign(static_cast<size_t>(order_[k]->num_values), -1);
      env_[k].resize(static_cast<size_t>(order_[k]->num_values));
    }
    int64_t g = 0;
    for (size_t k = 0; k < order_.size(); ++k) {
      for (const InitStep& step : order_[k]->steps) {
        for (const InitArg& a : step.args) {
          for (const InitSlot& s : a.slots) {
            if (s.record != nullptr) {
              last_[at_of_.at(s.record)][static_cast<size_t>(s.id)] = g;
            }
          }
        }
        for (const auto& ids : step.outputs) {
          for (int64_t id : ids) {
            if (id >= 0) {
              last_[k][static_cast<size_t>(id)] = g;
            }
          }
        }
        ++g;
      }
    }
    for (const auto& [name, t] : tensors_) {
      InitTag* tag = tag_of(t);
      last_[at_of_.at(tag->record.get())][static_cast<size_t>(tag->id)] = kKeep;
    }
  }

  // The tensor a failed step is named by: one it wrote, else the first made after it.
  std::string name_for(size_t k, int64_t local, const InitStep& step) const {
    for (const auto& [name, t] : tensors_) {
      const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
      if (std::find(step.touched.begin(), step.touched.end(), s) != step.touched.end()) {
        return name;
      }
    }
    for (const auto& [name, t] : tensors_) {
      InitRecord* r = tag_of(t)->record.get();
      auto it = r->storages.find(t.storage().unsafeGetStorageImpl());
      if (at_of_.at(r) > k || (r == order_[k] && it != r->storages.end() && it->second.last_step >= local)) {
        return name + " (made after it)";
      }
    }
    return tensors_.front().first;
  }

  void fail(size_t k, int64_t local, const InitStep& step, const std::string& why) const {
    TORCH_CHECK(false, "materialize: cannot give ", name_for(k, local, step),
                " the values its construction gave: ", op_name(step.op), " ", why, " on ", device_,
                "; nothing was changed");
  }

  // A slot's real value: the record's (`ready` false when it has none), or
  // the constant, refused when it changed since the construction.
  at::Tensor value_of(const InitSlot& s, size_t k, int64_t local, const InitStep& step, bool& ready) const {
    if (s.record != nullptr) {
      const at::Tensor& v = env_[at_of_.at(s.record)][static_cast<size_t>(s.id)];
      ready = ready && v.defined();
      return v;
    }
    if (s.constant.defined() && s.version >= 0) {
      const auto now = static_cast<int64_t>(s.constant.unsafeGetTensorImpl()->version_counter().current_version());
      if (now != s.version) {
        fail(k, local, step,
             fmt::format("read a real tensor of size {} that was changed after the construction (version {}, "
                         "now {}), so it cannot be replayed",
                         s.constant.sizes(), s.version, now));
      }
    }
    return s.constant;
  }

  // The step's arguments on the device.
  torch::jit::Stack arguments(size_t k, int64_t local, const InitStep& step, bool& ready) const {
    torch::jit::Stack stack;
    for (const InitArg& a : step.args) {
      switch (a.kind) {
        case InitArgKind::kValue:
          if (a.value.isDevice() && a.value.toDevice().is_meta()) {
            stack.emplace_back(device_);
          } else {
            stack.push_back(a.value);
          }
          break;
        case InitArgKind::kTensor:
          stack.emplace_back(value_of(a.slots[0], k, local, step, ready));
          break;
        case InitArgKind::kTensorList: {
          c10::List<at::Tensor> list;
          for (const InitSlot& s : a.slots) {
            list.push_back(value_of(s, k, local, step, ready));
          }
          stack.emplace_back(std::move(list));
          break;
        }
        case InitArgKind::kOptionalTensorList: {
          c10::List<std::optional<at::Tensor>> list;
          for (const InitSlot& s : a.slots) {
            at::Tensor v = value_of(s, k, local, step, ready);
            list.push_back(v.defined() || s.record != nullptr ? std::optional<at::Tensor>(v) : std::nullopt);
          }
          stack.emplace_back(std::move(list));
          break;
        }
      }
    }
    return stack;
  }

  // Runs the step on `stack` and keeps the values it returned.
  void call(size_t k, int64_t local, const InitStep& step, torch::jit::Stack& stack) {
    try {
      step.op.callBoxed(&stack);
    } catch (const c10::Error& e) {
      fail(k, local, step, fmt::format("failed ({})", e.what_without_backtrace()));
    }
    for (size_t i = 0; i < step.outputs.size() && i < stack.size(); ++i) {
      const auto& ids = step.outputs[i];
      if (stack[i].isTensor() && ids.size() == 1 && ids[0] >= 0) {
        env_[k][static_cast<size_t>(ids[0])] = stack[i].toTensor();
      } else if (stack[i].isTensorList()) {
        const auto list = stack[i].toTensorList().vec();
        for (size_t j = 0; j < ids.size() && j < list.size(); ++j) {
          if (ids[j] >= 0) {
            env_[k][static_cast<size_t>(ids[j])] = list[j];
          }
        }
      }
    }
  }

  // Real values released after their last use, global step `g`.
  void release_after(size_t k, const InitStep& step, int64_t g) {
    auto release = [&](size_t kk, int64_t id) {
      if (id >= 0 && last_[kk][static_cast<size_t>(id)] == g) {
        env_[kk][static_cast<size_t>(id)].reset();
      }
    };
    for (const InitArg& a : step.args) {
      for (const InitSlot& s : a.slots) {
        if (s.record != nullptr) {
          release(at_of_.at(s.record), s.id);
        }
      }
    }
    for (const auto& ids : step.outputs) {
      for (int64_t id : ids) {
        release(k, id);
      }
    }
  }

  const NamedTensors& tensors_;
  std::vector<InitRecord*> order_;
  c10::Device device_;
  std::unordered_map<const InitRecord*, size_t> at_of_;
  std::vector<std::vector<int64_t>> last_;
  std::vector<std::vector<at::Tensor>> env_;
};

} // namespace

std::vector<at::Tensor> replay_init(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                    c10::Device device) {
  auto order = records_oldest_first(tensors);
  check_untainted(tensors);
  Replay replay(tensors, std::move(order), device);
  replay.run();
  return replay.results();
}

} // namespace trainmem::detail
