// The generic meta path's refusals: what a call's tensors are, and what the
// fallback cannot stand in for (Note [A meta path for ops without a meta
// kernel] in meta_fallback.cpp).

#include "core/detail/meta_fallback_internal.h"

#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "detail/intercept.h"

namespace trainmem::detail::meta_fallback_impl {

[[noreturn]] void refuse_values(const std::string& name, const std::string& why) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "trainmem: ", name, " has no meta kernel and its output shape depends on values (",
                              why,
                              "): a prediction cannot run it on meta (", kNote, ")");
}

std::string refusal(const std::string& name, const std::string& why) {
  return fmt::format("trainmem: {} has no meta kernel, and {} ({})", name, why, kNote);
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

namespace {

// The call's tensor arguments, flattened, each marked written when its
// schema says so (in place, out=); and whether it takes a generator.
void collect_tensors(Call& call, const torch::jit::Stack& args) {
  const auto& schema = call.op->schema();
  map_tensors(args, [&](int /*k*/, const at::Tensor& t) {
    call.tensors.push_back({t});
    return t;
  });
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

// Groups the meta arguments by storage (refusing one with no strided
// storage), and marks those that share theirs with another argument.
void group_storages(Call& call) {
  std::unordered_map<const c10::StorageImpl*, int> group_of;
  std::vector<int> members;
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
}

// One tensor argument's part of the key: a meta one by its layout and
// storage group, a CPU one by its layout and (when small) its bytes.
void append_tensor_key(std::ostringstream& key, Call& call, const Arg& a) {
  const at::Tensor& t = a.tensor;
  if (!t.defined()) {
    key << " -";
    return;
  }
  if (t.is_meta()) {
    key << fmt::format(" M{}{}:{}[{}/{}]+{}:{}{}{}{}{}", a.group, a.shared ? "s" : "",
                       c10::toString(t.scalar_type()), fmt::join(t.sizes(), ","), fmt::join(t.strides(), ","),
                       t.storage_offset(), a.shared ? static_cast<int64_t>(t.storage().nbytes()) : extent_bytes(t),
                       a.written ? "w" : "", t.unsafeGetTensorImpl()->is_wrapped_number() ? "n" : "",
                       t.is_conj() ? "c" : "", t.is_neg() ? "g" : "");
    return;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(t.is_cpu() && t.layout() == at::kStrided && !t.is_quantized(),
                              refusal(call.name, fmt::format("it got a {} tensor beside meta ones",
                                                             c10::str(t.device()))));
  TORCH_CHECK_NOT_IMPLEMENTED(!a.written, refusal(call.name, "it writes a CPU tensor it got beside meta ones"));
  // Real data: its values may matter; small ones are part of the key.
  key << fmt::format(" C:{}[{}/{}]{}", c10::toString(t.scalar_type()), fmt::join(t.sizes(), ","),
                     fmt::join(t.strides(), ","), t.unsafeGetTensorImpl()->is_wrapped_number() ? "n" : "");
  if (t.numel() <= 16) {
    key << "=" << bytes_hex(t);
  } else {
    call.cacheable = false;
  }
}

// One argument's part of the key; `k` walks the flattened tensors.
void append_arg_key(std::ostringstream& key, Call& call, const c10::IValue& v, size_t& k) {
  if (v.isTensor()) {
    append_tensor_key(key, call, call.tensors[k++]);
  } else if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList()) {
    key << " [";
    for (const c10::IValue& e : v.toList()) {
      if (e.isTensor()) {
        append_tensor_key(key, call, call.tensors[k++]);
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

} // namespace

// Collects the call's tensors and checks what the fallback can stand in for;
// the key of the call (empty when it cannot be cached).
std::string describe(Call& call, const torch::jit::Stack& args) {
  collect_tensors(call, args);
  group_storages(call);
  std::ostringstream key;
  key << call.name;
  for (size_t i = 0, k = 0; i < args.size(); ++i) {
    append_arg_key(key, call, args[i], k);
  }
  key << fmt::format("|threads {}|mkldnn {}", at::get_num_threads(), at::globalContext().userEnabledMkldnn());
  return key.str();
}

} // namespace trainmem::detail::meta_fallback_impl
