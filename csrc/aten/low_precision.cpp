//@ ch22
// Low precision without quantized tensors: three matrix products over plain
// int8 or float8 tensors with float scales beside them, as torchao keeps
// quantized data (torch._int_mm and torch._scaled_mm are what its int8 and
// float8 recipes call; torch._weight_int8pack_mm is weight-only int8). They
// need no quantized dispatch key, only one kernel each at PrivateUse1. acme's kernel is
// PyTorch's CPU kernel queued on the stream over device views, as chapter 18's
// launches are; a vendor puts its integer and float8 matrix engines here.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/_scaled_mm.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>

#include "aten/device_views.h"
#include "aten/launch.h"
#include "aten/routed_ops.h"

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;  // prints as the device's name

//> ch22 low-precision-checks
// The kernel runs later, on the stream's worker: whatever the CPU kernel would
// refuse is refused here first, on the host, where the op was called. (The
// meta kernels are no substitute: on 2.15 _scaled_mm's accepts mismatched
// inner sizes that the CPU kernel refuses.)
void check_matrix(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be a matrix, got ", t.dim(), "-D tensor");
}

void check_int_mm(const at::Tensor& self, const at::Tensor& mat2) {
  check_matrix("_int_mm", "self", self);
  check_matrix("_int_mm", "mat2", mat2);
  TORCH_CHECK(self.size(1) == mat2.size(0), "_int_mm: mat1 and mat2 shapes cannot be multiplied (",
              self.size(0), "x", self.size(1), " and ", mat2.size(0), "x", mat2.size(1), ")");
  TORCH_CHECK(self.scalar_type() == at::kChar || self.scalar_type() == at::kByte,
              "_int_mm: expected self to be int8 or uint8, got ", self.scalar_type());
  TORCH_CHECK(mat2.scalar_type() == at::kChar, "_int_mm: expected mat2 to be int8, got ",
              mat2.scalar_type());
}

void check_weight_int8pack_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  const char* op = "_weight_int8pack_mm";
  check_matrix(op, "self", x);
  check_matrix(op, "mat2", weight);
  const auto type = x.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kHalf || type == at::kBFloat16, op,
              ": expected self to be float32, float16 or bfloat16, got ", type);
  TORCH_CHECK(x.stride(1) == 1, op, ": self must be contiguous in its last dimension");
  TORCH_CHECK(weight.scalar_type() == at::kChar, op, ": expected mat2 to be int8, got ",
              weight.scalar_type());
  TORCH_CHECK(weight.is_contiguous(), op, ": mat2 must be contiguous");
  TORCH_CHECK(weight.size(1) == x.size(1), op, ": mat2 (", weight.size(0), "x", weight.size(1),
              ") holds one row of ", x.size(1), " weights per output");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == weight.size(0), op,
              ": expected scales to be a 1-D tensor of size ", weight.size(0), ", got ", scales.sizes());
  TORCH_CHECK(scales.scalar_type() == type, op, ": scales must have self's dtype (", type, "), got ",
              scales.scalar_type());
}

bool is_float8(at::ScalarType type) {
  return type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2;
}

void check_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                     const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& scale_result) {
  check_matrix("_scaled_mm", "mat1", a);
  check_matrix("_scaled_mm", "mat2", b);
  TORCH_CHECK_VALUE(is_float8(a.scalar_type()) && is_float8(b.scalar_type()),
                    "_scaled_mm: expected float8_e4m3fn or float8_e5m2 inputs, got ",
                    a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.size(1) == b.size(0), "_scaled_mm: mat1 and mat2 shapes cannot be multiplied (",
              a.size(0), "x", a.size(1), " and ", b.size(0), "x", b.size(1), ")");
  // The CPU kernel's two scalings: one float32 scale per matrix, or one per
  // row of mat1 (M x 1) and one per column of mat2 (1 x N).
  const bool f32 = scale_a.scalar_type() == at::kFloat && scale_b.scalar_type() == at::kFloat;
  const bool tensorwise = scale_a.numel() == 1 && scale_b.numel() == 1;
  const bool rowwise = scale_a.dim() == 2 && scale_b.dim() == 2 && scale_a.size(0) == a.size(0) &&
                       scale_a.size(1) == 1 && scale_b.size(0) == 1 && scale_b.size(1) == b.size(1) &&
                       scale_a.is_contiguous() && scale_b.is_contiguous();
  TORCH_CHECK_VALUE(f32 && (tensorwise || rowwise),
                    "_scaled_mm: scales must be float32, either one per matrix or ", a.size(0),
                    "x1 and 1x", b.size(1), " contiguous (one per row of mat1 and column of mat2); got ",
                    scale_a.scalar_type(), " ", scale_a.sizes(), " and ", scale_b.scalar_type(), " ",
                    scale_b.sizes());
  // On 2.13 to 2.15 the CPU kernel divides the result by scale_result when
  // out_dtype names a float8 type, and ignores it otherwise (out_dtype left
  // out included); CUDA's multiplies (pytorch#190449). Code written for either
  // would be silently wrong on acme: refused instead.
  TORCH_CHECK_NOT_IMPLEMENTED(!scale_result.has_value() || !scale_result->defined(), kAcme,
                              ": _scaled_mm does not take scale_result: the CPU and CUDA disagree on "
                              "what it means; scale the result yourself");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->numel() == b.size(1), "_scaled_mm: bias must be size ", b.size(1), " but got ",
                bias->numel());
}
//< ch22 low-precision-checks

//> ch22 low-precision-kernels
// One pattern for the three: checks, the output on the device (under a guard:
// a hand-registered kernel gets none), then the CPU kernel queued on the
// stream over views of the device memory.
at::Tensor int_mm(const at::Tensor& self, const at::Tensor& mat2) {
  check_same_device("aten::_int_mm", self.device(), {mat2});
  check_int_mm(self, mat2);
  const c10::DeviceGuard guard(self.device());
  at::Tensor out = at::empty({self.size(0), mat2.size(1)}, self.options().dtype(at::kInt));
  if (out.numel() == 0) return out;
  DeviceViews view(DeviceViews::kForLaunch);
  launch_kernel(self.device().index(), "aten::_int_mm",
                [a = view(self), b = view(mat2), o = view(out)] {
                  at::Tensor result = o;
                  at::_int_mm_out(result, a, b);
                });
  return out;
}

at::Tensor weight_int8pack_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  check_same_device("aten::_weight_int8pack_mm", x.device(), {weight, scales});
  check_weight_int8pack_mm(x, weight, scales);
  const c10::DeviceGuard guard(x.device());
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (out.numel() == 0) return out;
  // PyTorch's CPU kernel reads the scales as if contiguous (2.13 to 2.15):
  // strided scales would give wrong products, silently. A device copy first.
  const at::Tensor dense_scales = scales.contiguous();
  DeviceViews view(DeviceViews::kForLaunch);
  launch_kernel(x.device().index(), "aten::_weight_int8pack_mm",
                [a = view(x), w = view(weight), s = view(dense_scales), o = view(out)] {
                  // The CPU op has no out= form: its result is copied into the
                  // output (a device kernel writes the output directly).
                  at::Tensor result = o;
                  result.copy_(at::_weight_int8pack_mm(a, w, s));
                });
  return out;
}

at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                     const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& scale_result,
                     std::optional<at::ScalarType> out_dtype, bool use_fast_accum) {
  const at::Tensor no_tensor;
  check_same_device("aten::_scaled_mm", a.device(),
                    {b, scale_a, scale_b, bias.value_or(no_tensor), scale_result.value_or(no_tensor)});
  check_scaled_mm(a, b, scale_a, scale_b, bias, scale_result);
  const c10::DeviceGuard guard(a.device());
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options().dtype(out_dtype.value_or(a.scalar_type())));
  if (out.numel() == 0) return out;
  DeviceViews view(DeviceViews::kForLaunch);
  std::optional<at::Tensor> bias_view;
  if (bias.has_value() && bias->defined()) bias_view = view(*bias);
  launch_kernel(a.device().index(), "aten::_scaled_mm",
                [x = view(a), y = view(b), sx = view(scale_a), sy = view(scale_b), c = bias_view,
                 out_dtype, use_fast_accum, o = view(out)] {
                  at::Tensor result = o;
                  at::_scaled_mm_out(result, x, y, sx, sy, c, std::nullopt, out_dtype, use_fast_accum);
                });
  return out;
}
//< ch22 low-precision-kernels

}  // namespace

//> ch22 register-low-precision
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_int_mm", TORCH_FN(int_mm));
  m.impl("_weight_int8pack_mm", TORCH_FN(weight_int8pack_mm));
  m.impl("_scaled_mm", TORCH_FN(scaled_mm));
}
//< ch22 register-low-precision

}  // namespace acme
