// A prediction that fails leaves nothing behind (Note [Predictions leave no
// trace]): a throw in the forward, in the meta backward (a custom autograd
// Function whose backward refuses meta) or in the optimizer's step (an
// optimizer whose step throws after it has made its state), inside
// predict_step_peak and predict_step_function, leaves the module's gradients,
// the parameters' autograd metadata, the optimizer's state and the buffers as
// they were; the next predictions, and the next real CPU steps after
// materialize(), give the same figures as a twin that never saw the failures.
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "trainmem/allocator.h"
#include "trainmem/meta.h"
#include "trainmem/planner.h"
#include "support/error_of.h"

namespace {

using trainmem::testing::error_of;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    l1 = register_module("l1", torch::nn::Linear(16, 32));
    bn = register_module("bn", torch::nn::BatchNorm1d(32));
    l2 = register_module("l2", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return l2->forward(bn->forward(l1->forward(x)).relu()); }
  torch::nn::Linear l1{nullptr}, l2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

// Adam whose step throws once it has updated the parameters and made its
// state, on its `throw_at`-th call (0: never).
struct ThrowingAdam : torch::optim::Adam {
  using torch::optim::Adam::Adam;
  at::Tensor step(LossClosure closure = nullptr) override {
    auto loss = torch::optim::Adam::step(closure);
    ++calls;
    TORCH_CHECK(throw_at == 0 || calls != throw_at, "the optimizer's step failed on purpose");
    return loss;
  }
  int throw_at = 0;
  int calls = 0;
};

// Identity forward; its backward refuses meta gradients.
struct RefusesMetaBackward : torch::autograd::Function<RefusesMetaBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!grads[0].is_meta(), "the backward failed on meta on purpose");
    return grads;
  }
};

const std::vector<int64_t> kInput = {8, 16};

Net make_on_meta() {
  torch::manual_seed(0);
  trainmem::MetaInitGuard meta;
  return Net();
}

// What a module and its optimizer hold: each gradient and buffer (the tensor
// itself), each parameter's autograd metadata, the optimizer's state.
struct Held {
  std::vector<at::Tensor> grads;
  std::vector<at::Tensor> buffers;
  std::vector<std::vector<int64_t>> buffer_sizes;
  std::vector<std::pair<void*, const torch::optim::OptimizerParamState*>> state;
};

Held held(torch::nn::Module& m, torch::optim::Optimizer& opt) {
  Held h;
  for (const auto& p : m.parameters()) {
    h.grads.push_back(p.grad());
  }
  for (const auto& b : m.buffers()) {
    h.buffers.push_back(b);
    h.buffer_sizes.push_back(b.sizes().vec());
  }
  for (const auto& [key, state] : opt.state()) {
    h.state.emplace_back(key, state.get());
  }
  std::sort(h.state.begin(), h.state.end());
  return h;
}

void expect_as_before(torch::nn::Module& m, torch::optim::Optimizer& opt, const Held& before, const std::string& what) {
  const auto now = held(m, opt);
  ASSERT_EQ(now.grads.size(), before.grads.size()) << what;
  for (size_t i = 0; i < now.grads.size(); ++i) {
    EXPECT_EQ(now.grads[i].defined(), before.grads[i].defined()) << what << ": gradient " << i;
    if (now.grads[i].defined()) {
      EXPECT_TRUE(now.grads[i].is_same(before.grads[i])) << what << ": gradient " << i << " is another tensor";
    }
  }
  for (const auto& p : m.parameters()) {
    EXPECT_TRUE(p.is_leaf()) << what;
    EXPECT_TRUE(p.requires_grad()) << what;
    EXPECT_EQ(p.grad_fn(), nullptr) << what;
    EXPECT_TRUE(torch::autograd::impl::hooks(p).empty()) << what << ": a tensor hook left on a parameter";
    if (auto acc = torch::autograd::impl::try_get_grad_accumulator(p)) {
      EXPECT_TRUE(acc->post_hooks().empty()) << what << ": a post hook left on a gradient accumulator";
      EXPECT_TRUE(acc->pre_hooks().empty()) << what << ": a pre hook left on a gradient accumulator";
    }
  }
  ASSERT_EQ(now.buffers.size(), before.buffers.size()) << what;
  for (size_t i = 0; i < now.buffers.size(); ++i) {
    EXPECT_TRUE(now.buffers[i].is_same(before.buffers[i])) << what << ": buffer " << i;
    EXPECT_EQ(now.buffers[i].sizes().vec(), before.buffer_sizes[i]) << what << ": buffer " << i;
  }
  EXPECT_EQ(now.state, before.state) << what << ": the optimizer's state changed";
}

void expect_same(const trainmem::StepPeak& a, const trainmem::StepPeak& b, const std::string& what) {
  EXPECT_EQ(a.peak_bytes, b.peak_bytes) << what;
  EXPECT_EQ(a.forward_peak_bytes, b.forward_peak_bytes) << what;
  EXPECT_EQ(a.backward_peak_bytes, b.backward_peak_bytes) << what;
  EXPECT_EQ(a.optimizer_peak_bytes, b.optimizer_peak_bytes) << what;
  EXPECT_EQ(a.activation_bytes, b.activation_bytes) << what;
  EXPECT_EQ(a.optimizer_state_bytes, b.optimizer_state_bytes) << what;
  EXPECT_EQ(a.grad_bytes, b.grad_bytes) << what;
  EXPECT_EQ(a.param_bytes, b.param_bytes) << what;
  EXPECT_EQ(a.buffer_bytes, b.buffer_bytes) << what;
}

void expect_same(const trainmem::StepFunctionPeak& a, const trainmem::StepFunctionPeak& b, const std::string& what) {
  EXPECT_EQ(a.peak_bytes, b.peak_bytes) << what;
  EXPECT_EQ(a.end_bytes, b.end_bytes) << what;
  EXPECT_EQ(a.start_bytes, b.start_bytes) << what;
  EXPECT_EQ(a.grad_bytes, b.grad_bytes) << what;
  EXPECT_EQ(a.optimizer_state_bytes, b.optimizer_state_bytes) << what;
}

TEST(PredictFailureTest, AFailedPredictionLeavesNothingBehind) {
  trainmem::CpuMemoryTracker::install();
  Net net = make_on_meta();
  Net twin = make_on_meta();
  ThrowingAdam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
  ThrowingAdam twin_opt(twin->parameters(), torch::optim::AdamOptions(1e-3));
  // Something to keep: gradients and Adam's state from a meta step of their
  // own, outside any prediction.
  for (auto [n, o] : {std::pair<Net*, ThrowingAdam*>{&net, &opt}, {&twin, &twin_opt}}) {
    o->zero_grad();
    (*n)->forward(at::empty(kInput, at::kMeta)).pow(2).mean().backward();
    o->step();
    o->calls = 0;
  }
  const Held before = held(*net, opt);
  ASSERT_FALSE(before.state.empty());
  ASSERT_TRUE(before.grads[0].defined());

  auto loss_of = [](Net& n) { return n->forward(at::randn(kInput)).pow(2).mean(); };
  auto step_of = [&](Net& n, ThrowingAdam& o) {
    return [&n, &o, loss_of] {
      o.zero_grad();
      loss_of(n).backward();
      o.step();
    };
  };
  struct Failure {
    std::string what;
    std::function<at::Tensor()> loss;
    int throw_at;         // the optimizer's call that throws (0: none)
    std::string message;  // what the error says
  };
  const std::vector<Failure> failures = {
      {"a throw in the forward",
       [&]() -> at::Tensor {
         net->forward(at::randn(kInput));
         TORCH_CHECK(false, "the forward failed on purpose");
       },
       0, "the forward failed on purpose"},
      {"an op with no meta path in the forward",
       [&] {
         const auto y = net->forward(at::randn(kInput));
         return y.pow(2).mean() + at::nonzero(y).size(0);
       },
       0, "trainmem: aten::nonzero has no meta kernel"},
      {"a throw in the meta backward",
       [&] { return RefusesMetaBackward::apply(net->forward(at::randn(kInput))).pow(2).mean(); }, 0,
       "the backward failed on meta on purpose"},
      {"a throw in the warm-up step's optimizer step", [&] { return loss_of(net); }, 1,
       "the optimizer's step failed on purpose"},
      {"a throw in the counted step's optimizer step", [&] { return loss_of(net); }, 2,
       "the optimizer's step failed on purpose"},
  };
  for (const auto& f : failures) {
    opt.throw_at = f.throw_at;
    opt.calls = 0;
    const auto peak_error = error_of([&] { trainmem::predict_step_peak(*net, f.loss, &opt); });
    EXPECT_NE(peak_error.find(f.message), std::string::npos) << f.what << ": " << peak_error;
    expect_as_before(*net, opt, before, "predict_step_peak, " + f.what);
    opt.calls = 0;
    const auto function_error = error_of([&] {
      trainmem::predict_step_function({net.get()}, {&opt}, [&] {
        opt.zero_grad();
        f.loss().backward();
        opt.step();
      });
    });
    EXPECT_NE(function_error.find(f.message), std::string::npos) << f.what << ": " << function_error;
    expect_as_before(*net, opt, before, "predict_step_function, " + f.what);
  }
  opt.throw_at = 0;

  // The next predictions: the twin's figures.
  expect_same(trainmem::predict_step_peak(*net, [&] { return loss_of(net); }, &opt),
              trainmem::predict_step_peak(*twin, [&] { return loss_of(twin); }, &twin_opt), "predict_step_peak");
  expect_same(trainmem::predict_step_function({net.get()}, {&opt}, step_of(net, opt)),
              trainmem::predict_step_function({twin.get()}, {&twin_opt}, step_of(twin, twin_opt)),
              "predict_step_function");
  expect_as_before(*net, opt, before, "after the predictions that worked");

  // The next real steps on CPU: the twin's figures, parameters, state and
  // buffers. (The meta state made above is the test's, not a prediction's:
  // both optimizers drop it before their parameters get real storage.)
  for (auto [n, o] : {std::pair<Net*, ThrowingAdam*>{&net, &opt}, {&twin, &twin_opt}}) {
    o->state().clear();
    torch::manual_seed(1);
    trainmem::materialize(**n, at::kCPU);
  }
  auto measure = [&](Net& n, ThrowingAdam& o) {
    torch::manual_seed(2);
    return trainmem::measure_step_peak(*n, [&] { return loss_of(n); }, &o);
  };
  const auto measured = measure(net, opt);
  expect_same(measured, measure(twin, twin_opt), "measure_step_peak");
  for (auto [n, o] : {std::pair<Net*, ThrowingAdam*>{&net, &opt}, {&twin, &twin_opt}}) {
    torch::manual_seed(3);
    step_of(*n, *o)();
  }
  const auto params = net->parameters(), twin_params = twin->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::equal(params[i], twin_params[i])) << "parameter " << i;
    EXPECT_TRUE(at::equal(params[i].grad(), twin_params[i].grad())) << "gradient " << i;
  }
  const auto buffers = net->buffers(), twin_buffers = twin->buffers();
  for (size_t i = 0; i < buffers.size(); ++i) {
    EXPECT_TRUE(at::equal(buffers[i], twin_buffers[i])) << "buffer " << i;
  }
  ASSERT_EQ(opt.state().size(), twin_opt.state().size());
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& s = static_cast<const torch::optim::AdamParamState&>(
        *opt.state().at(params[i].unsafeGetTensorImpl()));
    const auto& t = static_cast<const torch::optim::AdamParamState&>(
        *twin_opt.state().at(twin_params[i].unsafeGetTensorImpl()));
    EXPECT_EQ(s.step(), t.step());
    EXPECT_TRUE(at::equal(s.exp_avg(), t.exp_avg())) << "exp_avg " << i;
    EXPECT_TRUE(at::equal(s.exp_avg_sq(), t.exp_avg_sq())) << "exp_avg_sq " << i;
  }
  std::printf("after the failures: measured step peak %lld B, forward %lld B, backward %lld B, optimizer %lld B\n",
              static_cast<long long>(measured.peak_bytes), static_cast<long long>(measured.forward_peak_bytes),
              static_cast<long long>(measured.backward_peak_bytes),
              static_cast<long long>(measured.optimizer_peak_bytes));
}

}  // namespace
