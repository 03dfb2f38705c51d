#pragma once

// Probes of CPU kernels for the meta kernels (Note [CPU convolution scratch]
// in src/core/meta_kernels.cpp, Note [Meta RNNs follow the CPU's kernel] in
// src/core/meta_rnn.cpp), defined in src/core/cpu_probe.cpp: an op runs once
// on zero-filled CPU tensors with the meta tensors' sizes and strides, under
// the CPU tracker; what it allocated beyond its outputs (its scratch) and its
// outputs' sizes, strides and dtypes are kept for the process, per distinct
// call.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

namespace torch {
class Library;
} // namespace torch

namespace trainmem::detail {

/// An output of a probed call: what a meta kernel gives back in its place.
struct ProbedTensor {
  bool defined = false;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  at::ScalarType dtype = at::kFloat;
};

struct CpuProbe {
  int64_t scratch_bytes = 0;  ///< the CPU peak above the inputs and outputs, in bytes
  std::vector<ProbedTensor> outputs;
};

/// Makes the CPU inputs, calls `open()` (the window opens), runs the op and
/// returns its outputs.
using ProbeRun = std::function<std::vector<at::Tensor>(const std::function<void()>& open)>;

/// The probe of `key` (run once per process and thread count); nullopt when
/// its tensors would take more than 1 GiB (`probe_bytes`): not run.
std::optional<CpuProbe> cpu_probe(const std::string& key, int64_t probe_bytes, const ProbeRun& run);

/// cpu_probe()'s scratch; 0, with one warning, when not probed.
int64_t cpu_scratch(const std::string& key, int64_t probe_bytes, const ProbeRun& run);

/// False when TRAINMEM_CONV_SCRATCH=0 or a CUDA prediction runs on this thread.
bool probing_enabled();
/// "dtype[sizes/strides]", or "-" when undefined: part of a probe key.
std::string probe_key(const at::Tensor& t);
/// A zero-filled CPU tensor with `t`'s sizes, strides and dtype (undefined stays so).
at::Tensor cpu_twin(const at::Tensor& t);
int64_t probe_storage_bytes(const at::Tensor& t);
/// Holds `bytes` on meta until the returned tensor goes.
at::Tensor hold_meta_bytes(int64_t bytes);
/// A meta tensor shaped as `t` (undefined when `t` was), with `options`' other fields.
at::Tensor meta_like(const ProbedTensor& t, const at::TensorOptions& options);

/// Registers the RNN meta kernels (src/core/meta_rnn.cpp): mkldnn_rnn_layer and
/// its backward on `meta` (the aten Meta library), aten::lstm.input on AutogradMeta.
void register_rnn_meta_kernels(torch::Library& meta);

} // namespace trainmem::detail
