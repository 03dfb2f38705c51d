#pragma once
// Shared pieces of the `trainmem` command: error types that carry exit codes,
// the model flags every subcommand takes, and atomic file output.
//
// Exit codes (docs/cli.md): 0 ok, 1 runtime error, 2 usage error (the message
// names the bad value), 3 a check failed (a budget that cannot be met).

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>

#include <ATen/core/Tensor.h>
#include <CLI/CLI.hpp>
#include <c10/core/DeviceType.h>

#include "trainmem/cuda_predict.h"

namespace trainmem::cli {

/// A check the user asked for failed (exit status 3).
struct CheckFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Bad flags or values, found after CLI11's own parsing (exit status 2).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Shape of the bundled transformer; defaults are the reference transformer's
/// (6 pre-LN blocks, d_model 128, 4 heads, batch 16 x 64 tokens).
struct ModelFlags {
  int64_t layers = 6;
  int64_t d_model = 128;
  int64_t heads = 4;
  int64_t batch = 16;
  int64_t seq_len = 64;
};

/// Upper bounds of the model flags (kMax...): far above any model this
/// command can run, low enough that every figure it prints fits int64.
inline constexpr int64_t kMaxLayers = 10000;
inline constexpr int64_t kMaxDModel = 1 << 16;
inline constexpr int64_t kMaxHeads = 1 << 12;
inline constexpr int64_t kMaxBatch = 1 << 20;
inline constexpr int64_t kMaxSeqLen = 1 << 20;

/// Adds --layers, --d-model, --heads, --batch, --seq-len to `app`, each
/// checked by int_in() against its kMax bound.
void add_model_flags(CLI::App& app, ModelFlags& flags);

/// Throws UsageError naming the bad value when the shape is impossible
/// (sizes outside [1, kMax...], d_model not divisible by heads, or a model
/// whose parameter or activation bytes would not fit in 64 bits).
void check_model_flags(const ModelFlags& flags);

/// CLI11 validator: a whole number in [lo, hi] written in full (no wrap-around
/// of "99999999999999999999", no "1.5", no "12abc").
CLI::Validator int_in(int64_t lo, int64_t hi);

/// CLI11 validator: a finite number > 0 (rejects inf, nan, 0, -1e-3).
CLI::Validator positive_finite();

/// CLI11 validator for output file flags: a non-empty path ("-" is stdout).
CLI::Validator output_path();

/// Throws UsageError unless `device` is "cpu" or "cuda[:index]" (c10 accepts
/// "cpu:1", which names no CPU).
void check_device(const std::string& device);

/// Adds `--gpu NAME` (cuda_predict.h's known_cuda_gpus()) to `sub`.
void add_gpu_flag(CLI::App& sub, std::string& gpu);

/// The device a command predicts for: `device`, or "cuda" where `gpu` names
/// a GPU and --device was not given. Throws UsageError for --device cpu
/// with --gpu.
std::string device_for_gpu(const std::string& device, bool device_given, const std::string& gpu);

/// CUDA prediction options: the allocator settings `alloc_conf`
/// (PYTORCH_CUDA_ALLOC_CONF), the GPU `gpu` ("" for none: compute
/// capability 8.0 and LibTorch 2.6's workspaces, CudaPredictOptions'
/// defaults) and a cuBLAS workspace that overrides the GPU's. Throws
/// UsageError naming a bad value.
CudaPredictOptions cuda_options(const std::string& alloc_conf, const std::string& gpu,
                                std::optional<int64_t> cublas_workspace);

/// "the H100, compute capability 9.0" or "a GPU not named (--gpu), compute
/// capability 8.0": the GPU `o` predicts for, in words.
std::string gpu_words(const CudaPredictOptions& o);

/// Parses "40MiB", "1.5GB", "4096", "512 KiB" into bytes. Throws UsageError
/// naming `text` when it is not a size.
int64_t parse_bytes(const std::string& text);

/// An output file, opened before the work that fills it so a long run never
/// ends in a report that cannot be written, and written in one step at the end.
///
/// - "-" is stdout.
/// - A device, FIFO or terminal (/dev/stdout, /dev/null) is opened now and
///   written in place, never replaced by a regular file.
/// - Anything else is a regular file: a fresh temporary file is created now
///   beside it (mkostemp: O_CREAT|O_EXCL, so a planted symlink is never
///   followed), written, fsync'd and renamed over `path`. A failed run leaves
///   `path` as it was. If `path` is a symbolic link, the link is replaced, not
///   the file it points to.
///
/// The constructor throws UsageError naming the path and the system's reason
/// (errno) when the file cannot be opened; commit() throws std::runtime_error
/// likewise. The destructor removes an uncommitted temporary file and never
/// throws.
class OutputFile {
 public:
  explicit OutputFile(std::string path);
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  /// Writes `contents` (all of it) and, for a regular file, renames it into place.
  void commit(const std::string& contents);
  const std::string& path() const { return path_; }
  bool is_stdout() const { return path_ == "-"; }

 private:
  std::string path_;
  std::string tmp_;  // temporary file beside path_, or empty
  int fd_ = -1;
  bool committed_ = false;
};

/// Fails with UsageError before any work when `path` cannot be written (opens
/// and removes the temporary file OutputFile would use, with the errno reason).
void check_writable(const std::string& path);

/// OutputFile(path).commit(contents): a temporary file and a rename, so a
/// failed run never leaves a truncated file behind. Throws std::runtime_error
/// (UsageError when it cannot be opened) naming the path.
void write_file_atomically(const std::string& path, const std::string& contents);

/// Memory this process may still use, in bytes: the smaller of
/// /proc/meminfo's MemAvailable and the cgroup's limit less its usage.
/// std::nullopt when neither can be read.
std::optional<int64_t> available_memory_bytes();

/// Reads at most `max_bytes` of `path`; throws UsageError naming the path
/// when it cannot be read or is larger (`trainmem report /dev/zero`).
std::string read_file_bounded(const std::string& path, int64_t max_bytes);

/// True when progress lines may go to stderr (it is a terminal).
bool show_progress();

/// Registers `trainmem audit`, `estimate` and `report` (commands.cpp).
void add_audit_command(CLI::App& app);
void add_estimate_command(CLI::App& app);
void add_report_command(CLI::App& app);

/// Registers `trainmem plan` (tools/trainmem/plan.cpp).
void add_plan_command(CLI::App& app);

/// `trainmem snapshot FILE`: replay a recorded CUDA memory snapshot (snapshot.cpp).
void add_snapshot_command(CLI::App& app);


} // namespace trainmem::cli
