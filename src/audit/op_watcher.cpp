// The step's phases: the spans (forward, backward, each optimizer's step)
// and their peaks, the backward listener that opens and closes backward, and
// the op watcher that tells an optimizer's step from forward.
#include "audit/detail/audit_impl.h"

#include <algorithm>
#include <exception>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "trainmem/allocator.h"
#include "trainmem/device.h"
#include "trainmem/meter.h"

#include "core/detail/alloc_recorder.h"
#include "detail/attribution.h"

// Note [Optimizer phases from ops]
// LibTorch's optimizers have no hook, but their step() runs ops on their
// parameters and gradients under no-grad. While a step is open, a
// thread-local RecordFunction callback looks at each op run without grad
// (outside backward): one that reads a gradient or updates a parameter in
// place belongs to the optimizer that owns it, so that optimizer's step
// begins (a phase of its own); one that only reads a parameter is a pass
// without grad (Note [Steps within a step]). With no optimizer added the
// step is inferred (Note [Optimizer state inferred from lifetimes]). An op
// that builds graph (an output with a grad_fn) is forward.
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

using WatchMode = Audit::Impl::WatchMode;

// Per-thread list of the audits whose step is open on this thread, and the
// one RecordFunction callback that serves them (Note [Optimizer phases from
// ops]). Entries are weak: an audit destroyed on another thread is skipped
// and dropped here later.
thread_local std::vector<std::weak_ptr<Audit::Impl>> tls_watchers;

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

void Audit::Impl::open_window() {
  if (recorder) {
    recorder->open_window();
  } else if (tracker != nullptr) {
    window = std::make_unique<PeakWindow>(*tracker);
  } else {
    reset_peak(device);
  }
}

int64_t Audit::Impl::window_peak() const {
  if (recorder) {
    return recorder->window_peak();  // its baseline ("before the audit") included
  }
  if (tracker != nullptr) {
    return window ? window->peak_bytes() : 0;
  }
  return device_memory_stats(device).peak_allocated_bytes;
}

// Ends the current span at `t` and starts `next`.
void Audit::Impl::transition(Span next, int64_t t) {
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

Audit::Impl::Span Audit::Impl::optimizer_span(int64_t opt) const {
  Span s;
  s.phase = Phase::kOptimizerStep;
  if (opt == kInferredOptimizer) {
    s.name = "inferred";
    s.optimizer = kInferredOptimizer;
    return s;
  }
  s.name = optimizers[static_cast<size_t>(opt)].name;
  s.optimizer = optimizers[static_cast<size_t>(opt)].group;
  return s;
}

void Audit::Impl::on_backward(bool begin, const torch::autograd::edge_list& roots) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!open || closed) {
    return;
  }
  backward_depth += begin ? 1 : -1;
  int64_t micro_batch_saved = -1;
  if (metering) {
    if (begin) {
      name_waiting_saves(roots);  // Note [Saves named by a later backward]
      detail::WaitingSaves waiting;
      if (meter_guard) {
        detail::name_saved_nodes(*meter, roots);  // Note [Naming nodes by sequence number]
        waiting = detail::take_waiting_saves(*meter);
      }
      micro_batch_saved = close_meter(std::move(waiting));
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
    // (gradient accumulation: forward, backward, forward, backward...);
    // a provisional pass without grad stays one.
    if (spans.back().provisional) {
      if (!spans.back().no_grad) {
        spans.back().phase = Phase::kForward;
      }
      spans.back().provisional = false;
    }
    Span b;
    b.phase = Phase::kBackward;
    b.saved_bytes = micro_batch_saved;
    transition(b, t);
  } else {
    refresh_grad_owners();
    sight_grads(t);  // Note [Steps within a step]
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
void Audit::Impl::on_optimizer_op(int64_t opt) {
  auto& cur = spans.back();
  int64_t group = kInferredOptimizer;
  if (opt == kInferredOptimizer) {
    inferred_optimizer = true;
  } else {
    optimizers[static_cast<size_t>(opt)].stepped = true;
    group = optimizers[static_cast<size_t>(opt)].group;
  }
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
  if (num_groups <= 1) {
    learnt = WatchMode::kQuietStep;  // no other optimizer's op can follow
  }
}

// An op read a parameter without grad, and neither wrote one nor read a
// gradient: a pass without grad (a rollout, an evaluation), not a step
// (Note [Steps within a step]).
void Audit::Impl::on_no_grad_read() {
  auto& cur = spans.back();
  if (cur.no_grad || (cur.phase == Phase::kOptimizerStep && !cur.provisional)) {
    return;  // an optimizer's step reads its parameters too (Adam's first makes its state like them)
  }
  if (cur.provisional || (cur.phase == Phase::kForward && !cur.saw_graph)) {
    cur.phase = Phase::kForward;  // what it held so far was this pass's
    cur.name = "no grad";
    cur.no_grad = true;
    cur.optimizer = -1;
    return;
  }
  Span n;
  n.phase = Phase::kForward;
  n.name = "no grad";
  n.no_grad = true;
  n.provisional = true;  // an optimizer's step may show itself (its first op reads a parameter)
  transition(n, now_ns());
}

void Audit::Impl::on_forward_op() {
  auto& cur = spans.back();
  if (cur.phase == Phase::kForward && !cur.no_grad) {
    cur.saw_graph = true;
    return;
  }
  if (cur.provisional && !cur.no_grad) {
    cur.phase = Phase::kForward;
    cur.provisional = false;
    cur.saw_graph = true;
    return;
  }
  Span f;
  f.phase = Phase::kForward;
  f.saw_graph = true;
  transition(f, now_ns());
}

bool Audit::Impl::watching() const {
  return open && !closed && backward_depth == 0 && !marked;
}

void Audit::Impl::watch_start(const at::RecordFunction& fn) {
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
  // Note [Steps within a step]: an optimizer's op reads a gradient or
  // writes a parameter in place; one that only reads a parameter is a pass
  // without grad.
  const bool in_place = name.back() == '_';
  int64_t owner = -1;
  bool step_op = false;
  auto look = [&](const at::Tensor& t, bool written) {
    if (step_op || !t.defined() || !t.has_storage()) {
      return;
    }
    const auto* key = t.storage().unsafeGetStorageImpl();
    if (auto it = param_owner.find(key); it != param_owner.end()) {
      owner = it->second;
      step_op = written;
    } else if (auto g = grad_owner.find(key); g != grad_owner.end()) {
      owner = g->second;
      step_op = true;
    }
  };
  bool first = true;
  for (const auto& v : fn.inputs()) {
    if (v.isTensor()) {
      look(v.toTensor(), first && in_place);
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) {
        look(t, first && in_place);
      }
    }
    first = false;
    if (step_op) {
      break;
    }
  }
  if (step_op) {
    on_optimizer_op(owner);
  } else if (owner != -1) {
    on_no_grad_read();
  }
}

void Audit::Impl::watch_end(const at::RecordFunction& fn) {
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
  } else if (spans.back().phase == Phase::kForward && !spans.back().provisional && !spans.back().no_grad) {
    // The step began in forward and an op ran with grad: forward has
    // shown itself, though this op built no graph (a frozen encoder's).
    learnt = WatchMode::kQuietForward;
  }
}

// Forward has shown itself since the last phase change: until the next
// one the watcher has nothing to learn (Note [Optimizer phases from ops]).
// Or the audit's only optimizer has shown itself: until forward allocates.
Audit::Impl::WatchMode Audit::Impl::quiet_mode() {
  std::lock_guard<std::mutex> lock(mutex);
  return learnt;
}

void Audit::Impl::start_watching() {
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
void Audit::Impl::suspend_watch_callback() {
  if (tls_watch_mode != WatchMode::kOff) {
    set_watch_mode(WatchMode::kOff);
    tls_watch_suspended = true;
  }
}

void Audit::Impl::resume_watch_callback() {
  if (tls_watch_suspended) {
    tls_watch_suspended = false;
    if (!tls_watchers.empty()) {
      set_watch_mode(WatchMode::kFull);
    }
  }
}

// A phase changed without a backward (a marked phase ended): look at every op again.
void Audit::Impl::wake_watch_callback() {
  if (is_quiet(tls_watch_mode)) {
    set_watch_mode(WatchMode::kFull);
  }
}

// On the step's thread only (thread-local state).
void Audit::Impl::stop_watching() {
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

} // namespace trainmem
