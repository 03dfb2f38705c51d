#pragma once
// Shared pieces of the `trainmem` command: error types that carry exit codes,
// the model flags every subcommand takes, and atomic file output.
//
// Exit codes (docs/cli.md): 0 ok, 1 runtime error, 2 usage error (the message
// names the bad value), 3 a check failed (a budget that cannot be met).

#include <cstdint>
#include <stdexcept>
#include <string>

#include <CLI/CLI.hpp>

namespace trainmem::cli {

/// A check the user asked for failed (exit status 3).
struct CheckFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Bad flags or values, found after CLI11's own parsing (exit status 2).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Shape of the bundled transformer; defaults are the seed's capstone.
struct ModelFlags {
  int64_t layers = 6;
  int64_t d_model = 128;
  int64_t heads = 4;
  int64_t batch = 16;
  int64_t seq_len = 64;
};

/// Adds --layers, --d-model, --heads, --batch, --seq-len to `app`.
void add_model_flags(CLI::App& app, ModelFlags& flags);

/// Throws UsageError naming the bad value when the shape is impossible
/// (non-positive sizes, d_model not divisible by heads).
void check_model_flags(const ModelFlags& flags);

/// Parses "40MiB", "1.5GB", "4096", "512 KiB" into bytes. Throws UsageError
/// naming `text` when it is not a size.
int64_t parse_bytes(const std::string& text);

/// Fails with UsageError before any work when `path`'s directory does not
/// exist or is not writable, so a long run never ends in a lost report.
void check_writable(const std::string& path);

/// Writes `contents` to `path` through a temporary file in the same directory
/// and a rename, so a failed run never leaves a truncated file behind. Throws
/// std::runtime_error naming the path on failure.
void write_file_atomically(const std::string& path, const std::string& contents);

/// True when progress lines may go to stderr (it is a terminal).
bool show_progress();

/// Registers `trainmem audit`, `estimate` and `report` (commands.cpp).
void add_audit_command(CLI::App& app);
void add_estimate_command(CLI::App& app);
void add_report_command(CLI::App& app);

/// Registers `trainmem plan` (tools/trainmem/plan.cpp).
void add_plan_command(CLI::App& app);

} // namespace trainmem::cli
