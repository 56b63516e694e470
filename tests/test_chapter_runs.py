"""The stored chapter runs the site renders (tools/chapter_runs.py) are never stale."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time

import nbformat
import pytest

from conftest import CHAPTERS, ROOT, stage_path
from tools import chapter_runs

FIRST = CHAPTERS[0]


@pytest.fixture
def build(tmp_path, monkeypatch):
    """A build folder of its own holding a copy of stage 0's package."""
    package = tmp_path / "packages" / "stage-00" / "torch_acme"
    shutil.copytree(stage_path(0) / "torch_acme", package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("ACME_BUILD_DIR", str(tmp_path))
    return package


def store(chapter, key: str) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["acme_key"] = key
    chapter_runs.stored(chapter).parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, chapter_runs.stored(chapter))


def test_a_run_is_reused_only_under_its_key(build):
    assert chapter_runs.cached(FIRST) is None  # nothing stored yet
    store(FIRST, chapter_runs.key(FIRST))
    assert chapter_runs.cached(FIRST) is not None
    store(FIRST, "a key of other inputs")
    assert chapter_runs.cached(FIRST) is None


def test_the_key_follows_the_stage_build(build):
    before = chapter_runs.key(FIRST)
    assert chapter_runs.key(FIRST) == before  # deterministic
    extension = next(build.glob("_C*.so"))
    extension.write_bytes(extension.read_bytes() + b"\0")  # a rebuilt extension
    assert chapter_runs.key(FIRST) != before
    # Python caches written by importing the stage do not count.
    changed = chapter_runs.key(FIRST)
    (build / "__pycache__").mkdir()
    (build / "__pycache__" / "device.cpython-311.pyc").write_bytes(b"cache")
    assert chapter_runs.key(FIRST) == changed


def test_a_run_with_an_unexpected_error_is_not_kept():
    ok = nbformat.v4.new_code_cell("1", execution_count=1)
    raised = nbformat.v4.new_code_cell("1 / 0", execution_count=2)
    raised.outputs = [nbformat.v4.new_output("error", ename="ZeroDivisionError", evalue="", traceback=[])]
    notebook = nbformat.v4.new_notebook(cells=[ok, raised])
    assert chapter_runs.misbehaving_cells(notebook) == ["cell raised:\n1 / 0"]
    raised.metadata["tags"] = ["raises-exception"]
    assert chapter_runs.misbehaving_cells(notebook) == []
    ok.execution_count = None  # a cell that never ran
    assert chapter_runs.misbehaving_cells(notebook) == ["cell did not run:\n1"]
    ok.execution_count, raised.outputs = 1, []  # a tagged cell that did not raise
    assert chapter_runs.misbehaving_cells(notebook) == ["cell expected to raise did not:\n1 / 0"]


def test_a_chapter_runs_once_in_a_session(build, monkeypatch):
    made = []

    def execute(chapter):  # stands in for running the notebook
        made.append(chapter["number"])
        store(chapter, chapter_runs.key(chapter))
        return chapter_runs.cached(chapter)

    monkeypatch.setattr(chapter_runs, "execute", execute)
    began = time.time()
    store(FIRST, chapter_runs.key(FIRST))
    os.utime(chapter_runs.stored(FIRST), (began - 60, began - 60))  # a run of an earlier session
    chapter_runs.run_once(FIRST, began)
    assert made == [0]
    chapter_runs.run_once(FIRST, began)  # this session's run, made by another process
    assert made == [0]
    store(FIRST, "a key of other inputs")  # stored in this session, but stale
    chapter_runs.run_once(FIRST, began)
    assert made == [0, 0]


def test_one_process_at_a_time_holds_a_chapter(build):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tools import chapter_runs\n"
         f"with chapter_runs.locked({FIRST!r}):\n"
         "    print('held', flush=True); sys.stdin.readline()"],
        cwd=ROOT, env=dict(os.environ), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    lock = chapter_runs.stored(FIRST).with_suffix(".lock")
    with lock.open("w") as handle:
        with pytest.raises(BlockingIOError):
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.communicate("\n", timeout=60)
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once the holder let go
    assert holder.returncode == 0
