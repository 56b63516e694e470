//@ ch13
// Convolution. ATen's convolution picks a backend by device: for CPU tensors
// its own kernels or oneDNN, for CUDA cuDNN, and for PrivateUse1 always
// `convolution_overrideable`, whose default kernel only raises. That op has
// no CPU kernel, so the CPU fallback cannot run it: acme must. Everything
// in front of it (padding modes, 'same' padding, complex inputs, batching of
// 1-D and unbatched inputs) is composite ATen that runs before the routing.
#include <ATen/core/Tensor.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "aten/device_views.h"
#include "aten/routed_ops.h"
//> ch23 convolution-on-stream-include
#include "aten/run_on_stream.h"
//< ch23 convolution-on-stream-include

namespace acme {
namespace {

//> ch13 conv-kernels
// The device's convolution: here PyTorch's CPU convolution, run on device
// views (a vendor calls its own convolution library at this point).
at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                       at::IntArrayRef output_padding, int64_t groups) {
  const at::Tensor no_bias;
  const at::Tensor& b = bias ? *bias : no_bias;
  check_same_device("aten::convolution_overrideable", input.device(), {weight, b});
  DeviceViews view;
  std::optional<at::Tensor> bias_view;
  if (b.defined()) bias_view = view(b);
  const at::Tensor out = at::convolution(view(input), view(weight), bias_view, stride, padding,
                                         dilation, transposed, output_padding, groups);
  return on_device(out, input.device());
}

// Its backward, which autograd reaches through convolution_backward (also
// routed by device). output_mask says which of the three gradients to compute.
std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
    at::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> output_mask) {
  check_same_device("aten::convolution_backward_overrideable", input.device(),
                    {grad_output, weight});
  // The bias has one value per output channel.
  const int64_t channels = transposed ? weight.size(1) * groups : weight.size(0);
  const std::array<int64_t, 1> bias_sizes{channels};
  DeviceViews view;
  auto [grad_input, grad_weight, grad_bias] = at::convolution_backward(
      view(grad_output), view(input), view(weight), at::IntArrayRef(bias_sizes), stride, padding,
      dilation, transposed, output_padding, groups, output_mask);
  const c10::Device device = input.device();
  return {on_device(grad_input, device), on_device(grad_weight, device),
          on_device(grad_bias, device)};
}
//< ch13 conv-kernels
//> ch23 conv-arithmetic

// The two kernels' arithmetic alone, on CPU tensors (device views), for
// their launches once a call with the same shapes has passed (chapter 23).
at::Tensor convolution_on_views(const at::Tensor& input, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                at::IntArrayRef padding, at::IntArrayRef dilation,
                                bool transposed, at::IntArrayRef output_padding, int64_t groups) {
  return at::convolution(input, weight, bias, stride, padding, dilation, transposed,
                         output_padding, groups);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_on_views(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
    at::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> output_mask) {
  const std::array<int64_t, 1> bias_sizes{transposed ? weight.size(1) * groups : weight.size(0)};
  return at::convolution_backward(grad_output, input, weight, at::IntArrayRef(bias_sizes),
                                  stride, padding, dilation, transposed, output_padding, groups,
                                  output_mask);
}
//< ch23 conv-arithmetic

}  // namespace
}  // namespace acme

//> ch13 register-convolution
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
//> ch13 register-convolution-kernels < ch23 register-convolution-kernels
//   m.impl("convolution_overrideable", TORCH_FN(acme::convolution));
//   m.impl("convolution_backward_overrideable", TORCH_FN(acme::convolution_backward));
//< ch13 register-convolution-kernels
//> ch23 register-convolution-kernels
  // The kernels run on the stream's worker: the first call with given shapes
  // waiting, later ones launched (chapter 23).
  using acme::LaunchedOnStream;
  m.impl("convolution_overrideable",
         TORCH_FN((LaunchedOnStream<"convolution", acme::convolution,
                                    acme::convolution_on_views>::call)));
  m.impl("convolution_backward_overrideable",
         TORCH_FN((LaunchedOnStream<"convolution backward", acme::convolution_backward,
                                    acme::convolution_backward_on_views>::call)));
//< ch23 register-convolution-kernels
}
//< ch13 register-convolution
