#pragma once
// Small text helpers shared by the report writers and the trainers.
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

namespace trainmem::detail {

// `s` with &, <, >, " and ' as HTML entities (html.cpp, distributed_report.cpp).
inline std::string html_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// The bundled trainers' optimizers by name: "adamw", "adam", else SGD with
// momentum 0.9 (trainer.cpp defines it; distributed_trainer.cpp uses it too).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& name, std::vector<at::Tensor> params,
                                                        double lr);

} // namespace trainmem::detail
