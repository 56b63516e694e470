#@ ch16
"""acme tensors through torch.multiprocessing: queues, pipes, spawn arguments,
DataLoader workers.

PyTorch shares a CPU tensor's memory through shared memory and a CUDA tensor's
through CUDA IPC; for any other device its reducer would pickle the storage as
CPU memory and fail. This module registers reducers that share acme memory the
way CUDA's is shared: the receiver maps the sender's device memory (no copy),
and the sender keeps it alive until the receiver lets go.
"""

import os
import threading
import warnings
from multiprocessing.reduction import DupFd, ForkingPickler

import torch
from torch.multiprocessing import reductions as torch_reductions

from . import DEVICE_NAME, _C

_torch_reduce_tensor = torch_reductions.reduce_tensor
_torch_reduce_storage = torch_reductions.reduce_storage


#> ch16 reduce
def reduce_tensor(tensor):
    if tensor.device.type != DEVICE_NAME:
        return _torch_reduce_tensor(tensor)
    try:
        return _reduce_acme_tensor(tensor)
    except Exception as error:
        if threading.current_thread().name != "QueueFeederThread":
            raise  # pickled by the caller (Pipe.send, spawn arguments): raise there
        # multiprocessing.Queue pickles in a background thread that only prints
        # an exception and drops the item: its consumer would wait forever.
        # Send the error instead, and say so here too.
        warnings.warn(f"{DEVICE_NAME}: a tensor put on a queue cannot be shared: {error}")
        return _raise, (type(error), str(error))


def _reduce_acme_tensor(tensor):
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError(
            f"{DEVICE_NAME}: cannot share a non-leaf tensor that requires grad: autograd does not "
            "cross processes. Send tensor.detach() instead.")
    if tensor.layout != torch.strided:
        raise RuntimeError(
            f"{DEVICE_NAME}: cannot share a {tensor.layout} tensor between processes")
    meta = (type(tensor), tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset(),
            tensor.dtype, tensor.requires_grad, tensor.device.index)
    if tensor.untyped_storage().nbytes() == 0:
        return _rebuild_empty, meta
    device, memory_fd, memory_size, offset, nbytes, counter_fd = _C._share(tensor)
    # DupFd duplicates each descriptor now; the receiver collects its copies.
    shared = (DupFd(memory_fd), memory_size, offset, nbytes, DupFd(counter_fd), os.getpid())
    return _rebuild_acme_tensor, meta + shared
#< ch16 reduce


#> ch16 rebuild
def _rebuild_acme_tensor(cls, size, stride, storage_offset, dtype, requires_grad, device,
                         memory, memory_size, offset, nbytes, counter, sender):
    try:
        memory_fd, counter_fd = memory.detach(), counter.detach()
    except OSError as error:
        raise RuntimeError(
            f"{DEVICE_NAME}: the process that sent this tensor (pid {sender}) exited before it "
            f"was received, so its memory cannot be opened. Keep a sending process alive until "
            f"its receivers have taken what it sent.") from error
    # One storage per sent storage, as CUDA's receiver keeps one (PyTorch's
    # shared_cache): a second send of the same memory (the tensor again, a view
    # of it) maps nothing new, and views of one storage stay views of one here.
    # The memory file's identity and the storage's place in it name it.
    found = os.fstat(memory_fd)
    key = (DEVICE_NAME, found.st_dev, found.st_ino, offset, nbytes)
    storage = torch_reductions.storage_from_cache(torch.UntypedStorage, key)
    if storage is not None:
        # The first send's lease keeps the memory; this one's is handed back.
        os.close(memory_fd)
        _C._release_lease(counter_fd)
    else:
        try:
            # counter_fd becomes the storage's: it holds the lease's lock, which
            # closing any descriptor of that file would drop.
            whole = _C._open_shared(device, memory_fd, memory_size, offset, nbytes, counter_fd,
                                    sender)
        finally:
            os.close(memory_fd)
        storage = whole.untyped_storage()
        torch_reductions.shared_cache[key] = torch_reductions.StorageWeakRef(storage)
    tensor = torch.empty(0, dtype=dtype, device=storage.device)
    tensor.set_(storage, storage_offset, size, stride)
    return _as(cls, tensor, requires_grad)


def _rebuild_empty(cls, size, stride, storage_offset, dtype, requires_grad, device):
    tensor = torch.empty_strided(size, stride, dtype=dtype, device=f"{DEVICE_NAME}:{device}")
    return _as(cls, tensor, requires_grad)


def _as(cls, tensor, requires_grad):
    if cls is torch.nn.Parameter:
        return torch.nn.Parameter(tensor, requires_grad)
    tensor.requires_grad_(requires_grad)
    return tensor


def _raise(kind, message):
    raise kind(message)
#< ch16 rebuild


#> ch16 storages
def reduce_storage(storage):
    if storage.device.type != DEVICE_NAME:
        return _torch_reduce_storage(storage)
    whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    return _storage_of, (reduce_tensor(whole),)


def _storage_of(reduced):
    rebuild, args = reduced
    return rebuild(*args).untyped_storage()
#< ch16 storages


#> ch16 register
# torch.multiprocessing registered its reducers when torch was imported; these
# take their place, and hand every other device's tensors back to them.
for _cls in [torch.Tensor, torch.nn.Parameter, *torch._tensor_classes]:
    ForkingPickler.register(_cls, reduce_tensor)
ForkingPickler.register(torch.UntypedStorage, reduce_storage)


def ipc_collect() -> int:
    """Release memory sent to other processes that they have all let go of
    (as torch.cuda.ipc_collect). Returns how many sent storages are still held."""
    return _C._ipc_collect()
#< ch16 register
