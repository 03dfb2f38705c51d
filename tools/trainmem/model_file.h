#pragma once
// `--model FILE`: a Hugging Face style config.json for `trainmem estimate`
// (hf_model.h builds it on the meta device; nothing is run or downloaded).

#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

namespace trainmem::cli {

struct ModelFileFlags {
  std::string path;   ///< --model: the config.json
  int64_t ranks = 1;  ///< --ranks: data-parallel ranks
  int64_t zero = 0;   ///< --zero: ZeRO stage 0-3
};

/// Adds --model, --ranks and --zero to `sub`.
void add_model_file_flags(CLI::App& sub, ModelFileFlags& flags);

/// `trainmem estimate --model FILE`: parameters, static bytes per precision
/// recipe and per rank (ZeRO), activation bytes of a (batch, seq_len)
/// micro-batch (exact on meta, fp32) and the fp32 AdamW step peak. Throws
/// UsageError (exit 2) naming the key and value of a bad config or flag.
void run_estimate_model(const ModelFileFlags& flags, int64_t batch, int64_t seq_len, bool json);

} // namespace trainmem::cli
