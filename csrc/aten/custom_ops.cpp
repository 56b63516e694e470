//@ ch15
// An operator of acme's own: acme::bias_gelu(x, bias) = gelu(x + bias), the
// bias broadcast along the last dimension. A transformer's MLP runs it after
// every up-projection; fused, it reads x once and writes y once instead of
// materialising x + bias. Everything an operator needs is here: its schema,
// a kernel per device (CPU, acme), a Meta kernel for shape-only tracing, and
// autograd.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "aten/device_views.h"

namespace acme {
namespace {

//> ch15 schema
// The namespace is the product's, not the device's (chapter 8): it stays
// `acme` when a vendor renames the device. pt2_compliant_tag promises
// torch.compile that the operator passes opcheck (below).
TORCH_LIBRARY_FRAGMENT(acme, m) {
  m.def("bias_gelu(Tensor x, Tensor bias) -> Tensor", {at::Tag::pt2_compliant_tag});
  // Returns (grad_x, grad_bias). An operator in its own right, so that
  // torch.compile sees it in the backward graph instead of its pieces.
  m.def("bias_gelu_backward(Tensor grad, Tensor x, Tensor bias) -> (Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
}
//< ch15 schema

//> ch15 checks
// The argument checks every kernel runs first, Meta included: a shape-only
// trace must fail where the real call would.
void check_arguments(const char* op, const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension");
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == x.size(-1), op,
              ": bias must be 1-D with x's last dimension (", x.size(-1),
              ") elements, got shape ", bias.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), op,
              ": expected a floating-point x, got ", x.scalar_type());
  TORCH_CHECK(bias.scalar_type() == x.scalar_type(), op, ": bias has dtype ",
              bias.scalar_type(), " but x has ", x.scalar_type());
  TORCH_CHECK(bias.device() == x.device(), op, ": bias is on ", bias.device(),
              " but x is on ", x.device());
}
//< ch15 checks

//> ch15 math
// The arithmetic, once, for both devices. 16-bit inputs compute in float
// (at::opmath_type), as PyTorch's own gelu does.
constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;

template <typename T>
void bias_gelu_rows(const T* x, const T* bias, T* y, int64_t rows, int64_t n) {
  using Acc = at::opmath_type<T>;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) {
      const Acc v = static_cast<Acc>(x[r * n + i]) + static_cast<Acc>(bias[i]);
      y[r * n + i] = static_cast<T>(Acc(0.5) * v * (Acc(1) + std::erf(v * Acc(kInvSqrt2))));
    }
}

// d gelu(v)/dv = Phi(v) + v * phi(v); grad_bias sums grad_x over the rows.
template <typename T>
void bias_gelu_backward_rows(const T* grad, const T* x, const T* bias, T* grad_x,
                             T* grad_bias, int64_t rows, int64_t n) {
  using Acc = at::opmath_type<T>;
  for (int64_t i = 0; i < n; ++i) {
    Acc bias_sum = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const Acc v = static_cast<Acc>(x[r * n + i]) + static_cast<Acc>(bias[i]);
      const Acc cdf = Acc(0.5) * (Acc(1) + std::erf(v * Acc(kInvSqrt2)));
      const Acc pdf = Acc(kInvSqrt2Pi) * std::exp(Acc(-0.5) * v * v);
      const Acc g = static_cast<Acc>(grad[r * n + i]) * (cdf + v * pdf);
      grad_x[r * n + i] = static_cast<T>(g);
      bias_sum += g;
    }
    grad_bias[i] = static_cast<T>(bias_sum);
  }
}
//< ch15 math

//> ch15 kernels
// One forward and one backward for both devices: `view` is the identity for
// CPU tensors and the device-side view for acme tensors (chapter 10), so the
// loops read and write wherever the data lives. Outputs are contiguous, as
// the Meta kernel promises.
at::Tensor bias_gelu(const at::Tensor& x_in, const at::Tensor& bias_in) {
  check_arguments("acme::bias_gelu", x_in, bias_in);
  const c10::DeviceGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), bias = bias_in.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (y.numel() == 0) return y;
  DeviceViews view;
  const at::Tensor xv = view(x), bv = view(bias), yv = view(y);
  const int64_t n = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bias_gelu", [&] {
    bias_gelu_rows(xv.const_data_ptr<scalar_t>(), bv.const_data_ptr<scalar_t>(),
                   yv.mutable_data_ptr<scalar_t>(), x.numel() / n, n);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad_in,
                                                      const at::Tensor& x_in,
                                                      const at::Tensor& bias_in) {
  check_arguments("acme::bias_gelu_backward", x_in, bias_in);
  TORCH_CHECK(grad_in.sizes() == x_in.sizes() && grad_in.dtype() == x_in.dtype() &&
                  grad_in.device() == x_in.device(),
              "acme::bias_gelu_backward: grad must match x in shape, dtype and device");
  const c10::DeviceGuard guard(x_in.device());
  const at::Tensor grad = grad_in.contiguous(), x = x_in.contiguous(),
                   bias = bias_in.contiguous();
  at::Tensor grad_x = at::empty(x.sizes(), x.options());
  at::Tensor grad_bias = at::empty(bias.sizes(), bias.options());
  DeviceViews view;
  const at::Tensor gv = view(grad), xv = view(x), bv = view(bias), gxv = view(grad_x),
                   gbv = view(grad_bias);
  const int64_t n = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(),
                                  "bias_gelu_backward", [&] {
    bias_gelu_backward_rows(gv.const_data_ptr<scalar_t>(), xv.const_data_ptr<scalar_t>(),
                            bv.const_data_ptr<scalar_t>(), gxv.mutable_data_ptr<scalar_t>(),
                            gbv.mutable_data_ptr<scalar_t>(), n == 0 ? 0 : x.numel() / n, n);
  });
  return {grad_x, grad_bias};
}
//< ch15 kernels

//> ch15 meta
// The Meta kernel: the same checks and the same output shapes, strides and
// dtypes, no data. torch.compile's fake tensors and device="meta" use it.
at::Tensor bias_gelu_meta(const at::Tensor& x, const at::Tensor& bias) {
  check_arguments("acme::bias_gelu", x, bias);
  return at::empty(x.sizes(), x.options());
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward_meta(const at::Tensor& grad,
                                                           const at::Tensor& x,
                                                           const at::Tensor& bias) {
  check_arguments("acme::bias_gelu_backward", x, bias);
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.dtype() == x.dtype(),
              "acme::bias_gelu_backward: grad must match x in shape, dtype and device");
  return {at::empty(x.sizes(), x.options()), at::empty(bias.sizes(), bias.options())};
}
//< ch15 meta

//> ch15 autograd
// The backward as a torch::autograd::Function: forward calls the operator
// below autograd (else it would dispatch back here), backward calls
// acme::bias_gelu_backward through the dispatcher, so it runs on whichever
// device the tensors are on and torch.compile can trace it.
struct BiasGelu : torch::autograd::Function<BiasGelu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& bias) {
    ctx->save_for_backward({x, bias});
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("acme::bias_gelu", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    return op.call(x, bias);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("acme::bias_gelu_backward", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&)>();
    auto [grad_x, grad_bias] = op.call(grads[0].contiguous(), saved[0], saved[1]);
    return {grad_x, grad_bias};
  }
};

at::Tensor bias_gelu_autograd(const at::Tensor& x, const at::Tensor& bias) {
  return BiasGelu::apply(x, bias);
}
//< ch15 autograd

}  // namespace

//> ch15 register
TORCH_LIBRARY_IMPL(acme, CPU, m) {
  m.impl("bias_gelu", TORCH_FN(bias_gelu));
  m.impl("bias_gelu_backward", TORCH_FN(bias_gelu_backward));
}
TORCH_LIBRARY_IMPL(acme, PrivateUse1, m) {
  m.impl("bias_gelu", TORCH_FN(bias_gelu));
  m.impl("bias_gelu_backward", TORCH_FN(bias_gelu_backward));
}
TORCH_LIBRARY_IMPL(acme, Meta, m) {
  m.impl("bias_gelu", TORCH_FN(bias_gelu_meta));
  m.impl("bias_gelu_backward", TORCH_FN(bias_gelu_backward_meta));
}
// The same Function for both devices' autograd keys. (The `Autograd` alias
// key would cover every backend at once; a vendor's library registers for
// the devices it ships kernels for.)
TORCH_LIBRARY_IMPL(acme, AutogradPrivateUse1, m) {
  m.impl("bias_gelu", TORCH_FN(bias_gelu_autograd));
}
TORCH_LIBRARY_IMPL(acme, AutogradCPU, m) {
  m.impl("bias_gelu", TORCH_FN(bias_gelu_autograd));
}
//< ch15 register

//> ch15 not-differentiable
// The backward has no backward of its own. Registered at the autograd keys,
// this kernel makes a second derivative raise ("... is not implemented").
// Without it the default autograd fallback ("warn" mode) warns and the
// second derivative never reaches the input: its .grad stays None.
TORCH_LIBRARY_IMPL(acme, AutogradPrivateUse1, m) {
  m.impl("bias_gelu_backward", torch::autograd::autogradNotImplementedFallback());
}
TORCH_LIBRARY_IMPL(acme, AutogradCPU, m) {
  m.impl("bias_gelu_backward", torch::autograd::autogradNotImplementedFallback());
}
//< ch15 not-differentiable

//> ch15 autocast
// Under autocast, a float16 activation meets a float32 bias (a Linear's
// output and a parameter). The fused operator does what its unfused pieces
// would, gelu(x + bias): it computes in the promoted dtype. The autocast keys
// are excluded so the call below goes on to the kernels.
namespace {
at::Tensor bias_gelu_autocast(const at::Tensor& x, const at::Tensor& bias) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto dtype = at::promoteTypes(x.scalar_type(), bias.scalar_type());
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("acme::bias_gelu", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(x.to(dtype), bias.to(dtype));
}
}  // namespace
TORCH_LIBRARY_IMPL(acme, AutocastPrivateUse1, m) {
  m.impl("bias_gelu", TORCH_FN(bias_gelu_autocast));
}
TORCH_LIBRARY_IMPL(acme, AutocastCPU, m) {
  m.impl("bias_gelu", TORCH_FN(bias_gelu_autocast));
}
//< ch15 autocast

}  // namespace acme
