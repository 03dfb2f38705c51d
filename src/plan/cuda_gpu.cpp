// GPUs by name: their compute capability, and the options the installed
// LibTorch runs with on them (cuda_predict.h).

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/version.h>

#include "trainmem/cuda_predict.h"

namespace trainmem {

namespace {

// Lower case, spaces, dashes and underscores dropped: "RTX 4090" == "rtx4090".
std::string gpu_key(const std::string& name) {
  std::string key;
  for (const char c : name) {
    if (c != ' ' && c != '-' && c != '_') {
      key.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
    }
  }
  return key;
}

} // namespace

const std::vector<CudaGpu>& known_cuda_gpus() {
  // NVIDIA's published compute capabilities.
  static const std::vector<CudaGpu> gpus = {
      {"H100", 90},  {"H200", 90},  {"GH200", 90},    {"B200", 100},     {"A100", 80}, {"A10G", 86}, {"A10", 86},
      {"L4", 89},    {"L40S", 89},  {"RTX 4090", 89}, {"RTX 3090", 86},  {"T4", 75},   {"V100", 70},
  };
  return gpus;
}

CudaGpu cuda_gpu(const std::string& name) {
  const auto& gpus = known_cuda_gpus();
  const auto it = std::find_if(gpus.begin(), gpus.end(),
                               [&](const CudaGpu& g) { return gpu_key(g.name) == gpu_key(name); });
  if (it != gpus.end()) {
    return *it;
  }
  std::string known;
  for (const auto& g : gpus) {
    known += (known.empty() ? "" : ", ") + g.name;
  }
  TORCH_CHECK(false, "unknown GPU '", name, "': expected one of ", known);
}

CudaPredictOptions cuda_options_for(const CudaGpu& gpu, CudaPredictOptions base) {
  TORCH_CHECK(gpu.compute_capability >= 50 && gpu.compute_capability <= 121,
              "cuda_options_for: compute capability ", gpu.compute_capability, " of '", gpu.name,
              "' is outside 50-121 (sm 5.0 to 12.1, what LibTorch's attention kernels cover)");
  const int64_t major = gpu.compute_capability / 10;
  base.compute_capability(gpu.compute_capability);
  base.gpu_name(gpu.name);
  base.cublas_workspace_bytes(major == 9 || major == 10 || major == 12 ? kCublasWorkspaceHopperBytes
                                                                        : kCublasWorkspaceBytes);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 11)
  base.cublaslt_workspace_bytes(0);  // cuBLASLt shares the handle's cuBLAS workspace
#endif
  return base;
}

} // namespace trainmem
