#pragma once

// Note [CPU convolution scratch] (src/core/meta_kernels.cpp): meta
// convolutions measure the CPU kernels' scratch. A CUDA prediction replays
// meta allocations as CUDA ones, whose convolution workspaces are cuDNN's,
// not the CPU's: it turns the probe off on its thread for its duration
// (src/core/cpu_probe.cpp holds the switch).

namespace trainmem::detail {

// True (the default) while meta convolutions on this thread hold the CPU's scratch.
bool& conv_scratch_on_meta();

class NoConvScratchGuard {
 public:
  NoConvScratchGuard() : before_(conv_scratch_on_meta()) { conv_scratch_on_meta() = false; }
  ~NoConvScratchGuard() { conv_scratch_on_meta() = before_; }
  NoConvScratchGuard(const NoConvScratchGuard&) = delete;
  NoConvScratchGuard& operator=(const NoConvScratchGuard&) = delete;

 private:
  bool before_;
};

} // namespace trainmem::detail
