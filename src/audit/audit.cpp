// The Audit API: what the user adds (modules, optimizers, labels, inputs),
// the steps and phases they mark, and the report. Audit::Impl
// (audit/detail/audit_impl.h) holds the state; its other jobs are in
// op_watcher.cpp, event_log.cpp, meter_schedule.cpp and storage_tables.cpp.
#include "trainmem/audit.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include "trainmem/allocator.h"
#include "trainmem/device.h"
#include "trainmem/meter.h"
#include "trainmem/optimizer_in_backward.h"

#include "audit/detail/audit_impl.h"
#include "core/detail/optimizer_state_walk.h"
#include "detail/attribution.h"
#include "detail/backward_listener.h"
#include "detail/thread_id.h"

namespace trainmem {

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
    impl_->made_ns = impl_->tracker->now_ns();
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
    s.step_saved_waiting = {};
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
    s.grad_sightings.clear();
    s.backward_depth = 0;
    s.learnt = Impl::WatchMode::kFull;
    s.marked.reset();
    s.refresh_param_owners();
    s.wall_begin = std::chrono::steady_clock::now();
    s.step_begin_ns = s.now_ns();
    s.open_window();
    Impl::Span f;
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
    s.finish_step_saved();
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
    ps.saved_bytes = span.saved_bytes;
    s.timeline.phases.push_back(ps);
  }
  if (s.step_index == 0) {
    s.first_step_end_ns = s.spans.back().end_ns;  // Note [A batch made between steps]
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
  Impl::Span m;
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
  Impl::Span f;
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
  const auto address = Impl::storage_address(tensor);
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
  s.baseline_named_bytes = 0;  // moved out of this baseline by the events above
  for (const auto& [address, a] : s.live) {
    s.known[address] = t.events[a.event].category;
  }
  s.live.clear();
  return t;
}

namespace {

// The category breakdown at each of r.phases' highest points, and at the
// peak: one pass over the events, never the whole series in memory.
void note_category_peaks(const Timeline& timeline, AuditReport& r) {
  TimelinePoint p;
  p.bytes = timeline.baseline_bytes;
  int64_t best = p.total_bytes();
  r.peak_by_category = p.bytes;
  size_t ph = 0;
  int64_t top = -1;
  for (const auto& e : timeline.events) {
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
}

} // namespace

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
  if (s.inferred_optimizer) {  // Note [Optimizer state inferred from lifetimes]
    r.buckets.push_back({"optimizer state (inferred)", Category::kOptimizerState, s.inferred_state_bytes});
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
    note_category_peaks(s.timeline, r);
    r.series = live_bytes(s.timeline, s.options.max_points());
  }
  if (s.timeline.num_dropped_events > 0) {
    r.notes.push_back(fmt::format(
        "{} allocator events beyond max_events were dropped; the timeline ends early",
        s.timeline.num_dropped_events));
  }
  // What of the baseline no name claimed since (Note [A batch made between steps]).
  const int64_t unnamed_baseline =
      s.timeline.baseline_bytes[static_cast<int>(Category::kBeforeAudit)] - s.baseline_named_bytes;
  if (unnamed_baseline > 0) {
    r.notes.push_back(fmt::format(
        "{} B were live before the audit began and are no parameter, buffer, gradient, optimizer state or labelled "
        "tensor (a data set held in memory? name it with Audit::label()); the plot can hide this baseline",
        with_commas(unnamed_baseline)));
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
  if (s.inferred_optimizer) {
    r.notes.push_back(fmt::format(
        "no optimizer was added: its step was found by its ops (an op without grad that reads a gradient or "
        "writes a parameter in place), and the {} B made in it and alive at the last step's end are optimizer "
        "state inferred from lifetimes; add the optimizer (Audit(model, &optimizer)) for its own figures",
        with_commas(s.inferred_state_bytes)));
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
