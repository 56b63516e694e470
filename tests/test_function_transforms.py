"""torch.func and forward-mode AD on acme give the CPU's answers.

Every op the backend registers at its autograd key (AutogradPrivateUse1) is
listed here, so a new override meets these tests. tanh keeps PyTorch's graph
and has a backward kernel (chapter 3); rms_norm runs acme's _fused_rms_norm
kernels under PyTorch's generated autograd kernel, whose formulas cover
forward mode and double backward (chapter 15). Chapter 3's C++ override of
tanh, registered on request, shows what an override costs.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.func import grad, hessian, jacfwd, jacrev, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_acme  # noqa: F401

STAGE = importlib.import_module("torch_acme._build_info").STAGE
DEVICE = torch._C._get_privateuse1_backend_name()
pytestmark = pytest.mark.skipif(STAGE < 15, reason="the autograd kernels of chapters 3 and 15")

WEIGHT = torch.linspace(0.5, 1.5, 3, dtype=torch.float64)

# Scalar functions of a 6-element input, each through the ops named.
FUNCTIONS = {
    "tanh": lambda x: torch.tanh(x).pow(2).sum(),
    "rms_norm": lambda x: F.rms_norm(x.reshape(2, 3), (3,), WEIGHT.to(x.device)).pow(2).sum(),
    "tanh-mlp": lambda x: torch.tanh(torch.tanh(x.reshape(2, 3)) @ WEIGHT.to(x.device)).sum(),
    "gelu-tanh": lambda x: F.gelu(x, approximate="tanh").sum(),
    "layer_norm": lambda x: F.layer_norm(x.reshape(2, 3), (3,)).mul(WEIGHT.to(x.device)).sum(),
    # acme's fused attention backward is differentiable (chapter 14's autograd
    # kernel); its forward has no forward derivative or batching rule, so under
    # forward AD and torch.func the choice takes the math path.
    "attention": lambda x: _attention(x),
}


def _attention(x):
    # The CPU's reference on its math path: which fused kernel the CPU picks for
    # these shapes changes between releases (flash on 2.15), and its fused
    # kernels have no forward derivative either.
    q = x.reshape(1, 2, 3)
    with sdpa_kernel([SDPBackend.MATH]) if x.device.type == "cpu" else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, 0.5 * q, q).pow(2).sum()
TRANSFORMS = {
    "grad": grad,
    "jacrev": lambda f: jacrev(grad(f)),
    "jacfwd": lambda f: jacfwd(grad(f)),
    "hessian": hessian,
    "vmap-grad": lambda f: lambda x: vmap(grad(f))(torch.stack([x, 2 * x])),
}


def test_the_autograd_key_kernels_are_these():
    registered = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutogradPrivateUse1"))
    # boxkit::nms returns indices: a fallthrough, nothing to transform.
    # bias_gelu_backward refuses a second derivative (tested in test_custom_ops).
    assert registered == {"acme::bias_gelu", "acme::bias_gelu_backward", "boxkit::nms",
                          "aten::_scaled_dot_product_fused_attention_overrideable_backward"}, registered


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("function", list(FUNCTIONS))
def test_transforms_match_the_cpu(function, transform):
    f, t = FUNCTIONS[function], TRANSFORMS[transform]
    x = torch.linspace(-1.2, 0.9, 6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback's notices
        on_acme = t(f)(x.to(DEVICE))
    assert on_acme.device.type == DEVICE
    torch.testing.assert_close(on_acme.cpu(), t(f)(x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("function", list(FUNCTIONS))
def test_forward_mode_matches_the_cpu(function):
    f = FUNCTIONS[function]
    x = torch.linspace(-1.2, 0.9, 6, dtype=torch.float64)
    tangent = torch.linspace(1, 2, 6, dtype=torch.float64)

    def directional(device):
        with fwAD.dual_level(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = f(fwAD.make_dual(x.to(device), tangent.to(device)))
            return fwAD.unpack_dual(out).tangent.cpu()

    torch.testing.assert_close(directional(DEVICE), directional("cpu"), rtol=1e-10, atol=1e-12)
    # Under no_grad too: forward-mode AD does not depend on grad mode.
    with torch.no_grad():
        torch.testing.assert_close(directional(DEVICE), directional("cpu"), rtol=1e-10, atol=1e-12)


def test_the_override_costs_torch_func_and_forward_mode():
    from torch_acme.autograd import tanh_override

    x = torch.linspace(-1, 1, 4, dtype=torch.float64, device=DEVICE)
    with tanh_override():
        with pytest.raises(RuntimeError, match="cannot use C.. torch::autograd::Function with functorch"):
            grad(FUNCTIONS["tanh"])(x)
        with fwAD.dual_level(), pytest.raises(RuntimeError, match="jvp is not implemented"):
            torch.tanh(fwAD.make_dual(x, torch.ones_like(x)))
    assert torch.allclose(grad(FUNCTIONS["tanh"])(x).cpu(), grad(FUNCTIONS["tanh"])(x.cpu()))


def test_bias_gelu_refuses_transforms_as_on_the_cpu():
    # Chapter 15's custom op owns its graph with a C++ Function on both devices:
    # torch.func refuses it on the CPU and on acme alike (backward() works).
    def f(device):
        x = torch.linspace(-1, 1, 6, dtype=torch.float64, device=device).reshape(2, 3)
        return lambda b: torch.ops.acme.bias_gelu(x, b).sum()

    for device in ("cpu", DEVICE):
        with pytest.raises(RuntimeError, match="cannot use C.. torch::autograd::Function"):
            grad(f(device))(WEIGHT.to(device))
