"""Chapter 6 through PyTorch: two devices, the current stream, events, mixed devices.

The runtime's own streams and events are tested in tests/test_runtime.py; these
tests drive them the way a user does, through torch.Stream, torch.Event,
torch.accelerator and the device module, so they exercise the device guard.
"""

from __future__ import annotations

import importlib
import threading

import pytest
import torch

import torch_acme  # noqa: F401 - registers the backend
from conftest import dispatch_row, run_in_stage
from torch_acme import runtime

pytestmark = [
    pytest.mark.skipif(importlib.import_module("torch_acme._build_info").STAGE < 6,
                       reason="the device guard's streams and events arrive in chapter 6"),
    pytest.mark.filterwarnings("ignore:.*runs on the CPU:UserWarning"),
]

NAME = torch._C._get_privateuse1_backend_name()  # "privateuseone" until chapter 8
MS = 1000  # microseconds per millisecond, for sleep_kernel


def on(index: int) -> str:
    return f"{NAME}:{index}"


@pytest.fixture(autouse=True)
def idle_devices():
    """Each test starts and ends on device 0 with every stream of both devices idle."""
    yield
    for device in range(runtime.device_count()):
        torch.accelerator.synchronize(device)
    torch.accelerator.set_device_index(0)


# ---- copies between the devices ----

@pytest.mark.parametrize("source,target", [(0, 1), (1, 0)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "stepped slice"])
def test_copies_between_devices(source, target, layout):
    host = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = {"contiguous": lambda t: t, "transposed": lambda t: t.t(),
            "stepped slice": lambda t: t[:, ::2]}[layout]
    moved = view(host.to(on(source))).to(on(target))
    assert moved.device == torch.device(on(target))
    assert torch.equal(moved.cpu(), view(host))


@pytest.mark.parametrize("source,target", [(0, 1), (1, 0)])
def test_copy_into_a_strided_destination_on_the_other_device(source, target):
    host = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    destination = torch.empty(4, 3, device=on(target)).t()  # a transposed view
    destination.copy_(host.to(on(source)))
    assert destination.device.index == target and not destination.is_contiguous()
    assert torch.equal(destination.cpu(), host)


# ---- mixing devices in one op ----

def test_the_fallback_refuses_tensors_of_two_devices():
    # where.self goes through the CPU fallback: this is the fallback's own check.
    assert "cpu_fallback" in dispatch_row("aten::where.self"), "pick an op the fallback still serves"
    condition = torch.tensor([True, False], device=on(0))
    here, there = torch.ones(2, device=on(0)), torch.zeros(2, device=on(1))
    with pytest.raises(RuntimeError) as info:
        torch.where(condition, here, there)
    message = str(info.value)
    assert "Expected all tensors to be on the same device" in message
    assert on(0) in message and on(1) in message


def test_the_fallback_refuses_a_tensor_list_spanning_two_devices():
    with pytest.raises(RuntimeError) as info:
        torch.cat([torch.ones(2, device=on(0)), torch.ones(2, device=on(1))])
    message = str(info.value)
    assert "Expected all tensors to be on the same device" in message
    assert on(0) in message and on(1) in message
    assert "aten::cat" in message  # the fallback names the op it refused


@pytest.mark.parametrize("device", [0, 1])
def test_a_zero_dimensional_cpu_tensor_is_welcome_on_either_device(device):
    condition = torch.tensor([True, False], device=on(device))
    values = torch.tensor([1.0, 2.0], device=on(device))
    picked = torch.where(condition, values, torch.tensor(-1.0))  # a CPU scalar
    assert picked.device == torch.device(on(device))
    assert picked.cpu().tolist() == [1.0, -1.0]
    scaled = torch.mul(values, torch.tensor(2.0))
    assert scaled.device.index == device and scaled.cpu().tolist() == [2.0, 4.0]


# What torch.cuda does with a CPU tensor that has dimensions beside device
# tensors: refuses it, except as indices for advanced indexing.
MIXED_WITH_HOST = {
    "mm": lambda a, h: torch.mm(a, h),
    "cat": lambda a, h: torch.cat([a, h]),
    "where": lambda a, h: torch.where(a > 0, a, h),
    "add": lambda a, h: a + h,
    "dot": lambda a, h: torch.dot(a.flatten(), h.flatten()),
}


@pytest.mark.parametrize("name", MIXED_WITH_HOST)
def test_a_cpu_tensor_with_dimensions_beside_acme_inputs_is_refused(name):
    a = torch.ones(2, 2, device=on(0))
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        MIXED_WITH_HOST[name](a, torch.ones(2, 2))


def test_advanced_indexing_takes_cpu_indices_as_on_cuda():
    a = torch.arange(6.0, device=on(0))
    index = torch.tensor([4, 0])
    assert a[index].device == a.device and a[index].cpu().tolist() == [4.0, 0.0]
    a[index] = torch.tensor([-1.0, -2.0], device=on(0))
    assert a.cpu().tolist() == [-2.0, 1.0, 2.0, 3.0, -1.0, 5.0]


def test_the_stage_6_fallback_refuses_cpu_tensors_with_dimensions():
    # At stage 6 these ops all reach the fallback: its own check, no kernel's.
    code = """
import warnings, torch, torch_acme
warnings.simplefilter("ignore")
a, host = torch.ones(2, 2, device="privateuseone"), torch.ones(2, 2)
for name, call in [("mm", lambda: torch.mm(a, host)), ("cat", lambda: torch.cat([host, a])),
                   ("where", lambda: torch.where(a > 0, a, host))]:
    try:
        call()
        print(name, "computed")
    except RuntimeError as error:
        print(name, str(error).splitlines()[0])
print("index", a.flatten()[torch.tensor([3, 0])].cpu().tolist())
print("scalar", (a * torch.tensor(3.0)).device)
"""
    proc = run_in_stage(6, code)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name, argument in [("mm", "mat2"), ("cat", "tensors"), ("where", "other")]:
        line = next(line for line in lines if line.startswith(name + " "))
        assert "Expected all tensors to be on the same device" in line, line
        assert f"argument '{argument}'" in line and "checked by the privateuseone backend" in line
    assert "index [1.0, 1.0]" in lines and "scalar privateuseone:0" in lines


def test_a_device_index_beyond_the_count_is_refused_for_streams_and_events():
    count = runtime.device_count()
    expected = f"invalid device ordinal {count + 7}: there are {count} acme devices"
    with pytest.raises(RuntimeError, match=expected):
        torch.Stream(device=on(count + 7))
    with pytest.raises(RuntimeError, match=expected):
        torch.empty(1, device=on(count + 7))
    # torch.Event keeps only the device type of `device` (it takes its device
    # from its first record), so the guard sees the index when the event is
    # recorded: on a stream of that device, built from its parts since
    # torch.Stream(device=...) refuses it.
    beyond = torch.Stream(stream_id=0, device_index=count + 7,
                          device_type=torch.Stream(device=on(0)).device_type)
    event = torch.Event(device=on(count + 7))
    with pytest.raises(RuntimeError, match=expected):
        event.record(beyond)
    assert event.query()  # still never recorded: nothing to wait for


# ---- the current stream ----

def test_device_module_stream_helpers_agree_with_torch_accelerator():
    module = getattr(torch, NAME)
    side = torch.Stream(device=on(1))
    assert module.current_stream(1) == module.default_stream(1)
    assert module.default_stream(1).stream_id == 0
    module.set_stream(side)
    try:
        assert module.current_stream(1) == side == torch.accelerator.current_stream(1)
        assert module.current_stream(0) == torch.accelerator.current_stream(0)
        assert torch.accelerator.current_stream(0).stream_id == 0  # device 0 untouched
    finally:
        module.set_stream(module.default_stream(1))
    assert module.current_stream(1) == module.default_stream(1)


def test_with_stream_switches_stream_and_device_and_restores_both():
    side = torch.Stream(device=on(1))
    assert torch.accelerator.current_device_index() == 0
    with side:
        assert torch.accelerator.current_stream() == side
        assert torch.accelerator.current_device_index() == 1
    assert torch.accelerator.current_device_index() == 0
    assert torch.accelerator.current_stream(1).stream_id == 0


def test_the_current_stream_belongs_to_one_thread():
    side = torch.Stream(device=on(1))
    seen = []
    with side:
        worker = threading.Thread(target=lambda: seen.append(torch.accelerator.current_stream(1)))
        worker.start()
        worker.join()
        assert torch.accelerator.current_stream(1) == side
    assert len(seen) == 1 and seen[0].stream_id == 0


def test_new_streams_come_from_a_pool_of_eight_per_device():
    ids = [torch.Stream(device=on(1)).stream_id for _ in range(16)]
    assert 0 not in ids and len(set(ids)) == 8
    assert ids[:8] == ids[8:]  # handed out in turn
    assert all(runtime.stream_device(i) == 1 for i in ids)


def test_the_device_module_synchronize_waits_for_every_stream_of_the_device():
    module = getattr(torch, NAME)
    side = torch.Stream(device=on(1))  # not device 1's current stream
    assert torch.accelerator.current_stream(1) != side
    end = torch.Event(device=on(1))
    runtime.sleep_kernel(side.native_handle, 200 * MS)
    end.record(side)
    assert not side.query() and not end.query()  # busy for 200 ms
    module.synchronize(1)
    assert side.query() and end.query()
    assert torch.accelerator.current_device_index() == 0  # and the current device is untouched


# ---- events ----

def test_elapsed_time_needs_both_events_completed():
    side = torch.Stream(device=on(1))
    start = torch.Event(device=on(1), enable_timing=True)
    end = torch.Event(device=on(1), enable_timing=True)
    start.record(side)
    runtime.sleep_kernel(side.native_handle, 250 * MS)
    end.record(side)
    with pytest.raises(RuntimeError, match="must be completed"):
        start.elapsed_time(end)
    end.synchronize()
    assert start.elapsed_time(end) >= 200


def test_an_event_belongs_to_the_device_of_its_first_record():
    # Created lazily, on the first record: from then on it is that device's event.
    event = torch.Event(device=on(1))
    event.record(torch.Stream(device=on(1)))
    with pytest.raises(RuntimeError,
                       match="an event of device 1 cannot be recorded on a stream of device 0"):
        event.record(torch.Stream(device=on(0)))
    event.synchronize()
    assert event.query()


def test_a_forked_child_is_refused_the_parents_streams_at_stage_6():
    # Chapter 11 tracks fork() for the whole runtime; from chapter 6 to 10 the
    # streams' worker threads, which a child does not inherit, would make the
    # child wait forever. The runtime refuses instead.
    code = """
import os, torch, torch_acme
from torch_acme import runtime
side = torch.Stream(device="privateuseone:0")
runtime.sleep_kernel(side.native_handle, 1000)
side.synchronize()
pid = os.fork()
if pid == 0:
    try:
        runtime.sleep_kernel(side.native_handle, 1000)
        side.synchronize()
        os._exit(3)
    except Exception as error:
        os.write(1, f"{type(error).__name__}: {error}\\n".encode())
        os._exit(0)
print("child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
side.synchronize()  # the parent's streams still work
print("parent fine")
"""
    proc = run_in_stage(6, code)
    assert proc.returncode == 0, proc.stderr
    assert "acmeErrorForkedChild" in proc.stdout, proc.stdout
    assert "this process is a child of fork()" in proc.stdout
    assert "child exit 0" in proc.stdout and "parent fine" in proc.stdout
