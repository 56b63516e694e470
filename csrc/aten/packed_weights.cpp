//@ ch16
// A tensor without strided storage: a linear layer's weight packed once into
// the layout acme's (simulated) matrix unit reads, then used by every call.
// at::OpaqueTensorImpl holds a handle instead of a storage; PyTorch's oneDNN
// tensors (MkldnnCPU) are built the same way. Nothing that expects sizes,
// strides and a data pointer can read it: only the operators below can.
#include <ATen/OpaqueTensorImpl.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_to_copy.h>
#include <ATen/ops/_to_copy_native.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/clone_native.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <optional>
#include <utility>
#include <vector>

#include "aten/packed_weights.h"

namespace acme {

//> ch16 packed-handle
// The handle: the transposed weight, [in_features, out_features], contiguous
// in device memory (so an x @ W^T reads each output column as one row).
struct PackedLinearWeight {
  at::Tensor transposed;
};
using PackedTensorImpl = at::OpaqueTensorImpl<PackedLinearWeight>;

bool is_packed(const at::Tensor& t) {
  return t.defined() && dynamic_cast<const PackedTensorImpl*>(t.unsafeGetTensorImpl()) != nullptr;
}

const PackedLinearWeight& packed_handle(const at::Tensor& t) {
  TORCH_CHECK(is_packed(t), c10::DeviceType::PrivateUse1,
              ": expected a weight from torch.ops.acme.pack_linear_weight");
  return static_cast<PackedTensorImpl*>(t.unsafeGetTensorImpl())->opaque_handle();
}
//< ch16 packed-handle

namespace {

//> ch16 packed-ops
// Sizes say what the weight is ([out, in]); there are no strides to say.
at::Tensor wrap(at::Tensor transposed) {
  const std::vector<int64_t> sizes{transposed.size(1), transposed.size(0)};
  const auto dtype = transposed.dtype();
  const auto device = transposed.device();
  return at::detail::make_tensor<PackedTensorImpl>(
      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dtype, device,
      PackedLinearWeight{std::move(transposed)}, sizes);
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "acme::pack_linear_weight: expected a 2-D weight, got ",
              weight.dim(), " dimensions");
  TORCH_CHECK(!is_packed(weight), "acme::pack_linear_weight: the weight is already packed");
  return wrap(weight.t().contiguous());
}

at::Tensor unpack_linear_weight(const at::Tensor& packed) {
  return packed_handle(packed).transposed.t().contiguous();
}

at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  const at::Tensor& w = packed_handle(packed).transposed;
  TORCH_CHECK(input.size(-1) == w.size(0), "acme::packed_linear: input has ", input.size(-1),
              " features, the packed weight expects ", w.size(0));
  const at::Tensor rows = input.reshape({-1, input.size(-1)});
  at::Tensor out = bias && bias->defined() ? at::addmm(*bias, rows, w) : at::mm(rows, w);
  auto sizes = input.sizes().vec();
  sizes.back() = w.size(1);
  return out.view(sizes);
}
//< ch16 packed-ops

//> ch16 packed-copies
// Three paths copy a tensor whatever it is, and PyTorch takes them for a
// packed weight too: .cpu() and .to() (aten::_to_copy; torch.save calls
// .cpu() for a PrivateUse1 tensor without storage) and clone (what
// copy.deepcopy calls for one). These kernels read the handle; every other
// tensor goes on to PyTorch's own kernels, as before.
at::Tensor to_copy(const at::Tensor& self, std::optional<at::ScalarType> dtype,
                   std::optional<at::Layout> layout, std::optional<at::Device> device,
                   std::optional<bool> pin_memory, bool non_blocking,
                   std::optional<at::MemoryFormat> memory_format) {
  if (!is_packed(self)) {
    return at::native::_to_copy(self, dtype, layout, device, pin_memory, non_blocking,
                                memory_format);
  }
  // The handle's tensor moves once. Still on the device: packed again, as it
  // is. Elsewhere (the CPU) an ordinary [out, in] tensor, which is what a
  // checkpoint then holds.
  at::Tensor moved = at::_to_copy(packed_handle(self).transposed, dtype, layout, device, pin_memory,
                                  non_blocking, memory_format);
  if (moved.device().type() == c10::DeviceType::PrivateUse1) return wrap(std::move(moved));
  return moved.t().contiguous();
}

at::Tensor clone(const at::Tensor& self, std::optional<at::MemoryFormat> memory_format) {
  if (!is_packed(self)) return at::native::clone(self, memory_format);
  return wrap(packed_handle(self).transposed.clone());
}
//< ch16 packed-copies

}  // namespace
}  // namespace acme

//> ch16 register-packed
TORCH_LIBRARY_FRAGMENT(acme, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("unpack_linear_weight(Tensor packed) -> Tensor");
  m.def("packed_linear(Tensor input, Tensor packed, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(acme, PrivateUse1, m) {
  m.impl("pack_linear_weight", TORCH_FN(acme::pack_linear_weight));
  m.impl("unpack_linear_weight", TORCH_FN(acme::unpack_linear_weight));
  m.impl("packed_linear", TORCH_FN(acme::packed_linear));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_to_copy", TORCH_FN(acme::to_copy));
  m.impl("clone", TORCH_FN(acme::clone));
}
//< ch16 register-packed
