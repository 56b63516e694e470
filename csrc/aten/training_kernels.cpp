//@ ch23
// The kernels two small training runs needed (chapter 23): a CNN and a
// transformer language model, trained with AdamW, gradient clipping and AMP.
// Run with the CPU fallback, they reached it for the ops listed at the end:
// each call copied its inputs to the host and its results back. Here each of
// them computes where its tensors live: PyTorch's CPU kernel for the op runs
// on device views of the arguments, writing in-place and out= results
// straight into device memory. One boxed kernel serves them all; a vendor
// registers its own kernel per op at the same names.
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/empty.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "aten/device_views.h"
#include "aten/index_checks.h"
#include "aten/routed_ops.h"
#include "aten/run_on_stream.h"

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;

//> ch23 device-of-arguments
// The one acme device among an op's tensor arguments (lists included). Device
// views pass CPU tensors through, so the CPU kernel would compute with a
// second acme device's tensors, or a CPU tensor's, without a word: refuse
// them, as PyTorch's kernels do. A CPU scalar (0-dim) input stays allowed, as
// do CPU index tensors (a list of optional tensors: aten::index's indices);
// what the op writes must be on the device.
c10::Device device_of_arguments(const c10::OperatorHandle& op,
                                const std::vector<c10::IValue>& args) {
  const auto& arguments = op.schema().arguments();
  std::optional<c10::Device> device;
  std::optional<c10::Device> other;
  auto note = [&](const at::Tensor& t, bool cpu_allowed) {
    if (!t.defined()) return;
    if (t.device().type() != kAcme) {
      if (!cpu_allowed && !other) other = t.device();
      return;
    }
    if (!device) device = t.device();
    if (t.device() != *device && !other) other = t.device();
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = args[i];
    const auto* alias = arguments[i].alias_info();
    const bool written = alias != nullptr && alias->isWrite();
    if (v.isTensor()) {
      note(v.toTensor(), !written && v.toTensor().dim() == 0);
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) note(t, false);
    } else if (v.isOptionalTensorList()) {
      for (const std::optional<at::Tensor> t : v.toOptionalTensorList())
        if (t) note(*t, !written);
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
// Runs the op's CPU kernel on device views of its arguments, on `device`
// (on_stream_kernel below runs it on the stream's worker). Three kinds of
// result:
//  - in-place arguments are device views: written where they live;
//  - an out= argument is a device view too when it has elements, so the CPU
//    kernel checks overlap and resizes as it would on the CPU. An empty one
//    (the usual case), or one the result outgrows, gets a CPU result the
//    kernel sizes as it likes; the device tensor takes its shape and strides
//    and is filled from it;
//  - new results come back as CPU tensors and move to the device.
//
// An argument as the CPU kernel takes it: tensors, in lists too, as views.
c10::IValue viewed(DeviceViews& view, const c10::IValue& v) {
  if (v.isTensor()) return view(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> views;
    for (const at::Tensor& t : v.toTensorList()) views.push_back(view(t));
    return views;
  }
  if (v.isOptionalTensorList()) {
    c10::List<std::optional<at::Tensor>> views;
    for (const std::optional<at::Tensor> t : v.toOptionalTensorList())
      views.push_back(t ? std::optional(view(*t)) : std::nullopt);
    return views;
  }
  return v;
}

// The argument that result `r` aliases (in-place, out=), which the op returns.
const c10::IValue& aliased_argument(const c10::FunctionSchema& schema, size_t r,
                                    const std::vector<c10::IValue>& originals) {
  const auto* alias = schema.returns()[r].alias_info();
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto* argument_alias = schema.arguments()[i].alias_info();
    if (argument_alias && argument_alias->beforeSets() == alias->beforeSets())
      return originals[i];
  }
  TORCH_INTERNAL_ASSERT(false, schema.operator_name(), ": result ", r, " aliases no argument");
}

void on_device_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                      c10::Device device) {
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  const size_t base = stack->size() - arguments.size();
  const std::vector<c10::IValue> originals(stack->begin() + static_cast<std::ptrdiff_t>(base),
                                           stack->end());

  DeviceViews view;
  std::vector<std::pair<size_t, at::Tensor>> outs;  // (argument, what the kernel wrote)
  // The arguments on the stack again, as the CPU kernel takes them.
  auto push_arguments = [&](bool view_outs) {
    stack->resize(base);
    outs.clear();
    for (size_t i = 0; i < arguments.size(); ++i) {
      const c10::IValue& v = originals[i];
      if (v.isTensor()) {
        const at::Tensor& t = v.toTensor();
        const bool out = arguments[i].is_out() && t.defined();
        stack->push_back(out && (t.numel() == 0 || !view_outs)
                             ? at::empty({0}, t.options().device(c10::kCPU))
                             : view(t));
        if (out) outs.emplace_back(i, stack->back().toTensor());
      } else {
        stack->push_back(viewed(view, v));
      }
    }
  };
  push_arguments(/*view_outs=*/true);
  try {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  } catch (const c10::Error& error) {
    // The one thing a device view cannot do that a CPU tensor can: grow. The
    // kernel resizes before it writes, so it runs again, out= into CPU results.
    if (std::string(error.what()).find("not resizable") == std::string::npos) throw;
    // A CPU result overlaps nothing, so first the check the kernel would have
    // made after growing the out= tensor: it must not share an input's memory.
    for (const auto& [i, written] : outs) {
      for (size_t j = 0; j < originals.size(); ++j) {
        if (j == i) continue;
        const c10::IValue& v = originals[j];
        if (v.isTensor() && v.toTensor().defined() && v.toTensor().device() == device)
          at::assert_no_overlap(view(originals[i].toTensor()), view(v.toTensor()));
        if (v.isTensorList())
          for (const at::Tensor& t : v.toTensorList())
            at::assert_no_overlap(view(originals[i].toTensor()), view(t));
      }
    }
    push_arguments(/*view_outs=*/false);
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  }

  for (const auto& [i, written] : outs) {
    const at::Tensor& out = originals[i].toTensor();
    auto* impl = out.unsafeGetTensorImpl();
    if (!written.is_alias_of(view(out))) {
      // A CPU result: the device tensor takes its shape and strides, then its values.
      at::native::resize_output(out, written.sizes());
      impl->set_sizes_and_strides(written.sizes(), written.strides(), out.storage_offset());
      DeviceViews after_resize;  // the resize may have given `out` new memory
      after_resize(out).copy_(written);
    } else if (written.sizes() != out.sizes() || written.strides() != out.strides()) {
      // The kernel shrank the view in place; the device tensor follows.
      impl->set_sizes_and_strides(written.sizes(), written.strides(), written.storage_offset());
    }
  }
  // A result that aliases an argument (in-place, out=) is that argument, the
  // device tensor; any other result is new, and moves to the device.
  const auto& returns = schema.returns();
  const auto results = stack->end() - static_cast<std::ptrdiff_t>(returns.size());
  for (size_t r = 0; r < returns.size(); ++r) {
    c10::IValue& v = results[static_cast<std::ptrdiff_t>(r)];
    if (const auto* alias = returns[r].alias_info(); alias && alias->isWrite()) {
      v = aliased_argument(schema, r, originals);
    } else if (v.isTensor()) {
      v = on_device(v.toTensor(), device);
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> moved;
      for (const at::Tensor& t : v.toTensorList()) moved.push_back(on_device(t, device));
      v = moved;
    }
  }
}

// What the host needs back from a kernel: nothing when every result is an
// argument (in-place); the new results' sizes, strides and dtypes when they
// follow from the arguments' shapes; otherwise the kernel's own answer.
enum class Results { in_place, shaped_by_arguments, only_the_kernel_knows };

Results results_of(const c10::FunctionSchema& schema) {
  // An out= argument may need resizing to a size the kernel decides.
  for (const auto& a : schema.arguments()) {
    if (a.is_out()) return Results::only_the_kernel_knows;
  }
  // Sizes that depend on values (nonzero, a boolean index).
  static const auto* value_dependent = new std::set<std::string>{  // kernels may launch at exit
      "aten::nonzero", "aten::index"};
  if (value_dependent->count(schema.name())) return Results::only_the_kernel_knows;
  const auto& returns = schema.returns();
  const bool all_in_place = std::all_of(returns.begin(), returns.end(), [](const auto& r) {
    return r.alias_info() && r.alias_info()->isWrite();
  });
  if (all_in_place) return Results::in_place;
  const bool all_new = std::all_of(returns.begin(), returns.end(), [](const auto& r) {
    return !r.alias_info() && r.type()->kind() == c10::TypeKind::TensorType;
  });
  return all_new ? Results::shaped_by_arguments : Results::only_the_kernel_knows;
}

// What a call's validity and its results' shapes depend on besides the
// tensors' values: each tensor's device, dtype, sizes and strides, which
// arguments share memory, the values of integer, boolean and string arguments
// (dimensions, reductions, modes) and the kinds of the others (a Scalar's
// value changes neither). Empty if an argument is a CPU tensor (read when
// the kernel runs, the host may have changed it) or of a kind not keyed here.
std::vector<int64_t> shape_key(const c10::OperatorHandle& op,
                               c10::ArrayRef<c10::IValue> arguments) {
  std::vector<int64_t> key{static_cast<int64_t>(std::hash<std::string>()(op.schema().name())),
                           static_cast<int64_t>(std::hash<std::string>()(
                               op.schema().overload_name()))};
  // The one kernel here that checks a Scalar's value (a norm's order).
  const bool scalar_values = op.schema().name() == "aten::linalg_vector_norm";
  std::vector<const void*> storages;
  bool keyable = true;
  auto tensor = [&](const at::Tensor& t) {
    if (!t.defined()) return key.push_back(-1);
    const void* storage = t.storage().unsafeGetStorageImpl();
    const auto seen = std::find(storages.begin(), storages.end(), storage);
    key.push_back(seen - storages.begin());  // the first argument with this memory
    if (seen == storages.end()) storages.push_back(storage);
    if (!add_to_shape_key(key, t)) keyable = false;  // run_on_stream.h
  };
  for (const c10::IValue& v : arguments) {
    key.push_back(static_cast<int64_t>(std::hash<std::string>()(v.tagKind())));
    if (v.isTensor()) {
      tensor(v.toTensor());
    } else if (v.isTensorList()) {
      key.push_back(static_cast<int64_t>(v.toTensorList().size()));
      for (const at::Tensor& t : v.toTensorList()) tensor(t);
    } else if (v.isDouble() && scalar_values) {
      const double value = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &value, sizeof bits);
      key.push_back(bits);
    } else if (v.isInt()) {
      key.push_back(v.toInt());  // a dimension, a reduction: results' shapes follow it
    } else if (v.isString()) {
      key.push_back(static_cast<int64_t>(std::hash<std::string>()(v.toStringRef())));
    } else if (v.isBoolList()) {
      for (bool b : v.toBoolList()) key.push_back(b);  // which results to make
    } else if (!(v.isNone() || v.isScalar() || v.isBool() || v.isIntList() ||
                 v.isDoubleList())) {
      keyable = false;
    } else if (v.isIntList()) {
      for (int64_t x : v.toIntList()) key.push_back(x);
    } else if (v.isBool()) {
      key.push_back(v.toBool());  // a flag may choose a path with checks of its own
    }
  }
  return keyable ? key : std::vector<int64_t>{};
}

// Ops that check the values of an index argument, which the caller should
// see raised by the call itself (a class index out of range is an IndexError
// there, as on the CPU). A call is launched only if the host can read those
// values without waiting for the stream (index_checks.h) and finds them in
// range; otherwise it waits, and the kernel raises at the call.
using Args = c10::ArrayRef<c10::IValue>;
struct IndexCheck {
  size_t indices;           // the argument checked
  int64_t (*bound)(Args);   // its values lie in [0, bound)
  size_t allowed;           // or equal this int argument (ignore_index, padding_idx)
};

int64_t classes(const c10::IValue& input) {  // nll_loss: an (N, C) or (C) input
  const at::Tensor& t = input.toTensor();
  return t.dim() == 1 ? t.size(0) : t.size(1);
}

const IndexCheck* index_check_of(const c10::FunctionSchema& schema) {
  static const auto* checks = new std::map<std::string, IndexCheck>{
      // (self, target, weight, reduction, ignore_index)
      {"aten::nll_loss_forward", {1, [](Args a) { return classes(a[0]); }, 4}},
      // (grad_output, self, target, weight, reduction, ignore_index, total_weight)
      {"aten::nll_loss_backward", {2, [](Args a) { return classes(a[1]); }, 5}},
      // (grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
      {"aten::embedding_dense_backward", {1, [](Args a) { return a[2].toInt(); }, 3}}};
  const auto found = checks->find(schema.name());
  return found == checks->end() ? nullptr : &found->second;
}

bool indices_known_in_range(const IndexCheck& check, Args args) {
  return copied_indices_in_range(args[check.indices].toTensor(), check.bound(args),
                                 args[check.allowed].toInt());
}

// The size a routed op's kernel is given its threads by (kernel_threads.h):
// its largest argument, known before its first call's body runs as well as
// after, so the first call and the later ones run on the same count.
int64_t largest_argument(Args args) {
  int64_t largest = 0;
  for (const c10::IValue& v : args) {
    if (v.isTensor() && v.toTensor().defined()) largest = std::max(largest, v.toTensor().numel());
    if (v.isTensorList())
      for (const at::Tensor& t : v.toTensorList()) largest = std::max(largest, t.numel());
  }
  return largest;
}

// The shapes whose first call has run (run_on_stream.h), with the layouts
// of the results it made (none for an in-place op).
PassedShapes& passed_shapes() {
  static auto* p = new PassedShapes;
  return *p;
}

// The same, on the stream's worker: the CPU kernel's arithmetic runs where
// every other acme kernel runs. Once the first call of an op's shapes has
// run waiting, and raised whatever the kernel raises for them, calls with
// those shapes are launched and the host goes on, as with CUDA's kernels:
// an in-place op needs nothing back, and an op with new results gets them
// allocated here, shaped as the first call's were, for the kernel to fill.
void on_stream_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t count = schema.arguments().size();
  const c10::ArrayRef<c10::IValue> arguments(&*(stack->end() - static_cast<std::ptrdiff_t>(count)),
                                             count);
  const std::vector<c10::IValue> originals(arguments.begin(), arguments.end());
  const c10::Device device = device_of_arguments(op, originals);
  const char* name = schema.name().c_str();
  const Results results = results_of(schema);
  std::vector<int64_t> key;
  // The fused optimizers return early, checking nothing, when found_inf is
  // set: a first call that passed may have validated nothing.
  const bool fused = schema.name().rfind("aten::_fused_", 0) == 0;
  if (results != Results::only_the_kernel_knows && !fused) key = shape_key(op, arguments);
  if (!key.empty()) {
    const auto shapes = passed_shapes().find(key);
    const IndexCheck* index_check = shapes ? index_check_of(schema) : nullptr;
    if (shapes && (!index_check || indices_known_in_range(*index_check, arguments))) {
      DeviceViews view(DeviceViews::kForLaunch);
      std::vector<c10::IValue> held;
      for (const c10::IValue& v : originals) held.push_back(viewed(view, v));
      std::vector<at::Tensor> made, written;  // new results, and their views
      for (const ResultLayout& r : *shapes) {
        made.push_back(allocate_result(r, device.index()));
        written.push_back(view(made.back()));
      }
      set_kernel_elements(largest_argument(originals));  // as the first call was
      launch_kernel(device.index(), name, [op, name, held = std::move(held),
                                           written = std::move(written)] {
        torch::jit::Stack kernel_stack(held);
        op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &kernel_stack);
        for (size_t r = 0; r < written.size(); ++r) {
          if (written[r].defined()) copy_result(name, written[r], kernel_stack[r].toTensor());
        }
      });
      stack->resize(stack->size() - count);
      if (results == Results::in_place) {
        // The results are the arguments they alias, as on_device_kernel returns them.
        for (size_t r = 0; r < schema.returns().size(); ++r)
          stack->push_back(aliased_argument(schema, r, originals));
      } else {
        for (at::Tensor& t : made) stack->push_back(std::move(t));
      }
      return;
    }
  }
  run_on_stream(device.index(), name, largest_argument(originals),
                [&] { on_device_kernel(op, stack, device); });
  if (!key.empty()) {
    std::vector<ResultLayout> shapes;
    if (results == Results::shaped_by_arguments) {
      std::set<c10::ScalarType> argument_dtypes;
      for (const c10::IValue& v : originals) {
        if (v.isTensor() && v.toTensor().defined()) argument_dtypes.insert(v.toTensor().scalar_type());
        if (v.isTensorList())
          for (const at::Tensor& t : v.toTensorList()) argument_dtypes.insert(t.scalar_type());
      }
      const size_t returned = schema.returns().size();
      for (auto v = stack->end() - static_cast<std::ptrdiff_t>(returned); v != stack->end(); ++v) {
        const at::Tensor& t = v->toTensor();
        if (!t.defined()) {
          shapes.emplace_back();
          continue;
        }
        // A floating dtype no argument has may be the default dtype (sqrt of
        // an integer tensor), which a launched kernel would read when it
        // runs, not when it was called: such calls keep waiting. An integer
        // or boolean one is the op's own (max_pool2d's indices).
        const c10::ScalarType dtype = t.scalar_type();
        if (!argument_dtypes.count(dtype) &&
            (at::isFloatingType(dtype) || at::isComplexType(dtype)))
          return;
        shapes.push_back(layout_of(t));
      }
    }
    passed_shapes().remember(std::move(key), std::move(shapes));
  }
}
//< ch23 on-device-kernel

}  // namespace
}  // namespace acme

//> ch23 register-training-kernels
// What the two models reached the fallback for, by where it came from.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  const auto kernel = [] {
    return torch::CppFunction::makeFromBoxedFunction<&acme::on_stream_kernel>();
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
