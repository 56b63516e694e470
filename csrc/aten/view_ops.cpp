//@ ch13
// The view ops the dispatcher finds no acme kernel for. A view must share its
// base's storage, so the CPU fallback refuses them (chapter 2). Their CPU
// kernels only compute sizes, strides and a dtype over the same storage; no
// data is touched, so they are device-generic and acme registers them as is.
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <torch/library.h>

//> ch13 register-views
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("unfold", TORCH_FN(at::native::unfold));           // Tensor.repeat, tile, stft
  m.impl("view_as_real", TORCH_FN(at::native::view_as_real));  // .real, .imag, printing
  m.impl("view_as_complex", TORCH_FN(at::native::view_as_complex));
}
//< ch13 register-views
