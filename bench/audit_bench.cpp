// The audit's overhead on real loop shapes (issue 22): a step of a few
// milliseconds, plain and inside Audit::step(). Reported as ratios to the
// plain step in docs/benchmarks.md (goal <= 1.05x); never asserted in tests.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/rnn.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "trainmem/allocator.h"
#include "trainmem/audit.h"
#include "trainmem/hooks.h"

namespace {

// word_language_model's shape, truncated BPTT with the state carried.
struct WordLm : torch::nn::Module {
  torch::nn::Embedding emb{register_module("emb", torch::nn::Embedding(1000, 64))};
  torch::nn::LSTM lstm{register_module("lstm", torch::nn::LSTM(torch::nn::LSTMOptions(64, 128).num_layers(2)))};
  torch::nn::Linear out{register_module("out", torch::nn::Linear(128, 1000))};
  torch::optim::SGD opt{parameters(), torch::optim::SGDOptions(0.1)};
  std::optional<std::tuple<at::Tensor, at::Tensor>> state;
  at::Tensor x = torch::randint(0, 1000, {20, 8});
  at::Tensor y = torch::randint(0, 1000, {20 * 8});
  void step() {
    if (state) state = std::make_tuple(std::get<0>(*state).detach(), std::get<1>(*state).detach());
    opt.zero_grad();
    auto [h, next] = lstm->forward(emb->forward(x), state);
    state = next;
    torch::cross_entropy_loss(out->forward(h).flatten(0, 1), y).backward();
    opt.step();
  }
  torch::optim::Optimizer& optimizer() { return opt; }
};

// Image captioning's decoder: an LSTMCell unrolled over 12 steps.
struct Decoder : torch::nn::Module {
  torch::nn::Linear embed{register_module("embed", torch::nn::Linear(16, 48))};
  torch::nn::LSTMCell cell{register_module("cell", torch::nn::LSTMCell(48, 48))};
  torch::nn::Linear head{register_module("head", torch::nn::Linear(48, 10))};
  torch::optim::Adam opt{parameters(), torch::optim::AdamOptions(1e-3)};
  at::Tensor x = torch::randn({32, 12, 16});
  at::Tensor y = torch::randint(0, 10, {32});
  void step() {
    opt.zero_grad();
    auto e = torch::tanh(embed->forward(x));
    std::optional<std::tuple<at::Tensor, at::Tensor>> s;
    std::vector<at::Tensor> hs;
    for (int64_t t = 0; t < e.size(1); ++t) {
      s = cell->forward(e.select(1, t), s);
      hs.push_back(std::get<0>(*s));
    }
    torch::cross_entropy_loss(head->forward(at::stack(hs, 1).mean(1)), y).backward();
    opt.step();
  }
  torch::optim::Optimizer& optimizer() { return opt; }
};

std::unique_ptr<at::ObserverContext> no_op_start(const at::RecordFunction&) {
  return nullptr;
}
void no_op_end(const at::RecordFunction&, at::ObserverContext*) {}

// Saved-tensor hooks that keep each saved tensor's data as it is and give it
// back: the mechanism any meter of saved bytes stands on, with no counting.
struct KeepHooks final : trainmem::SavedTensorHooks {
  std::any pack(const at::Tensor& t) override { return t.tensor_data(); }
  at::Tensor unpack(const std::any& packed) override { return std::any_cast<at::Tensor>(packed); }
};

// The audit's options for arm 1 (all), 2 (no meter), 3 (no timeline), 4
// (phases only) and 6 (all, the meter once every 10 steps), in BM_Loop and
// BM_Paired alike.
trainmem::AuditOptions arm_options(int64_t arm) {
  return trainmem::AuditOptions()
      .meter(arm == 1 || arm == 3 || arm == 6)
      .timeline(arm == 1 || arm == 2 || arm == 6)
      .meter_every(arm == 6 ? 10 : 1);
}

// Arg 0: plain; 1: audited (the counting allocator is installed in both).
// The breakdown of the audit's cost: 2 without the meter, 3 without the
// timeline, 4 with neither (phases only). What LibTorch's RecordFunction
// alone costs, plain with a thread-local callback that does nothing: 5 that
// needs neither inputs nor outputs, 6 that needs inputs, 7 both. What
// saved-tensor hooks alone cost: 8, plain with a pack/unpack pair that keeps
// each saved tensor's data as it is (what any meter of saved bytes stands on).
template <typename Model>
void BM_Loop(benchmark::State& state) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  Model m;
  std::optional<trainmem::Audit> audit;
  const auto arm = state.range(0);
  static const char* const kLabels[] = {"plain", "audited", "audited, no meter", "audited, no timeline",
                                        "audited, phases only", "plain + empty op callback",
                                        "plain + op callback, inputs", "plain + op callback, inputs and outputs",
                                        "plain + saved-tensor hooks that keep the tensor"};
  std::optional<at::CallbackHandle> callback;
  std::shared_ptr<trainmem::SavedTensorHooks> keep;
  if (arm == 8) {
    keep = std::make_shared<KeepHooks>();
  } else if (arm >= 5) {
    callback = at::addThreadLocalCallback(at::RecordFunctionCallback(&no_op_start, &no_op_end)
                                              .needsInputs(arm >= 6)
                                              .needsOutputs(arm == 7)
                                              .scopes({at::RecordScope::FUNCTION}));
  } else if (arm > 0) {
    audit.emplace(m, &m.optimizer(), torch::kCPU, arm_options(arm));
  }
  state.SetLabel(kLabels[arm]);
  for (auto _ : state) {
    if (keep) {
      trainmem::SavedTensorHooksGuard hooks(keep);
      m.step();
    } else if (audit) {
      auto audited = audit->step();
      m.step();
    } else {
      m.step();
    }
  }
  if (callback) {
    at::removeCallback(*callback);
  }
}
BENCHMARK_TEMPLATE(BM_Loop, WordLm)->DenseRange(0, 1)->Unit(benchmark::kMillisecond)->MinTime(2.0);
// Paired: each iteration times one plain step and one audited step of two
// copies of the model (same seed), in alternating order, so that the drift
// of this machine's speed falls on both alike. Reports the median of the
// per-iteration ratios (counter "ratio") beside both medians, and the ratio
// of the sums (counter "mean_ratio": what a run pays, slow steps included).
// Arg: the AuditOptions as in BM_Loop (1 audited, 2 no meter, 3 no
// timeline, 4 phases only, 6 all with the meter once every 10 steps); 0 is
// the control, both copies plain (the method's own bias); 5 is no audit but
// the second copy's step inside KeepHooks (its saves are in forward): the
// floor of the meter's mechanism.
template <typename Model>
void BM_Paired(benchmark::State& state) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  Model plain;
  torch::manual_seed(0);
  Model audited;
  const auto arm = state.range(0);
  trainmem::Audit audit(audited, &audited.optimizer(), torch::kCPU, arm_options(arm));
  const auto keep = std::make_shared<KeepHooks>();
  using Clock = std::chrono::steady_clock;
  std::vector<double> plain_ms, audited_ms, ratios;
  bool plain_first = true;
  for (auto _ : state) {
    double p = 0, a = 0;
    for (int k = 0; k < 2; ++k) {
      const auto t0 = Clock::now();
      if ((k == 0) == plain_first) {
        plain.step();
        p = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      } else {
        if (arm == 0) {
          audited.step();
        } else if (arm == 5) {
          trainmem::SavedTensorHooksGuard hooks(keep);
          audited.step();
        } else {
          auto step = audit.step();
          audited.step();
        }
        a = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      }
    }
    plain_first = !plain_first;
    plain_ms.push_back(p);
    audited_ms.push_back(a);
    ratios.push_back(a / p);
  }
  auto median = [](std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  state.counters["plain_ms"] = median(plain_ms);
  state.counters["audited_ms"] = median(audited_ms);
  state.counters["ratio"] = median(ratios);
  // What a run pays: the rare slow step (a page fault that stalls, a
  // compaction) hides from a median, never from a sum.
  state.counters["mean_ratio"] = std::accumulate(audited_ms.begin(), audited_ms.end(), 0.0) /
      std::accumulate(plain_ms.begin(), plain_ms.end(), 0.0);
  static const char* const kLabels[] = {"control: both plain", "audited", "audited, no meter", "audited, no timeline",
                                        "audited, phases only", "plain + saved-tensor hooks that keep the tensor",
                                        "audited, meter every 10th step"};
  state.SetLabel(kLabels[arm]);
}

BENCHMARK_TEMPLATE(BM_Loop, Decoder)->DenseRange(0, 8)->Unit(benchmark::kMillisecond)->MinTime(2.0);
BENCHMARK_TEMPLATE(BM_Paired, Decoder)->DenseRange(0, 6)->Unit(benchmark::kMillisecond)->MinTime(4.0);
BENCHMARK_TEMPLATE(BM_Paired, WordLm)->Arg(0)->Arg(1)->Arg(6)->Unit(benchmark::kMillisecond)->MinTime(4.0);

} // namespace
