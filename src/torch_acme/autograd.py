#@ ch03
"""Chapter 3's autograd override of tanh, in C++ and in Python.

``tanh_override()`` registers the C++ override (``csrc/aten/autograd.cpp``) for
a ``with`` block: acme ships PyTorch's own graph for tanh, whose backward runs
on acme's ``tanh_backward`` kernel. ``Tanh`` is the same backward as a Python
``torch.autograd.Function``, for prototyping; it is not registered for acme,
call ``Tanh.apply(x)``.
"""

import contextlib

import torch


@contextlib.contextmanager
def tanh_override():
    """tanh on acme records acme's own backward node inside the block."""
    from torch_acme import _C

    registration = _C._override_tanh_autograd()
    try:
        yield
    finally:
        del registration  # destroying the Library removes its kernel


class Tanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)  # the output suffices: d tanh = 1 - tanh^2
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)
