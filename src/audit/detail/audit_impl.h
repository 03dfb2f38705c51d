#pragma once
// Audit::Impl, the state behind trainmem::Audit (never installed). Its
// member functions are defined by job, one file each:
//   audit.cpp           the Audit API (add_module, begin_step, end_step, report...)
//   op_watcher.cpp      the step's phases: spans, the backward listener and the
//                       op watcher (Note [Optimizer phases from ops])
//   event_log.cpp       the recorder's events made the timeline's, and their
//                       categories (Note [Categories from lifetimes])
//   meter_schedule.cpp  which steps the meter runs in (Note [Metering the
//                       steps that differ])
//   storage_tables.cpp  what the audit can name by storage: parameters,
//                       buffers, gradients, optimizer state, and the
//                       optimizers' reads (Note [Optimizers that come and go])
#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/flat_hash_map.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "trainmem/accountant.h"
#include "trainmem/allocator.h"
#include "trainmem/audit.h"
#include "trainmem/meter.h"

#include "core/detail/alloc_recorder.h"
#include "detail/attribution.h"

namespace trainmem {

struct Audit::Impl : std::enable_shared_from_this<Audit::Impl> {
  struct Span {
    Phase phase = Phase::kForward;
    std::string name;
    int64_t optimizer = -1;    // index of the optimizer whose step this is
    bool provisional = false;  // a guess that evidence may rename
    bool no_grad = false;      // a pass without grad over parameters (Note [Steps within a step])
    bool saw_graph = false;    // an op built graph in it
    int64_t begin_ns = 0;
    int64_t end_ns = 0;
    int64_t peak_bytes = 0;
    int64_t saved_bytes = -1;  // a backward's: what its micro-batch saved (metered), else -1
  };
  // Owner of a parameter or gradient when no optimizer was added: the
  // step is inferred (Note [Optimizer state inferred from lifetimes]).
  static constexpr int64_t kInferredOptimizer = -2;
  // A block seen as a gradient at `time_ns`.
  struct Sighting {
    uint64_t address;
    int64_t time_ns;
    bool operator<(const Sighting& o) const {
      return address != o.address ? address < o.address : time_ns < o.time_ns;
    }
  };
  // Sightings of one step, sorted at its end, with a filter of their
  // addresses for the many blocks that were none.
  struct Sightings {
    std::vector<Sighting> seen;
    std::array<uint64_t, 16> filter{};
    static size_t bit(uint64_t address) {
      return static_cast<size_t>((address * 0x9E3779B97F4A7C15ULL) >> 54);  // 1,024 bits
    }
    void add(uint64_t address, int64_t t) {
      seen.push_back({address, t});
    }
    void seal();  // sorts and fills the filter
    // Seen at some time in [from, to].
    bool seen_between(uint64_t address, int64_t from, int64_t to) const;
    void clear() {
      seen.clear();
      filter.fill(0);
    }
  };

  // One allocation made while recording, until its category is final.
  struct Alloc {
    size_t event = 0;       // index of its alloc event in timeline.events
    bool final = false;     // category decided
  };

  // kFull looks at every op's inputs and outputs; the quiet modes have no
  // callback: kQuietForward (forward, once seen) waits for an allocation
  // without grad, kQuietStep (the step of an audit's only optimizer, once
  // seen) for one with grad (Note [Optimizer phases from ops]).
  enum class WatchMode { kOff, kFull, kQuietForward, kQuietStep };

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
  int64_t first_step_end_ns = -1;  // Note [A batch made between steps]
  int64_t made_ns = 0;  // when the Audit was made (tracker clock): Note [A batch made between steps]
  int64_t baseline_named_bytes = 0;  // of the baseline, named since recording began (label, mark_input)
  std::vector<Span> spans;
  Sightings grad_sightings;  // Note [Steps within a step]
  int64_t last_backward_ns = -1;  // the step's last backward began (classify_step_events)
  bool inferred_optimizer = false;  // a step was inferred (no optimizer added)
  int64_t inferred_state_bytes = 0;  // live OPTIMIZER_STATE at the last step's end, when inferred
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
  // Its saves no backward has named yet (Note [Saves named by a later backward]).
  detail::WaitingSaves step_saved_waiting;
  std::vector<std::pair<std::string, std::string>> config;
  std::vector<std::string> notes;
  int64_t predicted_activation_bytes = -1;

  Impl(c10::Device d, AuditOptions opts) : device(d), options(std::move(opts)) {}

  // A tensor's block address (0: none) and its storage (nullptr: none).
  static uint64_t storage_address(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) {
      return 0;
    }
    return reinterpret_cast<uint64_t>(t.storage().data_ptr().get());
  }

  static const c10::StorageImpl* storage_key(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) {
      return nullptr;
    }
    return t.storage().unsafeGetStorageImpl();
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

  // Note [Optimizers that come and go]: the parameters as of the last read.
  template <typename F>
  static void for_each_param(const NamedOptimizer& o, F&& f) {
    for (const auto& w : o.params) {
      if (auto impl = w.lock()) {
        f(at::Tensor(std::move(impl)));
      }
    }
  }

  // storage_tables.cpp: storages the audit can name, the optimizers' reads.
  std::vector<at::Tensor> parameters() const;
  std::vector<at::Tensor> buffers() const;
  std::shared_ptr<torch::nn::Module> union_module() const;
  StaticBuckets buckets() const;
  std::unordered_map<uint64_t, Category> owners() const;
  bool infers_optimizer() const;
  void refresh_grad_owners();
  void refresh_param_owners();
  static bool state_gone(const NamedOptimizer& o);
  void retire(NamedOptimizer& o, const char* why);
  void read_optimizer(NamedOptimizer& o, bool force_figures);
  void read_optimizers_after_step();
  std::optional<std::string> retired_note() const;
  std::vector<at::Tensor> held_state() const;

  // op_watcher.cpp: the step's phases.
  void open_window();
  int64_t window_peak() const;
  void transition(Span next, int64_t t);
  Span optimizer_span(int64_t opt) const;
  void on_backward(bool begin, const torch::autograd::edge_list& roots);
  void on_optimizer_op(int64_t opt);
  void on_no_grad_read();
  void on_forward_op();
  void sight_grads(int64_t t);
  bool watching() const;
  void watch_start(const at::RecordFunction& fn);
  void watch_end(const at::RecordFunction& fn);
  WatchMode quiet_mode();
  void start_watching();
  static void suspend_watch_callback();
  static void resume_watch_callback();
  static void wake_watch_callback();
  void stop_watching();

  // meter_schedule.cpp: the meter's steps.
  bool meters_next_step() const;
  void judge_shape(StepRecord& rec);
  std::optional<std::string> meter_note() const;
  static bool same_saves(const SavedTensorReport& a, const SavedTensorReport& b);
  // Ends the open micro-batch's meter; `waiting`: its saves still unnamed.
  // Returns the micro-batch's saved bytes (-1: no meter was open).
  int64_t close_meter(detail::WaitingSaves waiting = {});
  // At a backward's start: names what it reaches of step_saved's waiting saves.
  void name_waiting_saves(const torch::autograd::edge_list& roots);
  // At the step's end: step_saved's saves no backward reached, "(unattributed)".
  void finish_step_saved();

  // event_log.cpp: the timeline's events and their categories.
  int64_t adopt(const c10::Storage& storage, Category category, int64_t at_ns);
  void start_recording();
  void make_event_room(size_t incoming);
  bool push_event(const MemoryEvent& e);
  const Span* span_at(int64_t t) const;
  Phase phase_at(int64_t t) const;
  int64_t first_backward_after(int64_t t) const;
  bool is_input(uint64_t address, int64_t alloc_ns) const;
  Category category_of_freed(const MemoryEvent& a, int64_t free_ns) const;
  Category category_of_live(const MemoryEvent& a, const std::unordered_map<uint64_t, Category>& own) const;
  void classify_step_events(const std::vector<detail::RecordedEvent>& raw);
  void close_pair(MemoryEvent& a, bool final, MemoryEvent e);
  void add_event(MemoryEvent e, bool adoption);
  MemoryEvent from_raw(const detail::RecordedEvent& r) const;
  void add_events_in_order(const std::vector<detail::RecordedEvent>& raw);
  void add_events_merged(const std::vector<detail::RecordedEvent>& raw);
  void name_survivors();

  // audit.cpp: label() and set_category().
  void add_label(const at::Tensor& tensor, std::string name, Category category, bool bucket, const char* who);

  // Scratch of classify_step_events, kept between steps for their room.
  std::vector<detail::RecordedEvent> spare_log;
  std::vector<size_t> made_log;
  const MemoryEvent* populated_log = nullptr;
  uintptr_t populated_end = 0;
  bool populate_log = true;
};

} // namespace trainmem
