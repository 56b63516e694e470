"""Helpers the chapter notebooks use in their hidden cells and failure demos.

A chapter's kernel (installed by tools/build_stages.py --kernels) sets
ACME_STAGE_DIR to the stage build it must run against; these helpers check that
and reach the neighbouring stages for "what fails before this chapter" cells.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import runpy
import subprocess
import sys
import traceback
from pathlib import Path


def stage_dir(number: int) -> Path:
    return Path(os.environ["ACME_STAGE_DIR"]).parent / f"stage-{number:02d}"


def check_stage(number: int) -> None:
    """Fail unless this kernel imports stage `number`'s build of torch_acme."""
    expected = stage_dir(number).resolve()
    assert Path(os.environ["ACME_STAGE_DIR"]).resolve() == expected, (
        f"this kernel serves {os.environ['ACME_STAGE_DIR']}, not stage {number}")
    spec = importlib.util.find_spec("torch_acme")
    assert spec is not None and spec.origin, "torch_acme is not importable in this kernel"
    package = Path(spec.origin).resolve().parent
    assert package.is_relative_to(expected), f"torch_acme comes from {package}, not {expected}"
    info = runpy.run_path(str(package / "_build_info.py"))
    assert info["STAGE"] == number, f"the build in {package} is stage {info['STAGE']}"


def at_stage(number: int, code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh process against stage `number` (one backend per process)."""
    env = dict(os.environ, PYTHONPATH=str(stage_dir(number) / "src"))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)


def last_error() -> BaseException:
    """The exception the previous cell raised (and forget it, so it is never reused).

    The traceback is dropped too: its frames would keep the failing call's
    tensors (and their device memory) alive.
    """
    error = getattr(sys, "last_value", None)
    assert error is not None, "the previous cell did not raise"
    del sys.last_value
    # IPython keeps its own reference to the traceback (for %debug): empty the
    # frames themselves, so no failed call's locals outlive the cell.
    traceback.clear_frames(error.__traceback__)
    sys.last_traceback = sys.last_type = None
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if shell is not None:
        shell.InteractiveTB.tb = None
        shell._last_traceback = None
    return error.with_traceback(None)


def check_no_leaks() -> None:
    """Every byte of device memory a chapter allocated must be free at its end."""
    from torch_acme import runtime

    gc.collect()
    for device in range(runtime.device_count()):
        stats = runtime.memory_stats(device)
        assert stats["bytes_in_use"] == 0 and stats["blocks_in_use"] == 0, (device, stats)
