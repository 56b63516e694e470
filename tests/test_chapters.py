"""Every chapter is a test: its notebook runs in its own kernel against its own stage."""

from __future__ import annotations

import jupytext
import pytest
from nbclient.exceptions import CellExecutionError

from conftest import CHAPTERS, ROOT, stage_dir
from tools import chapter_runs


def chapter_path(chapter: dict) -> "Path":
    return ROOT / "chapters" / f"{chapter['number']:02d}-{chapter['slug']}.md"


def chapters_upto(config) -> list[dict]:
    return [c for c in CHAPTERS if c["number"] <= config.getoption("--upto")]


def pytest_generate_tests(metafunc):
    if "chapter" in metafunc.fixturenames:
        chosen = chapters_upto(metafunc.config)
        metafunc.parametrize("chapter", chosen, ids=[f"ch{c['number']:02d}-{c['slug']}" for c in chosen])


def machine_paths() -> list[str]:
    """Folders whose names must never reach a reader: the checkout, the build, the venv."""
    import sys
    import tempfile

    return sorted({str(ROOT), str(stage_dir(0).parent.parent), sys.prefix,
                   tempfile.gettempdir() + "/"})


def output_text(output) -> str:
    if output.output_type == "stream":
        return output.text
    if output.output_type == "error":  # a reader sees the traceback field
        return "\n".join([output.ename, *output.traceback])
    return "\n".join(str(v) for k, v in output.get("data", {}).items() if k.startswith("text/"))


def test_chapter_runs_against_its_stage(chapter):
    number = chapter["number"]
    notebook = jupytext.read(chapter_path(chapter))
    kernel = notebook.metadata["kernelspec"]["name"]
    # The kernel decides which build the notebook sees: it must be this stage's.
    assert kernel == f"acme-stage-{number:02d}", kernel
    assert (stage_dir(number) / "src" / "torch_acme" / "_build_info.py").exists()

    try:
        # Executed once here; the site renders this very run (tools/chapter_runs.py).
        notebook = chapter_runs.execute(chapter)
    except CellExecutionError as error:
        pytest.fail(f"{chapter_path(chapter).name}: a cell failed:\n{error}", pytrace=False)

    # What a reader sees carries no path of the machine that built the book.
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            text = output_text(output)
            for path in machine_paths():
                assert path not in text, (
                    f"{chapter_path(chapter).name}: an output shows {path}:\n{text[:2000]}"
                    f"\nin the output of:\n{cell.source}")

    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    assert code_cells, "a chapter without code cells tests nothing"
    for cell in code_cells:
        tags = cell.metadata.get("tags", [])
        errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
        # A cell that claims to show a failure must really fail, and only such a cell may.
        if "raises-exception" in tags:
            assert errors, f"cell expected to raise did not:\n{cell.source}"
        else:
            assert not errors, f"cell raised:\n{cell.source}"
        assert cell.get("execution_count"), f"cell did not run:\n{cell.source}"
