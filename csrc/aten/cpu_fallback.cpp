//@ ch02
// The CPU fallback: every aten op without an acme kernel runs on the CPU,
// its tensors copied there and its results copied back.
#include <ATen/native/CPUFallback.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <mutex>
#include <string>
#include <unordered_set>

#include "aten/cpu_fallback.h"
//> ch16 packed-include
#include "aten/packed_weights.h"
//< ch16 packed-include

namespace acme {

//> ch02 warn-once
// One warning per operator, not per call: a loop would drown the user.
void warn_once(const c10::OperatorHandle& op, const char* how) {
  static std::mutex mutex;
  static std::unordered_set<std::string> warned;
  const std::string name = c10::toString(op.schema().operator_name());
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (!warned.insert(name).second) return;
  }
  constexpr auto device = c10::DeviceType::PrivateUse1;  // prints as its registered name
  TORCH_WARN(device, ": ", name, " has no ", device, " kernel and runs on the CPU ", how);
}
//< ch02 warn-once

namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;

//> ch02 deny-views
// A view shares its base's storage. A CPU copy cannot: a "view" that fell back
// would silently stop aliasing, so writes through it would be lost.
void refuse_views(const c10::OperatorHandle& op) {
  for (const auto& ret : op.schema().returns()) {
    const auto* alias = ret.alias_info();
    TORCH_CHECK_NOT_IMPLEMENTED(
        alias == nullptr || alias->isWrite(), kAcme, ": ", op.schema().operator_name(),
        " is a view operator and has no ", kAcme, " kernel. A view cannot run on the CPU "
        "fallback, because its result must share the device tensor's storage.");
  }
}
//< ch02 deny-views


//> ch02 result-device
// Upstream's fallback sends results to the device an op names (a Device
// argument), else to the device of the *first* tensor argument. For `2 // t`
// that is the CPU scalar 2, so the result would stay on the CPU. Results
// belong on the device of the first acme argument, unless the op names one.
std::optional<c10::Device> first_acme_device(const c10::OperatorHandle& op,
                                             const torch::jit::Stack& args) {
  for (const auto& value : args) {
    if (value.isDevice()) return std::nullopt;  // wherever it sits: upstream honours it
  }
  for (const auto& value : args) {
    if (value.isTensor() && value.toTensor().defined() &&
        value.toTensor().device().type() == kAcme) {
      return value.toTensor().device();
    }
  }
  return std::nullopt;
}

void move_results_to(c10::Device device, const c10::OperatorHandle& op,
                     torch::jit::Stack* stack) {
  const size_t n = op.schema().returns().size();
  for (size_t i = stack->size() - n; i < stack->size(); ++i) {
    auto& value = (*stack)[i];
    if (value.isTensor() && value.toTensor().defined() &&
        value.toTensor().device().type() == c10::DeviceType::CPU) {
      value = value.toTensor().to(device);
    }
  }
}
//< ch02 result-device
//> ch06 same-device

// Kernels see the tensors of one device. The fallback would copy tensors of
// devices 0 and 1 alike to the host and compute with both, hiding a bug that
// every real accelerator reports; refuse it as PyTorch's own kernels do.

// Calls `check(tensor, argument)` on every tensor among op's arguments on the
// stack, including those inside tensor lists.
template <class Check>
void for_each_tensor_argument(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                              const Check& check) {
  const auto& arguments = op.schema().arguments();
  auto it = stack.end() - static_cast<std::ptrdiff_t>(arguments.size());
  for (const c10::Argument& argument : arguments) {
    const c10::IValue& value = *it++;
    if (value.isTensor()) {
      check(value.toTensor(), argument);
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList()) check(t, argument);
    } else if (value.isOptionalTensorList()) {
      for (const std::optional<at::Tensor> t : value.toOptionalTensorList())
        if (t) check(*t, argument);
    }
  }
}

// Where CUDA lets a CPU tensor with dimensions sit beside device tensors:
// advanced indexing takes its indices from the host (their schemas say
// device_check: NoCheck in native_functions.yaml).
bool takes_host_indices(const c10::OperatorHandle& op) {
  static const std::unordered_set<std::string> names = {
      "aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_",
      "aten::_unsafe_index_put"};
  return names.count(op.schema().name()) != 0;
}

// Every acme input must be on one device, and a CPU input beside them must be
// a 0-dim tensor (how PyTorch passes a Python number), as TensorIterator
// allows on CUDA. Arguments the op writes are chapter 13's check.
void refuse_mixed_devices(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  std::optional<c10::Device> acme;
  const c10::Argument* host = nullptr;  // the first CPU input with dimensions
  for_each_tensor_argument(op, stack, [&](const at::Tensor& t, const c10::Argument& argument) {
    if (!t.defined()) return;
    if (t.device().type() == kAcme) {
      if (!acme) acme = t.device();
      TORCH_CHECK(t.device() == *acme,
                  "Expected all tensors to be on the same device, but found at least two "
                  "devices, ", *acme, " and ", t.device(), "! (checked by the ", kAcme,
                  " backend's CPU fallback for ", op.schema().operator_name(), ")");
    } else if (t.device().is_cpu() && t.dim() > 0 && host == nullptr &&
               (argument.alias_info() == nullptr || !argument.alias_info()->isWrite())) {
      host = &argument;
    }
  });
  TORCH_CHECK(!acme || host == nullptr || takes_host_indices(op),
              "Expected all tensors to be on the same device, but found at least two devices, ",
              *acme, " and cpu! (argument '", host ? host->name() : "", "' of ",
              op.schema().operator_name(), " is a CPU tensor with dimensions; checked by the ",
              kAcme, " backend's CPU fallback)");
}
//< ch06 same-device
//> ch13 out-device

// An out= or in-place argument on the CPU beside acme inputs: the dispatcher
// picks acme (its key ranks above the CPU's), and the fallback would write
// the CPU tensor from acme data. PyTorch's own kernels refuse this; so does
// acme, naming the argument.
void refuse_host_outputs(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const auto& arguments = op.schema().arguments();
  const auto args = stack.end() - static_cast<std::ptrdiff_t>(arguments.size());
  std::optional<c10::Device> acme;
  for (auto it = args; it != stack.end() && !acme; ++it)
    if (it->isTensor() && it->toTensor().defined() && it->toTensor().device().type() == kAcme)
      acme = it->toTensor().device();
  if (!acme) return;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto* alias = arguments[i].alias_info();
    const c10::IValue& value = args[static_cast<std::ptrdiff_t>(i)];
    if (alias == nullptr || !alias->isWrite() || !value.isTensor()) continue;
    const at::Tensor& t = value.toTensor();
    TORCH_CHECK(!t.defined() || t.device().type() == kAcme,
                "Expected all tensors to be on the same device, but ", op.schema().operator_name(),
                " would write its result into argument '", arguments[i].name(), "' on ",
                t.device(), " while its inputs are on ", *acme, ". Pass '", arguments[i].name(),
                "' on ", *acme, ", or move the inputs to ", t.device(), ".");
  }
}
//< ch13 out-device

//> ch16 refuse-packed
// A packed weight has no storage to copy to the host: only its own operators
// can read it. Say so, instead of failing inside the copy.
void refuse_packed_weights(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  for_each_tensor_argument(op, stack, [&](const at::Tensor& t, const c10::Argument&) {
    TORCH_CHECK_NOT_IMPLEMENTED(!is_packed(t), kAcme, ": ", op.schema().operator_name(),
                                " cannot take a packed weight (from acme::pack_linear_weight): "
                                "it has no strided storage. Only acme::packed_linear reads it; "
                                "acme::unpack_linear_weight gives back an ordinary tensor.");
  });
}
//< ch16 refuse-packed

//> ch02 fallback
void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  refuse_views(op);
//> ch06 same-device-call
  refuse_mixed_devices(op, *stack);
//< ch06 same-device-call
//> ch13 out-device-call
  refuse_host_outputs(op, *stack);
//< ch13 out-device-call
//> ch16 refuse-packed-call
  refuse_packed_weights(op, *stack);
//< ch16 refuse-packed-call
  warn_once(op, "(inputs copied to the host, results copied back).");
  const size_t n_args = op.schema().arguments().size();
  const torch::jit::Stack args(stack->end() - n_args, stack->end());
  const auto device = first_acme_device(op, args);
  at::native::cpu_fallback(op, stack);
  if (device) move_results_to(*device, op, stack);
}
//< ch02 fallback

}  // namespace
}  // namespace acme

//> ch02 register-global
// `_` means every namespace: the fallback for all ops without an acme kernel.
TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&acme::cpu_fallback>());
}
//< ch02 register-global

//> ch02 register-per-op
// Some ops never reach the global fallback: abs has a CompositeExplicitAutograd
// kernel, which the dispatcher prefers to a backend fallback. That kernel makes
// an empty [0] result on the device and calls abs.out. Registering the fallback
// as abs's own acme kernel sends abs to the CPU in one piece instead.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("abs", torch::CppFunction::makeFromBoxedFunction<&acme::cpu_fallback>());
}
//< ch02 register-per-op

//> ch13 register-cpu-kernels < ch23 register-cpu-kernels
// // The same trap as abs, found by a scan rather than by a bug report: ops with
// // both a CPU kernel and a CompositeExplicitAutograd one. acme, having no kernel
// // of its own, got the composite, which can round differently from the CPU's
// // kernel (native_layer_norm over one element: 1e-4 apart in float32). Through
// // the fallback acme runs the CPU's kernel and matches it bit for bit.
// // tests/test_routed_ops.py repeats the scan, so a new such op fails a test.
// //
// // mse_loss and smooth_l1_loss are structured: their generic kernel makes a
// // 0-dim result and calls the .out form, whose CPU kernel resizes it and
// // warns that it did, a warning the CPU's own call never gives.
// TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
//   for (const char* name :
//        {"native_layer_norm", "native_group_norm", "addr", "addr.out", "_stack", "_stack.out",
//         "all.dims", "all.dims_out", "any.dims", "any.dims_out", "linalg__powsum", "mse_loss",
//         "smooth_l1_loss"}) {
//     m.impl(name, torch::CppFunction::makeFromBoxedFunction<&acme::cpu_fallback>());
//   }
// }
//< ch13 register-cpu-kernels
//> ch23 register-cpu-kernels
// Chapter 13's list, less native_layer_norm: chapter 23 gives it a kernel that
// runs on device memory (training_kernels.cpp). The rest keep the CPU's kernel
// through the fallback, for the reasons chapter 13 gives.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* name :
       {"native_group_norm", "addr", "addr.out", "_stack", "_stack.out", "all.dims",
        "all.dims_out", "any.dims", "any.dims_out", "linalg__powsum", "mse_loss",
        "smooth_l1_loss"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&acme::cpu_fallback>());
  }
}
//< ch23 register-cpu-kernels

//> ch14 register-cpu-kernels-implicit
// The other half of the trap, found by chapter 14's run (silu's gradient in
// half precision, one element in twenty apart): ops with a CPU kernel and a
// CompositeImplicitAutograd one. AutogradCPU skips the composite because the
// CPU has a kernel; AutogradPrivateUse1 ran it, decomposing the op on acme.
// A PrivateUse1 kernel makes the autograd key skip it on acme too. The hot
// one, silu_backward, gets a native kernel (native_kernels.cpp); these two,
// rarer, take the fallback at three host crossings a call until they do.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* name : {"mish_backward", "native_channel_shuffle"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&acme::cpu_fallback>());
  }
}
//< ch14 register-cpu-kernels-implicit

//> ch14 register-cpu-kernels-device-check
// The one found by the out= sweep: mode.values has only a generic kernel, and
// it refuses every device but the CPU, CUDA and XPU ("mode only supports CPU,
// CUDA and XPU device type, got: acme"), so torch.mode(x, out=...) failed where
// torch.mode(x) ran. Through the fallback it runs the CPU's kernel.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("mode.values", torch::CppFunction::makeFromBoxedFunction<&acme::cpu_fallback>());
}
//< ch14 register-cpu-kernels-device-check

//> ch14 register-cpu-kernels-format
// A third form of the trap, found by chapter 14's channels-last sweep: a
// structured op's CompositeExplicitAutogradNonFunctional kernel allocates a
// contiguous result on acme and calls the .out form, where the CPU's own
// kernel gives channels-last inputs a channels-last result. Through the
// fallback, the whole op runs on the CPU's kernel and keeps its strides.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* name : {"replication_pad2d", "replication_pad3d", "reflection_pad3d",
                           "reflection_pad3d_backward"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&acme::cpu_fallback>());
  }
}
//< ch14 register-cpu-kernels-format
