"""Many threads on the device at once: no crash, right answers, nothing left behind.

PyTorch releases the GIL inside its ops, so these threads really do run the
allocator, the device guard, the CPU fallback's copies and the runtime
concurrently. Each thread checks every result against the same computation on
the CPU; the main thread checks that all device memory came back.

The runtime alone also runs under ThreadSanitizer: test_runtime_under_thread_sanitizer
builds csrc/runtime/*.cpp with a C++ driver (tests/runtime_threads_driver.cpp)
and -fsanitize=thread, in a few seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_acme
from conftest import LAST, ROOT, device_memory_in_use
from conftest import run_threads as shared_run_threads
from torch_acme import _build_info, runtime

pytestmark = pytest.mark.skipif(_build_info.STAGE != LAST,
                                reason=f"written for the finished backend (stage {LAST})")
DEVICE = getattr(torch_acme, "DEVICE_NAME", "privateuseone")
THREADS = 8
ITERATIONS = 1000


def run_threads(target, count=THREADS):
    shared_run_threads(target, count)


def test_threads_compute_on_both_devices():
    before = device_memory_in_use()
    peak_before = [runtime.memory_stats(d)["peak_bytes"] for d in range(2)]

    def work(index):
        home, other = index % 2, 1 - index % 2
        torch_acme.device.set_device(home)  # per thread: the others keep theirs
        rng = torch.Generator().manual_seed(index)
        for i in range(ITERATIONS):
            a = torch.randn(8, 12, generator=rng)
            b = torch.randn(12, 8, generator=rng)
            # Allocation on the thread's current device, no index given.
            da = a.to(DEVICE)
            db = torch.empty(12, 8, device=DEVICE).copy_(b)
            assert da.device.index == db.device.index == home
            # Fallback ops, an in-place op through a view, a reduction.
            c = torch.mm(da, db)
            c[:, ::2].add_(1.0)
            total = c.sum(dim=1)
            # Across devices and back to the host.
            moved = c.t().to(f"{DEVICE}:{other}")
            assert moved.device.index == other
            expected = a @ b
            expected[:, ::2] += 1.0
            assert torch.equal(c.cpu(), expected), (index, i)
            assert torch.equal(moved.cpu(), expected.t()), (index, i)
            assert torch.equal(total.cpu(), expected.sum(dim=1)), (index, i)
            # Scalars read back on the host.
            assert c[0, 0].item() == expected[0, 0].item()
            if i % 10 == 0:
                torch_acme.device.synchronize()
        assert torch_acme.device.current_device() == home

    run_threads(work)
    assert device_memory_in_use() == before
    peaks = [runtime.memory_stats(d)["peak_bytes"] for d in range(2)]
    assert all(p >= b and p > 0 for p, b in zip(peaks, peak_before))
    assert torch_acme.device.current_device() == 0  # the main thread's is untouched


def test_threads_run_autograd_concurrently():
    before = device_memory_in_use()

    def work(index):
        rng = torch.Generator().manual_seed(100 + index)
        device = f"{DEVICE}:{index % 2}"
        for i in range(ITERATIONS // 3):
            w = torch.randn(6, 6, generator=rng)
            x = torch.randn(4, 6, generator=rng)
            dw = w.to(device).requires_grad_()
            loss = torch.tanh(x.to(device) @ dw).pow(2).sum()
            loss.backward()
            cw = w.clone().requires_grad_()
            torch.tanh(x @ cw).pow(2).sum().backward()
            assert torch.allclose(dw.grad.cpu(), cw.grad, rtol=1e-5, atol=1e-6), (index, i)

    run_threads(work)
    assert device_memory_in_use() == before


def test_threads_share_tensors_read_only():
    """One tensor read by every thread at once (copies to the host, views, ops)."""
    host = torch.arange(4096.0).reshape(64, 64)
    shared = host.to(DEVICE)

    def work(index):
        for i in range(ITERATIONS):
            row = (index * 7 + i) % 64
            assert torch.equal(shared[row].cpu(), host[row])
            assert torch.equal((shared[:, row] * 2).cpu(), host[:, row] * 2)
            if i % 25 == 0:
                assert torch.equal(shared.cpu(), host)

    run_threads(work)
    assert torch.equal(shared.cpu(), host)


def test_threads_raw_runtime_with_errors():
    """The runtime's per-thread last error stays per thread under concurrency."""
    def work(index):
        runtime.set_device(index % 2)
        for i in range(ITERATIONS * 4):
            ptr = runtime.malloc(64 + index)
            try:
                if i % 3 == 0:
                    with pytest.raises(runtime.AcmeError, match=f"by {index + 1} bytes"):
                        runtime.copy_to_device(ptr, bytes(64 + 2 * index + 1))
                runtime.copy_to_device(ptr, bytes([index]) * (64 + index))
                assert runtime.copy_to_host(ptr, 64 + index) == bytes([index]) * (64 + index)
            finally:
                runtime.free(ptr)

    run_threads(work)


# ---- ThreadSanitizer: the runtime alone, driven from C++ ----

DRIVER = Path(__file__).with_name("runtime_threads_driver.cpp")


def test_runtime_under_thread_sanitizer(tmp_path):
    """Builds csrc/runtime/*.cpp with the driver under -fsanitize=thread and runs it.

    PyTorch is not built with TSan, so a TSan run of the whole backend would
    report every unannotated synchronization inside libtorch; the runtime
    alone is ours from top to bottom, threads included (the stream workers).
    """
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++")
    # Neither the compiler nor the TSan binary may inherit an ASan preload
    # (nox -s sanitize runs this module with one).
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    sources = sorted(str(p) for p in (ROOT / "csrc" / "runtime").glob("*.cpp"))
    binary = tmp_path / "runtime_threads"
    # -Wno-tsan: TSan does not model the fences of checked mode's fault table
    # (a seqlock read only by the SIGSEGV handler); its fields are atomics.
    build = subprocess.run(
        [compiler, "-std=c++20", "-O1", "-g", "-fsanitize=thread", "-fno-omit-frame-pointer",
         "-Wno-tsan", f"-I{ROOT / 'csrc'}", *sources, str(DRIVER), "-o", str(binary), "-pthread"],
        env=env, capture_output=True, text=True, timeout=600)
    if build.returncode != 0 and "libtsan" in build.stderr:
        pytest.skip(f"no ThreadSanitizer runtime: {build.stderr.strip()[-200:]}")
    assert build.returncode == 0, build.stderr
    env.update(TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1", ACME_DEVICE_MEMORY="64M")
    for checked in ("1", "0"):
        env["ACME_CHECKED"] = checked
        proc = subprocess.run([str(binary)], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and "WARNING: ThreadSanitizer" not in proc.stderr, (
            f"ACME_CHECKED={checked}\n{proc.stdout}\n{proc.stderr}")
        assert "ok:" in proc.stdout, proc.stdout
        print(f"ACME_CHECKED={checked}: {proc.stdout.strip()}", file=sys.stderr)
