#@ ch23
"""Random ops in compiled, checkpointed code (chapter 23).

When torch.compile meets activation checkpointing around a random op (dropout),
AOTAutograd recomputes the op in backward and must draw the same numbers: it
wraps the forward op in `run_and_save_rng_state` (keep the generator's state,
then run) and the recomputation in `run_with_rng_state` (run from that state).
PyTorch (2.13 to 2.15) implements these two operators for cpu, cuda, hpu and xpu only,
picking by device type from a table a backend cannot extend; on any other
device tracing stops with "Backend not supported for acme". So acme adds its
own implementations: a kernel for its dispatch key, and a wrapper in front of
the two places that pick by device type (the BackendSelect kernel and the
fake-tensor rule). Private PyTorch API: chapter 23's run compiles the
language model with dropout, so a PyTorch release that moves these tables
fails it. Upstream is the right home for it.
"""

from __future__ import annotations

import torch
from torch._C import DispatchKey
from torch._higher_order_ops.utils import registered_hop_fake_fns
from torch._prims import rng_prims

from . import DEVICE_NAME


def _device_index(args, kwargs) -> int:
    """The device of the first acme tensor among the op's arguments."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.device.type == DEVICE_NAME:
            return value.device.index
    return torch.accelerator.current_device_index()


def _run_and_save(op, *args, **kwargs):
    state = torch.get_device_module(DEVICE_NAME).get_rng_state(_device_index(args, kwargs))
    return state, op(*args, **kwargs)


def _run_with(rng_state, op, *args, **kwargs):
    module, index = torch.get_device_module(DEVICE_NAME), _device_index(args, kwargs)
    current = module.get_rng_state(index)
    module.set_rng_state(rng_state.cpu(), index)
    try:
        return op(*args, **kwargs)
    finally:
        module.set_rng_state(current, index)


#> ch23 rng-in-front
def _in_front(hop, ours, device_of, tables):
    """Route `hop`'s device-type choices (`tables`: (table, key) pairs) to
    `ours` for acme tensors, everything else as before."""
    for table, key in tables:
        upstream = table[key]

        def choose(*args, _upstream=upstream, **kwargs):
            if rng_prims.get_device(*device_of(args), kwargs) == DEVICE_NAME:
                return ours(*args, **kwargs)
            return _upstream(*args, **kwargs)

        table[key] = choose
    hop.py_impl(DispatchKey.PrivateUse1)(ours)
    hop._dispatch_cache.clear()


_save, _with = rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state
# run_and_save_rng_state(op, *args): its fake-tensor rule picks by device too.
_in_front(_save, _run_and_save, lambda args: (args[1:],),
          [(_save.py_kernels, DispatchKey.BackendSelect), (registered_hop_fake_fns, _save)])
# run_with_rng_state(state, op, *args): the state is a CPU tensor; skip it.
_in_front(_with, _run_with, lambda args: (args[2:],),
          [(_with.py_kernels, DispatchKey.BackendSelect)])
#< ch23 rng-in-front
