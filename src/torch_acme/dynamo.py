#@ ch20
"""torch.compile's graph capture, Dynamo, for acme (chapter 20).

Dynamo asks a device interface for what torch.cuda would answer: the device
count, the current device and stream, synchronize, properties. It knows the
built-in devices; acme registers its own, made of the device module's
functions and PyTorch's generic torch.Stream and torch.Event (which Dynamo can
put in a graph). compiler_hooks.py imports this file when Dynamo has loaded.
"""

from __future__ import annotations

import torch
from torch._dynamo.device_interface import DeviceInterface, register_interface_for_device

from . import DEVICE_NAME
from . import device as acme

# Properties read once, by the first process that asks (the main process,
# before it starts Inductor's compile workers, which must not initialize the
# device themselves), and kept.
_worker_properties: list = []
_worker_device: int | None = None


def _compiler_properties(index: int):
    """acme's properties plus the one Inductor sizes reductions by:
    multi_processor_count. acme's compiled kernels are the CPU's C++ with
    OpenMP, so its "multiprocessors" are the threads those kernels use."""
    properties = acme.get_device_properties(index)
    properties.multi_processor_count = torch.get_num_threads()
    return properties


def _index(device) -> int:
    if isinstance(device, int):
        return device
    index = None if device is None else torch.device(device).index
    return AcmeInterface.Worker.current_device() if index is None else index


#> ch20 device-interface
class AcmeInterface(DeviceInterface):
    device = acme.device
    Stream = torch.Stream
    Event = torch.Event

    class Worker:
        @staticmethod
        def set_device(device: int) -> None:
            global _worker_device
            _worker_device = device

        @staticmethod
        def current_device() -> int:
            return acme.current_device() if _worker_device is None else _worker_device

        @staticmethod
        def get_device_properties(device=None):
            if not _worker_properties:
                _worker_properties.extend(_compiler_properties(i)
                                          for i in range(acme.device_count()))
            return _worker_properties[_index(device)]

    current_device = staticmethod(acme.current_device)
    set_device = staticmethod(acme.set_device)
    device_count = staticmethod(acme.device_count)
    is_available = staticmethod(acme.is_available)
    stream = staticmethod(acme.stream)
    current_stream = staticmethod(acme.current_stream)
    set_stream = staticmethod(acme.set_stream)
    synchronize = staticmethod(acme.synchronize)
    memory_allocated = staticmethod(acme.memory_allocated)

    @staticmethod
    def exchange_device(device: int) -> int:
        previous = acme.current_device()
        if device >= 0 and device != previous:
            acme.set_device(device)
        return previous

    maybe_exchange_device = exchange_device

    @staticmethod
    def _set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
        torch.accelerator.set_stream(torch.Stream(stream_id=stream_id, device_index=device_index,
                                                  device_type=device_type))

    @staticmethod
    def get_raw_stream(device_idx: int) -> int:
        """The runtime's handle of the current stream of acme:`device_idx`."""
        return torch.accelerator.current_stream(device_idx).native_handle

    @staticmethod
    def get_compute_capability(device=None) -> str:
        major, minor = acme.get_device_capability(device)
        return f"{major}.{minor}"

    @staticmethod
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return True

    @staticmethod
    def raise_if_triton_unavailable(device=None) -> None:
        raise RuntimeError(f"{DEVICE_NAME} has no Triton backend; torch.compile generates C++ "
                           f"kernels for {DEVICE_NAME} (torch_acme/inductor.py)")


register_interface_for_device(DEVICE_NAME, AcmeInterface)
for _i in range(acme.device_count()):  # "acme:1" too, as Dynamo has "cuda:1"
    register_interface_for_device(f"{DEVICE_NAME}:{_i}", AcmeInterface)
#< ch20 device-interface

#> ch20 constant-queries
# Dynamo traces into the device module's Python functions, and a call into the
# extension would end the graph. The device count cannot change in a process:
# Dynamo may take it as a constant. (current_device asks torch.accelerator,
# which Dynamo folds into the graph and guards on: device.py.)
for _query in (acme.device_count, acme.is_available):
    torch.compiler.assume_constant_result(_query)
#< ch20 constant-queries

# acme's own Dynamo backend, for a vendor's graph compiler (graph_backend.py).
from . import graph_backend  # noqa: E402,F401
