//@ ch03
// Module.to(device) keeps each Parameter object, and an optimizer built before
// the move keeps working, only if PyTorch may swap a tensor's data in place:
// `_has_compatible_shallow_copy_type(param, moved)`. c10's answer
// (TensorImpl::has_compatible_shallow_copy_type) lists the dense backends it
// knows (CPU, CUDA, MPS, HIP, XPU, HPU, MTIA), not PrivateUse1, and its comment
// names this operator as the PrivateUse1 backend's way to answer instead.
#include <ATen/core/Tensor.h>
#include <torch/library.h>
//> ch16 shallow-copy-include

#include "aten/packed_weights.h"
//< ch16 shallow-copy-include

namespace acme {
namespace {

//> ch03 shallow-copy
// Without this, Module.to("acme") made new Parameter objects: an optimizer
// built before `.to()` updated the old ones (training that never learns, and
// no error), and lazy modules lost their UninitializedParameter.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && (t.is_cpu() || t.is_privateuseone());
  };
//> ch16 shallow-copy-packed
  // A packed weight (chapter 16) is an OpaqueTensorImpl, whose layout reads as
  // strided: it must never lend its metadata to an ordinary tensor, nor take
  // an ordinary tensor's (param.data = packed would break the parameter).
  if (is_packed(self) != is_packed(from)) return false;
//< ch16 shallow-copy-packed
  if (dense(self) && dense(from)) return true;
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}
//< ch03 shallow-copy

}  // namespace

//> ch03 register-shallow-copy
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
}
//< ch03 register-shallow-copy

}  // namespace acme
