//@ ch23
// The kernels two small training runs needed (chapter 23): a CNN and a
// transformer language model, trained with AdamW, gradient clipping and AMP.
// Run with the CPU fallback, they reached it for the ops listed at the end:
// each call copied its inputs to the host and its results back. Here each of
// them computes where its tensors live: PyTorch's CPU kernel for the op runs
// on device views of the arguments, writing in-place and out= results
// straight into device memory. One boxed kernel serves them all; a vendor
// registers its own kernel per op at the same names.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/empty.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>

#include <optional>
#include <utility>
#include <vector>

#include "aten/device_views.h"

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;

//> ch23 device-of-arguments
// The one acme device among an op's tensor arguments (lists included). Device
// views pass CPU tensors through, so the CPU kernel would compute with a
// second acme device's tensors, or a CPU tensor's, without a word: refuse
// them, as PyTorch's kernels do. A CPU scalar (0-dim) stays allowed, as do
// CPU index tensors (a list of optional tensors: aten::index's indices).
c10::Device device_of_arguments(const c10::OperatorHandle& op,
                                const std::vector<c10::IValue>& args) {
  std::optional<c10::Device> device;
  std::optional<c10::Device> other;
  auto note = [&](const at::Tensor& t, bool cpu_allowed) {
    if (!t.defined()) return;
    if (t.device().type() != kAcme) {
      if (!cpu_allowed && t.dim() > 0 && !other) other = t.device();
      return;
    }
    if (!device) device = t.device();
    if (t.device() != *device && !other) other = t.device();
  };
  for (const c10::IValue& v : args) {
    if (v.isTensor()) {
      note(v.toTensor(), false);
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) note(t, false);
    } else if (v.isOptionalTensorList()) {
      for (const std::optional<at::Tensor> t : v.toOptionalTensorList())
        if (t) note(*t, true);
    }
  }
  TORCH_INTERNAL_ASSERT(device, kAcme, " kernel for ", op.schema().operator_name(),
                        " called without an ", kAcme, " tensor");
  TORCH_CHECK(!other, "Expected all tensors to be on the same device, but found at least two "
              "devices, ", *device, " and ", *other, "! (in the ", kAcme, " kernel for ",
              op.schema().operator_name(), ")");
  return *device;
}
//< ch23 device-of-arguments

//> ch23 on-device-kernel
// Runs the op's CPU kernel on device views (which wait for the device's
// stream first, like any host access). Three kinds of result:
//  - in-place arguments are device views already: written where they live;
//  - out= arguments get a CPU result the kernel may resize as it likes, then
//    the device tensor is resized the same way (resize_output) and filled;
//  - new results come back as CPU tensors and move to the device.
void on_device_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  const auto first = stack->end() - static_cast<std::ptrdiff_t>(arguments.size());
  const std::vector<c10::IValue> originals(first, stack->end());
  const c10::Device device = device_of_arguments(op, originals);

  DeviceViews view;
  std::vector<std::pair<size_t, at::Tensor>> out_results;  // (argument, CPU result)
  for (size_t i = 0; i < arguments.size(); ++i) {
    c10::IValue& v = first[static_cast<std::ptrdiff_t>(i)];
    if (v.isTensor()) {
      const at::Tensor t = v.toTensor();
      if (arguments[i].is_out() && t.defined() && t.device().type() == kAcme) {
        at::Tensor result = at::empty({0}, t.options().device(c10::kCPU));
        out_results.emplace_back(i, result);
        v = result;
      } else {
        v = view(t);
      }
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> views;
      for (const at::Tensor& t : v.toTensorList()) views.push_back(view(t));
      v = views;
    } else if (v.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> views;
      for (const std::optional<at::Tensor> t : v.toOptionalTensorList())
        views.push_back(t ? std::optional(view(*t)) : std::nullopt);
      v = views;
    }
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  for (const auto& [i, result] : out_results) {
    const at::Tensor& out = originals[i].toTensor();
    at::native::resize_output(out, result.sizes());
    DeviceViews after_resize;  // a resize may have given `out` new memory
    after_resize(out).copy_(result);
  }
  // A result that aliases an argument (in-place, out=) is that argument, the
  // device tensor; any other result is new, and moves to the device.
  const auto& returns = schema.returns();
  const auto results = stack->end() - static_cast<std::ptrdiff_t>(returns.size());
  for (size_t r = 0; r < returns.size(); ++r) {
    c10::IValue& v = results[static_cast<std::ptrdiff_t>(r)];
    if (const auto* alias = returns[r].alias_info(); alias && alias->isWrite()) {
      for (size_t i = 0; i < arguments.size(); ++i) {
        const auto* argument_alias = arguments[i].alias_info();
        if (argument_alias && argument_alias->beforeSets() == alias->beforeSets()) {
          v = originals[i];
          break;
        }
      }
    } else if (v.isTensor()) {
      v = on_device(v.toTensor(), device);
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> moved;
      for (const at::Tensor& t : v.toTensorList()) moved.push_back(on_device(t, device));
      v = moved;
    }
  }
}
//< ch23 on-device-kernel

}  // namespace
}  // namespace acme

//> ch23 register-training-kernels
// What the two models reached the fallback for, by where it came from.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  const auto kernel = [] {
    return torch::CppFunction::makeFromBoxedFunction<&acme::on_device_kernel>();
  };
  for (const char* name : {
           // layers: activations, normalisation, pooling, dropout, embedding
           "relu", "relu_", "threshold_backward", "threshold_backward.grad_input", "gelu",
           "gelu_", "gelu.out", "gelu_backward", "gelu_backward.grad_input",
           "_native_batch_norm_legit", "_native_batch_norm_legit.no_stats",
           "native_batch_norm_backward", "native_layer_norm", "native_layer_norm_backward",
           "max_pool2d_with_indices", "max_pool2d_with_indices.out",
           "max_pool2d_with_indices_backward", "max_pool2d_with_indices_backward.grad_input",
           "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "native_dropout_backward",
           "embedding_dense_backward",
           // the loss
           "nll_loss_forward", "nll_loss_forward.output", "nll_loss_backward",
           "nll_loss_backward.grad_input", "_log_softmax_backward_data",
           "_log_softmax_backward_data.out",
           // gradient clipping (clip_grad_norm_)
           "cat", "cat.out", "linalg_vector_norm", "linalg_vector_norm.out", "reciprocal",
           "reciprocal_", "reciprocal.out", "clamp", "clamp_", "clamp.out", "clamp.Tensor",
           "clamp_.Tensor", "clamp.Tensor_out",
           // AdamW, foreach (one op per tensor) and fused
           "sqrt", "sqrt_", "sqrt.out", "lerp.Scalar", "lerp_.Scalar", "lerp.Scalar_out",
           "addcmul", "addcmul_", "addcmul.out", "addcdiv", "addcdiv_", "addcdiv.out",
           "_fused_adamw_", "_fused_adamw_.tensor_lr", "_fused_adam_", "_fused_adam_.tensor_lr",
           // GradScaler
           "_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_",
           // SyncBatchNorm's Python code (its own operators: sync_batch_norm.cpp)
           "nonzero", "nonzero.out", "index.Tensor", "index.Tensor_out"}) {
    m.impl(name, kernel());
  }
}
//< ch23 register-training-kernels
