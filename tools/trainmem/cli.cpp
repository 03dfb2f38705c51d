#include "cli.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>

#include <unistd.h>

namespace trainmem::cli {

void add_model_flags(CLI::App& app, ModelFlags& f) {
  app.add_option("--layers", f.layers, "transformer blocks")->capture_default_str();
  app.add_option("--d-model", f.d_model, "model width")->capture_default_str();
  app.add_option("--heads", f.heads, "attention heads (must divide --d-model)")->capture_default_str();
  app.add_option("--batch", f.batch, "sequences per step")->capture_default_str();
  app.add_option("--seq-len", f.seq_len, "tokens per sequence")->capture_default_str();
}

void check_model_flags(const ModelFlags& f) {
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) {
      throw UsageError(std::string("expected ") + name + " > 0, but got " + std::to_string(v));
    }
  };
  positive("--layers", f.layers);
  positive("--d-model", f.d_model);
  positive("--heads", f.heads);
  positive("--batch", f.batch);
  positive("--seq-len", f.seq_len);
  if (f.d_model % f.heads != 0) {
    throw UsageError("expected --d-model divisible by --heads, but got --d-model " + std::to_string(f.d_model) +
                     " and --heads " + std::to_string(f.heads));
  }
}

int64_t parse_bytes(const std::string& text) {
  static const std::regex re(R"(\s*([0-9]+(\.[0-9]+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB|)\s*)");
  std::smatch m;
  if (!std::regex_match(text, m, re)) {
    throw UsageError("expected a size such as 40MiB, 1.5GB or 4096, but got \"" + text + "\"");
  }
  const double value = std::stod(m[1].str());
  const std::string unit = m[3].str();
  double scale = 1;
  if (unit == "KB") scale = 1e3;
  if (unit == "MB") scale = 1e6;
  if (unit == "GB") scale = 1e9;
  if (unit == "TB") scale = 1e12;
  if (unit == "KiB") scale = 1024.0;
  if (unit == "MiB") scale = 1024.0 * 1024;
  if (unit == "GiB") scale = 1024.0 * 1024 * 1024;
  if (unit == "TiB") scale = 1024.0 * 1024 * 1024 * 1024;
  const double bytes = std::round(value * scale);
  if (bytes <= 0 || bytes > 9.0e18) {
    throw UsageError("expected a size between 1 B and 8 EiB, but got \"" + text + "\"");
  }
  return static_cast<int64_t>(bytes);
}

void check_writable(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  if (path.empty()) {
    throw UsageError("expected an output file name, but got an empty one");
  }
  std::error_code ec;
  if (fs::is_directory(p, ec)) {
    throw UsageError("cannot write \"" + path + "\": it is a directory");
  }
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (!fs::is_directory(dir, ec)) {
    throw UsageError("cannot write \"" + path + "\": directory \"" + dir.string() + "\" does not exist");
  }
  if (::access(dir.c_str(), W_OK) != 0) {
    throw UsageError("cannot write \"" + path + "\": directory \"" + dir.string() + "\" is not writable");
  }
}

bool show_progress() {
  return ::isatty(STDERR_FILENO) == 1;
}

void write_file_atomically(const std::string& path, const std::string& contents) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  const fs::path tmp = dir / ("." + p.filename().string() + ".tmp." + std::to_string(::getpid()));
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    out.close();
    if (!out) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw std::runtime_error("cannot write \"" + path + "\": writing the temporary file failed");
    }
  }
  std::error_code ec;
  fs::rename(tmp, p, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw std::runtime_error("cannot write \"" + path + "\": " + ec.message());
  }
}

} // namespace trainmem::cli
