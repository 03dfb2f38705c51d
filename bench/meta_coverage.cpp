// Which ATen ops with a CPU kernel have a meta path in this LibTorch, before
// trainmem's meta kernels and after: LibTorch's own Meta kernel, a composite
// kernel (which runs on meta as far as the ops it calls do), trainmem's own
// meta kernels, or the generic fallback (Note [A meta path for ops without a
// meta kernel], src/core/meta_fallback.cpp). Prints the table of that Note in
// docs/design.md; --list also prints the ops of each row.
//
//   trainmem_meta_coverage [--list]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "trainmem/planner.h"

namespace {

using c10::DispatchKey;

std::string name_of(const c10::OperatorName& n) {
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

bool composite(const c10::OperatorHandle& op) {
  return op.hasKernelForDispatchKey(DispatchKey::CompositeExplicitAutograd) ||
      op.hasKernelForDispatchKey(DispatchKey::CompositeExplicitAutogradNonFunctional) ||
      op.hasKernelForDispatchKey(DispatchKey::CompositeImplicitAutograd);
}

// The file that registered the op's Meta kernel (the newest registration).
std::string meta_registered_at(const c10::OperatorHandle& op) {
  const std::string state = op.dumpState();
  const std::string lead = "\nMeta: registered at ";
  const auto at = state.find(lead);
  if (at == std::string::npos) {
    return "";
  }
  const auto start = at + lead.size();
  return state.substr(start, state.find(' ', start) - start);
}

// Why the fallback refuses every call of `op`, or "" when it runs some.
std::string refused_by_schema(const c10::OperatorHandle& op) {
  if (op.hasTag(at::Tag::dynamic_output_shape)) {
    return "tagged dynamic_output_shape";
  }
  if (op.hasTag(at::Tag::data_dependent_output)) {
    return "tagged data_dependent_output";
  }
  for (const auto& ret : op.schema().returns()) {
    const auto& type = ret.real_type();
    const bool tensor = type->kind() == c10::TypeKind::TensorType ||
        ((type->kind() == c10::TypeKind::OptionalType || type->kind() == c10::TypeKind::ListType) &&
         type->containedType(0)->kind() == c10::TypeKind::TensorType);
    if (!tensor) {
      return "returns a " + type->str();
    }
  }
  if (op.schema().name() == "aten::from_file") {
    return "reads a file";
  }
  return "";
}

// Ops that take or return a tensor that is not strided and dense
// (quantized, sparse, mkldnn, nested), by name: the fallback refuses them when
// it sees one.
bool not_strided_by_name(const std::string& name) {
  if (name.find("fake_quantize") != std::string::npos) {
    return false;  // float in, float out
  }
  for (const char* part :
       {"quantize_per_", "_make_per_", "_empty_affine_quantized", "_empty_per_channel_affine_quantized",
        "quantized_lstm", "quantized_gru", "dequantize", "_to_sparse", "to_mkldnn", "_nested_from_padded",
        "_nested_tensor_from_mask", "_nested_view_from_buffer"}) {
    if (name.find(part) != std::string::npos) {
      return true;
    }
  }
  return false;
}

// Calls a model or a loss makes, many through composite kernels, on small
// meta tensors: whether each runs before and after (a composite kernel runs
// on meta only as far as the ops it calls do).
struct Call {
  const char* what;
  void (*run)();
};

at::Tensor meta(std::initializer_list<int64_t> sizes, at::ScalarType dtype = at::kFloat) {
  return at::empty(sizes, at::TensorOptions().device(at::kMeta).dtype(dtype));
}

const Call kCalls[] = {
    {"logsumexp (Categorical's normalisation)", [] { at::logsumexp(meta({8, 6}), {1}); }},
    {"where(cond, x, y)", [] { at::where(meta({8, 6}, at::kBool), meta({8, 6}), meta({8, 6})); }},
    {"where(cond, x, 0.0)", [] { at::where(meta({8, 6}, at::kBool), meta({8, 6}), 0.0); }},
    {"logical_and / or / not",
     [] { at::logical_not(at::logical_or(at::logical_and(meta({4}), meta({4})), meta({4}))); }},
    {"abs", [] { at::abs(meta({8, 6})); }},
    {"max() / min() (full reduction)", [] { at::max(meta({8, 6})); }},
    {"std / var", [] { at::std(meta({8, 6}), {1}); }},
    {"dot", [] { at::dot(meta({6}), meta({6})); }},
    {"flip / roll", [] { at::roll(at::flip(meta({8, 6}), {0}), {1}, {1}); }},
    {"prod", [] { at::prod(meta({8, 6})); }},
    {"hardtanh / relu6", [] { at::hardtanh(meta({8, 6})); }},
    {"hardswish", [] { at::hardswish(meta({8, 6})); }},
    {"logit", [] { at::logit(meta({8, 6})); }},
    {"huber_loss", [] { at::huber_loss(meta({8, 6}), meta({8, 6})); }},
    {"isnan", [] { at::isnan(meta({8, 6})); }},
    {"median", [] { at::median(meta({8, 6})); }},
    {"cdist (p = 1)", [] { at::cdist(meta({8, 6}), meta({4, 6}), 1.0); }},
    {"multinomial", [] { at::multinomial(meta({8, 6}), 2); }},
    {"nonzero (refused: shape depends on values)", [] { at::nonzero(meta({8, 6})); }},
};

std::vector<bool> run_calls() {
  std::vector<bool> ran;
  for (const auto& c : kCalls) {
    try {
      c.run();
      ran.push_back(true);
    } catch (const c10::Error&) {
      ran.push_back(false);
    }
  }
  return ran;
}

} // namespace

int main(int argc, char** argv) {
  const bool list = argc > 1 && std::strcmp(argv[1], "--list") == 0;
  auto& dispatcher = c10::Dispatcher::singleton();
  struct Before {
    bool own = false;
    bool composite = false;
  };
  std::map<std::string, Before> cpu_ops;
  std::vector<c10::OperatorName> names;
  for (const auto& n : dispatcher.getAllOpNames()) {
    if (n.name.rfind("aten::", 0) != 0) {
      continue;
    }
    const auto op = dispatcher.findOp(n);
    if (!op || !op->hasKernelForDispatchKey(DispatchKey::CPU)) {
      continue;
    }
    cpu_ops[name_of(n)] = {op->hasKernelForDispatchKey(DispatchKey::Meta), composite(*op)};
    names.push_back(n);
  }
  const auto calls_before = run_calls();
  trainmem::enable_cpu_meta_kernels();  // every meta kernel trainmem adds, the fallback last
  const auto calls_after = run_calls();
  std::map<std::string, std::vector<std::string>> rows;
  for (const auto& n : names) {
    const auto name = name_of(n);
    const auto& before = cpu_ops[name];
    const auto op = dispatcher.findOp(n);
    if (before.own) {
      rows["1 LibTorch's Meta kernel"].push_back(name);
    } else if (before.composite) {
      rows["2 composite"].push_back(name);
    } else if (meta_registered_at(*op).find("meta_fallback.cpp") == std::string::npos) {
      rows[op->hasKernelForDispatchKey(DispatchKey::Meta) ? "3 trainmem's own meta kernel" : "6 none"].push_back(
          name);
    } else if (const auto why = refused_by_schema(*op); !why.empty()) {
      rows["5 fallback refuses: " + why].push_back(name);
    } else if (not_strided_by_name(name)) {
      rows["5 fallback refuses: a quantized, sparse, mkldnn or nested tensor"].push_back(name);
    } else {
      rows["4 the fallback"].push_back(name);
    }
  }
  const size_t total = names.size();
  const size_t libtorch = rows["1 LibTorch's Meta kernel"].size() + rows["2 composite"].size();
  const size_t before = libtorch + rows["3 trainmem's own meta kernel"].size();
  const size_t now = before + rows["4 the fallback"].size();
  std::printf("ATen ops with a CPU kernel: %zu\n\n", total);
  std::printf("| meta path | ops |\n|---|---:|\n");
  for (const auto& [row, ops] : rows) {
    std::printf("| %s | %zu |\n", row.c_str() + 2, ops.size());
  }
  auto share = [&](size_t n) { return 100.0 * static_cast<double>(n) / static_cast<double>(total); };
  std::printf("\nwith a meta path: LibTorch alone %zu (%.1f %%), with trainmem's own meta kernels %zu (%.1f %%), "
              "with the fallback %zu (%.1f %%)\n",
              libtorch, share(libtorch), before, share(before), now, share(now));
  std::printf("\n| call on meta tensors | before | now |\n|---|---|---|\n");
  for (size_t i = 0; i < calls_before.size(); ++i) {
    std::printf("| %s | %s | %s |\n", kCalls[i].what, calls_before[i] ? "runs" : "throws",
                calls_after[i] ? "runs" : "throws");
  }
  if (list) {
    for (auto& [row, ops] : rows) {
      std::sort(ops.begin(), ops.end());
      if (row[0] == '1' || row[0] == '2') {
        continue;
      }
      std::printf("\n%s (%zu):", row.c_str() + 2, ops.size());
      for (const auto& op : ops) {
        std::printf(" %s", op.c_str());
      }
      std::printf("\n");
    }
  }
  return 0;
}
