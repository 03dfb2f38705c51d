// trainmem_compare: the C++ half of the side-by-side comparison with
// PyTorch's Python tools (bench/compare/compare.py drives both halves).
//
// The model is the capstone, the demo's reference transformer (trainmem/models/transformer.h; 6 pre-LN blocks,
// d 128, 4 heads, input (16, 64, 128), loss out.pow(2).mean(), AdamW 1e-3),
// built from seed 0. Two modes, one JSON document on stdout each:
//
//   --check DIR   one step per variant: saved bytes (meter, SAC cache and
//                 offload counters) and gradients. Writes DIR/manifest.json,
//                 the initial parameters and input (params.bin, input.bin)
//                 and each variant's gradients (grads_<variant>.bin) as raw
//                 little-endian fp32, so torch_side.py runs the very same
//                 weights and compares gradients element by element.
//   --time        step times per variant, the variants interleaved step by
//                 step (so load drifts hit them alike). --track-allocator
//                 installs the counting CPU allocator first.
//
// Times are reported, never asserted.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>
#include <torch/version.h>

#include "app/variants.h"
#include "trainmem/allocator.h"
#include "trainmem/meter.h"
#include "trainmem/offload.h"
#include "trainmem/optimizer_in_backward.h"
#include "trainmem/selective.h"
#include "trainmem/models/transformer.h"

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

struct Args {
  std::string check_dir;
  bool time = false;
  bool track_allocator = false;
  int64_t steps = 10;
  int64_t warmup = 2;
  int64_t num_layers = 6;
  int64_t seq_len = 64;
  std::vector<std::string> variants;
};

const std::vector<std::string> kCheckVariants = {
    "plain", "full", "every_2", "selective", "optimizer_in_backward", "save_on_cpu"};
const std::vector<std::string> kTimeVariants = {
    "plain", "meter", "full", "every_2", "selective", "optimizer_in_backward",
    "save_on_cpu", "save_on_cpu_copies"};

int usage(const std::string& why) {
  std::fprintf(stderr,
               "trainmem_compare: %s\n"
               "usage: trainmem_compare (--check DIR | --time) [--steps N] [--warmup N]\n"
               "         [--layers L] [--seq-len T] [--variants a,b,...] [--track-allocator]\n",
               why.c_str());
  return 2;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    const size_t end = comma == std::string::npos ? s.size() : comma;
    if (end > start) {
      out.push_back(s.substr(start, end - start));
    }
    start = end + 1;
  }
  return out;
}

// The capstone's batch; the sequence length is --seq-len.
constexpr int64_t kBatch = 16;

trainmem::TransformerOptions options_of(const Args& a) {
  return trainmem::TransformerOptions().num_layers(a.num_layers);
}

trainmem::BlockCheckpointing plan_of(const std::string& variant, int64_t L) {
  if (variant == "full") return trainmem::BlockCheckpointing::full(L);
  if (variant == "every_2") return trainmem::BlockCheckpointing::every(L, 2);
  if (variant == "selective") {
    return trainmem::BlockCheckpointing::selective(L, trainmem::save_matmuls_policy());
  }
  return trainmem::BlockCheckpointing::none(L);
}

trainmem::Transformer clone_of(const trainmem::Transformer& model) {
  return trainmem::Transformer(
      std::dynamic_pointer_cast<trainmem::TransformerImpl>(model->clone()));
}

std::unique_ptr<torch::optim::Optimizer> adamw(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::AdamW>(std::move(params), torch::optim::AdamWOptions(1e-3));
}

// ---- raw fp32 files --------------------------------------------------------

int64_t write_floats(std::ofstream& out, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "trainmem_compare: expected fp32, but got ",
              t.scalar_type());
  const auto c = t.detach().contiguous();
  out.write(reinterpret_cast<const char*>(c.data_ptr<float>()),
            static_cast<std::streamsize>(c.numel() * sizeof(float)));
  return c.numel();
}

// Writes tensors back to back; returns each one's {offset, numel} in floats.
json write_tensors(const fs::path& file, const std::vector<at::Tensor>& ts) {
  std::ofstream out(file, std::ios::binary);
  TORCH_CHECK(out, "trainmem_compare: cannot write ", file.string());
  json layout = json::array();
  int64_t offset = 0;
  for (const auto& t : ts) {
    const int64_t n = write_floats(out, t);
    layout.push_back({{"offset", offset}, {"numel", n}});
    offset += n;
  }
  TORCH_CHECK(out.good(), "trainmem_compare: write failed for ", file.string());
  return layout;
}

// ---- check mode ------------------------------------------------------------

json by_node_json(const trainmem::SavedTensorReport& r) {
  json out = json::object();
  for (const auto& n : r.by_node) {
    out[n.node] = n.bytes;
  }
  return out;
}

int run_check(const Args& a) {
  const fs::path dir(a.check_dir);
  fs::create_directories(dir);
  const auto o = options_of(a);
  torch::manual_seed(0);
  trainmem::Transformer base(o);
  const auto x = torch::randn({kBatch, a.seq_len, o.d_model()});

  json manifest;
  manifest["schema"] = "trainmem-compare/1";
  manifest["dtype"] = "float32";
  manifest["byte_order"] = "little";
  manifest["options"] = {{"num_layers", o.num_layers()}, {"d_model", o.d_model()},
                         {"num_heads", o.num_heads()}, {"batch", kBatch},
                         {"seq_len", a.seq_len}};
  std::vector<at::Tensor> params;
  json names = json::array(), shapes = json::array();
  for (const auto& item : base->named_parameters()) {
    names.push_back(item.key());
    shapes.push_back(item.value().sizes().vec());
    params.push_back(item.value());
  }
  auto layout = write_tensors(dir / "params.bin", params);
  json entries = json::array();
  for (size_t i = 0; i < params.size(); ++i) {
    entries.push_back({{"name", names[i]}, {"shape", shapes[i]},
                       {"offset", layout[i]["offset"]}, {"numel", layout[i]["numel"]}});
  }
  manifest["params"] = entries;
  write_tensors(dir / "input.bin", {x});
  manifest["input"] = {{"file", "input.bin"}, {"shape", x.sizes().vec()}};

  json variants = json::object();
  for (const auto& v : kCheckVariants) {
    auto model = clone_of(base);
    json entry;
    std::vector<at::Tensor> result;  // gradients, or parameters after the step
    if (v == "optimizer_in_backward") {
      // One step with AdamW stepped per parameter in backward; the gradients
      // are gone afterwards, so the parameters after the step are compared.
      trainmem::OptimizerInBackward oib(model->parameters(), adamw);
      trainmem::SavedTensorMeter meter(*model);
      at::Tensor loss;
      {
        trainmem::SavedTensorMeterGuard scope(meter);
        loss = model->forward(x).pow(2).mean();
      }
      loss.backward();
      entry["saved_bytes"] = meter.report().saved_bytes;
      entry["compares"] = "parameters after one step";
      for (const auto& p : model->parameters()) {
        result.push_back(p.detach().clone());
      }
    } else if (v == "save_on_cpu") {
      // On a CPU-only machine the guard keeps CPU tensors in place; copies are
      // forced here so the copy path (and its storage dedup) is what runs.
      at::Tensor loss;
      trainmem::OffloadStats stats;
      {
        trainmem::SaveOnCpuGuard offload(*model, trainmem::SaveOnCpuOptions().copy_cpu_tensors(true));
        loss = model->forward(x).pow(2).mean();
        stats = offload.stats();
      }
      loss.backward();
      entry["saved_bytes"] = stats.offloaded_bytes;
      entry["num_packed"] = stats.num_packed;
      entry["num_storage_copies"] = stats.num_storage_copies;
      entry["compares"] = "gradients";
      for (const auto& p : model->parameters()) {
        result.push_back(p.grad().clone());
      }
    } else {
      auto run = trainmem::run_variant(model, x, plan_of(v, o.num_layers()));
      entry["saved_bytes"] = run.saved.saved_bytes;
      entry["num_storages"] = run.saved.num_storages;
      entry["by_node"] = by_node_json(run.saved);
      entry["compares"] = "gradients";
      result = run.grads;
    }
    const std::string file = "result_" + v + ".bin";
    write_tensors(dir / file, result);
    entry["file"] = file;
    variants[v] = entry;
  }
  manifest["variants"] = variants;
  manifest["num_threads"] = at::get_num_threads();
  manifest["torch_version"] = TORCH_VERSION;
  std::ofstream(dir / "manifest.json") << manifest.dump(1) << "\n";
  std::cout << manifest.dump() << "\n";
  return 0;
}

// ---- time mode -------------------------------------------------------------

// One variant's own model, optimizer and step.
struct Runner {
  std::string name;
  trainmem::Transformer model;
  std::unique_ptr<torch::optim::AdamW> opt;
  std::unique_ptr<trainmem::OptimizerInBackward> oib;
  std::unique_ptr<trainmem::SavedTensorMeter> meter;
  trainmem::BlockCheckpointing plan;
  std::optional<trainmem::SaveOnCpuOptions> offload;
  std::vector<double> ms;

  void step(const at::Tensor& x) {
    if (opt) {
      opt->zero_grad();
    }
    at::Tensor loss;
    if (meter) {
      trainmem::SavedTensorMeterGuard scope(*meter);
      loss = model->forward(x, plan).pow(2).mean();
    } else if (offload) {
      trainmem::SaveOnCpuGuard guard(*model, *offload);
      loss = model->forward(x, plan).pow(2).mean();
    } else {
      loss = model->forward(x, plan).pow(2).mean();
    }
    loss.backward();
    if (opt) {
      opt->step();
    }
    if (meter) {
      meter->reset();
    }
  }
};

std::unique_ptr<Runner> make_runner(const std::string& v, const trainmem::Transformer& base) {
  const int64_t L = base->options.num_layers();
  if (std::find(kTimeVariants.begin(), kTimeVariants.end(), v) == kTimeVariants.end()) {
    std::string known;
    for (const auto& k : kTimeVariants) {
      known += (known.empty() ? "" : ", ") + k;
    }
    TORCH_CHECK(false, "unknown variant '", v, "' (expected one of ", known, ")");
  }
  auto r = std::make_unique<Runner>(Runner{v, clone_of(base), nullptr, nullptr, nullptr,
                                           plan_of(v, L), std::nullopt, {}});
  if (v == "optimizer_in_backward") {
    r->oib = std::make_unique<trainmem::OptimizerInBackward>(r->model->parameters(), adamw);
  } else {
    r->opt = std::make_unique<torch::optim::AdamW>(r->model->parameters(),
                                                   torch::optim::AdamWOptions(1e-3));
  }
  if (v == "meter") {
    r->meter = std::make_unique<trainmem::SavedTensorMeter>(*r->model);
  }
  if (v == "save_on_cpu" || v == "save_on_cpu_copies") {
    r->offload = trainmem::SaveOnCpuOptions().copy_cpu_tensors(v == "save_on_cpu_copies");
  }
  return r;
}

int run_time(const Args& a) {
  if (a.track_allocator) {
    trainmem::CpuMemoryTracker::install();  // first: every later storage is counted
  }
  const auto o = options_of(a);
  torch::manual_seed(0);
  trainmem::Transformer base(o);
  const auto x = torch::randn({kBatch, a.seq_len, o.d_model()});
  const auto names = a.variants.empty() ? kTimeVariants : a.variants;
  std::vector<std::unique_ptr<Runner>> runners;
  for (const auto& v : names) {
    runners.push_back(make_runner(v, base));
  }
  std::optional<trainmem::PeakWindow> window;
  if (a.track_allocator) {
    window.emplace(trainmem::CpuMemoryTracker::install());
  }
  // Step i runs the variants starting from i mod n, so none always goes first.
  const size_t n = runners.size();
  for (int64_t i = 0; i < a.warmup + a.steps; ++i) {
    for (size_t j = 0; j < n; ++j) {
      auto& r = *runners[(i + j) % n];
      const auto t0 = std::chrono::steady_clock::now();
      r.step(x);
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= a.warmup) {
        r.ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      }
    }
  }
  json variants = json::object();
  for (const auto& r : runners) {
    variants[r->name] = {{"ms", r->ms}};
  }
  json doc = {{"side", "cpp"},
              {"track_allocator", a.track_allocator},
              {"num_threads", at::get_num_threads()},
              {"num_layers", o.num_layers()},
              {"seq_len", a.seq_len},
              {"variants", variants}};
  if (window) {
    doc["peak_bytes"] = window->peak_bytes();
  }
  std::cout << doc.dump() << "\n";
  return 0;
}

std::optional<int64_t> parse_int(const std::string& s) {
  try {
    size_t used = 0;
    const int64_t v = std::stoll(s, &used);
    if (used == s.size()) {
      return v;
    }
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

} // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::optional<std::string> {
      if (i + 1 >= argc) return std::nullopt;
      return std::string(argv[++i]);
    };
    auto number = [&](int64_t& out, int64_t min) -> bool {
      const auto v = value();
      const auto n = v ? parse_int(*v) : std::nullopt;
      if (!n || *n < min) {
        usage("expected an integer >= " + std::to_string(min) + " after " + arg +
              ", but got '" + (v ? *v : std::string("nothing")) + "'");
        return false;
      }
      out = *n;
      return true;
    };
    if (arg == "--check") {
      const auto v = value();
      if (!v) return usage("expected a directory after --check");
      a.check_dir = *v;
    } else if (arg == "--time") {
      a.time = true;
    } else if (arg == "--track-allocator") {
      a.track_allocator = true;
    } else if (arg == "--steps") {
      if (!number(a.steps, 1)) return 2;
    } else if (arg == "--warmup") {
      if (!number(a.warmup, 0)) return 2;
    } else if (arg == "--layers") {
      if (!number(a.num_layers, 1)) return 2;
    } else if (arg == "--seq-len") {
      if (!number(a.seq_len, 1)) return 2;
    } else if (arg == "--variants") {
      const auto v = value();
      if (!v) return usage("expected a comma-separated list after --variants");
      a.variants = split(*v);
    } else {
      return usage("unknown argument '" + arg + "'");
    }
  }
  if (a.check_dir.empty() == !a.time) {
    return usage("expected exactly one of --check DIR and --time");
  }
  try {
    return a.time ? run_time(a) : run_check(a);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "trainmem_compare: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trainmem_compare: %s\n", e.what());
    return 1;
  }
}
