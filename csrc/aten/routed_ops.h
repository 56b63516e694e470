//@ ch13
// Helpers of the routed ops (chapter 13), which compute on device views. A
// header apart from device_views.h, which the native kernels read too.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/Device.h>

#include <initializer_list>

#include "aten/device_views.h"

namespace acme {

//> ch13 results
// Chapter 10's device check (device_views.h), over a routed op's tensors.
inline void check_same_device(const char* op, c10::Device device,
                              std::initializer_list<at::Tensor> tensors) {
  for (const at::Tensor& t : tensors) check_device(op, device, t);
}

// The routed ops compute on device views into CPU results; this writes one
// into a new tensor on `device`, with the same sizes and strides. (A real
// kernel would write its output in place; here the copy is device-side.)
inline at::Tensor on_device(const at::Tensor& computed, c10::Device device) {
  if (!computed.defined()) return computed;
  at::Tensor result = at::empty_strided(computed.sizes(), computed.strides(),
                                        computed.options().device(device));
  DeviceViews view;
  view(result).copy_(computed);
  return result;
}
//< ch13 results

}  // namespace acme
