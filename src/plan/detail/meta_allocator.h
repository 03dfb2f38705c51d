// The one meta allocator of the plan layer and its observers: the counting
// observer of the CPU prediction (predict.cpp) and the trace observer of the
// CUDA prediction (cuda_predict.cpp). Not installed.
#pragma once

#include <atomic>
#include <functional>
#include <cstdint>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Allocator.h>

namespace trainmem::detail {

// Note [One meta allocator]
// Meta storages come from GetAllocator(kMeta) (empty_meta,
// empty_strided_meta), a stub that returns a null pointer. Ours returns a
// null pointer too, with a context per block (MetaBlock: its bytes, an id,
// a generation), so the free is seen: live and peak meta bytes are always
// counted, as the CPU tracker counts CPU bytes. It sits in the process-wide
// slot (c10::SetAllocator, priority 1 above the stub's) from its first use
// on, and is never destroyed: storages outlive any prediction.
// What a prediction wants besides live and peak bytes is an observer,
// attached for a scope (MetaObserverScope) and told of every allocation and
// free while attached: the CPU prediction's CountingObserver (the gradient
// bytes live at each phase window's peak), the CUDA prediction's
// TraceObserver (every event in order, with ids, for the caching
// allocator's model). One allocator, no wrapping: a block's generation is
// the number of observer scopes opened before it was made, so an observer
// knows its own blocks (made while it was attached) from older ones.
// Predictions hold prediction_mutex(): one runs at a time, on one thread
// (plus the autograd engine's, in backward), and the peak is that run's.

// One block the allocator made.
struct MetaBlock {
  int64_t bytes = 0;
  uint64_t id = 0;
  uint64_t generation = 0;
};

// Told of the meta allocator's events while attached (MetaObserverScope).
// Called under the allocator's lock, from the thread that allocates or frees:
// an observer must not allocate on meta, and must not throw.
class MetaObserver {
 public:
  virtual ~MetaObserver() = default;
  // After `block` was made; `new_peak`: the live bytes with it are above
  // the peak until now.
  virtual void on_allocate(const MetaBlock& block, bool new_peak) = 0;
  // Before `block` is freed.
  virtual void on_free(const MetaBlock& block) = 0;

  // Whether `block` was made while this observer was attached.
  bool owns(const MetaBlock& block) const { return block.generation >= generation_; }
  // Note [Meta storages that grow]: a storage this observer saw made, now
  // larger than its block, gets a block of its size (the old one freed).
  void grow(const at::Tensor& t) const;
  // Runs the op (`run`), then grow()s each tensor it wrote (an argument
  // with a write alias) or returned.
  void run_growing(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::function<void()>& run) const;

 private:
  friend class MetaObserverScope;
  uint64_t generation_ = 0;
};

class MetaAllocator final : public c10::Allocator {
 public:
  // The allocator, installed in the meta slot on first use.
  static MetaAllocator& get();

  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* /*dest*/, const void* /*src*/, std::size_t /*count*/) const override {}

  int64_t live_bytes() const { return live_.load(); }
  int64_t peak_bytes() const { return peak_.load(); }
  // The peak from now on starts at the live bytes.
  void reset_peak() { peak_.store(live_.load()); }
  // An id no block has (a trace's synthetic events share the blocks' ids).
  uint64_t next_id() { return next_id_.fetch_add(1); }

  // The block of `t`'s storage when this allocator made it, else nullptr.
  static const MetaBlock* block_of(const at::Tensor& t);

 private:
  friend class MetaObserverScope;
  MetaAllocator() = default;
  static void free_block(void* ctx);
  uint64_t attach(MetaObserver* observer);
  void detach(MetaObserver* observer);

  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<uint64_t> next_id_{1};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> observed_{false};
  std::mutex mutex_;  // guards observers_ and the calls into them
  std::vector<MetaObserver*> observers_;
};

// Attaches `observer` to the meta allocator for the scope (process-wide, not
// thread-local: the autograd engine's threads allocate too). RAII.
class MetaObserverScope {
 public:
  explicit MetaObserverScope(MetaObserver& observer);
  ~MetaObserverScope();
  MetaObserverScope(const MetaObserverScope&) = delete;
  MetaObserverScope& operator=(const MetaObserverScope&) = delete;

 private:
  MetaObserver& observer_;
};

// One lock for every prediction on meta (the allocator and its peak are one).
std::mutex& prediction_mutex();

// The CPU prediction's observer: the gradient bytes live at the peak of
// each phase window. Gradients are added by the caller (post-hooks on each
// parameter's AccumulateGrad, predict.cpp's GradWatch).
class CountingObserver final : public MetaObserver {
 public:
  void on_allocate(const MetaBlock& /*block*/, bool new_peak) override {
    if (new_peak) {
      grad_at_peak_.store(grad_live_.load());
    }
  }
  void on_free(const MetaBlock& /*block*/) override {}

  void add_grad(int64_t bytes) { grad_live_.fetch_add(bytes); }
  // A new step: no gradient counted, no window.
  void clear();
  // Ends the open window (if any) and opens one: the allocator's peak starts
  // again at the live bytes.
  void open_window();
  // Ends the open window.
  void close_window();
  // Per window, in order: the gradient bytes live at its peak.
  const std::vector<int64_t>& grad_at_peak() const { return windows_; }

 private:
  std::atomic<int64_t> grad_live_{0};
  std::atomic<int64_t> grad_at_peak_{0};
  std::vector<int64_t> windows_;
};

// What a traced event is (the CUDA prediction's terms at the peak).
enum class TraceKind : uint8_t { kTensor, kWorkspace, kKernelTemporary, kResident, kParameter };

struct TraceEvent {
  int64_t bytes = 0;  // + requested bytes allocated, - freed
  uint64_t id = 0;
  TraceKind kind = TraceKind::kTensor;
};

// The CUDA prediction's observer: every allocation and free of its own
// blocks, in order, and the synthetic events (workspaces, kernel
// temporaries) its kernel model adds.
class TraceObserver final : public MetaObserver {
 public:
  void on_allocate(const MetaBlock& block, bool /*new_peak*/) override {
    push({block.bytes, block.id, TraceKind::kTensor});
  }
  void on_free(const MetaBlock& block) override {
    if (owns(block)) {
      push({-block.bytes, block.id, TraceKind::kTensor});
    }
  }

  // A synthetic allocation (workspace, kernel temporary): its id.
  uint64_t add(int64_t bytes, TraceKind kind);
  void remove(uint64_t id, int64_t bytes, TraceKind kind);
  // The id of `t`'s storage when this trace made it, else 0.
  uint64_t id_of(const at::Tensor& t) const;

  // Read once detached.
  const std::vector<TraceEvent>& events() const { return events_; }
  size_t num_events() const;

 private:
  void push(const TraceEvent& e);
  mutable std::mutex mutex_;  // the kernel model adds from the op's thread
  std::vector<TraceEvent> events_;
};

} // namespace trainmem::detail
