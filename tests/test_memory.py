"""Chapter 12: the caching device allocator, its statistics, out-of-memory and pinned memory.

What torch.cuda users rely on: allocated/reserved accounting, block reuse per
stream, record_stream, peak and accumulated resets, empty_cache, OOM recovery,
pinned host memory through PyTorch's caching host allocator, and checked mode
still catching host access to cached memory. Tests that need a small device, a
fault or a fresh allocator run in processes of their own.
"""

from __future__ import annotations

import importlib
import json
import random
import textwrap
import threading
import time

import pytest
import torch

import torch_acme
from conftest import LAST, run_in_stage
from torch_acme import runtime

pytestmark = pytest.mark.skipif(importlib.import_module("torch_acme._build_info").STAGE < 12,
                                reason="chapter 12's allocator is not in this stage")

KiB, MiB = 1024, 1024 * 1024


def run_json(code: str, *, stage: int = LAST, **env: str):
    """Run `code` in a fresh stage process; it prints one JSON line last."""
    proc = run_in_stage(stage, textwrap.dedent(code), **env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(autouse=True)
def empty_cache_first():
    # Each test starts from an allocator holding nothing but what other
    # modules' fixtures keep alive.
    torch.acme.empty_cache()
    yield


# ---- accounting ----

def test_allocated_and_reserved_follow_tensors():
    base_alloc = torch.acme.memory_allocated()
    base_reserved = torch.acme.memory_reserved()
    t = torch.empty(1000, device="acme")  # 4000 bytes, rounded up to 4096
    assert torch.acme.memory_allocated() - base_alloc == 4096
    assert torch.acme.memory_reserved() - base_reserved == 2 * MiB  # one small segment
    assert torch.acme.memory_stats()["requested_bytes.all.current"] >= 4000
    del t
    assert torch.acme.memory_allocated() == base_alloc
    assert torch.acme.memory_reserved() - base_reserved == 2 * MiB  # kept in the cache
    torch.acme.empty_cache()
    assert torch.acme.memory_reserved() == base_reserved


def test_torch_accelerator_reads_the_same_allocator():
    t = torch.empty(3 * MiB, dtype=torch.uint8, device="acme")
    assert torch.accelerator.memory_allocated() == torch.acme.memory_allocated()
    assert torch.accelerator.memory_reserved() == torch.acme.memory_reserved()
    assert torch.accelerator.memory_stats()["segment.large_pool.current"] == 1
    assert torch.accelerator.get_memory_info() == torch.acme.mem_get_info()
    free, total = torch.acme.mem_get_info()
    assert total == runtime.device_properties(0)["total_memory"]
    assert total - free >= 20 * MiB  # the 20 MiB segment the 3 MiB block came from
    del t


def test_a_freed_block_is_reused_and_small_blocks_share_a_segment():
    a = torch.empty(256, device="acme")
    address = a.data_ptr()
    del a
    b = torch.empty(256, device="acme")
    assert b.data_ptr() == address
    others = [torch.empty(100, device="acme") for _ in range(10)]
    stats = torch.acme.memory_stats()
    assert stats["segment.small_pool.current"] == 1  # eleven blocks, one 2 MiB segment
    assert stats["allocation.small_pool.current"] == 11
    del b, others
    stats = torch.acme.memory_stats()
    # Freed neighbours merged back into one whole segment, which empty_cache returns.
    assert stats["inactive_split.all.current"] == 0
    torch.acme.empty_cache()
    assert torch.acme.memory_stats()["segment.all.current"] == 0


def test_large_blocks_split_and_merge():
    a = torch.empty(2 * MiB, dtype=torch.uint8, device="acme")
    b = torch.empty(3 * MiB, dtype=torch.uint8, device="acme")
    assert b.data_ptr() - a.data_ptr() == 2 * MiB  # carved from one 20 MiB segment
    stats = torch.acme.memory_stats()
    assert stats["segment.large_pool.current"] == 1
    assert stats["inactive_split_bytes.large_pool.current"] == 15 * MiB
    del a
    stats = torch.acme.memory_stats()
    assert stats["inactive_split_bytes.large_pool.current"] == 17 * MiB
    del b
    assert torch.acme.memory_stats()["inactive_split_bytes.large_pool.current"] == 0
    big = torch.empty(25 * MiB, dtype=torch.uint8, device="acme")  # a segment of its own
    assert torch.acme.memory_stats()["reserved_bytes.large_pool.current"] == 46 * MiB
    del big


# PYTORCH_ALLOC_CONF (chapter 12): a freed 40 MiB block, then a 24 MiB and a
# 36 MiB request. By default the 24 MiB one splits the cached block; with
# max_split_size_mb:32 that block is "oversize": the 24 MiB request gets a
# segment of its own, and the 36 MiB one takes the 40 MiB block whole.
ALLOC_CONF = """
import json, os, torch, torch_acme
MiB = 1 << 20
def state():
    s = torch.accelerator.memory_stats()
    return [s["segment.all.current"], s["reserved_bytes.all.current"] // MiB,
            s["allocated_bytes.all.current"] // MiB]
setting = os.environ.get("SET_AT_RUN_TIME")
if setting:
    torch._C._accelerator_setAllocatorSettings(setting)  # at run time, as the variable
big = torch.empty(40 * MiB, dtype=torch.uint8, device="acme")
del big
x = torch.empty(24 * MiB, dtype=torch.uint8, device="acme")
after_24 = state()
del x
y = torch.empty(36 * MiB, dtype=torch.uint8, device="acme")
print(json.dumps([after_24, state()]))
"""


@pytest.mark.parametrize("stage", [12, LAST])
def test_pytorch_alloc_conf_keeps_large_blocks_whole(stage):
    default = json.loads(run_in_stage(stage, ALLOC_CONF, fresh=True).stdout)
    assert default == [[1, 40, 24], [1, 40, 36]]
    env = run_in_stage(stage, ALLOC_CONF, fresh=True, PYTORCH_ALLOC_CONF="max_split_size_mb:32")
    assert json.loads(env.stdout) == [[2, 64, 24], [2, 64, 40]], env.stderr
    # The same through PyTorch's setter, in a running process: read at each request.
    done = run_in_stage(stage, ALLOC_CONF, fresh=True, SET_AT_RUN_TIME="max_split_size_mb:32")
    assert json.loads(done.stdout) == [[2, 64, 24], [2, 64, 40]], done.stderr


def test_peak_and_accumulated_resets():
    t = torch.empty(4 * MiB, dtype=torch.uint8, device="acme")
    del t
    assert torch.acme.max_memory_allocated() >= 4 * MiB
    torch.acme.reset_peak_memory_stats()
    assert torch.acme.max_memory_allocated() == torch.acme.memory_allocated()
    assert torch.acme.max_memory_reserved() == torch.acme.memory_reserved()
    assert torch.acme.memory_stats()["allocation.all.allocated"] > 0
    torch.acme.reset_accumulated_memory_stats()
    stats = torch.acme.memory_stats()
    assert stats["allocation.all.allocated"] == 0 and stats["allocation.all.freed"] == 0
    assert stats["num_device_alloc"] == 0


def test_devices_are_counted_apart():
    before = [torch.acme.memory_allocated(d) for d in (0, 1)]
    t = torch.empty(1 * MiB, dtype=torch.uint8, device="acme:1")
    assert torch.acme.memory_allocated(1) - before[1] == 1 * MiB
    assert torch.acme.memory_allocated("acme:1") == torch.acme.memory_allocated(1)
    assert torch.acme.memory_allocated(torch.device("acme", 0)) == before[0]
    with torch.acme.device(1):
        assert torch.acme.memory_allocated() == torch.acme.memory_allocated(1)
    del t


def test_bad_device_index_is_a_value_error():
    for call in (torch.acme.memory_allocated, torch.acme.memory_stats, torch.acme.mem_get_info,
                 torch.acme.reset_peak_memory_stats):
        with pytest.raises(ValueError, match="invalid device index 7: there are 2 acme devices"):
            call(7)


def test_memory_summary_names_the_figures():
    t = torch.empty(1000, device="acme")
    summary = torch.acme.memory_summary()
    lines = summary.splitlines()
    assert max(len(line) for line in lines) <= 88
    row = next(line for line in lines if line.startswith("| Allocated memory"))
    assert "4.0 KiB" in row
    assert len(torch.acme.memory_summary(abbreviated=True).splitlines()) < len(lines)
    del t


def test_the_snapshot_has_cudas_keys_and_pytorchs_viewer_reads_it():
    sizes = (1000, 300_000, 3 * MiB + 5)
    kept = [torch.empty(n, dtype=torch.uint8, device="acme") for n in sizes]
    segments = torch.acme.memory_snapshot()
    assert {"device", "address", "total_size", "allocated_size", "active_size", "requested_size",
            "stream", "segment_type", "segment_pool_id", "is_expandable", "frames",
            "blocks"} <= set(segments[0])
    assert {"address", "size", "requested_size", "state", "frames"} <= set(segments[0]["blocks"][0])
    # The totals are the allocator's statistics, seen segment by segment.
    assert sum(s["total_size"] for s in segments) == torch.acme.memory_reserved()
    assert sum(s["allocated_size"] for s in segments) == torch.acme.memory_allocated()
    assert sum(s["requested_size"] for s in segments) == sum(sizes)
    for segment in segments:  # blocks tile their segment
        ends = [b["address"] + b["size"] for b in segment["blocks"]]
        assert [b["address"] for b in segment["blocks"][1:]] == ends[:-1]
        assert ends[-1] == segment["address"] + segment["total_size"]
    assert {s["stream"] for s in segments} == {torch.acme.current_stream().stream_id}
    # PyTorch's own memory viewer summarises it as it would CUDA's.
    from torch.cuda import _memory_viz
    summary = _memory_viz.segsum({"segments": segments})
    assert f"segments: {len(segments)}" in summary, summary
    assert "total_reserved: " in summary and "total_allocated: " in summary, summary
    del kept


# ---- streams ----

def test_blocks_are_reused_on_their_own_stream_only():
    side = torch.Stream(device="acme:0")
    with torch.acme.stream(side):
        a = torch.empty(256, device="acme")
    address = a.data_ptr()
    del a
    b = torch.empty(256, device="acme")  # the default stream: another block
    assert b.data_ptr() != address
    with torch.acme.stream(side):
        c = torch.empty(256, device="acme")
    assert c.data_ptr() == address
    del b, c


def test_record_stream_holds_a_block_until_that_stream_passes_the_free():
    side = torch.Stream(device="acme:0")
    a = torch.empty(256, device="acme")
    address = a.data_ptr()
    runtime.sleep_kernel(side.stream_id, 300_000)  # the side stream is busy for 0.3 s
    a.record_stream(side)
    del a
    b = torch.empty(256, device="acme")
    assert b.data_ptr() != address  # still "in use" by the side stream
    assert torch.acme.memory_stats()["active.all.current"] >= 2
    side.synchronize()
    c = torch.empty(256, device="acme")
    assert c.data_ptr() == address
    del b, c


def test_empty_cache_waits_for_recorded_streams():
    side = torch.Stream(device="acme:0")
    a = torch.empty(256, device="acme")
    runtime.sleep_kernel(side.stream_id, 100_000)
    a.record_stream(side)
    del a
    torch.acme.empty_cache()
    stats = torch.acme.memory_stats()
    assert stats["segment.all.current"] == 0
    assert stats["num_sync_all_streams"] >= 1


# A gradient that crosses streams: y = x * 2 runs on a side stream, so its
# backward node (the gradient's consumer) belongs to that stream, while exp's
# backward produces y's gradient on the default stream. The autograd engine
# then calls the guard's recordDataPtrOnStream for the gradient; without it the
# gradient's block would return to the default stream's pool while the side
# stream, busy here, may still read it.
CROSS_STREAM_GRADIENT = """
import json, torch, torch_acme
from torch_acme import runtime

def state_at(address):
    for segment in torch.acme.memory_snapshot():
        for block in segment["blocks"]:
            if block["address"] <= address < block["address"] + block["size"]:
                return block["state"]

torch.acme.empty_cache()
n = 3 * 1024 * 1024 // 4 + 7
side = torch.Stream(device="acme:0")
x = torch.ones(n, device="acme", requires_grad=True)
side.wait_stream(torch.acme.current_stream())
with side:
    y = x * 2                                        # MulBackward0: the side stream's
torch.acme.current_stream().wait_stream(side)        # y is written before exp reads it
seen = []
y.register_hook(lambda g: seen.append(g.data_ptr()))
z = y.exp().sum()                                    # ExpBackward0: the default stream's
runtime.sleep_kernel(side.stream_id, 400_000)        # the side stream is busy for 0.4 s
z.backward()
torch.acme.current_stream().synchronize()
busy = state_at(seen[0])                             # the gradient is freed; the side sleeps
side.synchronize()
torch.empty(1, device="acme")                        # the allocator looks at its events
done = state_at(seen[0])
print(json.dumps({"busy": busy, "done": done, "grad": x.grad.cpu()[:3].tolist()}))
"""


@pytest.mark.parametrize("stage", sorted({12, LAST}))
def test_a_gradient_that_crosses_streams_is_recorded_on_its_consumer_stream(stage):
    out = run_json(CROSS_STREAM_GRADIENT, stage=stage)
    assert out["busy"] == "active_pending_free"  # held for the side stream
    assert out["done"] == "inactive"  # back in the pool once the side stream passed
    assert out["grad"] == pytest.approx([2 * 7.389056] * 3)


def test_record_stream_of_another_device_is_refused():
    t = torch.empty(4, device="acme:0")
    with pytest.raises(RuntimeError, match="the stream is on acme:1 but the memory is on acme:0"):
        t.record_stream(torch.Stream(device="acme:1"))
    del t


# ---- out of memory ----

def test_out_of_memory_empties_the_cache_and_retries_then_raises():
    out = run_json("""
        import json, torch, torch_acme
        MiB = 1 << 20
        # Fill the 64 MiB device with cached, unused segments.
        blocks = [torch.empty(20 * MiB, dtype=torch.uint8, device="acme") for _ in range(3)]
        del blocks
        cached = torch.acme.memory_reserved()
        big = torch.empty(40 * MiB, dtype=torch.uint8, device="acme")  # fits only after a flush
        stats = torch.acme.memory_stats()
        after_retry = [cached, stats["num_alloc_retries"], stats["num_ooms"],
                       torch.acme.memory_reserved()]
        try:
            torch.empty(40 * MiB, dtype=torch.uint8, device="acme")
            message = None
        except torch.OutOfMemoryError as e:
            message = str(e).splitlines()[0]
        stats = torch.acme.memory_stats()
        del big
        usable = torch.ones(3, device="acme").sum().item()
        print(json.dumps([after_retry, message, stats["num_alloc_retries"], stats["num_ooms"],
                          usable]))
    """, ACME_DEVICE_MEMORY="64M")
    after_retry, message, retries, ooms, usable = out
    assert after_retry == [60 * 1024 * 1024, 1, 0, 40 * 1024 * 1024]
    assert message.startswith("acme out of memory. Tried to allocate 40.00 MiB. Device 0 has a "
                              "total capacity of 64.00 MiB of which 24.00 MiB is free. Of the "
                              "memory in use, 40.00 MiB is allocated by PyTorch, and 0 bytes is "
                              "reserved by PyTorch but unallocated"), message
    assert (retries, ooms, usable) == (2, 1, 3.0)


def test_a_device_smaller_than_a_segment_still_serves_small_tensors():
    out = run_json("""
        import json, torch, torch_acme
        kept = [torch.ones(64 * 1024, device="acme") for _ in range(3)]  # 3 x 256 KiB
        reserved = torch.acme.memory_reserved()
        print(json.dumps([t.sum().item() for t in kept] + [reserved]))
    """, ACME_DEVICE_MEMORY="1M")
    assert out == [65536.0] * 3 + [3 * 256 * 1024]


# ---- pinned host memory ----

def test_pinned_memory_is_cached_by_pytorchs_host_allocator():
    torch.accelerator.empty_host_cache()
    before = torch.acme.host_memory_stats()["num_host_alloc"]
    a = torch.ones(1000).pin_memory()
    assert a.is_pinned() and not torch.ones(1000).is_pinned()
    del a
    b = torch.empty(1000, pin_memory=True)  # same power-of-two size: the cached block
    assert b.is_pinned()
    assert torch.acme.host_memory_stats()["num_host_alloc"] - before == 1
    del b
    torch.accelerator.empty_host_cache()
    assert torch.acme.host_memory_stats()["allocated_bytes.current"] == 0


def test_non_blocking_copies_both_ways():
    x = torch.randn(1000).pin_memory()
    d = x.to("acme", non_blocking=True)
    back = d.to("cpu", non_blocking=True)
    torch.acme.synchronize()
    assert back.is_pinned()  # a non-blocking copy to the CPU lands in pinned memory
    assert torch.equal(back, x)
    del d


def test_data_loader_pins_batches_that_train_on_the_device():
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator))
    model = torch.nn.Linear(8, 1).to("acme")
    reference = torch.nn.Linear(8, 1)
    reference.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for x, y in DataLoader(data, batch_size=16, pin_memory=True):
        assert x.is_pinned() and y.is_pinned()
        for m, opt, dev in ((model, optimizers[0], "acme"), (reference, optimizers[1], "cpu")):
            loss = torch.nn.functional.mse_loss(m(x.to(dev, non_blocking=True)),
                                                y.to(dev, non_blocking=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
    torch.testing.assert_close(model.weight.cpu(), reference.weight)
    del model, optimizers


# ---- the GIL ----

# The allocator runs on threads that do not hold the GIL (here the autograd
# engine's device thread), while the Python thread that does may be waiting
# for them: it must never take the GIL. This thread starts a backward on
# another thread, and once the device thread has allocated, keeps the GIL
# (a switch interval of 1,000 s) until the device thread has made all the
# backward's allocations and frees, or 3 s have passed. The second graph has
# a Python autograd Function near its input, which the backward reaches
# hundreds of steps after the hold began: its backward needs the GIL, and the
# device thread stops there, which shows the check sees a GIL taken.
GIL_FREE = """
import json, os, sys, threading, time, warnings, torch, torch_acme
warnings.simplefilter("ignore")
device = torch_acme.DEVICE_NAME

class PythonBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return grad * 1

def graph(python_node):
    x = torch.randn(256, 1024, device=device, requires_grad=True)
    y = x
    for i in range(400):
        y = y * 1.01 + 0.5
        if python_node and i == 10:
            y = PythonBackward.apply(y)
    return y.sum()

def allocations():
    return torch.accelerator.memory_stats()["allocation.all.allocated"]

profiling = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                   profile_memory=True) if os.environ["PROFILED"] == "1" else None
if profiling:
    profiling.__enter__()  # the allocator reports each allocation to the profiler
totals, results = [], []
for python_node in (False, True):
    loss = graph(python_node)
    before = allocations()
    loss.backward()
    totals.append(allocations() - before)
for python_node, total in zip((False, True), totals):
    loss = graph(python_node)
    before = allocations()
    worker = threading.Thread(target=loss.backward)
    worker.start()
    while allocations() == before:
        pass  # until the device thread allocates: the backward has released the GIL
    sys.setswitchinterval(1000.0)
    start = time.monotonic()
    while allocations() - before < total and time.monotonic() < start + 3:
        pass
    made = allocations() - before
    sys.setswitchinterval(0.005)
    worker.join()
    results.append(made)
if profiling:
    profiling.__exit__(None, None, None)
print(json.dumps({"totals": totals, "made": results}))
"""


@pytest.mark.parametrize("profiled", ["0", "1"], ids=["plain", "profile_memory"])
def test_the_allocator_never_takes_the_gil(profiled):
    done = run_in_stage(LAST, GIL_FREE, PROFILED=profiled)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    (total, total_with_python), (made, made_with_python) = got["totals"], got["made"]
    assert total > 400, got  # a gradient per step, at least
    assert made == total, f"the device thread stalled while this thread held the GIL: {got}"
    assert made_with_python < total_with_python, f"a Python backward ran without the GIL?: {got}"


# ---- robustness ----

def test_mixed_sizes_from_threads_leave_nothing_allocated():
    before = torch.acme.memory_allocated()
    errors = []

    def work(seed):
        rng = random.Random(seed)
        try:
            live = []
            for _ in range(2000):
                if live and rng.random() < 0.5:
                    live.pop(rng.randrange(len(live)))
                else:
                    live.append(torch.empty(rng.choice([1, 100, 5000, 300_000, 1_500_000]),
                                            dtype=torch.uint8, device=f"acme:{seed % 2}"))
        except Exception as e:  # reported below, on the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert torch.acme.memory_allocated() == before
    assert torch.acme.memory_allocated(1) == 0
    torch.acme.empty_cache()
    assert torch.acme.memory_reserved(1) == 0


@pytest.mark.parametrize("freed", [False, True], ids=["live", "cached"])
def test_checked_mode_still_faults_on_host_access(freed):
    code = f"""
        import ctypes, torch, torch_acme
        t = torch.arange(8.0, device="acme")
        address = t.data_ptr()
        if {freed}:
            del t  # back in the cache: still device memory
        print("reading", flush=True)
        ctypes.c_float.from_address(address).value
        print("survived", flush=True)
    """
    proc = run_in_stage(LAST, textwrap.dedent(code))
    assert proc.returncode != 0 and "survived" not in proc.stdout
    assert "acme: the host touched device memory at" in proc.stderr
    assert "(2097152 bytes, device 0)" in proc.stderr  # the segment holding the block


def test_cache_makes_checked_allocation_cheap():
    # Not a timing assert: the runtime is asked for memory once, not per tensor.
    torch.acme.reset_accumulated_memory_stats()
    for _ in range(1000):
        torch.ones(4, device="acme").add_(1)
    assert torch.acme.memory_stats()["num_device_alloc"] <= 1


def test_poison_mode_shows_reads_of_memory_nobody_wrote():
    code = """
        import json, torch, torch_acme
        from torch_acme import runtime
        t = torch.ones(256, device="acme")
        del t
        recycled = torch.empty(256, device="acme").cpu()  # the same block, unwritten
        ptr = runtime.malloc(8)
        raw = runtime.copy_to_host(ptr, 8)
        runtime.free(ptr)
        print(json.dumps([runtime.checked_mode(), recycled[:2].tolist(), raw.hex()]))
    """
    plain = run_json(code)
    poisoned = run_json(code, ACME_CHECKED="2")
    # Checked mode alone hands the last tensor's values on, and fresh pages are zero.
    assert plain == [True, [1.0, 1.0], "00" * 8]
    assert poisoned[0] is True and poisoned[2] == "ff" * 8
    assert all(v != v for v in poisoned[1])  # NaN
