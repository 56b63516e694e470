"""Device memory comes back: the leak check itself, and the paths most likely to leak.

conftest.py's autouse fixtures check every test in this process: the (bytes,
blocks) in use on each device must be the same after a test as before it, and
zero at the end of each module. The first tests here check that the check
catches what it should, by running a small pytest session with conftest.py
as a plugin; the others exercise error paths (an exception half-way through
an op), where a backend typically forgets to free.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import torch_acme
from conftest import LAST, device_memory_in_use, stage_env
from torch_acme import _build_info, runtime

pytestmark = pytest.mark.skipif(_build_info.STAGE != LAST,
                                reason=f"written for the finished backend (stage {LAST})")
DEVICE = getattr(torch_acme, "DEVICE_NAME", "privateuseone")
TESTS = Path(__file__).resolve().parent


def test_in_use_counts_bytes_and_blocks():
    before = device_memory_in_use()
    t = torch.empty(1000, dtype=torch.uint8, device=f"{DEVICE}:1")
    after = device_memory_in_use()
    assert after[1] == (before[1][0] + 1000, before[1][1] + 1) and after[0] == before[0]
    del t
    assert device_memory_in_use() == before


def test_in_use_collects_cycles_before_judging():
    before = device_memory_in_use()
    holder = [torch.ones(256, device=DEVICE)]
    holder.append(holder)  # a reference cycle: only the collector frees it
    del holder
    assert device_memory_in_use(collect=False)[0] == (before[0][0] + 1024, before[0][1] + 1)
    assert device_memory_in_use() == before


SESSION = '''
import pytest
import torch
import torch_acme

KEPT = []


@pytest.fixture(scope="module")
def weights():
    yield torch.ones(256, device="acme")   # held for the module's tests, released at its end


def test_uses_module_fixture(weights):
    assert weights.sum().item() == 256


def test_uses_module_fixture_again(weights):
    assert weights.sum().item() == 256


def test_clean():
    t = torch.ones(10, device="acme")
    assert t.sum().item() == 10


def test_cycle_freed_by_the_collector():
    cycle = [torch.ones(10, device="acme")]
    cycle.append(cycle)


def test_leaks():
    KEPT.append(torch.ones(1000, device="acme"))
'''

FAILING = '''
import torch
import torch_acme


def test_fails_holding_a_tensor():
    t = torch.ones(10, device="acme")
    assert t.sum().item() == 11
'''


def test_the_check_catches_a_leak_and_nothing_else(tmp_path):
    (tmp_path / "test_session.py").write_text(SESSION)
    (tmp_path / "test_failing.py").write_text(FAILING)
    report = tmp_path / "report.json"
    plugin = tmp_path / "collect_outcomes.py"
    plugin.write_text(textwrap.dedent('''
        import json
        outcomes = {}
        def pytest_runtest_logreport(report):
            if report.failed or report.when == "call":
                key = f"{report.nodeid.split('/')[-1]}:{report.when}"
                outcomes[key] = [report.outcome, str(report.longrepr) if report.failed else ""]
        def pytest_sessionfinish(session):
            with open(%r, "w") as f:
                json.dump(outcomes, f)
    ''' % str(report)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(tmp_path)]),
               TORCH_DEVICE_BACKEND_AUTOLOAD="0", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "collect_outcomes", "-q",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    outcomes = json.loads(report.read_text())
    summary = {key: outcome for key, (outcome, _) in outcomes.items()}
    assert summary == {
        "test_failing.py::test_fails_holding_a_tensor:call": "failed",  # no leak error on top
        "test_session.py::test_uses_module_fixture:call": "passed",
        "test_session.py::test_uses_module_fixture_again:call": "passed",
        "test_session.py::test_clean:call": "passed",
        "test_session.py::test_cycle_freed_by_the_collector:call": "passed",
        "test_session.py::test_leaks:call": "passed",
        "test_session.py::test_leaks:teardown": "failed",  # the per-test check
    }, proc.stdout + proc.stderr
    message = outcomes["test_session.py::test_leaks:teardown"][1]
    # 4000 bytes more than before the test (the module fixture's 1024 bytes stay).
    assert ("device memory left in use, as (bytes, blocks) per device: [(5024, 2), (0, 0)] "
            "after the test, [(1024, 1), (0, 0)] before it") in message, message


# ---- error paths ----

def test_failing_fallback_op_frees_its_copies():
    a = torch.ones(2, 3, device=DEVICE)
    before = device_memory_in_use()
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.mm(a, a)  # inputs went to the host, the CPU kernel raised
    assert device_memory_in_use() == before


def test_failing_in_place_op_frees_its_copies():
    a = torch.ones(3, device=DEVICE)
    before = device_memory_in_use()
    with pytest.raises(RuntimeError):
        a.add_(torch.ones(4, device=DEVICE))
    assert device_memory_in_use() == before
    assert torch.equal(a.cpu(), torch.ones(3))  # untouched


def test_autograd_graph_is_released():
    before = device_memory_in_use()
    x = torch.randn(4, 4).to(DEVICE).requires_grad_()
    loss = (torch.tanh(x @ x) * 3).sum()
    loss.backward(retain_graph=True)
    loss.backward()  # the retained graph, then freed
    assert x.grad is not None
    del x, loss
    assert device_memory_in_use() == before


def test_resize_growth_frees_the_old_block():
    t = torch.arange(4.0, device=DEVICE)
    before = device_memory_in_use()
    t.resize_(1000)
    assert device_memory_in_use()[0] == (before[0][0] - 16 + 4000, before[0][1])
    assert torch.equal(t[:4].cpu(), torch.arange(4.0))


def test_raw_allocations_of_a_failed_copy_are_intact():
    ptr = runtime.malloc(64)
    try:
        with pytest.raises(runtime.AcmeError, match="overruns the device allocation"):
            runtime.copy_to_device(ptr, bytes(128))
        assert runtime.memory_stats(0)["blocks_in_use"] >= 1
    finally:
        runtime.free(ptr)


OUT_OF_MEMORY_MIDWAY = """
import json, torch, torch_acme
from torch_acme import runtime

def in_use():
    # Bytes tensors hold (the caching allocator's requested bytes) plus raw
    # runtime allocations (whatever the runtime holds beyond the cache's segments).
    out = []
    for d in range(runtime.device_count()):
        cache = torch.accelerator.memory_stats(d)
        out.append(runtime.memory_stats(d)["bytes_in_use"] - cache["reserved_bytes.all.current"]
                   + cache["requested_bytes.all.current"])
    return out

steps = {}
x = torch.ones(176 * 1024, device="acme")          # 704 KiB of 1 MiB
steps["x"] = in_use()
for name, op in [("cat", lambda: torch.cat([x, x])),          # result does not fit
                 ("fallback", lambda: torch.sin(x)),           # result does not fit
                 ("to", lambda: torch.ones(300 * 1024).to("acme")),  # copy does not fit
                 ("grow", lambda: torch.ones(1024, device="acme").resize_(300 * 1024))]:
    try:
        op()
        steps[name] = "no error"
    except torch.OutOfMemoryError:
        steps[name] = in_use()
del x
steps["end"] = in_use()
print(json.dumps(steps))
"""


def test_out_of_memory_midway_frees_what_was_taken():
    env = stage_env(LAST, ACME_DEVICE_MEMORY="1M", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", OUT_OF_MEMORY_MIDWAY], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    steps = json.loads(proc.stdout.splitlines()[-1])
    held = [176 * 1024 * 4, 0]
    assert steps == {"x": held, "cat": held, "fallback": held, "to": held, "grow": held,
                     "end": [0, 0]}, steps
