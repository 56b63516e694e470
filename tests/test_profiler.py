"""Chapter 19: acme's device work in torch.profiler traces.

From chapter 19 the runtime records what each stream ran and when (its
activity API), and a Kineto plugin turns the records into device activities:
kernels, copies and memsets on their device and stream, with device-side
timestamps, each linked to the operator that queued it. The legacy profiler
(torch.autograd.profiler with use_device) times operators with events.

Determinism: where a test needs device work to take a known time, it queues
`torch.acme._sleep`; timing checks compare with margins of several times.
"""

from __future__ import annotations

import gc
import importlib
import json
import threading

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import torch_acme  # noqa: F401 - registers torch.acme
from conftest import LAST, run_in_stage
from torch_acme import runtime

pytestmark = [
    pytest.mark.skipif(importlib.import_module("torch_acme._build_info").STAGE < 19,
                       reason="chapter 19's profiler plugin is not in this stage"),
    pytest.mark.filterwarnings("ignore:.*runs on the CPU:UserWarning"),
]

ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]
MS = 1000  # microseconds per millisecond, for _sleep


def device_events(prof, name=None):
    return [e for e in prof.events() if e.device_type == DeviceType.PrivateUse1
            and (name is None or e.name == name)]


def cpu_ops(prof):
    """The operators by id. Host calls (acmeLaunchKernel) number launches in a
    space of their own, and link to their operator like the kernels do."""
    return {e.id: e for e in prof.events()
            if e.device_type == DeviceType.CPU and e.linked_correlation_id == 0}


def chrome_trace(prof, tmp_path):
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())["traceEvents"]


# ---- the runtime's activity records ----

def test_runtime_records_kernels_copies_and_host_calls():
    x = torch.rand(64, 64, device="acme")
    torch.acme.synchronize()
    runtime.activity_enable(1)
    try:
        runtime.push_external_id(41)
        y = x @ x
        runtime.pop_external_id()
        host = y.cpu()
        torch.acme.synchronize()
    finally:
        runtime.activity_enable(0)
    records = runtime.activity_flush()
    kernel = next(r for r in records if r["kind"] == "kernel")
    launch = next(r for r in records if r["kind"] == "host_call"
                  and r["correlation"] == kernel["correlation"])
    assert kernel["name"] == "aten::mm" and kernel["external_id"] == 41
    assert launch["name"] == "acmeLaunchKernel" and launch["thread"] > 0
    assert kernel["start"] <= kernel["end"] and launch["start"] <= launch["end"]
    copy = next(r for r in records if r["kind"] == "memcpy")
    assert copy["name"] == "Memcpy DtoH" and copy["bytes"] == 64 * 64 * 4
    assert copy["external_id"] == 0  # nothing pushed: no operator to link to
    assert torch.equal(host, y.cpu())
    assert runtime.activity_flush() == []  # flushing moves the records out


def test_runtime_records_the_work_queued_while_enabled():
    x = torch.ones(16, device="acme")
    torch.acme._sleep(30 * MS)
    x + 1  # queued before the start, runs after it
    runtime.activity_enable(1)
    x * 2
    with torch.acme.device(1):
        torch.acme._sleep(30 * MS)  # queued on another device: the stop waits for it
    runtime.activity_enable(0)
    x - 1  # queued after the stop
    torch.acme.synchronize()
    work = {(r["name"], r["device"]) for r in runtime.activity_flush() if r["kind"] != "host_call"}
    assert work == {("mul_stub", 0), ("sleep", 1)}  # in the order they ended: either


def test_sync_copies_show_on_the_default_stream():
    import ctypes

    x = torch.ones(1024, device="acme")
    host = ctypes.create_string_buffer(4096)
    side = torch.Stream(device="acme")
    torch.acme.synchronize()
    runtime.activity_enable(1)
    try:
        with torch.acme.stream(side):  # a synchronous copy runs on no stream
            runtime.memcpy(ctypes.addressof(host), x.data_ptr(), 4096,
                           runtime.MemcpyKind.DeviceToHost)
    finally:
        runtime.activity_enable(0)
    records = runtime.activity_flush()
    (copy,) = [r for r in records if r["kind"] == "memcpy"]
    (call,) = [r for r in records if r["kind"] == "host_call"]
    default = torch.acme.default_stream().native_handle
    assert copy["name"] == "Memcpy DtoH" and copy["bytes"] == 4096
    assert copy["stream"] == call["stream"] == default != side.native_handle
    assert call["name"] == "acmeMemcpy" and call["correlation"] == copy["correlation"]
    assert host.raw[:4] == torch.ones(1).numpy().tobytes()


def test_pushed_ids_do_not_outlive_a_trace():
    runtime.activity_enable(1)
    runtime.push_external_id(7)  # never popped, as when a profile ends mid-op
    runtime.activity_enable(0)
    runtime.activity_enable(1)  # a new trace starts with empty stacks
    try:
        torch.ones(8, device="acme").add_(1)
        torch.acme.synchronize()
    finally:
        runtime.activity_enable(0)
    records = runtime.activity_flush()
    assert records and all(r["external_id"] == 0 for r in records)
    with pytest.raises(runtime.AcmeError, match="no pushed id"):
        runtime.pop_external_id()


def test_runtime_activity_bad_arguments():
    with pytest.raises(runtime.AcmeError, match="not 0 or 1"):
        runtime.activity_enable(2)


def test_runtime_counts_what_it_drops():
    cap = 1 << 20
    buffer = runtime.malloc(16)
    runtime.activity_enable(1)
    try:
        for _ in range(cap // 2 + 8):  # each queued memset: a host call and its memset
            runtime.memset_async(buffer, 0, 0)
        runtime.synchronize()
        dropped = runtime.activity_dropped()
    finally:
        runtime.activity_enable(0)
        runtime.free(buffer)
    assert dropped == 16  # the first `cap` records were kept
    runtime.activity_enable(1)  # discards them (flushing a million as dicts is slow)
    runtime.activity_enable(0)


# ---- torch.profiler ----

def test_kernels_are_device_activities_linked_to_their_op():
    x = torch.rand(128, 128, device="acme")
    with profile(activities=ACTIVITIES) as prof:
        y = x @ x
        z = y + 1
    ops = cpu_ops(prof)
    # Kernels carry the glue's names: a structured op's, or its TensorIterator stub's.
    for kernel_name, op_name in (("aten::mm", "aten::mm"), ("add_stub", "aten::add")):
        (kernel,) = device_events(prof, kernel_name)
        assert ops[kernel.linked_correlation_id].name == op_name
        assert kernel.device_index == 0
        assert 0 <= kernel.time_range.start <= kernel.time_range.end
    # The table credits the kernel's device time to the op.
    mm = next(a for a in prof.key_averages() if a.key == "aten::mm")
    assert mm.device_time_total > 0
    assert torch.allclose(z.cpu(), x.cpu() @ x.cpu() + 1, atol=1e-3)


def test_device_time_is_when_the_stream_ran_it():
    with profile(activities=ACTIVITIES) as prof:
        torch.acme._sleep(50 * MS)
    (sleep,) = device_events(prof, "sleep")
    (launch,) = [e for e in prof.events() if e.name == "acmeLaunchSleepKernel"]
    assert sleep.time_range.elapsed_us() >= 45_000  # the device's time
    assert launch.time_range.elapsed_us() < 20_000  # the host only queued it
    assert sleep.time_range.start >= launch.time_range.start


def test_a_schedule_gives_each_cycle_its_own_kernels():
    # torch.profiler.schedule: the plugin's session starts and stops once per
    # active window. Each trace must hold that window's kernels, none from
    # another window, none twice.
    x = torch.rand(32, 32, device="acme")
    traces = []
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=3)
    def ready(p):
        steps = sorted(e.name for e in p.events() if e.name.startswith("step "))
        traces.append((steps, sorted(e.name for e in device_events(p))))

    with profile(activities=ACTIVITIES, schedule=schedule, on_trace_ready=ready) as prof:
        for step in range(12):
            with record_function(f"step {step}"):
                x.mul(step)
            torch.acme.synchronize()
            prof.step()
    # wait 1, warm up 1, record 2: steps 2-3, 6-7 and 10-11, a kernel each.
    assert traces == [([f"step {a}", f"step {a + 1}"], ["mul_stub", "mul_stub"])
                      for a in (2, 6, 10)], traces


def test_cpu_only_profile_has_no_device_activity():
    x = torch.rand(64, 64, device="acme")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x @ x
    assert device_events(prof) == []
    assert any(e.name == "aten::mm" for e in prof.events())


def test_streams_and_devices_are_rows_of_the_trace(tmp_path):
    side = torch.Stream(device="acme")
    a = torch.rand(64, 64, device="acme")
    b = torch.rand(64, 64, device="acme:1")
    torch.acme.synchronize(0)
    torch.acme.synchronize(1)
    with profile(activities=ACTIVITIES) as prof:
        a @ a
        with torch.acme.stream(side):
            a + a
        with torch.acme.device(1):
            torch.acme._sleep(50 * MS)  # device 1's kernels end after the profile's
        b * b                           # synchronize, which is device 0's
    events = chrome_trace(prof, tmp_path)
    kernels = {e["name"]: (e["pid"], e["tid"]) for e in events if e.get("cat") == "kernel"}
    assert kernels["aten::mm"] == (0, 0)
    assert kernels["add_stub"] == (0, side.stream_id)
    assert kernels["mul_stub"] == (1, 0)
    names = {}
    for e in events:
        if e.get("ph") == "M" and e["name"] in ("process_name", "thread_name"):
            names.setdefault((e["name"], e["pid"], e["tid"]), set()).add(e["args"]["name"])
    assert names["process_name", 0, 0] == {"acme 0"} and names["process_name", 1, 0] == {"acme 1"}
    assert names["thread_name", 0, 0] == names["thread_name", 1, 0] == {"stream 0 (default)"}
    assert names["thread_name", 0, side.stream_id] == {f"stream {side.stream_id}"}
    # A session that names its devices keeps Kineto's placeholder "GPU n" rows out.
    assert not any(e.get("ph") == "M" and "GPU" in str(e["args"]) for e in events)


def test_a_copy_overlaps_a_kernel_on_another_stream(tmp_path):
    side = torch.Stream(device="acme")
    batch = torch.rand(4 << 20).pin_memory()  # 16 MiB
    with profile(activities=ACTIVITIES) as prof:
        torch.acme._sleep(100 * MS)  # the default stream is busy
        with torch.acme.stream(side):
            batch.to("acme", non_blocking=True)
        torch.acme.synchronize()
    (sleep,) = device_events(prof, "sleep")
    (copy,) = device_events(prof, "Memcpy HtoD")
    assert copy.time_range.start < sleep.time_range.end  # ran while the sleep did
    assert copy.time_range.end < sleep.time_range.end
    (trace_copy,) = [e for e in chrome_trace(prof, tmp_path) if e.get("cat") == "gpu_memcpy"]
    assert trace_copy["args"]["bytes"] == str(16 << 20)
    assert trace_copy["tid"] == side.stream_id


def test_chrome_trace_loads_with_flows_and_sane_times(tmp_path):
    x = torch.rand(64, 64, device="acme")
    with profile(activities=ACTIVITIES) as prof:
        for _ in range(3):
            x = torch.softmax(x @ x, dim=1)
        x.cpu()
    events = chrome_trace(prof, tmp_path)
    spans = [e for e in events if e.get("ph") == "X"]
    assert spans and all(e["dur"] >= 0 for e in spans)
    host = [e for e in spans if e.get("cat") == "cpu_op"]
    device = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy")]
    assert len([e for e in device if e["cat"] == "kernel"]) == 6
    begin = min(e["ts"] for e in host)
    end = max(e["ts"] + e["dur"] for e in host)
    # Device times share the host's clock: every kernel lies within the ops.
    assert all(begin <= e["ts"] and e["ts"] + e["dur"] <= end + 1000 for e in device)
    # Each launch is an arrow: a start on the host call, a finish on the work.
    flows = [e for e in events if e.get("cat") == "ac2g"]
    starts = {e["id"] for e in flows if e["ph"] == "s"}
    finishes = {e["id"] for e in flows if e["ph"] == "f"}
    assert starts == finishes and len(starts) >= 7  # 6 kernels and the copy


def test_record_function_ranges_hold_their_kernels():
    x = torch.rand(64, 64, device="acme")
    with profile(activities=ACTIVITIES) as prof:
        with record_function("attention block"):
            y = torch.softmax(x @ x, dim=-1)
        y.sum()
    (block,) = [e for e in prof.events() if e.name == "attention block"]
    ops = cpu_ops(prof)
    inside = [k for k in device_events(prof) if k.name in ("aten::mm", "aten::_softmax")]
    assert len(inside) == 2
    for kernel in inside:
        op = ops[kernel.linked_correlation_id]
        assert block.time_range.start <= op.time_range.start <= block.time_range.end
    assert block.device_time_total > 0  # the range's total counts its kernels


def test_profile_memory_shows_acme_allocations():
    gc.collect()  # no other test's tensors freed inside the profile
    with profile(activities=ACTIVITIES, profile_memory=True) as prof:
        x = torch.empty(1 << 20, device="acme")  # 4 MiB
        del x
    # The allocation is charged to the op that made it; the free, outside any
    # op, is a record of its own.
    empty = next(a for a in prof.key_averages() if a.key == "aten::empty")
    assert empty.device_memory_usage == 4 << 20
    assert empty.cpu_memory_usage == 0
    frees = [e for e in prof.events() if e.name == "[memory]"]
    assert [e.device_memory_usage for e in frees] == [-(4 << 20)]


def test_threads_link_to_their_own_ops():
    xs = [torch.rand(64, 64, device="acme") for _ in range(2)]
    barrier = threading.Barrier(2)

    def work(x, op):
        barrier.wait()
        for _ in range(20):
            op(x)
        torch.acme.synchronize()

    # By default torch.profiler records the ops of the thread that started it.
    everyone = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=ACTIVITIES, experimental_config=everyone) as prof:
        threads = [threading.Thread(target=work, args=(xs[0], lambda x: x + 1)),
                   threading.Thread(target=work, args=(xs[1], lambda x: x * 2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    ops = cpu_ops(prof)
    kernels = [k for k in device_events(prof) if k.name in ("add_stub", "mul_stub")]
    assert len(kernels) == 40
    expected = {"add_stub": "aten::add", "mul_stub": "aten::mul"}
    assert all(ops[k.linked_correlation_id].name == expected[k.name] for k in kernels)


def test_no_warnings_and_positive_times_in_both_profilers():
    # A fresh process: PyTorch prints its profiler warnings once per process.
    code = """
import warnings, torch, torch_acme
from torch.profiler import profile, ProfilerActivity
warnings.simplefilter("error")  # any Python warning fails the run
warnings.filterwarnings("ignore", message=".*runs on the CPU")  # the fallback says so
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
model = model.to("acme")
x = torch.rand(32, 64, device="acme")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
    for _ in range(5):
        model(x)
times = [(e.time_range.start, e.time_range.end) for e in prof.events()]
assert all(0 <= s <= e for s, e in times), times
with torch.autograd.profiler.profile(use_device="acme") as legacy:
    for _ in range(5):
        model(x)
averages = legacy.key_averages()
assert all(a.device_time_total >= 0 and a.cpu_time_total >= 0 for a in averages)
assert next(a for a in averages if a.key == "aten::addmm").device_time_total > 0
print("ok")
"""
    proc = run_in_stage(LAST, code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert "not enabled" not in proc.stderr
    assert "RecordFunction" not in proc.stderr
