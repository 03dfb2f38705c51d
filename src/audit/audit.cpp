#include "trainmem/audit.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include <sys/mman.h>

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/flat_hash_map.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "trainmem/accountant.h"
#include "trainmem/allocator.h"
#include "trainmem/device.h"
#include "trainmem/meter.h"
#include "trainmem/optimizer_in_backward.h"

#include "core/detail/alloc_recorder.h"
#include "detail/attribution.h"
#include "detail/backward_listener.h"
#include "core/detail/optimizer_state_walk.h"
#include "detail/thread_id.h"

// Note [Categories from lifetimes]
// The allocator sees bytes, not meaning. An allocation's category follows
// from the storages we can name when the step ends (parameters and buffers
// of every audited module, their gradients, every added optimizer's state,
// labelled tensors, inputs) and otherwise from when it was made and how long it
// lived. Made in forward and still alive when backward starts: ACTIVATION
// (what autograd saved, the output, the loss). Made and freed before that,
// or within backward or an optimizer step: TEMPORARY. Alive at the step's
// end and unnamed: OPTIMIZER_STATE if an optimizer step made it, else
// unknown. Every free carries its allocation's category, so the
// per-category series never drift. Bytes live when recording began are
// attributed the same way (the blocks of named storages are adopted by the
// audit's recorder, so their frees are seen); the rest is "before the
// audit". The meter gives the exact saved bytes beside this; the timeline's
// ACTIVATION is the broader "kept for backward".

// Note [Optimizer phases from ops]
// LibTorch's optimizers have no hook, but their step() runs ops on their
// parameters and gradients under no-grad. While a step is open, a
// thread-local RecordFunction callback looks at each op run without grad
// (outside backward): one that reads or updates a parameter or a gradient
// belongs to the optimizer that owns it, so that optimizer's step begins (a phase of
// its own). An op that builds graph (an output with a grad_fn) is forward.
// After a backward the phase is provisionally "optimizer step": a backward
// that follows makes it forward (gradient accumulation), an optimizer's op
// names it. Gradient clipping on an optimizer's gradients falls in its step.
// Once an op has built graph, the phase is forward until a backward or a
// marked phase ends it or an optimizer steps (DCGAN's discriminator steps
// after `d_loss = real + fake` built graph). Any RecordFunction callback
// costs every op of forward (an empty one about 0.2 us an op, 15 % of the
// LSTMCell decoder's step), so once every audit watching the thread has seen
// forward the callback is removed, and the counting allocator is asked to
// call back at the next allocation made without grad
// (detail::set_allocation_alarm): then the full callback is back for the
// ops after it, as it is after a backward or a marked phase. Forward pays
// nothing. The cost, only for an optimizer that steps after forward began
// and before its backward: the ops of its step up to its first allocation
// and the one that allocates fall in forward, and a step that allocates
// nothing (SGD without momentum) stays in forward. Likewise, once the step
// of an audit's only optimizer has shown itself, no other optimizer can
// follow: the callback goes until an allocation with grad (forward again);
// the op that makes it and those it ran inside of are not looked at, so a
// forward after the step begins one op later. A step begins in forward, so
// there any op run with grad shows forward, graph or not: a frozen encoder
// (captioning's pretrained CNN) builds none, and the callback would
// otherwise box its every op (21 us of a 1.5 ms captioning step). A step
// that begins with an optimizer's step is still seen (its ops run without
// grad); one that runs an op with grad first is the case above.

namespace trainmem {
namespace {

uint64_t storage_address(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) {
    return 0;
  }
  return reinterpret_cast<uint64_t>(t.storage().data_ptr().get());
}

const c10::StorageImpl* storage_key(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) {
    return nullptr;
  }
  return t.storage().unsafeGetStorageImpl();
}

struct Span {
  Phase phase = Phase::kForward;
  std::string name;
  int64_t optimizer = -1;    // index of the optimizer whose step this is
  bool provisional = false;  // a guess that evidence may rename
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
  int64_t peak_bytes = 0;
};

// One allocation made while recording, until its category is final.
struct Alloc {
  size_t event = 0;       // index of its alloc event in timeline.events
  bool final = false;     // category decided
};

// Per-thread list of the audits whose step is open on this thread, and the
// one RecordFunction callback that serves them (Note [Optimizer phases from
// ops]). Entries are weak: an audit destroyed on another thread is skipped
// and dropped here later.
thread_local std::vector<std::weak_ptr<Audit::Impl>> tls_watchers;
// kFull looks at every op's inputs and outputs; the quiet modes have no
// callback: kQuietForward (forward, once seen) waits for an allocation
// without grad, kQuietStep (the step of an audit's only optimizer, once
// seen) for one with grad (Note [Optimizer phases from ops]).
enum class WatchMode { kOff, kFull, kQuietForward, kQuietStep };

// Note [Metering the steps that differ]: on its default schedule the meter
// runs at least once in this many steps, however steady the loop.
constexpr int64_t kMeterAtLeastEvery = 10;

// Note [The event log's pages]
// The event log grows by a few hundred events (40 B each) a step until
// max_events. The room is reserved at once, up to kEventRoom events
// (address space only), so the log is not copied as it grows that far.
// Each page of it written for the first time costs a fault: a decoder step
// on our VM writes eight, about 35 us or 0.8 % of the step (timed inside
// the step, against a recycled log). So before a step's events are added
// the log's next kPopulateBytes are populated at once
// (madvise(MADV_POPULATE_WRITE), Linux 5.14+; elsewhere the writes fault as
// before): about 2 us a page, paid once every few dozen steps. It is not
// advised to transparent huge pages: where the kernel has no free
// huge page it compacts memory inside the fault (defrag "madvise", the
// common default), stalls of a few milliseconds every few dozen steps that
// hide from a median. With that advice the audited decoder's mean step cost
// 1.113-1.121x on our VM, without it 1.086-1.093x (docs/design.md,
// docs/benchmarks.md).
constexpr int64_t kEventRoom = int64_t{1} << 21;
// How much of the log is populated at once, ahead of its writes.
constexpr uintptr_t kPopulateBytes = uintptr_t{1} << 20;

bool is_quiet(WatchMode mode) {
  return mode == WatchMode::kQuietForward || mode == WatchMode::kQuietStep;
}
thread_local WatchMode tls_watch_mode = WatchMode::kOff;
thread_local std::optional<at::CallbackHandle> tls_watch_callback;
// The callback was removed for a backward (Note [No op watcher in backward]).
thread_local bool tls_watch_suspended = false;
void set_watch_mode(WatchMode mode);

std::unique_ptr<at::ObserverContext> on_watch_start(const at::RecordFunction& fn);
void on_watch_end(const at::RecordFunction& fn, at::ObserverContext*);

} // namespace

struct Audit::Impl : std::enable_shared_from_this<Audit::Impl> {
  using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  // Note [Optimizers that come and go]
  // LibTorch's optimizers have no destruction hook, and a loop may make one
  // per epoch (often at the same stack address), rebuild it in a scheduler,
  // or drop it before report(). So an added optimizer is read only while it
  // is known to be alive, and what the report needs is kept as of its last
  // read:
  //  - report() never reads an optimizer: each one's state figures are kept
  //    from add_optimizer() and from every step end where its state tensors
  //    changed.
  //  - An optimizer is retired (never read again, its figures kept) when
  //    add_optimizer() is given another one at its address or over any of
  //    its parameters (the new one takes its name and phase), or when every
  //    state tensor it held at its last read is gone (destroyed).
  //  - A stateless one (plain SGD, or any before its first step) cannot be
  //    seen to die: plain SGD is never read after add_optimizer(), and the
  //    others only at the end of a step in which their parameters' update
  //    ran. The limit: an optimizer destroyed before its first step while
  //    another, not added, steps its parameters.
  // The same object added twice stays one optimizer.
  struct NamedOptimizer {
    const torch::optim::Optimizer* optimizer;
    std::string name;   // phase name
    int64_t group = 0;  // optimizers added in one call share a phase (OptimizerInBackward)
    bool retired = false;
    int64_t retired_before = -1;  // the first step it was not part of
    std::string retired_why;
    bool plain_sgd = false;       // never holds state: read once
    bool stepped = false;         // its parameters' update ran in the open step
    bool unknown_state = false;   // a state type the walk cannot read: figures refreshed each step
    // Its state tensors at the last read: the impls to see a change, weak
    // references to see it die.
    std::vector<const c10::TensorImpl*> state_impls;
    std::vector<WeakTensor> state_refs;
    // Its parameters at the last read (gradients are read through them).
    std::vector<WeakTensor> params;
    std::string type;       // "Adam", "SGD", ... or "optimizer"
    StaticBuckets figures;  // state bytes as of the last read
  };
  struct AuditedModule {
    const torch::nn::Module* raw;           // for a module no shared_ptr owns
    std::weak_ptr<const torch::nn::Module> weak;  // for one that a holder or make_shared owns
    bool shared = false;
    const torch::nn::Module* get() const {
      if (!shared) {
        return raw;
      }
      auto m = weak.lock();
      return m ? m.get() : nullptr;  // the owner outlives this call: its holder is the user's
    }
  };
  struct Label {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    const c10::StorageImpl* key;
    std::string name;
    Category category;
    bool bucket = true;  // shown as a bucket of the report (label()), or only a timeline category (set_category())
  };

  std::vector<AuditedModule> modules;
  std::vector<at::Tensor> optimized_inputs;  // add_optimized_input(): leaves of no module
  // TorchScript modules, held weakly: a module gone is skipped.
  std::vector<c10::weak_intrusive_ptr<c10::ivalue::Object>> jit_modules;
  std::vector<NamedOptimizer> optimizers;
  int64_t num_groups = 0;
  std::vector<Label> labels;
  c10::Device device;
  AuditOptions options;
  CpuMemoryTracker* tracker = nullptr;
  std::unique_ptr<detail::AllocRecorder> recorder;
  std::unique_ptr<SavedTensorMeter> meter;
  std::unique_ptr<SavedTensorMeterGuard> meter_guard;
  bool metering = false;  // the meter runs in the open step (AuditOptions::meter_every)
  int64_t last_metered_step = -1;
  // Note [Metering the steps that differ]
  detail::AllocationShape metered_shape;  // the last metered step's allocations
  bool steady = false;  // the last metered step repeated the step before it
  int64_t listener_id = 0;
  uint64_t step_thread = 0;

  // Timeline state.
  Timeline timeline;
  bool recording_started = false;
  int64_t origin_ns = 0;      // tracker time of the audit's time zero
  // Flat maps (c10's copy of ska::flat_hash_map): each block a step makes is
  // inserted and erased here, and a flat map allocates nothing for either.
  ska::flat_hash_map<uint64_t, Alloc> live;      // address -> open allocation
  ska::flat_hash_map<uint64_t, Category> known;  // adopted pre-existing blocks
  std::vector<MemoryEvent> synthetic;            // adoption events of this step, by time
  struct Input {
    uint64_t address;
    int64_t marked_ns;
  };
  std::vector<Input> inputs;  // marked in the open step

  // Step state; `mutex` guards what the backward listener and the op
  // callback touch (both run on the step's thread; the lock makes a
  // destruction from another thread safe).
  std::mutex mutex;
  bool open = false;
  bool closed = false;  // the Audit is gone
  int64_t step_index = 0;
  std::chrono::steady_clock::time_point wall_begin;
  int64_t step_begin_ns = 0;
  std::vector<Span> spans;
  std::unique_ptr<PeakWindow> window;
  int backward_depth = 0;
  // What this audit learnt since the last phase change: kQuietForward once
  // an op built graph, kQuietStep once the only optimizer's op ran; kFull
  // while ops may still change the phase.
  WatchMode learnt = WatchMode::kFull;
  std::optional<Span> marked;  // an explicit phase (begin_phase)
  // Storage -> optimizer index: parameters (refreshed each step) and
  // gradients (refreshed after each backward).
  std::unordered_map<const c10::StorageImpl*, int64_t> param_owner, grad_owner;

  std::vector<StepRecord> steps;
  SavedTensorReport last_saved;
  SavedTensorReport step_saved;  // largest micro-batch of the open step
  std::vector<std::pair<std::string, std::string>> config;
  std::vector<std::string> notes;
  int64_t predicted_activation_bytes = -1;

  Impl(c10::Device d, AuditOptions opts) : device(d), options(std::move(opts)) {}

  std::vector<at::Tensor> parameters() const {
    std::vector<at::Tensor> out;
    std::unordered_set<const c10::TensorImpl*> seen;
    auto add = [&](const at::Tensor& p) {
      if (p.defined() && seen.insert(p.unsafeGetTensorImpl()).second) {
        out.push_back(p);
      }
    };
    for (const auto& am : modules) {
      if (const auto* m = am.get()) {
        for (const auto& p : m->parameters()) {
          add(p);
        }
      }
    }
    for (const auto& w : jit_modules) {
      if (auto obj = w.lock()) {
        for (const auto& p : torch::jit::Module(std::move(obj)).parameters()) {
          add(p);
        }
      }
    }
    return out;
  }

  // Buffers (BatchNorm's running statistics): BUFFER on the timeline and a
  // bucket of their own, so that the peak's categories and the static
  // buckets name the same bytes.
  std::vector<at::Tensor> buffers() const {
    std::vector<at::Tensor> out;
    for (const auto& am : modules) {
      if (const auto* m = am.get()) {
        for (const auto& b : m->buffers()) {
          out.push_back(b);
        }
      }
    }
    for (const auto& w : jit_modules) {
      if (auto obj = w.lock()) {
        for (const auto& b : torch::jit::Module(std::move(obj)).buffers()) {
          out.push_back(b);
        }
      }
    }
    return out;
  }

  // Every parameter in one module, so that the accountant can read
  // optimizers whose parameters span several audited modules.
  std::shared_ptr<torch::nn::Module> union_module() const {
    auto u = std::make_shared<torch::nn::Module>("audited");
    int64_t i = 0;
    for (const auto& p : parameters()) {
      u->register_parameter(fmt::format("p{}", i++), p, p.requires_grad());
    }
    // Optimized inputs: for their gradients and optimizer state (their
    // bytes are their own bucket, taken out of the parameters' below).
    for (const auto& t : optimized_inputs) {
      u->register_parameter(fmt::format("p{}", i++), t, true);
    }
    // Buffers, for the buffer bucket (the accountant counts a storage that a
    // parameter holds once, as a parameter).
    int64_t j = 0;
    for (const auto& b : buffers()) {
      if (b.defined()) {
        u->register_buffer(fmt::format("b{}", j++), b);
      }
    }
    return u;
  }

  // Parameters and gradients of every module, state summed over optimizers,
  // labelled tensors.
  StaticBuckets buckets() const {
    const auto u = union_module();
    auto b = account(*u);
    for (const auto& t : optimized_inputs) {  // a bucket of their own (labels)
      b.param_bytes -= static_cast<int64_t>(t.storage().nbytes());
      b.num_params -= t.numel();
      b.num_trainable_params -= t.numel();
    }
    std::map<std::string, StateBytes> by_name;
    for (const auto& o : optimizers) {
      if (o.retired) {
        continue;  // gone by the last step: a note says what it held
      }
      const auto& ob = o.figures;  // never read here (Note [Optimizers that come and go])
      b.optimizer_state_bytes += ob.optimizer_state_bytes;
      for (const auto& st : ob.state_by_name) {
        auto& e = by_name[st.name];
        e.name = st.name;
        e.bytes += st.bytes;
        e.num_tensors += st.num_tensors;
      }
    }
    b.state_by_name.clear();
    for (const auto& [name, st] : by_name) {
      b.state_by_name.push_back(st);
    }
    return b;
  }

  // Storages we can name now: category by block address.
  std::unordered_map<uint64_t, Category> owners() const {
    std::unordered_map<uint64_t, Category> o;
    for (const auto& t : held_state()) {
      o[storage_address(t)] = Category::kOptimizerState;
    }
    for (const auto& l : labels) {
      if (auto s = l.storage.lock()) {
        o[reinterpret_cast<uint64_t>(s->data_ptr().get())] = l.category;
      }
    }
    for (const auto& b : buffers()) {  // before the parameters: a shared storage is a parameter
      o[storage_address(b)] = Category::kBuffer;
    }
    for (const auto& p : parameters()) {
      o[storage_address(p)] = Category::kParameter;
      if (p.grad().defined()) {
        o[storage_address(p.grad())] = Category::kGradient;
      }
    }
    for (const auto& t : optimized_inputs) {
      o[storage_address(t)] = Category::kInput;
      if (t.grad().defined()) {
        o[storage_address(t.grad())] = Category::kGradient;
      }
    }
    o.erase(0);
    return o;
  }

  int64_t now_ns() const {
    if (tracker != nullptr) {
      return tracker->now_ns() - origin_ns;
    }
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count() - origin_ns;
  }

  bool per_thread() const {
    return recorder != nullptr;
  }

  void open_window() {
    if (recorder) {
      recorder->open_window();
    } else if (tracker != nullptr) {
      window = std::make_unique<PeakWindow>(*tracker);
    } else {
      reset_peak(device);
    }
  }

  int64_t window_peak() const {
    if (recorder) {
      return recorder->window_peak();  // its baseline ("before the audit") included
    }
    if (tracker != nullptr) {
      return window ? window->peak_bytes() : 0;
    }
    return device_memory_stats(device).peak_allocated_bytes;
  }

  // Ends the current span at `t` and starts `next`.
  void transition(Span next, int64_t t) {
    if (spans.empty()) {
      return;
    }
    spans.back().end_ns = t;
    spans.back().peak_bytes = window_peak();
    open_window();
    next.begin_ns = next.end_ns = t;
    spans.push_back(std::move(next));
    learnt = WatchMode::kFull;
  }

  Span optimizer_span(int64_t opt) const {
    Span s;
    s.phase = Phase::kOptimizerStep;
    s.name = optimizers[static_cast<size_t>(opt)].name;
    s.optimizer = optimizers[static_cast<size_t>(opt)].group;
    return s;
  }

  // Note [Metering the steps that differ]: whether the meter runs in the
  // step about to begin.
  bool meters_next_step() const {
    if (!meter) {
      return false;
    }
    const int64_t every = options.meter_every();
    if (every >= 1) {
      return step_index % every == 0;
    }
    return !(recorder && steady && step_index - last_metered_step < kMeterAtLeastEvery);
  }

  // After a step: its record says whether it repeated the last metered step;
  // whether the loop is steady is updated.
  void judge_shape(StepRecord& rec) {
    if (!meter) {
      return;
    }
    std::optional<detail::AllocationShape> shape;
    if (recorder) {
      shape = recorder->take_shape();
    }
    if (metering) {
      // The step before was metered, or repeated the last metered one.
      const bool previous_known = !steps.empty() && (steps.back().metered || steps.back().repeats >= 0);
      steady = shape && previous_known && *shape == metered_shape && same_saves(step_saved, last_saved);
      metered_shape = shape.value_or(detail::AllocationShape{});
      last_saved = step_saved;
      last_metered_step = step_index;
    } else if (shape && last_metered_step >= 0 && *shape == metered_shape) {
      rec.repeats = last_metered_step;
    } else {
      steady = false;
    }
  }

  // What the report says of the steps the meter skipped, if any.
  std::optional<std::string> meter_note() const {
    if (!meter) {
      return std::nullopt;
    }
    int64_t metered = 0;
    int64_t repeated = 0;
    std::vector<int64_t> unknown;
    for (const auto& st : steps) {
      metered += st.metered ? 1 : 0;
      repeated += st.repeats >= 0 ? 1 : 0;
      if (!st.metered && st.repeats < 0) {
        unknown.push_back(st.step);
      }
    }
    if (metered == static_cast<int64_t>(steps.size())) {
      return std::nullopt;
    }
    const int64_t every = options.meter_every();
    std::string out = fmt::format(
        "the meter ran on {} of {} steps (AuditOptions::meter_every({}): {}); ", metered, steps.size(), every,
        every == 0 ? std::string("the steps that differ") : fmt::format("steps 0, {}, {}, ...", every, 2 * every));
    if (repeated > 0) {
      out += fmt::format(
          "{} more repeated the metered step before them allocation for allocation, so their saved bytes are its; ",
          repeated);
    }
    if (!unknown.empty()) {
      std::string list;
      for (size_t i = 0; i < std::min<size_t>(unknown.size(), 8); ++i) {
        list += fmt::format("{}{}", i == 0 ? "" : ", ", unknown[i]);
      }
      if (unknown.size() > 8) {
        list += ", ...";
      }
      out += fmt::format(
          "{} step{} ({}) did not, and {} saved bytes are not known; ", unknown.size(),
          unknown.size() == 1 ? "" : "s", list, unknown.size() == 1 ? "its" : "their");
    }
    return out + fmt::format("the saved bytes shown are step {}'s", last_metered_step);
  }

  static bool same_saves(const SavedTensorReport& a, const SavedTensorReport& b) {
    return a.saved_bytes == b.saved_bytes && a.device_bytes == b.device_bytes && a.host_bytes == b.host_bytes &&
        a.num_tensors == b.num_tensors && a.num_storages == b.num_storages &&
        a.excluded_param_bytes == b.excluded_param_bytes && a.num_param_tensors == b.num_param_tensors &&
        a.unowned_leaf_bytes == b.unowned_leaf_bytes;
  }

  // The meter covers forward only, one micro-batch at a time: a step's
  // saved bytes are its largest micro-batch's, what backward holds at once.
  void close_meter() {
    if (!meter_guard) {
      return;
    }
    meter_guard.reset();
    auto r = meter->report();
    if (r.saved_bytes >= step_saved.saved_bytes) {
      step_saved = std::move(r);
    }
    meter->reset();
  }

  void refresh_grad_owners() {
    grad_owner.clear();
    for (size_t i = 0; i < optimizers.size(); ++i) {
      if (optimizers[i].retired) {
        continue;
      }
      for_each_param(optimizers[i], [&](const at::Tensor& p) {
        if (p.grad().defined()) {
          grad_owner[storage_key(p.grad())] = static_cast<int64_t>(i);
        }
      });
    }
    grad_owner.erase(nullptr);
  }

  void refresh_param_owners() {
    param_owner.clear();
    for (size_t i = 0; i < optimizers.size(); ++i) {
      auto& o = optimizers[i];
      o.stepped = false;
      if (o.retired) {
        continue;
      }
      if (state_gone(o)) {
        retire(o, "destroyed");
        continue;
      }
      for_each_param(o, [&](const at::Tensor& p) { param_owner[storage_key(p)] = static_cast<int64_t>(i); });
    }
    param_owner.erase(nullptr);
    refresh_grad_owners();
  }

  // Note [Optimizers that come and go]: the parameters as of the last read.
  template <typename F>
  static void for_each_param(const NamedOptimizer& o, F&& f) {
    for (const auto& w : o.params) {
      if (auto impl = w.lock()) {
        f(at::Tensor(std::move(impl)));
      }
    }
  }

  // Every state tensor it held at its last read is gone: it was destroyed.
  static bool state_gone(const NamedOptimizer& o) {
    if (o.state_refs.empty()) {
      return false;  // stateless: cannot tell
    }
    return std::all_of(o.state_refs.begin(), o.state_refs.end(), [](const auto& w) { return w.expired(); });
  }

  void retire(NamedOptimizer& o, const char* why) {
    o.retired = true;
    o.retired_before = step_index;
    o.retired_why = why;
    o.state_refs.clear();
    o.params.clear();
  }

  // Reads a live optimizer: its parameters, its state tensors and, when
  // they changed, its state figures (Note [Optimizers that come and go]).
  void read_optimizer(NamedOptimizer& o, bool force_figures) {
    const auto& opt = *o.optimizer;
    o.params.clear();
    for (const auto& g : opt.param_groups()) {
      for (const auto& p : g.params()) {
        if (p.defined()) {
          o.params.emplace_back(p.getIntrusivePtr());
        }
      }
    }
    if (o.plain_sgd) {
      return;
    }
    std::vector<const c10::TensorImpl*> impls;
    std::vector<at::Tensor> held;
    bool unknown = false;
    detail::for_each_state_tensor(
        opt,
        [&](const std::string&, const at::Tensor& t) {
          if (t.defined()) {
            impls.push_back(t.unsafeGetTensorImpl());
            held.push_back(t);
          }
        },
        [&](const torch::optim::OptimizerParamState&) { unknown = true; });
    o.unknown_state = unknown;
    if (!force_figures && !unknown && impls == o.state_impls) {
      return;
    }
    o.state_impls = std::move(impls);
    o.state_refs.clear();
    for (const auto& t : held) {
      o.state_refs.emplace_back(t.getIntrusivePtr());
    }
    try {
      o.figures = account(*union_module(), opt);
    } catch (const c10::Error& e) {
      TORCH_WARN("trainmem audit: the state of optimizer '", o.name, "' was not read: ", e.what_without_backtrace());
    }
  }

  // At a step's end: the optimizers whose state may have changed are read
  // again, those whose state is gone retired.
  void read_optimizers_after_step() {
    for (auto& o : optimizers) {
      if (o.retired || o.plain_sgd) {
        continue;
      }
      if (state_gone(o)) {
        retire(o, "destroyed");
      } else if (o.stepped || o.state_impls.empty() || o.unknown_state) {
        read_optimizer(o, /*force_figures=*/false);
      }
    }
  }

  // The optimizers retired during the audit, by name (Note [Optimizers that
  // come and go]).
  std::optional<std::string> retired_note() const {
    std::map<std::string, std::vector<const NamedOptimizer*>> by_name;
    for (const auto& o : optimizers) {
      if (o.retired) {
        by_name[o.name].push_back(&o);
      }
    }
    if (by_name.empty()) {
      return std::nullopt;
    }
    std::vector<std::string> parts;
    for (const auto& [name, list] : by_name) {
      std::vector<std::string> when;
      for (const auto* o : list) {
        if (when.size() == 4 && list.size() > 5) {
          when.push_back("...");
          break;
        }
        when.push_back(fmt::format("before step {} ({}; its state then {} B)", o->retired_before, o->retired_why,
                                   with_commas(o->figures.optimizer_state_bytes)));
      }
      parts.push_back(fmt::format("'{}' {} time{}: {}", name, list.size(), list.size() == 1 ? "" : "s",
                                  fmt::join(when, ", ")));
    }
    return fmt::format("optimizers were replaced or destroyed during the audit, and are read no more: {}; the "
                       "buckets count the optimizers alive at the last step",
                       fmt::join(parts, "; "));
  }

  // The state tensors the optimizers held at their last read, still alive.
  std::vector<at::Tensor> held_state() const {
    std::vector<at::Tensor> out;
    for (const auto& o : optimizers) {
      if (o.retired) {
        continue;
      }
      for (const auto& w : o.state_refs) {
        if (auto impl = w.lock()) {
          out.emplace_back(std::move(impl));
        }
      }
    }
    return out;
  }

  void on_backward(bool begin, const torch::autograd::edge_list& roots) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!open || closed) {
      return;
    }
    backward_depth += begin ? 1 : -1;
    if (metering) {
      if (begin) {
        if (meter_guard) {
          detail::name_saved_nodes(*meter, roots);  // Note [Naming nodes by sequence number]
        }
        close_meter();
      } else {
        meter_guard = std::make_unique<SavedTensorMeterGuard>(*meter);
      }
    }
    // Note [No op watcher in backward]
    if (begin) {
      suspend_watch_callback();
    } else {
      resume_watch_callback();
    }
    const int64_t t = now_ns();
    if (begin) {
      // A provisional optimizer step that saw no optimizer was forward
      // (gradient accumulation: forward, backward, forward, backward...).
      if (spans.back().provisional && spans.back().phase == Phase::kOptimizerStep) {
        spans.back().phase = Phase::kForward;
        spans.back().provisional = false;
      }
      Span b;
      b.phase = Phase::kBackward;
      transition(b, t);
    } else {
      refresh_grad_owners();
      Span next;
      if (marked) {
        next = *marked;  // the marked phase resumes
      } else {
        next.phase = Phase::kOptimizerStep;
        next.provisional = true;
      }
      transition(next, t);
    }
  }

  // An op of optimizer `opt` ran (Note [Optimizer phases from ops]).
  void on_optimizer_op(int64_t opt) {
    auto& cur = spans.back();
    optimizers[static_cast<size_t>(opt)].stepped = true;
    const int64_t group = optimizers[static_cast<size_t>(opt)].group;
    if (cur.phase == Phase::kOptimizerStep && cur.optimizer == group) {
      return;
    }
    if (cur.provisional) {
      const int64_t begin = cur.begin_ns;
      cur = optimizer_span(opt);
      cur.begin_ns = begin;
    } else {
      transition(optimizer_span(opt), now_ns());
    }
    if (num_groups == 1) {
      learnt = WatchMode::kQuietStep;  // no other optimizer's op can follow
    }
  }

  void on_forward_op() {
    auto& cur = spans.back();
    if (cur.phase == Phase::kForward) {
      return;
    }
    if (cur.provisional) {
      cur.phase = Phase::kForward;
      cur.provisional = false;
      return;
    }
    if (cur.phase == Phase::kOptimizerStep) {
      Span f;
      f.phase = Phase::kForward;
      transition(f, now_ns());
    }
  }

  bool watching() const {
    return open && !closed && backward_depth == 0 && !marked && !optimizers.empty();
  }

  void watch_start(const at::RecordFunction& fn) {
    if (c10::GradMode::is_enabled()) {
      return;  // LibTorch's optimizers step under NoGradGuard; forward (and
               // TorchScript's detached differentiable graphs) run with grad.
               // Checked first: most ops of a step run with grad, and take no lock.
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (!watching()) {
      return;
    }
    const auto name = std::string_view(fn.name());
    if (name == "aten::zero_" || name == "aten::detach_" || name == "aten::detach") {
      return;  // zero_grad(false) and friends are no step
    }
    int64_t owner = -1;
    auto look = [&](const at::Tensor& t) {
      if (owner >= 0 || !t.defined() || !t.has_storage()) {
        return;
      }
      const auto* key = t.storage().unsafeGetStorageImpl();
      if (auto it = param_owner.find(key); it != param_owner.end()) {
        owner = it->second;  // a parameter updated or read without grad
      } else if (auto g = grad_owner.find(key); g != grad_owner.end()) {
        owner = g->second;
      }
    };
    for (const auto& v : fn.inputs()) {
      if (v.isTensor()) {
        look(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorVector()) {
          look(t);
        }
      }
      if (owner >= 0) {
        break;
      }
    }
    if (owner >= 0) {
      on_optimizer_op(owner);
    }
  }

  void watch_end(const at::RecordFunction& fn) {
    if (!c10::GradMode::is_enabled()) {
      return;
    }
    bool builds_graph = false;
    for (const auto& v : fn.outputs()) {
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().grad_fn()) {
        builds_graph = true;
        break;
      }
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (!watching()) {
      return;
    }
    if (builds_graph) {
      on_forward_op();
      learnt = WatchMode::kQuietForward;
    } else if (spans.back().phase == Phase::kForward && !spans.back().provisional) {
      // The step began in forward and an op ran with grad: forward has
      // shown itself, though this op built no graph (a frozen encoder's).
      learnt = WatchMode::kQuietForward;
    }
  }

  // Forward has shown itself since the last phase change: until the next
  // one the watcher has nothing to learn (Note [Optimizer phases from ops]).
  // Or the audit's only optimizer has shown itself: until forward allocates.
  WatchMode quiet_mode() {
    std::lock_guard<std::mutex> lock(mutex);
    return learnt;
  }

  void start_watching() {
    if (optimizers.empty()) {
      return;
    }
    auto& w = tls_watchers;
    w.erase(std::remove_if(w.begin(), w.end(), [](const auto& e) { return e.expired(); }), w.end());
    w.push_back(weak_from_this());
    tls_watch_suspended = false;
    set_watch_mode(WatchMode::kFull);
  }

  // Note [No op watcher in backward]
  // Every op the watcher sees costs a RecordFunction with its inputs and
  // outputs boxed (about 0.3 us an op, docs/benchmarks.md), a share that a
  // step of tiny ops does not hide, and it has nothing to do in backward:
  // every audit watching this thread has an open step here, so each sees
  // the same outermost backward (the engine's listeners are per thread) and
  // watching() is false for all of them until it ends.
  // So the callback is removed while a backward runs on the step's thread
  // and added back when it ends (an audit whose listener is called here is
  // on this thread: tls state is its own).
  static void suspend_watch_callback() {
    if (tls_watch_mode != WatchMode::kOff) {
      set_watch_mode(WatchMode::kOff);
      tls_watch_suspended = true;
    }
  }

  static void resume_watch_callback() {
    if (tls_watch_suspended) {
      tls_watch_suspended = false;
      if (!tls_watchers.empty()) {
        set_watch_mode(WatchMode::kFull);
      }
    }
  }

  // A phase changed without a backward (a marked phase ended): look at every op again.
  static void wake_watch_callback() {
    if (is_quiet(tls_watch_mode)) {
      set_watch_mode(WatchMode::kFull);
    }
  }

  // On the step's thread only (thread-local state).
  void stop_watching() {
    auto& w = tls_watchers;
    const auto* self = this;
    w.erase(std::remove_if(w.begin(), w.end(),
                           [self](const auto& e) {
                             auto p = e.lock();
                             return !p || p.get() == self;
                           }),
            w.end());
    if (w.empty()) {
      tls_watch_suspended = false;
      set_watch_mode(WatchMode::kOff);
    }
  }

  // Adopts the block under `t` into the recorder (Note [Categories from
  // lifetimes]); bytes made before recording leave "before the audit".
  // Returns the adopted bytes.
  int64_t adopt(const c10::Storage& storage, Category category, int64_t at_ns) {
    if (!recorder) {
      return 0;
    }
    int64_t alloc_ns = 0;
    const int64_t bytes = recorder->adopt(storage, &alloc_ns);
    if (bytes == 0) {
      return 0;
    }
    const auto address = reinterpret_cast<uint64_t>(storage.data_ptr().get());
    if (!recording_started || alloc_ns - origin_ns < 0) {
      // Part of the baseline (the recorder moved its bytes out of it): its
      // bytes change category there.
      if (recording_started) {
        synthetic.push_back(MemoryEvent{at_ns, -bytes, 0, Category::kBeforeAudit, Phase::kForward, step_index});
        synthetic.push_back(MemoryEvent{at_ns, bytes, 0, category, Phase::kForward, step_index});
      } else {
        timeline.baseline_bytes[static_cast<int>(category)] += bytes;
      }
      known[address] = category;
    } else {
      // Made since, on a thread the audit does not record (a data loader):
      // it appears now.
      synthetic.push_back(MemoryEvent{at_ns, bytes, address, category, Phase::kForward, step_index});
    }
    return bytes;
  }

  // label() and set_category(): defined below.
  void add_label(const at::Tensor& tensor, std::string name, Category category, bool bucket, const char* who);

  void start_recording() {
    recording_started = true;
    recorder = std::make_unique<detail::AllocRecorder>(options.max_events());
    recorder->attach_this_thread();
    recorder->set_logging(true);
    // Everything live now is the recorder's baseline (Note [A recorder's
    // baseline]); adopt what we can name, the rest is "before the audit" and
    // leaves it when freed.
    origin_ns = recorder->begin_baseline();
    recording_started = false;  // adopt() into the baseline
    std::vector<std::pair<c10::Storage, Category>> named;
    const auto state = held_state();
    auto add = [&](const at::Tensor& t, Category c) {
      if (t.defined() && t.has_storage()) {
        named.emplace_back(t.storage(), c);
      }
    };
    for (const auto& p : parameters()) {
      add(p, Category::kParameter);
      add(p.grad(), Category::kGradient);
    }
    for (const auto& b : buffers()) {
      add(b, Category::kBuffer);
    }
    for (const auto& t : state) {
      add(t, Category::kOptimizerState);
    }
    for (const auto& l : labels) {
      if (auto st = l.storage.lock()) {
        named.emplace_back(c10::Storage(std::move(st)), l.category);
      }
    }
    for (const auto& [storage, category] : named) {
      adopt(storage, category, 0);
    }
    recording_started = true;
    timeline.baseline_bytes[static_cast<int>(Category::kBeforeAudit)] = recorder->baseline_bytes();
  }

  // Note [The event log's pages]. Before `incoming` events are added.
  void make_event_room(size_t incoming) {
    auto& events = timeline.events;
    const auto room = static_cast<size_t>(std::min(options.max_events(), kEventRoom));
    if (events.capacity() < room) {
      try {
        events.reserve(room);
      } catch (const std::bad_alloc&) {
        // Strict overcommit may refuse the room at once: grow as needed.
      }
    }
#ifdef MADV_POPULATE_WRITE
    if (events.data() != populated_log) {  // reserved here, or moved by growth
      populated_log = events.data();
      populated_end = reinterpret_cast<uintptr_t>(events.data() + events.size());
    }
    const auto need = reinterpret_cast<uintptr_t>(events.data() + std::min(events.size() + incoming, events.capacity()));
    const auto limit = reinterpret_cast<uintptr_t>(events.data() + events.capacity());
    if (populate_log && need > populated_end) {
      constexpr uintptr_t kPage = 4096;
      const uintptr_t begin = populated_end & ~(kPage - 1);
      const uintptr_t end = std::min(std::max(need, begin + kPopulateBytes), limit) & ~(kPage - 1);
      if (end > begin && madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) != 0) {
        populate_log = false;  // a kernel before 5.14: first writes fault, as before
      }
      populated_end = std::max(populated_end, end);
    }
#endif
  }
  // Scratch of classify_step_events, kept between steps for their room.
  std::vector<detail::RecordedEvent> spare_log;
  std::vector<size_t> made_log;
  const MemoryEvent* populated_log = nullptr;
  uintptr_t populated_end = 0;
  bool populate_log = true;

  bool push_event(const MemoryEvent& e) {
    if (static_cast<int64_t>(timeline.events.size()) >= options.max_events()) {
      ++timeline.num_dropped_events;
      return false;
    }
    timeline.events.push_back(e);
    return true;
  }

  Phase phase_at(int64_t t) const {
    for (const auto& s : spans) {
      if (t < s.end_ns) {
        return s.phase;
      }
    }
    return spans.empty() ? Phase::kForward : spans.back().phase;
  }

  int64_t first_backward_after(int64_t t) const {
    for (const auto& s : spans) {
      if (s.phase == Phase::kBackward && s.begin_ns >= t) {
        return s.begin_ns;
      }
    }
    return INT64_MAX;
  }

  bool is_input(uint64_t address, int64_t alloc_ns) const {
    return std::any_of(inputs.begin(), inputs.end(), [&](const auto& in) {
      return in.address == address && in.marked_ns >= alloc_ns;
    });
  }

  // Category of an allocation freed at `free_ns` in this step.
  Category category_of_freed(const MemoryEvent& a, int64_t free_ns) const {
    if (is_input(a.address, a.time_ns)) {
      return Category::kInput;
    }
    if (a.phase == Phase::kForward && a.time_ns >= step_begin_ns && free_ns >= first_backward_after(a.time_ns)) {
      return Category::kActivation;
    }
    return Category::kTemporary;
  }

  // Category of an allocation still live at the step's end.
  Category category_of_live(const MemoryEvent& a, const std::unordered_map<uint64_t, Category>& own) const {
    if (is_input(a.address, a.time_ns)) {
      return Category::kInput;
    }
    if (auto it = own.find(a.address); it != own.end()) {
      return it->second;
    }
    if (a.time_ns < step_begin_ns) {
      return Category::kUnknown;  // made between steps
    }
    if (a.phase == Phase::kOptimizerStep) {
      return Category::kOptimizerState;
    }
    if (a.phase == Phase::kForward && first_backward_after(a.time_ns) != INT64_MAX) {
      return Category::kActivation;
    }
    return Category::kUnknown;
  }

  void classify_step_events(const std::vector<detail::RecordedEvent>& raw) {
    timeline.num_dropped_events += recorder->take_num_dropped();
    // Blocks of the baseline freed in this step leave "before the audit".
    for (const auto& f : recorder->take_baseline_frees()) {
      synthetic.push_back(
          MemoryEvent{f.time_ns - origin_ns, f.bytes, 0, Category::kBeforeAudit, Phase::kForward, step_index});
    }
    make_event_room(raw.size() + synthetic.size());
    // A free `e` (its phase set) paired with its allocation `a`: the pair's
    // category is decided now, unless the allocation's is final.
    auto close_pair = [&](MemoryEvent& a, bool final, MemoryEvent e) {
      if (!final) {
        a.category = category_of_freed(a, e.time_ns);
      }
      e.category = a.category;
      push_event(e);
    };
    auto handle = [&](MemoryEvent e, bool adoption) {
      e.phase = phase_at(e.time_ns);
      if (adoption) {
        // An adoption: its category is set; an alloc stays open until freed.
        if (e.address != 0 && e.bytes > 0 && push_event(e)) {
          live[e.address] = Alloc{timeline.events.size() - 1, true};
        } else if (e.address == 0) {
          push_event(e);
        }
        return;
      }
      if (e.bytes > 0) {
        if (push_event(e)) {
          live[e.address] = Alloc{timeline.events.size() - 1, false};
        }
        return;
      }
      if (auto it = live.find(e.address); it != live.end()) {
        const Alloc open = it->second;
        live.erase(it);
        close_pair(timeline.events[open.event], open.final, e);
        return;
      }
      if (auto k = known.find(e.address); k != known.end()) {
        e.category = k->second;
        known.erase(k);
      } else {
        return;  // its allocation was dropped (the log was full): nothing to pair
      }
      push_event(e);
    };
    auto from_raw = [&](const detail::RecordedEvent& r) {
      MemoryEvent e;
      e.time_ns = r.time_ns - origin_ns;
      e.bytes = r.bytes;
      e.address = r.address;
      e.category = Category::kUnknown;
      e.step = step_index;
      return e;
    };
    const auto by_time = [](const auto& a, const auto& b) { return a.time_ns < b.time_ns; };
    if (synthetic.empty() && std::is_sorted(raw.begin(), raw.end(), by_time)) {
      // The usual step: one thread's events, already in time order. Most
      // blocks are made and freed among them: those pair by the log's
      // numbers, with no lookup (about a fifth of the classification's
      // instructions went to `live`); what was made before goes through
      // `live`, and what outlives them joins it.
      constexpr size_t kNone = SIZE_MAX;
      const auto first_made = std::find_if(raw.begin(), raw.end(), [](const auto& r) { return r.bytes > 0; });
      const int64_t first = first_made == raw.end() ? INT64_MAX : first_made->seq;
      auto& made = made_log;  // by seq - first: the allocation's event, or kNone
      made.clear();
      for (const auto& r : raw) {
        const int64_t k = r.seq >= first ? r.seq - first : -1;  // -1: made before these events
        if (r.bytes > 0 && k >= 0) {
          MemoryEvent e = from_raw(r);
          e.phase = phase_at(e.time_ns);
          made.resize(std::max(made.size(), static_cast<size_t>(k)), kNone);  // a number lost to a failed push
          made.push_back(push_event(e) ? timeline.events.size() - 1 : kNone);
        } else if (r.bytes < 0 && k >= 0 && k < static_cast<int64_t>(made.size())) {
          auto& slot = made[static_cast<size_t>(k)];
          if (slot == kNone) {
            continue;  // its allocation was dropped (the log was full): nothing to pair
          }
          MemoryEvent e = from_raw(r);
          e.phase = phase_at(e.time_ns);
          close_pair(timeline.events[slot], false, e);
          slot = kNone;
        } else {
          handle(from_raw(r), false);
        }
      }
      for (const size_t i : made) {
        if (i != kNone) {
          live[timeline.events[i].address] = Alloc{i, false};
        }
      }
    } else {
      // The recorder's events and this step's adoptions, in time order.
      std::vector<MemoryEvent> all;
      all.reserve(raw.size() + synthetic.size());
      for (const auto& r : raw) {
        all.push_back(from_raw(r));
      }
      const size_t num_raw = all.size();
      all.insert(all.end(), synthetic.begin(), synthetic.end());
      synthetic.clear();
      std::vector<size_t> order(all.size());
      for (size_t i = 0; i < order.size(); ++i) {
        order[i] = i;
      }
      std::stable_sort(order.begin(), order.end(),
                       [&](size_t a, size_t b) { return all[a].time_ns < all[b].time_ns; });
      for (const size_t i : order) {
        handle(all[i], i >= num_raw);
      }
    }
    // What survives the step gets its final category now. In a loop's
    // steady state that is the new gradients alone: an optimizer's
    // parameter's gradient is GRADIENT in owners() too (its parameters are
    // the audited modules' or optimized inputs, add_optimizer() checks), so
    // they are named from the optimizers, and owners() (a walk over every
    // module, about 0.5 % of a step of small ops) is made only for the rest.
    std::vector<uint64_t> grads;
    for (const auto& opt : optimizers) {
      if (opt.retired) {
        continue;
      }
      for_each_param(opt, [&](const at::Tensor& p) {
        if (p.grad().defined()) {
          grads.push_back(storage_address(p.grad()));
        }
      });
    }
    std::optional<std::unordered_map<uint64_t, Category>> own;
    for (auto& [address, a] : live) {
      if (a.final) {
        continue;
      }
      auto& e = timeline.events[a.event];
      if (!is_input(e.address, e.time_ns) && std::find(grads.begin(), grads.end(), address) != grads.end()) {
        e.category = Category::kGradient;
      } else {
        if (!own) {
          own = owners();
        }
        e.category = category_of_live(e, *own);
      }
      a.final = true;
    }
  }
};

namespace {

// Calls `f` on every live watcher of this thread. A RecordFunction callback
// must not throw into the op it observes: a failure only costs the phase.
template <typename F>
void for_each_watcher(F f) noexcept {
  try {
    for (const auto& w : tls_watchers) {
      if (auto impl = w.lock()) {
        f(*impl);
      }
    }
  } catch (const std::exception& e) {
    TORCH_WARN("trainmem::Audit: could not follow an op's phase: ", e.what());
  } catch (...) {
  }
}

// Every audit watching this thread agrees that ops have nothing to tell
// until an allocation (Note [Optimizer phases from ops]): the callback goes.
// `mode` is the one quiet mode that the op just seen can lead to (an op with
// grad to kQuietForward, one without to kQuietStep), so that a no-grad
// region inside forward does not swap the callback at each allocation.
void quiet_if_all_agree(WatchMode mode) {
  bool agree = true;
  for_each_watcher([&](auto& impl) { agree = agree && impl.quiet_mode() == mode; });
  if (agree && !tls_watchers.empty()) {
    set_watch_mode(mode);
  }
}

std::unique_ptr<at::ObserverContext> on_watch_start(const at::RecordFunction& fn) {
  for_each_watcher([&](auto& impl) { impl.watch_start(fn); });
  if (!c10::GradMode::is_enabled()) {
    quiet_if_all_agree(WatchMode::kQuietStep);
  }
  return nullptr;
}

void on_watch_end(const at::RecordFunction& fn, at::ObserverContext*) {
  for_each_watcher([&](auto& impl) { impl.watch_end(fn); });
  if (c10::GradMode::is_enabled()) {
    quiet_if_all_agree(WatchMode::kQuietForward);  // until an allocation without grad, a backward's end or a phase change
  }
}

// Forward, once seen: only an op without grad can change the phase (an
// optimizer step after forward, before any backward), and the optimizers'
// steps allocate. The only optimizer's step, once seen: only forward can,
// and it allocates with grad.
void on_quiet_allocation() noexcept {
  try {
    if (is_quiet(tls_watch_mode)) {
      const bool any = std::any_of(tls_watchers.begin(), tls_watchers.end(),
                                   [](const auto& w) { return !w.expired(); });
      // The ops after this allocation; nothing if every audit here is gone.
      set_watch_mode(any ? WatchMode::kFull : WatchMode::kOff);
    }
  } catch (const std::exception& e) {
    TORCH_WARN("trainmem::Audit: could not follow an op's phase: ", e.what());
  } catch (...) {
  }
}

void set_watch_mode(WatchMode mode) {
  if (mode == tls_watch_mode) {
    return;
  }
  if (tls_watch_callback) {
    at::removeCallback(*tls_watch_callback);
    tls_watch_callback.reset();
  }
  tls_watch_mode = mode;
  detail::set_allocation_alarm(is_quiet(mode) ? &on_quiet_allocation : nullptr, mode == WatchMode::kQuietStep);
  if (mode == WatchMode::kFull) {
    tls_watch_callback = at::addThreadLocalCallback(at::RecordFunctionCallback(&on_watch_start, &on_watch_end)
                                                        .needsInputs(true)
                                                        .needsOutputs(true)
                                                        .scopes({at::RecordScope::FUNCTION}));
  }
}

} // namespace

Audit::Audit(c10::Device device, AuditOptions options)
    : impl_(std::make_shared<Impl>(device, std::move(options))) {
  TORCH_CHECK(
      impl_->options.max_events() >= 0,
      "Audit: expected max_events >= 0, but got ", impl_->options.max_events());
  TORCH_CHECK(
      impl_->options.meter_every() >= 0,
      "Audit: expected meter_every >= 0 (0: the steps that differ; n: every n-th step), but got ",
      impl_->options.meter_every());
  TORCH_CHECK(
      impl_->options.max_points() >= 2,
      "Audit: expected max_points >= 2, but got ", impl_->options.max_points());
  TORCH_CHECK(
      device.is_cpu() || device.is_cuda(),
      "Audit: expected a cpu or cuda device, but got ", device);
  if (device.is_cpu()) {
    impl_->tracker = &CpuMemoryTracker::install();
  }
  impl_->timeline.device = device_memory_stats(device).device;  // fails early, naming the device
  if (impl_->options.meter()) {
    impl_->meter = std::make_unique<SavedTensorMeter>();
    detail::name_nodes_by_sequence(*impl_->meter);  // no op callback in forward
  }
  detail::ensure_hooks_engine();
}

Audit::Audit(
    const torch::nn::Module& model,
    const torch::optim::Optimizer* optimizer,
    c10::Device device,
    AuditOptions options)
    : Audit(device, std::move(options)) {
  add_module(model);
  if (optimizer != nullptr) {
    add_optimizer(*optimizer);
  }
}

Audit::Audit(
    const torch::jit::Module& model,
    const torch::optim::Optimizer* optimizer,
    c10::Device device,
    AuditOptions options)
    : Audit(device, std::move(options)) {
  add_module(model);
  if (optimizer != nullptr) {
    add_optimizer(*optimizer);
  }
}

Audit::~Audit() {
  // Safe on any thread: the listener is removed under its registry's lock,
  // the op callback holds the Impl only weakly, the meter guard and the
  // recorder may end anywhere. What is thread-local to the step's thread is
  // dropped there lazily.
  try {
    detail::remove_backward_listener(impl_->listener_id);
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->closed = true;
    impl_->meter_guard.reset();
    impl_->recorder.reset();
    if (impl_->step_thread == detail::this_thread_id()) {
      impl_->stop_watching();
    }
  } catch (...) {
  }
}

void Audit::add_module(const torch::nn::Module& module) {
  auto& s = *impl_;
  TORCH_CHECK(!s.open, "Audit::add_module: call it outside a step (step ", s.step_index, " is open)");
  TORCH_CHECK(std::none_of(s.modules.begin(), s.modules.end(), [&](const auto& m) { return m.get() == &module; }),
              "Audit::add_module: module '", module.name(), "' was added already");
  // Held weakly where a shared_ptr owns it (a module holder): a module gone
  // before report() is then skipped, never read.
  Impl::AuditedModule m{&module, module.weak_from_this(), false};
  m.shared = !m.weak.expired();
  s.modules.push_back(std::move(m));
  if (s.meter) {
    s.meter->exclude(module);
  }
}

void Audit::add_module(const torch::jit::Module& module) {
  auto& s = *impl_;
  TORCH_CHECK(!s.open, "Audit::add_module: call it outside a step (step ", s.step_index, " is open)");
  TORCH_CHECK(std::none_of(s.jit_modules.begin(), s.jit_modules.end(),
                           [&](const auto& w) { return w.lock() == module._ivalue(); }),
              "Audit::add_module: this TorchScript module was added already");
  s.jit_modules.emplace_back(module._ivalue());
  if (s.meter) {
    for (const auto& p : module.parameters()) {
      s.meter->exclude(p);
    }
    for (const auto& b : module.buffers()) {
      s.meter->exclude(b);
    }
  }
}

namespace {

std::string optimizer_type(const torch::optim::Optimizer& o) {
  std::string name = detail::builtin_optimizer_name(o);
  return name.empty() ? "optimizer" : name;
}

} // namespace

void Audit::add_optimizer(const torch::optim::Optimizer& optimizer, std::string name) {
  auto& s = *impl_;
  TORCH_CHECK(!s.open, "Audit::add_optimizer: call it outside a step (step ", s.step_index, " is open)");
  std::unordered_set<const c10::TensorImpl*> audited;
  for (const auto& p : s.parameters()) {
    audited.insert(p.unsafeGetTensorImpl());
  }
  for (const auto& t : s.optimized_inputs) {
    audited.insert(t.unsafeGetTensorImpl());
  }
  int64_t num = 0, foreign = 0;
  std::unordered_set<const c10::TensorImpl*> mine;  // its parameters
  for (const auto& g : optimizer.param_groups()) {
    for (const auto& p : g.params()) {
      ++num;
      foreign += audited.count(p.unsafeGetTensorImpl()) == 0 ? 1 : 0;
      mine.insert(p.unsafeGetTensorImpl());
    }
  }
  TORCH_CHECK(num > 0, "Audit::add_optimizer: the optimizer has no parameters");
  TORCH_CHECK(foreign == 0, "Audit::add_optimizer: ", foreign, " of the optimizer's ", num,
              " parameters are not parameters of an audited module; add their module first "
              "(Audit::add_module), or, for a tensor of no module the loop optimizes (an image), "
              "Audit::add_optimized_input");
  // Note [Optimizers that come and go]: the same object again stays one
  // optimizer; another at its address or over its parameters replaces it.
  std::unordered_set<const c10::TensorImpl*> state_now;
  detail::for_each_state_tensor(optimizer, [&](const std::string&, const at::Tensor& t) {
    if (t.defined()) {
      state_now.insert(t.unsafeGetTensorImpl());
    }
  });
  int64_t group = -1;
  std::string inherited;
  for (auto& o : s.optimizers) {
    if (o.retired) {
      continue;
    }
    if (o.optimizer == &optimizer && !Impl::state_gone(o)) {
      const bool same = o.state_impls.empty()
          ? state_now.empty()
          : std::any_of(o.state_impls.begin(), o.state_impls.end(),
                        [&](const c10::TensorImpl* t) { return state_now.count(t) > 0; });
      if (same) {
        if (!name.empty()) {
          o.name = std::move(name);
        }
        s.read_optimizer(o, /*force_figures=*/true);
        return;
      }
    }
    bool overlaps = o.optimizer == &optimizer;
    Impl::for_each_param(o, [&](const at::Tensor& p) { overlaps = overlaps || mine.count(p.unsafeGetTensorImpl()) > 0; });
    if (overlaps) {
      s.retire(o, o.optimizer == &optimizer ? "another optimizer was added at its address"
                                            : "another optimizer was added over its parameters");
      if (group < 0) {
        group = o.group;
        inherited = o.name;
      }
    }
  }
  const std::string type = optimizer_type(optimizer);
  if (name.empty() && !inherited.empty()) {
    name = inherited;
  } else if (name.empty()) {
    name = type;
    int64_t same = 0;
    for (const auto& o : s.optimizers) {
      same += !o.retired && o.type == type ? 1 : 0;
    }
    if (same > 0) {
      name += fmt::format(" #{}", same + 1);
    }
  }
  Impl::NamedOptimizer o;
  o.optimizer = &optimizer;
  o.name = std::move(name);
  o.group = group >= 0 ? group : s.num_groups++;
  o.type = type;
  if (const auto* sgd = dynamic_cast<const torch::optim::SGD*>(&optimizer)) {
    o.plain_sgd = std::all_of(sgd->param_groups().begin(), sgd->param_groups().end(), [](const auto& g) {
      return static_cast<const torch::optim::SGDOptions&>(g.options()).momentum() == 0;
    });
  }
  s.read_optimizer(o, /*force_figures=*/true);
  s.optimizers.push_back(std::move(o));
}

void Audit::add_optimizer(const OptimizerInBackward& optimizer, std::string name) {
  auto& s = *impl_;
  const auto all = optimizer.optimizers();
  TORCH_CHECK(!all.empty(), "Audit::add_optimizer: the OptimizerInBackward has no optimizers");
  const auto first = s.optimizers.size();
  const auto group = s.num_groups;
  if (name.empty()) {
    name = "in backward";
  }
  try {
    for (const auto* o : all) {
      const auto before = s.optimizers.size();
      add_optimizer(*o, name);
      if (s.optimizers.size() > before) {
        s.optimizers.back().group = group;
      }
    }
  } catch (...) {
    s.optimizers.resize(first);
    throw;
  }
  if (s.optimizers.size() > first) {
    s.num_groups = group + 1;
  }
}

void Audit::label(const at::Tensor& tensor, std::string name, Category category) {
  TORCH_CHECK(!name.empty(), "Audit::label: the name is empty");
  impl_->add_label(tensor, std::move(name), category, /*bucket=*/true, "Audit::label");
}

void Audit::set_category(const at::Tensor& tensor, Category category) {
  impl_->add_label(tensor, category_name(category), category, /*bucket=*/false, "Audit::set_category");
}

void Audit::add_optimized_input(const at::Tensor& tensor, std::string name) {
  auto& s = *impl_;
  TORCH_CHECK(tensor.defined(), "Audit::add_optimized_input: the tensor '", name, "' is undefined");
  TORCH_CHECK(tensor.is_leaf() && tensor.requires_grad(), "Audit::add_optimized_input: '", name,
              "' must be a leaf that requires grad (an optimizer's parameter), but it ",
              tensor.requires_grad() ? "is the result of an op (not a leaf)" : "does not require grad");
  for (const auto& t : s.optimized_inputs) {
    TORCH_CHECK(!t.is_same(tensor), "Audit::add_optimized_input: '", name, "' was added already");
  }
  for (const auto& p : s.parameters()) {
    TORCH_CHECK(!p.is_same(tensor), "Audit::add_optimized_input: '", name,
                "' is a parameter of an audited module already");
  }
  s.add_label(tensor, "optimized input (" + name + ")", Category::kInput, /*bucket=*/true,
              "Audit::add_optimized_input");
  s.optimized_inputs.push_back(tensor);
}

void Audit::Impl::add_label(const at::Tensor& tensor, std::string name, Category category, bool bucket,
                            const char* who) {
  auto& s = *this;
  TORCH_CHECK(tensor.defined(), who, ": the tensor is undefined");
  TORCH_CHECK(!s.open, who, ": call it outside a step (step ", s.step_index, " is open)");
  TORCH_CHECK(tensor.has_storage(), who, ": the tensor has no storage (layout ", tensor.layout(), ")");
  s.labels.push_back({tensor.storage().getWeakStorageImpl(), tensor.storage().unsafeGetStorageImpl(),
                      std::move(name), category, bucket});
  if (s.meter) {
    s.meter->exclude(tensor);
  }
  if (s.recording_started) {
    s.adopt(tensor.storage(), category, s.now_ns());
  }
}

void Audit::begin_step() {
  auto& s = *impl_;
  TORCH_CHECK(!s.open, "Audit::begin_step: step ", s.step_index, " is still open; call end_step() first");
  const uint64_t thread = detail::this_thread_id();
  if (s.recorder && s.step_thread != 0 && thread != s.step_thread) {
    s.recorder->attach_this_thread();  // the loop moved to another thread
  }
  s.step_thread = thread;
  const bool timeline = s.tracker != nullptr && s.options.timeline();
  if (timeline && !s.recording_started) {
    s.start_recording();
  }
  if (!s.recording_started) {
    s.origin_ns = s.now_ns();
    s.recording_started = true;
  }
  if (s.recorder) {
    s.recorder->take_shape();  // what was made between steps is not the step's
  }
  s.metering = s.meters_next_step();
  if (s.metering) {
    s.meter->reset();
    s.step_saved = SavedTensorReport();
    s.meter_guard = std::make_unique<SavedTensorMeterGuard>(*s.meter);
  }
  std::weak_ptr<Impl> weak = s.shared_from_this();
  s.listener_id = detail::add_backward_listener([weak](bool begin, const torch::autograd::edge_list& roots) {
    if (auto impl = weak.lock()) {
      impl->on_backward(begin, roots);
    }
  });
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.spans.clear();
    s.backward_depth = 0;
    s.learnt = WatchMode::kFull;
    s.marked.reset();
    s.refresh_param_owners();
    s.wall_begin = std::chrono::steady_clock::now();
    s.step_begin_ns = s.now_ns();
    s.open_window();
    Span f;
    f.phase = Phase::kForward;
    f.begin_ns = f.end_ns = s.step_begin_ns;
    s.spans.push_back(f);
    s.open = true;
  }
  s.start_watching();
}

void Audit::end_step() {
  auto& s = *impl_;
  TORCH_CHECK(s.open, "Audit::end_step: no step is open; call begin_step() first");
  detail::remove_backward_listener(s.listener_id);
  s.listener_id = 0;
  if (s.step_thread == detail::this_thread_id()) {
    s.stop_watching();
  }
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    const int64_t t = s.now_ns();
    s.spans.back().end_ns = t;
    s.spans.back().peak_bytes = s.window_peak();
    if (s.spans.back().provisional) {
      s.spans.back().provisional = false;  // no optimizer showed itself: keep the guess
    }
    s.window.reset();
    s.open = false;
    s.marked.reset();
  }
  if (s.metering) {
    s.close_meter();
  }
  StepRecord rec;
  rec.step = s.step_index;
  rec.time_ms = std::chrono::duration<double, std::milli>(
                    std::chrono::steady_clock::now() - s.wall_begin).count();
  s.judge_shape(rec);
  rec.saved_activation_bytes = s.last_saved.saved_bytes;
  rec.metered = s.metering;
  s.metering = false;
  s.read_optimizers_after_step();
  if (s.recorder && s.options.timeline()) {
    auto raw = s.recorder->take_events(std::move(s.spare_log));
    s.classify_step_events(raw);
    s.spare_log = std::move(raw);
    const int64_t room = s.options.max_events() - static_cast<int64_t>(s.timeline.events.size());
    s.recorder->set_max_events(room);  // the cap holds inside the next step too
  }
  for (const auto& span : s.spans) {
    rec.peak_bytes = std::max(rec.peak_bytes, span.peak_bytes);
    auto& slot = span.phase == Phase::kForward ? rec.forward_peak_bytes
        : span.phase == Phase::kBackward       ? rec.backward_peak_bytes
                                               : rec.optimizer_peak_bytes;
    slot = std::max(slot, span.peak_bytes);
    PhaseSpan ps;
    ps.phase = span.phase;
    ps.name = span.name;
    ps.step = s.step_index;
    ps.begin_ns = span.begin_ns;
    ps.end_ns = span.end_ns;
    ps.peak_bytes = span.peak_bytes;
    s.timeline.phases.push_back(ps);
  }
  s.steps.push_back(rec);
  s.inputs.clear();
  ++s.step_index;
}

Audit::StepGuard::StepGuard(Audit& audit) : audit_(audit) {
  audit_.begin_step();
}

Audit::StepGuard::~StepGuard() {
  try {
    audit_.end_step();
  } catch (const std::exception& e) {
    TORCH_WARN("trainmem::Audit: ending the step failed: ", e.what());
  } catch (...) {
  }
}

void Audit::begin_phase(Phase phase, std::string name) {
  auto& s = *impl_;
  TORCH_CHECK(s.open, "Audit::begin_phase: call it inside a step (after begin_step())");
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(!s.marked, "Audit::begin_phase: phase '", span_label(PhaseSpan{s.marked->phase, s.marked->name}),
              "' is still open; call end_phase() first");
  Span m;
  m.phase = phase;
  m.name = std::move(name);
  s.marked = m;
  s.transition(m, s.now_ns());
}

void Audit::end_phase() {
  auto& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(s.open && s.marked, "Audit::end_phase: no phase marked with begin_phase() is open");
  s.marked.reset();
  Span f;
  f.phase = Phase::kForward;
  f.provisional = true;
  s.transition(f, s.now_ns());
  if (s.step_thread == detail::this_thread_id()) {
    Impl::wake_watch_callback();  // the watcher's thread-local state is the step thread's
  }
}

Audit::PhaseGuard::PhaseGuard(Audit& audit, Phase phase, std::string name) : audit_(audit) {
  audit_.begin_phase(phase, std::move(name));
}

Audit::PhaseGuard::~PhaseGuard() {
  try {
    audit_.end_phase();
  } catch (const std::exception& e) {
    TORCH_WARN("trainmem::Audit: ending the phase failed: ", e.what());
  } catch (...) {
  }
}

void Audit::mark_input(const at::Tensor& tensor) {
  auto& s = *impl_;
  TORCH_CHECK(tensor.defined(), "Audit::mark_input: the tensor is undefined");
  TORCH_CHECK(s.open, "Audit::mark_input: call it inside a step (after begin_step())");
  const auto address = storage_address(tensor);
  if (address == 0 || !tensor.is_cpu()) {
    return;
  }
  const int64_t t = s.now_ns();
  s.adopt(tensor.storage(), Category::kInput, t);
  s.inputs.push_back({address, t});
}

void Audit::set_config(const std::string& key, const std::string& value) {
  for (auto& [k, v] : impl_->config) {
    if (k == key) {
      v = value;
      return;
    }
  }
  impl_->config.emplace_back(key, value);
}

void Audit::add_note(const std::string& note) {
  impl_->notes.push_back(note);
}

void Audit::set_predicted_activation_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "Audit::set_predicted_activation_bytes: expected bytes >= 0, but got ", bytes);
  impl_->predicted_activation_bytes = bytes;
}

int64_t Audit::num_steps() const {
  return static_cast<int64_t>(impl_->steps.size());
}

const Timeline& Audit::timeline() const {
  return impl_->timeline;
}

Timeline Audit::take_timeline() {
  TORCH_CHECK(!impl_->open, "Audit::take_timeline: step ", impl_->step_index, " is still open");
  auto& s = *impl_;
  Timeline t = std::move(s.timeline);
  s.timeline = Timeline();
  s.timeline.device = t.device;
  // The blocks still live carry into the next piece: its baseline counts
  // them by category (what this piece ends with), and their frees keep the
  // category they have here. Outside a step every open block's is final.
  s.timeline.baseline_bytes = t.baseline_bytes;
  for (const auto& e : t.events) {
    s.timeline.baseline_bytes[static_cast<int>(e.category)] += e.bytes;
  }
  for (const auto& [address, a] : s.live) {
    s.known[address] = t.events[a.event].category;
  }
  s.live.clear();
  return t;
}

AuditReport Audit::report() const {
  const auto& s = *impl_;
  TORCH_CHECK(!s.open, "Audit::report: step ", s.step_index, " is still open; call end_step() first");
  AuditReport r;
  r.title = s.options.title();
  r.config = s.config;
  r.device = s.timeline.device;
  const auto b = s.buckets();
  r.num_params = b.num_params;
  r.buckets.push_back({"parameters", Category::kParameter, b.param_bytes});
  if (b.buffer_bytes > 0) {  // only where there are buffers: most nets have none
    r.buckets.push_back({"buffers", Category::kBuffer, b.buffer_bytes});
  }
  r.buckets.push_back({"gradients", Category::kGradient, b.grad_bytes});
  for (const auto& st : b.state_by_name) {
    if (st.bytes > 0) {
      r.buckets.push_back({"optimizer state (" + st.name + ")", Category::kOptimizerState, st.bytes});
    }
  }
  for (const auto& l : s.labels) {
    if (auto st = l.bucket ? l.storage.lock() : nullptr) {
      r.buckets.push_back({l.name, l.category, static_cast<int64_t>(st->nbytes())});
    }
  }
  r.saved_activation_bytes = s.last_saved.saved_bytes;
  r.saved_device_bytes = s.last_saved.device_bytes;
  r.saved_host_bytes = s.last_saved.host_bytes;
  r.saved_by_node = s.last_saved.by_node;
  r.predicted_activation_bytes = s.predicted_activation_bytes;
  r.steps = s.steps;
  for (const auto& st : s.steps) {
    r.peak_bytes = std::max(r.peak_bytes, st.peak_bytes);
  }
  r.device_stats = device_memory_stats(s.device);
  r.fragmentation = fragmentation(r.device_stats);
  r.phases = s.timeline.phases;
  if (!s.timeline.events.empty()) {
    // Category breakdown at each phase's highest point, and at the peak: one
    // pass over the events, never the whole series in memory.
    TimelinePoint p;
    p.bytes = s.timeline.baseline_bytes;
    int64_t best = p.total_bytes();
    r.peak_by_category = p.bytes;
    size_t ph = 0;
    int64_t top = -1;
    for (const auto& e : s.timeline.events) {
      p.bytes[static_cast<int>(e.category)] += e.bytes;
      const int64_t total = p.total_bytes();
      while (ph < r.phases.size() && e.time_ns > r.phases[ph].end_ns) {
        ++ph;
        top = -1;
      }
      if (ph < r.phases.size() && e.time_ns >= r.phases[ph].begin_ns && total > top) {
        top = total;
        r.phases[ph].peak_by_category = p.bytes;
      }
      if (total > best) {
        best = total;
        r.peak_by_category = p.bytes;
      }
    }
    r.series = live_bytes(s.timeline, s.options.max_points());
  }
  if (s.timeline.num_dropped_events > 0) {
    r.notes.push_back(fmt::format(
        "{} allocator events beyond max_events were dropped; the timeline ends early",
        s.timeline.num_dropped_events));
  }
  if (s.timeline.baseline_bytes[static_cast<int>(Category::kBeforeAudit)] > 0) {
    r.notes.push_back(fmt::format(
        "{} B were live before the audit began and are no parameter, buffer, gradient, optimizer state or labelled "
        "tensor (a data set held in memory? name it with Audit::label()); the plot can hide this baseline",
        with_commas(s.timeline.baseline_bytes[static_cast<int>(Category::kBeforeAudit)])));
  }
  if (auto note = s.meter_note()) {
    r.notes.push_back(*note);
  }
  if (s.last_saved.unowned_leaf_bytes > 0) {
    r.notes.push_back(fmt::format(
        "{} B of the saved bytes are leaves that require grad and belong to no audited module: another "
        "network's parameters (add it: Audit audit(device); audit.add_module(G); audit.add_module(D)) or an "
        "optimized input; they are counted as saved activations",
        with_commas(s.last_saved.unowned_leaf_bytes)));
  }
  if (auto note = s.retired_note()) {
    r.notes.push_back(*note);
  }
  const auto gone = std::count_if(s.modules.begin(), s.modules.end(), [](const auto& m) { return m.get() == nullptr; }) +
      std::count_if(s.jit_modules.begin(), s.jit_modules.end(), [](const auto& w) { return w.expired(); });
  if (gone > 0) {
    r.notes.push_back(fmt::format(
        "{} audited module{} destroyed before report(): {} parameters, gradients and buffers are not in the buckets",
        gone, gone == 1 ? " was" : "s were", gone == 1 ? "its" : "their"));
  }
  for (const auto& n : s.notes) {
    r.notes.push_back(n);
  }
  return r;
}

} // namespace trainmem
