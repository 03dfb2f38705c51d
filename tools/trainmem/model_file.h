#pragma once
// `--model FILE`: a Hugging Face style config.json for `trainmem estimate`
// (hf_model.h builds it on the meta device; nothing is run or downloaded).

#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "trainmem/cuda_predict.h"
#include "trainmem/models/estimate.h"

namespace trainmem::cli {

struct LoraFlags {
  int64_t rank = 0;     ///< --lora-rank: 0 for no LoRA
  double alpha = 8.0;   ///< --lora-alpha (PEFT's default)
  std::string targets;  ///< --lora-targets: comma-separated layer names
};

/// Adds --lora-rank, --lora-alpha and --lora-targets to `sub`.
void add_lora_flags(CLI::App& sub, LoraFlags& flags);

/// estimate_model()'s options for a micro-batch, a --precision (any of the
/// five: estimate and plan honour them all) and the LoRA flags. Throws
/// UsageError naming a bad value.
ModelEstimateOptions model_options(int64_t batch, int64_t seq_len, const std::string& precision,
                                   const LoraFlags& lora);

struct ModelFileFlags {
  std::string path;   ///< --model: the config.json
  int64_t ranks = 1;  ///< --ranks: data-parallel ranks
  int64_t zero = 0;   ///< --zero: ZeRO stage 0-3
  std::string checkpoint = "none";  ///< --checkpoint: BlockCheckpointing::named()
  LoraFlags lora;                   ///< --lora-*
};

/// Adds --model, --ranks, --zero, --checkpoint and the --lora-* flags to `sub`.
void add_model_file_flags(CLI::App& sub, ModelFileFlags& flags);

/// `trainmem estimate --model FILE`: what estimate_model() (models/estimate.h)
/// returns for the flags (precision, checkpointing, LoRA, ranks and ZeRO;
/// with `cuda`, the step's predicted CUDA max_memory_allocated / reserved on
/// `device`), with every assumption printed. Throws UsageError (exit 2)
/// naming the key and value of a bad config or flag.
void run_estimate_model(const ModelFileFlags& flags, int64_t batch, int64_t seq_len, bool json,
                        const CudaPredictOptions* cuda = nullptr, const std::string& device = "cpu",
                        const std::string& precision = "fp32");

/// `trainmem plan --model FILE --budget B`: the model's checkpoint plan for an
/// AdamW step of `options`' micro-batch, precision (fp32, bf16 autocast, bf16)
/// and LoRA, planned on meta
/// (plan_regions() on hf_region_model()). With `run`, the model is also
/// built on CPU and one step run under the plan, measured beside the
/// prediction (a small config only: it needs the memory it plans for).
/// With `cuda` (not null), the budget is on the predicted CUDA peak of
/// `kind` (plan_regions_cuda(); `device` is printed); nothing runs.
/// Throws UsageError (exit 2) for a bad config or flag, CheckFailed (exit 3)
/// when no plan fits.
void run_plan_model(const std::string& path, int64_t budget, const ModelEstimateOptions& options, bool selective,
                    bool run, bool json, const CudaPredictOptions* cuda = nullptr,
                    CudaBudgetKind kind = CudaBudgetKind::kAllocated, const std::string& device = "cpu");

/// What a plan for a CUDA budget adds to `plan`'s output, with the bundled
/// model or a model file: the plan, its predicted CUDA step and the planner's
/// last budget (text); the `cuda` object of `--json`; and CheckFailed (exit 3)
/// naming the last plan's peaks when none fits.
std::string cuda_plan_text(const CudaCheckpointPlan& r);
nlohmann::ordered_json cuda_plan_json(const CudaCheckpointPlan& r);
// A plan as the `plan` documents hold it (docs/cli.md): the one writer of
// `trainmem plan --json` and `trainmem plan --model FILE --json`.
nlohmann::ordered_json plan_json(const CheckpointPlan& plan);
void check_cuda_plan_fits(const CudaCheckpointPlan& r);
// A step peak as the estimate documents hold it (`step_peak` of `trainmem
// estimate --json` and `trainmem estimate --model FILE --json`).
nlohmann::ordered_json step_peak_json(const StepPeak& peak, bool phases_split, const std::string& optimizer);

} // namespace trainmem::cli
