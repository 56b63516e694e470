//@ ch15
// A fused kernel behind a composite operator. aten::rms_norm is
// CompositeImplicitAutograd: one kernel for every device. On 2.13 to 2.15
// that kernel calls aten::_fused_rms_norm, an operator with CUDA, MPS and XPU
// kernels, a composite for every other device, and a derivative formula whose
// backward is aten::_fused_rms_norm_backward. A vendor registers those two at
// PrivateUse1, as CUDA does: autograd then uses PyTorch's own formula, and
// both training and inference get one kernel each way.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_fused_rms_norm_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "aten/device_views.h"
#include "aten/routed_ops.h"

namespace acme {
namespace {

// What the loops below cover: real floating dtypes, the weight's equal to the
// input's, shapes that agree. rms_norm itself sends mismatched dtypes and
// complex inputs to its composite before reaching _fused_rms_norm.
bool covered(const at::Tensor& input, at::IntArrayRef normalized_shape,
             const std::optional<at::Tensor>& weight) {
  const auto dims = static_cast<int64_t>(normalized_shape.size());
  const bool has_weight = weight.has_value() && weight->defined();
  return at::isFloatingType(input.scalar_type()) && dims >= 1 && input.dim() >= dims &&
         input.sizes().slice(input.dim() - dims) == normalized_shape &&
         (!has_weight || (weight->sizes() == normalized_shape &&
                          weight->scalar_type() == input.scalar_type()));
}

// rstd has the input's leading sizes and ones for the normalized dimensions,
// in the compute type (float for half and bfloat16), as the composite's.
std::vector<int64_t> rstd_shape(const at::Tensor& input, size_t dims) {
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end() - dims);
  shape.insert(shape.end(), dims, 1);
  return shape;
}

//> ch15 rms-norm-kernel
// Forward, one pass per row: the mean of squares, then the scaled row. The
// rounding follows the composite's: normalise in opmath, round to the input's
// dtype, then multiply by the weight.
template <typename T, typename Acc = at::opmath_type<T>>
void rms_norm_rows(const T* x, const T* weight, T* y, Acc* rstd, int64_t rows, int64_t n,
                   double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * n;
    Acc squares = 0;
    for (int64_t i = 0; i < n; ++i) squares += static_cast<Acc>(row[i]) * static_cast<Acc>(row[i]);
    const Acc scale = Acc(1) / std::sqrt(squares / static_cast<Acc>(n) + static_cast<Acc>(eps));
    rstd[r] = scale;
    for (int64_t i = 0; i < n; ++i) {
      const T normalised = static_cast<T>(static_cast<Acc>(row[i]) * scale);
      y[r * n + i] = weight ? static_cast<T>(static_cast<Acc>(normalised) * static_cast<Acc>(weight[i]))
                            : normalised;
    }
  }
}

// Backward, one pass per row for the input's gradient, the weight's summed
// over rows: with x̂ = x·rstd and h = grad·weight,
//   dx = rstd · (h − x̂ · mean(h · x̂)),   dweight = Σ_rows grad · x̂.
template <typename T, typename Acc = at::opmath_type<T>>
void rms_norm_backward_rows(const T* grad, const T* x, const Acc* rstd, const T* weight,
                            T* dx, Acc* dweight, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = grad + r * n;
    const T* row = x + r * n;
    const Acc s = rstd[r];
    auto h = [&](int64_t i) {
      return weight ? static_cast<Acc>(g[i]) * static_cast<Acc>(weight[i]) : static_cast<Acc>(g[i]);
    };
    Acc dot = 0;
    for (int64_t i = 0; i < n; ++i) dot += h(i) * static_cast<Acc>(row[i]) * s;
    const Acc mean = dot / static_cast<Acc>(n);
    for (int64_t i = 0; i < n; ++i) {
      const Acc normalised = static_cast<Acc>(row[i]) * s;
      if (dx) dx[r * n + i] = static_cast<T>(s * (h(i) - normalised * mean));
      if (dweight) dweight[i] += static_cast<Acc>(g[i]) * normalised;
    }
  }
}
//< ch15 rms-norm-kernel

//> ch15 rms-norm-ops
std::tuple<at::Tensor, at::Tensor> fused_rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                  const std::optional<at::Tensor>& weight_opt,
                                                  std::optional<double> eps) {
  // A layout the loops do not keep (channels-last) or a case they do not
  // cover goes to PyTorch's composite, with its strides and its messages.
  if (!covered(input, normalized_shape, weight_opt) ||
      input.suggest_memory_format() != at::MemoryFormat::Contiguous) {
    return at::compositeimplicitautograd::_fused_rms_norm(input, normalized_shape, weight_opt, eps);
  }
  const bool has_weight = weight_opt.has_value() && weight_opt->defined();
  if (has_weight) check_same_device("aten::_fused_rms_norm", input.device(), {*weight_opt});

  const c10::DeviceGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  const at::Tensor weight = has_weight ? weight_opt->contiguous() : at::Tensor();
  const auto opmath = at::toOpMathType(x.scalar_type());
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor rstd = at::empty(rstd_shape(x, normalized_shape.size()), x.options().dtype(opmath));
  const int64_t n = c10::multiply_integers(normalized_shape);
  // Rows of nothing: the mean of no squares is NaN, as in the composite.
  if (n == 0) rstd.fill_(std::numeric_limits<double>::quiet_NaN());
  if (y.numel() == 0) return {y, rstd};
  DeviceViews view;
  const at::Tensor xv = view(x), yv = view(y), wv = view(weight), rv = view(rstd);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "_fused_rms_norm", [&] {
    using Acc = at::opmath_type<scalar_t>;
    // The composite's default epsilon: its compute type's machine epsilon.
    const double e = eps.value_or(std::numeric_limits<Acc>::epsilon());
    rms_norm_rows<scalar_t>(xv.const_data_ptr<scalar_t>(), has_weight ? wv.const_data_ptr<scalar_t>() : nullptr,
                            yv.mutable_data_ptr<scalar_t>(), rv.mutable_data_ptr<Acc>(), x.numel() / n, n, e);
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> fused_rms_norm_backward(
    const at::Tensor& grad_out, const at::Tensor& input, at::IntArrayRef normalized_shape,
    const at::Tensor& rstd, const std::optional<at::Tensor>& weight_opt, std::array<bool, 2> output_mask) {
  // No composite to fall back on here (CUDA and XPU alone have kernels), so
  // what the loops do not cover is a clear error, never a wrong gradient.
  const bool has_weight = weight_opt.has_value() && weight_opt->defined();
  TORCH_CHECK_NOT_IMPLEMENTED(covered(input, normalized_shape, weight_opt),
                              "acme: the backward of rms_norm supports real floating inputs whose weight "
                              "has the input's dtype, got ", input.scalar_type(), " input",
                              has_weight ? " and a weight of " : "",
                              has_weight ? c10::toString(weight_opt->scalar_type()) : "");
  check_same_device("aten::_fused_rms_norm_backward", input.device(), {grad_out, rstd});
  if (has_weight) check_same_device("aten::_fused_rms_norm_backward", input.device(), {*weight_opt});
  const auto opmath = at::toOpMathType(input.scalar_type());
  TORCH_CHECK(rstd.scalar_type() == opmath && rstd.numel() * c10::multiply_integers(normalized_shape) ==
                  input.numel() && grad_out.sizes() == input.sizes() &&
                  grad_out.scalar_type() == input.scalar_type(),
              "acme: _fused_rms_norm_backward: grad_out and rstd do not match the input");

  const c10::DeviceGuard guard(input.device());
  const at::Tensor x = input.contiguous(), g = grad_out.contiguous(), r = rstd.contiguous();
  const at::Tensor weight = has_weight ? weight_opt->contiguous() : at::Tensor();
  at::Tensor dx = output_mask[0] ? at::empty(x.sizes(), x.options()) : at::Tensor();
  // The weight's gradient accumulates over rows in the compute type.
  at::Tensor dweight = output_mask[1] && has_weight ? at::zeros(normalized_shape, x.options().dtype(opmath))
                                                    : at::Tensor();
  const int64_t n = c10::multiply_integers(normalized_shape);
  if (x.numel() > 0) {
    DeviceViews view;
    const at::Tensor xv = view(x), gv = view(g), rv = view(r), wv = view(weight), dxv = view(dx),
                     dwv = view(dweight);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "_fused_rms_norm_backward", [&] {
      using Acc = at::opmath_type<scalar_t>;
      rms_norm_backward_rows<scalar_t>(
          gv.const_data_ptr<scalar_t>(), xv.const_data_ptr<scalar_t>(), rv.const_data_ptr<Acc>(),
          has_weight ? wv.const_data_ptr<scalar_t>() : nullptr,
          dx.defined() ? dxv.mutable_data_ptr<scalar_t>() : nullptr,
          dweight.defined() ? dwv.mutable_data_ptr<Acc>() : nullptr, x.numel() / n, n);
    });
  }
  if (dweight.defined()) dweight = dweight.to(weight.scalar_type());
  return {dx, dweight};
}
//< ch15 rms-norm-ops

}  // namespace

//> ch15 register-rms-norm
// Kernels at PrivateUse1 only: the autograd key then takes PyTorch's
// generated kernel for _fused_rms_norm, whose backward calls ours.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_fused_rms_norm", TORCH_FN(fused_rms_norm));
  m.impl("_fused_rms_norm_backward", TORCH_FN(fused_rms_norm_backward));
}
//< ch15 register-rms-norm

}  // namespace acme
