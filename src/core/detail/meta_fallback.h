#pragma once

// The one meta path for the ATen ops LibTorch's C++ has no Meta kernel for:
// Note [A meta path for ops without a meta kernel] in src/core/meta_fallback.cpp.
// Core layer; not installed.

#include <string>

namespace trainmem::detail {

/// Registers the fallback kernel on the Meta key of every aten op that has a
/// CPU kernel and neither a Meta kernel nor a composite one. Once per process;
/// register_meta_kernels() calls it after trainmem's own meta kernels, so an
/// op that has one keeps it.
void register_meta_fallback();

/// The op a refusal of the fallback names ("aten::nonzero" from "trainmem:
/// aten::nonzero has no meta kernel and ..."), or "" when `message` is none.
std::string meta_fallback_refused_op(const std::string& message);

} // namespace trainmem::detail
