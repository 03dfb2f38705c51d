#include "trainmem/planner.h"

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <ATen/Context.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Generator.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <ATen/ops/_scaled_dot_product_attention_math.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/sum.h>
#include <c10/core/Allocator.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/function.h>  // Node: node.h only since 2.13
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include "trainmem/accountant.h"
#include "trainmem/allocator.h"
#include "trainmem/meta.h"
#include "trainmem/format.h"
#include "detail/backward_on_meta.h"
#include "core/detail/checkpoint_state.h"
#include "detail/intercept.h"
#include "detail/optimizer_state.h"
#include "detail/process_library.h"
#include "plan/detail/plan_internal.h"

namespace trainmem {

// ---------------------------------------------------------------------------
// Costs and policies

namespace detail {

OpKind op_kind(const SelectiveOp& op) {
  static std::mutex mutex;
  static std::unordered_map<std::string, OpKind> cache;
  const std::string key = op.full_name();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) {
    return it->second;
  }
  OpKind kind;
  auto handle = c10::Dispatcher::singleton().findSchema(
      {op.name, op.overload == "default" ? "" : op.overload});
  if (handle) {
    const auto& schema = handle->schema();
    bool alias_return = false;
    for (const auto& r : schema.returns()) {
      alias_return |= r.alias_info() != nullptr;
    }
    kind.aliases = alias_return || schema.is_mutable();
    kind.view = alias_return && !schema.is_mutable();
  }
  cache.emplace(key, kind);
  return kind;
}

// Saved or offloaded: not recomputed (selective.cpp's is_save counts only the first).
bool is_kept(CheckpointPolicy p) {
  return p == CheckpointPolicy::kMustSave || p == CheckpointPolicy::kPreferSave ||
      p == CheckpointPolicy::kMustCpuOffload || p == CheckpointPolicy::kPreferCpuOffload;
}

} // namespace detail

namespace {

using detail::op_kind;

const at::Tensor* tensor_arg(const SelectiveOp& op, size_t i) {
  return i < op.inputs.size() && op.inputs[i].isTensor() ? &op.inputs[i].toTensor() : nullptr;
}

} // namespace

double flop_cost(const SelectiveOp& op) {
  const auto kind = op_kind(op);
  if (kind.view) {
    return 0.0;
  }
  auto dims_ok = [](const at::Tensor* t, int64_t d) { return t != nullptr && t->dim() == d; };
  if (op.name == "aten::mm") {
    const auto *a = tensor_arg(op, 0), *b = tensor_arg(op, 1);
    if (dims_ok(a, 2) && dims_ok(b, 2)) {
      return 2.0 * static_cast<double>(a->size(0)) * static_cast<double>(a->size(1)) *
          static_cast<double>(b->size(1));
    }
  }
  if (op.name == "aten::addmm") {
    const auto *a = tensor_arg(op, 1), *b = tensor_arg(op, 2);
    if (dims_ok(a, 2) && dims_ok(b, 2)) {
      const double m = static_cast<double>(a->size(0)), k = static_cast<double>(a->size(1)),
                   n = static_cast<double>(b->size(1));
      return 2.0 * m * k * n + m * n;
    }
  }
  if (op.name == "aten::bmm" || op.name == "aten::baddbmm") {
    const size_t first = op.name == "aten::bmm" ? 0 : 1;
    const auto *a = tensor_arg(op, first), *b = tensor_arg(op, first + 1);
    if (dims_ok(a, 3) && dims_ok(b, 3)) {
      const double bs = static_cast<double>(a->size(0)), m = static_cast<double>(a->size(1)),
                   k = static_cast<double>(a->size(2)), n = static_cast<double>(b->size(2));
      return 2.0 * bs * m * k * n + (first == 1 ? bs * m * n : 0.0);
    }
  }
  if (op.name == "aten::_scaled_dot_product_flash_attention_for_cpu") {
    const auto *q = tensor_arg(op, 0), *k = tensor_arg(op, 1);
    if (dims_ok(q, 4) && dims_ok(k, 4)) {
      const bool causal = op.inputs.size() > 4 && op.inputs[4].isBool() && op.inputs[4].toBool();
      const double f = 4.0 * static_cast<double>(q->size(0)) *
          static_cast<double>(q->size(1)) * static_cast<double>(q->size(2)) *
          static_cast<double>(k->size(2)) * static_cast<double>(q->size(3));
      return causal ? f / 2.0 : f;
    }
  }
  double largest = 0.0;
  for (const auto& v : op.inputs) {
    if (v.isTensor()) {
      largest = std::max(largest, static_cast<double>(v.toTensor().numel()));
    }
  }
  return largest;
}

namespace {

// Per-op CPU times, collected by thread-local RecordFunction callbacks (which
// take no state: the table is thread-local while measuring).
thread_local std::unordered_map<std::string, std::vector<double>>* tls_op_times = nullptr;

struct OpTimer final : at::ObserverContext {
  std::string key;
  std::chrono::steady_clock::time_point start;
};

template <typename Inputs>
std::string op_key(const std::string& name, const Inputs& inputs) {
  std::string key = name;
  for (const auto& v : inputs) {
    key += '|';
    if (v.isTensor()) {
      for (auto d : v.toTensor().sizes()) {
        key += std::to_string(d) + ',';
      }
    }
  }
  return key;
}

std::unique_ptr<at::ObserverContext> on_timed_op_start(const at::RecordFunction& fn) {
  if (tls_op_times == nullptr) {
    return nullptr;
  }
  auto timer = std::make_unique<OpTimer>();
  timer->key = op_key(fn.name(), fn.inputs());
  timer->start = std::chrono::steady_clock::now();
  return timer;
}

void on_timed_op_end(const at::RecordFunction& /*fn*/, at::ObserverContext* ctx) {
  if (tls_op_times == nullptr || ctx == nullptr) {
    return;
  }
  auto* timer = static_cast<OpTimer*>(ctx);
  const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - timer->start;
  (*tls_op_times)[timer->key].push_back(seconds.count());
}

} // namespace

OpCostFn measured_op_cost(const std::function<void()>& run, int64_t repeats) {
  TORCH_CHECK(static_cast<bool>(run), "measured_op_cost: the function to time is empty");
  TORCH_CHECK(repeats >= 1, "measured_op_cost: expected repeats >= 1, but got ", repeats);
  std::unordered_map<std::string, std::vector<double>> times;
  tls_op_times = &times;
  const auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&on_timed_op_start, &on_timed_op_end)
          .needsInputs(true)
          .scopes({at::RecordScope::FUNCTION}));
  try {
    for (int64_t r = 0; r < repeats; ++r) {
      run();
    }
  } catch (...) {
    at::removeCallback(handle);
    tls_op_times = nullptr;
    throw;
  }
  at::removeCallback(handle);
  tls_op_times = nullptr;
  auto table = std::make_shared<std::unordered_map<std::string, double>>();
  for (auto& [key, samples] : times) {
    std::sort(samples.begin(), samples.end());
    (*table)[key] = samples[samples.size() / 2];
  }
  // Seconds per FLOP over the matmuls seen, for ops the run never made.
  std::vector<double> per_flop;
  for (const auto& [key, seconds] : *table) {
    if (key.rfind("aten::mm|", 0) == 0) {
      std::vector<int64_t> d;
      std::string num;
      for (char c : key.substr(9)) {
        if (c == ',' || c == '|') {
          if (!num.empty()) d.push_back(std::stoll(num));
          num.clear();
        } else {
          num += c;
        }
      }
      if (d.size() == 4 && d[0] * d[1] * d[3] > 0) {
        per_flop.push_back(seconds / (2.0 * static_cast<double>(d[0] * d[1] * d[3])));
      }
    }
  }
  std::sort(per_flop.begin(), per_flop.end());
  const double seconds_per_flop = per_flop.empty() ? 1e-9 : per_flop[per_flop.size() / 2];
  return [table, seconds_per_flop](const SelectiveOp& op) {
    auto it = table->find(op_key(op.name, op.inputs));
    return it != table->end() ? it->second : flop_cost(op) * seconds_per_flop;
  };
}

SelectivePolicy save_op_calls_policy(std::vector<std::string> op_calls) {
  // Each checkpoint call copies the policy (selective.cpp keeps one copy per
  // region), so the counters below are per region; one set per pass.
  return [calls = std::move(op_calls), counts = std::array<std::map<std::string, int64_t>, 2>{}](
             const SelectiveContext& ctx, const SelectiveOp& op) mutable {
    const std::string key = op.full_name();
    const int64_t n = counts[ctx.is_recompute ? 1 : 0][key]++;
    const std::string call = key + "#" + std::to_string(n);
    return std::find(calls.begin(), calls.end(), call) != calls.end()
        ? CheckpointPolicy::kMustSave
        : CheckpointPolicy::kPreferRecompute;
  };
}

} // namespace trainmem
