"""Shared test set-up.

The pytest process itself imports the *last* stage (the finished backend), so
unit tests can `import torch_acme`. Anything that needs another stage runs in a
subprocess or a Jupyter kernel of its own: only one PrivateUse1 backend can
live in a process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# ACME_BUILD_DIR lets several build folders coexist (e.g. one per engineer).
BUILD = Path(os.environ.get("ACME_BUILD_DIR", ROOT / "_build")).resolve()
# The per-stage kernels written by `tools/build_stages.py --kernels` live here.
os.environ["JUPYTER_PATH"] = str(BUILD / "jupyter")
CHAPTERS = tomllib.loads((ROOT / "chapters" / "chapters.toml").read_text())["chapter"]
LAST = CHAPTERS[-1]["number"]

sys.path.insert(0, str(ROOT))

from tools import preforked  # noqa: E402


def stage_dir(number: int) -> Path:
    """Stage `number`'s snapshot: the clean source tree a vendor copies."""
    return BUILD / "stages" / f"stage-{number:02d}"


def stage_path(number: int) -> Path:
    """What goes on sys.path to import stage `number`'s build (tools/build_stages.py)."""
    return BUILD / "packages" / f"stage-{number:02d}"


def stage_built(number: int) -> bool:
    return (stage_path(number) / "torch_acme" / "_build_info.py").exists()


# Chapter 15's stand-in third-party library (tests/third_party/boxkit), built
# beside the stages: importable as `boxkit` with this on sys.path.
THIRD_PARTY = BUILD / "third_party"


def stage_env(number: int, **extra: str) -> dict[str, str]:
    """The environment a process needs to import stage `number`'s torch_acme."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(stage_path(number))
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env.update(extra)
    return env


def run_in_stage(number: int, code: str, *, fresh: bool = False,
                 **extra_env: str) -> subprocess.CompletedProcess:
    """`code` in a new process against stage `number` (tools/preforked.py; `fresh`:
    a new interpreter, for what happens at exit)."""
    return preforked.python(["-c", code], stage_env(number, **extra_env), fresh=fresh)


def pytest_addoption(parser):
    parser.addoption("--upto", type=int, default=LAST, help="last chapter to test")


def pytest_configure(config):
    # The newest stage under test is the one this process imports.
    newest = config.getoption("--upto")
    if not stage_built(newest):
        raise pytest.UsageError(f"{stage_path(newest)} is not built: run `nox -s tests` (it builds every stage)")
    sys.path.insert(0, str(stage_path(newest)))
    # When this session began, for the workers and the site's build too: a
    # chapter run stored since then is this session's (chapter_runs.run_once).
    os.environ.setdefault(SESSION_START, repr(time.time()))


SESSION_START = "BOOK_TEST_SESSION_START"
# The book is one unit of three files, in this order: the site is built from
# what the other two leave in the build folder. Its odd-numbered chapters are a
# unit of their own, which the other worker runs meanwhile: a chapter is run
# once in the session, by whichever process comes to it first, and the site
# waits for one being run (tools/chapter_runs.py, run_once and locked).
BOOK = ("/test_chapters.py", "/test_conformance.py", "/test_site.py")
ODD_CHAPTER = re.compile(r"::test_chapter_runs_against_its_stage\[ch\d*[13579]-")
# The vendor test builds the final stage from nothing with CMake: a unit of its own.
VENDOR_TEST = "/test_packaging.py::test_vendor_copies_installs_and_renames_the_final_stage"
# The longest units, longest first (a fresh clone's --durations, 2 workers):
# each runs as soon as a worker is free, and the short files fill in at the end.
LONGEST_FIRST = ("book", "odd chapters", "vendor", "tests/test_packaging.py",
                 "tests/test_stage_matrix.py", "tests/test_distributed.py",
                 "tests/test_capstone.py", "tests/test_bad_inputs.py", "tests/test_runtime.py",
                 "tests/test_threads.py")


def work_unit(nodeid: str) -> str:
    """What one pytest-xdist worker runs whole: a test file, the book, its odd
    chapters, or the vendor test."""
    path = nodeid.split("::", 1)[0]
    if path.endswith(BOOK):
        return "odd chapters" if ODD_CHAPTER.search(nodeid) else "book"
    return "vendor" if nodeid.endswith(VENDOR_TEST) else path


def pytest_collection_modifyitems(config, items):
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(work_unit(item.nodeid), len(rank)))  # stable


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`nox -s tests` runs the suite on two pytest-xdist workers, a unit
    (work_unit) at a time, so module-scoped fixtures are set up once. Units go
    out in collection order (LONGEST_FIRST, then the rest) whenever a worker
    is almost out of work: one worker starts on the book, the other on the
    vendor test."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # not by test count: by collection order

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByUnit(config, log)


def built_stages(config) -> list[int]:
    return [c["number"] for c in CHAPTERS if c["number"] <= config.getoption("--upto")]


# ---- leak check (reliability suite; tested by tests/test_leaks.py) ----
# Autouse: every test in this process must give back the device memory it
# took. gc.collect() runs only when the numbers differ (it costs ~30 ms with
# torch loaded), since reference cycles may still hold tensors.

def device_memory_in_use(collect: bool = True, expect=None) -> list[tuple[int, int]]:
    """(bytes, blocks) in use on each acme device (waiting briefly for `expect`)."""
    from torch_acme import _build_info, runtime

    def measure():
        stats = [runtime.memory_stats(d) for d in range(runtime.device_count())]
        counts = [(s["bytes_in_use"], s["blocks_in_use"]) for s in stats]
        if _build_info.STAGE < 12:
            return counts
        # From chapter 12 the caching allocator keeps freed blocks' segments:
        # what tensors hold is its allocated figure, and raw runtime allocations
        # are whatever the runtime holds beyond the allocator's segments.
        import torch
        cached = [torch.accelerator.memory_stats(d) for d in range(len(counts))]
        return [(b - c["reserved_bytes.all.current"] + c["requested_bytes.all.current"],
                 n - c["segment.all.current"] + c["allocation.all.current"])
                for (b, n), c in zip(counts, cached)]

    now = measure()
    if collect and any(b or n for b, n in now):
        import gc
        import time
        gc.collect()
        now = measure()
        # The autograd engine runs an acme backward on its device thread, which
        # drops its last reference to the graph (and so to the leaves the graph
        # holds) just after torch.autograd.grad has returned in this thread.
        # Give it up to half a second to reach `expect` before calling memory leaked.
        for _ in range(50 if expect is not None else 0):
            if now == expect:
                break
            time.sleep(0.01)
            now = measure()
    return now


def leak_message(before, after) -> str:
    return ("device memory left in use, as (bytes, blocks) per device: "
            f"{after} after the test, {before} before it")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # A failed test's traceback keeps its tensors alive: its failure is the
    # report, not a second "leak" error at teardown.
    report = (yield).get_result()
    if report.when == "call" and report.failed:
        item.acme_call_failed = True
        module = item.getparent(pytest.Module)
        if module is not None:
            module.acme_call_failed = True


@pytest.fixture(autouse=True, scope="module")
def no_leaks_in_module(request):
    """At the end of a module, after its module-scoped fixtures: nothing at all in use."""
    yield
    if getattr(request.node, "acme_call_failed", False):
        return
    from torch_acme import runtime
    nothing = [(0, 0)] * runtime.device_count()
    after = device_memory_in_use(expect=nothing)
    assert after == nothing, leak_message(nothing, after)


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fails a test that leaves acme memory allocated.

    Relative to the start of the test, so a module-scoped fixture may keep
    device tensors for its module's tests (no_leaks_in_module checks that
    they are let go).
    """
    before = device_memory_in_use()
    yield
    if getattr(request.node, "acme_call_failed", False):
        return
    after = device_memory_in_use(collect=False)
    if after != before:
        after = device_memory_in_use(expect=before)  # collect, wait, then judge
    assert after == before, leak_message(before, after)


def dispatch_row(op: str, key: str = "PrivateUse1") -> str:
    """The row of `op`'s dispatch table for `key` ("" if the table has none).

    The row names the file that registered the kernel and its kind, e.g.
    "PrivateUse1: registered at .../cpu_fallback.cpp:162 [backend fallback]".
    """
    import torch

    rows = torch._C._dispatch_dump_table(op).splitlines()
    return next((row for row in rows if row.startswith(key + ":")), "")


def composites_where_the_cpu_has_a_kernel(composite_key: str) -> list[str]:
    """ATen ops (with overload) that acme runs through a `composite_key` kernel
    although the CPU has a kernel of its own: no PrivateUse1 kernel, so acme
    gets the composite, which may round differently from the CPU's kernel."""
    import torch

    C = torch._C
    found = []
    for name in C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        for schema in C._jit_get_schemas_for_operator(name):
            op = name + ("." + schema.overload_name if schema.overload_name else "")
            try:
                has = lambda key: C._dispatch_has_kernel_for_dispatch_key(op, key)  # noqa: E731
                if not has("CPU") or has("PrivateUse1"):
                    continue
            except RuntimeError:
                continue  # a TorchScript-only name
            if has(composite_key):
                found.append(op)
    return found


def run_threads(target, count: int, timeout: float = 300) -> None:
    """Runs target(index) on `count` threads started together; re-raises the first failure.

    PyTorch releases the GIL inside its ops, so the threads really do run the
    backend concurrently. A thread still running after `timeout` seconds fails
    the test as a hang.
    """
    import threading
    import warnings

    errors: list[BaseException] = []
    barrier = threading.Barrier(count)  # start together, for the most overlap

    def body(index):
        try:
            barrier.wait()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the fallback's one-time notices
                target(index)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    if errors:
        raise errors[0]
