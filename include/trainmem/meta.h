#pragma once
/// \file meta.h
/// The meta device for C++ modules: shapes, dtypes and exact byte counts with
/// no data.
///
/// Example:
/// ```
/// torch::nn::Linear lin(1000, 1000);
/// trainmem::to_meta(*lin);                 // parameters keep their identity
/// trainmem::account(*lin).param_bytes;     // 4,004,000 B planned, no data
/// ```

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace trainmem {

/// Moves every parameter and buffer of `module` (recursively) to the meta
/// device in place: each tensor keeps its identity (an optimizer or a meter
/// built on it still refers to it), its shape, strides, dtype and
/// requires_grad, and its storage is released. LibTorch's `module->to(kMeta)`
/// refuses this ("incompatible tensor type"). Note that the module was built
/// on CPU first, so its parameters were allocated once.
void to_meta(torch::nn::Module& module);

} // namespace trainmem
