"""How to call each op of acme's autocast policy table, and what its policy promises.

Shared by tests/test_autocast.py (which checks dtypes and values against the
last stage) and chapter 4 (which draws the table from the same calls at stage
4). Device-neutral: the device name is an argument, since it is
"privateuseone" before chapter 8 and "acme" after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# One call per op of the table, keyed by the op's name as the table gives it.
# `t(*shape)` makes the next input tensor (see make_inputs).
RECIPES = {
    "aten::mm": lambda t: torch.mm(t(3, 4), t(4, 5)),
    "aten::bmm": lambda t: torch.bmm(t(2, 3, 4), t(2, 4, 5)),
    "aten::addmm": lambda t: torch.addmm(t(3, 5), t(3, 4), t(4, 5)),
    "aten::baddbmm": lambda t: torch.baddbmm(t(2, 3, 5), t(2, 3, 4), t(2, 4, 5)),
    "aten::matmul": lambda t: torch.matmul(t(3, 4), t(4, 5)),
    "aten::linear": lambda t: F.linear(t(3, 4), t(5, 4), t(5)),
    "aten::exp": lambda t: torch.exp(t(3, 4)),
    "aten::log": lambda t: torch.log(t(3, 4)),
    "aten::rsqrt": lambda t: torch.rsqrt(t(3, 4)),
    "aten::pow.Tensor_Scalar": lambda t: torch.pow(t(3, 4), 3),
    "aten::layer_norm": lambda t: F.layer_norm(t(3, 4), (4,), t(4), t(4)),
    "aten::mse_loss": lambda t: F.mse_loss(t(3, 4), t(3, 4)),
    "aten::binary_cross_entropy_with_logits":
        lambda t: F.binary_cross_entropy_with_logits(t(3, 4), t(3, 4)),
    "aten::softmax.int": lambda t: torch.softmax(t(3, 4), dim=1),
    "aten::log_softmax.int": lambda t: torch.log_softmax(t(3, 4), dim=1),
    "aten::sum": lambda t: torch.sum(t(3, 4)),
    "aten::sum.dim_IntList": lambda t: torch.sum(t(3, 4), dim=1),
    "aten::cumsum": lambda t: torch.cumsum(t(3, 4), dim=1),
    "aten::cat": lambda t: torch.cat([t(3, 4), t(2, 4)]),
    "aten::stack": lambda t: torch.stack([t(3, 4), t(3, 4)]),
    "aten::addcmul": lambda t: torch.addcmul(t(3, 4), t(3, 4), t(3, 4)),
    "aten::addcdiv": lambda t: torch.addcdiv(t(3, 4), t(3, 4), t(3, 4)),
    "aten::dot": lambda t: torch.dot(t(4), t(4)),
}

LOW = (torch.float16, torch.bfloat16)
# The input mixes: every input float32, every input in the autocast dtype
# ("low"), or the first float32 and the rest low ("mixed").
MIXES = ("float32", "low", "mixed")


def make_inputs(device: str, mix: str, low: torch.dtype, as_float32: bool = False):
    """t(*shape): the next input, the same values on every device, its dtype per `mix`.

    Values lie in [0.5, 1.5), so log and rsqrt are defined. With as_float32 the
    (already rounded) values come back as float32 CPU tensors: the reference.
    """
    generator = torch.Generator().manual_seed(0)
    count = 0

    def t(*shape):
        nonlocal count
        first = count == 0
        count += 1
        dtype = torch.float32 if mix == "float32" or (mix == "mixed" and first) else low
        values = (torch.rand(shape, generator=generator) + 0.5).to(dtype)
        return values.float() if as_float32 else values.to(device)

    return t


def expected_dtype(policy: str, mix: str, low: torch.dtype) -> torch.dtype:
    """The output dtype an op with `policy` must give under autocast to `low`."""
    if policy == "lower_precision_fp":
        return low
    if policy in ("fp32", "fp32_set_opt_dtype"):
        return torch.float32
    assert policy == "promote", policy
    return low if mix == "low" else torch.float32  # the widest of the inputs
