// trainmem::GradScaler against PyTorch's Python torch.amp.GradScaler("cpu"):
// same weights (exchanged as raw fp32 files), same forced overflows, same
// scale sequence, same skipped steps, bit-identical parameters.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include "trainmem/grad_scaler.h"
#include "trainmem/optimizer_in_backward.h"

namespace {

namespace fs = std::filesystem;

void write_raw(const fs::path& path, const at::Tensor& t) {
  const auto c = t.detach().contiguous();
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
}

at::Tensor read_raw(const fs::path& path, at::IntArrayRef shape) {
  auto t = at::empty(shape, at::kFloat);
  std::ifstream f(path, std::ios::binary);
  f.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  EXPECT_EQ(f.gcount(), static_cast<std::streamsize>(t.nbytes())) << path;
  return t;
}

struct OracleSetup {
  int64_t d_in = 8, d_hidden = 16, d_out = 4, batch = 32, steps = 12;
  std::vector<int64_t> overflow_steps = {2, 3, 8};
  double init_scale = 1024.0, growth_factor = 2.0, backoff_factor = 0.5, lr = 0.05, max_norm = 0.5;
  int64_t growth_interval = 3;
};

torch::nn::Sequential make_net(const OracleSetup& s) {
  return torch::nn::Sequential(torch::nn::Linear(s.d_in, s.d_hidden), torch::nn::Tanh(),
                               torch::nn::Linear(s.d_hidden, s.d_out));
}

TEST(GradScalerTest, MatchesPythonGradScaler) {
  // "PYTHON SCRIPT", set by tests/CMakeLists.txt when a Python with torch exists.
  const char* oracle = std::getenv("TRAINMEM_GRAD_SCALER_ORACLE");
  if (oracle == nullptr || std::string(oracle).empty()) {
    GTEST_SKIP() << "no Python with torch (TRAINMEM_GRAD_SCALER_ORACLE) to run the oracle";
  }
  at::set_num_threads(1);
  const OracleSetup s;
  torch::manual_seed(0);
  auto net = make_net(s);
  const auto x = torch::randn({s.batch, s.d_in});
  const auto target = torch::randn({s.batch, s.d_out});
  const fs::path dir = fs::temp_directory_path() / ("trainmem_grad_scaler_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    write_raw(dir / ("param_" + std::to_string(i) + ".bin"), params[i]);
  }
  write_raw(dir / "x.bin", x);
  write_raw(dir / "target.bin", target);
  nlohmann::json config = {{"d_in", s.d_in}, {"d_hidden", s.d_hidden}, {"d_out", s.d_out}, {"batch", s.batch},
                           {"steps", s.steps}, {"overflow_steps", s.overflow_steps}, {"init_scale", s.init_scale},
                           {"growth_factor", s.growth_factor}, {"backoff_factor", s.backoff_factor},
                           {"growth_interval", s.growth_interval}, {"lr", s.lr}, {"max_norm", s.max_norm}};
  std::ofstream(dir / "config.json") << config.dump();

  // The C++ side: the recipe of torch.amp's docs, unscale_ before clipping.
  torch::optim::SGD opt(params, torch::optim::SGDOptions(s.lr));
  trainmem::GradScaler scaler(trainmem::GradScalerOptions()
                                  .init_scale(s.init_scale)
                                  .growth_factor(s.growth_factor)
                                  .backoff_factor(s.backoff_factor)
                                  .growth_interval(s.growth_interval));
  std::vector<double> scales;
  std::vector<bool> stepped;
  for (int64_t step = 0; step < s.steps; ++step) {
    opt.zero_grad();
    auto loss = (net->forward(x) - target).pow(2).mean();
    if (std::find(s.overflow_steps.begin(), s.overflow_steps.end(), step) != s.overflow_steps.end()) {
      loss = loss * std::numeric_limits<float>::infinity();
    }
    scaler.scale(loss).backward();
    scaler.unscale_(opt);
    torch::nn::utils::clip_grad_norm_(params, s.max_norm);
    stepped.push_back(scaler.step(opt));
    scaler.update();
    scales.push_back(scaler.get_scale());
  }

  const std::string cmd = std::string(oracle) + " " + dir.string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  nlohmann::json py;
  std::ifstream(dir / "python.json") >> py;
  const auto py_scales = py["scales"].get<std::vector<double>>();
  const auto py_stepped = py["stepped"].get<std::vector<bool>>();
  EXPECT_EQ(scales, py_scales);
  EXPECT_EQ(stepped, py_stepped);
  EXPECT_EQ(scaler.growth_tracker(), py["growth_tracker"].get<int64_t>());
  // The schedule the options imply, worked by hand: 1024; steps 0, 1 finite;
  // 2 and 3 overflow (512, 256); 4, 5, 6 finite: grow (512); 7 finite; 8
  // overflows (256); 9, 10, 11 finite: grow (512).
  const std::vector<double> expected = {1024, 1024, 512, 256, 256, 256, 512, 512, 256, 256, 256, 512};
  EXPECT_EQ(scales, expected);
  EXPECT_EQ(std::count(stepped.begin(), stepped.end(), false), 3);
  for (size_t i = 0; i < params.size(); ++i) {
    const auto theirs = read_raw(dir / ("py_param_" + std::to_string(i) + ".bin"), params[i].sizes());
    EXPECT_TRUE(at::equal(params[i].detach(), theirs))
        << "parameter " << i << " differs by " << (params[i].detach() - theirs).abs().max().item<float>();
  }
  fs::remove_all(dir);
}

TEST(GradScalerTest, SkipsNonFiniteStepsAndBacksOff) {
  auto lin = torch::nn::Linear(3, 1);
  torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
  trainmem::GradScaler scaler(trainmem::GradScalerOptions().init_scale(8.0).growth_interval(2));
  const auto before = lin->weight.detach().clone();
  auto loss = lin->forward(torch::ones({2, 3})).sum() * std::numeric_limits<float>::quiet_NaN();
  scaler.scale(loss).backward();
  EXPECT_FALSE(scaler.step(opt));
  EXPECT_TRUE(at::equal(before, lin->weight.detach()));  // skipped
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 4.0);  // 8 x 0.5
  EXPECT_EQ(scaler.growth_tracker(), 0);
  // Two finite steps in a row: the scale doubles, the tracker restarts.
  for (int i = 0; i < 2; ++i) {
    opt.zero_grad();
    scaler.scale(lin->forward(torch::ones({2, 3})).sum()).backward();
    // Gradients are scaled by 4 until unscale_: d(sum)/d(bias) = 2 rows x 4.
    EXPECT_EQ(lin->bias.grad().item<float>(), 8.0f);
    EXPECT_TRUE(scaler.step(opt));
    EXPECT_EQ(lin->bias.grad().item<float>(), 2.0f);  // unscaled by step()
    scaler.update();
  }
  EXPECT_EQ(scaler.get_scale(), 8.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(GradScalerTest, RefusesMisuse) {
  auto lin = torch::nn::Linear(2, 1);
  torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
  trainmem::GradScaler scaler;
  EXPECT_THROW(scaler.unscale_(opt), c10::Error);  // no scale yet
  scaler.scale(lin->forward(torch::ones({1, 2})).sum()).backward();
  scaler.unscale_(opt);
  EXPECT_THROW(scaler.unscale_(opt), c10::Error);  // twice before update()
  scaler.step(opt);
  EXPECT_THROW(scaler.step(opt), c10::Error);      // twice before update()
  scaler.update();
  EXPECT_THROW(trainmem::GradScaler(trainmem::GradScalerOptions().growth_factor(0.5)), c10::Error);
  // fp16 gradients cannot be unscaled (PyTorch: "Attempting to unscale FP16 gradients.").
  auto half = torch::nn::Linear(2, 1);
  half->to(at::kHalf);
  torch::optim::SGD opt16(half->parameters(), torch::optim::SGDOptions(0.1));
  for (auto& p : half->parameters()) {
    p.mutable_grad() = at::ones_like(p);
  }
  trainmem::GradScaler s16;
  s16.scale(at::ones({}, at::kFloat));
  EXPECT_THROW(s16.unscale_(opt16), c10::Error);
}

TEST(GradScalerTest, RefusesOptimizerInBackward) {
  auto lin = torch::nn::Linear(2, 1);
  trainmem::OptimizerInBackward oib(lin->parameters(), [](std::vector<at::Tensor> p) {
    return std::make_unique<torch::optim::SGD>(std::move(p), torch::optim::SGDOptions(0.1));
  });
  trainmem::GradScaler scaler;
  try {
    scaler.step(oib);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("OptimizerInBackward"), std::string::npos) << e.what();
  }
}

TEST(GradScalerTest, SavesAndLoadsItsState) {
  trainmem::GradScaler a(trainmem::GradScalerOptions().init_scale(256).growth_interval(7));
  auto lin = torch::nn::Linear(2, 1);
  torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
  a.scale(lin->forward(torch::ones({1, 2})).sum()).backward();
  a.step(opt);
  a.update();  // one finite step: tracker 1
  torch::serialize::OutputArchive out;
  a.save(out);
  std::stringstream buffer;
  out.save_to(buffer);
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  trainmem::GradScaler b;
  b.load(in);
  EXPECT_EQ(b.get_scale(), 256.0);
  EXPECT_EQ(b.growth_tracker(), 1);
  EXPECT_EQ(b.state_dict().growth_interval, 7);
}

TEST(GradScalerTest, DisabledIsAPassThrough) {
  trainmem::GradScaler off(trainmem::GradScalerOptions().enabled(false));
  auto loss = at::full({}, 3.0);
  EXPECT_TRUE(at::equal(off.scale(loss), loss));
  EXPECT_EQ(off.get_scale(), 1.0);
}

} // namespace
