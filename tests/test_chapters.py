"""Every chapter is a test: its notebook runs in its own kernel against its own stage."""

from __future__ import annotations

import os
import sys
import tempfile

import jupytext
import pytest
from nbclient.exceptions import CellExecutionError

from conftest import BUILD, CHAPTERS, ROOT, SESSION_START, stage_built, stage_dir
from tools import chapter_runs, chapter_support


def chapters_upto(config) -> list[dict]:
    return [c for c in CHAPTERS if c["number"] <= config.getoption("--upto")]


def pytest_generate_tests(metafunc):
    if "chapter" in metafunc.fixturenames:
        chosen = chapters_upto(metafunc.config)
        metafunc.parametrize("chapter", chosen, ids=[f"ch{c['number']:02d}-{c['slug']}" for c in chosen])


def machine_paths() -> list[str]:
    """Folders whose names must never reach a reader: the checkout, the build, the venv."""
    return sorted({str(ROOT), str(BUILD), sys.prefix, tempfile.gettempdir() + "/"})


def output_text(output) -> str:
    if output.output_type == "stream":
        return output.text
    if output.output_type == "error":  # a reader sees the traceback field
        return "\n".join([output.ename, *output.traceback])
    return "\n".join(str(v) for k, v in output.get("data", {}).items() if k.startswith("text/"))


def test_chapter_runs_against_its_stage(chapter):
    number = chapter["number"]
    notebook = jupytext.read(chapter_runs.source(chapter))
    kernel = notebook.metadata["kernelspec"]["name"]
    # The kernel decides which build the notebook sees: it must be this stage's.
    assert kernel == f"acme-stage-{number:02d}", kernel
    assert stage_built(number)

    try:
        # Executed once in this session, here or by the site's build on the
        # other worker; the site renders this very run (tools/chapter_runs.py).
        notebook = chapter_runs.run_once(chapter, float(os.environ[SESSION_START]))
    except CellExecutionError as error:
        pytest.fail(f"{chapter_runs.source(chapter).name}: a cell failed:\n{error}", pytrace=False)

    # What a reader sees carries no path of the machine that built the book.
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            text = output_text(output)
            for path in machine_paths():
                assert path not in text, (
                    f"{chapter_runs.source(chapter).name}: an output shows {path}:\n{text[:2000]}"
                    f"\nin the output of:\n{cell.source}")

    # ... and no line wider than the text column (chapter_support folds printed
    # lines; a display or a traceback must fit by itself).
    for cell in notebook.cells:
        if {"remove-output", "remove-cell"} & set(cell.get("metadata", {}).get("tags", [])):
            continue
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if {"text/html", "text/markdown", "image/png"} & set(data):
                continue  # rendered (a table, a picture), not shown as lines of text
            wide = [line for line in output_text(output).splitlines()
                    if len(line) > chapter_support.OUTPUT_WIDTH]
            assert not wide, (f"{chapter_runs.source(chapter).name}: output lines wider than "
                              f"{chapter_support.OUTPUT_WIDTH} characters:\n" + "\n".join(wide)
                              + f"\nin the output of:\n{cell.source}")

    assert any(c.cell_type == "code" for c in notebook.cells), \
        "a chapter without code cells tests nothing"
    # A cell that claims to show a failure must really fail, and only such a cell may.
    problems = chapter_runs.misbehaving_cells(notebook)
    assert not problems, "\n\n".join(problems)
