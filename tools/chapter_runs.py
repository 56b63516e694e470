"""One execution, two uses: a chapter runs once against its stage, and both the
test suite and the site use that run.

An executed notebook is kept in <build>/executed/NN-slug.ipynb with the key it
was made under: a hash of the chapter's text, the helpers its cells use, and
the builds of its own stage and the one before it (its "what fails before"
cells run there). Any change to those makes the key differ, so a stale run is
never reused: it is executed again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def build_dir() -> Path:
    return Path(os.environ.get("ACME_BUILD_DIR", ROOT / "_build")).resolve()


def source(chapter: dict) -> Path:
    return ROOT / "chapters" / f"{chapter['number']:02d}-{chapter['slug']}.md"


def stored(chapter: dict) -> Path:
    return build_dir() / "executed" / f"{chapter['number']:02d}-{chapter['slug']}.ipynb"


def _imported_names(code: str, scripts: bool = True) -> set[str]:
    """Module names `code` imports, and (scripts) names as a script: foo.py."""
    names = {name.strip() for names in re.findall(r"^\s*import\s+([\w, ]+)", code, re.M)
             for name in names.split(",")}
    for module, imported in re.findall(r"^\s*from\s+([\w.]+)\s+import\s+([\w, ]+)", code, re.M):
        names |= set(module.split(".")) | {name.strip() for name in imported.split(",")}
    return names | (set(re.findall(r"(\w+)\.py\b", code)) if scripts else set())


def helpers(chapter: dict) -> list[Path]:
    """The book's own Python files a chapter's code uses: chapter_support, and
    every module of tools/ or tests/ its code cells import or run as a script,
    and the ones those import in turn."""
    modules = {path.stem: path for folder in ("tools", "tests")
               for path in sorted((ROOT / folder).glob("*.py"))}
    found = [ROOT / "tools" / "chapter_support.py"]
    code = "\n".join(cell.source for cell in jupytext.read(source(chapter)).cells
                     if cell.cell_type == "code")
    pending = sorted(_imported_names(code) & set(modules))
    while pending:
        path = modules[pending.pop(0)]
        if path not in found:
            found.append(path)
            pending += sorted(_imported_names(path.read_text(), scripts=False) & set(modules))
    return found


def key(chapter: dict) -> str:
    digest = hashlib.sha256()
    for path in [source(chapter), *helpers(chapter)]:
        digest.update(path.read_bytes())
    for number in (chapter["number"] - 1, chapter["number"]):
        package = build_dir() / "packages" / f"stage-{number:02d}" / "torch_acme"
        for path in sorted(package.rglob("*")) if package.is_dir() else []:
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(path.relative_to(package).as_posix().encode() + b"\0")
                digest.update(path.read_bytes())
    return digest.hexdigest()


def cached(chapter: dict) -> nbformat.NotebookNode | None:
    """The stored run, if it was made under the current key."""
    path = stored(chapter)
    if not path.exists():
        return None
    notebook = nbformat.read(path, as_version=4)
    return notebook if notebook.metadata.get("acme_key") == key(chapter) else None


@contextlib.contextmanager
def locked(chapter: dict):
    """Held while a chapter's stored run is read and made: two processes (the
    test suite's two workers, or a worker and the site's build) never execute
    the same chapter at once, and the second finds the first one's run."""
    path = stored(chapter).with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_once(chapter: dict, since: float) -> nbformat.NotebookNode:
    """execute(), unless a current run was stored at or after `since` (the start
    of this test session): then that run, which another process made."""
    with locked(chapter):
        path = stored(chapter)
        if path.exists() and path.stat().st_mtime >= since:
            run = cached(chapter)
            if run is not None:
                return run
        return execute(chapter)


def execute(chapter: dict) -> nbformat.NotebookNode:
    """Run the chapter in its stage's kernel; keep the run if every cell behaved.

    Raises nbclient's CellExecutionError when a cell fails unexpectedly. The
    returned notebook is what the tests check; it is stored only when cells
    tagged raises-exception, and only those, raised.
    """
    notebook = jupytext.read(source(chapter))
    the_key = key(chapter)  # before running: the run is of these inputs
    kernel = notebook.metadata["kernelspec"]["name"]
    client = NotebookClient(notebook, kernel_name=kernel, timeout=600,
                            resources={"metadata": {"path": str(ROOT / "chapters")}})
    client.execute()
    if not misbehaving_cells(notebook):
        notebook.metadata["acme_key"] = the_key
        stored(chapter).parent.mkdir(parents=True, exist_ok=True)
        tmp = stored(chapter).with_suffix(".tmp")
        nbformat.write(notebook, tmp)
        tmp.replace(stored(chapter))
    return notebook


def misbehaving_cells(notebook) -> list[str]:
    """Why each code cell that misbehaved did: a cell tagged raises-exception must
    raise, no other cell may, and every cell must have run."""
    problems = []
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        raised = any(o.output_type == "error" for o in cell.get("outputs", []))
        if "raises-exception" in cell.metadata.get("tags", []):
            if not raised:
                problems.append(f"cell expected to raise did not:\n{cell.source}")
        elif raised:
            problems.append(f"cell raised:\n{cell.source}")
        if not cell.get("execution_count"):
            problems.append(f"cell did not run:\n{cell.source}")
    return problems
