#@ ch14
"""Where PyTorch's Python picks a precision by device type (chapter 14).

`F.linear_cross_entropy` with `options=` (the chunked path) accumulates fp16
and bf16 inputs in float32 on CUDA (sm80 and later) and on the CPU, and in the
input's own dtype on any other device: it asks
`LinearCrossEntropyOptions._resolve_auto_acc_dtype`, which knows "cuda" and
"cpu" only (PyTorch 2.13 to 2.15). On 2.15 a bf16 loss of PyTorch's own
samples came out 2.6 % from the CPU's on acme, with no error. acme's matrix
products accumulate in float32, as CUDA's do, so acme answers as CUDA does.
Private PyTorch API, no registration point: upstream is the right home for a
per-device answer.
"""

from __future__ import annotations

import torch

from . import DEVICE_NAME


def install() -> None:
    try:
        from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions
    except ImportError:  # a release without the chunked path: nothing to answer
        return
    pytorch_answer = LinearCrossEntropyOptions._resolve_auto_acc_dtype

    def resolve_auto_acc_dtype(dtype, device):
        if (device is not None and torch.device(device).type == DEVICE_NAME
                and dtype in (torch.float16, torch.bfloat16)):
            return torch.float32
        return pytorch_answer(dtype, device)

    LinearCrossEntropyOptions._resolve_auto_acc_dtype = staticmethod(resolve_auto_acc_dtype)
