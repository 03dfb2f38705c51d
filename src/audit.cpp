#include "trainmem/audit.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "trainmem/accountant.h"
#include "trainmem/allocator.h"
#include "trainmem/device.h"
#include "trainmem/meter.h"

#include "detail/backward_listener.h"

// Note [Categories from lifetimes]
// The allocator sees bytes, not meaning. An allocation's category follows
// from when it was made and how long it lived, plus the storages we can
// name: parameters and gradients (their data pointers at the step's start
// and end) and tensors passed to mark_input(). Made in forward and still
// alive when backward starts: ACTIVATION (what autograd saved, the output,
// the loss). Made and freed before that, or within backward or the
// optimizer step: TEMPORARY. Alive at the step's end: GRADIENT if a
// parameter's .grad owns it, OPTIMIZER_STATE if the optimizer step made it,
// PARAMETER if a parameter owns it, else unknown. Every free carries its
// allocation's category, so the per-category series never drift. The meter
// gives the exact saved bytes beside this; the timeline's ACTIVATION is the
// broader "kept for backward".

namespace trainmem {
namespace {

uint64_t storage_address(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) {
    return 0;
  }
  return reinterpret_cast<uint64_t>(t.storage().data_ptr().get());
}

struct Span {
  Phase phase = Phase::kForward;
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
  int64_t peak_bytes = 0;
};

// One allocation made while recording, until its category is final.
struct Alloc {
  size_t event = 0;       // index of its alloc event in timeline.events
  bool final = false;     // category decided
};

} // namespace

struct Audit::Impl {
  const torch::nn::Module& model;
  std::vector<const torch::optim::Optimizer*> optimizers;
  c10::Device device;
  AuditOptions options;
  CpuMemoryTracker* tracker = nullptr;
  std::unique_ptr<SavedTensorMeter> meter;
  std::unique_ptr<SavedTensorMeterGuard> meter_guard;
  int64_t listener_id = 0;

  // Timeline state.
  Timeline timeline;
  bool recording_started = false;
  int64_t origin_ns = 0;         // tracker time of the audit's time zero
  int64_t running_total = 0;     // baseline + events, to detect untracked drift
  std::unordered_map<uint64_t, Alloc> live;   // address -> open allocation
  std::unordered_map<uint64_t, Category> known; // pre-existing addresses
  // Inputs made outside any step, whose bytes were moved from unknown to
  // INPUT; the weak reference tells when one was freed outside a step too.
  struct MovedInput {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    int64_t bytes;
  };
  std::unordered_map<uint64_t, MovedInput> known_inputs;
  struct Input {
    uint64_t address;
    int64_t marked_ns;
    int64_t bytes;
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  };
  std::vector<Input> inputs;  // marked in the open step

  // Step state; `mutex` guards what the backward listener touches.
  std::mutex mutex;
  bool open = false;
  int64_t step_index = 0;
  std::chrono::steady_clock::time_point wall_begin;
  int64_t step_begin_ns = 0;
  std::vector<Span> spans;
  std::unique_ptr<PeakWindow> window;

  std::vector<StepRecord> steps;
  SavedTensorReport last_saved;
  SavedTensorReport step_saved;  // largest micro-batch of the open step
  std::vector<std::pair<std::string, std::string>> config;
  std::vector<std::string> notes;
  int64_t predicted_activation_bytes = -1;

  Impl(const torch::nn::Module& m, const torch::optim::Optimizer* o, c10::Device d, AuditOptions opts)
      : model(m), device(d), options(std::move(opts)) {
    if (o != nullptr) {
      optimizers.push_back(o);
    }
  }

  // Parameters and gradients from the model, state summed over optimizers.
  StaticBuckets buckets() const {
    auto b = account(model);
    std::map<std::string, StateBytes> by_name;
    for (const auto* o : optimizers) {
      const auto ob = account(model, *o);
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

  int64_t now_ns() const {
    if (tracker != nullptr) {
      return tracker->now_ns() - origin_ns;
    }
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count() - origin_ns;
  }

  void open_window() {
    if (tracker != nullptr) {
      window = std::make_unique<PeakWindow>(*tracker);
    } else {
      reset_peak(device);
    }
  }

  int64_t window_peak() const {
    if (tracker != nullptr) {
      return window ? window->peak_bytes() : 0;
    }
    return device_memory_stats(device).peak_allocated_bytes;
  }

  // Ends the current span at `t` and starts one of phase `next`.
  void transition(Phase next, int64_t t) {
    if (spans.empty()) {
      return;
    }
    spans.back().end_ns = t;
    spans.back().peak_bytes = window_peak();
    open_window();
    spans.push_back(Span{next, t, t, 0});
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

  void on_backward(bool begin) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!open) {
      return;
    }
    if (meter) {
      if (begin) {
        close_meter();
      } else {
        meter_guard = std::make_unique<SavedTensorMeterGuard>(*meter);
      }
    }
    // After a backward the phase is provisionally "optimizer step"; a later
    // backward turns it back into forward (gradient accumulation).
    transition(begin ? Phase::kBackward : Phase::kOptimizerStep, now_ns());
    if (begin && spans.size() >= 2 && spans[spans.size() - 2].phase == Phase::kOptimizerStep) {
      spans[spans.size() - 2].phase = Phase::kForward;
    }
  }

  void note_known_storages() {
    known.clear();
    for (const auto& p : model.parameters()) {
      known[storage_address(p)] = Category::kParameter;
      if (p.grad().defined()) {
        known[storage_address(p.grad())] = Category::kGradient;
      }
    }
    known.erase(0);
  }

  void start_recording() {
    origin_ns = tracker->now_ns();
    recording_started = true;
    const int64_t live_now = tracker->stats().allocated_bytes;
    // Attribute what is live now by what we can name; the rest is unknown.
    const auto b = buckets();
    auto& base = timeline.baseline_bytes;
    base[static_cast<int>(Category::kParameter)] = std::min(b.param_bytes, live_now);
    base[static_cast<int>(Category::kGradient)] =
        std::min(b.grad_bytes, live_now - base[0]);
    base[static_cast<int>(Category::kOptimizerState)] =
        std::min(b.optimizer_state_bytes, live_now - base[0] - base[1]);
    base[static_cast<int>(Category::kUnknown)] = live_now - base[0] - base[1] - base[2];
    running_total = live_now;
  }

  bool push_event(MemoryEvent e) {
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
    if (a.phase == Phase::kForward && free_ns >= first_backward_after(a.time_ns)) {
      return Category::kActivation;
    }
    return Category::kTemporary;
  }

  // Category of an allocation still live at the step's end.
  Category category_of_live(const MemoryEvent& a,
                            const std::unordered_map<uint64_t, Category>& owners) const {
    if (is_input(a.address, a.time_ns)) {
      return Category::kInput;
    }
    if (auto it = owners.find(a.address); it != owners.end()) {
      return it->second;
    }
    if (a.phase == Phase::kOptimizerStep) {
      return Category::kOptimizerState;
    }
    if (a.phase == Phase::kForward && first_backward_after(a.time_ns) != INT64_MAX) {
      return Category::kActivation;
    }
    return Category::kUnknown;
  }

  void classify_step_events(std::vector<CpuMemoryEvent> raw) {
    // An input made outside any step sits in the baseline (or a between-
    // steps adjustment) as unknown: move its bytes to INPUT at the step's
    // start, once, before the step's own events so the series stays in time
    // order; when it is freed outside a step, move them back (its free was
    // counted as unknown). Order: inputs freed since, the between-steps
    // adjustment, new inputs, so no category dips below zero on the way.
    // `allocated`: addresses allocated in this step; `freed_before`: blocks
    // made before the step and freed in it (their address's first event is a
    // free; a later free at that address is a new block's).
    std::unordered_set<uint64_t> allocated, freed_before;
    for (const auto& r : raw) {
      if (r.bytes > 0) {
        allocated.insert(r.address);
      } else if (allocated.count(r.address) == 0) {
        freed_before.insert(r.address);
      }
    }
    for (auto it = known_inputs.begin(); it != known_inputs.end();) {
      if (it->second.storage.expired() && freed_before.count(it->first) == 0) {
        push_event(MemoryEvent{step_begin_ns, -it->second.bytes, 0, Category::kInput, Phase::kForward, step_index});
        push_event(MemoryEvent{step_begin_ns, it->second.bytes, 0, Category::kUnknown, Phase::kForward, step_index});
        it = known_inputs.erase(it);
      } else {
        ++it;
      }
    }
    // Bytes allocated or freed between steps were not logged: one
    // adjustment event keeps the totals equal to the allocator's.
    if (!raw.empty()) {
      const int64_t before = raw.front().allocated_bytes - raw.front().bytes;
      if (before != running_total) {
        push_event(MemoryEvent{step_begin_ns, before - running_total, 0, Category::kUnknown,
                               Phase::kForward, step_index});
        running_total = before;
      }
    }
    for (const auto& in : inputs) {
      if (allocated.count(in.address) == 0 && live.count(in.address) == 0 &&
          known_inputs.count(in.address) == 0) {
        known_inputs.emplace(in.address, MovedInput{in.storage, in.bytes});
        push_event(MemoryEvent{step_begin_ns, -in.bytes, 0, Category::kUnknown, Phase::kForward, step_index});
        push_event(MemoryEvent{step_begin_ns, in.bytes, 0, Category::kInput, Phase::kForward, step_index});
      }
    }
    for (const auto& r : raw) {
      MemoryEvent e;
      e.time_ns = r.time_ns - origin_ns;
      e.bytes = r.bytes;
      e.address = r.address;
      e.phase = phase_at(e.time_ns);
      e.step = step_index;
      running_total += r.bytes;
      if (r.bytes > 0) {
        if (push_event(e)) {
          live[e.address] = Alloc{timeline.events.size() - 1, false};
        }
        continue;
      }
      if (auto it = live.find(e.address); it != live.end()) {
        auto& a = timeline.events[it->second.event];
        if (!it->second.final) {
          a.category = category_of_freed(a, e.time_ns);
        }
        e.category = a.category;
        live.erase(it);
      } else if (known_inputs.count(e.address) > 0) {
        e.category = Category::kInput;
        known_inputs.erase(e.address);
      } else if (auto k = known.find(e.address); k != known.end()) {
        e.category = k->second;
      } else {
        e.category = Category::kUnknown;
      }
      push_event(e);
    }
    // What survives the step gets its final category now.
    std::unordered_map<uint64_t, Category> owners;
    for (const auto& p : model.parameters()) {
      owners[storage_address(p)] = Category::kParameter;
      if (p.grad().defined()) {
        owners[storage_address(p.grad())] = Category::kGradient;
      }
    }
    for (auto& [address, a] : live) {
      if (!a.final) {
        auto& e = timeline.events[a.event];
        e.category = category_of_live(e, owners);
        a.final = true;
      }
    }
  }
};

Audit::Audit(
    const torch::nn::Module& model,
    const torch::optim::Optimizer* optimizer,
    c10::Device device,
    AuditOptions options)
    : impl_(std::make_unique<Impl>(model, optimizer, device, std::move(options))) {
  TORCH_CHECK(
      impl_->options.max_events() >= 0,
      "Audit: expected max_events >= 0, but got ", impl_->options.max_events());
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
    impl_->meter = std::make_unique<SavedTensorMeter>(model);
  }
  detail::ensure_hooks_engine();
  Impl* impl = impl_.get();
  impl_->listener_id = detail::add_backward_listener([impl](bool begin) { impl->on_backward(begin); });
}

Audit::~Audit() {
  detail::remove_backward_listener(impl_->listener_id);
  if (impl_->open) {
    try {
      impl_->meter_guard.reset();
      if (impl_->tracker != nullptr && impl_->options.timeline()) {
        impl_->tracker->record_events(false);
      }
    } catch (...) {
    }
  }
}

void Audit::begin_step() {
  auto& s = *impl_;
  TORCH_CHECK(!s.open, "Audit::begin_step: step ", s.step_index, " is still open; call end_step() first");
  const bool timeline = s.tracker != nullptr && s.options.timeline();
  if (timeline && !s.recording_started) {
    s.start_recording();
  }
  if (s.tracker == nullptr && !s.recording_started) {
    s.origin_ns = s.now_ns();
    s.recording_started = true;
  }
  s.note_known_storages();
  if (s.meter) {
    s.meter->reset();
    s.step_saved = SavedTensorReport();
    s.meter_guard = std::make_unique<SavedTensorMeterGuard>(*s.meter);
  }
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.spans.clear();
    s.wall_begin = std::chrono::steady_clock::now();
    s.step_begin_ns = s.now_ns();
    s.open_window();
    s.spans.push_back(Span{Phase::kForward, s.step_begin_ns, s.step_begin_ns, 0});
    s.open = true;
  }
  if (timeline) {
    s.tracker->take_events(); // drop anything logged by someone else before
    s.tracker->record_events(true);
  }
}

void Audit::end_step() {
  auto& s = *impl_;
  TORCH_CHECK(s.open, "Audit::end_step: no step is open; call begin_step() first");
  const bool timeline = s.tracker != nullptr && s.options.timeline();
  std::vector<CpuMemoryEvent> raw;
  if (timeline) {
    s.tracker->record_events(false);
    raw = s.tracker->take_events();
  }
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    const int64_t t = s.now_ns();
    s.spans.back().end_ns = t;
    s.spans.back().peak_bytes = s.window_peak();
    s.window.reset();
    s.open = false;
  }
  if (s.meter) {
    s.close_meter();
    s.last_saved = s.step_saved;
  }
  StepRecord rec;
  rec.step = s.step_index;
  rec.time_ms = std::chrono::duration<double, std::milli>(
                    std::chrono::steady_clock::now() - s.wall_begin).count();
  rec.saved_activation_bytes = s.last_saved.saved_bytes;
  if (timeline) {
    s.classify_step_events(std::move(raw));
  }
  for (const auto& span : s.spans) {
    rec.peak_bytes = std::max(rec.peak_bytes, span.peak_bytes);
    auto& slot = span.phase == Phase::kForward ? rec.forward_peak_bytes
        : span.phase == Phase::kBackward       ? rec.backward_peak_bytes
                                               : rec.optimizer_peak_bytes;
    slot = std::max(slot, span.peak_bytes);
    PhaseSpan ps;
    ps.phase = span.phase;
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

void Audit::mark_input(const at::Tensor& tensor) {
  TORCH_CHECK(tensor.defined(), "Audit::mark_input: the tensor is undefined");
  TORCH_CHECK(impl_->open, "Audit::mark_input: call it inside a step (after begin_step())");
  const auto address = storage_address(tensor);
  if (address != 0 && tensor.is_cpu()) {
    impl_->inputs.push_back({address, impl_->now_ns(), static_cast<int64_t>(tensor.storage().nbytes()),
                             tensor.storage().getWeakStorageImpl()});
  }
}

void Audit::add_optimizer(const torch::optim::Optimizer& optimizer) {
  impl_->optimizers.push_back(&optimizer);
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
  r.buckets.push_back({"gradients", Category::kGradient, b.grad_bytes});
  for (const auto& st : b.state_by_name) {
    if (st.bytes > 0) {
      r.buckets.push_back({"optimizer state (" + st.name + ")", Category::kOptimizerState, st.bytes});
    }
  }
  r.saved_activation_bytes = s.last_saved.saved_bytes;
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
    const auto all = live_bytes(s.timeline);
    // Category breakdown at each phase's highest point, and at the peak.
    size_t i = 0;
    int64_t best = -1;
    for (auto& ph : r.phases) {
      int64_t top = -1;
      while (i < all.size() && all[i].time_ns <= ph.end_ns) {
        if (all[i].time_ns >= ph.begin_ns && all[i].total_bytes() > top) {
          top = all[i].total_bytes();
          ph.peak_by_category = all[i].bytes;
        }
        if (all[i].total_bytes() > best) {
          best = all[i].total_bytes();
          r.peak_by_category = all[i].bytes;
        }
        ++i;
      }
    }
    r.series = live_bytes(s.timeline, s.options.max_points());
  }
  if (s.timeline.num_dropped_events > 0) {
    r.notes.push_back(fmt::format(
        "{} allocator events beyond max_events were dropped; the timeline ends early",
        s.timeline.num_dropped_events));
  }
  for (const auto& n : s.notes) {
    r.notes.push_back(n);
  }
  return r;
}

} // namespace trainmem
