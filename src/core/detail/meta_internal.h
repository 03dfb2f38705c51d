#pragma once
// What the meta device's files share (never installed): the meta kernels
// LibTorch's C++ lacks, defined in meta_kernels.cpp and registered on the
// Meta key by meta.cpp (each only where the op has none: Note [Meta kernels
// LibTorch lacks], Note [Meta kernels for conv nets]), and the count of
// MetaInitGuards alive on this thread, which materialize.cpp's to_empty()
// and load_into() refuse to run under.
#include <array>
#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/OptionalArrayRef.h>

namespace trainmem::detail {

// MetaInitGuards alive on this thread (meta.cpp).
int& meta_init_guards();

// Note [Meta kernels LibTorch lacks]
at::Tensor index_select_meta(const at::Tensor& self, int64_t dim, const at::Tensor& index);
at::Tensor relu_meta(const at::Tensor& self);
at::Tensor& randperm_out_meta(int64_t n, std::optional<at::Generator>, at::Tensor& out);

// Note [Meta kernels for conv nets]
at::Tensor convolution_meta(const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                            at::IntArrayRef output_padding, int64_t groups);
std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_meta(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::OptionalIntArrayRef bias_sizes, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, bool transposed, at::IntArrayRef output_padding,
    int64_t groups, std::array<bool, 3> output_mask);
std::tuple<at::Tensor, at::Tensor, at::Tensor> native_batch_norm_meta(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool training, double momentum,
    double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> native_batch_norm_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    const std::optional<at::Tensor>& save_mean, const std::optional<at::Tensor>& save_invstd,
    bool train, double eps, std::array<bool, 3> mask);
std::tuple<at::Tensor, at::Tensor> max_pool3d_with_indices_meta(
    const at::Tensor& self, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode);
at::Tensor max_pool3d_with_indices_backward_meta(
    const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef kernel_size,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
    bool ceil_mode, const at::Tensor& indices);
at::Tensor adaptive_avg_pool2d_meta(const at::Tensor& self, at::IntArrayRef output_size);
at::Tensor adaptive_avg_pool3d_meta(const at::Tensor& self, at::IntArrayRef output_size);
at::Tensor adaptive_avg_pool_backward_meta(const at::Tensor& grad_output, const at::Tensor& self);
at::Tensor embedding_dense_backward_meta(const at::Tensor& grad_output, const at::Tensor& indices,
                                         int64_t num_weights, int64_t padding_idx,
                                         bool scale_grad_by_freq);
std::tuple<at::Tensor, at::Tensor> nll_loss2d_forward_meta(
    const at::Tensor& self, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    int64_t reduction, int64_t ignore_index);
at::Tensor nll_loss2d_backward_meta(const at::Tensor& grad_output, const at::Tensor& self,
                                    const at::Tensor& target,
                                    const std::optional<at::Tensor>& weight,
                                    int64_t reduction, int64_t ignore_index,
                                    const at::Tensor& total_weight);

// GradScaler's ops: nothing to do on meta.
void amp_unscale_meta(at::TensorList grads, at::Tensor& found_inf, const at::Tensor& inv_scale);
at::Tensor& amp_update_scale_meta(at::Tensor& self, at::Tensor& growth_tracker, const at::Tensor& found_inf,
                                  double growth_factor, double backoff_factor, int64_t growth_interval);

// Losses.
at::Tensor mse_loss_backward_meta(const at::Tensor& grad_output, const at::Tensor& self,
                                  const at::Tensor& target, int64_t reduction);
at::Tensor binary_cross_entropy_meta(const at::Tensor& self, const at::Tensor& target,
                                     const std::optional<at::Tensor>& weight, int64_t reduction);
at::Tensor binary_cross_entropy_backward_meta(const at::Tensor& grad_output, const at::Tensor& self,
                                              const at::Tensor& target,
                                              const std::optional<at::Tensor>& weight,
                                              int64_t reduction);

} // namespace trainmem::detail
