#@ ch01
"""The device module PyTorch finds as ``torch.privateuseone``.

Its functions mirror ``torch.cuda``'s so that code written for one reads the same
for the other; each is a thin call into the vendor runtime.
"""

from ._C import runtime


def is_available() -> bool:
    return device_count() > 0


def device_count() -> int:
    return runtime.device_count()


def current_device() -> int:
    return runtime.current_device()


def set_device(device) -> None:
    runtime.set_device(_index(device))


def synchronize(device=None) -> None:
    runtime.synchronize()


def _index(device) -> int:
    """Accepts 1, "privateuseone:1" or torch.device("privateuseone", 1)."""
    if isinstance(device, int):
        return device
    import torch

    device = torch.device(device)
    if device.type != "privateuseone":
        raise ValueError(f"expected an acme device, got {device}")
    return current_device() if device.index is None else device.index
