//@ ch14
// Second derivatives through attention (found by chapter 14's gradgrad sweep).
// acme's fused attention backward (chapter 13) is a kernel, not a formula
// autograd can differentiate: with create_graph=True, PyTorch's generated
// autograd kernel for the backward op raises "derivative ... is not
// implemented", where the CPU's float64 run (ATen's math path) gives an
// answer. Registered at AutogradPrivateUse1, this kernel passes ordinary
// backward calls straight to the fused kernel and, only when the gradient
// itself must be differentiable, recomputes it through ATen's math path, whose
// graph autograd can follow. CUDA's fused kernels have no such route: there,
// the math path is chosen up front (float64) or the call fails.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_dot_product_attention_math.h>
#include <ATen/ops/_scaled_dot_product_fused_attention_overrideable_backward.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

namespace acme {
namespace {

using AttentionGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

AttentionGrads attention_backward_autograd(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& attn_bias, std::array<bool, 4> grad_input_mask,
    const at::Tensor& out, const at::Tensor& logsumexp, const at::Tensor& cum_seq_q,
    const at::Tensor& cum_seq_k, c10::SymInt max_q, c10::SymInt max_k, double dropout_p,
    bool is_causal, const at::Tensor& philox_seed, const at::Tensor& philox_offset,
    std::optional<double> scale) {
  const std::array<at::Tensor, 4> inputs = {query, key, value, attn_bias};
  bool in_graph = grad_out.requires_grad();
  for (const auto& t : inputs) in_graph |= t.defined() && t.requires_grad();
  if (!c10::GradMode::is_enabled() || !in_graph) {  // an ordinary backward: the fused kernel
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return at::_ops::_scaled_dot_product_fused_attention_overrideable_backward::call(
        grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q,
        cum_seq_k, std::move(max_q), std::move(max_k), dropout_p, is_causal, philox_seed,
        philox_offset, scale);
  }
  TORCH_CHECK_NOT_IMPLEMENTED(
      dropout_p == 0.0, c10::DeviceType::PrivateUse1,
      ": a second derivative through scaled_dot_product_attention with dropout is not "
      "supported (recomputing the gradient would draw a new dropout mask). Use dropout_p=0, or "
      "run the whole computation on the math path: torch.nn.attention.sdpa_kernel("
      "SDPBackend.MATH).");
  // Inputs the gradient is wanted for; one that does not require grad gets a
  // stand-in leaf, so that its gradient is still a function of grad_out.
  std::vector<at::Tensor> wrt;
  std::array<at::Tensor, 4> used;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!grad_input_mask[i] || !inputs[i].defined()) continue;
    used[i] = inputs[i].requires_grad() ? inputs[i] : inputs[i].detach().requires_grad_(true);
    wrt.push_back(used[i]);
  }
  auto pick = [&](size_t i) { return used[i].defined() ? used[i] : inputs[i]; };
  std::optional<at::Tensor> bias;
  if (attn_bias.defined()) bias = pick(3);
  const at::Tensor recomputed = std::get<0>(at::_scaled_dot_product_attention_math(
      pick(0), pick(1), pick(2), bias, /*dropout_p=*/0.0, is_causal, std::nullopt, scale));
  const auto grads = torch::autograd::grad({recomputed}, wrt, {grad_out}, /*retain_graph=*/true,
                                           /*create_graph=*/true, /*allow_unused=*/true);
  std::array<at::Tensor, 4> result;
  for (size_t i = 0, k = 0; i < inputs.size(); ++i) {
    if (!used[i].defined()) continue;
    result[i] = grads[k].defined() ? grads[k] : at::zeros_like(inputs[i]);
    ++k;
  }
  return {result[0], result[1], result[2], result[3]};
}

}  // namespace
}  // namespace acme

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("_scaled_dot_product_fused_attention_overrideable_backward",
         TORCH_FN(acme::attention_backward_autograd));
}
