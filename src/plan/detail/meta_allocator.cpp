#include "plan/detail/meta_allocator.h"

#include <algorithm>

#include <c10/core/StorageImpl.h>

namespace trainmem::detail {

// Note [One meta allocator] in meta_allocator.h.

MetaAllocator& MetaAllocator::get() {
  static MetaAllocator* allocator = [] {
    auto* a = new MetaAllocator();
    c10::SetAllocator(c10::DeviceType::Meta, a, /*priority=*/1);
    return a;
  }();
  return *allocator;
}

c10::DataPtr MetaAllocator::allocate(size_t n) {
  auto* block = new MetaBlock{static_cast<int64_t>(n), next_id(), generation_.load()};
  const int64_t now = live_.fetch_add(block->bytes) + block->bytes;
  const bool new_peak = now > peak_.load();
  if (new_peak) {
    peak_.store(now);
  }
  if (observed_.load()) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto* o : observers_) {
      o->on_allocate(*block, new_peak);
    }
  }
  return {nullptr, block, &free_block, c10::Device(c10::DeviceType::Meta)};
}

void MetaAllocator::free_block(void* ctx) {
  auto* block = static_cast<MetaBlock*>(ctx);
  auto& self = get();
  if (self.observed_.load()) {
    std::lock_guard<std::mutex> lock(self.mutex_);
    for (auto* o : self.observers_) {
      o->on_free(*block);
    }
  }
  self.live_.fetch_sub(block->bytes);
  delete block;
}

const MetaBlock* MetaAllocator::block_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) {
    return nullptr;
  }
  const auto& dp = t.storage().data_ptr();
  return dp.get_deleter() == &free_block ? static_cast<const MetaBlock*>(dp.get_context()) : nullptr;
}

uint64_t MetaAllocator::attach(MetaObserver* observer) {
  std::lock_guard<std::mutex> lock(mutex_);
  observers_.push_back(observer);
  observed_.store(true);
  return generation_.fetch_add(1) + 1;
}

void MetaAllocator::detach(MetaObserver* observer) {
  std::lock_guard<std::mutex> lock(mutex_);
  observers_.erase(std::remove(observers_.begin(), observers_.end(), observer), observers_.end());
  observed_.store(!observers_.empty());
}

MetaObserverScope::MetaObserverScope(MetaObserver& observer) : observer_(observer) {
  observer_.generation_ = MetaAllocator::get().attach(&observer_);
}

MetaObserverScope::~MetaObserverScope() {
  MetaAllocator::get().detach(&observer_);
}

std::mutex& prediction_mutex() {
  static std::mutex m;
  return m;
}

void CountingObserver::clear() {
  grad_live_.store(0);
  windows_.clear();
}

void CountingObserver::open_window() {
  close_window();
  windows_.push_back(0);
  MetaAllocator::get().reset_peak();
  grad_at_peak_.store(grad_live_.load());
}

void CountingObserver::close_window() {
  if (!windows_.empty()) {
    windows_.back() = grad_at_peak_.load();
  }
}

void TraceObserver::push(const TraceEvent& e) {
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back(e);
}

size_t TraceObserver::num_events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

uint64_t TraceObserver::add(int64_t bytes, TraceKind kind) {
  const uint64_t id = MetaAllocator::get().next_id();
  push({bytes, id, kind});
  return id;
}

void TraceObserver::remove(uint64_t id, int64_t bytes, TraceKind kind) {
  push({-bytes, id, kind});
}

// Note [Meta storages that grow]
// A meta storage grows without the allocator (resize_bytes_meta only sets
// its size): an op that makes its output with empty({0}) and resizes it
// (arange, the out= ops) would leave a count with 0 bytes, where CUDA's
// resize_bytes_cuda and the CPU's resize_bytes_cpu allocate the new size
// (and free the old block). A storage the observer saw made (the CUDA
// trace's, or predict_step_peak's counter's) that is now larger than its
// block gets a block of its size; the old one is freed with it (both events
// in the trace, and in the allocator's live bytes). Without it a GPT-2's
// position ids (arange, saved by its position embedding) were missing from
// the CPU step peak: 8 T bytes under the CPU's.
void MetaObserver::grow(const at::Tensor& t) const {
  if (!t.defined() || !t.has_storage() || !t.is_meta()) {
    return;
  }
  const MetaBlock* block = MetaAllocator::block_of(t);
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (block == nullptr || !owns(*block) || static_cast<int64_t>(storage->nbytes()) <= block->bytes) {
    return;
  }
  storage->set_data_ptr_noswap(MetaAllocator::get().allocate(storage->nbytes()));
}

void MetaObserver::run_growing(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                               const std::function<void()>& run) const {
  const auto& args = op.schema().arguments();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < args.size() && args.size() <= stack->size(); ++i) {
    const auto* alias = args[i].alias_info();
    const auto& v = (*stack)[stack->size() - args.size() + i];
    if (alias != nullptr && alias->isWrite() && v.isTensor()) {
      written.push_back(v.toTensor());
    }
  }
  run();
  for (const auto& t : written) {
    grow(t);
  }
  const size_t num_returns = std::min(op.schema().returns().size(), stack->size());
  for (size_t i = stack->size() - num_returns; i < stack->size(); ++i) {
    if ((*stack)[i].isTensor()) {
      grow((*stack)[i].toTensor());
    }
  }
}

uint64_t TraceObserver::id_of(const at::Tensor& t) const {
  const MetaBlock* block = MetaAllocator::block_of(t);
  return block != nullptr && owns(*block) ? block->id : 0;
}

} // namespace trainmem::detail
