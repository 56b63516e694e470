//@ ch16
// A tensor without strided storage: a linear layer's weight packed once into
// the layout acme's (simulated) matrix unit reads, then used by every call.
// at::OpaqueTensorImpl holds a handle instead of a storage; PyTorch's oneDNN
// tensors (MkldnnCPU) are built the same way. Nothing that expects sizes,
// strides and a data pointer can read it: only the operators below can.
#include <ATen/OpaqueTensorImpl.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <optional>

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
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "acme::pack_linear_weight: expected a 2-D weight, got ",
              weight.dim(), " dimensions");
  TORCH_CHECK(!is_packed(weight), "acme::pack_linear_weight: the weight is already packed");
  PackedLinearWeight handle{weight.t().contiguous()};
  // Sizes say what the weight is ([out, in]); there are no strides to say.
  return at::detail::make_tensor<PackedTensorImpl>(
      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), weight.dtype(), weight.device(),
      std::move(handle), weight.sizes());
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
//< ch16 register-packed
