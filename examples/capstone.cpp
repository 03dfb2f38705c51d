// The reference transformer's step, audited: six pre-LN transformer blocks (d 128, 4 heads)
// on a fixed (16, 64, 128) input, loss out.pow(2).mean(), AdamW. Prints where
// the step's memory goes: static buckets, saved activations by autograd node,
// the 64 T B d per-layer prediction beside the measured figure, and the four
// checkpointing variants (none, full, every_2, selective) side by side.
//
//   make demo               a report for people
//   make demo ARGS=--json   one JSON document (schema trainmem/1) on stdout
#include <cstdio>
#include <cstring>
#include <iostream>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include "app/variants.h"
#include "trainmem/accountant.h"
#include "trainmem/allocator.h"
#include "trainmem/meter.h"
#include "trainmem/report.h"
#include "trainmem/models/transformer.h"

namespace {

using trainmem::with_commas;

int usage(const char* bad) {
  std::fprintf(stderr, "capstone: unknown argument '%s'\nusage: capstone [--json]\n", bad);
  return 2;
}

// What the capstone measures and predicts of the reference step.
struct Findings {
  trainmem::TransformerOptions o;  // the capstone's model
  int64_t batch = trainmem::kReferenceBatch;
  int64_t seq_len = trainmem::kReferenceSeqLen;
  trainmem::Transformer model{nullptr};
  trainmem::StaticBuckets buckets;
  trainmem::SavedTensorReport saved;
  int64_t unit = 0;  // one (B, T, d) fp32 tensor
  std::vector<trainmem::VariantRun> runs;
  trainmem::OptimizerInBackwardPeaks oib;
  trainmem::OptimizerInBackwardPeaks oib_tiny;
  trainmem::ActivationEstimate estimate;
  int64_t predicted = 0;
  double ratio = 0.0;
};

// One metered AdamW step of the reference transformer, its four
// checkpointing variants and the optimizer step in backward. Needs the
// CpuMemoryTracker installed.
Findings measure() {
  Findings f;
  const auto& o = f.o;
  const int64_t batch = f.batch, seq_len = f.seq_len;
  torch::manual_seed(0);
  trainmem::Transformer model(o);
  f.model = model;
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto x = torch::randn({batch, seq_len, o.d_model()});

  trainmem::SavedTensorMeter meter(*model);
  at::Tensor loss;
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    loss = model->forward(x).pow(2).mean();
  }
  loss.backward();
  opt.step();

  f.buckets = trainmem::account(*model, opt);
  f.saved = meter.report();

  // The four checkpointing variants, each metered, gradients
  // compared with the plain run.
  const int64_t L = o.num_layers();
  f.unit = 4 * batch * seq_len * o.d_model();
  for (const auto& plan : trainmem::reference_variants(L)) {
    f.runs.push_back(trainmem::run_variant(model, x, plan));
  }
  // Optimizer step in backward: at the capstone's shape (activations
  // dominate: the peak is early in backward) and with tiny activations
  // (batch 1, 8 tokens: the peak moves to the optimizer step).
  f.oib = trainmem::measure_optimizer_in_backward(o, batch, seq_len);
  f.oib_tiny = trainmem::measure_optimizer_in_backward(o, 1, 8);
  f.estimate = trainmem::estimate_activation_bytes(o, batch, seq_len);
  f.predicted = trainmem::predicted_activation_bytes(o, batch, seq_len);
  f.ratio = static_cast<double>(f.saved.saved_bytes) / static_cast<double>(f.predicted);
  return f;
}

// --json: one document, schema trainmem/1.
void print_json(const Findings& f) {
  const auto& o = f.o;
  const auto& saved = f.saved;
  const auto& buckets = f.buckets;
  nlohmann::json by_node = nlohmann::json::array();
  for (const auto& n : saved.by_node) {
    by_node.push_back({{"node", n.node}, {"bytes", n.bytes}, {"num_tensors", n.num_tensors}});
  }
  nlohmann::json terms = nlohmann::json::array();
  for (const auto& t : f.estimate.terms) {
    terms.push_back({{"name", t.name}, {"bytes", t.bytes}});
  }
  nlohmann::json doc = {
      {"schema", "trainmem/1"},
      {"model", {{"num_layers", o.num_layers()}, {"d_model", o.d_model()},
                 {"num_heads", o.num_heads()}, {"batch", f.batch}, {"seq_len", f.seq_len}}},
      {"params", buckets.num_params},
      {"param_bytes", buckets.param_bytes},
      {"grad_bytes", buckets.grad_bytes},
      {"optimizer", buckets.optimizer},
      {"optimizer_state_bytes", buckets.optimizer_state_bytes},
      {"saved_activation_bytes", saved.saved_bytes},
      {"saved_num_tensors", saved.num_tensors},
      {"saved_num_storages", saved.num_storages},
      {"excluded_param_bytes", saved.excluded_param_bytes},
      {"saved_by_node", by_node},
      {"predicted_activation_bytes", f.predicted},
      {"explained_activation_bytes", f.estimate.total_bytes},
      {"explained_activation_terms", terms},
      {"measured_over_predicted", f.ratio},
  };
  for (const auto& r : f.runs) {
    doc["variants"][r.name] = {
        {"saved_activation_bytes", r.saved.saved_bytes},
        {"saved_units_512KiB", static_cast<double>(r.saved.saved_bytes) / static_cast<double>(f.unit)},
        {"max_grad_diff", trainmem::max_abs_diff(f.runs.front().grads, r.grads)},
        {"peak_bytes", r.peak_bytes},
        {"peak_above_start_bytes", r.peak_above_start_bytes}};
  }
  doc["optimizer_in_backward"] = {{"peak_bytes", f.oib.peak_bytes},
                                  {"plain_peak_bytes", f.oib.plain_peak_bytes},
                                  {"grad_bytes", f.oib.grad_bytes},
                                  {"tiny_batch", {{"batch", 1}, {"seq_len", 8},
                                                  {"peak_bytes", f.oib_tiny.peak_bytes},
                                                  {"plain_peak_bytes", f.oib_tiny.plain_peak_bytes}}}};
  std::cout << doc.dump() << "\n";
}

// The report's static buckets, saved bytes by node and the 64 T B d
// prediction with the difference explained.
void print_buckets_and_saved(const Findings& f) {
  const auto& o = f.o;
  const auto& saved = f.saved;
  std::cout << fmt::format(
      "trainmem capstone: {} pre-LN blocks, d_model {}, {} heads, input ({}, {}, {}), fp32, AdamW\n\n",
      o.num_layers(), o.d_model(), o.num_heads(), f.batch, f.seq_len, o.d_model());
  std::cout << "static buckets (after one step)\n" << trainmem::to_string(f.buckets) << "\n";
  std::cout << trainmem::to_string(trainmem::predict_static_bytes(*f.model, trainmem::Recipe::kFp32AdamW))
            << "\n\n";
  std::cout << fmt::format("saved for backward {:>16} B in {} storages ({} tensors)\n",
                           with_commas(saved.saved_bytes), saved.num_storages, saved.num_tensors);
  for (const auto& n : saved.by_node) {
    std::cout << fmt::format("  {:<48}{:>14} B {:>5} tensors\n", n.node, with_commas(n.bytes),
                             n.num_tensors);
  }
  std::cout << fmt::format("  parameters seen and excluded: {} B\n\n", with_commas(saved.excluded_param_bytes));
  std::cout << fmt::format("predicted 64 T B d per layer {:>14} B\n", with_commas(f.predicted));
  std::cout << fmt::format("measured / predicted         {:>14.3f}\n", f.ratio);
  std::cout << "the difference, explained:\n";
  for (const auto& t : f.estimate.terms) {
    std::cout << fmt::format("  {:<56}{:>14} B\n", t.name, with_commas(t.bytes));
  }
  std::cout << fmt::format("  {:<56}{:>14} B ({})\n", "total", with_commas(f.estimate.total_bytes),
                           f.estimate.total_bytes == saved.saved_bytes ? "equals the measurement"
                                                                       : "DIFFERS from the measurement");
}

// The report's checkpointing variants and the optimizer step in backward.
void print_variants(const Findings& f) {
  const auto& runs = f.runs;
  std::cout << fmt::format("\ncheckpointing variants (unit: one (B, T, d) fp32 tensor, {} KiB)\n",
                           f.unit / 1024);
  std::cout << fmt::format("  {:<12}{:>16}{:>10}{:>16}{:>18}\n", "variant", "saved B", "units",
                           "max grad diff", "step peak B");
  for (const auto& r : runs) {
    std::cout << fmt::format("  {:<12}{:>16}{:>10.2f}{:>16.3g}{:>18}\n", r.name,
                             with_commas(r.saved.saved_bytes),
                             static_cast<double>(r.saved.saved_bytes) / static_cast<double>(f.unit),
                             trainmem::max_abs_diff(runs.front().grads, r.grads),
                             with_commas(r.peak_above_start_bytes));
  }
  std::cout << "  (step peak: live bytes above the step's start counted by the CPU allocator\n"
               "   wrapper; allocations LibTorch does not make through its allocator, e.g.\n"
               "   oneDNN scratch, are not seen)\n";
  const auto& oib = f.oib;
  const auto& oib_tiny = f.oib_tiny;
  std::cout << "\noptimizer step in backward (AdamW, CPU peak of one step)\n";
  std::cout << fmt::format("  {:<28}{:>16}{:>16}{:>14}\n", "shape", "plain peak B", "in-backward B",
                           "drop B");
  std::cout << fmt::format("  {:<28}{:>16}{:>16}{:>14}\n", "capstone (16, 64, 128)",
                           with_commas(oib.plain_peak_bytes), with_commas(oib.peak_bytes),
                           with_commas(oib.plain_peak_bytes - oib.peak_bytes));
  std::cout << fmt::format("  {:<28}{:>16}{:>16}{:>14}\n", "tiny batch (1, 8, 128)",
                           with_commas(oib_tiny.plain_peak_bytes), with_commas(oib_tiny.peak_bytes),
                           with_commas(oib_tiny.plain_peak_bytes - oib_tiny.peak_bytes));
  std::cout << fmt::format("  gradient bucket: {} B\n", with_commas(oib.grad_bytes));
}

} // namespace

int main(int argc, char** argv) {
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else {
      return usage(argv[i]);
    }
  }
  try {
    // First thing: everything allocated from here on is counted.
    trainmem::CpuMemoryTracker::install();
    const Findings f = measure();
    if (json) {
      print_json(f);
      return 0;
    }
    print_buckets_and_saved(f);
    print_variants(f);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "capstone: %s\n", e.what());
    return 1;
  }
}
