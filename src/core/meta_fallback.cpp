// The generic meta path for ops without a Meta kernel: Note [A meta path for
// ops without a meta kernel]. This file registers it and selects its ops;
// meta_fallback_refusals.cpp describes a call and refuses what it cannot
// stand in for, meta_fallback_standins.cpp runs the CPU kernel on stand-ins
// and caches each call's result, meta_fallback_apply.cpp makes the outputs
// meta tensors (detail/meta_fallback_internal.h is what they share).
#include "core/detail/meta_fallback.h"

#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/library.h>

#include "detail/process_library.h"
#include "core/detail/meta_fallback_internal.h"

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
namespace meta_fallback_impl {

constexpr int64_t kDefaultMaxBytes = int64_t{1} << 30;

int64_t max_bytes() {
  const char* v = std::getenv("TRAINMEM_META_FALLBACK_MAX_BYTES");
  if (v == nullptr || *v == '\0') {
    return kDefaultMaxBytes;
  }
  char* end = nullptr;
  const long long parsed = std::strtoll(v, &end, 10);
  return end != v && parsed >= 0 ? static_cast<int64_t>(parsed) : kDefaultMaxBytes;
}

namespace {

std::string op_name(const c10::FunctionSchema& schema) {
  return schema.overload_name().empty() ? schema.name() : schema.name() + "." + schema.overload_name();
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

} // namespace
} // namespace meta_fallback_impl

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
