//@ ch23
// SyncBatchNorm's five operators (chapter 23). Under DistributedDataParallel a
// CUDA script converts BatchNorm to SyncBatchNorm, so every process normalises
// with the statistics of the whole global batch. Its Python code calls these
// operators, which PyTorch implements for CUDA only (the CPU has no kernels, so
// the fallback cannot run them): per-process statistics, their combination
// across processes, and the forward and backward element-wise passes. The
// arithmetic is written here with ATen operators on device views, in the
// input's compute type (float for half and bfloat16), as CUDA's kernels do.
#include <ATen/OpMathType.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/var_mean.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "aten/device_views.h"
#include "aten/routed_ops.h"

namespace acme {
namespace {

// Every dimension but the channels (dimension 1): what the statistics reduce.
std::vector<int64_t> all_but_channels(const at::Tensor& input) {
  TORCH_CHECK(input.dim() >= 2, "SyncBatchNorm expects an input of at least 2 dimensions "
              "(batch, channels, ...), got ", input.dim());
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
  return dims;
}

// A per-channel vector shaped to broadcast against `input` ([1, C, 1, ...]).
at::Tensor per_channel(const at::Tensor& v, const at::Tensor& input) {
  std::vector<int64_t> shape(input.dim(), 1);
  shape[1] = -1;
  return v.view(shape);
}

at::ScalarType compute_type(const at::Tensor& input) {
  return at::toOpMathType(input.scalar_type());
}

// 1 / sqrt(var + eps); 0 for a constant channel with eps 0, as batch norm's
// kernels give (the output is then the bias), not infinity.
at::Tensor inverse_std(const at::Tensor& var, double eps) {
  if (eps != 0) return (var + eps).rsqrt();
  return at::where(var == 0, at::zeros_like(var), var.rsqrt());
}

void check_same_type(const at::Tensor& mean, const at::Tensor& invstd) {
  TORCH_CHECK(mean.scalar_type() == invstd.scalar_type(),
              "mean and invstd need to have the same data types");
}

std::tuple<at::Tensor, at::Tensor> batch_norm_stats(const at::Tensor& input, double eps) {
  check_same_device("aten::batch_norm_stats", input.device(), {input});
  DeviceViews view;
  const at::Tensor x = view(input).to(compute_type(input));
  const auto [var, mean] = at::var_mean(x, all_but_channels(input), /*correction=*/0);
  return {on_device(mean, input.device()), on_device(inverse_std(var, eps), input.device())};
}

// Each process's (mean, invstd, count) -> the global batch's, and the running
// statistics updated with them (the variance unbiased, as BatchNorm's is).
std::tuple<at::Tensor, at::Tensor> batch_norm_gather_stats_with_counts(
    const at::Tensor& input, const at::Tensor& mean_all, const at::Tensor& invstd_all,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    double momentum, double eps, const at::Tensor& counts) {
  const at::Tensor rm = running_mean.value_or(at::Tensor());
  const at::Tensor rv = running_var.value_or(at::Tensor());
  check_same_device("aten::batch_norm_gather_stats_with_counts", input.device(),
                    {mean_all, invstd_all, counts, rm, rv});
  // CUDA's checks: one row of statistics per process, and a count for each.
  TORCH_CHECK(mean_all.dim() == 2, "batch_norm_gather_stats_with_counts: mean must be 2-D "
              "(processes x channels), got ", mean_all.dim(), " dimensions");
  TORCH_CHECK(invstd_all.sizes() == mean_all.sizes(), "batch_norm_gather_stats_with_counts: "
              "invstd ", invstd_all.sizes(), " and mean ", mean_all.sizes(), " must match");
  const int64_t world = mean_all.size(0);
  TORCH_CHECK(counts.numel() >= world, "batch_norm_gather_stats_with_counts: ", world,
              " processes' statistics but ", counts.numel(), " counts");
  DeviceViews view;
  const at::Tensor means = view(mean_all), invstds = view(invstd_all);
  const at::Tensor n =  // [world, 1]
      view(counts).reshape(-1).narrow(0, 0, world).to(means.scalar_type()).view({-1, 1});
  const at::Tensor total = n.sum();
  const at::Tensor mean = (means * n).sum(0) / total;
  // Each process's biased variance back from its invstd, then the pooled one.
  const at::Tensor var_each = invstds.pow(-2) - eps;
  const at::Tensor var = ((var_each + (means - mean).pow(2)) * n).sum(0) / total;
  // Updated in the compute type and rounded once, as CUDA's kernel does.
  if (rm.defined()) {
    at::Tensor r = view(rm);
    r.copy_(r.to(mean.scalar_type()) * (1 - momentum) + mean * momentum);
  }
  if (rv.defined()) {
    at::Tensor r = view(rv);
    r.copy_(r.to(var.scalar_type()) * (1 - momentum) + var * total / (total - 1) * momentum);
  }
  return {on_device(mean, input.device()), on_device(inverse_std(var, eps), input.device())};
}

at::Tensor batch_norm_elemt(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& mean,
                            const at::Tensor& invstd, double /*eps: in invstd already*/) {
  const at::Tensor w = weight.value_or(at::Tensor());
  const at::Tensor b = bias.value_or(at::Tensor());
  check_same_device("aten::batch_norm_elemt", input.device(), {w, b, mean, invstd});
  DeviceViews view;
  const at::Tensor x = view(input).to(compute_type(input));
  at::Tensor y = (x - per_channel(view(mean), x)) * per_channel(view(invstd), x);
  if (w.defined()) y = y * per_channel(view(w).to(y.scalar_type()), x);
  if (b.defined()) y = y + per_channel(view(b).to(y.scalar_type()), x);
  return on_device(y.to(input.scalar_type()), input.device());
}

// This process's share of the backward sums: sum(dy) and sum(dy * (x - mean))
// per channel; the weight's and bias's gradients follow from them.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_reduce(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& invstd, const std::optional<at::Tensor>& weight, bool input_g,
    bool weight_g, bool bias_g) {
  const at::Tensor w = weight.value_or(at::Tensor());
  check_same_device("aten::batch_norm_backward_reduce", input.device(),
                    {grad_out, mean, invstd, w});
  check_same_type(mean, invstd);
  DeviceViews view;
  const at::Tensor x = view(input).to(compute_type(input));
  const at::Tensor dy = view(grad_out).to(x.scalar_type());
  const auto dims = all_but_channels(input);
  const at::Tensor sum_dy = dy.sum(dims);
  const at::Tensor sum_dy_xmu = (dy * (x - per_channel(view(mean), x))).sum(dims);
  const c10::Device device = input.device();
  const auto param_type = w.defined() ? w.scalar_type() : x.scalar_type();
  return {input_g ? on_device(sum_dy, device) : at::Tensor(),
          input_g ? on_device(sum_dy_xmu, device) : at::Tensor(),
          weight_g && w.defined() ? on_device((sum_dy_xmu * view(invstd)).to(param_type), device)
                                  : at::Tensor(),
          bias_g && w.defined() ? on_device(sum_dy.to(param_type), device) : at::Tensor()};
}

// The input's gradient from the global sums (all-reduced across processes)
// and the global count.
at::Tensor batch_norm_backward_elemt(const at::Tensor& grad_out, const at::Tensor& input,
                                     const at::Tensor& mean, const at::Tensor& invstd,
                                     const std::optional<at::Tensor>& weight,
                                     const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu,
                                     const at::Tensor& count) {
  const at::Tensor w = weight.value_or(at::Tensor());
  check_same_device("aten::batch_norm_backward_elemt", input.device(),
                    {grad_out, mean, invstd, w, sum_dy, sum_dy_xmu, count});
  check_same_type(mean, invstd);
  DeviceViews view;
  const at::Tensor x = view(input).to(compute_type(input));
  const at::Tensor dy = view(grad_out).to(x.scalar_type());
  const at::Tensor total = view(count).sum().to(x.scalar_type());
  const at::Tensor is = per_channel(view(invstd), x);
  const at::Tensor grad_mean = per_channel(view(sum_dy), x) / total;
  const at::Tensor projection = per_channel(view(sum_dy_xmu), x) / total * is * is;
  at::Tensor grad = (dy - grad_mean - (x - per_channel(view(mean), x)) * projection) * is;
  if (w.defined()) grad = grad * per_channel(view(w).to(x.scalar_type()), x);
  return on_device(grad.to(input.scalar_type()), input.device());
}

}  // namespace
}  // namespace acme

//> ch23 register-sync-batch-norm
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("batch_norm_stats", TORCH_FN(acme::batch_norm_stats));
  m.impl("batch_norm_gather_stats_with_counts",
         TORCH_FN(acme::batch_norm_gather_stats_with_counts));
  m.impl("batch_norm_elemt", TORCH_FN(acme::batch_norm_elemt));
  m.impl("batch_norm_backward_reduce", TORCH_FN(acme::batch_norm_backward_reduce));
  m.impl("batch_norm_backward_elemt", TORCH_FN(acme::batch_norm_backward_elemt));
}
//< ch23 register-sync-batch-norm
