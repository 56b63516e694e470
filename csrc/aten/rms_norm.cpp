//@ ch15
// Overriding a CompositeImplicitAutograd operator. aten::rms_norm has no
// kernel per device: its composite kernel computes it from pow, mean, rsqrt
// and mul, on any device, and autograd differentiates those pieces. A vendor
// with a fused normalisation kernel registers it at PrivateUse1, and must then
// also say what autograd does: the composite no longer covers the autograd
// key for that device (the chapter shows the dispatch table before and after).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/rms_norm_compositeimplicitautograd_dispatch.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>

#include "aten/device_views.h"
#include "aten/routed_ops.h"

namespace acme {
namespace {

//> ch15 rms-norm-kernel
// One pass per row: the mean of squares, then the scaled row. The rounding
// follows the composite's: normalise in opmath, round to the input's dtype,
// then multiply by the weight.
template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* y, int64_t rows, int64_t n, double eps) {
  using Acc = at::opmath_type<T>;
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * n;
    Acc squares = 0;
    for (int64_t i = 0; i < n; ++i) squares += static_cast<Acc>(row[i]) * static_cast<Acc>(row[i]);
    const Acc scale = Acc(1) / std::sqrt(squares / static_cast<Acc>(n) + static_cast<Acc>(eps));
    for (int64_t i = 0; i < n; ++i) {
      const T normalised = static_cast<T>(static_cast<Acc>(row[i]) * scale);
      y[r * n + i] = weight ? static_cast<T>(static_cast<Acc>(normalised) * static_cast<Acc>(weight[i]))
                            : normalised;
    }
  }
}

at::Tensor rms_norm_fused(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                          const std::optional<at::Tensor>& weight_opt, std::optional<double> eps) {
  const bool has_weight = weight_opt.has_value() && weight_opt->defined();
  const int64_t dims = static_cast<int64_t>(normalized_shape.size());
  // Whatever the fused kernel does not cover (complex inputs, mismatched
  // shapes, whose error messages are the composite's) goes to the composite.
  const bool covered = at::isFloatingType(input.scalar_type()) && dims >= 1 &&
                       input.dim() >= dims &&
                       input.sym_sizes().slice(input.dim() - dims) == normalized_shape &&
                       (!has_weight || (weight_opt->sym_sizes() == normalized_shape &&
                                        weight_opt->scalar_type() == input.scalar_type()));
  if (!covered) return at::compositeimplicitautograd::rms_norm_symint(input, normalized_shape, weight_opt, eps);
  if (has_weight) check_same_device("aten::rms_norm", input.device(), {*weight_opt});

  const c10::DeviceGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  const at::Tensor weight = has_weight ? weight_opt->contiguous() : at::Tensor();
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t n = c10::multiply_integers(x.sizes().slice(x.dim() - dims));
  if (y.numel() == 0) return y;
  DeviceViews view;
  const at::Tensor xv = view(x), yv = view(y), wv = view(weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    // The composite's default epsilon: its compute type's machine epsilon.
    const double e = eps.value_or(std::numeric_limits<at::opmath_type<scalar_t>>::epsilon());
    rms_norm_rows(xv.const_data_ptr<scalar_t>(), has_weight ? wv.const_data_ptr<scalar_t>() : nullptr,
                  yv.mutable_data_ptr<scalar_t>(), x.numel() / n, n, e);
  });
  return y;
}
//< ch15 rms-norm-kernel

//> ch15 rms-norm-autograd
// The autograd key's kernel. When a gradient is wanted, PyTorch's composite
// runs and autograd records its pieces (torch.func's transforms work through
// them); otherwise (inference, no_grad) the call goes below autograd, to the
// fused kernel. Without this registration
// the table's AutogradPrivateUse1 entry would be the autograd fallback, and a
// backward through rms_norm on acme would find no formula.
at::Tensor rms_norm_autograd(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                             const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  // A gradient is wanted by backward (grad mode and requires_grad) or by
  // forward-mode AD (a tangent on an input, whatever the grad mode): the fused
  // kernel would silently drop either.
  auto wants = [](const at::Tensor& t) {
    return t.defined() && ((c10::GradMode::is_enabled() && t.requires_grad()) ||
                           t._fw_grad(/*level=*/0).defined());
  };
  const bool wants_grad = wants(input) || (weight.has_value() && wants(*weight));
  if (wants_grad) return at::compositeimplicitautograd::rms_norm_symint(input, normalized_shape, weight, eps);
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return at::rms_norm_symint(input, normalized_shape, weight, eps);
}
//< ch15 rms-norm-autograd

}  // namespace

//> ch15 register-rms-norm
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) { m.impl("rms_norm", TORCH_FN(rms_norm_fused)); }
TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("rms_norm", TORCH_FN(rms_norm_autograd));
}
//< ch15 register-rms-norm

}  // namespace acme
