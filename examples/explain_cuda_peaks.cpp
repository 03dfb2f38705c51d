// A notebook's CUDA peaks reproduced and explained, on a machine without a GPU.
//
// The notebook's "Activation Checkpointing" experiment (16 residual blocks
// Linear(1024, 1024) - GELU - Linear(1024, 1024), X (16384, 1024) requiring
// grad, loss h.sum(), store-all vs a checkpoint per block) printed CUDA peaks
// of 4318 MB and 2306 MB (max_memory_allocated / 1e6). This program predicts
// both from meta runs through trainmem's model of the CUDA caching allocator
// (cuda_predict.h) and prints them term by term. The experiment's own tensors
// do not explain them: the notebook ran its "Mixed Precision" section first in
// the same process, and what that section leaves alive (the MLP, the
// gradients of its last step, y, and the cuBLAS / cuBLASLt workspaces of the
// main and the backward threads) is still allocated when the peak is reset.
//
// It then does the same for that MLP (4096-8192-8192-10, SGD, batch 2048):
// static and activation bytes and the predicted CUDA peak per precision.
//
//   explain_cuda_peaks            predictions (seconds; a ctest checks the output)
//   explain_cuda_peaks --run-cpu  also runs the checkpoint experiment for real on
//                                 the CPU (about 4 GB, minutes on 2 cores) and
//                                 compares the measured peak with the CPU prediction
//   explain_cuda_peaks --gpu      on a CUDA machine, runs both experiments and the
//                                 capstone (per checkpointing variant, with step-time
//                                 ratios) on the GPU and prints measured beside
//                                 predicted (skips without CUDA)
#include <cstdio>
#include <cstring>
#include <iostream>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <chrono>

#include "trainmem/accountant.h"
#include "trainmem/allocator.h"
#include "trainmem/block_checkpointing.h"
#include "trainmem/checkpoint.h"
#include "trainmem/cuda_predict.h"
#include "trainmem/device.h"
#include "trainmem/meta.h"
#include "trainmem/models/transformer.h"
#include "trainmem/models/transformer_plan.h"
#include "trainmem/planner.h"
#include "trainmem/report.h"

namespace {

using trainmem::with_commas;

constexpr int64_t kD = 1024, kBlocks = 16, kRows = 16384;

// class Block(nn.Module): x + Sequential(Linear(d, d), GELU(), Linear(d, d))(x)
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d)
      : net(register_module("net", torch::nn::Sequential(torch::nn::Linear(d, d), torch::nn::GELU(),
                                                          torch::nn::Linear(d, d)))) {}
  at::Tensor forward(const at::Tensor& x) { return x + net->forward(x); }
  torch::nn::Sequential net;
};
TORCH_MODULE(Block);

struct BlocksImpl : torch::nn::Module {
  BlocksImpl() : list(register_module("blocks", torch::nn::ModuleList())) {
    for (int64_t i = 0; i < kBlocks; ++i) {
      list->push_back(Block(kD));
    }
  }
  // run(use_ckpt): h = X; h = checkpoint(blk, h) or blk(h) per block; h.sum()
  at::Tensor run(const at::Tensor& x, bool use_ckpt) {
    at::Tensor h = x;
    for (const auto& m : *list) {
      auto blk = std::dynamic_pointer_cast<BlockImpl>(m);
      h = use_ckpt ? trainmem::checkpoint([blk](const at::Tensor& in) { return blk->forward(in); }, h)
                   : blk->forward(h);
    }
    return h.sum();
  }
  torch::nn::ModuleList list;
};
TORCH_MODULE(Blocks);

// nn.Sequential(Flatten, Linear(64*64, 8192), ReLU, Linear(8192, 8192), ReLU, Linear(8192, 10))
struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : l1(register_module("l1", torch::nn::Linear(64 * 64, 8192))),
        l2(register_module("l2", torch::nn::Linear(8192, 8192))),
        l3(register_module("l3", torch::nn::Linear(8192, 10))) {}
  // loss(net(X), y), in fp32 or as torch.autocast('cuda', dtype) runs it:
  // linear is on autocast's lower-precision list (input, weight and bias cast
  // to `dt`; weight and bias casts cached until autocast exits, X cast at each
  // use), relu runs in its input's dtype, cross_entropy on the fp32 list.
  // Autocast has no meta key, so on meta the casts are spelt out.
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y, std::optional<at::ScalarType> dt) {
    auto h = x.flatten(1);
    auto lin = [&](torch::nn::Linear& l, const at::Tensor& in) {
      return dt ? at::linear(in.to(*dt), l->weight.to(*dt), l->bias.to(*dt)) : l->forward(in);
    };
    h = at::relu(lin(l1, h));
    h = at::relu(lin(l2, h));
    auto logits = lin(l3, h);
    return at::cross_entropy_loss(dt ? logits.to(at::kFloat) : logits, y);
  }
  torch::nn::Linear l1, l2, l3;
};
TORCH_MODULE(Mlp);

struct Precision {
  const char* name;
  std::optional<at::ScalarType> dtype;
};
const Precision kPrecisions[] = {{"fp32", std::nullopt}, {"bf16-autocast", at::kBFloat16},
                                 {"fp16-autocast", at::kHalf}};

int64_t block_bytes(int64_t n) {  // the caching allocator's 512 B rounding
  return n <= 0 ? 0 : (n + 511) / 512 * 512;
}

std::string mb(int64_t bytes) {
  return fmt::format("{:.0f} MB", static_cast<double>(bytes) / 1e6);
}

struct MlpPrediction {
  trainmem::StaticBuckets buckets;
  int64_t saved_bytes = 0;
  trainmem::CudaStepPrediction cuda;
};

MlpPrediction predict_mlp(const Precision& p, const trainmem::CudaPredictOptions& base) {
  Mlp net{nullptr};
  {
    trainmem::MetaInitGuard meta;
    net = Mlp();
  }
  auto X = at::empty({2048, 1, 64, 64}, at::kMeta);
  auto y = at::empty({2048}, at::TensorOptions(at::kMeta).dtype(at::kLong));
  // fp16 trains with a GradScaler: the scale (a float32 scalar) multiplies the loss.
  auto scale = at::empty({}, at::kMeta);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01));
  MlpPrediction r;
  r.saved_bytes = trainmem::predict_saved_activations(*net, [&] { return net->loss(X, y, p.dtype); }).saved_bytes;
  auto options = base;
  std::vector<at::Tensor> resident = {X, y};
  if (p.dtype == at::kHalf) {
    resident.push_back(scale);
  }
  options.resident(resident);
  r.cuda = trainmem::predict_cuda_step_peak(
      *net,
      [&] {
        auto l = net->loss(X, y, p.dtype);
        return p.dtype == at::kHalf ? l * scale : l;
      },
      &opt, options);
  r.buckets = trainmem::account(*net, opt);
  return r;
}

// What the notebook's "Mixed Precision" section leaves on the device when the
// checkpoint section starts: net (the MLP), the gradients of its last step
// (step() sets them to None at its start, not its end), y. X is rebound by
// the checkpoint section, which frees the MLP's.
std::vector<at::Tensor> mlp_leftovers() {
  Mlp net{nullptr};
  {
    trainmem::MetaInitGuard meta;
    net = Mlp();
  }
  std::vector<at::Tensor> out;
  for (const auto& p : net->parameters()) {
    out.push_back(p.detach());
  }
  for (const auto& p : net->parameters()) {
    out.push_back(at::empty_like(p));  // p.grad
  }
  out.push_back(at::empty({2048}, at::TensorOptions(at::kMeta).dtype(at::kLong)));  // y
  return out;
}

void print_terms(const char* title, const trainmem::CudaStepPrediction& a, const trainmem::CudaStepPrediction& b,
                 int64_t leftover_bytes, int64_t x_bytes) {
  std::cout << title << "\n";
  std::cout << fmt::format("  {:<46} {:>16} {:>16}\n", "", "store all", "checkpointed");
  auto row = [&](const char* what, int64_t va, int64_t vb) {
    std::cout << fmt::format("  {:<46} {:>16} {:>16}\n", what, with_commas(va), with_commas(vb));
  };
  row("MLP section's leftovers (net, its grads, y)", leftover_bytes, leftover_bytes);
  row("X (16384, 1024) fp32", x_bytes, x_bytes);
  row("blocks' parameters", a.terms.param_bytes, b.terms.param_bytes);
  row("cuBLAS / cuBLASLt workspaces", a.terms.workspace_bytes, b.terms.workspace_bytes);
  row("gradients written (blocks, X)", a.terms.grad_bytes, b.terms.grad_bytes);
  row("step tensors (activations, grads, recompute)", a.terms.step_bytes, b.terms.step_bytes);
  row("cuBLAS copy of the expanded h.sum() grad", a.terms.kernel_temporary_bytes, b.terms.kernel_temporary_bytes);
  row("512 B rounding", a.terms.rounding_bytes, b.terms.rounding_bytes);
  row("= max_memory_allocated (B)", a.max_memory_allocated_bytes, b.max_memory_allocated_bytes);
  std::cout << fmt::format("  {:<46} {:>16} {:>16}\n", "  in the notebook's unit (/ 1e6)",
                           mb(a.max_memory_allocated_bytes), mb(b.max_memory_allocated_bytes));
}

// For `make gpu-check`: the capstone (AdamW, second step) per checkpointing
// variant, predicted max_memory_allocated / reserved beside the measured, and
// the step time relative to storing everything.
void capstone_on_gpu(const c10::Device& dev) {
  const trainmem::TransformerOptions o;
  constexpr int64_t kBatch = 16, kSeqLen = 64;  // the capstone's input (16, 64, 128)
  std::cout << "\nCapstone on the GPU (AdamW, second step): measured / predicted max allocated, reserved; time vs none\n";
  double none_seconds = 0.0;
  const int64_t L = o.num_layers();
  const std::vector<trainmem::BlockCheckpointing> variants = {
      trainmem::BlockCheckpointing::none(L), trainmem::BlockCheckpointing::full(L),
      trainmem::BlockCheckpointing::every(L, 2),
      trainmem::BlockCheckpointing::selective(L, trainmem::save_matmuls_policy())};
  for (const auto& ck : variants) {
    const auto pred = trainmem::predict_cuda_transformer_step(o, kBatch, kSeqLen, ck);
    torch::manual_seed(0);
    trainmem::Transformer model(o);
    model->to(dev);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
    auto x = torch::randn({kBatch, kSeqLen, o.d_model()}, at::TensorOptions(dev));
    auto step = [&] {
      opt.zero_grad();
      model->forward(x, ck).pow(2).mean().backward();
      opt.step();
    };
    step();  // warm-up: optimizer state, workspaces, cached segments
    torch::cuda::synchronize();
    trainmem::reset_peak(dev);
    step();
    torch::cuda::synchronize();
    const auto s = trainmem::device_memory_stats(dev);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) {
      step();
    }
    torch::cuda::synchronize();
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 10;
    if (none_seconds == 0.0) {
      none_seconds = sec;
    }
    std::cout << fmt::format("  {:<10} allocated {} / {} B, reserved {} / {} B, time x{:.2f}\n", ck.name,
                             with_commas(s.peak_allocated_bytes), with_commas(pred.max_memory_allocated_bytes),
                             with_commas(s.peak_reserved_bytes), with_commas(pred.max_memory_reserved_bytes),
                             sec / none_seconds);
  }
}

struct Options {
  bool run_cpu = false;
  bool gpu = false;
};

// 1. The mixed-precision MLP, first in the notebook: each precision's row;
// the workspaces it leaves.
trainmem::CudaWorkspaces print_mlp_section() {
  std::cout << "Mixed precision MLP (4096-8192-8192-10, SGD, batch 2048), one step after a warm-up step\n";
  std::cout << fmt::format("  {:<14} {:>14} {:>14} {:>16} {:>18} {:>18}\n", "precision", "parameters", "gradients",
                           "saved activations", "max allocated", "max reserved");
  trainmem::CudaWorkspaces after_mlp;
  for (const auto& p : kPrecisions) {
    const auto r = predict_mlp(p, trainmem::CudaPredictOptions());
    std::cout << fmt::format("  {:<14} {:>14} {:>14} {:>16} {:>18} {:>18}\n", p.name,
                             with_commas(r.buckets.param_bytes), with_commas(r.buckets.predicted_grad_bytes),
                             with_commas(r.saved_bytes), with_commas(r.cuda.max_memory_allocated_bytes),
                             with_commas(r.cuda.max_memory_reserved_bytes));
    after_mlp = r.cuda.workspaces;  // the last section ran bf16/fp16 autocast: same workspaces
  }
  std::cout << "  (tf32 changes no byte: the notebook's fp32 and tf32 rows have fp32's figures)\n\n";
  return after_mlp;
}

// The checkpoint experiment on meta: the blocks and X, which requires grad.
struct Experiment {
  Experiment() {
    {
      trainmem::MetaInitGuard meta;
      blocks = Blocks();
    }
    X = at::empty({kRows, kD}, at::kMeta).requires_grad_(true);
  }
  // Its CUDA step, store all or checkpointed, with `resident` live beside it.
  trainmem::CudaStepPrediction predict(bool ckpt, const std::vector<at::Tensor>& resident,
                                       trainmem::CudaWorkspaces ws) {
    X.mutable_grad().reset();  // X.grad = None
    return trainmem::predict_cuda_step_peak(*blocks, [&] { return blocks->run(X, ckpt); }, nullptr,
                                            trainmem::CudaPredictOptions().resident(resident).workspaces(ws));
  }
  Blocks blocks{nullptr};
  at::Tensor X;
};

struct CheckpointPeaks {
  trainmem::CudaStepPrediction store;
  trainmem::CudaStepPrediction ckpt;
  bool reproduced = false;  // both as the notebook printed them
};

// 2. The checkpoint experiment, in the notebook's order (store all, then
// checkpointed), after its MLP section: term by term, and where the bytes
// its own tensors do not explain come from.
CheckpointPeaks print_checkpoint_section(Experiment& ex, const trainmem::CudaWorkspaces& after_mlp) {
  const int64_t x_bytes = ex.X.numel() * 4;
  auto leftovers = mlp_leftovers();
  int64_t leftover_bytes = 0;
  for (const auto& t : leftovers) {
    leftover_bytes += t.numel() * static_cast<int64_t>(t.element_size());
  }
  auto notebook_resident = leftovers;
  notebook_resident.push_back(ex.X);
  CheckpointPeaks r;
  r.store = ex.predict(false, notebook_resident, after_mlp);
  r.ckpt = ex.predict(true, notebook_resident, r.store.workspaces);
  print_terms("Checkpoint experiment, in the notebook's process (after its mixed-precision section)", r.store,
              r.ckpt, leftover_bytes, x_bytes);
  const bool store_ok = mb(r.store.max_memory_allocated_bytes) == "4318 MB";
  const bool ckpt_ok = mb(r.ckpt.max_memory_allocated_bytes) == "2306 MB";
  r.reproduced = store_ok && ckpt_ok;
  std::cout << fmt::format("  {:<46} {:>16} {:>16}\n", "the notebook printed", "4318 MB", "2306 MB");
  std::cout << fmt::format("  {:<46} {:>16} {:>16}\n\n", "reproduced", store_ok ? "yes" : "NO",
                           ckpt_ok ? "yes" : "NO");

  std::cout << "Where the bytes the experiment's own tensors do not explain come from (the notebook's text):\n"
            << fmt::format("  - the MLP of \"Mixed Precision, Fairly Measured\": parameters {} B and the gradients\n"
                           "    of its last benchmarked step {} B (step() zeroes them at its start), y {} B;\n",
                           with_commas(leftovers.size() > 0 ? (leftover_bytes - 16384) / 2 : 0),
                           with_commas((leftover_bytes - 16384) / 2), with_commas(16384))
            << "  - cuBLAS workspaces of the main and the autograd device thread (the MLP made both) and\n"
               "    the main thread's cuBLASLt workspace (its addmm with bias); the checkpointed run's\n"
               "    recompute runs addmm on the backward thread and makes that thread's cuBLASLt one;\n"
            << "  - cuBLAS cannot read the expanded gradient of h.sum() (strides 0, 0) and clones it\n"
               "    (67,108,864 B) for each mm of the last block's backward.\n";
  std::cout << fmt::format("  The same steps in a fresh process (only X and the blocks on the device): store all {}"
                           " B, checkpointed {} B.\n\n",
                           with_commas(ex.predict(false, {ex.X}, {}).max_memory_allocated_bytes),
                           with_commas(ex.predict(true, {ex.X}, {}).max_memory_allocated_bytes));
  return r;
}

// 3. The CPU: the planner's meta prediction, and with `run_cpu` a real run.
void print_cpu_section(Experiment& ex, bool run_cpu) {
  std::cout << "The same experiment on the CPU (predicted on meta; measured with --run-cpu)\n";
  for (bool ck : {false, true}) {
    ex.X.mutable_grad().reset();
    const auto p = trainmem::predict_step_peak(*ex.blocks, [&] { return ex.blocks->run(ex.X, ck); });
    std::cout << fmt::format("  {:<14} predicted CPU peak {:>16} B", ck ? "checkpointed" : "store all",
                             with_commas(p.peak_bytes));
    if (run_cpu) {
      torch::manual_seed(0);
      Blocks cpu;
      auto Xc = torch::randn({kRows, kD}).requires_grad_(true);
      const auto m = trainmem::measure_step_peak(*cpu, [&] { return cpu->run(Xc, ck); });
      std::cout << fmt::format(", measured {:>16} B, measured / predicted {:.4f}", with_commas(m.peak_bytes),
                               static_cast<double>(m.peak_bytes) / static_cast<double>(p.peak_bytes));
    }
    std::cout << "\n";
  }
  std::cout << "  (peaks above what was live before the step: parameters + the step's own bytes; X excluded)\n";
}

// --gpu: both experiments run on `dev` in the notebook's order, measured
// beside `peaks`, then the capstone.
void run_on_gpu(const c10::Device& dev, const CheckpointPeaks& peaks) {
  std::cout << "\nOn the GPU, the notebook's order (measured beside predicted max_memory_allocated / reserved)\n";
  // The mixed-precision section first: a few steps per precision.
  torch::manual_seed(0);
  Mlp mlp;
  mlp->to(dev);
  auto Xm = torch::randn({2048, 1, 64, 64}, at::TensorOptions(dev));
  auto ym = torch::randint(0, 10, {2048}, at::TensorOptions(dev).dtype(at::kLong));
  torch::optim::SGD sgd(mlp->parameters(), torch::optim::SGDOptions(0.01));
  for (const auto& p : kPrecisions) {
    trainmem::reset_peak(dev);
    for (int i = 0; i < 3; ++i) {
      sgd.zero_grad();
      at::Tensor l;
      if (p.dtype) {
        at::autocast::set_autocast_dtype(at::kCUDA, *p.dtype);
        at::autocast::set_autocast_enabled(at::kCUDA, true);
        l = mlp->loss(Xm, ym, std::nullopt);
        at::autocast::set_autocast_enabled(at::kCUDA, false);
        at::autocast::clear_cache();
      } else {
        l = mlp->loss(Xm, ym, std::nullopt);
      }
      l.backward();
      sgd.step();
    }
    const auto s = trainmem::device_memory_stats(dev);
    std::cout << fmt::format("  MLP {:<14} measured {} / {} B\n", p.name, with_commas(s.peak_allocated_bytes),
                             with_commas(s.peak_reserved_bytes));
  }
  Xm = at::Tensor();  // the checkpoint section rebinds X
  torch::manual_seed(0);
  Blocks gpu;
  gpu->to(dev);
  auto Xg = torch::randn({kRows, kD}, at::TensorOptions(dev)).requires_grad_(true);
  for (bool ck : {false, true}) {
    for (auto& p : gpu->parameters()) {
      p.mutable_grad().reset();
    }
    Xg.mutable_grad().reset();
    trainmem::reset_peak(dev);
    gpu->run(Xg, ck).backward();
    const auto s = trainmem::device_memory_stats(dev);
    const auto& pred = ck ? peaks.ckpt : peaks.store;
    std::cout << fmt::format("  {:<14} measured {} / {} B, predicted {} / {} B\n",
                             ck ? "checkpointed" : "store all", with_commas(s.peak_allocated_bytes),
                             with_commas(s.peak_reserved_bytes), with_commas(pred.max_memory_allocated_bytes),
                             with_commas(pred.max_memory_reserved_bytes));
  }
  capstone_on_gpu(dev);
}

int run(const Options& opts) {
  trainmem::CpuMemoryTracker::install();
  std::cout << "The notebook's CUDA peaks, predicted from meta runs (LibTorch's caching allocator, 512 B blocks;\n"
               "cuBLAS workspace 8,519,680 B per thread (compute capability < 9), cuBLASLt 1 MiB)\n\n";
  const auto after_mlp = print_mlp_section();
  Experiment ex;
  const auto peaks = print_checkpoint_section(ex, after_mlp);
  print_cpu_section(ex, opts.run_cpu);
  if (opts.gpu) {
    if (!torch::cuda::is_available()) {
      std::cout << "\n--gpu: no CUDA device, skipped\n";
      return 0;
    }
    run_on_gpu(c10::Device(c10::kCUDA, 0), peaks);
  }
  return peaks.reproduced ? 0 : 3;
}

} // namespace

int main(int argc, char** argv) {
  Options opts;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--run-cpu") == 0) {
      opts.run_cpu = true;
    } else if (std::strcmp(argv[i], "--gpu") == 0) {
      opts.gpu = true;
    } else {
      std::fprintf(stderr,
                   "explain_cuda_peaks: unknown argument '%s'\nusage: explain_cuda_peaks [--run-cpu] [--gpu]\n",
                   argv[i]);
      return 2;
    }
  }
  try {
    return run(opts);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "explain_cuda_peaks: %s\n", e.what());
    return 1;
  }
}
