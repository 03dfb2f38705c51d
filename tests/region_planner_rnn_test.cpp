// The region planner on recurrent nets: an LSTM
// classifier with a bidirectional layer, an LSTMCell decoder unrolled over
// steps, and a GRU stack. Each is planned on meta (Note [Meta RNNs follow the
// CPU's kernel]), then run on CPU under each plan: saved bytes equal the
// meter's, the step peak is within 0.5 % of the CPU's, a budget plan fits,
// and gradients equal the plain run's (check_model).
#include <memory>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/rnn.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "trainmem/planner.h"
#include "region_planner_check.h"

namespace {

namespace nn = torch::nn;
using Modules = std::vector<std::shared_ptr<nn::Module>>;
using trainmem::Region;
using trainmem::RegionModel;
using trainmem::testing::check_model;

void expect_all_on_meta(const RegionModel& m, const std::string& name) {
  for (const auto& f : trainmem::plan_regions(m).cpu_fallbacks) {
    ADD_FAILURE() << name << ": region " << f.region << " was profiled on CPU: '" << f.op << "' (" << f.reason
                  << ")";
  }
}

at::Tensor class_loss(const at::Tensor& logits) {
  return at::cross_entropy_loss(logits, at::zeros({logits.size(0)}, logits.options().dtype(at::kLong)));
}

// A sequence classifier: a bidirectional LSTM, a second LSTM, a head on the last step.
TEST(RegionPlannerRnnTest, LstmClassifierWithABidirectionalLayer) {
  at::manual_seed(0);
  nn::Sequential net;
  nn::LSTM bi(nn::LSTMOptions(32, 64).batch_first(true).bidirectional(true));
  nn::LSTM uni(nn::LSTMOptions(128, 64).batch_first(true));
  nn::Linear head(64, 10);
  net->push_back("bi", bi);
  net->push_back("uni", uni);
  net->push_back("head", head);
  RegionModel m;
  m.regions = {Region("bi", [bi](const at::Tensor& x) mutable { return std::get<0>(bi->forward(x)); }, Modules{bi.ptr()}),
               Region("uni", [uni](const at::Tensor& x) mutable { return std::get<0>(uni->forward(x)); },
                      Modules{uni.ptr()}),
               Region("head", [head](const at::Tensor& x) mutable { return head->forward(x.select(1, -1)); },
                      Modules{head.ptr()})};
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  m.input = [](c10::Device device) { return at::randn({16, 24, 32}, at::TensorOptions().device(device)); };
  m.loss = class_loss;
  m.optimizer = &adam;
  check_model("LSTM classifier", *net, m, &adam);
  expect_all_on_meta(m, "LSTM classifier");
}

// A decoder: an LSTMCell unrolled over the steps of its input, the state
// carried from step to step (the cell's gates are changed in place: a
// selective plan must recompute them, not cache them).
TEST(RegionPlannerRnnTest, LstmCellDecoderUnrolled) {
  at::manual_seed(0);
  struct Decoder : nn::Module {
    nn::Linear embed{register_module("embed", nn::Linear(16, 48))};
    nn::LSTMCell cell{register_module("cell", nn::LSTMCell(48, 48))};
    nn::Linear head{register_module("head", nn::Linear(48, 10))};
  };
  auto net = std::make_shared<Decoder>();
  RegionModel m;
  m.regions = {
      Region("embed", [net](const at::Tensor& x) { return at::tanh(net->embed->forward(x)); }, Modules{net->embed.ptr()}),
      Region("decoder",
             [net](const at::Tensor& x) {
               std::optional<std::tuple<at::Tensor, at::Tensor>> state;
               std::vector<at::Tensor> hs;
               for (int64_t t = 0; t < x.size(1); ++t) {
                 state = net->cell->forward(x.select(1, t), state);
                 hs.push_back(std::get<0>(*state));
               }
               return at::stack(hs, 1);
             },
             Modules{net->cell.ptr()}),
      Region("head", [net](const at::Tensor& x) { return net->head->forward(x.mean(1)); }, Modules{net->head.ptr()})};
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  m.input = [](c10::Device device) { return at::randn({32, 12, 16}, at::TensorOptions().device(device)); };
  m.loss = class_loss;
  m.optimizer = &sgd;
  check_model("LSTMCell decoder", *net, m, &sgd);
  expect_all_on_meta(m, "LSTMCell decoder");
}

TEST(RegionPlannerRnnTest, GruStack) {
  at::manual_seed(0);
  nn::Sequential net;
  nn::GRU g1(nn::GRUOptions(24, 40));
  nn::GRU g2(nn::GRUOptions(40, 40).num_layers(2).dropout(0.1));
  nn::Linear head(40, 10);
  net->push_back("g1", g1);
  net->push_back("g2", g2);
  net->push_back("head", head);
  RegionModel m;
  m.regions = {Region("g1", [g1](const at::Tensor& x) mutable { return std::get<0>(g1->forward(x)); }, Modules{g1.ptr()}),
               Region("g2", [g2](const at::Tensor& x) mutable { return std::get<0>(g2->forward(x)); }, Modules{g2.ptr()}),
               Region("head", [head](const at::Tensor& x) mutable { return head->forward(x.select(0, -1)); },
                      Modules{head.ptr()})};
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  m.input = [](c10::Device device) { return at::randn({20, 16, 24}, at::TensorOptions().device(device)); };
  m.loss = class_loss;
  m.optimizer = &adam;
  check_model("GRU stack", *net, m, &adam);
  expect_all_on_meta(m, "GRU stack");
}

} // namespace
