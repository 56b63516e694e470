//@ ch22
// Quantized tensors on acme (chapter 22). A quantized tensor is integer data
// plus a Quantizer (scale and zero point, per tensor or per channel), under
// the QuantizedPrivateUse1 dispatch key. PyTorch's own Quantizer classes and
// its generic quantized natives serve every accelerator; what is
// device-specific is the kernels behind the quantize and dequantize
// DispatchStubs, which acme fills with the CPU's own kernels running on
// device memory through the device-side views, as its other native kernels
// do, and the few ops that touch memory (int_repr, equal, copies).
#include <ATen/ATen.h>
#include <ATen/NativeFunctions.h>
#include <ATen/native/quantized/AffineQuantizer.h>
#include <ATen/quantized/QTensorImpl.h>
#include <ATen/quantized/Quantizer.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/accumulate.h>

#include <limits>
#include <torch/library.h>

#include "aten/acme_check.h"
#include "aten/device_views.h"
#include "aten/launch.h"

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;  // prints as the device's name

// Sub-byte types pack two or four values in a byte: acme has no kernels for
// them, and its integer views would read them as one value a byte.
void check_whole_bytes(const at::Tensor& t, const char* op) {
  const at::ScalarType type = t.scalar_type();
  TORCH_CHECK_VALUE(type != at::kQUInt4x2 && type != at::kQUInt2x4, kAcme, ": ", op,
                    ": quantized tensors of ", type,
                    " are not supported (quint8, qint8 and qint32 are)");
}

//> ch22 device-guards
// PyTorch's quantized factories allocate on the current device: the
// registrations of its own backends wrap them in a device guard (the
// dispatcher's generated code does), and so does acme.
at::Tensor empty_affine_quantized(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                                  std::optional<at::Layout> layout,
                                  std::optional<at::Device> device, std::optional<bool> pin,
                                  double scale, int64_t zero_point,
                                  std::optional<at::MemoryFormat> format) {
  c10::OptionalDeviceGuard guard(device);
  return at::native::empty_affine_quantized(size, dtype, layout, device, pin, scale, zero_point,
                                            format);
}

at::Tensor empty_per_channel_affine_quantized(
    at::IntArrayRef size, const at::Tensor& scales, const at::Tensor& zero_points, int64_t axis,
    std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
    std::optional<at::Device> device, std::optional<bool> pin,
    std::optional<at::MemoryFormat> format) {
  c10::OptionalDeviceGuard guard(device);
  return at::native::empty_per_channel_affine_quantized(size, scales, zero_points, axis, dtype,
                                                        layout, device, pin, format);
}

at::Tensor empty_unknown_quantized(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                                   std::optional<at::Layout> layout,
                                   std::optional<at::Device> device, std::optional<bool> pin,
                                   std::optional<at::MemoryFormat> format) {
  c10::OptionalDeviceGuard guard(device);
  return at::native::empty_unknown_quantized(size, dtype, layout, device, pin, format);
}

at::Tensor quantize_per_tensor(const at::Tensor& self, double scale, int64_t zero_point,
                               at::ScalarType dtype) {
  c10::DeviceGuard guard(self.device());
  return at::native::quantize_per_tensor(self, scale, zero_point, dtype);
}

at::Tensor quantize_per_tensor_tensor_qparams(const at::Tensor& self, const at::Tensor& scale,
                                              const at::Tensor& zero_point,
                                              at::ScalarType dtype) {
  c10::DeviceGuard guard(self.device());
  return at::native::quantize_per_tensor_tensor_qparams(self, scale, zero_point, dtype);
}
//< ch22 device-guards

//> ch22 quantize
// torch.quantize_per_channel is PyTorch's own kernel; its argument checks
// skip the zero points' range for devices other than the CPU (their kernels
// would check them later, on the stream). acme checks them here, where the
// error belongs.
at::Tensor quantize_per_channel(const at::Tensor& self, const at::Tensor& scales,
                                const at::Tensor& zero_points, int64_t axis,
                                at::ScalarType dtype) {
  if (!at::isFloatingType(zero_points.scalar_type()) && zero_points.numel() > 0) {
    const at::Tensor z = zero_points.cpu();
    const int64_t low = z.min().item<int64_t>(), high = z.max().item<int64_t>();
    int64_t qmin = 0, qmax = 0;
    AT_DISPATCH_QINT_TYPES(dtype, "quantize_per_channel", [&] {
      qmin = std::numeric_limits<underlying_t>::min();
      qmax = std::numeric_limits<underlying_t>::max();
    });
    TORCH_CHECK_VALUE(low >= qmin && high <= qmax, kAcme, ": quantize_per_channel: zero points ",
                      "must lie in [", qmin, ", ", qmax, "] for ", dtype, ", got ", low,
                      " to ", high);
  }
  c10::DeviceGuard guard(self.device());
  return at::native::quantize_per_channel(self, scales, zero_points, axis, dtype);
}
//< ch22 quantize

// ---- device memory as the CPU kernels see it ----

//> ch22 views
// A CPU tensor over the device-side view of q's bytes: a qtensor with q's
// quantizer (for the CPU's quantize and dequantize kernels), or its integers
// (quint8 as uint8, and so on). The bytes come from chapter 10's DeviceViews,
// which waits for the stream unless the views are for a launch; a host
// qtensor's integers are its own storage.
at::Tensor host_side(DeviceViews& views, const at::Tensor& t, bool as_integers = false) {
  const bool on_acme = t.device().type() == kAcme;
  if (!on_acme && !(as_integers && t.is_quantized())) return t;
  c10::Storage storage = on_acme ? views.storage_of(t) : t.storage();
  at::Tensor cpu;
  if (t.is_quantized() && !as_integers) {
    cpu = at::detail::make_tensor<at::QTensorImpl>(
        std::move(storage), c10::DispatchKeySet(c10::DispatchKey::QuantizedCPU), t.dtype(),
        at::get_qtensorimpl(t)->quantizer());
  } else {
    const auto type = t.is_quantized() ? c10::toUnderlying(t.scalar_type()) : t.scalar_type();
    cpu = at::detail::make_tensor<c10::TensorImpl>(
        std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
        c10::scalarTypeToTypeMeta(type));
  }
  cpu.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return cpu;
}
//< ch22 views

//> ch22 stubs
// The DispatchStub kernels: PyTorch's CPU kernels, queued on the stream,
// reading and writing device memory through the views. (The stubs
// themselves are not exported; the checked entry points that call them for
// a tensor's device are, and for the views that device is the CPU.)
using PerTensor = at::Tensor& (*)(const at::Tensor&, at::Tensor&, double, int64_t);

void per_tensor(PerTensor cpu_kernel, const char* name, const at::Tensor& in, at::Tensor& out,
                double scale, int64_t zero_point) {
  const at::Tensor& device_side = in.device().type() == kAcme ? in : out;
  DeviceViews view(DeviceViews::kForLaunch);
  launch_kernel(device_side.device().index(), name,
                [cpu_kernel, i = host_side(view, in), o = host_side(view, out), scale,
                 zero_point] {
                  at::Tensor result = o;
                  cpu_kernel(i, result, scale, zero_point);
                });
}

void quantize_per_tensor_kernel(const at::Tensor& r, at::Tensor& q, double scale,
                                int64_t zero_point) {
  per_tensor(&at::native::quantize_tensor_per_tensor_affine, "quantize_per_tensor", r, q,
             scale, zero_point);
}

void dequantize_per_tensor_kernel(const at::Tensor& q, at::Tensor& r, double scale,
                                  int64_t zero_point) {
  per_tensor(&at::native::dequantize_tensor_per_tensor_affine, "dequantize_per_tensor", q, r,
             scale, zero_point);
}
//< ch22 stubs

using PerChannel = at::Tensor& (*)(const at::Tensor&, at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, int64_t);

void per_channel(PerChannel cpu_kernel, const char* name, const at::Tensor& in, at::Tensor& out,
                 const at::Tensor& scales, const at::Tensor& zero_points, int64_t axis) {
  const at::Tensor& device_side = in.device().type() == kAcme ? in : out;
  // Parameters in host memory are copied: the caller may change them before
  // the kernel runs. (Views of device memory are ordered by the stream.)
  DeviceViews view(DeviceViews::kForLaunch);
  auto parameter = [&](const at::Tensor& p) {
    return p.device().type() == kAcme ? host_side(view, p) : p.clone();
  };
  launch_kernel(device_side.device().index(), name,
                [cpu_kernel, i = host_side(view, in), o = host_side(view, out),
                 s = parameter(scales), z = parameter(zero_points), axis] {
                  at::Tensor result = o;
                  cpu_kernel(i, result, s, z, axis);
                });
}

// PyTorch declares two of these with a by-value zero_points.
at::Tensor& quantize_channels(const at::Tensor& r, at::Tensor& q, const at::Tensor& s,
                              const at::Tensor& z, int64_t axis) {
  return at::native::quantize_tensor_per_channel_affine(r, q, s, z, axis);
}
at::Tensor& dequantize_channels(const at::Tensor& q, at::Tensor& r, const at::Tensor& s,
                                const at::Tensor& z, int64_t axis) {
  return at::native::dequantize_tensor_per_channel_affine(q, r, s, z, axis);
}

void quantize_per_channel_kernel(const at::Tensor& r, at::Tensor& q, const at::Tensor& s,
                                 const at::Tensor& z, int64_t axis) {
  per_channel(&quantize_channels, "quantize_per_channel", r, q, s, z, axis);
}

void dequantize_per_channel_kernel(const at::Tensor& q, at::Tensor& r, const at::Tensor& s,
                                   const at::Tensor& z, int64_t axis) {
  per_channel(&dequantize_channels, "dequantize_per_channel", q, r, s, z, axis);
}

void quantize_float_qparams_kernel(const at::Tensor& r, at::Tensor& q, const at::Tensor& s,
                                   const at::Tensor& z, int64_t axis) {
  per_channel(&at::native::quantize_tensor_per_channel_float_qparams,
              "quantize_per_channel_float_qparams", r, q, s, z, axis);
}

void dequantize_float_qparams_kernel(const at::Tensor& q, at::Tensor& r, const at::Tensor& s,
                                     const at::Tensor& z, int64_t axis) {
  per_channel(&at::native::dequantize_tensor_per_channel_float_qparams,
              "dequantize_per_channel_float_qparams", q, r, s, z, axis);
}

void quantize_sub_byte_kernel(const at::Tensor&, at::Tensor& qtensor, float, float) {
  check_whole_bytes(qtensor, "quantize");
}

void dequantize_sub_byte_kernel(const at::Tensor& qtensor, at::Tensor&, float, float) {
  check_whole_bytes(qtensor, "dequantize");
}

// ---- ops whose QuantizedCPU kernels touch memory the host's way ----

//> ch22 int-repr
at::Tensor int_repr(const at::Tensor& self) {
  check_whole_bytes(self, "int_repr");
  at::Tensor out = at::empty(self.sizes(), self.options()
                                               .dtype(c10::toUnderlying(self.scalar_type()))
                                               .memory_format(self.suggest_memory_format()));
  if (out.numel() == 0) return out;
  DeviceViews view(DeviceViews::kForLaunch);
  launch_kernel(self.device().index(), "int_repr",
                [in = host_side(view, self, /*as_integers=*/true), o = host_side(view, out)] {
                  at::Tensor result = o;
                  result.copy_(in);
                });
  return out;
}
//< ch22 int-repr

//> ch22 copy
// Tensor.copy_ hands devices it does not know to _copy_from before its own
// quantized checks, so they are here: quantized to quantized takes the
// source's quantizer, as on the CPU; a float source is quantized with the
// destination's; quantized to float is refused, as on the CPU. Then the
// integers move.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  TORCH_CHECK(dst.is_quantized(), "Copying from quantized Tensor to non-quantized Tensor is not ",
              "allowed, please use dequantize to get a float Tensor from a quantized Tensor");
  check_whole_bytes(dst, "copy_");
  at::Tensor src = self;
  if (!src.is_quantized()) {  // q.copy_(floats): quantize them with q's own parameters
    TORCH_CHECK(dst.qscheme() == at::kPerTensorAffine, kAcme,
                ": copying floats into a quantized tensor needs a per-tensor quantizer, got ",
                dst.qscheme());
    src = at::quantize_per_tensor(src.to(dst.device(), at::kFloat).expand(dst.sizes()),
                                  dst.q_scale(), dst.q_zero_point(), dst.scalar_type());
  } else {
    check_whole_bytes(src, "copy_");
    TORCH_CHECK(src.qscheme() == dst.qscheme(), "Quantized Copy only works with same qscheme");
    TORCH_CHECK(src.scalar_type() == dst.scalar_type(), kAcme,
                ": quantized copy between ", src.scalar_type(), " and ", dst.scalar_type());
    at::set_quantizer_(dst, src.quantizer());
  }
  TORCH_CHECK(src.sizes() == dst.sizes(), kAcme, ": quantized copy from ", src.sizes(),
              " into ", dst.sizes());
  if (dst.numel() == 0) return dst;
  at::assert_no_internal_overlap(dst);
  at::assert_no_partial_overlap(dst, src);
  const bool src_on_acme = src.device().type() == kAcme, dst_on_acme = dst.device().type() == kAcme;
  if (src_on_acme && dst_on_acme) {  // a kernel on dst's stream, ordered after src's
    const c10::DeviceIndex from = src.device().index(), to = dst.device().index();
    if (from != to) stream_wait(to, from);
    DeviceViews view(DeviceViews::kForLaunch);
    launch_kernel(to, "quantized copy",
                  [in = host_side(view, src, true), out = host_side(view, dst, true)] {
                    at::Tensor o = out;
                    o.copy_(in);
                  });
    if (from != to) stream_wait(from, to);  // src's memory is read until then
  } else {  // one side in host memory: here, once the device's stream is there
    DeviceViews view;  // waits for the device's stream
    at::Tensor out = host_side(view, dst, true);
    out.copy_(host_side(view, src, true));
  }
  return dst;
}
//< ch22 copy

bool equal(const at::Tensor& self, const at::Tensor& other) {
  TORCH_CHECK(self.device() == other.device(), "Cannot compare two tensors on different ",
              "devices. Got: ", self.device(), " and ", other.device());
  if (!other.is_quantized() || self.qscheme() != other.qscheme() ||
      self.scalar_type() != other.scalar_type() || self.sizes() != other.sizes())
    return false;
  if (self.qscheme() == at::kPerTensorAffine) {
    if (self.q_scale() != other.q_scale() || self.q_zero_point() != other.q_zero_point())
      return false;
  } else {
    if (self.q_per_channel_axis() != other.q_per_channel_axis() ||
        !at::equal(self.q_per_channel_scales().cpu(), other.q_per_channel_scales().cpu()) ||
        !at::equal(self.q_per_channel_zero_points().cpu(),
                   other.q_per_channel_zero_points().cpu()))
      return false;
  }
  return at::equal(acme::int_repr(self), acme::int_repr(other));
}

//> ch22 unsupported
// Every other op on a quantized acme tensor: an error that names it, instead
// of the dispatcher's table of the keys it has kernels for.
void unsupported(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, kAcme, ": ", op.schema().operator_name(),
                              " has no kernel for quantized ", kAcme,
                              " tensors. Dequantize first (t.dequantize()), or move the "
                              "tensor to the CPU for PyTorch's quantized CPU kernels");
}

// The fallback only sees ops without a kernel for the key. Structured ops
// (add, mul, sum, mm, ...) have a generic one for every backend, which makes
// its result with at::empty: the fallback would then name aten::empty, not
// the op the user called. So those get the error as their own kernel.
void refuse_structured_ops(torch::Library& library) {
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    const auto op = dispatcher.findOp(name);
    if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::QuantizedPrivateUse1) ||
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
      continue;
    // The *_copy forms of views, and the *_scatter ops, are views, clones
    // and copies underneath: those work for quantized acme tensors.
    if (op->hasTag(at::Tag::view_copy) || name.name.ends_with("_scatter")) continue;
    const std::string op_name = name.overload_name.empty()
                                    ? name.name.substr(6)
                                    : name.name.substr(6) + "." + name.overload_name;
    library.impl(op_name.c_str(), torch::CppFunction::makeFromBoxedFunction<&unsupported>());
  }
}
//< ch22 unsupported

}  // namespace
}  // namespace acme

//> ch22 register
namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(quantize_tensor_per_tensor_affine_stub,
                              &acme::quantize_per_tensor_kernel)
REGISTER_PRIVATEUSE1_DISPATCH(dequantize_tensor_per_tensor_affine_stub,
                              &acme::dequantize_per_tensor_kernel)
REGISTER_PRIVATEUSE1_DISPATCH(quantize_tensor_per_channel_affine_stub,
                              &acme::quantize_per_channel_kernel)
REGISTER_PRIVATEUSE1_DISPATCH(dequantize_tensor_per_channel_affine_stub,
                              &acme::dequantize_per_channel_kernel)
REGISTER_PRIVATEUSE1_DISPATCH(quantize_tensor_per_channel_float_qparams_stub,
                              &acme::quantize_float_qparams_kernel)
REGISTER_PRIVATEUSE1_DISPATCH(dequantize_tensor_per_channel_float_qparams_stub,
                              &acme::dequantize_float_qparams_kernel)
REGISTER_PRIVATEUSE1_DISPATCH(quantize_tensor_per_tensor_affine_sub_byte_stub,
                              &acme::quantize_sub_byte_kernel)
REGISTER_PRIVATEUSE1_DISPATCH(dequantize_tensor_per_tensor_affine_sub_byte_stub,
                              &acme::dequantize_sub_byte_kernel)
}  // namespace at::native

// Float tensors in, quantized tensors out: keyed by the float input. These
// are PyTorch's own kernels: they allocate through the accelerator's
// allocator and quantize through the stubs above.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("quantize_per_tensor", TORCH_FN(acme::quantize_per_tensor));
  m.impl("quantize_per_tensor.tensor_qparams", TORCH_FN(acme::quantize_per_tensor_tensor_qparams));
  m.impl("quantize_per_channel", TORCH_FN(acme::quantize_per_channel));
  m.impl("_empty_affine_quantized", TORCH_FN(acme::empty_affine_quantized));
  m.impl("_empty_per_channel_affine_quantized",
         TORCH_FN(acme::empty_per_channel_affine_quantized));
}

// Quantized acme tensors in. Most kernels are PyTorch's generic ones, the
// QuantizedCPU kernels' own, which only read the quantizer, build views or
// allocate.
TORCH_LIBRARY_IMPL(aten, QuantizedPrivateUse1, m) {
  m.impl("_empty_affine_quantized", TORCH_FN(acme::empty_affine_quantized));
  m.impl("_empty_per_channel_affine_quantized",
         TORCH_FN(acme::empty_per_channel_affine_quantized));
  m.impl("empty.memory_format", TORCH_FN(acme::empty_unknown_quantized));
  m.impl("empty_quantized", TORCH_FN(at::native::empty_quantized));
  m.impl("empty_like", TORCH_FN(at::native::empty_like_quantized));
  m.impl("clone", TORCH_FN(at::native::quantized_clone));
  m.impl("dequantize.self", TORCH_FN(at::native::dequantize_quantized));
  m.impl("q_scale", TORCH_FN(at::native::q_scale_quant));
  m.impl("q_zero_point", TORCH_FN(at::native::q_zero_point_quant));
  m.impl("q_per_channel_scales", TORCH_FN(at::native::q_per_channel_scales));
  m.impl("q_per_channel_zero_points", TORCH_FN(at::native::q_per_channel_zero_points));
  m.impl("q_per_channel_axis", TORCH_FN(at::native::q_per_channel_axis));
  m.impl("qscheme", TORCH_FN(at::native::qscheme_quant));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_qtensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("squeeze", TORCH_FN(static_cast<at::Tensor (*)(const at::Tensor&)>(
                        at::native::squeeze_quantized)));
  m.impl("squeeze.dim", TORCH_FN(static_cast<at::Tensor (*)(const at::Tensor&, int64_t)>(
                            at::native::squeeze_quantized)));
  m.impl("squeeze.dims",
         TORCH_FN(static_cast<at::Tensor (*)(const at::Tensor&, at::IntArrayRef)>(
             at::native::squeeze_quantized)));
  m.impl("unsqueeze", TORCH_FN(at::native::unsqueeze_quantized));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(at::native::set_storage_quantized_));
  m.impl("int_repr", TORCH_FN(acme::int_repr));
  m.impl("_copy_from", TORCH_FN(acme::copy_from));
  m.impl("equal", TORCH_FN(acme::equal));
}

TORCH_LIBRARY_IMPL(_, QuantizedPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&acme::unsupported>());
}

// After the kernels above (registration follows the order of this file).
TORCH_LIBRARY_IMPL(aten, QuantizedPrivateUse1, m) { acme::refuse_structured_ops(m); }
//< ch22 register
