#@ ch21
"""acme's collective backend for torch.distributed (chapter 21).

`init_process_group()` without a backend then gives acme tensors this backend,
as it gives CUDA tensors NCCL's; `init_process_group("cpu:gloo,acme:acme")`
adds gloo for CPU tensors.
The backend is C++ (csrc/aten/collectives.cpp) over the runtime's collective
library; this module only tells c10d it exists.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from . import _C, sharding

# The backend takes the device's name, as everything users see does.
BACKEND_NAME = torch._C._get_privateuse1_backend_name()

# PyTorch 2.13 marks gloo's type as the default backend of a group that
# init_process_group() made without naming one, whatever it made, and DDP then
# fails to find it ("Could not find backend type 1"); a factory is not handed
# the group there to put that right. So on 2.13 the factory returns a whole
# ProcessGroup, which c10d takes as it is (and does not wrap for
# TORCH_DISTRIBUTED_DEBUG=DETAIL). From 2.14 c10d marks the backend it made.
_WHOLE_GROUP = TorchVersion(torch.__version__) < (2, 14)


def _make_backend(options, backend_options=None) -> dist.Backend:
    """What c10d calls to make a group's acme backend (extended_api=True: one
    `_DistributedBackendOptions` with the store, rank, size and timeout)."""
    sharding.register()  # DTensor's strategies for acme's operators, once
    return _C._make_process_group_backend(options.store, options.group_rank,
                                          options.group_size, options.timeout)


def _make_whole_group(store: dist.Store, rank: int, size: int,
                      timeout: datetime.timedelta) -> dist.ProcessGroup:
    """PyTorch 2.13 only: acme's backend as the group's default, and gloo for
    CPU tensors (which the "cpu:gloo,acme:acme" form asks for: c10d drops
    what it made before a factory that returns a whole group)."""
    sharding.register()
    group = dist.ProcessGroup(store, rank, size)
    backend = _C._make_process_group_backend(store, rank, size, timeout)
    custom = dist.ProcessGroup.BackendType.CUSTOM
    group._register_backend(torch.device(BACKEND_NAME), custom, backend)
    if dist.is_gloo_available():
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        gloo._set_sequence_number_for_group()  # as c10d does for its own gloo on 2.13
        group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    group._set_default_backend(custom)
    return group


def register() -> None:
    """Make BACKEND_NAME a c10d backend, the default for acme tensors."""
    if hasattr(dist.Backend, BACKEND_NAME.upper()):
        return  # registered already (the module was imported again)
    if _WHOLE_GROUP:
        dist.Backend.register_backend(BACKEND_NAME, _make_whole_group, devices=[BACKEND_NAME])
    else:
        dist.Backend.register_backend(BACKEND_NAME, _make_backend, extended_api=True,
                                      devices=[BACKEND_NAME])


if dist.is_available():
    register()
