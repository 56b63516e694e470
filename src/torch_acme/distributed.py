#@ ch21
"""acme's collective backend for torch.distributed (chapter 21).

`init_process_group()` without a backend then gives acme tensors this backend
and CPU tensors gloo; `init_process_group("acme")` asks for it by name.
The backend is C++ (csrc/aten/collectives.cpp) over the runtime's collective
library; this module only tells c10d it exists.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from . import _C, sharding

# c10d's own groups agree on gloo's first sequence number this way up to
# PyTorch 2.13. From 2.14 numbers start at 0 on every rank, and the call is a
# no-op that warns (on stderr, once per process): make it on older releases only.
_SET_SEQUENCE_NUMBER = TorchVersion(torch.__version__) < (2, 14)

# The backend takes the device's name, as everything users see does.
BACKEND_NAME = torch._C._get_privateuse1_backend_name()


def _make_process_group(store: dist.Store, rank: int, size: int,
                        timeout: datetime.timedelta) -> dist.ProcessGroup:
    """What c10d calls to make a group's acme backend. It returns a whole
    ProcessGroup instead: acme's backend for acme tensors, as the default, and
    gloo for CPU tensors. `init_process_group()` with no backend makes only
    the accelerator's (2.13 to 2.15), and up to PyTorch 2.13 it set a group's
    default backend to NCCL's or gloo's type whatever it made (DDP then fails
    to find it); a group made here is right in both respects."""
    sharding.register()  # DTensor's strategies for acme's operators, once
    group = dist.ProcessGroup(store, rank, size)
    backend = _C._make_process_group_backend(store, rank, size, timeout)
    custom = dist.ProcessGroup.BackendType.CUSTOM
    group._register_backend(torch.device(BACKEND_NAME), custom, backend)
    if dist.is_gloo_available():
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        if _SET_SEQUENCE_NUMBER:
            gloo._set_sequence_number_for_group()
        group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    group._set_default_backend(custom)
    return group


def register() -> None:
    """Make BACKEND_NAME a c10d backend, the default for acme tensors."""
    if hasattr(dist.Backend, BACKEND_NAME.upper()):
        return  # registered already (the module was imported again)
    dist.Backend.register_backend(BACKEND_NAME, _make_process_group, devices=[BACKEND_NAME])


if dist.is_available():
    register()
