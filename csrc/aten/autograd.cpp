//@ ch03
// A backend's own autograd for one op. PyTorch's derivative formulas already
// work on acme (they are ordinary ops); a vendor overrides one when it has a
// better backward, e.g. a fused kernel or one that saves less memory.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/tanh_backward.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "aten/autograd.h"
#include "runtime/acme_runtime.h"

namespace acme {

//> ch03 tanh-function
// tanh's backward computed from the saved *output*: d tanh(x)/dx = 1 - tanh(x)^2,
// so the input need not be kept alive for the backward pass.
struct AcmeTanh : torch::autograd::Function<AcmeTanh> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    // Run the device kernel below autograd; without this guard at::tanh would
    // dispatch straight back to this function.
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor y = at::tanh(x);
    ctx->save_for_backward({y});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor y = ctx->get_saved_variables()[0];
    // ATen's own tanh_backward (grad * conj(1 - y^2)): written out by hand as
    // grad * (1 - y * y) it was wrong for complex inputs and, in half
    // precision, rounded where the CPU does not (chapter 14 found both).
    return {at::tanh_backward(grads[0], y)};
  }
};
//< ch03 tanh-function

//> ch03 register
at::Tensor tanh_with_acme_autograd(const at::Tensor& x) { return AcmeTanh::apply(x); }

// AutogradPrivateUse1 sits above PrivateUse1: a kernel here decides what the
// backward graph records. A kernel at PrivateUse1 only computes the forward,
// and PyTorch's own formula (TanhBackward0) would still be recorded.
TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("tanh", TORCH_FN(tanh_with_acme_autograd));
}
//< ch03 register

//> ch03 drain
// Works around an upstream race at interpreter exit: the autograd engine runs
// acme backwards on a thread per device, and that thread may drop the last
// reference to a finished graph (and the Python tensors in it) while Python is
// finalizing; it then cannot take the GIL and the process aborts ("terminate
// called without an active exception"). A device thread serves its queue in
// order and releases each graph before taking the next task, so one tiny
// backward per device, run at exit from tensors without Python objects, waits
// until every earlier graph is gone.
void drain_autograd_device_threads() {
  int count = 0;
  if (acmeGetDeviceCount(&count) != acmeSuccess) return;
  for (int device = 0; device < count; ++device) {
    // Only ops with acme kernels of their own (empty, view, copy): nothing
    // falls back to the CPU, so nothing warns at exit.
    const auto options = at::TensorOptions().device(c10::DeviceType::PrivateUse1, device);
    const at::Tensor x = at::empty({1}, options).requires_grad_();
    torch::autograd::backward({x.view({1})}, {at::empty({1}, options)});
  }
}
//< ch03 drain

}  // namespace acme
