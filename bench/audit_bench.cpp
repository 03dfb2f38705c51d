// The audit's overhead on real loop shapes: a step of a few
// milliseconds, plain and inside Audit::step(). Reported as ratios to the
// plain step in docs/benchmarks.md (goal <= 1.05x); never asserted in tests.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>
#include <tuple>
#include <vector>

#include <malloc.h>
#include <pthread.h>
#include <sched.h>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
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
  void enroll(trainmem::Audit& audit) {
    audit.add_module(*this);
    audit.add_optimizer(opt);
  }
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
  void enroll(trainmem::Audit& audit) {
    audit.add_module(*this);
    audit.add_optimizer(opt);
  }
};

// The other loop shapes (a conv net with BatchNorm, recurrent nets), each small enough for a step of a few
// milliseconds on this machine.

// DCGAN's two networks, one audit: D's step on a real and a fake batch,
// then G's through D; an Adam each.
struct Gan {
  torch::nn::Sequential g{torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(32, 64, 4).bias(false)),
                          torch::nn::BatchNorm2d(64), torch::nn::ReLU(),
                          torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(64, 32, 3).stride(2).padding(1).bias(false)),
                          torch::nn::BatchNorm2d(32), torch::nn::ReLU(),
                          torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(32, 16, 4).stride(2).padding(1).bias(false)),
                          torch::nn::BatchNorm2d(16), torch::nn::ReLU(),
                          torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(16, 1, 4).stride(2).padding(1).bias(false)),
                          torch::nn::Tanh()};
  torch::nn::Sequential d{torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 4).stride(2).padding(1).bias(false)),
                          torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
                          torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 4).stride(2).padding(1).bias(false)),
                          torch::nn::BatchNorm2d(32), torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
                          torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 4).stride(2).padding(1).bias(false)),
                          torch::nn::BatchNorm2d(64), torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
                          torch::nn::Conv2d(torch::nn::Conv2dOptions(64, 1, 3).bias(false)), torch::nn::Sigmoid()};
  torch::optim::Adam g_opt{g->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.5})};
  torch::optim::Adam d_opt{d->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.5})};
  at::Tensor real = torch::randn({16, 1, 28, 28});
  at::Tensor noise = torch::randn({16, 32, 1, 1});
  void step() {
    d->zero_grad();
    torch::binary_cross_entropy(d->forward(real).flatten(), torch::full({16}, 0.9)).backward();
    auto fake = g->forward(noise);
    torch::binary_cross_entropy(d->forward(fake.detach()).flatten(), torch::zeros({16})).backward();
    d_opt.step();
    g->zero_grad();
    torch::binary_cross_entropy(d->forward(fake).flatten(), torch::ones({16})).backward();
    g_opt.step();
  }
  void enroll(trainmem::Audit& audit) {
    audit.add_module(g);
    audit.add_module(d);
    audit.add_optimizer(d_opt, "D");
    audit.add_optimizer(g_opt, "G");
  }
};

// A conv net with BatchNorm (the MNIST/CIFAR tutorials' shape), SGD with momentum.
struct ConvBn {
  torch::nn::Sequential net{torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3).padding(1)), torch::nn::BatchNorm2d(16),
                            torch::nn::ReLU(), torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).stride(2).padding(1)),
                            torch::nn::BatchNorm2d(32), torch::nn::ReLU(),
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 32, 3).stride(2).padding(1)),
                            torch::nn::BatchNorm2d(32), torch::nn::ReLU(), torch::nn::Flatten(),
                            torch::nn::Linear(32 * 8 * 8, 10)};
  torch::optim::SGD opt{net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)};
  at::Tensor x = torch::randn({16, 3, 32, 32});
  at::Tensor y = torch::randint(0, 10, {16});
  void step() {
    opt.zero_grad();
    torch::cross_entropy_loss(net->forward(x), y).backward();
    opt.step();
  }
  void enroll(trainmem::Audit& audit) {
    audit.add_module(net);
    audit.add_optimizer(opt);
  }
};

// Neural style transfer's loop: frozen convs, Adam over the image itself.
struct Style {
  torch::nn::Sequential features{torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3).padding(1)), torch::nn::ReLU(),
                                 torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 16, 3).padding(1)), torch::nn::ReLU(),
                                 torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).stride(2).padding(1))};
  at::Tensor image = torch::rand({1, 3, 96, 96}).requires_grad_();
  torch::optim::Adam opt{std::vector<at::Tensor>{image}, torch::optim::AdamOptions(0.01)};
  Style() {
    for (auto& p : features->parameters()) {
      p.requires_grad_(false);  // frozen, as VGG is
    }
  }
  void step() {
    opt.zero_grad();
    auto f = features->forward(image).flatten(2);
    at::matmul(f, f.transpose(1, 2)).pow(2).mean().backward();  // a Gram matrix's loss
    opt.step();
  }
  void enroll(trainmem::Audit& audit) {
    audit.add_module(features);
    audit.add_optimized_input(image, "image");
    audit.add_optimizer(opt);
  }
};

// Image captioning: a TorchScript encoder (compiled here from its source,
// as torch.jit.script would save it) and an LSTMCell decoder over 8 words.
struct Captioning {
  torch::jit::Module encoder = [] {
    torch::jit::Module m("Encoder");
    m.register_parameter("w", torch::randn({32, 3, 3, 3}) * 0.1, false);
    m.register_parameter("b", torch::zeros({32}), false);
    m.register_parameter("proj", torch::randn({48, 32}) * 0.1, false);
    m.define(R"(
def forward(self, x):
    y = torch.relu(torch.conv2d(x, self.w, self.b, [2, 2], [1, 1]))
    return torch.matmul(y.mean([2, 3]), self.proj.t())
)");
    return m;
  }();
  torch::nn::LSTMCell cell{torch::nn::LSTMCell(48, 48)};
  torch::nn::Linear head{torch::nn::Linear(48, 100)};
  torch::optim::Adam opt{[&] {
    std::vector<at::Tensor> ps;
    for (const auto& p : encoder.parameters()) ps.push_back(p);
    for (const auto& p : cell->parameters()) ps.push_back(p);
    for (const auto& p : head->parameters()) ps.push_back(p);
    return ps;
  }(), torch::optim::AdamOptions(1e-3)};
  at::Tensor images = torch::randn({8, 3, 32, 32});
  at::Tensor words = torch::randint(0, 100, {8, 8});
  void step() {
    opt.zero_grad();
    auto h = encoder.forward({images}).toTensor();
    std::optional<std::tuple<at::Tensor, at::Tensor>> s = std::make_tuple(h, torch::zeros_like(h));
    std::vector<at::Tensor> logits;
    for (int64_t t = 0; t < words.size(1); ++t) {
      s = cell->forward(std::get<0>(*s), s);
      logits.push_back(head->forward(std::get<0>(*s)));
    }
    torch::cross_entropy_loss(at::stack(logits, 1).flatten(0, 1), words.flatten()).backward();
    opt.step();
  }
  void enroll(trainmem::Audit& audit) {
    audit.add_module(encoder);
    audit.add_module(*cell);
    audit.add_module(*head);
    audit.add_optimizer(opt);
  }
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

// The audit's options for arm 1 (all, the defaults: the meter on the steps
// that differ), 2 (no meter), 3 (no timeline: then the meter runs every
// step), 4 (phases only), and in BM_Paired 6 (all, the meter once every 10
// steps) and 7 (all, the meter every step).
trainmem::AuditOptions arm_options(int64_t arm) {
  return trainmem::AuditOptions()
      .meter(arm == 1 || arm == 3 || arm == 6 || arm == 7)
      .timeline(arm != 3 && arm != 4)
      .meter_every(arm == 6 ? 10 : arm == 7 ? 1 : 0);
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
    audit.emplace(torch::kCPU, arm_options(arm));
    m.enroll(*audit);
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
// Runs one job at a time on a thread of its own while the caller waits:
// BM_Paired's plain copy. An Audit records every allocation of its thread,
// between steps too, so a plain step run on the audited thread would be
// logged and classified at the audited step's end, a cost that a loop with
// only its data made between steps never pays. Both threads are pinned to
// the CPU the caller was on, so the two copies share one core and its caches
// as before, and glibc is held to one malloc arena, so the worker's heap is
// the main thread's, as a loop on main has it (a thread's own arena trims
// its heap on free: the control read 0.83-0.87 with one).
class Worker {
 public:
  Worker() : cpu_(one_arena_cpu()), thread_([this] { loop(); }) {
    restore_ = pthread_getaffinity_np(pthread_self(), sizeof(caller_), &caller_) == 0;
    pin(pthread_self());
  }
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    if (restore_) {
      pthread_setaffinity_np(pthread_self(), sizeof(caller_), &caller_);
    }
  }
  void run(const std::function<void()>& job) {
    std::unique_lock<std::mutex> lock(mutex_);
    job_ = &job;
    cv_.notify_all();
    cv_.wait(lock, [&] { return job_ == nullptr; });
  }

 private:
  // Holds glibc to one arena before the worker thread (initialized after
  // cpu_) first allocates; the caller's CPU.
  static int one_arena_cpu() {
    mallopt(M_ARENA_MAX, 1);
    return sched_getcpu();
  }
  void pin(pthread_t t) const {
    if (cpu_ < 0) {
      return;
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu_, &set);
    pthread_setaffinity_np(t, sizeof(set), &set);  // best effort: unpinned is still paired
  }
  void loop() {
    pin(pthread_self());
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || job_ != nullptr; });
      if (stop_) {
        return;
      }
      (*job_)();
      job_ = nullptr;
      cv_.notify_all();
    }
  }
  int cpu_;
  cpu_set_t caller_{};
  bool restore_ = false;
  std::mutex mutex_;
  std::condition_variable cv_;
  const std::function<void()>* job_ = nullptr;
  bool stop_ = false;
  std::thread thread_;
};

// Paired: each iteration times one plain step and one audited step of two
// copies of the model (same seed), in alternating order, so that the drift
// of this machine's speed falls on both alike; the plain copy steps on a
// Worker's thread, which the audit does not record. Reports the median of the
// per-iteration ratios (counter "ratio") beside both medians, and the ratio
// of the sums (counter "mean_ratio": what a run pays, slow steps included).
// Arg: the AuditOptions as in BM_Loop (1 audited with the defaults, 2 no
// meter, 3 no timeline, 4 phases only, 6 all with the meter once every 10
// steps, 7 all with the meter every step); 0 is
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
  trainmem::Audit audit(torch::kCPU, arm_options(arm));
  audited.enroll(audit);
  const auto keep = std::make_shared<KeepHooks>();
  using Clock = std::chrono::steady_clock;
  std::vector<double> plain_ms, audited_ms, ratios;
  bool plain_first = true;
  Worker worker;
  double p = 0;
  const std::function<void()> plain_step = [&] {
    const auto t0 = Clock::now();
    plain.step();
    p = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  for (auto _ : state) {
    double a = 0;
    for (int k = 0; k < 2; ++k) {
      if ((k == 0) == plain_first) {
        worker.run(plain_step);
      } else {
        const auto t0 = Clock::now();
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
  if (arm != 0 && arm != 5) {
    // The share of audited steps the meter ran in (AuditOptions::meter_every).
    const auto steps = audit.report().steps;
    state.counters["metered"] = static_cast<double>(std::count_if(
                                    steps.begin(), steps.end(), [](const auto& st) { return st.metered; })) /
        static_cast<double>(std::max<size_t>(steps.size(), 1));
  }
  static const char* const kLabels[] = {"control: both plain", "audited", "audited, no meter", "audited, no timeline",
                                        "audited, phases only", "plain + saved-tensor hooks that keep the tensor",
                                        "audited, meter every 10th step", "audited, meter every step"};
  state.SetLabel(kLabels[arm]);
}

BENCHMARK_TEMPLATE(BM_Loop, Decoder)->DenseRange(0, 8)->Unit(benchmark::kMillisecond)->MinTime(2.0);
BENCHMARK_TEMPLATE(BM_Paired, Decoder)->DenseRange(0, 7)->Unit(benchmark::kMillisecond)->MinTime(4.0);
BENCHMARK_TEMPLATE(BM_Paired, WordLm)->Arg(0)->Arg(1)->Arg(6)->Arg(7)->Unit(benchmark::kMillisecond)->MinTime(4.0);
BENCHMARK_TEMPLATE(BM_Paired, Gan)->DenseRange(0, 7)->Unit(benchmark::kMillisecond)->MinTime(4.0);
BENCHMARK_TEMPLATE(BM_Paired, ConvBn)->Arg(0)->Arg(1)->Arg(6)->Arg(7)->Unit(benchmark::kMillisecond)->MinTime(4.0);
BENCHMARK_TEMPLATE(BM_Paired, Style)->Arg(0)->Arg(1)->Arg(6)->Arg(7)->Unit(benchmark::kMillisecond)->MinTime(4.0);
BENCHMARK_TEMPLATE(BM_Paired, Captioning)->DenseRange(0, 7)->Unit(benchmark::kMillisecond)->MinTime(4.0);

} // namespace
