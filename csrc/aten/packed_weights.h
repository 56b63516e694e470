//@ ch16
// Packed linear weights (packed_weights.cpp): tensors with no storage.
#pragma once

#include <ATen/core/Tensor.h>

namespace acme {
// True for a weight made by torch.ops.acme.pack_linear_weight.
bool is_packed(const at::Tensor& t);
}  // namespace acme
