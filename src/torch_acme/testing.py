#@ ch15
"""``torch.library.opcheck`` for operators called with acme tensors.

PyTorch's opcheck runs four tests. Three of them work for any device; the
fourth, ``test_autograd_registration``, raises NotImplementedError for devices
other than CPU, CUDA and XPU (PyTorch 2.13 to 2.15). This module runs the three and
checks the fourth itself, against acme's autograd key.
"""

import torch
import torch.utils._pytree as pytree

DEVICE_AGNOSTIC_TESTS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck(op, args, kwargs=None, *, rtol=None, atol=None) -> dict:
    """Every opcheck test for ``op(*args, **kwargs)``; raises on the first failure."""
    kwargs = kwargs or {}
    results = torch.library.opcheck(op, args, kwargs, test_utils=DEVICE_AGNOSTIC_TESTS,
                                    raise_exception=True, rtol=rtol, atol=atol)
    autograd_registration_check(op, args, kwargs)
    results["test_autograd_registration"] = "SUCCESS"
    return results


def autograd_registration_check(op, args, kwargs) -> None:
    """An op whose outputs need gradients must say how, at an autograd key.

    The failure this catches: a backward wired up inside the device kernel
    (an autograd.Function called from the PrivateUse1 kernel), which autograd
    bypasses in some modes and torch.compile never sees.
    """
    overload = _overload(op)
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if not any(t.requires_grad for t in tensors):
        return  # nothing to differentiate; opcheck skips the test the same way
    name = overload.name()
    for key in ("AutogradPrivateUse1", "Autograd", "CompositeImplicitAutograd"):
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
            return
    # No autograd kernel: then no output may require grad, or a gradient was
    # recorded below autograd's key.
    mode = torch._C._get_autograd_fallback_mode()
    torch._C._set_autograd_fallback_mode("nothing")
    try:
        outputs = overload(*args, **kwargs)
    finally:
        torch._C._set_autograd_fallback_mode(mode)
    inputs = {id(t) for t in tensors}
    if pytree.tree_any_only(torch.Tensor, lambda t: t.requires_grad and id(t) not in inputs,
                            outputs):
        raise AssertionError(
            f"{name}: an output requires grad but the operator has no kernel at "
            f"AutogradPrivateUse1 (or Autograd): register its autograd there, not in "
            f"the device kernel")


def _overload(op):
    op = getattr(op, "_opoverload", op)  # a torch.library.custom_op
    return op.default if isinstance(op, torch._ops.OpOverloadPacket) else op
