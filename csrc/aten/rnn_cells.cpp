//@ ch13
// Recurrent cells. For CUDA and PrivateUse1 tensors, ATen's LSTM and GRU
// (nn.LSTM, nn.GRU, nn.LSTMCell, nn.GRUCell, packed sequences too) run each
// step as two matmuls plus one fused cell op that applies the gates; the CPU
// runs the gates as separate ops instead and has no kernel for the fused
// ones, so the fallback cannot help. Autograd's formulas for the fused ops
// call their backward ops below with the `workspace` the forward saved.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "aten/device_views.h"
#include "aten/routed_ops.h"

namespace acme {
namespace {

// A gate pre-activation, plus its bias when the cell has biases.
at::Tensor with_bias(DeviceViews& view, const at::Tensor& gates,
                     const std::optional<at::Tensor>& bias) {
  return bias && bias->defined() ? view(gates) + view(*bias) : view(gates);
}

at::Tensor defined_or_zeros(DeviceViews& view, const std::optional<at::Tensor>& t,
                            const at::Tensor& like) {
  return t && t->defined() ? view(*t) : at::zeros_like(like);
}

//> ch13 lstm-cell
// One LSTM step. The gates come in the order i, f, g, o (input, forget,
// cell, output); the workspace keeps them activated, for backward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& cx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  const c10::Device device = input_gates.device();
  check_same_device("aten::_thnn_fused_lstm_cell", device,
                    {hidden_gates, cx, input_bias.value_or(at::Tensor()),
                     hidden_bias.value_or(at::Tensor())});
  DeviceViews view;
  // Summed in the order the CPU's own cell sums them.
  const at::Tensor pre = with_bias(view, hidden_gates, hidden_bias) +
                         with_bias(view, input_gates, input_bias);
  const auto g = pre.chunk(4, 1);
  const at::Tensor i = g[0].sigmoid(), f = g[1].sigmoid(), c = g[2].tanh(), o = g[3].sigmoid();
  const at::Tensor cy = f * view(cx) + i * c;
  const at::Tensor hy = o * cy.tanh();
  return {on_device(hy, device), on_device(cy, device),
          on_device(at::cat({i, f, c, o}, 1), device)};
}

// Its backward: the gradient of the four pre-activations (which autograd then
// hands to both matmuls), of cx, and of the bias.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_cell_backward(
    const std::optional<at::Tensor>& grad_hy, const std::optional<at::Tensor>& grad_cy,
    const at::Tensor& cx, const at::Tensor& cy, const at::Tensor& workspace, bool has_bias) {
  const c10::Device device = workspace.device();
  check_same_device("aten::_thnn_fused_lstm_cell_backward_impl", device,
                    {grad_hy.value_or(at::Tensor()), grad_cy.value_or(at::Tensor()), cx, cy});
  DeviceViews view;
  const auto w = view(workspace).chunk(4, 1);
  const at::Tensor &i = w[0], &f = w[1], &c = w[2], &o = w[3];
  const at::Tensor tanh_cy = view(cy).tanh();
  const at::Tensor d_hy = defined_or_zeros(view, grad_hy, tanh_cy);
  const at::Tensor d_cy = d_hy * o * (1 - tanh_cy * tanh_cy) + defined_or_zeros(view, grad_cy, tanh_cy);
  const at::Tensor d_gates = at::cat({d_cy * c * i * (1 - i), d_cy * view(cx) * f * (1 - f),
                                      d_cy * i * (1 - c * c), d_hy * tanh_cy * o * (1 - o)},
                                     1);
  const at::Tensor d_bias = has_bias ? d_gates.sum(0) : at::Tensor();
  return {on_device(d_gates, device), on_device(d_cy * f, device), on_device(d_bias, device)};
}
//< ch13 lstm-cell

//> ch13 gru-cell
// One GRU step. The gates come in the order r, z, n (reset, update, new);
// the reset gate scales only the hidden part of n, so the workspace keeps
// that part, and hx, beside the three activated gates.
std::tuple<at::Tensor, at::Tensor> gru_cell(const at::Tensor& input_gates,
                                            const at::Tensor& hidden_gates, const at::Tensor& hx,
                                            const std::optional<at::Tensor>& input_bias,
                                            const std::optional<at::Tensor>& hidden_bias) {
  const c10::Device device = input_gates.device();
  check_same_device("aten::_thnn_fused_gru_cell", device,
                    {hidden_gates, hx, input_bias.value_or(at::Tensor()),
                     hidden_bias.value_or(at::Tensor())});
  DeviceViews view;
  const auto ig = with_bias(view, input_gates, input_bias).chunk(3, 1);
  const auto hg = with_bias(view, hidden_gates, hidden_bias).chunk(3, 1);
  const at::Tensor r = (hg[0] + ig[0]).sigmoid(), z = (hg[1] + ig[1]).sigmoid();
  const at::Tensor n = (ig[2] + hg[2] * r).tanh();
  const at::Tensor h = view(hx);
  const at::Tensor hy = (h - n) * z + n;
  return {on_device(hy, device), on_device(at::cat({r, z, n, h, hg[2]}, 1), device)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gru_cell_backward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  const c10::Device device = workspace.device();
  check_same_device("aten::_thnn_fused_gru_cell_backward", device, {grad_hy});
  DeviceViews view;
  const auto w = view(workspace).chunk(5, 1);
  const at::Tensor &r = w[0], &z = w[1], &n = w[2], &h = w[3], &hidden_n = w[4];
  const at::Tensor d_hy = view(grad_hy);
  const at::Tensor d_n = d_hy * (1 - z) * (1 - n * n);
  const at::Tensor d_z = d_hy * (h - n) * z * (1 - z);
  const at::Tensor d_r = d_n * hidden_n * r * (1 - r);
  const at::Tensor d_input = at::cat({d_r, d_z, d_n}, 1);
  const at::Tensor d_hidden = at::cat({d_r, d_z, d_n * r}, 1);
  return {on_device(d_input, device), on_device(d_hidden, device), on_device(d_hy * z, device),
          on_device(has_bias ? d_input.sum(0) : at::Tensor(), device),
          on_device(has_bias ? d_hidden.sum(0) : at::Tensor(), device)};
}
//< ch13 gru-cell

}  // namespace
}  // namespace acme

//> ch13 register-rnn-cells
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_thnn_fused_lstm_cell", TORCH_FN(acme::lstm_cell));
  m.impl("_thnn_fused_lstm_cell_backward_impl", TORCH_FN(acme::lstm_cell_backward));
  m.impl("_thnn_fused_gru_cell", TORCH_FN(acme::gru_cell));
  m.impl("_thnn_fused_gru_cell_backward", TORCH_FN(acme::gru_cell_backward));
}
//< ch13 register-rnn-cells
