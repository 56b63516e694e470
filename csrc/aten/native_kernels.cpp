//@ ch10
// Native kernels: the hot ops computed where acme's data lives, without the
// CPU fallback's two host copies. Each kernel reads and writes device memory
// through the runtime's device-side view (acmeDeviceAccess); the arithmetic
// itself is borrowed from PyTorch's CPU kernels, which is the part a real
// vendor replaces with its own.
//> ch10 stub-abi
// DispatchStub's inline code must be compiled with the CPU kernel variants
// libtorch was built with, or it calls a DispatchStubImpl::get_call_ptr
// overload libtorch does not export: AVX2 and AVX-512 in the x86-64 wheels,
// SVE in the aarch64 ones.
#if defined(__x86_64__) && !defined(HAVE_AVX2_CPU_DEFINITION)
#define HAVE_AVX512_CPU_DEFINITION
#define HAVE_AVX2_CPU_DEFINITION
#elif defined(__aarch64__) && !defined(HAVE_SVE_CPU_DEFINITION)
#define HAVE_SVE_CPU_DEFINITION
#endif
//< ch10 stub-abi
#include <ATen/EmptyTensor.h>
#include <ATen/ExpandUtils.h>
#include <ATen/NumericUtils.h>
#include <ATen/TensorIterator.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/BinaryOps.h>
//> ch14 silu-backward-include
#include <ATen/native/Activation.h>
#include <ATen/ops/silu_backward_native.h>
//< ch14 silu-backward-include
#include <ATen/native/Fill.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_log_softmax.h>
#include <ATen/ops/_log_softmax_meta.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/_softmax_meta.h>
#include <ATen/ops/add_native.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/addmm_meta.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/amax_meta.h>
#include <ATen/ops/amin.h>
#include <ATen/ops/amin_meta.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/argmax_meta.h>
#include <ATen/ops/argmin.h>
#include <ATen/ops/argmin_meta.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/bmm_meta.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/div_native.h>
#include <ATen/ops/eq_native.h>
#include <ATen/ops/fill_native.h>
#include <ATen/ops/ge_native.h>
#include <ATen/ops/gt_native.h>
#include <ATen/ops/le_native.h>
#include <ATen/ops/lt_native.h>
#include <ATen/ops/max.h>
#include <ATen/ops/max_meta.h>
#include <ATen/ops/maximum_native.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/mean_meta.h>
#include <ATen/ops/min.h>
#include <ATen/ops/min_meta.h>
#include <ATen/ops/minimum_native.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mm_meta.h>
#include <ATen/ops/mul_native.h>
#include <ATen/ops/ne_native.h>
#include <ATen/ops/sub_native.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/sum_meta.h>
#include <ATen/ops/sum_native.h>
#include <ATen/ops/zero_native.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/SmallVector.h>
#include <c10/util/Type.h>
#include <torch/library.h>

#include <array>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
//> ch18 native-includes
#include <tuple>
#include <vector>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
//< ch18 native-includes

#include "aten/acme_check.h"
#include "aten/allocator.h"
#include "aten/device_views.h"
#include "aten/elementwise.h"
//> ch18 native-launch-include
#include "aten/launch.h"
//< ch18 native-launch-include
//> ch16 native-storage-include
#include "aten/storage.h"
//< ch16 native-storage-include

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;
const c10::DispatchKeySet kAcmeKeys{c10::DispatchKey::PrivateUse1};


//> ch10 outputs
// A new acme tensor on the device the options name (the device guard makes
// it current, so the allocator serves it).
at::Tensor allocate(at::IntArrayRef sizes, at::IntArrayRef strides,
                    const at::TensorOptions& options) {
  const c10::DeviceGuard guard(options.device());
  const auto dtype = options.dtype().toScalarType();
//> ch10 allocate-generic < ch16 allocate-acme
//   if (strides.empty()) {
//     return at::detail::empty_generic(sizes, device_allocator(), kAcmeKeys, dtype,
//                                      options.memory_format_opt());
//   }
//   return at::detail::empty_strided_generic(sizes, strides, device_allocator(), kAcmeKeys,
//                                            dtype);
//< ch10 allocate-generic
//> ch16 allocate-acme
  if (strides.empty()) return empty_acme(sizes, dtype, options.memory_format_opt());
  return empty_strided_acme(sizes, strides, dtype);
//< ch16 allocate-acme
}

// A structured op is ATen's `meta` (checks, broadcasting, type promotion,
// output shape and strides) plus an `impl` that computes. `meta` announces
// each output through set_output_*; these three wrappers answer it for the
// three forms of an op, as PyTorch's generated code does for CPU and CUDA.
template <class Op>
constexpr bool kIterates = std::is_base_of_v<at::TensorIteratorBase, Op>;

// torch.add(a, b): outputs are allocated on the device.
template <class Op, size_t N = 1>
struct Functional final : Op {
  void set_output_strided(int64_t i, at::IntArrayRef sizes, at::IntArrayRef strides,
                          at::TensorOptions options) override {
    set_output_raw_strided(i, sizes, strides, options);
  }
  void set_output_raw_strided(int64_t i, at::IntArrayRef sizes, at::IntArrayRef strides,
                              at::TensorOptions options) override {
    outputs[i] = allocate(sizes, strides, options);
    // A TensorIterator also records the output as its operand.
    if constexpr (kIterates<Op>) Op::set_output_raw_strided(i, sizes, strides, options);
  }
  const at::Tensor& maybe_get_output(int64_t i) override { return outputs[i]; }

  std::array<at::Tensor, N> outputs;
};

// a.add_(b): the output is `a`, which must already have the result's shape and
// dtype. A kernel that needs other strides gets a proxy, copied back after.
template <class Op>
struct Inplace final : Op {
  explicit Inplace(const at::Tensor& self) : self(self) {}
  void set_output_strided(int64_t i, at::IntArrayRef sizes, at::IntArrayRef strides,
                          at::TensorOptions options) override {
    check(sizes, options);
    if (self.strides() != strides) proxy = allocate(sizes, strides, options);
    if constexpr (kIterates<Op>) Op::set_output_raw_strided(i, sizes, strides, options);
  }
  void set_output_raw_strided(int64_t i, at::IntArrayRef sizes, at::IntArrayRef strides,
                              at::TensorOptions options) override {
    check(sizes, options);
    if constexpr (kIterates<Op>) Op::set_output_raw_strided(i, sizes, strides, options);
  }
  const at::Tensor& maybe_get_output(int64_t) override { return proxy ? *proxy : self; }
  void check(at::IntArrayRef sizes, const at::TensorOptions& options) const {
    TORCH_CHECK(options.dtype() == self.dtype(), "Bad in-place call: input tensor dtype ",
                self.dtype(), " and output tensor dtype ", options.dtype(), " should match");
    TORCH_CHECK(options.device() == self.device(), "Bad in-place call: input tensor device ",
                self.device(), " and output tensor device ", options.device(), " should match");
    TORCH_CHECK(sizes == self.sizes(), "Bad in-place call: input tensor size ", self.sizes(),
                " and output tensor size ", sizes, " should match");
  }
  void finish() {
    if (proxy) self.copy_(*proxy);
  }

  const at::Tensor& self;
  std::optional<at::Tensor> proxy;
};

// torch.add(a, b, out=o): `o` is resized to the result's shape (PyTorch's
// resize_output, with its warning for a non-empty `o`), its dtype checked.
template <class Op, size_t N = 1>
struct Out final : Op {
  template <class... T>
  explicit Out(const T&... outs) : outputs{std::cref(outs)...} {}
  void set_output_strided(int64_t i, at::IntArrayRef sizes, at::IntArrayRef strides,
                          at::TensorOptions options) override {
    prepare(i, sizes, strides, options);
    if (outputs[i].get().strides() != strides) proxies[i] = allocate(sizes, strides, options);
    if constexpr (kIterates<Op>) Op::set_output_raw_strided(i, sizes, strides, options);
  }
  void set_output_raw_strided(int64_t i, at::IntArrayRef sizes, at::IntArrayRef strides,
                              at::TensorOptions options) override {
    prepare(i, sizes, strides, options);
    if constexpr (kIterates<Op>) Op::set_output_raw_strided(i, sizes, strides, options);
  }
  const at::Tensor& maybe_get_output(int64_t i) override {
    return proxies[i] ? *proxies[i] : outputs[i].get();
  }
  void prepare(int64_t i, at::IntArrayRef sizes, at::IntArrayRef strides,
               const at::TensorOptions& options) {
    const at::Tensor& out = outputs[i];
    TORCH_CHECK(options.dtype() == out.dtype(), "Expected out tensor to have dtype ",
                options.dtype(), ", but got ", out.dtype(), " instead");
    TORCH_CHECK(options.device() == out.device(), "Expected out tensor to have device ",
                options.device(), ", but got ", out.device(), " instead");
    if (at::native::resize_output(out, sizes)) {
      if (!strides.empty()) {
        out.as_strided_(sizes, strides);
      } else if (options.memory_format_opt()) {
        out.unsafeGetTensorImpl()->empty_tensor_restride(*options.memory_format_opt());
      }
    }
  }
  void finish() {
    for (size_t i = 0; i < N; ++i)
      if (proxies[i]) outputs[i].get().copy_(*proxies[i]);
  }

  std::array<std::reference_wrapper<const at::Tensor>, N> outputs;
  std::array<std::optional<at::Tensor>, N> proxies;
};
//< ch10 outputs

//> ch10 same-device
// A TensorIterator refuses tensors of two devices by itself (CPU scalars
// allowed). The other kernels check here, as PyTorch's generated wrappers do.
struct SameDevice {
  const char* op;
  std::optional<c10::Device> first;
  void operator()(const at::Tensor& t) {
    if (!t.defined()) return;
    if (!first) first = t.device();
    check_device(op, *first, t);
  }
  template <class T>
  void operator()(const T&) {}
};

template <class Op, class... Args>
void check_devices(const Args&... args) {
  if constexpr (!kIterates<Op>) {
    SameDevice check{Op::name};
    (check(args), ...);
  }
}
//< ch10 same-device

//> ch10 run-impl < ch18 run-impl
// // The impl computes; here it runs at once (chapter 18 queues it on a stream).
// template <class Op, class... Args>
// void run_impl(Op& op, const Args&... args) {
//   op.impl(args...);
// }
//< ch10 run-impl
//> ch18 run-impl
// From this chapter on, an impl runs on a stream, after the op has returned
// and its arguments are gone: they travel by value. Tensors become device
// views (made now, touching no memory), dim lists vectors; the kernel gets
// them back as the types impl takes. An impl over a TensorIterator runs at
// once instead: its stub launches the kernel (launch, below).
at::Tensor hold(DeviceViews& view, const at::Tensor& t) { return view(t); }
std::vector<int64_t> hold(DeviceViews&, at::IntArrayRef v) { return v.vec(); }
std::optional<std::vector<int64_t>> hold(DeviceViews&, at::OptionalIntArrayRef v) {
  return v ? std::optional(v->vec()) : std::nullopt;
}
template <class T>
T hold(DeviceViews&, const T& v) {
  return v;
}

at::IntArrayRef pass(const std::vector<int64_t>& v) { return v; }
at::OptionalIntArrayRef pass(const std::optional<std::vector<int64_t>>& v) {
  return v ? at::OptionalIntArrayRef(*v) : std::nullopt;
}
template <class T>
const T& pass(const T& v) {
  return v;
}

// Calls f on each tensor among an impl's arguments, in order.
template <class F, class... Args>
void for_each_tensor(F&& f, const Args&... args) {
  auto one = [&](const auto& a) {
    if constexpr (std::is_same_v<std::decay_t<decltype(a)>, at::Tensor>) f(a);
  };
  (one(args), ...);
}

// The device of the first acme tensor among the arguments (they share one).
template <class... Args>
c10::DeviceIndex device_of(const Args&... args) {
  c10::DeviceIndex device = -1;
  for_each_tensor([&](const at::Tensor& t) {
    if (device < 0 && t.defined() && t.device().type() == kAcme) device = t.device().index();
  }, args...);
  return device;
}

// What a probe is keyed on: each tensor's dtype and rank.
template <class... Args>
c10::SmallVector<int64_t, 12> dtypes_and_ranks(const Args&... args) {
  c10::SmallVector<int64_t, 12> key;
  for_each_tensor([&](const at::Tensor& t) {
    key.append({t.defined() ? static_cast<int64_t>(t.scalar_type()) : -1,
                t.defined() ? t.dim() : -1});
  }, args...);
  return key;
}

// An empty result (the last tensor argument): nothing for a kernel to do.
template <class... Args>
bool writes_nothing(const Args&... args) {
  int64_t last = -1;
  for_each_tensor([&](const at::Tensor& t) {
    if (t.defined()) last = t.numel();
  }, args...);
  return last == 0;
}

// The probe's arguments: each tensor a zero-filled CPU tensor of its dtype and
// rank with every size 1, the rest as the kernel gets them.
at::Tensor stand_in(DeviceViews&, const at::Tensor& t) {
  if (!t.defined()) return t;
  return at::zeros(std::vector<int64_t>(t.dim(), 1), t.options().device(at::kCPU));
}
template <class T>
auto stand_in(DeviceViews& view, const T& v) {
  return hold(view, v);
}

// The op inside one of the three forms.
template <class Form>
struct OpOf;
template <class Op, size_t N>
struct OpOf<Functional<Op, N>> { using type = Op; };
template <class Op>
struct OpOf<Inplace<Op>> { using type = Op; };
template <class Op, size_t N>
struct OpOf<Out<Op, N>> { using type = Op; };

template <class Form, class... Args>
void run_impl(Form& form, const Args&... args) {
  using Op = typename OpOf<Form>::type;
  // Checks the borrowed CPU impl makes beyond ATen's meta belong to the call:
  // an op that has them runs them here, on the host, before the launch.
  if constexpr (requires { Op::check(args...); }) Op::check(args...);
  if constexpr (kIterates<Op>) {
    form.impl(args...);
  } else {
    DeviceViews view(DeviceViews::kForLaunch);
    auto impl = [](const auto&... a) { Functional<Op>().impl(pass(a)...); };
    if (writes_nothing(args...)) {  // the CPU impl decides, on the host, what to refuse
      std::apply(impl, std::make_tuple(hold(view, args)...));
      return;
    }
    check_once(Op::name, dtypes_and_ranks(args...),
               [&] { std::apply(impl, std::make_tuple(stand_in(view, args)...)); });
    launch_kernel(device_of(args...), Op::name,
                  [impl, held = std::make_tuple(hold(view, args)...)] { std::apply(impl, held); });
  }
}
//< ch18 run-impl

//> ch10 forms
// The three forms of a single-output structured op: meta, then impl. Rest is
// the schema's arguments after `self`.
template <class Op, class... Rest>
struct Structured {
  static at::Tensor functional(const at::Tensor& self, Rest... rest) {
    check_devices<Op>(self, rest...);
    Functional<Op> op;
    op.meta(self, rest...);
    run_impl(op, self, rest..., op.outputs[0]);
    return std::move(op.outputs[0]);
  }

  static at::Tensor& inplace(at::Tensor& self, Rest... rest) {
    check_devices<Op>(self, rest...);
    Inplace<Op> op(self);
    op.meta(self, rest...);
    run_impl(op, self, rest..., op.maybe_get_output(0));
    op.finish();
    return self;
  }

  static at::Tensor& out(const at::Tensor& self, Rest... rest, at::Tensor& out) {
    check_devices<Op>(self, rest..., out);
    Out<Op> op(out);
    op.meta(self, rest...);
    run_impl(op, self, rest..., op.maybe_get_output(0));
    op.finish();
    return out;
  }
};
//< ch10 forms

//> ch10 launch
// A TensorIterator builder: how an op's meta made its iterator.
using Builder = at::TensorIterator (*)(at::TensorBase&, const at::TensorBase&,
                                       const at::TensorBase&);

//> ch10 launch-run < ch18 launch-run
// // How acme runs a CPU kernel that a DispatchStub hands a TensorIterator over
// // device tensors. ATen's meta has already broadcast, promoted and allocated;
// // what is left is memory. The common case: every operand already has the
// // computation dtype, so the kernel runs on this very iterator, each device
// // operand's pointer swapped for its device-side view.
// bool runs_as_is(const at::TensorIteratorBase& iter) {
//   const auto common = iter.maybe_common_dtype();
//   if (!common) return true;
//   for (int i = 0; i < iter.ntensors(); ++i) {
//     const bool bool_result = i < iter.noutputs() && iter.dtype(i) == at::kBool;
//     if (iter.dtype(i) != *common && !bool_result) return false;
//   }
//   return true;
// }
//
// // Otherwise a device kernel would convert while it loads (CUDA's do); the CPU
// // kernels cannot, since off the CPU a TensorIterator leaves casting to the
// // kernel. So acme rebuilds the iterator on the CPU over device views, with
// // the same builder the op's meta used, and the CPU iterator converts.
//
// template <class Kernel>
// void launch(const char* name, at::TensorIteratorBase& iter, Builder rebuild,
//             const Kernel& cpu_kernel) {
//   if (iter.numel() == 0) return;
//   if (runs_as_is(iter)) {
//     for (int i = 0; i < iter.ntensors(); ++i) {
//       if (iter.device_type(i) == kAcme)
//         iter.unsafe_replace_operand(i, device_address(iter.data_ptr(i)));
//     }
//     cpu_kernel(iter);
//     return;
//   }
//   TORCH_INTERNAL_ASSERT(rebuild && iter.ntensors() == 3, kAcme, ": no rebuild for ", name);
//   DeviceViews view;
//   at::TensorBase out = view(iter.tensor_base(0));
//   const at::TensorBase a = view(iter.tensor_base(1));
//   const at::TensorBase b = view(iter.tensor_base(2));
//   at::TensorIterator on_cpu = rebuild(out, a, b);
//   cpu_kernel(on_cpu);
// }
//< ch10 launch-run
//> ch18 launch-run
// On a stream, the kernel runs after launch() returned, when the iterator and
// the tensors it borrows are gone. So the launch takes what the kernel needs
// by value: a device view of each device operand (made now, touching no
// memory) and the value of each CPU scalar as it is now. On the worker, the
// kernel rebuilds the iterator on the CPU over them, with the builder the
// op's meta used, and runs the CPU kernel there (a nullary fill needs none).
// A CPU scalar operand, made again from its value (a wrapped number promotes
// as a Python number does, so the flag travels too).
at::Tensor cpu_scalar(const c10::Scalar& value, at::ScalarType dtype, bool wrapped) {
  at::Tensor t = at::scalar_tensor(value, at::TensorOptions().dtype(dtype));
  if (wrapped) t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

at::TensorIterator on_cpu(Builder rebuild, std::array<at::Tensor, 3>& operands) {
  at::TensorBase out = operands[0];
  if (rebuild) return rebuild(out, operands[1], operands[2]);
  return at::TensorIteratorConfig()
      .set_check_mem_overlap(false)
      .check_all_same_dtype(false)
      .add_output(out)
      .resize_outputs(false)
      .build();
}

// The computation dtype is the launch's, decided by the op's meta on the
// host. Where inputs are integers it can come from the default dtype
// (int / int, int * 0.1), a global the host may have changed by the time the
// worker rebuilds the iterator. Then the integer inputs go in as the launch's
// dtype already, and the iterator has nothing left to read from the default.
at::TensorIterator on_cpu_as_launched(Builder rebuild, std::array<at::Tensor, 3>& operands,
                                      std::optional<at::ScalarType> launched) {
  at::TensorIterator it = on_cpu(rebuild, operands);
  if (!rebuild || !launched || it.maybe_common_dtype() == launched) return it;
  for (size_t i = 1; i < operands.size(); ++i) {
    if (operands[i].defined() && at::isIntegralType(operands[i].scalar_type(), true))
      operands[i] = operands[i].to(*launched);
  }
  it = on_cpu(rebuild, operands);
  TORCH_INTERNAL_ASSERT(it.maybe_common_dtype() == launched, kAcme, ": a kernel computed in ",
                        it.maybe_common_dtype().value_or(at::ScalarType::Undefined), ", launched in ",
                        *launched);
  return it;
}

template <class Kernel>
void launch(const char* name, at::TensorIteratorBase& iter, Builder rebuild,
            const Kernel& cpu_kernel) {
  const int n = iter.ntensors();
  TORCH_INTERNAL_ASSERT(n == 1 || (rebuild && n == 3), kAcme, ": no rebuild for ", name);
  DeviceViews view(DeviceViews::kForLaunch);
  std::array<at::Tensor, 3> views;
  std::array<std::optional<c10::Scalar>, 3> scalars;  // CPU scalars' values
  std::array<at::ScalarType, 3> dtypes{};
  std::array<bool, 3> wrapped{};
  const std::optional<at::ScalarType> launched = iter.maybe_common_dtype();
  c10::SmallVector<int64_t, 6> key;
  for (int i = 0; i < n; ++i) {
    const at::TensorBase& t = iter.tensor_base(i);
    const bool on_device = t.device().type() == kAcme;
    dtypes[i] = t.scalar_type();
    if (on_device) {
      views[i] = view(t);
    } else {
      scalars[i] = at::Tensor(t).item();
      wrapped[i] = t.unsafeGetTensorImpl()->is_wrapped_number();
    }
    key.append({static_cast<int64_t>(t.scalar_type()), wrapped[i], on_device});
  }
  check_once(name, key, [&] {
    std::array<at::Tensor, 3> stand_ins;
    for (int i = 0; i < n; ++i) {
      stand_ins[i] = scalars[i] ? cpu_scalar(1, dtypes[i], wrapped[i])
                                : at::ones({1}, at::TensorOptions().dtype(dtypes[i]));
    }
    at::TensorIterator it = on_cpu(rebuild, stand_ins);
    cpu_kernel(it);
  });
  // Probed even when empty, so an empty tensor of a dtype the kernel does not
  // support is refused as the CPU refuses it; then there is nothing to run.
  if (iter.numel() == 0) return;
  launch_kernel(iter.device(0).index(), name,
                [views, scalars, dtypes, wrapped, n, rebuild, launched, cpu_kernel]() mutable {
    for (int i = 0; i < n; ++i) {
      if (scalars[i]) views[i] = cpu_scalar(*scalars[i], dtypes[i], wrapped[i]);
    }
    at::TensorIterator it = on_cpu_as_launched(rebuild, views, launched);
    cpu_kernel(it);
  });
}
//< ch18 launch-run

at::TensorIterator binary(at::TensorBase& out, const at::TensorBase& a, const at::TensorBase& b) {
  return at::TensorIterator::borrowing_binary_op(out, a, b);
}
at::TensorIterator binary_float(at::TensorBase& out, const at::TensorBase& a,
                                const at::TensorBase& b) {
  return at::TensorIterator::binary_float_op(out, a, b);
}
at::TensorIterator comparison(at::TensorBase& out, const at::TensorBase& a,
                              const at::TensorBase& b) {
  return at::TensorIterator::comparison_op(out, a, b);
}
//< ch10 launch

//> ch10 stub-kernels
// The acme kernels behind ATen's stubs. Each one "launches" on the device;
// here the launch runs the CPU implementation of the same stub.
void add_kernel(at::TensorIteratorBase& iter, const c10::Scalar& alpha) {
  launch("add_stub", iter, binary, [alpha](at::TensorIteratorBase& it) {
    at::native::add_stub(c10::kCPU, it, alpha);
  });
}
//< ch10 stub-kernels

//> ch10 own-kernel
// maximum and minimum run acme's own device code (elementwise.h), not
// PyTorch's CPU kernel. A NaN operand gives NaN, as on the CPU and CUDA.
template <bool kMax>
struct Extremum {
  static constexpr const char* name = kMax ? "maximum" : "minimum";
  template <typename T>
  T operator()(T a, T b) const {
    if constexpr (std::is_same_v<T, bool>) {
      return kMax ? (a || b) : (a && b);
    } else {
      if constexpr (!std::is_integral_v<T>) {
        if (at::_isnan(a) || at::_isnan(b)) return std::numeric_limits<T>::quiet_NaN();
      }
      return (kMax ? a < b : b < a) ? b : a;
    }
  }
};

void maximum_kernel(at::TensorIteratorBase& iter) { binary_kernel(iter, Extremum<true>{}); }
void minimum_kernel(at::TensorIteratorBase& iter) { binary_kernel(iter, Extremum<false>{}); }
//< ch10 own-kernel

// "mul_stub": DECLARE_DISPATCH names a stub's type after the stub.
template <auto& stub>
const char* stub_name() {
  static const std::string name = [] {
    std::string type = c10::demangle_type<std::remove_reference_t<decltype(stub)>>();
    type = type.substr(type.rfind(':') + 1);
    return type.substr(0, type.find("_DECLARE_DISPATCH_type"));
  }();
  return name.c_str();
}

// The stubs of one signature, `void(TensorIteratorBase&)`, share a template.
template <auto& stub, Builder rebuild>
void iterator_kernel(at::TensorIteratorBase& iter) {
  launch(stub_name<stub>(), iter, rebuild, [](at::TensorIteratorBase& it) { stub(c10::kCPU, it); });
}

//> ch10 fill-kernel
void fill_kernel(at::TensorIterator& iter, const c10::Scalar& value) {
  launch("fill_stub", iter, nullptr, [value](at::TensorIteratorBase& it) {
    at::native::fill_stub(c10::kCPU, static_cast<at::TensorIterator&>(it), value);
  });
}
//< ch10 fill-kernel

//> ch10 matmul
// Structured kernels of acme's own: ATen's meta computes the output, acme's
// impl computes the values. The impl runs PyTorch's CPU kernel on views of
// the device memory, writing straight into the device output.
struct Mm : at::meta::structured_mm {
  static constexpr const char* name = "aten::mm";
  void impl(const at::Tensor& self, const at::Tensor& mat2, const at::Tensor& out) {
    DeviceViews view;
    at::Tensor result = view(out);
    at::mm_out(result, view(self), view(mat2));
  }
};
//< ch10 matmul

struct Bmm : at::meta::structured_bmm {
  static constexpr const char* name = "aten::bmm";
  void impl(const at::Tensor& self, const at::Tensor& mat2, const at::Tensor& out) {
    DeviceViews view;
    at::Tensor result = view(out);
    at::bmm_out(result, view(self), view(mat2));
  }
};

struct Addmm : at::meta::structured_addmm {
  static constexpr const char* name = "aten::addmm";
//> ch18 addmm-check
  // The CPU impl broadcasts `self` to the result (meta does not check it).
  static void check(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                    const c10::Scalar&, const c10::Scalar&, const at::Tensor&) {
    (void)self.expand({mat1.size(0), mat2.size(1)});
  }
//< ch18 addmm-check
  void impl(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
            const c10::Scalar& beta, const c10::Scalar& alpha, const at::Tensor& out) {
    DeviceViews view;  // for addmm_, `out` is `self`: one view serves both
    at::Tensor result = view(out);
    at::addmm_out(result, view(self), view(mat1), view(mat2), beta, alpha);
  }
};

struct Softmax : at::meta::structured__softmax {
  static constexpr const char* name = "aten::_softmax";
  void impl(const at::Tensor& self, int64_t dim, bool half_to_float, const at::Tensor& out) {
    DeviceViews view;
    at::Tensor result = view(out);
    at::_softmax_out(result, view(self), dim, half_to_float);
  }
};

struct LogSoftmax : at::meta::structured__log_softmax {
  static constexpr const char* name = "aten::_log_softmax";
  void impl(const at::Tensor& self, int64_t dim, bool half_to_float, const at::Tensor& out) {
    DeviceViews view;
    at::Tensor result = view(out);
    at::_log_softmax_out(result, view(self), dim, half_to_float);
  }
};

//> ch10 reductions
// Reductions too. (sum_stub cannot be borrowed: the CPU's parallel reduction
// allocates its per-thread partials like its output, on acme, and writes them
// through raw pointers.) On views, those partials are host scratch memory.
struct Sum : at::native::structured_sum_out {
  static constexpr const char* name = "aten::sum";
  void impl(const at::Tensor& self, at::OptionalIntArrayRef dim, bool keepdim,
            std::optional<at::ScalarType> dtype, const at::Tensor& out) {
    DeviceViews view;
    // The CPU's own impl, without at::sum_out's dispatch and second meta:
    // acme's meta has already checked the arguments and sized `out`.
    at::native::structured_sum_out::impl(view(self), dim, keepdim, dtype, view(out));
  }
};
//< ch10 reductions

struct Mean : at::meta::structured_mean_dim {
  static constexpr const char* name = "aten::mean";
  void impl(const at::Tensor& self, at::OptionalIntArrayRef dim, bool keepdim,
            std::optional<at::ScalarType> dtype, const at::Tensor& out) {
    DeviceViews view;
    at::Tensor result = view(out);
    at::mean_out(result, view(self), dim, keepdim, dtype);
  }
};

struct Amax : at::meta::structured_amax {
  static constexpr const char* name = "aten::amax";
  void impl(const at::Tensor& self, at::IntArrayRef dim, bool keepdim, const at::Tensor& out) {
    DeviceViews view;
    at::Tensor result = view(out);
    at::amax_out(result, view(self), dim, keepdim);
  }
};

struct Amin : at::meta::structured_amin {
  static constexpr const char* name = "aten::amin";
  void impl(const at::Tensor& self, at::IntArrayRef dim, bool keepdim, const at::Tensor& out) {
    DeviceViews view;
    at::Tensor result = view(out);
    at::amin_out(result, view(self), dim, keepdim);
  }
};

struct Argmax : at::meta::structured_argmax {
  static constexpr const char* name = "aten::argmax";
  void impl(const at::Tensor& self, std::optional<int64_t> dim, bool keepdim,
            const at::Tensor& out) {
    DeviceViews view;
    at::Tensor result = view(out);
    at::argmax_out(result, view(self), dim, keepdim);
  }
};

struct Argmin : at::meta::structured_argmin {
  static constexpr const char* name = "aten::argmin";
  void impl(const at::Tensor& self, std::optional<int64_t> dim, bool keepdim,
            const at::Tensor& out) {
    DeviceViews view;
    at::Tensor result = view(out);
    at::argmin_out(result, view(self), dim, keepdim);
  }
};

// max(dim) and min(dim): two outputs, and a meta that returns the wrapped dim.
template <class Meta, bool is_max>
struct ValuesIndices : Meta {
  static constexpr const char* name = is_max ? "aten::max.dim" : "aten::min.dim";
  void impl(const at::Tensor& self, int64_t dim, bool keepdim, const at::Tensor& values,
            const at::Tensor& indices) {
    DeviceViews view;
    at::Tensor v = view(values);
    at::Tensor i = view(indices);
    if constexpr (is_max) {
      at::max_out(v, i, view(self), dim, keepdim);
    } else {
      at::min_out(v, i, view(self), dim, keepdim);
    }
  }

  static std::tuple<at::Tensor, at::Tensor> functional(const at::Tensor& self, int64_t dim,
                                                       bool keepdim) {
    Functional<ValuesIndices, 2> op;
    const auto pre = op.meta(self, dim, keepdim);
    run_impl(op, self, pre.dim, keepdim, op.outputs[0], op.outputs[1]);
    return {std::move(op.outputs[0]), std::move(op.outputs[1])};
  }

  static std::tuple<at::Tensor&, at::Tensor&> out(const at::Tensor& self, int64_t dim,
                                                  bool keepdim, at::Tensor& values,
                                                  at::Tensor& indices) {
    check_devices<ValuesIndices>(self, values, indices);
    Out<ValuesIndices, 2> op(values, indices);
    const auto pre = op.meta(self, dim, keepdim);
    run_impl(op, self, pre.dim, keepdim, op.maybe_get_output(0), op.maybe_get_output(1));
    op.finish();
    return {values, indices};
  }
};
using MaxDim = ValuesIndices<at::meta::structured_max_dim, true>;
using MinDim = ValuesIndices<at::meta::structured_min_dim, false>;

// max() and min() of a whole tensor are not structured: a plain kernel.
template <bool is_max>
at::Tensor& extremum_out(const at::Tensor& self, at::Tensor& out) {
  SameDevice check{is_max ? "aten::max" : "aten::min"};
  check(self);
  check(out);
  at::native::resize_output(out, {});
  TORCH_CHECK(out.dtype() == self.dtype(), "Expected out tensor to have dtype ", self.dtype(),
              ", but got ", out.dtype(), " instead");
  DeviceViews view;
  at::Tensor result = view(out);
  if constexpr (is_max) {
    at::max_out(result, view(self));
  } else {
    at::min_out(result, view(self));
  }
  return out;
}

template <bool is_max>
at::Tensor extremum(const at::Tensor& self) {
  // As on the CPU: only the functional form refuses an empty tensor.
  TORCH_CHECK(self.numel() > 0, is_max ? "max" : "min",
              "(): Expected reduction dim to be specified for input.numel() == 0. Specify "
              "the reduction dim with the 'dim' argument.");
  at::Tensor out = allocate({}, {}, self.options());
  return extremum_out<is_max>(self, out);
}

//> ch10 copy
// Between two acme tensors, copy_ converts dtype and layout on the device:
// the CPU's copy kernel over both views (a lazily conjugated source is
// conjugated on the way). Any pair with a CPU side takes ATen's copy_, which
// reaches acme's _copy_from (chapter 1).
at::Tensor& copy_(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  const bool on_acme = self.device().type() == kAcme && src.device().type() == kAcme;
  if (!on_acme || self._is_zerotensor() || src._is_zerotensor())
    return at::native::copy_(self, src, non_blocking);
  // The same refusal, in the same words, as chapter 1's copies.
  TORCH_CHECK(at::is_expandable_to(src.sizes(), self.sizes()), kAcme, " copy: source of shape ",
              src.sizes(), " cannot be copied into a destination of shape ", self.sizes());
  if (self.is_same(src) || self.numel() == 0) return self;
//> ch10 copy-run < ch18 copy-run
//   DeviceViews view;
//   at::Tensor destination = view(self);
//   destination.copy_(view(src));
//< ch10 copy-run
//> ch18 copy-run
  // The CPU's copy_ refuses overlapping memory before it copies; the launch
  // checks the same here, since those errors belong to the call, not the data.
  at::assert_no_internal_overlap(self);
  at::assert_no_partial_overlap(self, src);
  // On the destination's stream. A source on another device is read once
  // that device's stream got there, and is not reused before the copy ran.
  DeviceViews view(DeviceViews::kForLaunch);
  const c10::DeviceIndex to = self.device().index(), from = src.device().index();
  stream_wait(to, from);
  launch_kernel(to, "aten::copy_", [destination = view(self), source = view(src)] {
    destination.copy_(source);
  });
  stream_wait(from, to);
//< ch18 copy-run
  return self;
}
//< ch10 copy

}  // namespace
}  // namespace acme

//> ch10 register-stubs
// Scenario two of PyTorch's PrivateUse1 guide: acme implementations of ATen's
// own stubs. A stub is reached only through an ATen function that calls it
// with the tensors' device type: the registrations further down provide them.
namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(add_stub, &acme::add_kernel)
REGISTER_PRIVATEUSE1_DISPATCH(fill_stub, &acme::fill_kernel)
}  // namespace at::native
//< ch10 register-stubs

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(mul_stub, (&acme::iterator_kernel<mul_stub, acme::binary>))
REGISTER_PRIVATEUSE1_DISPATCH(div_true_stub,
                              (&acme::iterator_kernel<div_true_stub, acme::binary_float>))
REGISTER_PRIVATEUSE1_DISPATCH(div_floor_stub,
                              (&acme::iterator_kernel<div_floor_stub, acme::binary>))
REGISTER_PRIVATEUSE1_DISPATCH(div_trunc_stub,
                              (&acme::iterator_kernel<div_trunc_stub, acme::binary>))
REGISTER_PRIVATEUSE1_DISPATCH(eq_stub, (&acme::iterator_kernel<eq_stub, acme::comparison>))
REGISTER_PRIVATEUSE1_DISPATCH(ne_stub, (&acme::iterator_kernel<ne_stub, acme::comparison>))
REGISTER_PRIVATEUSE1_DISPATCH(lt_stub, (&acme::iterator_kernel<lt_stub, acme::comparison>))
REGISTER_PRIVATEUSE1_DISPATCH(le_stub, (&acme::iterator_kernel<le_stub, acme::comparison>))
REGISTER_PRIVATEUSE1_DISPATCH(gt_stub, (&acme::iterator_kernel<gt_stub, acme::comparison>))
REGISTER_PRIVATEUSE1_DISPATCH(ge_stub, (&acme::iterator_kernel<ge_stub, acme::comparison>))
//> ch10 register-own
REGISTER_PRIVATEUSE1_DISPATCH(maximum_stub, &acme::maximum_kernel)
REGISTER_PRIVATEUSE1_DISPATCH(minimum_stub, &acme::minimum_kernel)
//< ch10 register-own
}  // namespace at::native

namespace acme {
namespace {
//> ch10 structured-add
// ATen's structured add: its meta, and an impl that only calls
// add_stub(device_type(), ...). PyTorch generates it for the CPU, hence the
// name; nothing in it is CPU-specific.
using Add = Structured<at::native::structured_ufunc_add_CPU, const at::Tensor&,
                       const c10::Scalar&>;
//< ch10 structured-add
using Sub = Structured<at::native::structured_sub_out, const at::Tensor&, const c10::Scalar&>;
using Mul = Structured<at::native::structured_mul_out, const at::Tensor&>;
using Div = Structured<at::native::structured_div_out, const at::Tensor&>;
using DivMode = Structured<at::native::structured_div_out_mode, const at::Tensor&,
                           std::optional<c10::string_view>>;
using Maximum = Structured<at::native::structured_maximum_out, const at::Tensor&>;
using Minimum = Structured<at::native::structured_minimum_out, const at::Tensor&>;
using AddmmForms = Structured<Addmm, const at::Tensor&, const at::Tensor&, const c10::Scalar&,
                              const c10::Scalar&>;
using SumForms = Structured<Sum, at::OptionalIntArrayRef, bool, std::optional<at::ScalarType>>;
using MeanForms = Structured<Mean, at::OptionalIntArrayRef, bool, std::optional<at::ScalarType>>;
}  // namespace
}  // namespace acme

//> ch10 register
// Through ATen's structured classes, to acme's stubs.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace acme;
  m.impl("add.Tensor", TORCH_FN(Add::functional));
  m.impl("add_.Tensor", TORCH_FN(Add::inplace));
  m.impl("add.out", TORCH_FN(Add::out));
}
//< ch10 register

// The same for the rest of the arithmetic and the comparisons.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace acme;
  m.impl("sub.Tensor", TORCH_FN(Sub::functional));
  m.impl("sub_.Tensor", TORCH_FN(Sub::inplace));
  m.impl("sub.out", TORCH_FN(Sub::out));
  m.impl("mul.Tensor", TORCH_FN(Mul::functional));
  m.impl("mul_.Tensor", TORCH_FN(Mul::inplace));
  m.impl("mul.out", TORCH_FN(Mul::out));
  m.impl("div.Tensor", TORCH_FN(Div::functional));
  m.impl("div_.Tensor", TORCH_FN(Div::inplace));
  m.impl("div.out", TORCH_FN(Div::out));
  m.impl("div.Tensor_mode", TORCH_FN(DivMode::functional));
  m.impl("div_.Tensor_mode", TORCH_FN(DivMode::inplace));
  m.impl("div.out_mode", TORCH_FN(DivMode::out));
  m.impl("maximum", TORCH_FN(Maximum::functional));
  m.impl("maximum.out", TORCH_FN(Maximum::out));
  m.impl("minimum", TORCH_FN(Minimum::functional));
  m.impl("minimum.out", TORCH_FN(Minimum::out));
//> ch10 register-comparisons
  // Six comparisons, each against a tensor or a scalar, in three forms.
#define ACME_COMPARISON(op)                                                              \
  {                                                                                      \
    using T = Structured<at::native::structured_##op##_Tensor_out, const at::Tensor&>;   \
    using S = Structured<at::native::structured_##op##_Scalar_out, const c10::Scalar&>;  \
    m.impl(#op ".Tensor", TORCH_FN(T::functional));                                      \
    m.impl(#op "_.Tensor", TORCH_FN(T::inplace));                                        \
    m.impl(#op ".Tensor_out", TORCH_FN(T::out));                                         \
    m.impl(#op ".Scalar", TORCH_FN(S::functional));                                      \
    m.impl(#op "_.Scalar", TORCH_FN(S::inplace));                                        \
    m.impl(#op ".Scalar_out", TORCH_FN(S::out));                                         \
  }
  ACME_COMPARISON(eq)
  ACME_COMPARISON(ne)
  ACME_COMPARISON(lt)
  ACME_COMPARISON(le)
  ACME_COMPARISON(gt)
  ACME_COMPARISON(ge)
#undef ACME_COMPARISON
//< ch10 register-comparisons
}

//> ch14 silu-backward
// silu's backward runs on every step of a SiLU or SwiGLU network. It has a
// CPU kernel and a composite; with no acme kernel, the autograd key ran the
// composite on acme, rounding differently from the CPU in half precision.
// The chapter-10 route: ATen's structured class (its meta, and an impl that
// calls silu_backward_stub), with acme's kernel at the stub.
namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(silu_backward_stub,
                              (&acme::iterator_kernel<silu_backward_stub, acme::binary>))
}  // namespace at::native

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using SiluBackward = acme::Structured<at::native::structured_silu_backward_out, const at::Tensor&>;
  m.impl("silu_backward", TORCH_FN(SiluBackward::functional));
  m.impl("silu_backward.grad_input", TORCH_FN(SiluBackward::out));
}
//< ch14 silu-backward

//> ch10 register-fill
// ATen's own device-generic functions, which reach acme's fill_stub; and
// acme's copy_.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using FillScalar = at::Tensor& (*)(at::Tensor&, const c10::Scalar&);
  using FillTensor = at::Tensor& (*)(at::Tensor&, const at::Tensor&);
  m.impl("fill_.Scalar", TORCH_FN(static_cast<FillScalar>(at::native::fill_)));
  m.impl("fill_.Tensor", TORCH_FN(static_cast<FillTensor>(at::native::fill_)));
  m.impl("zero_", TORCH_FN(at::native::zero_));
  m.impl("copy_", TORCH_FN(acme::copy_));
}
//< ch10 register-fill

//> ch10 register-direct
// Structured kernels with acme's own impl.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace acme;
  m.impl("mm", TORCH_FN((Structured<Mm, const at::Tensor&>::functional)));
  m.impl("mm.out", TORCH_FN((Structured<Mm, const at::Tensor&>::out)));
}
//< ch10 register-direct

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace acme;
  m.impl("bmm", TORCH_FN((Structured<Bmm, const at::Tensor&>::functional)));
  m.impl("bmm.out", TORCH_FN((Structured<Bmm, const at::Tensor&>::out)));
  m.impl("addmm", TORCH_FN(AddmmForms::functional));
  m.impl("addmm_", TORCH_FN(AddmmForms::inplace));
  m.impl("addmm.out", TORCH_FN(AddmmForms::out));
  m.impl("_softmax", TORCH_FN((Structured<Softmax, int64_t, bool>::functional)));
  m.impl("_softmax.out", TORCH_FN((Structured<Softmax, int64_t, bool>::out)));
  m.impl("_log_softmax", TORCH_FN((Structured<LogSoftmax, int64_t, bool>::functional)));
  m.impl("_log_softmax.out", TORCH_FN((Structured<LogSoftmax, int64_t, bool>::out)));
  m.impl("sum.dim_IntList", TORCH_FN(SumForms::functional));
  m.impl("sum.IntList_out", TORCH_FN(SumForms::out));
  m.impl("mean.dim", TORCH_FN(MeanForms::functional));
  m.impl("mean.out", TORCH_FN(MeanForms::out));
  m.impl("amax", TORCH_FN((Structured<Amax, at::IntArrayRef, bool>::functional)));
  m.impl("amax.out", TORCH_FN((Structured<Amax, at::IntArrayRef, bool>::out)));
  m.impl("amin", TORCH_FN((Structured<Amin, at::IntArrayRef, bool>::functional)));
  m.impl("amin.out", TORCH_FN((Structured<Amin, at::IntArrayRef, bool>::out)));
  m.impl("argmax", TORCH_FN((Structured<Argmax, std::optional<int64_t>, bool>::functional)));
  m.impl("argmax.out", TORCH_FN((Structured<Argmax, std::optional<int64_t>, bool>::out)));
  m.impl("argmin", TORCH_FN((Structured<Argmin, std::optional<int64_t>, bool>::functional)));
  m.impl("argmin.out", TORCH_FN((Structured<Argmin, std::optional<int64_t>, bool>::out)));
  m.impl("max.dim", TORCH_FN(MaxDim::functional));
  m.impl("max.dim_max", TORCH_FN(MaxDim::out));
  m.impl("min.dim", TORCH_FN(MinDim::functional));
  m.impl("min.dim_min", TORCH_FN(MinDim::out));
  m.impl("max", TORCH_FN(extremum<true>));
  m.impl("max.unary_out", TORCH_FN(extremum_out<true>));
  m.impl("min", TORCH_FN(extremum<false>));
  m.impl("min.unary_out", TORCH_FN(extremum_out<false>));
}
