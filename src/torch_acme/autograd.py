#@ ch03
"""The Python route to a custom backward: ``torch.autograd.Function``.

The same tanh as ``csrc/aten/autograd.cpp``, for prototyping a backward before
writing it in C++. It is not registered for acme; call ``Tanh.apply(x)``.
"""

import torch


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
