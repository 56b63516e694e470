"""Chapter 0: the acme vendor runtime, driven from Python through torch_acme._C.runtime.

The pytest process runs with the default configuration (2 devices, 16 GiB,
checked mode); anything that needs another environment runs in a subprocess.
"""

from __future__ import annotations

import array
import ctypes
import json
import os
import signal
import subprocess
import textwrap
import threading

import pytest

import torch_acme
from torch_acme import runtime

from tools import preforked
AcmeError, MemcpyKind = runtime.AcmeError, runtime.MemcpyKind

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def stats():
    return [runtime.memory_stats(d) for d in range(runtime.device_count())]


def in_use():
    return [(s["bytes_in_use"], s["blocks_in_use"]) for s in stats()]


@pytest.fixture(autouse=True)
def leak_check():
    """Every test must free what it allocates (relative: others may hold memory)."""
    before = in_use()
    yield
    assert in_use() == before


@pytest.fixture
def alloc():
    """malloc that frees at the end of the test."""
    ptrs = []

    def allocate(nbytes, device=None):
        if device is not None:
            previous = runtime.current_device()
            runtime.set_device(device)
        try:
            ptr = runtime.malloc(nbytes)
        finally:
            if device is not None:
                runtime.set_device(previous)
        ptrs.append(ptr)
        return ptr

    yield allocate
    for ptr in ptrs:
        runtime.free(ptr)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Runs `code` in a new process with the ACME_* variables given (others removed)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ACME_")}
    # Wherever this process found torch_acme, the child finds it too.
    package_root = os.path.dirname(os.path.dirname(torch_acme.__file__))
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in [package_root, os.environ.get("PYTHONPATH", "")] if p)
    full_env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    full_env.update(env)
    return preforked.python(["-c", textwrap.dedent(code)], full_env, timeout=120)


def run_json(code: str, **env: str):
    """Runs `code`, which prints one JSON document last, and returns it."""
    result = run_python(code, **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---- devices and configuration ----

def test_device_count_default():
    out = run_json("""
        import json
        from torch_acme import runtime
        print(json.dumps([runtime.device_count(), runtime.mem_get_info(), runtime.checked_mode()]))
    """)
    assert out == [2, [16 * GiB, 16 * GiB], True]


def test_device_count_from_env():
    out = run_json("""
        import json
        from torch_acme import runtime
        runtime.set_device(2)
        try:
            runtime.set_device(3)
        except runtime.AcmeError as e:
            error = str(e)
        print(json.dumps([runtime.device_count(), runtime.current_device(), error]))
    """, ACME_DEVICE_COUNT="3")
    assert out[:2] == [3, 2]
    assert "invalid device ordinal 3: there are 3 acme devices" in out[2]


@pytest.mark.parametrize("variable,value", [
    ("ACME_DEVICE_COUNT", "-1"),
    ("ACME_DEVICE_COUNT", "17"),
    ("ACME_DEVICE_COUNT", "two"),
    ("ACME_DEVICE_COUNT", "2x"),
    ("ACME_DEVICE_COUNT", ""),
    ("ACME_DEVICE_MEMORY", "64Q"),
    ("ACME_DEVICE_MEMORY", "0"),
    ("ACME_CHECKED", "maybe"),
])
def test_invalid_configuration(variable, value):
    out = run_json("""
        import json
        from torch_acme import runtime
        errors = []
        for call in [runtime.device_count, lambda: runtime.malloc(16), runtime.synchronize,
                     lambda: runtime.memory_stats(0)]:
            try:
                call()
                errors.append(None)
            except runtime.AcmeError as e:
                errors.append([e.code, e.name, str(e)])
        print(json.dumps(errors))
    """, **{variable: value})
    # Every call fails the same way, and says which variable is wrong and why.
    assert all(e == out[0] for e in out), out
    code, name, text = out[0]
    assert code == 6 and name == "acmeErrorInitialization"
    assert text.startswith("acmeErrorInitialization: ")
    assert f'{variable}="{value}" is invalid' in text


def test_device_memory_suffixes():
    out = run_json("""
        import json
        from torch_acme import runtime
        print(json.dumps(runtime.mem_get_info()))
    """, ACME_DEVICE_MEMORY="3K")
    assert out == [3 * KiB, 3 * KiB]


def test_set_and_get_device_is_per_thread():
    assert runtime.current_device() == 0
    runtime.set_device(1)
    try:
        assert runtime.current_device() == 1
        seen = []
        thread = threading.Thread(target=lambda: seen.append(runtime.current_device()))
        thread.start()
        thread.join()
        assert seen == [0]
    finally:
        runtime.set_device(0)


@pytest.mark.parametrize("ordinal", [5, 2, -1])
def test_invalid_device_ordinal(ordinal):
    with pytest.raises(AcmeError) as info:
        runtime.set_device(ordinal)
    assert isinstance(info.value, RuntimeError)
    assert info.value.code == 1
    assert info.value.name == "acmeErrorInvalidDevice"
    assert str(info.value) == (
        f"acmeErrorInvalidDevice: invalid device ordinal {ordinal}: there are 2 acme devices")
    assert runtime.current_device() == 0
    with pytest.raises(AcmeError, match=f"invalid device ordinal {ordinal}"):
        runtime.memory_stats(ordinal)


def test_synchronize():
    runtime.synchronize()


# ---- copies ----

PAYLOAD = bytes(range(256)) * 3 + b"tail"


@pytest.mark.parametrize("make", [bytes, bytearray, lambda b: memoryview(b),
                                  lambda b: array.array("B", b)])
def test_round_trip_through_device(alloc, make):
    ptr = alloc(len(PAYLOAD))
    runtime.copy_to_device(ptr, make(PAYLOAD))
    assert runtime.copy_to_host(ptr, len(PAYLOAD)) == PAYLOAD
    # Interior pointers work on both sides.
    assert runtime.copy_to_host(ptr + 10, 5) == PAYLOAD[10:15]


def test_copy_to_device_rejects_non_contiguous_buffer(alloc):
    ptr = alloc(16)
    with pytest.raises(BufferError):
        runtime.copy_to_device(ptr, memoryview(bytes(32))[::2])


def test_raw_memcpy_all_directions(alloc):
    n = len(PAYLOAD)
    source = ctypes.create_string_buffer(PAYLOAD, n)
    back = ctypes.create_string_buffer(n)
    host_copy = ctypes.create_string_buffer(n)
    a, b = alloc(n), alloc(n)
    runtime.memcpy(a, ctypes.addressof(source), n, MemcpyKind.HostToDevice)
    runtime.memcpy(b, a, n, MemcpyKind.DeviceToDevice)
    runtime.memcpy(ctypes.addressof(back), b, n, MemcpyKind.DeviceToHost)
    runtime.memcpy(ctypes.addressof(host_copy), ctypes.addressof(back), n, MemcpyKind.HostToHost)
    assert back.raw == PAYLOAD
    assert host_copy.raw == PAYLOAD


def test_device_to_device_across_devices(alloc):
    on0, on1 = alloc(1000, device=0), alloc(1000, device=1)
    assert runtime.pointer_attributes(on0)["device"] == 0
    assert runtime.pointer_attributes(on1)["device"] == 1
    data = os.urandom(1000)
    runtime.copy_to_device(on0, data)
    runtime.copy_device_to_device(on1, on0, 1000)
    assert runtime.copy_to_host(on1, 1000) == data


def test_overlapping_copy_within_one_allocation(alloc):
    ptr = alloc(10)
    runtime.copy_to_device(ptr, b"0123456789")
    runtime.copy_device_to_device(ptr + 2, ptr, 6)
    assert runtime.copy_to_host(ptr, 10) == b"0101234589"


def test_memset(alloc):
    ptr = alloc(100)
    runtime.memset(ptr, 0xAB, 100)
    runtime.memset(ptr + 10, 0x100 + 7, 5)  # like C memset: only the low byte counts
    assert runtime.copy_to_host(ptr, 100) == b"\xab" * 10 + b"\x07" * 5 + b"\xab" * 85
    with pytest.raises(AcmeError, match=r"memset of 8 bytes at 0x[0-9a-f]+ overruns .* by 4 bytes"):
        runtime.memset(ptr + 96, 0, 8)


def test_zero_sizes_are_no_ops():
    assert runtime.malloc(0) == 0
    runtime.free(0)
    runtime.copy_to_device(0, b"")
    assert runtime.copy_to_host(0, 0) == b""
    runtime.memset(0, 1, 0)
    runtime.memcpy(0, 0, 0, MemcpyKind.HostToDevice)


def test_copy_overrunning_an_allocation(alloc):
    ptr = alloc(48)
    with pytest.raises(AcmeError) as info:
        runtime.copy_to_device(ptr, bytes(64))
    assert info.value.name == "acmeErrorInvalidDevicePointer"
    assert str(info.value) == (
        f"acmeErrorInvalidDevicePointer: copy of 64 bytes to {hex(ptr)} overruns the device "
        f"allocation at {hex(ptr)} (48 bytes, device 0) by 16 bytes")
    with pytest.raises(AcmeError, match=f"copy of 8 bytes from {hex(ptr + 44)} overruns"):
        runtime.copy_to_host(ptr + 44, 8)
    # Nothing was written by the failed copy.
    runtime.memset(ptr, 0, 48)
    assert runtime.copy_to_host(ptr, 48) == bytes(48)


def test_copy_between_mismatched_sizes(alloc):
    big, small = alloc(64), alloc(48, device=1)
    with pytest.raises(AcmeError) as info:
        runtime.copy_device_to_device(small, big, 64)
    text = str(info.value)
    assert f"copy of 64 bytes to {hex(small)} overruns" in text
    assert "(48 bytes, device 1)" in text
    with pytest.raises(AcmeError, match=rf"copy of 64 bytes from {hex(small)} overruns .*\(48 bytes"):
        runtime.copy_device_to_device(big, small, 64)


def test_device_side_must_be_a_device_pointer(alloc):
    host = ctypes.create_string_buffer(16)
    ptr = alloc(16)
    with pytest.raises(AcmeError, match=f"copy of 16 bytes from {hex(ctypes.addressof(host))}: "
                                        "not a device pointer"):
        runtime.memcpy(ptr, ctypes.addressof(host), 16, MemcpyKind.DeviceToDevice)


def test_host_to_host_memcpy_on_a_device_pointer(alloc):
    ptr = alloc(32)
    host = ctypes.create_string_buffer(16)
    with pytest.raises(AcmeError) as info:
        runtime.memcpy(ctypes.addressof(host), ptr + 8, 16, MemcpyKind.HostToHost)
    assert info.value.code == 5
    assert str(info.value) == (
        f"acmeErrorHostAccessToDevice: host access to device memory: {hex(ptr + 8)} lies in the "
        f"allocation at {hex(ptr)} (32 bytes, device 0); copy it with acmeMemcpyDeviceToHost")
    # Writing through a device pointer as if it were host memory is caught too.
    with pytest.raises(AcmeError, match="host access to device memory: .*acmeMemcpyHostToDevice"):
        runtime.memcpy(ptr, ctypes.addressof(host), 16, MemcpyKind.HostToHost)
    # And so is a "host" destination of a device-to-host copy.
    with pytest.raises(AcmeError, match="host access to device memory"):
        runtime.memcpy(ptr, ptr + 16, 16, MemcpyKind.DeviceToHost)


# ---- allocation ----

def test_free_of_unknown_pointer_and_double_free():
    host = ctypes.create_string_buffer(16)
    with pytest.raises(AcmeError, match=f"acmeFree\\({hex(ctypes.addressof(host))}\\): not a "
                                        "device pointer") as info:
        runtime.free(ctypes.addressof(host))
    assert info.value.name == "acmeErrorInvalidDevicePointer"
    ptr = runtime.malloc(100)
    with pytest.raises(AcmeError, match=f"lies inside the allocation at {hex(ptr)} \\(100 bytes"):
        runtime.free(ptr + 8)
    runtime.free(ptr)
    with pytest.raises(AcmeError, match=f"acmeFree\\({hex(ptr)}\\): double free") as info:
        runtime.free(ptr)
    assert info.value.code == 4


def test_pointer_attributes(alloc):
    ptr = alloc(100, device=1)
    assert runtime.pointer_attributes(ptr + 99) == {
        "device": 1, "is_device": True, "base": ptr, "size": 100}
    host = ctypes.create_string_buffer(8)
    expected_host = {"device": -1, "is_device": False, "base": 0, "size": 0}
    assert runtime.pointer_attributes(ctypes.addressof(host)) == expected_host
    assert runtime.pointer_attributes(0) == expected_host


def test_stats_count_requested_bytes_and_return_to_zero():
    out = run_json("""
        import json
        from torch_acme import runtime
        steps = []
        a = runtime.malloc(1000)
        b = runtime.malloc(24)
        runtime.set_device(1)
        c = runtime.malloc(5)
        steps.append([runtime.memory_stats(0), runtime.memory_stats(1), runtime.mem_get_info()])
        for p in (a, b, c):
            runtime.free(p)
        steps.append([runtime.memory_stats(0), runtime.memory_stats(1)])
        print(json.dumps(steps))
    """)
    assert out[0] == [
        {"bytes_in_use": 1024, "blocks_in_use": 2, "peak_bytes": 1024},
        {"bytes_in_use": 5, "blocks_in_use": 1, "peak_bytes": 5},
        [16 * GiB - 5, 16 * GiB],
    ]
    assert out[1] == [
        {"bytes_in_use": 0, "blocks_in_use": 0, "peak_bytes": 1024},
        {"bytes_in_use": 0, "blocks_in_use": 0, "peak_bytes": 5},
    ]


def test_mem_get_info_tracks_allocations(alloc):
    free_before, total = runtime.mem_get_info()
    assert total == 16 * GiB
    alloc(3 * MiB)
    assert runtime.mem_get_info() == (free_before - 3 * MiB, total)


def test_out_of_memory():
    out = run_json("""
        import json
        from torch_acme import runtime
        first = runtime.malloc(512 * 1024)
        try:
            runtime.malloc(768 * 1024)
        except runtime.AcmeError as e:
            error = [e.name, str(e)]
        info_full = runtime.mem_get_info()
        runtime.set_device(1)
        other = runtime.malloc(768 * 1024)   # capacity is per device
        runtime.free(other)
        runtime.set_device(0)
        runtime.free(first)
        print(json.dumps([error, info_full, runtime.mem_get_info(), runtime.memory_stats(0)]))
    """, ACME_DEVICE_MEMORY="1M")
    error, info_full, info_empty, stats0 = out
    assert error == ["acmeErrorMemoryAllocation",
                     "acmeErrorMemoryAllocation: out of memory on device 0: tried to allocate "
                     "768 KiB; 512 KiB of 1.00 MiB in use"]
    assert info_full == [512 * KiB, MiB]
    assert info_empty == [MiB, MiB]
    assert stats0 == {"bytes_in_use": 0, "blocks_in_use": 0, "peak_bytes": 512 * KiB}


def test_huge_allocation_fails_cleanly():
    with pytest.raises(AcmeError, match=r"out of memory on device 0: tried to allocate 1.00 TiB; "
                                        r".* of 16.0 GiB in use"):
        runtime.malloc(1 << 40)


# ---- checked mode: the host must not touch device memory ----

DEREFERENCE = """
    import ctypes
    from torch_acme import runtime
    ptr = runtime.malloc(48)
    runtime.copy_to_device(ptr, bytes(range(48)))
    print(runtime.checked_mode(), hex(ptr), flush=True)
    print(ctypes.string_at(ptr + 16, 4).hex(), flush=True)   # the host reads device memory
"""


def test_host_dereference_of_device_pointer_faults_with_a_report():
    result = run_python(DEREFERENCE)
    assert result.returncode == -signal.SIGSEGV, result
    checked, ptr = result.stdout.split()[:2]
    assert checked == "True"
    assert (f"acme: the host touched device memory at {hex(int(ptr, 16) + 16)}: it lies in the "
            f"allocation at {ptr} (48 bytes, device 0)") in result.stderr
    assert "must be copied to the host" in result.stderr


def test_host_dereference_works_when_unchecked():
    result = run_python(DEREFERENCE, ACME_CHECKED="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", result.stdout.split()[1], "10111213"]
    assert "touched device memory" not in result.stderr


def test_unrelated_segfault_is_left_to_the_previous_handler():
    result = run_python("""
        import ctypes
        from torch_acme import runtime
        runtime.free(runtime.malloc(16))   # installs the handler
        ctypes.string_at(8, 1)             # a fault that is not about acme memory
    """)
    assert result.returncode == -signal.SIGSEGV, result
    assert "touched device memory" not in result.stderr


def test_unchecked_mode_still_validates_copies():
    out = run_json("""
        import json
        from torch_acme import runtime
        ptr = runtime.malloc(48)
        try:
            runtime.copy_to_device(ptr, bytes(64))
        except runtime.AcmeError as e:
            error = e.name
        runtime.free(ptr)
        print(json.dumps([runtime.checked_mode(), error, ptr % 64]))
    """, ACME_CHECKED="0")
    assert out == [False, "acmeErrorInvalidDevicePointer", 0]


# ---- threads ----

def test_threads_allocate_copy_and_free_concurrently():
    errors = []

    def worker(index):
        try:
            runtime.set_device(index % 2)
            for i in range(2000):
                data = bytes([index, i % 256]) * (1 + (i * 37 + index) % 700)
                ptr = runtime.malloc(len(data))
                runtime.copy_to_device(ptr, data)
                assert runtime.pointer_attributes(ptr)["device"] == index % 2
                assert runtime.copy_to_host(ptr, len(data)) == data
                runtime.free(ptr)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    before = stats()
    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    after = stats()
    for b, a in zip(before, after):
        assert (a["bytes_in_use"], a["blocks_in_use"]) == (b["bytes_in_use"], b["blocks_in_use"])
        assert a["peak_bytes"] > 0


# ---- streams and events (chapter 6) ----

needs_streams = pytest.mark.skipif(not hasattr(runtime, "stream_create"),
                                   reason="streams and events arrive in chapter 6")
MS = 1000  # microseconds per millisecond, for sleep_kernel


@pytest.fixture
def handles():
    """Streams and events that are destroyed at the end of the test."""
    streams, events = [], []

    class Make:
        @staticmethod
        def stream(device=0):
            streams.append(runtime.stream_create(device))
            return streams[-1]

        @staticmethod
        def event(device=0, timing=False):
            events.append(runtime.event_create(device, timing))
            return events[-1]

    yield Make
    for stream in streams:
        runtime.stream_synchronize(stream)
        runtime.stream_destroy(stream)
    for event in events:
        runtime.event_destroy(event)


@needs_streams
def test_default_streams_one_per_device():
    d0, d1 = runtime.default_stream(0), runtime.default_stream(1)
    assert d0 != d1 and d0 == runtime.default_stream(0)
    assert [runtime.stream_device(d0), runtime.stream_device(d1)] == [0, 1]
    with pytest.raises(AcmeError) as info:
        runtime.stream_destroy(d1)
    assert info.value.name == "acmeErrorInvalidValue"
    assert (f"stream {d1} is the default stream of device 1, which cannot be destroyed"
            in str(info.value))
    with pytest.raises(AcmeError, match="invalid device ordinal 2: there are 2 acme devices"):
        runtime.default_stream(2)
    with pytest.raises(AcmeError, match="invalid device ordinal 5"):
        runtime.stream_create(5)


@needs_streams
def test_stream_work_is_asynchronous_and_in_order(handles, alloc):
    stream = handles.stream(device=1)
    ptr = alloc(4096, device=1)
    # Pinned: a copy into pageable memory waits for the stream (chapter 18).
    back = runtime.host_alloc(4096)
    try:
        runtime.sleep_kernel(stream, 200 * MS)
        runtime.memset_async(ptr, 0x11, 4096, stream)
        runtime.memset_async(ptr + 8, 0x22, 8, stream)  # runs after the first memset
        runtime.memcpy_async(back, ptr, 4096, MemcpyKind.DeviceToHost, stream)
        assert runtime.stream_query(stream) is False  # the host did not wait
        runtime.stream_synchronize(stream)
        assert runtime.stream_query(stream) is True
        assert ctypes.string_at(back, 4096) == b"\x11" * 8 + b"\x22" * 8 + b"\x11" * 4080
    finally:
        runtime.host_free(back)


@needs_streams
def test_async_work_is_validated_when_queued(handles, alloc):
    stream = handles.stream()
    ptr = alloc(48)
    with pytest.raises(AcmeError, match=f"copy of 64 bytes to {hex(ptr)} overruns"):
        runtime.memcpy_async(ptr, ctypes.addressof(ctypes.create_string_buffer(64)), 64,
                             MemcpyKind.HostToDevice, stream)
    with pytest.raises(AcmeError, match=f"memset of 8 bytes at {hex(ptr + 44)} overruns"):
        runtime.memset_async(ptr + 44, 0, 8, stream)
    assert runtime.stream_query(stream) is True  # nothing was queued


@needs_streams
def test_freed_memory_outlives_queued_work(handles):
    stream = handles.stream()
    before = in_use()
    ptr = runtime.malloc(1 << 20)
    runtime.sleep_kernel(stream, 100 * MS)
    runtime.memset_async(ptr, 7, 1 << 20, stream)
    runtime.free(ptr)  # the memset still runs on memory kept mapped for it
    assert in_use() == before  # the allocation is gone for the user at once
    runtime.stream_synchronize(stream)


@needs_streams
def test_timing_events_measure_the_work_between_them(handles):
    stream = handles.stream()
    start, end = handles.event(timing=True), handles.event(timing=True)
    runtime.event_record(start, stream)
    runtime.sleep_kernel(stream, 250 * MS)
    runtime.event_record(end, stream)
    runtime.event_synchronize(start)  # done before the sleep began
    assert runtime.event_query(end) is False
    with pytest.raises(AcmeError) as info:
        runtime.event_elapsed_time(start, end)
    assert info.value.name == "acmeErrorNotReady" and info.value.code == 9
    assert f"the latest record of event {end} has not completed yet" in str(info.value)
    runtime.event_synchronize(end)
    assert runtime.event_query(end) is True
    elapsed = runtime.event_elapsed_time(start, end)
    assert 250 <= elapsed < 250 + 1000, elapsed
    assert runtime.event_elapsed_time(end, start) == -elapsed


@needs_streams
def test_event_errors(handles):
    plain = handles.event()
    timed, unrecorded = handles.event(timing=True), handles.event(timing=True)
    runtime.event_record(plain)
    runtime.event_record(timed)
    runtime.event_synchronize(plain)
    runtime.event_synchronize(timed)
    with pytest.raises(AcmeError, match=f"event {plain} was created without acmeEventTiming"):
        runtime.event_elapsed_time(plain, timed)
    with pytest.raises(AcmeError, match=f"event {unrecorded} was never recorded"):
        runtime.event_elapsed_time(timed, unrecorded)
    # A never-recorded event counts as complete, and waiting for it is a no-op.
    assert runtime.event_query(unrecorded) is True
    runtime.event_synchronize(unrecorded)
    on1 = handles.stream(device=1)
    with pytest.raises(AcmeError) as info:
        runtime.event_record(timed, on1)
    assert info.value.name == "acmeErrorDeviceMismatch" and info.value.code == 8
    assert str(info.value) == (
        f"acmeErrorDeviceMismatch: acmeEventRecord: event {timed} belongs to device 0 but stream "
        f"{on1} to device 1; an event can only be recorded on a stream of its own device")
    other = handles.event(device=1, timing=True)
    runtime.event_record(other, on1)
    runtime.event_synchronize(other)
    with pytest.raises(AcmeError, match="elapsed time needs two events of one device"):
        runtime.event_elapsed_time(timed, other)
    with pytest.raises(AcmeError, match="invalid device ordinal 3"):
        runtime.event_create(3)


@needs_streams
def test_wait_event_orders_streams_across_devices(handles):
    producer, consumer = handles.stream(device=0), handles.stream(device=1)
    ready = handles.event(device=0)
    done = handles.event(device=1, timing=True)
    runtime.sleep_kernel(producer, 200 * MS)
    runtime.event_record(ready, producer)
    runtime.stream_wait_event(consumer, ready)
    runtime.event_record(done, consumer)
    assert runtime.stream_query(consumer) is False  # held back by the producer
    runtime.event_synchronize(done)
    assert runtime.event_query(ready) is True and runtime.stream_query(producer) is True


@needs_streams
def test_wait_concerns_the_record_issued_before_it(handles):
    first, second = handles.stream(), handles.stream()
    event = handles.event()
    runtime.event_record(event, first)  # version 1: completes at once
    runtime.stream_synchronize(first)
    runtime.stream_wait_event(second, event)  # waits for version 1 only
    runtime.sleep_kernel(first, 300 * MS)
    runtime.event_record(event, first)  # version 2, far in the future
    runtime.stream_synchronize(second)  # must not wait for version 2
    assert runtime.event_query(event) is False


@needs_streams
def test_device_synchronize_waits_for_every_stream_of_the_current_device(handles):
    busy = [handles.stream(device=1), handles.stream(device=1)]
    for stream in busy:
        runtime.sleep_kernel(stream, 100 * MS)
    runtime.sleep_kernel(runtime.default_stream(1), 100 * MS)
    previous = runtime.current_device()
    runtime.set_device(1)
    try:
        runtime.synchronize()
    finally:
        runtime.set_device(previous)
    assert all(runtime.stream_query(s) for s in busy + [runtime.default_stream(1)])


@needs_streams
def test_stale_and_wrong_handles(handles):
    stream, event = runtime.stream_create(0), handles.event()
    runtime.stream_destroy(stream)
    with pytest.raises(AcmeError) as info:
        runtime.stream_query(stream)
    assert info.value.name == "acmeErrorInvalidHandle" and info.value.code == 7
    assert str(info.value) == (
        f"acmeErrorInvalidHandle: acmeStreamQuery: stream {stream} was destroyed")
    with pytest.raises(AcmeError, match=f"acmeStreamSynchronize: {event} is an event handle, "
                                        "not a stream handle"):
        runtime.stream_synchronize(event)
    with pytest.raises(AcmeError, match="acmeEventQuery: 123456789 is not an event handle "
                                        r"\(never created\)"):
        runtime.event_query(123456789)
    with pytest.raises(AcmeError, match=f"acmeStreamDestroy: stream {stream} was destroyed"):
        runtime.stream_destroy(stream)
    gone = runtime.event_create(0)
    runtime.event_destroy(gone)
    with pytest.raises(AcmeError, match=f"acmeEventRecord: event {gone} was destroyed"):
        runtime.event_record(gone)
    # Handles are never reused: a new object gets a new number.
    assert runtime.stream_create(0) not in (stream, event, gone)


@needs_streams
def test_stream_zero_is_the_current_devices_default_stream(handles):
    event = handles.event(device=1)
    with pytest.raises(AcmeError, match="belongs to device 1 but stream"):
        runtime.event_record(event, 0)  # device 0 is current
    runtime.set_device(1)
    try:
        runtime.event_record(event, 0)
        runtime.stream_synchronize(0)
    finally:
        runtime.set_device(0)
    assert runtime.event_query(event) is True


@needs_streams
def test_threads_record_and_wait_concurrently():
    errors = []

    def worker(index):
        try:
            device = index % 2
            stream = runtime.stream_create(device)
            event = runtime.event_create(device, True)
            for i in range(500):
                runtime.event_record(event, stream)
                runtime.stream_wait_event(runtime.default_stream(device), event)
                if i % 50 == 0:
                    runtime.event_synchronize(event)
                    assert runtime.event_query(event)
            runtime.stream_synchronize(stream)
            runtime.stream_destroy(stream)
            runtime.event_destroy(event)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
