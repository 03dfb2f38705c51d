#pragma once
/// \file distributed_trainer.h
/// The data-parallel trainer behind `trainmem audit --nproc N`: N local ranks
/// (forked processes) meet at a TCPStore on 127.0.0.1 with a free port, make
/// a Gloo process group (on CUDA: NCCL, rank r on cuda:r, with Gloo for CPU
/// tensors; Note [NCCL ranks] in distributed_trainer.cpp), each trains the reference transformer (trainer.h) on
/// its shard of the batch with gradients all-reduced in DDP's buckets
/// (DataParallel), audits its steps, and rank 0 gathers one
/// DistributedReport (distributed.h).
///
/// A rank that throws or dies ends the run: the launcher stops the others
/// and throws a c10::Error naming the rank. Collectives and the store time
/// out after `timeout_ms`, so nothing waits forever.
///
/// Example:
/// ```
/// auto run = trainmem::train_distributed(trainmem::DistributedTrainerOptions().nproc(2));
/// std::cout << trainmem::to_text(run.report);
/// ```

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "trainmem/distributed.h"
#include "app/trainer.h"

namespace trainmem {

/// What `train_distributed()` runs.
struct DistributedTrainerOptions {
  /// The model, optimizer, precision, steps, checkpointing and seed of each
  /// rank; batch() is the global batch, split evenly across ranks.
  /// Offload, optimizer-in-backward and accumulation are not supported here.
  /// Device "cpu" (Gloo) or "cuda" (NCCL, one device per rank: rank r on
  /// cuda:r; needs nccl_available() and nproc CUDA devices).
  TORCH_ARG(TrainerOptions, trainer) = {};
  /// Ranks (local processes).
  TORCH_ARG(int64_t, nproc) = 2;
  /// DDP's bucketing.
  TORCH_ARG(DataParallelOptions, data_parallel) = {};
  /// Timeout of every collective and store operation, in milliseconds.
  TORCH_ARG(int64_t, timeout_ms) = 60'000;
  /// Intra-op threads per rank (torchrun's OMP_NUM_THREADS default is 1).
  TORCH_ARG(int64_t, threads_per_rank) = 1;
  /// Fault injection, for tests and demos: this rank fails (-1: none).
  TORCH_ARG(int64_t, fail_rank) = -1;
  /// How it fails: "kill" (SIGKILL to itself in step fail_step's backward),
  /// "throw" (an exception in that step), or "model" (its weights differ
  /// from the others' before training).
  TORCH_ARG(std::string, fail_mode) = "kill";
  /// The step (from 0) in which "kill" and "throw" happen.
  TORCH_ARG(int64_t, fail_step) = 0;
};

/// Whether this trainmem can run ranks on CUDA over NCCL: built against a
/// CUDA LibTorch whose c10d has ProcessGroupNCCL (USE_C10D_NCCL, nccl.h
/// found), with Gloo for the ranks' CPU tensors. False on a CPU LibTorch.
bool nccl_available();

/// CUDA devices this process would see, asked in a forked child so that this
/// process never initialises CUDA (after which ranks forked from it could
/// not use CUDA); 0 on a CPU LibTorch or without a GPU.
int64_t cuda_device_count_before_fork();

/// Throws c10::Error naming the first bad value of `options` (nproc < 1, a
/// batch that does not split into nproc shards, unsupported trainer options,
/// device cuda without NCCL). It does not touch CUDA.
void check_distributed_trainer_options(const DistributedTrainerOptions& options);

/// A finished multi-rank run, as rank 0 saw it.
struct DistributedRun {
  DistributedReport report;       ///< every rank's audit
  /// With trainer().keep_grads(): rank 0's gradients of the first step after
  /// the all-reduce (fp32, CPU), in parameters() order.
  std::vector<at::Tensor> grads;
  std::vector<double> losses;     ///< rank 0's loss of each step (its shard)
};

/// Starts the ranks, waits for them and returns rank 0's report. Throws
/// c10::Error naming the rank when one throws (with its message), exits
/// early or is killed (with the signal), or when the model differs across
/// ranks (each disagreement). Call it from a process that has not yet run
/// parallel ATen work (it forks; OpenMP does not survive fork).
DistributedRun train_distributed(const DistributedTrainerOptions& options);

} // namespace trainmem
