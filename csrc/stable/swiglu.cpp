//@ ch17
// acme_stable::swiglu(gate, up) = silu(gate) * up against PyTorch's stable ABI
// (torch/csrc/stable, chapter 17). This file reaches libtorch only through its
// C shim, which PyTorch keeps binary-compatible, so the library it builds loads
// in every PyTorch from the release it targets on, while _C serves the one
// release it was compiled against. What cannot live here: the glue, which
// subclasses c10's C++ classes (allocator, guard, hooks, generator).

// The oldest PyTorch this library runs on. Compiling against newer headers is
// fine: they hide what 2.13 lacks (Tensor::has_storage, say, from 2.14).
#define TORCH_TARGET_VERSION (((0ULL + 2) << 56) | ((0ULL + 13) << 48))

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cmath>
#include <cstdint>

#include "runtime/acme_runtime.h"
//> ch18 stable-launch-include
#include "runtime/acme_streams.h"
//< ch18 stable-launch-include

namespace {

using torch::stable::Tensor;

// Where the kernel reads and writes a device tensor (chapter 10's views,
// through the runtime's C API: the glue's C++ helpers are release-bound).
float* device_view(const Tensor& t) {
  void* view = nullptr;
  const acmeError_t error = acmeDeviceAccess(&view, t.data_ptr());
  STD_TORCH_CHECK(error == acmeSuccess, "acme_stable::swiglu: ", acmeGetErrorString(error));
  return static_cast<float*>(view);
}

void check_arguments(const Tensor& gate, const Tensor& up) {
  using torch::headeronly::ScalarType;
  STD_TORCH_CHECK(gate.device() == up.device(), "acme_stable::swiglu: gate and up are on ",
                  "different devices");
  STD_TORCH_CHECK(gate.scalar_type() == ScalarType::Float && up.scalar_type() == ScalarType::Float,
                  "acme_stable::swiglu: expected float32 gate and up");
  bool same_shape = gate.dim() == up.dim();
  for (int64_t d = 0; same_shape && d < gate.dim(); ++d) same_shape = gate.sizes()[d] == up.sizes()[d];
  STD_TORCH_CHECK(same_shape, "acme_stable::swiglu: gate and up must have the same shape");
}

// The arithmetic, over n contiguous elements wherever the kernel runs.
void swiglu_elements(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

//> ch18 stable-launch
// The kernel's arguments: device views, owned by the launch until it ran.
struct SwigluArgs {
  const float* gate;
  const float* up;
  float* out;
  int64_t n;
};

int swiglu_kernel(void* p, char*, size_t) {
  const auto* a = static_cast<const SwigluArgs*>(p);
  swiglu_elements(a->gate, a->up, a->out, a->n);
  return 0;
}

//< ch18 stable-launch
Tensor swiglu(Tensor gate, Tensor up) {
  check_arguments(gate, up);
  const torch::stable::accelerator::DeviceGuard guard(gate.get_device_index());
  const Tensor g = torch::stable::contiguous(gate), u = torch::stable::contiguous(up);
  Tensor out = torch::stable::empty_like(g);  // through the dispatcher: acme's allocator
  const int64_t n = g.numel();
  if (n == 0) return out;
//> ch17 stable-host-loop < ch18 stable-launch-call
//   swiglu_elements(device_view(g), device_view(u), device_view(out), n);
//< ch17 stable-host-loop
//> ch18 stable-launch-call
  // Queued on the stream PyTorch calls current (chapter 18), as a CUDA kernel
  // is launched on getCurrentCUDAStream(): the shim hands over the runtime's
  // own handle, which DeviceGuardImpl::getStreamNativeHandle returns.
  auto stream = static_cast<acmeStream_t>(
      torch::stable::accelerator::getCurrentStream(gate.get_device_index()).nativeHandle());
  auto* args = new SwigluArgs{device_view(g), device_view(u), device_view(out), n};
  const acmeError_t error = acmeLaunchKernel(stream, "acme_stable::swiglu", swiglu_kernel, args,
                                             [](void* p) { delete static_cast<SwigluArgs*>(p); });
  STD_TORCH_CHECK(error == acmeSuccess, "acme_stable::swiglu: ", acmeGetErrorString(error));
//< ch18 stable-launch-call
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY(acme_stable, m) {
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(acme_stable, PrivateUse1, m) {
  m.impl("swiglu", TORCH_BOX(&swiglu));
}
