"""Chapter 18: asynchronous execution, kernels queued on streams.

From chapter 18 a native kernel is queued on the current stream of its
device and the host returns at once, as on CUDA. What users rely on then:
events time the device, not the host; whatever reads device memory on the
host (copies to the CPU, item(), printing, host-run kernels) waits for the
stream first; a copy from pageable memory is staged, one between the device
and pinned memory is truly asynchronous; the caching allocators do not hand
out memory a queued kernel or copy still uses; a kernel's failure surfaces
at the next synchronizing call, or at its launch with ACME_LAUNCH_BLOCKING=1.

Determinism: `torch.acme._sleep` (a kernel that keeps the stream busy for
100-300 ms) is queued first wherever a test needs the device to be "behind"
the host, so a race the test shows cannot be won by chance. Wall-clock
checks only ever compare with margins of several times.
"""

from __future__ import annotations

import importlib
import textwrap
import time
import timeit
import warnings

import pytest
import torch

import torch_acme  # noqa: F401 - registers torch.acme
from conftest import LAST, run_in_stage, run_threads
from torch_acme import runtime

pytestmark = [
    pytest.mark.skipif(importlib.import_module("torch_acme._build_info").STAGE < 18,
                       reason="chapter 18's asynchronous kernels are not in this stage"),
    # Printing and a few helpers go through the CPU fallback, which says so once per op.
    pytest.mark.filterwarnings("ignore:.*runs on the CPU:UserWarning"),
]

MS = 1000  # microseconds per millisecond, for _sleep


@pytest.fixture(autouse=True)
def settled():
    """Every test starts and ends with idle devices and no failure left unreported.

    A kernel failure a test leaves behind would be raised by whichever test
    synchronizes next: here, at the end of the test that caused it.
    """
    for d in range(torch.acme.device_count()):
        torch.acme.synchronize(d)
    yield
    for d in range(torch.acme.device_count()):
        torch.acme.synchronize(d)


def current_stream():
    return torch.accelerator.current_stream()


def timing_events():
    return (torch.Event(device="acme", enable_timing=True),
            torch.Event(device="acme", enable_timing=True))


# ---- events time the device ----

def test_events_around_an_op_measure_the_device():
    x = torch.randn(1024, 1024, device="acme")
    start, end = timing_events()
    torch.acme._sleep(100 * MS)  # the stream is busy: the op cannot start at once
    start.record()
    y = x @ x
    end.record()
    # The host got here long before the device reached `start`.
    assert not start.query()
    end.synchronize()
    ms = start.elapsed_time(end)
    # The matmul ran between the two marks. Until chapter 17 it ran on the host
    # when called, before either mark was even reached: ~0.005 ms between them.
    assert ms > 1.0, ms
    assert torch.allclose(y.cpu(), x.cpu() @ x.cpu(), rtol=1e-4, atol=1e-3)


# ---- launches return before the device is done ----

def test_launch_returns_before_the_device_is_done():
    a = torch.arange(64.0, device="acme")
    torch.acme._sleep(300 * MS)
    b = a * 2 + 1
    assert not current_stream().query()  # still sleeping: b is not computed yet
    torch.acme.synchronize()
    assert current_stream().query()
    assert torch.equal(b.cpu(), torch.arange(64.0) * 2 + 1)


def test_a_long_chain_of_dependent_ops_keeps_its_order():
    rng = torch.Generator().manual_seed(18)
    x = torch.randn(64, generator=rng)
    b = torch.rand(64, generator=rng) + 1.0  # away from zero: divides by it
    c = torch.randn(64, generator=rng)
    dx, db, dc = x.to("acme"), b.to("acme"), c.to("acme")

    def step(t, tb, tc, i):
        kind = i % 6
        if kind == 0:
            return t + tb
        if kind == 1:
            return t * 0.5
        if kind == 2:
            return t - tc
        if kind == 3:
            return t / tb
        if kind == 4:
            return t.mul_(tb).sub_(0.25)  # in place, on the same memory
        return torch.div(t, 1.5).add_(tc, alpha=0.125)

    torch.acme._sleep(100 * MS)  # everything below queues up behind it
    for i in range(1000):
        x = step(x, b, c, i)
        dx = step(dx, db, dc, i)
    assert not current_stream().query()
    # The same kernels, run in the same order: bit for bit the CPU's result.
    assert torch.equal(dx.cpu(), x)


# ---- reads on the host wait for the stream ----

@pytest.mark.parametrize("read", ["cpu", "item", "repr", "tolist"])
def test_host_reads_wait_for_the_stream(read):
    a = torch.arange(6.0).reshape(2, 3)
    da = a.to("acme")
    torch.acme._sleep(150 * MS)
    d = da * 3 + 1
    expected = a * 3 + 1
    assert not current_stream().query()
    if read == "cpu":
        assert torch.equal(d.cpu(), expected)
    elif read == "item":
        assert d[1, 2].item() == expected[1, 2].item()
    elif read == "repr":
        assert repr(d) == repr(expected)[:-1] + ", device='acme:0')"
    else:
        assert d.tolist() == expected.tolist()


# ---- copies between the host and the device ----

N = 1 << 20  # floats: 4 MiB, large enough that a copy is not instantaneous


def test_non_blocking_copy_into_pinned_memory_is_a_race_until_synchronized():
    values = torch.arange(1.0, N + 1)
    d = values.to("acme")
    for wait in ("synchronize", "event"):
        pinned = torch.zeros(N, pin_memory=True)
        torch.acme._sleep(200 * MS)
        pinned.copy_(d, non_blocking=True)
        # The race a reader writes: the copy is queued behind the sleep, so
        # the host still sees the old contents. (Reading before waiting is the
        # bug; the test does it on purpose.)
        assert torch.count_nonzero(pinned).item() == 0, wait
        if wait == "synchronize":
            torch.acme.synchronize()
        else:
            done = torch.Event(device="acme")
            done.record()
            done.synchronize()
        assert torch.equal(pinned, values), wait


def test_non_blocking_copy_into_pageable_memory_is_synchronous():
    values = torch.arange(1.0, N + 1)
    d = values.to("acme")
    pageable = torch.zeros(N)
    assert not pageable.is_pinned()
    torch.acme._sleep(200 * MS)
    pageable.copy_(d, non_blocking=True)
    # The device cannot write pageable memory behind the host's back: the copy
    # waited for the stream, so the values are there already.
    assert current_stream().query()
    assert torch.equal(pageable, values)


def test_pageable_host_to_device_copy_is_staged():
    x = torch.arange(1.0, N + 1)
    original = x.clone()
    torch.acme._sleep(200 * MS)
    d = x.to("acme")
    assert not current_stream().query()  # the copy itself has not run yet...
    x.fill_(-1)  # ...but its source was staged: the host may reuse x at once
    assert torch.equal(d.cpu(), original)


def test_pinned_block_of_a_pending_non_blocking_copy_is_not_reused():
    torch.acme.synchronize()
    torch.accelerator.empty_host_cache()
    # Control: without pending work PyTorch's host allocator hands a freed
    # pinned block straight to the next allocation of its size.
    probe = torch.empty(N, pin_memory=True)
    address = probe.data_ptr()
    del probe
    probe = torch.empty(N, pin_memory=True)
    assert probe.data_ptr() == address
    del probe

    p = torch.arange(1.0, N + 1).pin_memory()
    original = p.clone()
    address = p.data_ptr()
    torch.acme._sleep(200 * MS)
    d = p.to("acme", non_blocking=True)
    assert not current_stream().query()  # the copy reads p later, on the stream
    del p
    other = torch.empty(N, pin_memory=True)
    other.fill_(-1)
    # The copy recorded an event with the host allocator: p's block stays out
    # of circulation until the stream has passed it.
    assert other.data_ptr() != address
    torch.acme.synchronize()
    assert torch.equal(d.cpu(), original)
    del other
    torch.accelerator.empty_host_cache()


# ---- record_stream ----

def record_stream_scenario(record: bool):
    """x made on the default stream, read by side stream s behind a sleep, then freed."""
    torch.acme.synchronize()
    torch.acme.empty_cache()  # no other cached block of x's size to pick instead
    n = 1 << 18
    main = current_stream()
    x = torch.ones(n, device="acme")
    address = x.data_ptr()
    s = torch.Stream(device="acme")
    s.wait_stream(main)  # x is written before s reads it
    with s:
        torch.acme._sleep(200 * MS)
        y = x * 2
    if record:
        x.record_stream(s)
    del x
    z = torch.full((n,), -1.0, device="acme")  # on the default stream, at once
    reused = z.data_ptr() == address
    torch.acme.synchronize()
    return reused, y.cpu(), z.cpu()


def test_freeing_a_tensor_another_stream_uses_is_a_race_without_record_stream():
    reused, y, z = record_stream_scenario(record=False)
    # The documented CUDA-style race: the allocator only knows x's own
    # (default) stream, which has passed the free, so z gets x's block and
    # overwrites it with -1 before s, still sleeping, computes y = x * 2.
    assert reused
    assert torch.equal(y, torch.full_like(y, -2.0))  # wrong, as it must be here
    assert torch.equal(z, torch.full_like(z, -1.0))


def test_record_stream_keeps_the_block_until_the_stream_is_done():
    reused, y, z = record_stream_scenario(record=True)
    assert not reused  # z got another block (the recorded stream had not passed the free)
    assert torch.equal(y, torch.full_like(y, 2.0))
    assert torch.equal(z, torch.full_like(z, -1.0))


# ---- asynchronous errors ----

def bad_embedding():
    """An nn.Embedding lookup with an index out of range, queued on the current stream."""
    emb = torch.nn.Embedding(10, 4).to("acme")
    return emb(torch.tensor([1, 12, 3], device="acme"))


def test_a_kernel_failure_is_raised_by_the_next_synchronizing_call():
    torch.acme._sleep(100 * MS)
    out = bad_embedding()  # returns without an error: the kernel has not even run yet
    assert not current_stream().query()
    with pytest.raises(torch.AcceleratorError) as raised:
        out.cpu()
    message = str(raised.value)
    assert isinstance(raised.value, RuntimeError)
    for part in ("acmeErrorLaunchFailure", "aten::index_select", "default stream",
                 "device 0", "index out of range", "ran asynchronously"):
        assert part in message, message
    # Reported once: the device is usable again.
    torch.acme.synchronize()
    emb = torch.nn.Embedding(10, 4).to("acme")
    good = emb(torch.tensor([1, 9, 3], device="acme"))
    assert torch.equal(good.cpu(), emb.weight.detach().cpu()[[1, 9, 3]])
    assert (torch.ones(3, device="acme") * 2).sum().item() == 6.0


def test_item_reports_a_kernel_failure_too():
    total = bad_embedding().sum()
    with pytest.raises(torch.AcceleratorError, match="aten::index_select"):
        total.item()
    assert torch.ones(2, device="acme").sum().item() == 2.0


def test_only_the_first_failure_of_a_device_is_kept():
    out = bad_embedding()
    a = torch.tensor([4, 5], device="acme")
    zero = torch.div(a, torch.zeros(2, dtype=torch.long, device="acme"), rounding_mode="floor")
    with pytest.raises(torch.AcceleratorError) as raised:
        zero.cpu()
    assert "aten::index_select" in str(raised.value)
    assert "div_floor_stub" not in str(raised.value)
    torch.acme.synchronize()  # the second failure was not kept: nothing to report
    del out


def test_a_failure_on_a_side_stream_names_that_stream():
    s = torch.Stream(device="acme")
    s.wait_stream(current_stream())
    with s:
        out = bad_embedding()
        with pytest.raises(torch.AcceleratorError) as raised:
            out.cpu()
    message = str(raised.value)
    assert f"stream {s.stream_id} of device 0" in message, message
    assert "default stream" not in message
    assert "aten::index_select" in message


def test_a_failure_on_device_1_names_device_1():
    with torch.acme.device(1):
        out = bad_embedding()
        assert out.device == torch.device("acme:1")
    with pytest.raises(torch.AcceleratorError, match="default stream of device 1"):
        out.cpu()
    torch.acme.synchronize(0)  # device 0 has nothing to report


def test_integer_floor_division_by_zero_fails_in_its_kernel():
    a = torch.tensor([5, 7, -3], device="acme")
    b = torch.tensor([2, 0, 2], device="acme")
    c = torch.div(a, b, rounding_mode="floor")  # returns: the division has not run
    with pytest.raises(torch.AcceleratorError) as raised:
        c.cpu()
    assert "div_floor_stub" in str(raised.value)
    assert "ZeroDivisionError" in str(raised.value)
    torch.acme.synchronize()
    assert torch.div(a, b.clamp(min=1), rounding_mode="floor").tolist() == [2, 7, -2]


def record_and_synchronize_an_event():
    event = torch.Event(device="acme")
    event.record()
    event.synchronize()


SYNCHRONIZING_CALLS = {
    "torch.accelerator.synchronize": torch.accelerator.synchronize,
    "Stream.synchronize": lambda: current_stream().synchronize(),
    "Event.synchronize": record_and_synchronize_an_event,
    "torch.acme.synchronize": lambda: torch.acme.synchronize(),
}


@pytest.mark.parametrize("call", SYNCHRONIZING_CALLS.values(), ids=SYNCHRONIZING_CALLS.keys())
def test_synchronizing_calls_report_a_failure(call):
    out = bad_embedding()
    try:
        with pytest.raises(torch.AcceleratorError, match="aten::index_select"):
            call()
    finally:
        del out  # not kept alive by the traceback of an unexpected error
        torch.accelerator.synchronize()  # reported once: nothing is left to report


# ---- ACME_LAUNCH_BLOCKING ----

LAUNCH_BLOCKING_SCRIPT = textwrap.dedent("""\
    import traceback
    import torch, torch_acme
    emb = torch.nn.Embedding(10, 4).to("acme")
    index = torch.tensor([1, 12], device="acme")
    try:
        out = emb(index)  # line 6: the launch
        out.cpu()  # line 7: the first synchronizing call
    except torch.AcceleratorError as error:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == "<string>"]
        print("LINE", frames[-1].lineno)
        print("MESSAGE", error)
    """)


def run_launch_blocking(value: str) -> dict[str, str]:
    proc = run_in_stage(LAST, LAUNCH_BLOCKING_SCRIPT, ACME_LAUNCH_BLOCKING=value)
    assert proc.returncode == 0, proc.stderr
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert "LINE" in out, proc.stdout + proc.stderr
    return out


def test_launch_blocking_reports_the_failure_at_its_launch():
    out = run_launch_blocking("1")
    assert out["LINE"] == "6", out  # raised by the embedding call itself
    assert "ACME_LAUNCH_BLOCKING=1" in out["MESSAGE"]
    assert "aten::index_select" in out["MESSAGE"]
    assert "index out of range" in out["MESSAGE"]


def test_without_launch_blocking_the_failure_surfaces_later():
    out = run_launch_blocking("0")
    assert out["LINE"] == "7", out  # raised by .cpu(), the next synchronizing call
    assert "ran asynchronously" in out["MESSAGE"]


def test_a_malformed_launch_blocking_value_fails_initialization():
    proc = run_in_stage(LAST, textwrap.dedent("""\
        import warnings
        import torch, torch_acme
        from torch_acme import runtime
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            print("AVAILABLE", torch.acme.is_available())
        for use in (lambda: torch.zeros(2, device="acme"), lambda: runtime.malloc(8)):
            try:
                use()
                print("NO ERROR")
            except RuntimeError as error:
                print("ERROR", error)
        """), ACME_LAUNCH_BLOCKING="yes")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "AVAILABLE False", proc.stdout
    errors = [line for line in lines if line.startswith("ERROR")]
    assert len(errors) == 2, proc.stdout
    for line in errors:
        assert "acmeErrorInitialization" in line, line
        assert 'ACME_LAUNCH_BLOCKING="yes"' in line, line


# ---- torch.utils.benchmark ----

def test_benchmark_timer_synchronizes_through_torch_accelerator():
    from torch.utils.benchmark import Timer

    # The statement queues 50 ms of device time: a sleep kernel, which takes as
    # long on a loaded machine as on an idle one (a matrix product's time moved
    # threefold with the other test worker's load, and the test failed once).
    stmt, env = "runtime.sleep_kernel(0, 50 * MS)", {"runtime": runtime, "MS": MS}
    # The default timer calls torch.accelerator.synchronize(): it times the device.
    synced = Timer(stmt, globals=env).timeit(3).mean
    assert synced >= 0.049, synced
    # timeit.default_timer does not synchronize: it times the launches only.
    unsynced = Timer(stmt, globals=env, timer=timeit.default_timer).timeit(3).mean
    torch.acme.synchronize()
    assert unsynced < 0.010, unsynced


# ---- the runtime's own waits ----

def test_runtime_free_waits_for_queued_work():
    n = 1 << 20
    ptr = runtime.malloc(n)
    runtime.sleep_kernel(0, 200 * MS)
    runtime.memset_async(ptr, 7, n, 0)  # queued behind the sleep, writes ptr
    begin = time.perf_counter()
    runtime.free(ptr)  # as cudaFree: waits for the memset before unmapping
    waited = time.perf_counter() - begin
    assert waited >= 0.15, waited
    assert runtime.stream_query(0)


def test_runtime_synchronous_copies_wait_for_queued_work():
    n = 1 << 16
    ptr = runtime.malloc(n)
    side = runtime.stream_create(0)
    try:
        runtime.memset(ptr, 0, n)
        runtime.sleep_kernel(0, 100 * MS)
        runtime.memset_async(ptr, 0x5A, n, 0)
        # acmeMemcpy to the host waits for the device's queued work first.
        assert runtime.copy_to_host(ptr, n) == b"\x5a" * n
        # Any stream of the device, not just the default one.
        runtime.sleep_kernel(side, 100 * MS)
        runtime.memset_async(ptr, 0x11, n, side)
        import ctypes

        buffer = ctypes.create_string_buffer(n)
        runtime.memcpy(ctypes.addressof(buffer), ptr, n, runtime.MemcpyKind.DeviceToHost)
        assert buffer.raw == b"\x11" * n
        # acmeMemset too: it runs after the queued memset, so its value stays.
        runtime.sleep_kernel(side, 100 * MS)
        runtime.memset_async(ptr, 0x22, n, side)
        runtime.memset(ptr, 0x33, n)
        assert runtime.copy_to_host(ptr, n) == b"\x33" * n
    finally:
        runtime.stream_synchronize(side)
        runtime.stream_destroy(side)
        runtime.free(ptr)


# ---- between devices, and host-run kernels ----

@pytest.mark.parametrize("source, target", [(1, 0), (0, 1)])
def test_a_cross_device_copy_waits_for_the_source_stream(source, target):
    h = torch.arange(1.0, 4097.0)
    hd = h.to(f"acme:{source}")
    with torch.acme.device(source):
        torch.acme._sleep(200 * MS)
        x = hd * 2 + 1  # queued behind the sleep on the source's current stream
        assert not torch.accelerator.current_stream(source).query()
    y = x.to(f"acme:{target}")
    assert y.device == torch.device(f"acme:{target}")
    assert torch.equal(y.cpu(), h * 2 + 1)


def test_a_host_run_kernel_sees_the_results_of_queued_kernels():
    rng = torch.Generator().manual_seed(3)
    a = torch.randn(2, 3, 8, 8, generator=rng)
    w = torch.randn(4, 3, 3, 3, generator=rng)
    da, dw = a.to("acme"), w.to("acme")
    torch.acme._sleep(200 * MS)
    x = da * 2  # queued
    y = torch.nn.functional.conv2d(x, dw)  # runs on the host: must wait for x
    assert torch.allclose(y.cpu(), torch.nn.functional.conv2d(a * 2, w), rtol=1e-5, atol=1e-5)


def test_a_host_run_kernel_does_not_overwrite_what_queued_kernels_read():
    x = torch.ones(4096, device="acme")
    torch.acme._sleep(200 * MS)
    y = x * 2  # queued: reads x later
    x.uniform_(5.0, 6.0)  # random fill runs on the host: after y's kernel, not before
    assert torch.equal(y.cpu(), torch.full((4096,), 2.0))
    assert bool(((x >= 5.0) & (x < 6.0)).all())


# ---- stress: threads, streams, events ----

def test_threads_streams_and_events_lose_and_reorder_nothing():
    threads, iterations = 4, 1000

    def work(index):
        rng = torch.Generator().manual_seed(1800 + index)
        devices = (0, 1)
        mine = {d: torch.Stream(device=f"acme:{d}") for d in devices}  # the producer
        default = {d: torch.acme.default_stream(d) for d in devices}  # the consumer
        b = {d: torch.rand(64, generator=rng) + 1.0 for d in devices}
        a = {d: torch.randn(64, generator=rng) for d in devices}
        da, db = {}, {}
        for d in devices:
            with mine[d]:
                da[d], db[d] = a[d].to(f"acme:{d}"), b[d].to(f"acme:{d}")
        consumed = []  # (device, device result, cpu result)
        for k in range(iterations):
            for d in devices:
                with mine[d]:
                    if k % 40 == index * 10 % 40:
                        torch.acme._sleep(3 * MS)
                    da[d] = ((da[d] + db[d]) * 0.5 - k / iterations) / db[d]
                    produced = torch.Event(device=f"acme:{d}")
                    produced.record(mine[d])
                a[d] = ((a[d] + b[d]) * 0.5 - k / iterations) / b[d]
                # Another stream consumes it: only the event orders the two.
                with default[d]:
                    default[d].wait_event(produced)
                    c = da[d] * 3 - k
                    da[d].record_stream(default[d])  # read here; made on mine[d]
                    consumed.append((d, c, a[d] * 3 - k))
                if k % 10 == 9:  # and the producer depends on the consumer
                    back = torch.Event(device=f"acme:{d}")
                    back.record(default[d])
                    mine[d].wait_event(back)
                    with mine[d]:
                        c.record_stream(mine[d])
                        da[d] = da[d] + c * 0.001
                    a[d] = a[d] + (a[d] * 3 - k) * 0.001
            if k % 25 == 24:  # across devices, both producers current
                with mine[0], mine[1]:
                    da[1] = da[1] + da[0].to("acme:1")
                a[1] = a[1] + a[0]
        for d in devices:
            with mine[d]:
                assert torch.equal(da[d].cpu(), a[d]), (index, d)
        for i, (d, c, expected) in enumerate(consumed):
            with default[d]:
                assert torch.equal(c.cpu(), expected), (index, i, d)

    run_threads(work, threads, timeout=120)
    for d in (0, 1):
        torch.acme.synchronize(d)
    assert torch.acme.current_device() == 0
