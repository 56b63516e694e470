"""Chapter 3's tanh autograd override, registered from Python with torch.library.

Run after `import torch_acme`. The same registration as csrc/aten/autograd.cpp:
a kernel at AutogradPrivateUse1, so every tanh on an acme tensor records
acme's backward node instead of PyTorch's TanhBackward0.
"""

import torch


class AcmeTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        # Run the acme kernel below autograd (and ADInplaceOrView, as the C++
        # tab's guard does): without it torch.tanh would dispatch straight back
        # to tanh_with_acme_autograd below.
        with torch._C._AutoDispatchBelowADInplaceOrView():
            y = torch.tanh(x)
        ctx.save_for_backward(y)  # the output suffices: d tanh = 1 - tanh^2
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        # ATen's own formula, as the C++ tab: right for complex and half too.
        return torch.ops.aten.tanh_backward(grad, y)


def tanh_with_acme_autograd(x):
    return AcmeTanh.apply(x)


# Keep the Library alive: when it is garbage collected, the kernel is removed.
autograd_lib = torch.library.Library("aten", "IMPL")
autograd_lib.impl("tanh", tanh_with_acme_autograd, "AutogradPrivateUse1")
