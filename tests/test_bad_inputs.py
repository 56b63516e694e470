"""Every row of tests/bad_inputs.toml: the error it promises, and a process that survives it.

The same table is the docs page "Errors you will meet" (docs/errors.md): a row
that passes here is exactly what the page shows.

- In-process rows run in this process, against the last stage. The exception
  must have the row's exact type and contain its message fragment; then a
  small op on each device must still compute the right thing, and (autouse
  fixture in conftest.py) no device memory may be left in use.
- Fresh-process rows run in a new interpreter, in a scratch directory. The
  child must end with a Python traceback whose last line is the expected
  exception, and exit status 1: a signal (a crash) fails the row.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import textwrap
import tomllib
import traceback
import warnings
from pathlib import Path

import pytest
import torch
from torch.torch_version import TorchVersion

from conftest import CHAPTERS, LAST, stage_built, stage_path
from tools import preforked
from tools.chapter_support import compiled_accelerator

# The table describes the finished backend: with --upto before the last
# chapter, this process imports an earlier stage.
pytestmark = pytest.mark.skipif(
    importlib.import_module("torch_acme._build_info").STAGE != LAST,
    reason=f"the bad-input table describes the finished backend (stage {LAST})")

TABLE = Path(__file__).with_name("bad_inputs.toml")
ROWS = tomllib.loads(TABLE.read_text())["row"]
FRESH_ONLY = {"stage", "backend", "env", "prepare", "cpu_only_torch", "since_torch"}
FIELDS = {"id", "chapter", "topic", "title", "setup", "code", "error", "message", "demonstrates",
          "process"} | FRESH_ONLY
CHAPTER_NUMBERS = {c["number"] for c in CHAPTERS}
TOPICS = ("devices", "memory", "ops", "custom-ops", "processes", "autocast", "compile",
          "distributed", "checkpoints", "bring-up")
REQUIRED_IN_ISSUE = {  # the rows the issue asks for, by id
    "device-index-tensor", "device-index-set-device", "cross-device-op", "out-of-memory",
    "host-touch-device-memory", "autocast-dtype", "rename-twice", "checkpoint-without-backend",
    "checkpoint-corrupted", "checkpoint-truncated", "view-no-fallback", "copy-mismatched-shapes",
    "stage-1-no-fallback",
}


def preamble(backend: bool = True) -> str:
    """What every input runs after (the page says so)."""
    return "import torch\n" + ("import torch_acme\nfrom torch_acme import runtime\n" if backend else "")


def resolve(dotted: str) -> type:
    """"torch.OutOfMemoryError" -> the class (imports the leading modules)."""
    parts = dotted.split(".")
    if len(parts) == 1:
        return getattr(__import__("builtins"), dotted)
    # The longest importable module prefix (a class may live in a submodule
    # its package does not import), then attributes.
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
            break
        except ImportError:
            continue
    for part in parts[split:]:
        obj = getattr(obj, part)
    return obj


def printed_name(cls: type) -> str:
    """How a traceback's last line names the class."""
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def by_process(kind: str) -> list[dict]:
    return [r for r in ROWS if r.get("process", "this") == kind]


# ---- the table itself ----

def test_rows_are_well_formed():
    ids = [r["id"] for r in ROWS]
    assert len(ids) == len(set(ids)), "duplicate ids"
    assert REQUIRED_IN_ISSUE <= set(ids), REQUIRED_IN_ISSUE - set(ids)
    for row in ROWS:
        assert set(row) <= FIELDS, (row["id"], set(row) - FIELDS)
        for key in ("id", "topic", "title", "code", "error", "message", "demonstrates"):
            assert isinstance(row.get(key), str) and row[key].strip(), (row["id"], key)
        assert re.fullmatch(r"[a-z0-9-]+", row["id"]), row["id"]
        assert row["topic"] in TOPICS, row["id"]
        # Each card links the chapter that explains the error or its fix.
        assert row.get("chapter") in CHAPTER_NUMBERS, (row["id"], row.get("chapter"))
        assert row.get("process", "this") in ("this", "fresh"), row["id"]
        if row.get("process", "this") == "this":
            extra = FRESH_ONLY & set(row)
            assert not extra, f"{row['id']}: {extra} only apply to fresh-process rows"
        resolve(row["error"])  # names a real exception class
        assert issubclass(resolve(row["error"]), BaseException), row["id"]
        for key in ("setup", "code", "prepare"):
            if key in row:
                compile(row[key], f"{row['id']}:{key}", "exec")


# ---- rows run in this process ----

def device_still_works() -> None:
    """A small op on every device after the error: the process is healthy."""
    import torch
    import torch_acme

    for index in range(torch_acme.runtime.device_count()):
        x = torch.arange(4.0, device=f"{torch_acme.DEVICE_NAME}:{index}")
        assert torch.equal((x * 2 + 1).cpu(), torch.tensor([1.0, 3.0, 5.0, 7.0]))
        assert x.device.index == index
    assert torch_acme.runtime.current_device() == 0


@pytest.mark.parametrize("row", by_process("this"), ids=lambda r: r["id"])
def test_in_process(row):
    expected = resolve(row["error"])
    namespace: dict = {}
    exec(preamble(), namespace)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's one-time notices
        if "setup" in row:
            exec(compile(row["setup"], f"{row['id']}:setup", "exec"), namespace)
        try:
            exec(compile(row["code"], f"{row['id']}:code", "exec"), namespace)
        except BaseException as caught:  # noqa: BLE001 - the row decides what is right
            error = caught
        else:
            pytest.fail(f"{row['id']}: no exception")
    try:
        assert type(error) is expected, (
            f"{row['id']}: {printed_name(type(error))} instead of {row['error']}: {error}")
        assert row["message"] in str(error), f"{row['id']}: message was:\n{error}"
    finally:
        # The traceback's frames hold the row's tensors: drop them, then the namespace.
        traceback.clear_frames(error.__traceback__)
        del error
        namespace.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        device_still_works()


# ---- rows run in a fresh process ----

def fresh_env(row: dict) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACME_")}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env["PYTHONWARNINGS"] = "ignore"
    if row.get("backend", True):
        env["PYTHONPATH"] = str(stage_path(row.get("stage", LAST)))
    else:
        env.pop("PYTHONPATH", None)
    env.update(row.get("env", {}))
    return env


def run_fresh(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return preforked.python(["-c", code], env, cwd)


@pytest.mark.parametrize("row", by_process("fresh"), ids=lambda r: r["id"])
def test_in_fresh_process(row, tmp_path):
    stage = row.get("stage", LAST)
    if not stage_built(stage):
        pytest.skip(f"stage {stage} is not built in this build folder")
    if row.get("cpu_only_torch") and compiled_accelerator() is not None:
        pytest.skip(f"this PyTorch is built with {compiled_accelerator()}: the row holds on a "
                    "CPU-only PyTorch")
    if "since_torch" in row and TorchVersion(torch.__version__) < row["since_torch"]:
        pytest.skip(f"the row holds from PyTorch {row['since_torch']}; this is {torch.__version__}")
    if "prepare" in row:
        prepared = run_fresh(preamble() + textwrap.dedent(row["prepare"]), fresh_env({}), tmp_path)
        assert prepared.returncode == 0, prepared.stderr
    backend = row.get("backend", True)
    guard = "" if backend else (
        "import importlib.util\nassert importlib.util.find_spec('torch_acme') is None\n")
    script = guard + preamble(backend) + textwrap.dedent(row.get("setup", "")) + "\n" + row["code"]
    child = run_fresh(script, fresh_env(row), tmp_path)
    # Once a process group exists, c10d starts every line of an uncaught
    # exception's report with "[rank0]: ".
    child.stderr = re.sub(r"^\[rank\d+\]: ", "", child.stderr, flags=re.MULTILINE)

    assert child.returncode >= 0, f"{row['id']}: killed by signal {-child.returncode}\n{child.stderr}"
    assert child.returncode == 1, f"{row['id']}: exit status {child.returncode}\n{child.stderr}"
    name = printed_name(resolve(row["error"]))
    header = "Traceback (most recent call last):\n"
    assert header in child.stderr, f"{row['id']}: no Python traceback\n{child.stderr}"
    # The exception line is the first unindented line after the last traceback's
    # frames; the message may go on over several lines (the dispatcher's do).
    report = child.stderr[child.stderr.rindex(header) + len(header):]
    lines = report.splitlines()
    first = next(i for i, line in enumerate(lines) if line and not line.startswith(" "))
    assert lines[first].startswith(f"{name}: "), (
        f"{row['id']}: the child raised\n{lines[first]}\nexpected {name}")
    assert row["message"] in "\n".join(lines[first:]), f"{row['id']}:\n{child.stderr}"
