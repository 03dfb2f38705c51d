// Meta kernels for recurrent nets: Note [Meta RNNs follow the CPU's kernel].
#include <algorithm>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/lstm.h>
#include <ATen/ops/gru_native.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/lstm_native.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/rnn_relu_native.h>
#include <ATen/ops/rnn_tanh_native.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/mkldnn_rnn_layer.h>
#include <ATen/ops/mkldnn_rnn_layer_backward.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/function.h>
#include <torch/library.h>

#include "detail/conv_scratch.h"
#include "core/detail/cpu_probe.h"
#include "detail/process_library.h"

namespace trainmem::detail {
namespace {

// Note [Meta RNNs follow the CPU's kernel]
// On CPU, at::lstm runs oneDNN, one mkldnn_rnn_layer per layer and
// direction, when oneDNN is on and the input is float (bf16 or fp16 where
// the CPU supports them), with no projections and no packed sequence. Each
// layer saves oneDNN's workspace for backward (MkldnnRnnLayerBackward0):
// a 2-layer LSTM(28, 128) on 100 x 28 steps saves 47,982,848 B on CPU. On
// meta, at::lstm's composite kernel sees a non-CPU input and runs the cells,
// which save 21,817,600 B: a prediction from a different kernel. So meta
// takes the CPU's path:
//  - an AutogradMeta kernel for aten::lstm.input runs mkldnn_rnn's steps
//    where the CPU would (layer by layer and direction by direction, the
//    directions concatenated, dropout between layers, the final states
//    stacked) and the composite kernel elsewhere;
//  - meta kernels for mkldnn_rnn_layer and mkldnn_rnn_layer_backward give
//    each output the sizes, strides and dtype the CPU kernel gives, the
//    workspace included, and hold the kernel's scratch while the outputs
//    are made. Both are measured once per distinct call by running the CPU
//    kernel on zero-filled tensors (core/detail/cpu_probe.h): oneDNN picks the
//    workspace's layout by shape and ISA, which no formula here would track.
//    A call whose probe would take more than 1 GiB is not guessed: the
//    kernel says so as a missing meta kernel, and the planner profiles that
//    region on CPU, naming it.
// GRU, RNN and the cells have no oneDNN path on CPU: there meta and CPU run
// the same composite ops. A CUDA prediction (detail/conv_scratch.h) keeps
// the composite path: cuDNN's RNN is neither.
constexpr int64_t kLstmMode = 2;  // ideep::rnn_kind::LSTM, the mode mkldnn_rnn passes for at::lstm

// Whether the CPU runs at::lstm on oneDNN for `input` of a non-float dtype:
// asked once per dtype with a tiny CPU LSTM (the CPU's own ISA checks).
bool cpu_lstm_on_onednn_for(at::ScalarType dtype) {
  static std::mutex mu;
  static std::unordered_map<int, bool> answers;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = answers.find(static_cast<int>(dtype)); it != answers.end()) {
    return it->second;
  }
  bool onednn = false;
  try {
    at::AutoGradMode grad(true);
    const auto opts = at::TensorOptions().dtype(dtype);
    const auto x = at::zeros({1, 1, 2}, opts);
    const auto h = at::zeros({1, 1, 2}, opts);
    std::vector<at::Tensor> params{at::zeros({8, 2}, opts).requires_grad_(), at::zeros({8, 2}, opts),
                                   at::zeros({8}, opts), at::zeros({8}, opts)};
    const auto out = std::get<0>(at::lstm(x, {h, h}, params, true, 1, 0.0, true, false, false));
    std::vector<torch::autograd::Node*> todo{out.grad_fn().get()};
    for (size_t k = 0; k < todo.size() && k < 16 && !onednn; ++k) {
      if (todo[k] == nullptr) continue;
      onednn = todo[k]->name().find("MkldnnRnnLayer") != std::string::npos;
      for (const auto& e : todo[k]->next_edges()) todo.push_back(e.function.get());
    }
  } catch (const c10::Error&) {
    onednn = false;  // the CPU cannot run this dtype at all: nor will the composite path differ
  }
  answers.emplace(static_cast<int>(dtype), onednn);
  return onednn;
}

// RNN.cpp's use_mkldnn, for a meta input standing for a CPU one.
bool cpu_lstm_on_onednn(const at::Tensor& input, at::TensorList hx) {
  if (!conv_scratch_on_meta() || !at::hasMKLDNN() || !at::globalContext().userEnabledMkldnn()) {
    return false;
  }
  if (input.numel() == 0 || hx.size() != 2 || hx[0].dim() != 3 || hx[1].dim() != 3 ||
      hx[0].size(2) != hx[1].size(2)) {  // projections take the composite path
    return false;
  }
  switch (input.scalar_type()) {
    case at::kFloat: return true;
    case at::kBFloat16: case at::kHalf: return cpu_lstm_on_onednn_for(input.scalar_type());
    default: return false;
  }
}

std::string key_of(at::TensorList ts) {
  std::string k;
  for (const auto& t : ts) k += probe_key(t) + " ";
  return k;
}

int64_t bytes_of(at::TensorList ts) {
  int64_t n = 0;
  for (const auto& t : ts) n += probe_storage_bytes(t);
  return n;
}

std::string not_measured(const char* op, int64_t bytes) {
  return fmt::format("aten::{}: attempted to run this operator with Meta tensors, but the CPU kernel's outputs "
                     "and scratch for these shapes were not measured (the probe would take about {} B, above "
                     "1 GiB); profile this region on CPU (Note [Meta RNNs follow the CPU's kernel])",
                     op, bytes);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rnn_layer_meta(
    const at::Tensor& input, const at::Tensor& w0, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& w3,
    const at::Tensor& hx, const at::Tensor& cx, bool reverse, at::IntArrayRef batch_sizes, int64_t mode,
    int64_t hidden_size, int64_t num_layers, bool has_biases, bool bidirectional, bool batch_first, bool train) {
  TORCH_CHECK(input.dim() == 3, "mkldnn_rnn_layer (meta): expected a 3-D input, but got ", input.dim(), "-D of size ",
              input.sizes());
  const bool grad = at::GradMode::is_enabled();
  // The workspace (the largest output) is about 16 times the output in an LSTM: a bound for the probe's size.
  const int64_t probe_bytes = bytes_of({input, w0, w1, w2, w3, hx, cx}) +
      20 * input.size(0) * input.size(1) * hidden_size * static_cast<int64_t>(input.element_size());
  const auto probe = cpu_probe(
      fmt::format("mkldnn_rnn_layer {}r{} bs[{}] m{} h{} l{} b{} bi{} bf{} t{} g{}",
                  key_of({input, w0, w1, w2, w3, hx, cx}), reverse, fmt::join(batch_sizes, ","), mode, hidden_size,
                  num_layers, has_biases, bidirectional, batch_first, train, grad),
      probe_bytes, [&](const std::function<void()>& open) {
        const auto i = cpu_twin(input), a = cpu_twin(w0), b = cpu_twin(w1), c = cpu_twin(w2), d = cpu_twin(w3),
                   h = cpu_twin(hx), s = cpu_twin(cx);
        open();
        auto [o, hy, cy, ws] = at::mkldnn_rnn_layer(i, a, b, c, d, h, s, reverse, batch_sizes, mode, hidden_size,
                                                     num_layers, has_biases, bidirectional, batch_first, train);
        return std::vector<at::Tensor>{o, hy, cy, ws};
      });
  TORCH_CHECK_NOT_IMPLEMENTED(probe.has_value() && probe->outputs.size() == 4,
                              not_measured("mkldnn_rnn_layer", probe_bytes));
  const auto held = hold_meta_bytes(probe->scratch_bytes);
  const auto& o = probe->outputs;
  return {meta_like(o[0], input.options()), meta_like(o[1], hx.options()), meta_like(o[2], cx.options()),
          meta_like(o[3], input.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> rnn_layer_backward_meta(
    const at::Tensor& input, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& w3, const at::Tensor& w4,
    const at::Tensor& hx, const at::Tensor& cx, const at::Tensor& output, const at::Tensor& hy, const at::Tensor& cy,
    const std::optional<at::Tensor>& grad_output, const std::optional<at::Tensor>& grad_hy,
    const std::optional<at::Tensor>& grad_cy, bool reverse, int64_t mode, int64_t hidden_size, int64_t num_layers,
    bool has_biases, bool train, bool bidirectional, at::IntArrayRef batch_sizes, bool batch_first,
    const at::Tensor& workspace) {
  const auto opt = [](const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); };
  const auto go = opt(grad_output), gh = opt(grad_hy), gc = opt(grad_cy);
  const std::vector<at::Tensor> ins{input, w1, w2, w3, w4, hx, cx, output, hy, cy, go, gh, gc, workspace};
  const int64_t probe_bytes = 3 * bytes_of(ins);
  const auto probe = cpu_probe(
      fmt::format("mkldnn_rnn_layer_backward {}r{} m{} h{} l{} b{} t{} bi{} bs[{}] bf{} hc{}", key_of(ins), reverse,
                  mode, hidden_size, num_layers, has_biases, train, bidirectional, fmt::join(batch_sizes, ","),
                  batch_first, hx.defined() && cx.defined() && hx.is_alias_of(cx)),
      probe_bytes, [&](const std::function<void()>& open) {
        std::vector<at::Tensor> t;
        for (const auto& x : ins) t.push_back(cpu_twin(x));
        const auto some = [](const at::Tensor& x) { return x.defined() ? std::optional<at::Tensor>(x) : std::nullopt; };
        open();
        auto r = at::mkldnn_rnn_layer_backward(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], some(t[10]),
                                               some(t[11]), some(t[12]), reverse, mode, hidden_size, num_layers,
                                               has_biases, train, bidirectional, batch_sizes, batch_first, t[13]);
        return std::vector<at::Tensor>{std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r),
                                       std::get<4>(r), std::get<5>(r), std::get<6>(r)};
      });
  TORCH_CHECK_NOT_IMPLEMENTED(probe.has_value() && probe->outputs.size() == 7,
                              not_measured("mkldnn_rnn_layer_backward", probe_bytes));
  const auto held = hold_meta_bytes(probe->scratch_bytes);
  const auto& o = probe->outputs;
  const auto options = input.options();
  return {meta_like(o[0], options), meta_like(o[1], options), meta_like(o[2], options), meta_like(o[3], options),
          meta_like(o[4], options), meta_like(o[5], options), meta_like(o[6], options)};
}

// ---------------------------------------------------------------------------
// The composite path as the CPU runs it (aten/src/ATen/native/RNN.cpp):
// for a CPU input, FullLayer and PackedLayer compute every step's input
// projection at once (one linear over the sequence) and the cells add it;
// for any other input each step projects its own. Meta runs the CPU's
// order, op for op, so its saved tensors and allocations are the CPU's.
enum class CellKind { kTanh, kRelu, kGru, kLstm };

struct CellParams {
  at::Tensor w_ih, w_hh, b_ih, b_hh, w_hr;  // b_* undefined without biases; w_hr only with projections
  at::Tensor linear_ih(const at::Tensor& x) const { return at::linear(x, w_ih, b_ih); }
  at::Tensor linear_hh(const at::Tensor& h) const { return at::linear(h, w_hh, b_hh); }
  at::Tensor matmul_hr(const at::Tensor& h) const { return w_hr.defined() ? at::matmul(h, w_hr.t()) : h; }
};

std::vector<CellParams> gather_params(at::TensorList p, bool has_biases, bool has_projections) {
  const size_t n = (has_biases ? 4 : 2) + (has_projections ? 1 : 0);
  TORCH_CHECK(p.size() % n == 0, "rnn (meta): got ", p.size(), " parameters, not a multiple of ", n);
  std::vector<CellParams> out;
  for (size_t i = 0; i < p.size(); i += n) {
    CellParams c{p[i], p[i + 1], {}, {}, {}};
    if (has_biases) {
      c.b_ih = p[i + 2];
      c.b_hh = p[i + 3];
    }
    if (has_projections) c.w_hr = p[i + n - 1];
    out.push_back(std::move(c));
  }
  return out;
}

using Hidden = std::pair<at::Tensor, at::Tensor>;  // (h, c); c only for an LSTM

// One step; `x` is the step's input projection (computed for all steps at once).
Hidden cell(CellKind kind, const at::Tensor& x, const Hidden& hidden, const CellParams& p) {
  switch (kind) {
    case CellKind::kTanh: return {at::tanh(p.linear_hh(hidden.first).add_(x)), {}};
    case CellKind::kRelu: return {at::relu(p.linear_hh(hidden.first).add_(x)), {}};
    case CellKind::kGru: {
      const auto ig = x.unsafe_chunk(3, 1);
      auto hg = p.linear_hh(hidden.first).unsafe_chunk(3, 1);
      const auto reset = hg[0].add_(ig[0]).sigmoid_();
      const auto input_gate = hg[1].add_(ig[1]).sigmoid_();
      const auto new_gate = ig[2].add(hg[2].mul_(reset)).tanh_();
      return {(hidden.first - new_gate).mul_(input_gate).add_(new_gate), {}};
    }
    case CellKind::kLstm: {
      const auto gates = p.linear_hh(hidden.first).add_(x);
      auto g = gates.unsafe_chunk(4, 1);
      auto in = g[0].sigmoid_();
      auto forget = g[1].sigmoid_();
      auto cell_gate = g[2].tanh_();
      auto out = g[3].sigmoid_();
      auto cy = (forget * hidden.second).add_(in * cell_gate);
      auto hy = out * cy.tanh();
      return {p.matmul_hr(hy), cy};
    }
  }
  TORCH_INTERNAL_ASSERT(false);
}

struct LayerOut {
  at::Tensor output;
  std::vector<Hidden> final;  // one per direction
};

std::vector<at::Tensor> run_steps(CellKind kind, const std::vector<at::Tensor>& steps, Hidden& hidden,
                                  const CellParams& p) {
  std::vector<at::Tensor> outs;
  for (const auto& x : steps) {
    hidden = cell(kind, x, hidden, p);
    outs.push_back(hidden.first);
  }
  TORCH_CHECK(!outs.empty(), "Expected sequence length to be larger than 0 in RNN");
  return outs;
}

// FullLayer and FullBidirectionalLayer, CPU branch.
LayerOut full_layer(CellKind kind, const at::Tensor& input, const std::vector<Hidden>& hidden,
                    const std::vector<CellParams>& p) {
  Hidden fw = hidden[0];
  auto input_w = p[0].linear_ih(input);
  auto steps = input_w.unbind(0);
  auto fw_out = at::stack(run_steps(kind, steps, fw, p[0]), 0);
  if (hidden.size() == 1) return {fw_out, {fw}};
  input_w = p[1].linear_ih(input);  // the forward's projection is freed only now, as on CPU
  steps = input_w.unbind(0);
  std::reverse(steps.begin(), steps.end());
  Hidden rev = hidden[1];
  auto rev_outs = run_steps(kind, steps, rev, p[1]);
  std::reverse(rev_outs.begin(), rev_outs.end());
  auto rev_out = at::stack(rev_outs, 0);
  return {at::cat({fw_out, rev_out}, fw_out.dim() - 1), {fw, rev}};
}

Hidden hidden_slice(const Hidden& h, int64_t start, int64_t end) {
  return {h.first.narrow(0, start, end - start), h.second.defined() ? h.second.narrow(0, start, end - start)
                                                                     : at::Tensor()};
}
Hidden hidden_concat(const std::vector<Hidden>& hs) {
  std::vector<at::Tensor> a, b;
  for (const auto& h : hs) {
    a.push_back(h.first);
    if (h.second.defined()) b.push_back(h.second);
  }
  return {at::cat(a, 0), b.empty() ? at::Tensor() : at::cat(b, 0)};
}

// PackedLayer and ReversedPackedLayer, CPU branch.
at::Tensor packed_direction(CellKind kind, const at::Tensor& data, const int64_t* batch_sizes, int64_t num_steps,
                            Hidden& hidden, const CellParams& p, bool reverse) {
  const auto input_w = p.linear_ih(data);
  std::vector<at::Tensor> outs;
  if (!reverse) {
    std::vector<Hidden> hiddens;
    int64_t offset = 0, last = batch_sizes[0];
    for (int64_t i = 0; i < num_steps; ++i) {
      const int64_t bs = batch_sizes[i];
      auto x = input_w.narrow(0, offset, bs);
      offset += bs;
      const int64_t dec = last - bs;
      if (dec > 0) {
        hiddens.push_back(hidden_slice(hidden, last - dec, last));
        hidden = hidden_slice(hidden, 0, last - dec);
      }
      last = bs;
      hidden = cell(kind, x, hidden, p);
      outs.push_back(hidden.first);
    }
    hiddens.push_back(hidden);
    std::reverse(hiddens.begin(), hiddens.end());
    auto out = at::cat(outs, 0);
    hidden = hidden_concat(hiddens);
    return out;
  }
  const Hidden initial = hidden;
  int64_t offset = data.size(0), last = batch_sizes[num_steps - 1];
  hidden = hidden_slice(initial, 0, last);
  for (int64_t i = num_steps - 1; i >= 0; --i) {
    const int64_t bs = batch_sizes[i];
    if (bs - last > 0) hidden = hidden_concat({hidden, hidden_slice(initial, last, bs)});
    auto x = input_w.narrow(0, offset - bs, bs);
    offset -= bs;
    last = bs;
    hidden = cell(kind, x, hidden, p);
    outs.push_back(hidden.first);
  }
  std::reverse(outs.begin(), outs.end());
  return at::cat(outs, 0);
}

// apply_layer_stack over full or packed layers; `hidden` holds one state
// per layer and direction. Returns the output and the final states.
std::pair<at::Tensor, std::vector<Hidden>> layer_stack(CellKind kind, at::Tensor input, const at::Tensor& batch_sizes,
                                                       std::vector<Hidden> hidden, const std::vector<CellParams>& p,
                                                       int64_t num_layers, double dropout, bool train,
                                                       bool bidirectional) {
  const size_t dirs = bidirectional ? 2 : 1;
  TORCH_CHECK(hidden.size() == static_cast<size_t>(num_layers) * dirs && p.size() == hidden.size(),
              "rnn (meta): expected ", num_layers * static_cast<int64_t>(dirs), " hidden states and parameter sets, but got ",
              hidden.size(), " and ", p.size());
  std::vector<Hidden> finals;
  for (int64_t l = 0; l < num_layers; ++l) {
    const auto at = static_cast<size_t>(l) * dirs;
    std::vector<Hidden> h(hidden.begin() + static_cast<std::ptrdiff_t>(at),
                          hidden.begin() + static_cast<std::ptrdiff_t>(at + dirs));
    std::vector<CellParams> w(p.begin() + static_cast<std::ptrdiff_t>(at), p.begin() + static_cast<std::ptrdiff_t>(at + dirs));
    if (batch_sizes.defined()) {
      TORCH_CHECK(batch_sizes.device().is_cpu() && batch_sizes.scalar_type() == at::kLong,
                  "rnn (meta): expected the packed sequence's batch_sizes as a CPU int64 tensor, but got ",
                  batch_sizes.toString());
      const auto bs = batch_sizes.contiguous();
      const int64_t* sizes = bs.data_ptr<int64_t>();
      const int64_t steps = bs.numel();
      TORCH_CHECK(steps > 0, "rnn (meta): a packed sequence with no steps");
      auto out = packed_direction(kind, input, sizes, steps, h[0], w[0], false);
      if (dirs == 2) {
        auto rev = packed_direction(kind, input, sizes, steps, h[1], w[1], true);
        out = at::cat({out, rev}, -1);
      }
      input = out;
      finals.insert(finals.end(), h.begin(), h.end());
    } else {
      auto r = full_layer(kind, input, h, w);
      input = r.output;
      finals.insert(finals.end(), r.final.begin(), r.final.end());
    }
    if (dropout != 0 && train && l < num_layers - 1) input = at::dropout(input, dropout, /*train=*/true);
  }
  return {input, finals};
}

// The CPU's composite path is this one only for CPU-standing meta inputs.
bool cpu_composite(const at::Tensor& input) { return conv_scratch_on_meta() && input.is_meta(); }

// RNN.cpp's ONE_HIDDEN_RNN (gru, rnn_tanh, rnn_relu) on the composite path:
// one hidden state per layer and direction; `batch_sizes` defined for a
// packed sequence.
std::tuple<at::Tensor, at::Tensor> one_hidden_rnn_meta(CellKind kind, const at::Tensor& input,
                                                       const at::Tensor& batch_sizes, const at::Tensor& hx,
                                                       at::TensorList params, bool has_biases, int64_t num_layers,
                                                       double dropout, bool train, bool bidirectional) {
  std::vector<Hidden> hidden;
  for (auto& h : hx.unbind(0)) hidden.push_back({h, {}});
  auto [out, finals] = layer_stack(kind, input, batch_sizes, hidden, gather_params(params, has_biases, false),
                                   num_layers, dropout, train, bidirectional);
  std::vector<at::Tensor> hy;
  for (auto& f : finals) hy.push_back(f.first);
  return {out, at::stack(hy, 0)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_composite_meta(const at::Tensor& input,
                                                                   const at::Tensor& batch_sizes, at::TensorList hx,
                                                                   at::TensorList params, bool has_biases,
                                                                   int64_t num_layers, double dropout, bool train,
                                                                   bool bidirectional) {
  TORCH_CHECK(hx.size() == 2, "lstm expects two hidden states");
  const bool projections = hx[0].size(2) != hx[1].size(2);
  auto hs = hx[0].unbind(0), cs = hx[1].unbind(0);
  std::vector<Hidden> hidden;
  for (size_t i = 0; i < hs.size(); ++i) hidden.push_back({hs[i], cs[i]});
  auto [out, finals] = layer_stack(CellKind::kLstm, input, batch_sizes, hidden,
                                   gather_params(params, has_biases, projections), num_layers, dropout, train,
                                   bidirectional);
  std::vector<at::Tensor> hy, cy;
  for (auto& f : finals) {
    hy.push_back(f.first);
    cy.push_back(f.second);
  }
  return {out, at::stack(hy, 0), at::stack(cy, 0)};
}

template <CellKind kKind>
std::tuple<at::Tensor, at::Tensor> rnn_input_autograd_meta(const at::Tensor& input, const at::Tensor& hx,
                                                           at::TensorList params, bool has_biases, int64_t num_layers,
                                                           double dropout, bool train, bool bidirectional,
                                                           bool batch_first) {
  if (!cpu_composite(input)) {
    switch (kKind) {
      case CellKind::kTanh:
        return at::native::rnn_tanh(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first);
      case CellKind::kRelu:
        return at::native::rnn_relu(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first);
      default:
        return at::native::gru(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first);
    }
  }
  auto r = one_hidden_rnn_meta(kKind, batch_first ? input.transpose(0, 1) : input, {}, hx, params, has_biases,
                               num_layers, dropout, train, bidirectional);
  if (batch_first) std::get<0>(r).transpose_(0, 1);
  return r;
}

template <CellKind kKind>
std::tuple<at::Tensor, at::Tensor> rnn_data_autograd_meta(const at::Tensor& data, const at::Tensor& batch_sizes,
                                                          const at::Tensor& hx, at::TensorList params, bool has_biases,
                                                          int64_t num_layers, double dropout, bool train,
                                                          bool bidirectional) {
  if (!cpu_composite(data)) {
    switch (kKind) {
      case CellKind::kTanh:
        return at::native::rnn_tanh(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional);
      case CellKind::kRelu:
        return at::native::rnn_relu(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional);
      default:
        return at::native::gru(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional);
    }
  }
  return one_hidden_rnn_meta(kKind, data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
                             bidirectional);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_data_autograd_meta(const at::Tensor& data,
                                                                       const at::Tensor& batch_sizes, at::TensorList hx,
                                                                       at::TensorList params, bool has_biases,
                                                                       int64_t num_layers, double dropout, bool train,
                                                                       bool bidirectional) {
  if (!cpu_composite(data)) {
    return at::native::lstm(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional);
  }
  return lstm_composite_meta(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional);
}

// mkldnn_rnn (aten/src/ATen/native/mkldnn/RNN.cpp) on meta tensors, above
// autograd: each at:: call below records its own backward node.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_autograd_meta(const at::Tensor& input, at::TensorList hx,
                                                                  at::TensorList params, bool has_biases,
                                                                  int64_t num_layers, double dropout, bool train,
                                                                  bool bidirectional, bool batch_first) {
  if (!cpu_lstm_on_onednn(input, hx)) {
    if (!cpu_composite(input)) {
      return at::native::lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first);
    }
    auto r = lstm_composite_meta(batch_first ? input.transpose(0, 1) : input, {}, hx, params, has_biases, num_layers,
                                 dropout, train, bidirectional);
    if (batch_first) std::get<0>(r) = std::get<0>(r).transpose(0, 1);
    return r;
  }
  const int64_t dirs = bidirectional ? 2 : 1;
  const int64_t stride = has_biases ? 4 : 2;
  TORCH_CHECK(static_cast<int64_t>(params.size()) == num_layers * dirs * stride, "lstm (meta): expected ",
              num_layers * dirs * stride, " parameters for ", num_layers, " layers, but got ", params.size());
  TORCH_CHECK(input.dim() == 3, "lstm (meta): expected a 3-D input, but got ", input.dim(), "-D of size ",
              input.sizes());
  at::Tensor layer_input = (batch_first ? input.transpose(0, 1) : input).contiguous();
  const auto h = hx[0].contiguous(), c = hx[1].contiguous();
  const int64_t hidden = h.size(2);
  std::vector<at::Tensor> layer_hy(static_cast<size_t>(num_layers * dirs)), layer_cy(layer_hy.size());
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    std::vector<at::Tensor> outs(static_cast<size_t>(dirs));
    for (int64_t dir = 0; dir < dirs; ++dir) {
      const int64_t index = layer * dirs + dir;
      const auto w = params.slice(static_cast<size_t>(index * stride), static_cast<size_t>(stride));
      auto r = at::mkldnn_rnn_layer(layer_input, w[0], w[1], has_biases ? w[2] : at::zeros(w[0].sizes(), w[0].options()),
                                    has_biases ? w[3] : at::zeros(w[1].sizes(), w[1].options()), h[index], c[index],
                                    /*reverse=*/dir > 0, /*batch_sizes=*/{}, kLstmMode, hidden, num_layers, has_biases,
                                    bidirectional, batch_first, train);
      outs[static_cast<size_t>(dir)] = std::get<0>(r);
      layer_hy[static_cast<size_t>(index)] = std::get<1>(r);
      layer_cy[static_cast<size_t>(index)] = std::get<2>(r);
    }
    layer_input = dirs == 1 ? outs[0] : at::cat(outs, -1);
    if (dropout != 0 && train && layer < num_layers - 1) {
      layer_input = at::dropout(layer_input, dropout, /*train=*/true);
    }
  }
  auto hy = at::stack(layer_hy, 0);
  auto cy = at::stack(layer_cy, 0);
  return {batch_first ? layer_input.transpose(0, 1) : layer_input, hy, cy};
}

} // namespace

void register_rnn_meta_kernels(torch::Library& meta) {
  auto missing = [](const char* name) {
    auto op = c10::Dispatcher::singleton().findOp({name, ""});
    return op.has_value() && !op->hasKernelForDispatchKey(c10::DispatchKey::Meta);
  };
  if (missing("aten::mkldnn_rnn_layer")) meta.impl("mkldnn_rnn_layer", TORCH_FN(rnn_layer_meta));
  if (missing("aten::mkldnn_rnn_layer_backward")) {
    meta.impl("mkldnn_rnn_layer_backward", TORCH_FN(rnn_layer_backward_meta));
  }
  auto& autograd = keep_for_process(
      std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::AutogradMeta, __FILE__, __LINE__));
  auto add = [&](const char* name, const char* overload, auto fn) {
    auto op = c10::Dispatcher::singleton().findOp({name, overload});
    if (op.has_value() && !op->hasKernelForDispatchKey(c10::DispatchKey::AutogradMeta)) {
      const std::string qualified = std::string(name + 6) + "." + overload;  // without "aten::"
      autograd.impl(qualified.c_str(), std::move(fn));
    }
  };
  add("aten::lstm", "input", TORCH_FN(lstm_autograd_meta));
  add("aten::lstm", "data", TORCH_FN(lstm_data_autograd_meta));
  add("aten::gru", "input", TORCH_FN(rnn_input_autograd_meta<CellKind::kGru>));
  add("aten::gru", "data", TORCH_FN(rnn_data_autograd_meta<CellKind::kGru>));
  add("aten::rnn_tanh", "input", TORCH_FN(rnn_input_autograd_meta<CellKind::kTanh>));
  add("aten::rnn_tanh", "data", TORCH_FN(rnn_data_autograd_meta<CellKind::kTanh>));
  add("aten::rnn_relu", "input", TORCH_FN(rnn_input_autograd_meta<CellKind::kRelu>));
  add("aten::rnn_relu", "data", TORCH_FN(rnn_data_autograd_meta<CellKind::kRelu>));
}

} // namespace trainmem::detail
