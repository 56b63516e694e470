"""Chapter 16: acme tensors between processes, through torch.multiprocessing.

The receiver maps the sender's device memory (writes are seen by both); the
sender keeps a block it sent until the receiver lets go; what cannot be sent
fails with a Python exception in the process that can act on it, never a hang;
and neither process leaks: the receiver closes what it opened, the sender gets
its memory back from ipc_collect().
"""

from __future__ import annotations

import gc
import os
import queue as queue_module
import time
import warnings

import pytest
import torch
import torch.multiprocessing as mp

import ipc_workers
import torch_acme
from torch_acme import _build_info

if _build_info.STAGE < 16:
    pytest.skip(f"the stage under test ({_build_info.STAGE}) predates chapter 16",
                allow_module_level=True)

DEVICE = torch_acme.DEVICE_NAME
spawn = mp.get_context("spawn")


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def test_queue_carries_tensors_the_sender_no_longer_holds():
    q, received, refilled, report = spawn.Queue(), spawn.Event(), spawn.Event(), spawn.Queue()
    sender = spawn.Process(target=ipc_workers.send_and_forget,
                           args=(q, received, refilled, report))
    sender.start()
    try:
        whole, view, param, empty, ints = (q.get(timeout=60) for _ in range(5))
        received.set()
        assert refilled.wait(60)  # the sender dropped them, collected, allocated again
        expected = torch.arange(64.0).reshape(8, 8)
        assert whole.device.type == DEVICE and torch.equal(whole.cpu(), expected)
        assert torch.equal(view.cpu(), expected[2:5, 1:7])
        assert type(param) is torch.nn.Parameter and param.requires_grad
        assert torch.equal(param.detach().cpu(), torch.full((3,), 2.5))
        assert empty.shape == (0, 4) and empty.device.type == DEVICE
        assert ints.dtype == torch.int16 and ints.cpu().tolist() == [1, 2, 3]
        assert torch_acme._C._storage_info(whole)["shared_by_pid"] == sender.pid
        assert ipc_workers.opened() > 0
        del whole, view, param, empty, ints
        gc.collect()
        assert ipc_workers.opened() == 0  # every mapping of the sender's memory closed
        q.put("done")
        held, still_held, leaked = report.get(timeout=60)
    finally:
        received.set()
        sender.join(60)
    assert sender.exitcode == 0
    assert held > 0  # while received tensors lived, the sender kept their storages
    assert still_held == 0 and leaked == 0  # then it got all of its memory back


def test_receiver_writes_are_seen_by_the_sender():
    parent_end, child_end = spawn.Pipe()
    shared = torch.zeros(2, 3, device=DEVICE)
    workers = mp.spawn(ipc_workers.write_row, args=(shared,), nprocs=2, join=True)
    assert workers is None
    # mp.spawn pickles its arguments once per child: both wrote into this memory.
    assert shared.cpu().tolist() == [[1.0] * 3, [2.0] * 3]
    parent_end.close(), child_end.close()
    assert torch_acme.multiprocessing.ipc_collect() == 0


def test_dataloader_workers_return_acme_tensors():
    before = ipc_workers.allocated()
    loader = torch.utils.data.DataLoader(ipc_workers.AcmeDataset(), batch_size=4, num_workers=2,
                                         multiprocessing_context="spawn")
    batches = list(loader)
    values = torch.cat([b[0].cpu() for b in batches])
    indices = torch.cat([b[1] for b in batches])
    assert all(b[0].device.type == DEVICE for b in batches)
    assert torch.equal(values, indices.float()[:, None].expand(-1, 4))
    assert indices.tolist() == list(range(10))
    del batches, loader
    gc.collect()
    assert ipc_workers.opened() == 0 and ipc_workers.allocated() == before


def test_a_tensor_autograd_tracks_fails_where_it_is_sent():
    parent_end, child_end = spawn.Pipe()
    leaf = torch.ones(3, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match="cannot share a non-leaf tensor that requires grad"):
        parent_end.send(leaf * 2)  # pickled here, in the sender: raises here
    parent_end.close(), child_end.close()


def test_a_queue_delivers_the_error_instead_of_hanging():
    q = spawn.Queue()
    sender = spawn.Process(target=ipc_workers.put_non_leaf, args=(q,))
    sender.start()
    try:
        with pytest.raises(RuntimeError, match="cannot share a non-leaf tensor"):
            q.get(timeout=60)  # pickled in the sender's feeder thread
    finally:
        sender.join(60)
    assert sender.exitcode == 0


def test_receiving_after_the_sender_exited_raises():
    q = spawn.Queue()
    sender = spawn.Process(target=ipc_workers.put_then_exit, args=(q,))
    sender.start()
    sender.join(60)
    assert sender.exitcode == 0
    with pytest.raises(RuntimeError, match=rf"the process that sent this tensor \(pid {sender.pid}\) "
                                           r"exited before it was received"):
        q.get(timeout=60)
    assert ipc_workers.opened() == 0


def test_a_received_tensor_outlives_its_sender():
    q, received = spawn.Queue(), spawn.Event()
    # The child gets a tensor as its argument, puts it back (sharing it again,
    # now as its sender) and exits once this process has received it.
    t = torch.arange(5.0, device=DEVICE)
    sender = spawn.Process(target=ipc_workers.return_and_exit, args=(t, q, received))
    sender.start()
    back = q.get(timeout=60)
    received.set()
    sender.join(60)
    assert sender.exitcode == 0
    assert torch_acme._C._storage_info(back)["shared_by_pid"] == sender.pid
    # The memory stays mapped here after the sender is gone, and still works.
    assert torch.equal((back * 2).cpu(), torch.arange(5.0) * 2)
    del back, t
    gc.collect()
    assert torch_acme.multiprocessing.ipc_collect() == 0
    assert ipc_workers.opened() == 0


def test_a_receiver_killed_while_holding_memory_gives_it_back():
    before = ipc_workers.allocated()
    q, got = spawn.Queue(), spawn.Event()
    receiver = spawn.Process(target=ipc_workers.receive_and_die, args=(q, got))
    receiver.start()
    q.put(torch.ones(1000, device=DEVICE))  # sent from this process, then dropped here
    assert got.wait(60)
    receiver.join(60)
    assert receiver.exitcode == -9
    assert torch_acme.multiprocessing.ipc_collect() == 0  # the kernel dropped its lock
    assert ipc_workers.allocated() == before


def test_two_sends_of_one_storage_arrive_as_one_storage_mapped_once():
    # As CUDA's receiver does (PyTorch's shared_cache): without it the view
    # arrived as a second storage over a second mapping, aliasing lost.
    q, report = spawn.Queue(), spawn.Queue()
    receiver = spawn.Process(target=ipc_workers.receive_twice, args=(q, report))
    receiver.start()
    t = torch.ones(1024, device=DEVICE)
    q.put(t)
    q.put(t[1:])
    same, after_one, after_two, seen = report.get(timeout=120)
    receiver.join(60)
    assert receiver.exitcode == 0
    assert same and after_one > 0 and after_two == after_one, (same, after_one, after_two)
    assert seen == [1.0] + [5.0] * 1023 and t.cpu().tolist() == seen
    for _ in range(100):  # both leases are let go once the receiver has exited
        if torch_acme.multiprocessing.ipc_collect() == 0:
            break
        time.sleep(0.1)
    assert torch_acme.multiprocessing.ipc_collect() == 0


def test_a_storage_made_directly_lands_on_the_device_it_names():
    # torch.UntypedStorage(n, device=...) reaches acme's storage creation with
    # PyTorch's device guard set (review 16.7 guessed it might not).
    storage = torch.UntypedStorage(8, device=f"{DEVICE}:1")
    assert storage.device == torch.device(DEVICE, 1)
    assert torch.empty(0, device=f"{DEVICE}:1").set_(storage).device.index == 1
    assert torch.accelerator.current_device_index() == 0


def test_storage_info_counts_sends():
    t = torch.ones(4, device=DEVICE)
    info = torch_acme._C._storage_info(t)
    assert info == {"times_shared": 0, "shared_by_pid": 0}
    parent_end, child_end = spawn.Pipe()
    parent_end.send(t)
    received = child_end.recv()  # opened in this same process: a second mapping
    assert torch_acme._C._storage_info(t)["times_shared"] == 1
    assert torch_acme._C._storage_info(received)["shared_by_pid"] == os.getpid()
    received.fill_(7)
    assert t.cpu().tolist() == [7.0] * 4  # one memory, two mappings
    del received
    gc.collect()
    assert torch_acme.multiprocessing.ipc_collect() == 0
    parent_end.close(), child_end.close()


def test_tensor_metadata_round_trips_and_survives_a_checkpoint(tmp_path):
    t = torch.ones(3, device=DEVICE)
    torch._C._set_tensor_metadata(t, {"version_number": True, "format_number": False})
    assert torch._C._get_tensor_metadata(t) == {"version_number": True, "format_number": False}
    torch.ops.acme.set_backend_meta(t, 5)  # chapter 7's tag keeps the flags
    torch.save({"t": t}, tmp_path / "ckpt.pt")
    back = torch.load(tmp_path / "ckpt.pt")["t"]
    meta = torch._C._get_tensor_metadata(back)
    assert meta["version_number"] is True and meta["format_number"] is False
    assert torch.ops.acme.get_backend_meta(back) == 5
    on_cpu = torch.load(tmp_path / "ckpt.pt", map_location="cpu")["t"]
    assert torch._C._get_tensor_metadata(on_cpu) == {}
