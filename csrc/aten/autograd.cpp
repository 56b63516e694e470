//@ ch03
// A backend's share of autograd. PyTorch's derivative formulas already work on
// acme (they are ordinary ops); a vendor gives their backward ops device
// kernels, and overrides an op's autograd only when it must own the graph.
#include <ATen/ExpandUtils.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/result_type.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/tanh_backward.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "aten/acme_check.h"
#include "aten/autograd.h"
//> ch18 tanh-backward-include
#include "aten/launch.h"
//< ch18 tanh-backward-include
#include "runtime/acme_runtime.h"

namespace acme {

//> ch03 tanh-backward
// The usual route. tanh's graph node is PyTorch's own (TanhBackward0), as on
// every device; its formula calls aten::tanh_backward(grad, y), an ordinary
// op, and this kernel runs it on the device. Everything PyTorch builds on its
// graph (torch.func's transforms, forward-mode AD, double backward) keeps
// working. The arithmetic is the CPU's kernel over host views of device
// memory, as acme's kernels do until chapter 10 says more; a real device
// launches its own kernel here.
namespace {
at::Tensor host_view(const at::Tensor& t) {
  void* view = nullptr;
  ACME_CHECK(acmeDeviceAccess(&view, t.const_data_ptr()));
  return at::from_blob(view, t.sizes(), t.strides(), t.options().device(c10::kCPU));
}
}  // namespace

at::Tensor tanh_backward(const at::Tensor& grad, const at::Tensor& y) {
  TORCH_CHECK(grad.device() == y.device(), "tanh_backward: grad on ", grad.device(),
              " and output on ", y.device(), " must be on one device");
  at::Tensor result = at::empty(at::infer_size(grad.sizes(), y.sizes()),
                                y.options().dtype(at::result_type(grad, y)));
//> ch18 tanh-backward-waits
  wait_for_stream(y.device().index());  // the forward may still be queued
//< ch18 tanh-backward-waits
  at::Tensor out = host_view(result);
  at::tanh_backward_out(out, host_view(grad), host_view(y));
  return result;
}
//< ch03 tanh-backward

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
// backward graph records. A vendor that ships an override registers it as the
// backward kernel below is registered, in a TORCH_LIBRARY_IMPL block. It costs
// every model that uses the op torch.func and forward-mode AD (a C++ Function
// has neither), so acme ships the route above and makes this registration
// only on request, for as long as the returned Library lives.
std::unique_ptr<torch::Library> override_tanh_autograd() {
  auto m = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                            c10::DispatchKey::AutogradPrivateUse1, __FILE__,
                                            __LINE__);
  m->impl("tanh", TORCH_FN(tanh_with_acme_autograd));
  return m;
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
    try {
      const at::Tensor x = at::empty({1}, options).requires_grad_();
      torch::autograd::backward({x.view({1})}, {at::empty({1}, options)});
    } catch (const c10::Error&) {
      // The device cannot allocate (full, or a malformed PYTORCH_ALLOC_CONF the
      // program was already told of): then it ran no backward to drain.
    }
  }
}
//< ch03 drain

}  // namespace acme

//> ch03 register-backward
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("tanh_backward", TORCH_FN(acme::tanh_backward));
}
//< ch03 register-backward
