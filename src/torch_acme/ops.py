#@ ch15
"""An operator defined in Python: ``torch.ops.acme.swiglu``.

swiglu(gate, up) = silu(gate) * up, the gated activation of LLaMA-style MLPs.
``torch.library.custom_op`` gives it a schema (from the type hints), kernels
for the devices named, a fake kernel for torch.compile, and autograd: the
same four pieces ``csrc/aten/custom_ops.cpp`` registers in C++ for
``acme::bias_gelu``.
"""

import torch
import torch.nn.functional as F

from . import DEVICE_NAME


#> ch15 custom-op
# The namespace is the product's, as in C++ (custom_ops.cpp); the devices
# follow DEVICE_NAME.
@torch.library.custom_op("acme::swiglu", mutates_args=(),
                         device_types=("cpu", DEVICE_NAME))
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    torch._check(gate.shape == up.shape, lambda: f"swiglu: gate {tuple(gate.shape)} "
                 f"and up {tuple(up.shape)} must have the same shape")
    # Written into a tensor shaped like `gate`, so the fake kernel below can
    # promise the same strides.
    return torch.mul(F.silu(gate), up, out=torch.empty_like(gate))
#< ch15 custom-op


#> ch15 register-fake
@swiglu.register_fake
def _(gate, up):
    torch._check(gate.shape == up.shape, lambda: f"swiglu: gate {tuple(gate.shape)} "
                 f"and up {tuple(up.shape)} must have the same shape")
    return torch.empty_like(gate)
#< ch15 register-fake


#> ch15 register-autograd
def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    gate, up = ctx.saved_tensors
    sigmoid = torch.sigmoid(gate)
    silu = gate * sigmoid
    # d silu(g)/dg = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    return grad * up * sigmoid * (1 + gate * (1 - sigmoid)), grad * silu


swiglu.register_autograd(_backward, setup_context=_setup_context)
#< ch15 register-autograd
