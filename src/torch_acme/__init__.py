"""acme: a simulated accelerator plugged into PyTorch through PrivateUse1."""

#> ch01 import-torch
# From chapter 1 on, _C links libtorch and registers kernels when it loads:
# torch must be imported first.
import torch

#< ch01 import-torch
#> ch00 load-runtime
from . import _C
from ._C import runtime  # the vendor runtime, driven directly (chapter 0)
#< ch00 load-runtime

#> ch01 device-module
from . import device

# PyTorch looks up `torch.privateuseone` whenever it creates a tensor on the device.
torch._register_device_module("privateuseone", device)
#< ch01 device-module

__all__ = [
    "runtime",
#> ch01 device-module-export
    "device",
#< ch01 device-module-export
]
