#pragma once
// Autograd node types told apart by their mangled names (never installed):
// the meter caches the names of generated nodes by type, and a plain save's
// adapter judges whether a node could be the one saving (hooks.cpp).
#include <string_view>
#include <typeinfo>

namespace trainmem::detail {

// A node of autograd's generated code (torch::autograd::generated::*):
// its name is its type's, fixed, where another node may name itself per
// instance (a Python function's PyNode does).
inline bool is_generated_node_type(const std::type_info& type) {
  const std::string_view mangled = type.name();
  return mangled.find("autograd9generated") != std::string_view::npos ||
      mangled.find("autograd::generated") != std::string_view::npos;
}

} // namespace trainmem::detail
