#include "cli.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <regex>

#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace trainmem::cli {
namespace {

std::string in_quotes(const std::string& s) {
  return "\"" + s + "\"";
}

std::string errno_text(int err) {
  return std::strerror(err);
}

// Parses all of `text` as a base-10 int64; false on junk, overflow or "".
bool parse_int64(const std::string& text, int64_t& out) {
  if (text.empty()) {
    return false;
  }
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno == ERANGE || end != text.c_str() + text.size()) {
    return false;
  }
  out = v;
  return true;
}

} // namespace

CLI::Validator int_in(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& input) -> std::string {
        int64_t v = 0;
        if (!parse_int64(input, v) || v < lo || v > hi) {
          return "expected a whole number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], but got " +
                 in_quotes(input);
        }
        return {};
      },
      "INT in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

CLI::Validator positive_finite() {
  return CLI::Validator(
      [](std::string& input) -> std::string {
        errno = 0;
        char* end = nullptr;
        const double v = std::strtod(input.c_str(), &end);
        if (input.empty() || end != input.c_str() + input.size() || errno == ERANGE || !std::isfinite(v) || v <= 0) {
          return "expected a finite number > 0, but got " + in_quotes(input);
        }
        return {};
      },
      "POSITIVE");
}

CLI::Validator output_path() {
  return CLI::Validator(
      [](std::string& input) -> std::string {
        if (input.empty()) {
          return "expected an output file name (or - for stdout), but got an empty one";
        }
        return {};
      },
      "FILE");
}

void add_model_flags(CLI::App& app, ModelFlags& f) {
  app.add_option("--layers", f.layers, "transformer blocks")->check(int_in(1, kMaxLayers))->capture_default_str();
  app.add_option("--d-model", f.d_model, "model width")->check(int_in(1, kMaxDModel))->capture_default_str();
  app.add_option("--heads", f.heads, "attention heads (must divide --d-model)")
      ->check(int_in(1, kMaxHeads))
      ->capture_default_str();
  app.add_option("--batch", f.batch, "sequences per step")->check(int_in(1, kMaxBatch))->capture_default_str();
  app.add_option("--seq-len", f.seq_len, "tokens per sequence")->check(int_in(1, kMaxSeqLen))->capture_default_str();
}

void check_model_flags(const ModelFlags& f) {
  auto in_range = [](const char* name, int64_t v, int64_t hi) {
    if (v < 1 || v > hi) {
      throw UsageError(std::string("expected ") + name + " in [1, " + std::to_string(hi) + "], but got " +
                       std::to_string(v));
    }
  };
  in_range("--layers", f.layers, kMaxLayers);
  in_range("--d-model", f.d_model, kMaxDModel);
  in_range("--heads", f.heads, kMaxHeads);
  in_range("--batch", f.batch, kMaxBatch);
  in_range("--seq-len", f.seq_len, kMaxSeqLen);
  if (f.d_model % f.heads != 0) {
    throw UsageError("expected --d-model divisible by --heads, but got --d-model " + std::to_string(f.d_model) +
                     " and --heads " + std::to_string(f.heads));
  }
  // Every figure printed is an int64 of bytes: 16 B per parameter (weights,
  // gradients, two Adam moments) plus activations (64 T B d per layer, and
  // attention's B H T^2 per layer at 8 B, a generous bound) must fit with room.
  const long double L = f.layers, d = f.d_model, H = f.heads, B = f.batch, T = f.seq_len;
  const long double bytes = 16 * L * (12 * d * d + 13 * d) + 64 * T * B * d * L + 8 * B * H * T * T * L;
  constexpr long double kLimit = 4.0L * (1LL << 60);  // 4 EiB
  if (bytes > kLimit) {
    throw UsageError("expected a model whose bytes fit in 64 bits, but --layers " + std::to_string(f.layers) +
                     " --d-model " + std::to_string(f.d_model) + " --heads " + std::to_string(f.heads) +
                     " --batch " + std::to_string(f.batch) + " --seq-len " + std::to_string(f.seq_len) +
                     " needs more than 4 EiB");
  }
}

void check_device(const std::string& device) {
  static const std::regex re(R"(cpu|cuda(:[0-9]{1,3})?)");
  if (!std::regex_match(device, re)) {
    throw UsageError("expected --device cpu or cuda[:index], but got " + in_quotes(device));
  }
}

void add_gpu_flag(CLI::App& sub, std::string& gpu) {
  std::string names;
  for (const auto& g : known_cuda_gpus()) {
    names += (names.empty() ? "" : ", ") + g.name;
  }
  sub.add_option("--gpu", gpu,
                 "the GPU to predict for (implies --device cuda): its attention backend and cuBLAS workspace as "
                 "the installed LibTorch picks them; one of " + names);
}

std::string device_for_gpu(const std::string& device, bool device_given, const std::string& gpu) {
  if (gpu.empty()) {
    return device;
  }
  if (device_given && device == "cpu") {
    throw UsageError("--gpu " + gpu + " with --device cpu: a GPU is predicted on --device cuda (or drop --device)");
  }
  return device_given ? device : "cuda";
}

CudaPredictOptions cuda_options(const std::string& alloc_conf, const std::string& gpu,
                                std::optional<int64_t> cublas_workspace) {
  CudaPredictOptions o;
  if (!gpu.empty()) {
    try {
      o = cuda_options_for(cuda_gpu(gpu));
    } catch (const c10::Error& e) {
      throw UsageError("--gpu: " + std::string(e.what_without_backtrace()));
    }
  }
  try {
    o.allocator(CudaAllocatorConfig::parse(alloc_conf));
  } catch (const c10::Error& e) {
    throw UsageError("--alloc-conf: " + std::string(e.what_without_backtrace()));
  }
  if (cublas_workspace) {
    if (*cublas_workspace < 0) {
      throw UsageError(fmt::format("--cublas-workspace {}: expected bytes >= 0", *cublas_workspace));
    }
    o.cublas_workspace_bytes(*cublas_workspace);
  }
  return o;
}

std::string gpu_words(const CudaPredictOptions& o) {
  return fmt::format("{}, compute capability {}.{}",
                     o.gpu_name().empty() ? std::string("a GPU not named (--gpu)") : "the " + o.gpu_name(),
                     o.compute_capability() / 10, o.compute_capability() % 10);
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
  if (!std::isfinite(bytes) || bytes <= 0 || bytes > 9.0e18) {
    throw UsageError("expected a size between 1 B and 8 EiB, but got \"" + text + "\"");
  }
  return static_cast<int64_t>(bytes);
}

bool show_progress() {
  return ::isatty(STDERR_FILENO) == 1;
}

// ---- output files -------------------------------------------------------------

OutputFile::OutputFile(std::string path) : path_(std::move(path)) {
  namespace fs = std::filesystem;
  if (path_.empty()) {
    throw UsageError("expected an output file name (or - for stdout), but got an empty one");
  }
  if (is_stdout()) {
    return;
  }
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0) {  // follows links: what would be written
    if (S_ISDIR(st.st_mode)) {
      throw UsageError("cannot write " + in_quotes(path_) + ": it is a directory");
    }
    if (!S_ISREG(st.st_mode)) {
      // A device, FIFO or socket: write in place; a rename would replace it.
      fd_ = ::open(path_.c_str(), O_WRONLY | O_NOCTTY | O_CLOEXEC);
      if (fd_ < 0) {
        throw UsageError("cannot write " + in_quotes(path_) + ": " + errno_text(errno));
      }
      return;
    }
  }
  const fs::path p(path_);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  std::string tmpl = (dir / ("." + p.filename().string() + ".tmp.XXXXXX")).string();
  fd_ = ::mkostemp(tmpl.data(), O_CLOEXEC);
  if (fd_ < 0) {
    const int err = errno;
    std::error_code ec;
    if (err == ENOENT && !fs::is_directory(dir, ec)) {
      throw UsageError("cannot write " + in_quotes(path_) + ": directory " + in_quotes(dir.string()) + " does not exist");
    }
    throw UsageError("cannot write " + in_quotes(path_) + ": cannot create a file in " + in_quotes(dir.string()) + ": " +
                     errno_text(err));
  }
  tmp_ = tmpl;
  // mkostemp makes 0600; a report is as readable as any file the user makes.
  const mode_t mask = ::umask(0);
  ::umask(mask);
  (void)::fchmod(fd_, 0666 & ~mask);
}

OutputFile::~OutputFile() {
  if (fd_ >= 0) {
    ::close(fd_);
  }
  if (!tmp_.empty() && !committed_) {
    ::unlink(tmp_.c_str());
  }
}

void OutputFile::commit(const std::string& contents) {
  if (committed_) {
    throw std::runtime_error("cannot write " + in_quotes(path_) + ": already written");
  }
  committed_ = true;
  if (is_stdout()) {
    std::cout.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    std::cout.flush();
    if (!std::cout) {
      throw std::runtime_error("cannot write to stdout");
    }
    return;
  }
  auto fail = [&](const std::string& what, int err) {
    if (!tmp_.empty()) {
      ::unlink(tmp_.c_str());
    }
    throw std::runtime_error("cannot write " + in_quotes(path_) + ": " + what + errno_text(err));
  };
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd_, contents.data() + done, contents.size() - done);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      fail("", errno);
    }
    done += static_cast<size_t>(n);
  }
  if (tmp_.empty()) {
    return;  // a device or FIFO: written in place
  }
  if (::fsync(fd_) != 0) {
    fail("", errno);
  }
  const int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) {
    fail("", errno);
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    fail("", errno);
  }
  tmp_.clear();
}

void check_writable(const std::string& path) {
  OutputFile probe(path);  // removed again when it goes out of scope
}

void write_file_atomically(const std::string& path, const std::string& contents) {
  OutputFile(path).commit(contents);
}

// ---- resources ------------------------------------------------------------------

namespace {

std::optional<int64_t> read_int_file(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text)) {
    return std::nullopt;
  }
  int64_t v = 0;
  return parse_int64(text, v) ? std::optional<int64_t>(v) : std::nullopt;  // "max" -> none
}

} // namespace

std::optional<int64_t> available_memory_bytes() {
  std::optional<int64_t> best;
  auto take = [&](int64_t v) { best = best ? std::min(*best, v) : v; };
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") {
      take(kib * 1024);
      break;
    }
  }
  // cgroup v2, then v1: a container's limit is below the machine's memory.
  const auto max2 = read_int_file("/sys/fs/cgroup/memory.max");
  const auto cur2 = read_int_file("/sys/fs/cgroup/memory.current");
  if (max2 && cur2) {
    take(std::max<int64_t>(0, *max2 - *cur2));
  }
  const auto max1 = read_int_file("/sys/fs/cgroup/memory/memory.limit_in_bytes");
  const auto cur1 = read_int_file("/sys/fs/cgroup/memory/memory.usage_in_bytes");
  if (max1 && cur1 && *max1 < (int64_t{1} << 60)) {
    take(std::max<int64_t>(0, *max1 - *cur1));
  }
  return best;
}

std::string read_file_bounded(const std::string& path, int64_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw UsageError("cannot read " + in_quotes(path) + ": " + errno_text(errno));
  }
  std::string out;
  std::string chunk(1 << 16, '\0');
  while (in) {
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    out.append(chunk.data(), static_cast<size_t>(in.gcount()));
    if (static_cast<int64_t>(out.size()) > max_bytes) {
      throw UsageError(in_quotes(path) + " is larger than " + std::to_string(max_bytes) +
                       " B: it is not a trainmem report");
    }
  }
  if (in.bad()) {
    throw UsageError("cannot read " + in_quotes(path) + ": " + errno_text(errno));
  }
  return out;
}

} // namespace trainmem::cli
