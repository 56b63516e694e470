"""The low-precision inference paths chapter 22 runs on acme: its tests and its
page use these. User code, for any device: `dynamic_linear` on quantized
tensors (what torch.ao's dynamic Linear computes), the others on plain int8 or
float8 tensors with their scales beside them, as torchao keeps them."""

from __future__ import annotations

import torch


def int8_weight(weight: torch.Tensor, dtype: torch.dtype = torch.float32):
    """A weight as torchao keeps it for int8 inference: a plain int8 tensor and
    one scale per output channel beside it (symmetric, no zero point)."""
    scales = weight.detach().abs().amax(dim=1).clamp(min=1e-8) / 127
    integers = torch.round(weight.detach() / scales[:, None]).clamp(-128, 127).to(torch.int8)
    return integers, scales.to(dtype)


def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """Weight-only int8: one kernel reads the int8 weight (a quarter of the
    float bytes) and scales each output; the float weight never exists."""
    y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), weight, scales)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def int8_dynamic_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """int8 activations and weights: each input row quantized as it arrives
    (symmetric, its own scale), one integer product with 32-bit sums
    (torch._int_mm), then both scales and the bias in float."""
    rows = x.reshape(-1, x.shape[-1])
    row_scales = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
    quantized = torch.round(rows / row_scales).clamp(-128, 127).to(torch.int8)
    sums = torch._int_mm(quantized, weight.t())
    y = (sums.to(torch.float32) * row_scales * scales.to(torch.float32)).to(x.dtype)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def float8_weight(weight: torch.Tensor):
    """float8 (e4m3) weights with one float32 scale per output channel."""
    scales = weight.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448
    return (weight.detach() / scales).to(torch.float8_e4m3fn), scales


def float8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """float8 rowwise: inputs scaled per row into e4m3, one torch._scaled_mm
    with the two scale vectors and the bias, the result in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    row_scales = rows.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448
    quantized = (rows / row_scales).to(torch.float8_e4m3fn)
    y = torch._scaled_mm(quantized, weight.t(), row_scales, scales.t(), bias=bias, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


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
