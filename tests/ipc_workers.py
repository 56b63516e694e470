"""Processes for tests/test_ipc.py. They are started with the "spawn" method,
which imports their functions by module name, so they live in a module."""

import torch
import torch_acme

DEVICE = torch_acme.DEVICE_NAME


def allocated() -> int:
    """Bytes of acme tensors alive on device 0 (the caching allocator's count)."""
    import gc

    gc.collect()
    return torch.acme.memory_allocated(0)


def opened() -> int:
    """Bytes of device memory this process holds from the runtime: with nothing
    allocated and the cache emptied, what is left was opened from other processes."""
    torch.acme.empty_cache()
    return torch_acme.runtime.memory_stats(0)["bytes_in_use"]


def send_and_forget(queue, received, refilled, report):
    """Sends tensors, drops every reference once they are received, collects, then
    reuses memory as hard as it can: the receiver must still see what was sent."""
    baseline = allocated()
    x = torch.arange(64.0, device=DEVICE).reshape(8, 8)
    queue.put(x)
    queue.put(x[2:5, 1:7])  # a view: the same storage, at an offset
    queue.put(torch.nn.Parameter(torch.full((3,), 2.5, device=DEVICE)))
    queue.put(torch.empty(0, 4, device=DEVICE))
    queue.put(torch.tensor([1, 2, 3], dtype=torch.int16, device=DEVICE))
    received.wait(60)
    del x
    held = torch_acme.multiprocessing.ipc_collect()
    # Fill the freed sizes again: a block given back too early would be reused here.
    fillers = [torch.full((8, 8), -1.0, device=DEVICE) for _ in range(8)]
    refilled.set()
    queue.get(timeout=60)  # the receiver is done
    still_held = torch_acme.multiprocessing.ipc_collect()
    del fillers
    report.put((held, still_held, allocated() - baseline))


def write_row(rank, shared):
    """mp.spawn's function: writes its rank into its row of a shared tensor."""
    shared[rank].fill_(rank + 1)


class AcmeDataset(torch.utils.data.Dataset):
    """Items made on acme in the worker that loads them."""

    def __len__(self):
        return 10

    def __getitem__(self, index):
        return torch.full((4,), float(index), device=DEVICE), index


def put_then_exit(queue):
    """Puts a tensor and exits at once, before anyone receives it."""
    queue.put(torch.ones(3, device=DEVICE))


def put_non_leaf(queue):
    """Puts a tensor autograd is tracking: it cannot cross processes."""
    leaf = torch.ones(3, device=DEVICE, requires_grad=True)
    queue.put(leaf * 2)


def receive_and_die(queue, got):
    """Receives a tensor and is killed while holding it: no chance to release."""
    import os
    import signal

    kept = queue.get(timeout=60)
    got.set()
    os.kill(os.getpid(), signal.SIGKILL)
    return kept


def hold_until(queue, report, release):
    """Receives a tensor, reports what it maps, and lets go when told to."""
    import gc

    held = queue.get(timeout=60)
    report.put(("received", opened(), held.sum().item()))
    release.wait(60)
    del held
    gc.collect()
    report.put(("released", opened(), None))


def return_and_exit(tensor, queue, received):
    """Shares a tensor it received back to its sender, then exits once it is taken."""
    queue.put(tensor)
    received.wait(60)


def receive_twice(queue, report):
    """Receives a tensor and then a view of it: one storage, mapped once."""
    whole = queue.get(timeout=60)
    after_one = opened()
    part = queue.get(timeout=60)
    after_two = opened()
    part.fill_(5.0)  # through the view: seen by the whole tensor and the sender
    same = whole.untyped_storage().data_ptr() == part.untyped_storage().data_ptr()
    report.put((same, after_one, after_two, whole.cpu().tolist()))
