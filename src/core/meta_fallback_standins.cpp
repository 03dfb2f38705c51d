// The generic meta path's CPU runs: stand-ins of a call's meta arguments,
// the CPU kernel run on them (whole, or shrunk for a pointwise op above the
// cap), and each distinct call's result, found once and cached (Note [A meta
// path for ops without a meta kernel] in meta_fallback.cpp).

#include "core/detail/meta_fallback_internal.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <ATen/core/Generator.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/library.h>

#include "detail/intercept.h"
#include "detail/process_library.h"
#include "trainmem/allocator.h"

namespace trainmem::detail::meta_fallback_impl {
namespace {

// Puts back the CPU generators' states an op draws from: its generator
// arguments' and the default CPU generator's.
class KeepGenerators {
 public:
  KeepGenerators(const Call& call, const torch::jit::Stack& args) {
    const bool seeded = call.has_generator || call.op->hasTag(at::Tag::nondeterministic_seeded);
    if (!seeded) {
      return;
    }
    keep(at::detail::getDefaultCPUGenerator());
    for (const auto& v : args) {
      if (v.isGenerator()) {
        keep(v.toGenerator());
      }
    }
  }
  ~KeepGenerators() {
    for (auto it = kept_.rbegin(); it != kept_.rend(); ++it) {
      try {
        std::lock_guard<std::mutex> lock(it->first.mutex());
        it->first.set_state(it->second);
      } catch (...) {
        // a destructor must not throw
      }
    }
  }
  KeepGenerators(const KeepGenerators&) = delete;
  KeepGenerators& operator=(const KeepGenerators&) = delete;

 private:
  void keep(at::Generator g) {
    if (!g.defined() || g.device().type() != c10::kCPU) {
      return;
    }
    std::lock_guard<std::mutex> lock(g.mutex());
    auto state = g.get_state();
    kept_.emplace_back(std::move(g), std::move(state));
  }
  std::vector<std::pair<at::Generator, at::Tensor>> kept_;
};

// A CPU tensor viewing `storage` with `t`'s sizes, strides and dtype at `offset`.
at::Tensor cpu_view(const c10::Storage& storage, const at::Tensor& t, int64_t offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                   t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), offset);
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
    impl->set_wrapped_number(true);
  }
  impl->_set_conj(t.is_conj());
  impl->_set_neg(t.is_neg());
  return at::Tensor(std::move(impl));
}

c10::Storage cpu_storage(int64_t bytes, bool resizable) {
  c10::Storage s(c10::Storage::use_byte_size_t(), static_cast<size_t>(bytes), c10::GetCPUAllocator(), resizable);
  if (bytes > 0) {
    std::memset(s.mutable_data(), 0, static_cast<size_t>(bytes));
  }
  return s;
}

// One run of the CPU kernel on stand-ins; `shrink` gives the shrunk sizes and
// strides of each meta argument (the shrunk path), else they are the meta ones.
struct StandIns {
  std::vector<at::Tensor> cpu;          // per flattened argument: what the kernel gets
  std::vector<int64_t> shift;           // per argument: meta offset - stand-in offset
  std::vector<c10::Storage> storages;   // per argument: the stand-in's storage (meta ones)
};

// Per flattened argument: shrunk sizes and strides (the shrunk path), or none.
using Shrink = std::vector<std::optional<std::pair<std::vector<int64_t>, std::vector<int64_t>>>>;

StandIns make_standins(const Call& call, const Shrink* shrink) {
  StandIns s;
  std::vector<std::optional<c10::Storage>> by_group(call.groups.size());
  for (size_t k = 0; k < call.tensors.size(); ++k) {
    const Arg& a = call.tensors[k];
    const at::Tensor& t = a.tensor;
    if (!t.defined() || !t.is_meta()) {
      s.cpu.push_back(t);
      s.shift.push_back(0);
      s.storages.emplace_back();
      continue;
    }
    const bool resizable = t.storage().resizable();
    if (shrink != nullptr && (*shrink)[k].has_value()) {
      const auto& [sizes, strides] = *(*shrink)[k];
      const int64_t bytes =
          c10::multiply_integers(sizes) == 0
              ? 0
              : static_cast<int64_t>(at::detail::computeStorageNbytes(sizes, strides, t.dtype().itemsize(), 0));
      auto storage = cpu_storage(bytes, resizable);
      auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage),
                                                       c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
      impl->set_sizes_and_strides(sizes, strides, 0);
      if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
        impl->set_wrapped_number(true);
      }
      s.cpu.emplace_back(std::move(impl));
      s.shift.push_back(0);
      s.storages.push_back(storage);
      continue;
    }
    if (a.shared) {
      auto& storage = by_group[a.group];
      if (!storage) {
        storage = cpu_storage(static_cast<int64_t>(t.storage().nbytes()), resizable);
      }
      s.cpu.push_back(cpu_view(*storage, t, t.storage_offset()));
      s.shift.push_back(0);
      s.storages.push_back(*storage);
    } else {
      auto storage = cpu_storage(extent_bytes(t), resizable);
      s.cpu.push_back(cpu_view(storage, t, 0));
      s.shift.push_back(t.storage_offset());
      s.storages.push_back(storage);
    }
  }
  return s;
}

void fill_ones(StandIns& s, const Call& call) {
  for (size_t k = 0; k < s.cpu.size(); ++k) {
    if (call.tensors[k].tensor.defined() && call.tensors[k].tensor.is_meta() && s.cpu[k].numel() > 0) {
      s.cpu[k].fill_(1);
    }
  }
}

// The stand-ins' storages and layouts before the kernel runs, to see which
// written arguments it reallocated or reshaped.
struct Before {
  std::vector<const void*> data;
  std::vector<int64_t> bytes;
  std::vector<Layout> layout;
};

Before before_run(const StandIns& s) {
  Before b;
  for (const auto& st : s.storages) {
    b.data.push_back(st ? st.data_ptr().get() : nullptr);
  }
  for (size_t k = 0; k < s.cpu.size(); ++k) {
    const auto& st = s.storages[k];
    b.bytes.push_back(st ? static_cast<int64_t>(st.nbytes()) : 0);
    b.layout.push_back(s.cpu[k].defined() ? layout_of(s.cpu[k], s.shift[k]) : Layout());
  }
  return b;
}

// Runs the CPU kernel on `stack` with the CPU generators kept; the CPU bytes
// it rose by at its peak.
int64_t run_kernel(const Call& call, torch::jit::Stack& stack) {
  auto& tracker = CpuMemoryTracker::install();
  KeepGenerators generators(call, *call.args);
  PeakWindow window(tracker);
  call.op->redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &stack);
  return window.peak_bytes() - window.start_bytes();
}

// Says what each tensor the kernel returned is: an argument, a view of a
// meta argument's stand-in, or a fresh storage (counted in r.fresh_bytes and
// out_bytes); a refusal in r.refused for what no meta tensor stands for.
class OutputReader {
 public:
  OutputReader(const Call& call, const StandIns& s, Result& r) : call_(call), s_(s), r_(r) {
    for (size_t k = 0; k < s.cpu.size(); ++k) {
      if (s.cpu[k].defined()) {
        arg_of_.emplace(s.cpu[k].unsafeGetTensorImpl(), static_cast<int>(k));
        if (s.cpu[k].has_storage()) {
          standin_of_.emplace(s.cpu[k].storage().unsafeGetStorageImpl(), static_cast<int>(k));
        }
      }
    }
  }

  Output classify(const at::Tensor& t) {
    Output o;
    if (!t.defined()) {
      return o;
    }
    if (auto it = arg_of_.find(t.unsafeGetTensorImpl()); it != arg_of_.end()) {
      o.kind = Output::Kind::kArg;
      o.index = it->second;
      return o;
    }
    if (!t.is_cpu() || t.layout() != at::kStrided || t.is_quantized() || !t.has_storage()) {
      r_.refused = refusal(call_.name,
                           fmt::format("its CPU kernel returns a {} {} tensor, which no meta tensor stands for",
                                       t.is_quantized() ? "quantized" : c10::str(t.layout()), c10::str(t.device())));
      return o;
    }
    const auto* storage = t.storage().unsafeGetStorageImpl();
    if (auto it = standin_of_.find(storage);
        it != standin_of_.end() && call_.tensors[it->second].tensor.is_meta()) {
      o.kind = Output::Kind::kView;
      o.index = it->second;
      o.layout = layout_of(t, s_.shift[it->second]);
      return o;
    }
    if (auto it = standin_of_.find(storage); it != standin_of_.end()) {
      r_.refused = refusal(call_.name, "its CPU kernel returns a view of a CPU tensor it got beside meta ones");
      return o;
    }
    auto [it, fresh] = fresh_of_.emplace(storage, static_cast<int>(r_.fresh_bytes.size()));
    if (fresh) {
      r_.fresh_bytes.push_back(static_cast<int64_t>(storage->nbytes()));
      out_bytes_ += static_cast<int64_t>(storage->nbytes());
    }
    o.kind = Output::Kind::kFresh;
    o.index = it->second;
    o.layout = layout_of(t);
    return o;
  }

  // The bytes of the fresh storages returned.
  int64_t out_bytes() const { return out_bytes_; }

 private:
  const Call& call_;
  const StandIns& s_;
  Result& r_;
  std::unordered_map<const c10::StorageImpl*, int> fresh_of_;
  std::unordered_map<const c10::StorageImpl*, int> standin_of_;  // a stand-in storage -> an argument on it
  std::unordered_map<const c10::TensorImpl*, int> arg_of_;
  int64_t out_bytes_ = 0;
};

// r.returns from what the kernel left on `stack`.
void read_returns(const Call& call, const torch::jit::Stack& stack, OutputReader& reader, Result& r) {
  const auto& returns = call.op->schema().returns();
  TORCH_INTERNAL_ASSERT(stack.size() == returns.size(), call.name, ": ", stack.size(), " values for ", returns.size(),
                        " returns");
  for (const auto& v : stack) {
    Return ret;
    if (v.isNone()) {
      ret.items.emplace_back();
    } else if (v.isTensor()) {
      ret.items.push_back(reader.classify(v.toTensor()));
    } else if (v.isTensorList()) {
      ret.is_list = true;
      for (const at::Tensor& t : v.toTensorVector()) {
        ret.items.push_back(reader.classify(t));
      }
    } else {
      refuse_values(call.name, fmt::format("it returns a {}", v.tagKind()));
    }
    r.returns.push_back(std::move(ret));
  }
}

// r.mutations: the written meta arguments whose layout the kernel changed;
// the bytes of those it reallocated.
int64_t read_mutations(const Call& call, const StandIns& s, const Before& before, Result& r) {
  int64_t reallocated = 0;
  for (size_t k = 0; k < s.cpu.size(); ++k) {
    const Arg& a = call.tensors[k];
    if (!a.written || !a.tensor.defined() || !a.tensor.is_meta()) {
      continue;
    }
    const at::Tensor& c = s.cpu[k];
    if (c.storage().data_ptr().get() != before.data[k] ||
        static_cast<int64_t>(c.storage().nbytes()) != before.bytes[k]) {
      reallocated += static_cast<int64_t>(c.storage().nbytes());  // reallocated inside the window
    }
    const Layout after = layout_of(c, s.shift[k]);
    if (!(after == before.layout[k])) {
      r.mutations.push_back({static_cast<int>(k), after});
    }
  }
  return reallocated;
}

// Runs the CPU kernel on `s` and reads what it gave. Throws what the kernel throws.
Result run_cpu(const Call& call, StandIns& s) {
  torch::jit::Stack stack = map_tensors(*call.args, [&](int k, const at::Tensor&) { return s.cpu[k]; });
  const Before before = before_run(s);
  const int64_t rise = run_kernel(call, stack);
  Result r;
  OutputReader reader(call, s, r);
  read_returns(call, stack, reader, r);
  const int64_t out_bytes = reader.out_bytes() + read_mutations(call, s, before, r);
  r.scratch_bytes = std::max<int64_t>(0, rise - out_bytes);
  return r;
}

// ---------------------------------------------------------------------------
// The shrunk call (pointwise ops above the cap)

// Every dim of size > 1 with a nonzero stride, in the order of its stride,
// is dense: the tensor is dense up to its broadcast (stride 0) dims.
bool dense_up_to_broadcast(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // stride, size
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) != 0) {
      dims.emplace_back(t.stride(d), t.size(d));
    }
  }
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) {
      return false;
    }
    expected *= size;
  }
  return true;
}

// Dense strides for `sizes` in the order of `order_strides` (ascending; size-1
// dims before a larger dim of the same stride), broadcast (stride 0) dims kept
// at 0 where `keep_zero`.
std::vector<int64_t> dense_strides_in_order(const std::vector<int64_t>& sizes,
                                            const std::vector<int64_t>& order_strides, bool keep_zero) {
  const int64_t n = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> perm(static_cast<size_t>(n));
  for (int64_t d = 0; d < n; ++d) {
    perm[d] = d;
  }
  std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) {
    if (order_strides[a] != order_strides[b]) {
      return order_strides[a] < order_strides[b];
    }
    const bool a1 = sizes[a] == 1, b1 = sizes[b] == 1;
    if (a1 != b1) {
      return a1;
    }
    return a > b;
  });
  std::vector<int64_t> strides(static_cast<size_t>(n), 0);
  int64_t next = 1;
  for (const int64_t d : perm) {
    if (keep_zero && order_strides[d] == 0 && sizes[d] != 1) {
      continue;
    }
    strides[d] = next;
    next *= std::max<int64_t>(sizes[d], 1);
  }
  return strides;
}

std::vector<int64_t> broadcast_sizes(const Call& call, const std::vector<at::Tensor>& tensors) {
  std::vector<int64_t> out;
  for (size_t k = 0; k < tensors.size(); ++k) {
    if (tensors[k].defined() && !call.tensors[k].written) {
      out = at::infer_size(out, tensors[k].sizes());
    }
  }
  return out;
}

std::optional<Result> run_shrunk(const Call& call, std::string* why) {
  if (!call.op->hasTag(at::Tag::pointwise)) {
    *why = "it is not a pointwise op that a smaller shape stands for";
    return std::nullopt;
  }
  Shrink shrink(call.tensors.size());
  std::vector<at::Tensor> full;
  for (size_t k = 0; k < call.tensors.size(); ++k) {
    const at::Tensor& t = call.tensors[k].tensor;
    full.push_back(t);
    if (!t.defined() || !t.is_meta()) {
      continue;
    }
    if (!dense_up_to_broadcast(t)) {
      *why = "it is pointwise, but an argument is not dense (a smaller shape would not keep its layout)";
      return std::nullopt;
    }
    std::vector<int64_t> sizes = t.sizes().vec();
    for (auto& s : sizes) {
      s = std::min<int64_t>(s, 2);
    }
    shrink[k].emplace(sizes, dense_strides_in_order(sizes, t.strides().vec(), /*keep_zero=*/true));
  }
  StandIns s = make_standins(call, &shrink);
  Result small = run_cpu(call, s);
  if (!small.refused.empty()) {
    return small;
  }
  const auto small_sizes = broadcast_sizes(call, s.cpu);
  const auto full_sizes = broadcast_sizes(call, full);
  Result r = small;
  r.shrunk = true;
  r.fresh_bytes.clear();
  for (auto& ret : r.returns) {
    for (auto& o : ret.items) {
      if (o.kind == Output::Kind::kNone || o.kind == Output::Kind::kArg) {
        continue;
      }
      if (o.kind != Output::Kind::kFresh || o.layout.sizes != small_sizes || o.layout.offset != 0 ||
          small.fresh_bytes[o.index] !=
              static_cast<int64_t>(c10::multiply_integers(small_sizes)) *
                  static_cast<int64_t>(c10::elementSize(o.layout.dtype)) ||
          static_cast<size_t>(o.index) != r.fresh_bytes.size()) {
        *why = "it is pointwise, but its CPU kernel's output on a smaller shape is not a dense tensor of the "
               "broadcast shape";
        return std::nullopt;
      }
      o.layout.strides = dense_strides_in_order(full_sizes, o.layout.strides, /*keep_zero=*/false);
      o.layout.sizes = full_sizes;
      r.fresh_bytes.push_back(static_cast<int64_t>(c10::multiply_integers(full_sizes)) *
                              static_cast<int64_t>(c10::elementSize(o.layout.dtype)));
    }
  }
  // An out= argument resized to the broadcast shape (a composite's
  // empty({0})): at the full shape, as a fresh output would be laid out.
  for (auto& m : r.mutations) {
    if (m.layout.sizes != small_sizes ||
        m.layout.strides != dense_strides_in_order(small_sizes, m.layout.strides, /*keep_zero=*/false)) {
      *why = "it is pointwise, but it gives an argument it writes a layout other than a dense one of the broadcast "
             "shape";
      return std::nullopt;
    }
    m.layout.strides = dense_strides_in_order(full_sizes, m.layout.strides, /*keep_zero=*/false);
    m.layout.sizes = full_sizes;
    m.layout.offset = call.tensors[m.arg].tensor.storage_offset();
  }
  if (small.scratch_bytes != 0) {
    static std::mutex mu;
    static std::set<std::string> warned;
    std::lock_guard<std::mutex> lock(mu);
    if (warned.insert(call.name).second) {
      TORCH_WARN("trainmem: ", call.name, " has no meta kernel and its stand-ins would take more than ", max_bytes(),
                 " B: it ran on a smaller shape, where its CPU kernel took ", small.scratch_bytes,
                 " B of scratch; predicted peaks leave its scratch out (", kNote, ")");
    }
  }
  r.scratch_bytes = 0;
  return r;
}

// ---------------------------------------------------------------------------
// The call, found once and cached

std::string first_line(const std::string& s) {
  return s.substr(0, s.find('\n'));
}

Result find_result(const Call& call) {
  const auto& schema = call.op->schema();
  if (schema.name() == "aten::from_file") {
    Result r;
    r.refused = refusal(call.name, "it reads a file");
    return r;
  }
  int64_t bytes = 0;
  int64_t largest = 0;
  {
    std::vector<bool> group_counted(call.groups.size(), false);
    for (const auto& a : call.tensors) {
      if (!a.tensor.defined() || !a.tensor.is_meta()) {
        continue;
      }
      if (a.shared) {
        if (!group_counted[a.group]) {
          group_counted[a.group] = true;
          bytes += standin_bytes(a);
        }
      } else {
        bytes += standin_bytes(a);
      }
      largest = std::max(largest, a.tensor.numel() * static_cast<int64_t>(a.tensor.dtype().itemsize()));
    }
  }
  const int64_t cap = max_bytes();
  if (bytes + largest > cap) {
    std::string why;
    try {
      if (auto shrunk = run_shrunk(call, &why)) {
        return *shrunk;
      }
    } catch (const c10::NotImplementedError&) {
      throw;
    } catch (const c10::Error& e) {
      why = "its CPU kernel failed on a smaller shape: " + first_line(e.what_without_backtrace());
    }
    Result r;
    r.refused = refusal(call.name, fmt::format("its CPU kernel's stand-ins would take about {} B, above the "
                                               "fallback's {} B (TRAINMEM_META_FALLBACK_MAX_BYTES), and {}",
                                               bytes + largest, cap, why));
    return r;
  }
  std::optional<Result> zeros;
  std::string zeros_error;
  try {
    StandIns s = make_standins(call, nullptr);
    zeros = run_cpu(call, s);
  } catch (const c10::NotImplementedError&) {
    throw;  // refused while reading the outputs
  } catch (const c10::Error& e) {
    zeros_error = first_line(e.what_without_backtrace());
  }
  if (zeros && !zeros->refused.empty()) {
    return *zeros;
  }
  const bool pointwise = call.op->hasTag(at::Tag::pointwise);
  if (zeros && pointwise) {
    return *zeros;
  }
  // A second run on ones: an output whose shape moves with the values is
  // refused; a kernel that refused zeros may take ones.
  std::optional<Result> ones;
  std::string ones_error;
  try {
    StandIns s = make_standins(call, nullptr);
    fill_ones(s, call);
    ones = run_cpu(call, s);
  } catch (const c10::NotImplementedError&) {
    throw;
  } catch (const c10::Error& e) {
    ones_error = first_line(e.what_without_backtrace());
  }
  if (zeros && ones && ones->refused.empty() && !zeros->same_shapes(*ones)) {
    refuse_values(call.name, "its CPU kernel gives outputs of other shapes for zeros and for ones");
  }
  if (zeros) {
    return *zeros;
  }
  if (ones) {
    return *ones;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, refusal(call.name, fmt::format("its CPU kernel, run on zero-filled stand-ins of "
                                                                    "the meta arguments (and on ones), failed: {}",
                                                                    zeros_error)));
}

} // namespace

std::shared_ptr<const Result> result_for(const Call& call, const std::string& key) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::shared_ptr<const Result>> cache;
  if (call.cacheable) {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(key); it != cache.end()) {
      return it->second;
    }
  }
  std::shared_ptr<const Result> r;
  {
    // The stand-ins are trainmem's own CPU work: no handler (a MetaInitGuard
    // around a step would make them meta) sees their ops, and autograd
    // records nothing of them, as below a real CPU op's autograd kernel.
    c10::impl::ExcludeDispatchKeyGuard unseen(kInterceptKey);
    at::AutoDispatchBelowADInplaceOrView below;
    try {
      r = std::make_shared<const Result>(find_result(call));
    } catch (const c10::NotImplementedError& e) {
      // Refusals are cached too (never the cap's: it can change).
      auto refused = std::make_shared<Result>();
      refused->refused = e.what_without_backtrace();
      r = refused;
    }
  }
  const bool cap_refusal = r->refused.find("TRAINMEM_META_FALLBACK_MAX_BYTES") != std::string::npos;
  if (call.cacheable && !cap_refusal) {
    std::lock_guard<std::mutex> lock(mu);
    cache.emplace(key, r);
  }
  return r;
}

} // namespace trainmem::detail::meta_fallback_impl
