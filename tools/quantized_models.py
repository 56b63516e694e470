"""The quantized inference paths chapter 22 runs on acme: its tests and its page
use these. Each is plain PyTorch on quantized tensors, for any device."""

from __future__ import annotations

import torch


def quantize_weight(weight: torch.Tensor, per_channel: bool = True) -> torch.Tensor:
    """int8 weights, symmetric: per output channel, or one scale for all."""
    if per_channel:
        scales = weight.detach().abs().amax(dim=1).clamp(min=1e-8).cpu().double() / 127
        return torch.quantize_per_channel(weight.detach(), scales, torch.zeros_like(
            scales, dtype=torch.long), axis=0, dtype=torch.qint8)
    scale = weight.detach().abs().max().clamp(min=1e-8).item() / 127
    return torch.quantize_per_tensor(weight.detach(), scale, 0, torch.qint8)


def weight_only_linear(x: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None):
    """Weight-only int8: the weights stay quantized in memory (a quarter of the
    float bytes) and become floats only for the product."""
    return torch.nn.functional.linear(x, qweight.dequantize(), bias)


def dynamic_linear(x: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None,
                   reduce_range: bool = True) -> torch.Tensor:
    """What torch.ao.nn.quantized.dynamic.Linear computes, in operations any
    device has: the input quantized per tensor with parameters taken from its
    range (uint8; 7 bits with reduce_range, as FBGEMM wants), an integer product
    with 32-bit sums, then one float scale per output and the bias."""
    scale, zero_point = torch._choose_qparams_per_tensor(x, reduce_range)
    qx = torch.quantize_per_tensor(x, scale, zero_point, torch.quint8)
    xi = qx.int_repr().to(torch.int32) - zero_point
    if qweight.qscheme() == torch.per_tensor_affine:
        wi = qweight.int_repr().to(torch.int32) - qweight.q_zero_point()
        scales = torch.tensor([qweight.q_scale()], dtype=torch.float32, device=x.device)
    else:
        zero_points = qweight.q_per_channel_zero_points().to(x.device, torch.int32)
        wi = qweight.int_repr().to(torch.int32) - zero_points[:, None]
        scales = qweight.q_per_channel_scales().to(x.device, torch.float32)
    sums = xi @ wi.t()  # int32, exact
    y = sums.to(torch.float32) * (torch.tensor(scale, dtype=torch.float32) * scales)
    return y if bias is None else y + bias
