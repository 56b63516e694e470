"""Shared test set-up.

The pytest process itself imports the *last* stage (the finished backend), so
unit tests can `import torch_acme`. Anything that needs another stage runs in a
subprocess or a Jupyter kernel of its own: only one PrivateUse1 backend can
live in a process.
"""

from __future__ import annotations

import os
import subprocess
import sys
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


def stage_dir(number: int) -> Path:
    return BUILD / "stages" / f"stage-{number:02d}"


def stage_env(number: int, **extra: str) -> dict[str, str]:
    """The environment a process needs to import stage `number`'s torch_acme."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(stage_dir(number) / "src")
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env.update(extra)
    return env


def run_in_stage(number: int, code: str, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=stage_env(number, **extra_env),
                          capture_output=True, text=True, timeout=300)


def pytest_addoption(parser):
    parser.addoption("--upto", type=int, default=LAST, help="last chapter to test")


def pytest_configure(config):
    # The newest stage under test is the one this process imports.
    newest = stage_dir(config.getoption("--upto"))
    if not (newest / "src" / "torch_acme" / "_build_info.py").exists():
        raise pytest.UsageError(f"{newest} is not built: run `nox -s tests` (it builds every stage)")
    sys.path.insert(0, str(newest / "src"))


def built_stages(config) -> list[int]:
    return [c["number"] for c in CHAPTERS if c["number"] <= config.getoption("--upto")]


@pytest.fixture
def no_leaks():
    """Fails a test that leaves acme memory allocated."""
    from torch_acme import runtime

    def in_use():
        stats = [runtime.memory_stats(d) for d in range(runtime.device_count())]
        return [(s["bytes_in_use"], s["blocks_in_use"]) for s in stats]

    import gc
    gc.collect()
    before = in_use()
    yield
    gc.collect()
    assert in_use() == before
