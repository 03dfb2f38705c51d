// The audit's event log: the recorder's events of each step made the
// timeline's, each allocation and its free given one category, and the
// blocks that were live before recording adopted.
#include "audit/detail/audit_impl.h"

#include <algorithm>
#include <new>
#include <optional>
#include <unordered_map>
#include <vector>

#include <sys/mman.h>

// Note [Categories from lifetimes]
// The allocator sees bytes, not meaning. An allocation's category follows
// from the storages we can name when the step ends (parameters and buffers
// of every audited module, their gradients, every added optimizer's state,
// labelled tensors, inputs) and otherwise from when it was made and how long it
// lived. Made in forward and still alive when backward starts: ACTIVATION
// (what autograd saved, the output, the loss). Made and freed before that,
// or within backward or an optimizer step: TEMPORARY. Alive at the step's
// end and unnamed: OPTIMIZER_STATE if an optimizer step made it, INPUT if
// it was made between steps (Note [A batch made between steps]), else
// unknown. Every free carries its allocation's category, so the
// per-category series never drift. Bytes live when recording began are
// attributed the same way (the blocks of named storages are adopted by the
// audit's recorder, so their frees are seen); the rest is "before the
// audit". The meter gives the exact saved bytes beside this; the timeline's
// ACTIVATION is the broader "kept for backward".

namespace trainmem {
namespace {

// Note [The event log's pages]
// The event log grows by a few hundred events (40 B each) a step until
// max_events. The room is reserved at once, up to kEventRoom events
// (address space only), so the log is not copied as it grows that far.
// Each page of it written for the first time costs a fault: a decoder step
// on our VM writes eight, about 35 us or 0.8 % of the step (timed inside
// the step, against a recycled log). So before a step's events are added
// the log's next kPopulateBytes are populated at once
// (madvise(MADV_POPULATE_WRITE), Linux 5.14+; elsewhere each page faults at
// its first write): about 2 us a page, paid once every few dozen steps. It
// is not advised to transparent huge pages: where the kernel has no free
// huge page it compacts memory inside the fault (defrag "madvise", the
// common default), stalls of a few milliseconds every few dozen steps that
// hide from a median. With that advice the audited decoder's mean step cost
// 1.113-1.121x on our VM, without it 1.086-1.093x (docs/design.md,
// docs/benchmarks.md).
constexpr int64_t kEventRoom = int64_t{1} << 21;
// How much of the log is populated at once, ahead of its writes.
constexpr uintptr_t kPopulateBytes = uintptr_t{1} << 20;

} // namespace

// Adopts the block under `t` into the recorder (Note [Categories from
// lifetimes]); bytes made before recording leave "before the audit".
// Returns the adopted bytes.
int64_t Audit::Impl::adopt(const c10::Storage& storage, Category category, int64_t at_ns) {
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
      baseline_named_bytes += bytes;  // no longer unnamed: the note leaves them out
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

void Audit::Impl::start_recording() {
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
void Audit::Impl::make_event_room(size_t incoming) {
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
      populate_log = false;  // a kernel before 5.14: each page faults at its first write
    }
    populated_end = std::max(populated_end, end);
  }
#endif
}

bool Audit::Impl::push_event(const MemoryEvent& e) {
  if (static_cast<int64_t>(timeline.events.size()) >= options.max_events()) {
    ++timeline.num_dropped_events;
    return false;
  }
  timeline.events.push_back(e);
  return true;
}

// The span holding time `t` (the last one past the step's end).
const Audit::Impl::Span* Audit::Impl::span_at(int64_t t) const {
  if (spans.empty()) {
    return nullptr;
  }
  const auto it = std::upper_bound(spans.begin(), spans.end(), t,
                                   [](int64_t x, const Span& s) { return x < s.end_ns; });
  return it == spans.end() ? &spans.back() : &*it;
}

Phase Audit::Impl::phase_at(int64_t t) const {
  const Span* s = span_at(t);
  return s == nullptr ? Phase::kForward : s->phase;
}

int64_t Audit::Impl::first_backward_after(int64_t t) const {
  if (t > last_backward_ns) {
    return INT64_MAX;  // the optimizer's step after the last backward: most of its blocks
  }
  auto it = std::lower_bound(spans.begin(), spans.end(), t,
                             [](const Span& s, int64_t x) { return s.begin_ns < x; });
  for (; it != spans.end(); ++it) {
    if (it->phase == Phase::kBackward) {
      return it->begin_ns;
    }
  }
  return INT64_MAX;
}

bool Audit::Impl::is_input(uint64_t address, int64_t alloc_ns) const {
  return std::any_of(inputs.begin(), inputs.end(), [&](const auto& in) {
    return in.address == address && in.marked_ns >= alloc_ns;
  });
}

// Category of an allocation freed at `free_ns` in this step (Note [Steps
// within a step]).
Category Audit::Impl::category_of_freed(const MemoryEvent& a, int64_t free_ns) const {
  if (is_input(a.address, a.time_ns)) {
    return Category::kInput;
  }
  if (grad_sightings.seen_between(a.address, a.time_ns, free_ns)) {
    return Category::kGradient;  // a gradient, whoever freed it
  }
  // The cheap tests first: most blocks of a step are backward's and the
  // optimizer's temporaries (Note [Categories from lifetimes]).
  if (a.phase == Phase::kBackward || a.time_ns < step_begin_ns || free_ns < first_backward_after(a.time_ns)) {
    return Category::kTemporary;
  }
  if (a.phase == Phase::kForward) {
    return span_at(a.time_ns)->no_grad ? Category::kInput : Category::kActivation;
  }
  // Made between an optimizer's step and the next forward, and read by a
  // later forward and backward: the update's data.
  return Category::kInput;
}

// Category of an allocation still live at the step's end.
Category Audit::Impl::category_of_live(const MemoryEvent& a, const std::unordered_map<uint64_t, Category>& own) const {
  if (is_input(a.address, a.time_ns)) {
    return Category::kInput;
  }
  if (auto it = own.find(a.address); it != own.end()) {
    return it->second;
  }
  if (a.time_ns < step_begin_ns) {
    return Category::kInput;  // made between steps: Note [A batch made between steps]
  }
  const Span* made_in = span_at(a.time_ns);
  if (made_in->phase == Phase::kOptimizerStep) {
    return Category::kOptimizerState;
  }
  if (made_in->phase == Phase::kForward && first_backward_after(a.time_ns) != INT64_MAX) {
    return made_in->no_grad ? Category::kInput : Category::kActivation;
  }
  return Category::kUnknown;
}

void Audit::Impl::classify_step_events(const std::vector<detail::RecordedEvent>& raw) {
  grad_sightings.seal();
  last_backward_ns = -1;
  for (const auto& s : spans) {
    if (s.phase == Phase::kBackward) {
      last_backward_ns = s.begin_ns;
    }
  }
  timeline.num_dropped_events += recorder->take_num_dropped();
  // Blocks of the baseline freed in this step leave "before the audit";
  // those made since the Audit and freed between the first step and the
  // second were the first step's INPUT (Note [A batch made between steps]).
  for (const auto& f : recorder->take_baseline_frees()) {
    const int64_t t = f.time_ns - origin_ns;
    Category c = Category::kBeforeAudit;
    if (step_index == 1 && f.made_ns >= made_ns && t >= first_step_end_ns && t < step_begin_ns) {
      c = Category::kInput;
      timeline.baseline_bytes[static_cast<int>(Category::kBeforeAudit)] += f.bytes;  // f.bytes < 0
      timeline.baseline_bytes[static_cast<int>(Category::kInput)] -= f.bytes;
    }
    synthetic.push_back(MemoryEvent{t, f.bytes, 0, c, Phase::kForward, step_index});
  }
  make_event_room(raw.size() + synthetic.size());
  const auto by_time = [](const auto& a, const auto& b) { return a.time_ns < b.time_ns; };
  if (synthetic.empty() && std::is_sorted(raw.begin(), raw.end(), by_time)) {
    add_events_in_order(raw);
  } else {
    add_events_merged(raw);
  }
  name_survivors();
}

// A free `e` (its phase set) paired with its allocation `a`: the pair's
// category is decided now, unless the allocation's is final.
void Audit::Impl::close_pair(MemoryEvent& a, bool final, MemoryEvent e) {
  if (!final) {
    a.category = category_of_freed(a, e.time_ns);
  }
  e.category = a.category;
  push_event(e);
}

// One event of the step, in time order: an allocation opens in `live`, a
// free closes its allocation there or an adopted block in `known`.
void Audit::Impl::add_event(MemoryEvent e, bool adoption) {
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
}

MemoryEvent Audit::Impl::from_raw(const detail::RecordedEvent& r) const {
  MemoryEvent e;
  e.time_ns = r.time_ns - origin_ns;
  e.bytes = r.bytes;
  e.address = r.address;
  e.category = Category::kUnknown;
  e.step = step_index;
  return e;
}

// The usual step: one thread's events, already in time order. Most
// blocks are made and freed among them: those pair by the log's
// numbers, with no lookup (about a fifth of the classification's
// instructions went to `live`); what was made before goes through
// `live`, and what outlives them joins it.
void Audit::Impl::add_events_in_order(const std::vector<detail::RecordedEvent>& raw) {
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
      add_event(from_raw(r), false);
    }
  }
  for (const size_t i : made) {
    if (i != kNone) {
      live[timeline.events[i].address] = Alloc{i, false};
    }
  }
}

// The recorder's events and this step's adoptions, in time order.
void Audit::Impl::add_events_merged(const std::vector<detail::RecordedEvent>& raw) {
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
    add_event(all[i], i >= num_raw);
  }
}

// What survives the step gets its final category now. In a loop's
// steady state that is the new gradients alone: an optimizer's
// parameter's gradient is GRADIENT in owners() too (its parameters are
// the audited modules' or optimized inputs, add_optimizer() checks), so
// they are named from the optimizers, and owners() (a walk over every
// module, about 0.5 % of a step of small ops) is made only for the rest.
void Audit::Impl::name_survivors() {
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
  if (inferred_optimizer && infers_optimizer()) {  // Note [Optimizer state inferred from lifetimes]
    inferred_state_bytes = 0;
    for (const auto& [address, a] : live) {
      const auto& e = timeline.events[a.event];
      if (e.category == Category::kOptimizerState) {
        inferred_state_bytes += e.bytes;
      }
    }
  }
}

} // namespace trainmem
