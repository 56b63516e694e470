//@ ch10
// An elementwise kernel written as device code is, where the other native
// kernels borrow PyTorch's CPU arithmetic (maximum and minimum use it, in
// native_kernels.cpp). ATen's meta hands a stub a TensorIterator that has
// broadcast the shapes, promoted the dtypes and allocated the output. Off the
// CPU it leaves three things to the kernel, which CUDA's Loops.cuh does for
// every CUDA elementwise op:
//   - a 0-dim CPU tensor operand (`x + torch.tensor(2.0)`) is host memory the
//     device cannot read: its value travels as a kernel argument;
//   - an operand whose dtype is not the computation's (`float + int`) is
//     converted as it is loaded, an output as it is stored;
//   - device code indexes in 32 bits, so an iterator whose offsets do not fit
//     is split first.
// Everything else is the loop: each element's offset, operand by operand,
// from the iterator's sizes and byte strides.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/TensorIterator.h>
#include <c10/core/DynamicCast.h>
#include <c10/util/SmallVector.h>

#include <array>
#include <cstdint>

#include "aten/device_views.h"
//> ch18 elementwise-include
#include "aten/launch.h"
//< ch18 elementwise-include

namespace acme {

//> ch10 elementwise-args
// What the host hands the device for one launch of a binary kernel: values
// only, no tensors, so that the launch may run after the call returned.
template <typename scalar_t>
struct BinaryArgs {
  uint32_t numel = 0;
  c10::SmallVector<uint32_t, 6> sizes;                   // dimension 0 varies fastest
  std::array<c10::SmallVector<uint32_t, 6>, 3> strides;  // in bytes; 0 is the output
  std::array<char*, 3> data{};                           // device-side addresses
  std::array<c10::ScalarType, 3> dtypes{};
  std::array<bool, 3> is_value{};                        // a CPU scalar, passed as
  std::array<scalar_t, 3> value{};                       // this value
};

template <typename scalar_t>
scalar_t load(const char* p, c10::ScalarType dtype) {
  if (dtype == c10::CppTypeToScalarType<scalar_t>::value) return *reinterpret_cast<const scalar_t*>(p);
  return c10::fetch_and_cast<scalar_t>(dtype, p);
}

template <typename scalar_t>
void store(char* p, c10::ScalarType dtype, scalar_t v) {
  if (dtype == c10::CppTypeToScalarType<scalar_t>::value) *reinterpret_cast<scalar_t*>(p) = v;
  else c10::cast_and_store<scalar_t>(dtype, p, v);
}
//< ch10 elementwise-args

//> ch10 elementwise-loop
// The device code. A GPU runs the body once per element, in parallel; the
// simulated device runs it as a loop.
template <typename scalar_t, class Op>
void binary_loop(const BinaryArgs<scalar_t>& a, Op op) {
  for (uint32_t i = 0; i < a.numel; ++i) {
    std::array<uint32_t, 3> offset{};
    uint32_t rest = i;
    for (size_t d = 0; d < a.sizes.size(); ++d) {
      const uint32_t index = rest % a.sizes[d];
      rest /= a.sizes[d];
      for (int k = 0; k < 3; ++k) offset[k] += index * a.strides[k][d];
    }
    auto operand = [&](int k) {
      return a.is_value[k] ? a.value[k] : load<scalar_t>(a.data[k] + offset[k], a.dtypes[k]);
    };
    store<scalar_t>(a.data[0] + offset[0], a.dtypes[0], op(operand(1), operand(2)));
  }
}
//< ch10 elementwise-loop

//> ch10 elementwise-host
// The host side: split, read CPU scalars, describe the operands, launch.
// Op names itself (Op::name) and computes one element of any dtype.
template <class Op>
void binary_kernel(at::TensorIteratorBase& iter, Op op) {
  if (iter.numel() == 0) return;
  if (!iter.can_use_32bit_indexing()) {
    for (auto& part : iter.with_32bit_indexing()) binary_kernel(part, op);
    return;
  }
  AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, iter.common_dtype(), Op::name, [&] {
    BinaryArgs<scalar_t> args;
    args.numel = static_cast<uint32_t>(iter.numel());
    for (int d = 0; d < iter.ndim(); ++d) args.sizes.push_back(static_cast<uint32_t>(iter.shape()[d]));
    for (int k = 0; k < 3; ++k) {
      args.dtypes[k] = iter.dtype(k);
      if (k > 0 && iter.is_cpu_scalar(k)) {
        args.is_value[k] = true;
        args.value[k] = iter.scalar_value<scalar_t>(k);
        args.strides[k].assign(args.sizes.size(), 0);
        continue;
      }
      for (int d = 0; d < iter.ndim(); ++d) args.strides[k].push_back(static_cast<uint32_t>(iter.strides(k)[d]));
      args.data[k] = static_cast<char*>(device_address(iter.data_ptr(k)));
    }
//> ch10 elementwise-launch < ch18 elementwise-launch
//     binary_loop(args, op);  // at once; chapter 18 queues it on a stream
//< ch10 elementwise-launch
//> ch18 elementwise-launch
    // On the current stream: the arguments travel by value.
    launch_kernel(iter.device(0).index(), Op::name,
                  [args = std::move(args), op] { binary_loop(args, op); });
//< ch18 elementwise-launch
  });
}
//< ch10 elementwise-host

}  // namespace acme
