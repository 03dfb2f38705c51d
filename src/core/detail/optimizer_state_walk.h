#pragma once
// One walk over an optimizer's state tensors (never installed), defined in
// accountant.cpp (core layer).
//
// Note [One optimizer-state walk]
// Two readers look into an optimizer's state: the accountant (account())
// sums its bytes by field name, deduplicated by storage, and the audit
// (audit/storage_tables.cpp) names its storages OPTIMIZER_STATE in the
// timeline. Both read the same fields of the same LibTorch state types in the
// same order through for_each_state_tensor(), so a type or field added here
// reaches both. A state of any other type goes to `unknown`: the accountant
// reads it back through its serialize() (copies: bytes are right, storages
// are not the live ones), the audit passes none and classifies such state by
// when it was made.
#include <functional>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

namespace trainmem::detail {

/// One state tensor: its field ("exp_avg", "momentum_buffer", ...) and the
/// tensor, possibly undefined (amsgrad off: no max_exp_avg_sq).
using StateTensorFn = std::function<void(const std::string& field, const at::Tensor& tensor)>;
/// A parameter's state of a type the walk does not know.
using UnknownStateFn = std::function<void(const torch::optim::OptimizerParamState& state)>;

/// Calls `tensor` for each state tensor of `optimizer` (Adam, AdamW, SGD,
/// RMSprop, Adagrad, LBFGS; parameter by parameter in the state map's order,
/// fields in a fixed order), and `unknown`, when given, for each state of
/// another type.
void for_each_state_tensor(const torch::optim::Optimizer& optimizer, const StateTensorFn& tensor,
                           const UnknownStateFn& unknown = {});

/// The type of one of LibTorch's optimizers the walk knows ("AdamW", "Adam",
/// "SGD", "RMSprop", "Adagrad", "LBFGS"), or "" for any other type: the
/// accountant then names it by its C++ type, the audit "optimizer".
std::string builtin_optimizer_name(const torch::optim::Optimizer& optimizer);

} // namespace trainmem::detail
