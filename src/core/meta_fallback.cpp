// The generic meta path for ops without a Meta kernel: Note [A meta path for
// ops without a meta kernel].
#include "core/detail/meta_fallback.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
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
#include <fmt/ranges.h>
#include <torch/library.h>

#include "core/detail/cpu_probe.h"
#include "detail/intercept.h"
#include "detail/process_library.h"
#include "trainmem/allocator.h"

// Note [A meta path for ops without a meta kernel]
// LibTorch's C++ build has Meta kernels for its structured ops and a few
// more; Python adds the rest from torch/_meta_registrations.py, which a C++
// process never loads. An op with a CPU kernel and neither a Meta kernel nor
// a composite one (about a third of the ATen ops with a CPU kernel: abs.out,
// which logsumexp calls, where.self, logical_and.out, the full max and min,
// std and var, dot, flip, roll, ...) threw on meta, and so did a prediction of
// any model that ran one: a PPO policy loss (a Categorical from logits) among
// them. LibTorch already registers its one boxed fallback on the Meta key
// (MetaFallbackKernel.cpp, the error "attempted to run this operator with
// Meta tensors"), and a key takes one. So this kernel is registered per op,
// on the Meta key, for each aten op with a CPU kernel and no Meta,
// CompositeExplicitAutograd(NonFunctional) or CompositeImplicitAutograd
// kernel (a Meta kernel would hide a composite one from autograd), after
// trainmem's own meta kernels (which keep their ops) and before the plan
// layer's (which replace it on theirs). It runs below autograd, so the
// autograd formulas and what they save are LibTorch's own.
//
// For each distinct call (op, every argument's dtype, sizes, strides, offset
// and storage sharing, the other arguments' values, the thread count), once
// per process, it runs the op's CPU kernel on CPU stand-ins: zero-filled
// tensors with the meta arguments' sizes, strides and dtypes (arguments that
// share a storage share one; an argument that shares none gets a storage of
// its own extent only), a meta device argument turned to the CPU, under the
// CPU tracker. The call's result is what the CPU gave: each output's sizes,
// strides, offset, dtype and storage bytes (a fresh storage, a view of an
// argument, or the argument itself), each written argument's new sizes and
// strides (an out= argument resized: its meta storage gets a block of the
// new size, the old one freed, as resize_bytes_cpu does), and the kernel's
// scratch (the tracker's peak above the stand-ins, less the outputs), which
// the meta call holds while it makes its outputs, as the convolutions' probes
// do (Note [CPU convolution scratch]; not in a CUDA prediction). Meta outputs
// are then made with exactly those sizes, strides and storage bytes: what
// autograd saves of them and what the meta allocator counts are the CPU's.
// The stand-ins are the prediction's own scratch on the CPU: they are never
// meta storages, so no meta count (and no prediction) sees them; an op that
// draws random numbers gets the CPU generators' states put back.
//
// What it refuses, as a c10::NotImplementedError that names the op (so
// find_missing_meta_kernel() and the planner's CPU profiling take it as a
// missing meta kernel):
// - an output whose shape depends on values: an op LibTorch tags
//   dynamic_output_shape or data_dependent_output (nonzero, unique,
//   masked_select, bincount, repeat_interleave.Tensor, _local_scalar_dense
//   under .item(), equal), one that returns anything but tensors (a bool, a
//   number), and one whose outputs differ when the stand-ins are filled with
//   ones instead of zeros (pointwise ops are not run twice): "trainmem:
//   aten::nonzero has no meta kernel and its output shape depends on values";
// - outputs no meta tensor stands for (quantized, sparse, mkldnn, nested),
//   meta arguments that are not strided or are storages, a CPU tensor the op
//   writes, aten::from_file (it reads a file);
// - a call whose stand-ins would take more than 1 GiB
//   (TRAINMEM_META_FALLBACK_MAX_BYTES to change it), unless the op is tagged
//   pointwise and every meta argument is dense up to broadcast dims: then the
//   CPU kernel runs on the shape with every dim above 2 shrunk to 2 (the
//   strides' order and the broadcast dims kept), which provably gives the
//   output's dtype and its dims' order (TensorIterator allocates a dense
//   output in the order of its operands' strides and the broadcast shape),
//   and the full output is that layout at the broadcast of the full sizes.
//   Scratch measured on a shrunk call is not scaled: when it is not zero it
//   is left out, with one warning per op;
// - a CPU kernel that fails on zero-filled stand-ins and on ones (most
//   likely the arguments are wrong for the op on the CPU too): its error,
//   naming the op.
// docs/design.md has the coverage table (bench/meta_coverage.cpp).

namespace trainmem::detail {
namespace {
namespace meta_fallback_impl {

constexpr int64_t kDefaultMaxBytes = int64_t{1} << 30;
constexpr const char* kNote = "Note [A meta path for ops without a meta kernel]";

std::string op_name(const c10::FunctionSchema& schema) {
  return schema.overload_name().empty() ? schema.name() : schema.name() + "." + schema.overload_name();
}

int64_t max_bytes() {
  const char* v = std::getenv("TRAINMEM_META_FALLBACK_MAX_BYTES");
  if (v == nullptr || *v == '\0') {
    return kDefaultMaxBytes;
  }
  char* end = nullptr;
  const long long parsed = std::strtoll(v, &end, 10);
  return end != v && parsed >= 0 ? static_cast<int64_t>(parsed) : kDefaultMaxBytes;
}

[[noreturn]] void refuse_values(const std::string& name, const std::string& why) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "trainmem: ", name, " has no meta kernel and its output shape depends on values (",
                              why,
                              "): a prediction cannot run it on meta (", kNote, ")");
}

std::string refusal(const std::string& name, const std::string& why) {
  return fmt::format("trainmem: {} has no meta kernel, and {} ({})", name, why, kNote);
}

// ---------------------------------------------------------------------------
// What a call gives back, found once per distinct call.

struct Layout {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset = 0;
  at::ScalarType dtype = at::kFloat;

  bool operator==(const Layout& o) const {
    return sizes == o.sizes && strides == o.strides && offset == o.offset && dtype == o.dtype;
  }
};

Layout layout_of(const at::Tensor& t, int64_t offset_shift = 0) {
  return {t.sizes().vec(), t.strides().vec(), t.storage_offset() + offset_shift, t.scalar_type()};
}

struct Output {
  enum class Kind { kNone, kArg, kView, kFresh };
  Kind kind = Kind::kNone;
  int index = -1;  // kArg, kView: the tensor argument (flattened); kFresh: its fresh storage
  Layout layout;   // kView, kFresh: on meta (a view's offset is into the argument's meta storage)

  bool operator==(const Output& o) const {
    return kind == o.kind && index == o.index && (kind == Kind::kArg || kind == Kind::kNone || layout == o.layout);
  }
};

struct Return {
  bool is_list = false;
  std::vector<Output> items;  // one for a Tensor return
  bool operator==(const Return& o) const { return is_list == o.is_list && items == o.items; }
};

struct Mutation {
  int arg = -1;   // a written meta argument (flattened)
  Layout layout;  // its sizes and strides after the call, its offset on meta
  bool operator==(const Mutation& o) const { return arg == o.arg && layout == o.layout; }
};

struct Result {
  std::string refused;  // non-empty: the call is refused, with this message
  std::vector<Return> returns;
  std::vector<int64_t> fresh_bytes;  // per fresh storage
  std::vector<Mutation> mutations;
  int64_t scratch_bytes = 0;
  bool shrunk = false;

  bool same_shapes(const Result& o) const {
    return returns == o.returns && fresh_bytes == o.fresh_bytes && mutations == o.mutations;
  }
};

// ---------------------------------------------------------------------------
// The call's tensor arguments, flattened (lists included), and their stand-ins.

struct Arg {
  at::Tensor tensor;  // as given (meta, cpu or undefined)
  bool written = false;
  int group = -1;       // meta: its storage's index among the arguments'
  bool shared = false;  // meta: another argument has the same storage
};

struct Call {
  const c10::OperatorHandle* op = nullptr;
  std::string name;
  const torch::jit::Stack* args = nullptr;  // the op's arguments (a copy of the stack's)
  std::vector<Arg> tensors;
  std::vector<const c10::StorageImpl*> groups;
  bool has_generator = false;
  bool cacheable = true;
};

template <typename F>
torch::jit::Stack map_tensors(const torch::jit::Stack& args, F&& f) {
  torch::jit::Stack out;
  out.reserve(args.size());
  int k = 0;
  for (const auto& v : args) {
    if (v.isTensor()) {
      out.emplace_back(f(k++, v.toTensor()));
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorVector()) {
        list.push_back(f(k++, t));
      }
      out.emplace_back(std::move(list));
    } else if (v.isList()) {
      const auto src = v.toList();
      bool tensors = false;
      for (const c10::IValue& e : src) {
        tensors = tensors || e.isTensor();
      }
      if (!tensors) {
        out.push_back(v);
        continue;
      }
      c10::impl::GenericList list(src.elementType());
      for (const c10::IValue& e : src) {
        list.push_back(e.isTensor() ? c10::IValue(f(k++, e.toTensor())) : e);
      }
      out.emplace_back(std::move(list));
    } else if (v.isDevice() && v.toDevice().is_meta()) {
      out.emplace_back(c10::Device(c10::kCPU));  // a factory's device: the stand-in runs on the CPU
    } else {
      out.push_back(v);
    }
  }
  return out;
}

std::string bytes_hex(const at::Tensor& t) {
  c10::impl::ExcludeDispatchKeyGuard unseen(kInterceptKey);  // trainmem's own read: no handler sees it
  const auto c = t.contiguous();
  const auto* p = static_cast<const unsigned char*>(c.const_data_ptr());
  std::string s;
  for (size_t i = 0; i < c.nbytes(); ++i) {
    s += fmt::format("{:02x}", p[i]);
  }
  return s;
}

int64_t extent_bytes(const at::Tensor& t) {
  if (t.numel() == 0) {
    return 0;
  }
  return static_cast<int64_t>(
      at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.dtype().itemsize(), /*storage_offset=*/0));
}

// The bytes a stand-in of argument `a` takes: its storage when it shares it
// with another argument, else its own extent.
int64_t standin_bytes(const Arg& a) {
  return a.shared ? static_cast<int64_t>(a.tensor.storage().nbytes()) : extent_bytes(a.tensor);
}

// Collects the call's tensors and checks what the fallback can stand in for;
// the key of the call (empty when it cannot be cached).
std::string describe(Call& call, const torch::jit::Stack& args) {
  const auto& schema = call.op->schema();
  std::ostringstream key;
  key << call.name;
  std::unordered_map<const c10::StorageImpl*, int> group_of;
  std::vector<int> members;
  map_tensors(args, [&](int /*k*/, const at::Tensor& t) {
    call.tensors.push_back({t});
    return t;
  });
  // Written arguments (in place, out=): their schema says so.
  {
    int k = 0;
    for (size_t i = 0; i < args.size(); ++i) {
      const auto* alias = schema.arguments()[i].alias_info();
      const bool written = alias != nullptr && alias->isWrite();
      auto count = [&](const c10::IValue& v) {
        if (v.isTensor()) {
          call.tensors[k++].written = written;
        } else if (v.isList()) {
          for (const c10::IValue& e : v.toList()) {
            if (e.isTensor()) {
              call.tensors[k++].written = written;
            }
          }
        }
      };
      count(args[i]);
      if (args[i].isGenerator()) {
        call.has_generator = true;
      }
    }
  }
  for (auto& a : call.tensors) {
    const at::Tensor& t = a.tensor;
    if (!t.defined() || !t.is_meta()) {
      continue;
    }
    if (t.layout() != at::kStrided || !t.has_storage()) {
      TORCH_CHECK_NOT_IMPLEMENTED(false, refusal(call.name, fmt::format("the fallback has no stand-in for its {} "
                                                                        "meta argument",
                                                                        c10::str(t.layout()))));
    }
    const auto* s = t.storage().unsafeGetStorageImpl();
    auto [it, fresh] = group_of.emplace(s, static_cast<int>(call.groups.size()));
    if (fresh) {
      call.groups.push_back(s);
      members.push_back(0);
    }
    a.group = it->second;
    ++members[a.group];
  }
  for (auto& a : call.tensors) {
    if (a.group >= 0) {
      a.shared = members[a.group] > 1;
    }
  }
  for (size_t i = 0, k = 0; i < args.size(); ++i) {
    const auto& v = args[i];
    auto tensor_key = [&](const Arg& a) {
      const at::Tensor& t = a.tensor;
      if (!t.defined()) {
        key << " -";
        return;
      }
      if (t.is_meta()) {
        key << fmt::format(" M{}{}:{}[{}/{}]+{}:{}{}{}{}{}", a.group, a.shared ? "s" : "",
                           c10::toString(t.scalar_type()), fmt::join(t.sizes(), ","), fmt::join(t.strides(), ","),
                           t.storage_offset(),
                           a.shared ? static_cast<int64_t>(t.storage().nbytes()) : extent_bytes(t),
                           a.written ? "w" : "", t.unsafeGetTensorImpl()->is_wrapped_number() ? "n" : "",
                           t.is_conj() ? "c" : "", t.is_neg() ? "g" : "");
        return;
      }
      TORCH_CHECK_NOT_IMPLEMENTED(t.is_cpu() && t.layout() == at::kStrided && !t.is_quantized(),
                                  refusal(call.name, fmt::format("it got a {} tensor beside meta ones",
                                                                 c10::str(t.device()))));
      TORCH_CHECK_NOT_IMPLEMENTED(!a.written,
                                  refusal(call.name, "it writes a CPU tensor it got beside meta ones"));
      // Real data: its values may matter; small ones are part of the key.
      key << fmt::format(" C:{}[{}/{}]{}", c10::toString(t.scalar_type()), fmt::join(t.sizes(), ","),
                         fmt::join(t.strides(), ","), t.unsafeGetTensorImpl()->is_wrapped_number() ? "n" : "");
      if (t.numel() <= 16) {
        key << "=" << bytes_hex(t);
      } else {
        call.cacheable = false;
      }
    };
    if (v.isTensor()) {
      tensor_key(call.tensors[k++]);
    } else if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList()) {
      key << " [";
      for (const c10::IValue& e : v.toList()) {
        if (e.isTensor()) {
          tensor_key(call.tensors[k++]);
        } else {
          key << " " << e;
        }
      }
      key << " ]";
    } else if (v.isStorage()) {
      TORCH_CHECK_NOT_IMPLEMENTED(!v.toStorage().device().is_meta(),
                                  refusal(call.name, "the fallback has no stand-in for a meta storage argument"));
      call.cacheable = false;
      key << " storage";
    } else if (v.isGenerator()) {
      key << " generator";
    } else if (v.isObject() || v.isCapsule() || v.isFuture() || v.isStream()) {
      call.cacheable = false;
      key << " ?";
    } else {
      key << " " << v;
    }
  }
  key << fmt::format("|threads {}|mkldnn {}", at::get_num_threads(), at::globalContext().userEnabledMkldnn());
  return key.str();
}

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

// Runs the CPU kernel on `s` and reads what it gave. Throws what the kernel throws.
Result run_cpu(const Call& call, StandIns& s) {
  const auto& schema = call.op->schema();
  torch::jit::Stack stack = map_tensors(*call.args, [&](int k, const at::Tensor&) { return s.cpu[k]; });
  std::vector<const void*> data_before;
  for (const auto& st : s.storages) {
    data_before.push_back(st ? st.data_ptr().get() : nullptr);
  }
  std::vector<int64_t> bytes_before;
  std::vector<Layout> layout_before;
  for (size_t k = 0; k < s.cpu.size(); ++k) {
    const auto& st = s.storages[k];
    bytes_before.push_back(st ? static_cast<int64_t>(st.nbytes()) : 0);
    layout_before.push_back(s.cpu[k].defined() ? layout_of(s.cpu[k], s.shift[k]) : Layout());
  }
  auto& tracker = CpuMemoryTracker::install();
  int64_t rise = 0;
  {
    KeepGenerators generators(call, *call.args);
    PeakWindow window(tracker);
    call.op->redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &stack);
    rise = window.peak_bytes() - window.start_bytes();
  }
  Result r;
  std::unordered_map<const c10::StorageImpl*, int> fresh_of;
  std::unordered_map<const c10::StorageImpl*, int> standin_of;  // a stand-in storage -> an argument on it
  std::unordered_map<const c10::TensorImpl*, int> arg_of;
  for (size_t k = 0; k < s.cpu.size(); ++k) {
    if (s.cpu[k].defined()) {
      arg_of.emplace(s.cpu[k].unsafeGetTensorImpl(), static_cast<int>(k));
      if (s.cpu[k].has_storage()) {
        standin_of.emplace(s.cpu[k].storage().unsafeGetStorageImpl(), static_cast<int>(k));
      }
    }
  }
  int64_t out_bytes = 0;
  auto classify = [&](const at::Tensor& t) -> Output {
    Output o;
    if (!t.defined()) {
      return o;
    }
    if (auto it = arg_of.find(t.unsafeGetTensorImpl()); it != arg_of.end()) {
      o.kind = Output::Kind::kArg;
      o.index = it->second;
      return o;
    }
    if (!t.is_cpu() || t.layout() != at::kStrided || t.is_quantized() || !t.has_storage()) {
      r.refused = refusal(call.name,
                          fmt::format("its CPU kernel returns a {} {} tensor, which no meta tensor stands for",
                                      t.is_quantized() ? "quantized" : c10::str(t.layout()), c10::str(t.device())));
      return o;
    }
    const auto* storage = t.storage().unsafeGetStorageImpl();
    if (auto it = standin_of.find(storage); it != standin_of.end() && call.tensors[it->second].tensor.is_meta()) {
      o.kind = Output::Kind::kView;
      o.index = it->second;
      o.layout = layout_of(t, s.shift[it->second]);
      return o;
    }
    if (auto it = standin_of.find(storage); it != standin_of.end()) {
      r.refused = refusal(call.name, "its CPU kernel returns a view of a CPU tensor it got beside meta ones");
      return o;
    }
    auto [it, fresh] = fresh_of.emplace(storage, static_cast<int>(r.fresh_bytes.size()));
    if (fresh) {
      r.fresh_bytes.push_back(static_cast<int64_t>(storage->nbytes()));
      out_bytes += static_cast<int64_t>(storage->nbytes());
    }
    o.kind = Output::Kind::kFresh;
    o.index = it->second;
    o.layout = layout_of(t);
    return o;
  };
  const auto& returns = schema.returns();
  TORCH_INTERNAL_ASSERT(stack.size() == returns.size(), call.name, ": ", stack.size(), " values for ", returns.size(),
                        " returns");
  for (const auto& v : stack) {
    Return ret;
    if (v.isNone()) {
      ret.items.emplace_back();
    } else if (v.isTensor()) {
      ret.items.push_back(classify(v.toTensor()));
    } else if (v.isTensorList()) {
      ret.is_list = true;
      for (const at::Tensor& t : v.toTensorVector()) {
        ret.items.push_back(classify(t));
      }
    } else {
      refuse_values(call.name, fmt::format("it returns a {}", v.tagKind()));
    }
    r.returns.push_back(std::move(ret));
  }
  for (size_t k = 0; k < s.cpu.size(); ++k) {
    const Arg& a = call.tensors[k];
    if (!a.written || !a.tensor.defined() || !a.tensor.is_meta()) {
      continue;
    }
    const at::Tensor& c = s.cpu[k];
    if (c.storage().data_ptr().get() != data_before[k] ||
        static_cast<int64_t>(c.storage().nbytes()) != bytes_before[k]) {
      out_bytes += static_cast<int64_t>(c.storage().nbytes());  // reallocated inside the window
    }
    const Layout after = layout_of(c, s.shift[k]);
    if (!(after == layout_before[k])) {
      r.mutations.push_back({static_cast<int>(k), after});
    }
  }
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

// ---------------------------------------------------------------------------
// The meta call

at::Tensor meta_tensor(c10::Storage storage, const Layout& l) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::Meta),
                                                   c10::scalarTypeToTypeMeta(l.dtype));
  impl->set_sizes_and_strides(l.sizes, l.strides, l.offset);
  return at::Tensor(std::move(impl));
}

// A meta storage grows as resize_bytes_cpu grows a CPU one: a block of the
// new size from the meta allocator, the old block freed (Note [Meta storages
// that grow] in src/plan/detail/meta_allocator.cpp: nothing is left to grow).
void grow_to(const at::Tensor& t, int64_t bytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (bytes <= static_cast<int64_t>(s->nbytes())) {
    return;
  }
  TORCH_CHECK(s->resizable(), "Trying to resize storage that is not resizable");
  s->set_data_ptr_noswap(c10::GetAllocator(c10::kMeta)->allocate(static_cast<size_t>(bytes)));
  s->set_nbytes(static_cast<size_t>(bytes));
}

void apply(const Call& call, const Result& r, torch::jit::Stack* stack) {
  // The CPU kernel's scratch, held while the outputs are made (its peak is
  // theirs and the scratch's), then freed: Note [CPU convolution scratch].
  const auto held = probing_enabled() ? hold_meta_bytes(r.scratch_bytes) : at::Tensor();
  for (const auto& m : r.mutations) {
    const at::Tensor& t = call.tensors[m.arg].tensor;
    const int64_t needed =
        c10::multiply_integers(m.layout.sizes) == 0
            ? 0
            : static_cast<int64_t>(at::detail::computeStorageNbytes(m.layout.sizes, m.layout.strides,
                                                                    t.dtype().itemsize(), m.layout.offset));
    grow_to(t, needed);
    t.unsafeGetTensorImpl()->set_sizes_and_strides(m.layout.sizes, m.layout.strides, m.layout.offset);
  }
  std::vector<c10::Storage> fresh;
  fresh.reserve(r.fresh_bytes.size());
  for (const int64_t bytes : r.fresh_bytes) {
    fresh.emplace_back(c10::Storage::use_byte_size_t(), static_cast<size_t>(bytes), c10::GetAllocator(c10::kMeta),
                       /*resizable=*/true);
  }
  auto make = [&](const Output& o) -> at::Tensor {
    switch (o.kind) {
      case Output::Kind::kNone:
        return at::Tensor();
      case Output::Kind::kArg:
        return call.tensors[o.index].tensor;
      case Output::Kind::kView:
        return meta_tensor(call.tensors[o.index].tensor.storage(), o.layout);
      case Output::Kind::kFresh:
        return meta_tensor(fresh[o.index], o.layout);
    }
    return at::Tensor();
  };
  torch::jit::drop(*stack, call.op->schema().arguments().size());
  const auto& returns = call.op->schema().returns();
  for (size_t i = 0; i < r.returns.size(); ++i) {
    const Return& ret = r.returns[i];
    if (ret.is_list) {
      c10::List<at::Tensor> list;
      for (const auto& o : ret.items) {
        list.push_back(make(o));
      }
      stack->emplace_back(std::move(list));
    } else if (ret.items[0].kind == Output::Kind::kNone && returns[i].type()->kind() == c10::TypeKind::OptionalType) {
      stack->emplace_back();
    } else {
      stack->emplace_back(make(ret.items[0]));
    }
  }
}

void fallback_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet /*ks*/, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const std::string name = op_name(schema);
  if (op.hasTag(at::Tag::dynamic_output_shape)) {
    refuse_values(name, "LibTorch tags it dynamic_output_shape");
  }
  if (op.hasTag(at::Tag::data_dependent_output)) {
    refuse_values(name, "LibTorch tags it data_dependent_output");
  }
  for (const auto& ret : schema.returns()) {
    const auto& type = ret.real_type();
    const bool tensor = type->kind() == c10::TypeKind::TensorType ||
        (type->kind() == c10::TypeKind::OptionalType &&
         type->containedType(0)->kind() == c10::TypeKind::TensorType) ||
        (type->kind() == c10::TypeKind::ListType && type->containedType(0)->kind() == c10::TypeKind::TensorType);
    if (!tensor) {
      refuse_values(name, fmt::format("it returns a {}", type->str()));
    }
  }
  const size_t n = schema.arguments().size();
  TORCH_INTERNAL_ASSERT(stack->size() >= n);
  const torch::jit::Stack args(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
  Call call;
  call.op = &op;
  call.name = name;
  call.args = &args;
  const std::string key = describe(call, args);
  const auto r = result_for(call, key);
  if (!r->refused.empty()) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, r->refused);
  }
  apply(call, *r, stack);
}

// The ops the fallback is registered on: aten ops with a CPU kernel and no
// Meta or composite kernel.
bool served(const c10::OperatorHandle& op) {
  using c10::DispatchKey;
  return op.hasKernelForDispatchKey(DispatchKey::CPU) && !op.hasKernelForDispatchKey(DispatchKey::Meta) &&
      !op.hasKernelForDispatchKey(DispatchKey::CompositeExplicitAutograd) &&
      !op.hasKernelForDispatchKey(DispatchKey::CompositeExplicitAutogradNonFunctional) &&
      !op.hasKernelForDispatchKey(DispatchKey::CompositeImplicitAutograd);
}

} // namespace meta_fallback_impl
} // namespace

void register_meta_fallback() {
  using namespace meta_fallback_impl;
  static std::once_flag once;
  std::call_once(once, [] {
    auto& dispatcher = c10::Dispatcher::singleton();
    // Never destroyed: the kernels live as long as the process.
    auto* lib = &keep_for_process(std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                                                   c10::DispatchKey::Meta, __FILE__, __LINE__));
    for (const auto& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) {
        continue;
      }
      const auto op = dispatcher.findOp(name);
      if (!op.has_value() || !served(*op)) {
        continue;
      }
      std::string qualified = name.name.substr(6);
      if (!name.overload_name.empty()) {
        qualified += "." + name.overload_name;
      }
      lib->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback_kernel>());
    }
  });
}

std::string meta_fallback_refused_op(const std::string& message) {
  const std::string lead = "trainmem: ";
  const auto at = message.find(lead);
  if (at == std::string::npos) {
    return "";
  }
  const auto start = at + lead.size();
  const auto end = message.find(" has no meta kernel", start);
  if (end == std::string::npos || message.find(' ', start) < end) {
    return "";
  }
  return message.substr(start, end - start);
}

} // namespace trainmem::detail
