#pragma once

// What the files of the generic meta path share (Note [A meta path for ops
// without a meta kernel] in src/core/meta_fallback.cpp): a call's tensors
// and what the CPU kernel gave for it. meta_fallback.cpp registers the path
// and selects its ops, meta_fallback_refusals.cpp describes a call and says
// what it refuses, meta_fallback_standins.cpp runs the CPU kernel on
// stand-ins and caches each call's result, meta_fallback_apply.cpp makes the
// meta outputs. Core layer; not installed.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/StorageImpl.h>

namespace trainmem::detail::meta_fallback_impl {

inline constexpr const char* kNote = "Note [A meta path for ops without a meta kernel]";

/// The stand-ins' cap in bytes (TRAINMEM_META_FALLBACK_MAX_BYTES, default 1 GiB).
int64_t max_bytes();

/// Throws the refusal of an op whose output shape depends on values.
[[noreturn]] void refuse_values(const std::string& name, const std::string& why);
/// "trainmem: NAME has no meta kernel, and WHY (the Note)".
std::string refusal(const std::string& name, const std::string& why);

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

inline Layout layout_of(const at::Tensor& t, int64_t offset_shift = 0) {
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

/// `args` with each tensor (lists flattened, in order) replaced by f(k, t).
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

/// Bytes the tensor's sizes and strides reach from offset 0 (0 when empty).
int64_t extent_bytes(const at::Tensor& t);
/// The bytes a stand-in of argument `a` takes: its storage when it shares it
/// with another argument, else its own extent.
int64_t standin_bytes(const Arg& a);
/// Collects the call's tensors and checks what the fallback can stand in for;
/// the key of the call (empty when it cannot be cached).
std::string describe(Call& call, const torch::jit::Stack& args);
/// The call's result, found once per key (a refusal is a result too).
std::shared_ptr<const Result> result_for(const Call& call, const std::string& key);
/// Replaces the call's arguments on `stack` with its meta outputs.
void apply(const Call& call, const Result& r, torch::jit::Stack* stack);

} // namespace trainmem::detail::meta_fallback_impl
