#pragma once
// Per-audit recording of the counting CPU allocator (never installed). See
// docs/design.md, Note [Allocations belong to a recorder].
//
// A recorder owns the allocations made on the threads it is attached to
// (thread-local), and every free of those blocks, from whatever thread it
// comes: each block's header carries the tag of the recorder that was
// attached when it was made. Two audits on two threads therefore see only
// their own bytes. A recorder keeps its own live bytes, one peak window and
// a capped event log.
#include <cstdint>
#include <memory>
#include <vector>

#include <c10/core/Storage.h>

#include "trainmem/allocator.h"

namespace trainmem::detail {

// The log number of a block that its recorder did not log.
constexpr int64_t kNotLogged = -1;

// One event of a recorder's log: an allocation (bytes > 0) or a free, and
// `seq`, which pairs them without a lookup. An allocation's `seq` is its own
// number among the allocations this recorder logged (0, 1, 2, ...); a
// free's is its allocation's, or kNotLogged when this recorder did not log
// it (made before logging began, dropped from a full log, or adopted).
struct RecordedEvent {
  int64_t time_ns = 0;  // tracker clock
  int64_t bytes = 0;
  uint64_t address = 0;
  int64_t seq = kNotLogged;
};

// The allocations a recorder saw over a stretch (a step): how many, their
// bytes, and a hash of their sizes in order. Two steps of a loop with the
// same shape are the same program on the same shapes, allocation for
// allocation (Note [Metering the steps that differ]).
struct AllocationShape {
  int64_t allocations = 0;
  int64_t bytes = 0;
  uint64_t hash = 14695981039346656037ull;  // FNV-1a's offset basis

  void add(int64_t size) noexcept {
    ++allocations;
    bytes += size;
    hash = (hash ^ static_cast<uint64_t>(size)) * 1099511628211ull;  // FNV-1a's prime, a size per round
  }
  bool operator==(const AllocationShape&) const = default;
};

class AllocRecorder {
 public:
  // Takes one of the process's recorder slots (64). Throws c10::Error when
  // all are taken. `max_events` caps the events held before take_events().
  explicit AllocRecorder(int64_t max_events);
  // Releases the slot; blocks still tagged with it are ignored from then on.
  // Safe from any thread.
  ~AllocRecorder();
  AllocRecorder(const AllocRecorder&) = delete;
  AllocRecorder& operator=(const AllocRecorder&) = delete;

  // Allocations made on the calling thread from now on belong to this
  // recorder (until another recorder attaches there, or this one ends).
  void attach_this_thread();

  // Logs events from now on (frees of its blocks always update live bytes).
  void set_logging(bool on);
  // The events logged so far, oldest first; clears the log. `spare`, a log
  // taken before and done with, is logged into next: its room is reused
  // (a step's log is tens of kilobytes; no allocation each step).
  std::vector<RecordedEvent> take_events(std::vector<RecordedEvent> spare = {});
  // Events not logged because the log was full, since the last take_events().
  int64_t take_num_dropped();
  // Changes the cap of the log.
  void set_max_events(int64_t max_events);

  // The shape of the allocations made on attached threads since the last
  // call (logged, dropped from a full log, or made while logging is off);
  // starts the next one.
  AllocationShape take_shape();

  // Bytes of live blocks that belong to this recorder.
  int64_t live_bytes() const;
  // Starts the peak window at the live bytes (and baseline) now;
  // window_peak() is the highest live bytes plus baseline since.
  void open_window();
  int64_t window_peak() const;

  // Note [A recorder's baseline]
  // Starts counting the bytes live now that are neither this recorder's nor
  // another live recorder's (the process's, made before; a data set, the
  // first batch) as its baseline, and returns the time it began (tracker clock). The baseline
  // shrinks when such a block is freed, from any thread, or adopted; it
  // never grows. Peak windows count live bytes plus baseline, so a block
  // made before and freed since is no longer in a peak.
  int64_t begin_baseline();
  int64_t baseline_bytes() const;
  // A free of a baseline block: when (tracker clock), its bytes (< 0), and
  // when the block was made.
  struct BaselineFree {
    int64_t time_ns = 0;
    int64_t bytes = 0;
    int64_t made_ns = 0;
  };
  // The baseline's frees since the last call, oldest first (logged while
  // logging is on; capped at max_events).
  std::vector<BaselineFree> take_baseline_frees();

  // Makes the block under `storage` this recorder's (if the counting
  // allocator made it and it is not already its). Its bytes join the live
  // bytes; returns them (0 when nothing changed). `alloc_ns` receives the
  // block's allocation time (tracker clock). No event is logged.
  int64_t adopt(const c10::Storage& storage, int64_t* alloc_ns = nullptr);

 private:
  int slot_;
  uint64_t tag_;
};

// Calls `alarm` once, at the next allocation of the counting allocator made
// on this thread with grad mode `grad_enabled` (false: an optimizer step, a
// no-grad region; true: forward, after an optimizer step), after it is
// counted; nullptr disarms. Costs the allocations nothing while unset. Used
// by Audit (Note [Optimizer phases from ops]).
void set_allocation_alarm(void (*alarm)() noexcept, bool grad_enabled);

} // namespace trainmem::detail
