"""Sphinx directives that tie chapter pages to the source tree.

``{acme-snippet} ch01 empty``  the code a chapter adds, from the splitter's
    snippet index, captioned with the file it lives in.
``{acme-diff} 1``              the collapsible diff from stage 0 to stage 1.
``{acme-stage} 1``             how to build the stage, and the notebook download.

Everything is read from _build/ (snippets/, diffs/), which `nox -s site` writes
before Sphinx runs; a missing file is an error, never an empty page.

Chapters are rendered with the outputs of their stored run (tools/chapter_runs.py):
the test suite's, or one made here when that is missing or stale. The .ipynb
downloads are those runs, outputs included.
"""

from __future__ import annotations

import json
import os
import sys
import tomllib
from pathlib import Path

import jupytext
import nbformat
from docutils import nodes
from docutils.parsers.rst import directives
from myst_nb.core import read as myst_nb_read
from nbclient.exceptions import CellExecutionError
from sphinx import addnodes
from sphinx.directives.code import container_wrapper
from sphinx.errors import ExtensionError
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("ACME_BUILD_DIR", ROOT / "_build")).resolve()


def chapters() -> list[dict]:
    return tomllib.loads((ROOT / "chapters" / "chapters.toml").read_text())["chapter"]


def notebook_name(chapter: dict) -> str:
    return f"{chapter['number']:02d}-{chapter['slug']}"


class SnippetDirective(SphinxDirective):
    """``{acme-snippet} ch18 launch-run`` shows a marked block (or file) of a
    stage. ``:simulator: <what a real device does instead>`` labels it as the
    simulated device's code, which a vendor replaces, as opposed to the glue a
    vendor copies. (acme_downloads.py puts the same label in the notebooks.)"""

    required_arguments = 2  # chapter tag (ch01) and snippet name
    option_spec = {"simulator": directives.unchanged_required}

    def run(self):
        chapter, name = self.arguments
        index_path = BUILD / "snippets" / "index.json"
        index = json.loads(index_path.read_text())
        try:
            entry = index[chapter][name]
        except KeyError:
            raise self.error(f"no snippet {chapter}/{name} in {index_path}") from None
        path = BUILD / entry["snippet"]
        self.env.note_dependency(str(path))
        text = path.read_text()
        literal = nodes.literal_block(text, text, language=entry["language"])
        where = entry["file"] if entry["kind"] == "file" else f"{entry['file']} ({name})"
        # In backticks: the caption is parsed as markdown, which would turn the
        # underscores of __init__.py into bold.
        shown = container_wrapper(self, literal, f"`{where}`")
        if "simulator" not in self.options:
            return [shown]
        label = nodes.paragraph(classes=["acme-simulator"])
        label += nodes.strong(text="Simulator. ")
        label += nodes.Text(self.options["simulator"].strip())
        box = nodes.container(classes=["acme-simulator-snippet"])
        box += label
        box += shown
        return [box]


class DiffDirective(SphinxDirective):
    required_arguments = 1

    def run(self):
        number = int(self.arguments[0])
        diff_path = BUILD / "diffs" / f"stage-{number:02d}.diff"
        stat = json.loads((BUILD / "diffs" / f"stage-{number:02d}.stat.json").read_text())
        self.env.note_dependency(str(diff_path))
        text = diff_path.read_text()
        summary = (f"{len(stat['added'])} files added, {len(stat['changed'])} changed, "
                   f"{len(stat['removed'])} removed; +{stat['insertions']} "
                   f"-{stat['deletions']} lines")
        box = nodes.admonition(classes=["dropdown"])
        box += nodes.title(text=f"Diff from the previous stage to stage {number} ({summary})")
        box += nodes.literal_block(text, text, language="diff")
        return [box]


class StageDirective(SphinxDirective):
    required_arguments = 1

    def run(self):
        number = int(self.arguments[0])
        chapter = next(c for c in chapters() if c["number"] == number)
        box = nodes.admonition(classes=["tip"])
        box += nodes.title(text=f"Stage {number}")
        para = nodes.paragraph()
        para += nodes.Text("Build this stage and run its notebooks: ")
        para += nodes.literal(text=f"nox -s chapter-{number}")
        para += nodes.Text(". The clean source snapshot is written to ")
        para += nodes.literal(text=f"_build/stages/stage-{number:02d}/")
        para += nodes.Text(", with a README: copy it and ")
        para += nodes.literal(text="pip install --no-build-isolation .")
        para += nodes.Text(" (chapter 17). ")
        notebook = BUILD / "notebooks" / f"{notebook_name(chapter)}.ipynb"
        doc_dir = Path(self.env.doc2path(self.env.docname)).parent
        target = os.path.relpath(notebook, doc_dir)
        link = addnodes.download_reference("", "", refdoc=self.env.docname, refdomain="",
                                           reftype="download", refexplicit=True,
                                           reftarget=target)
        link += nodes.literal(text=f"{notebook_name(chapter)}.ipynb")
        para += nodes.Text("Download this chapter as a notebook: ")
        para += link
        box += para
        return [box]


# ---- one execution, two uses (tools/chapter_runs.py) ----
# The test suite runs every chapter and keeps the executed notebook under a key
# of its inputs. The site renders those runs: before Sphinx reads anything,
# each chapter whose stored run is missing or stale is executed again (never
# shown stale), and reading a chapter takes its outputs from the stored run.

sys.path.insert(0, str(ROOT))
from tools import chapter_runs  # noqa: E402
from acme_downloads import for_download  # noqa: E402

LOGGER = logging.getLogger(__name__)

# This build's run of each chapter (None if it failed), keyed by chapter
# number, with the key it was made under: hashing the stage builds is the
# expensive part, so it happens once per build, in run_chapters.
RUNS: dict[int, tuple[str, nbformat.NotebookNode | None]] = {}


def run_chapters(app) -> None:
    """Make every chapter's stored run current, then write the .ipynb downloads."""
    out = BUILD / "notebooks"
    out.mkdir(parents=True, exist_ok=True)
    for chapter in chapters():
        if not chapter_runs.source(chapter).exists():
            raise ExtensionError(f"chapters.toml lists {chapter_runs.source(chapter).name}, "
                                 "which does not exist")
        with chapter_runs.locked(chapter):  # a test worker may be running it now
            notebook = run = chapter_runs.cached(chapter)
            if run is None:
                LOGGER.info("executing %s (no current run)", chapter_runs.source(chapter).name)
                try:
                    notebook = chapter_runs.execute(chapter)
                    run = chapter_runs.cached(chapter)  # None unless every cell behaved
                except CellExecutionError as error:
                    LOGGER.warning("%s: a cell failed:\n%s", chapter_runs.source(chapter).name,
                                   error)
                    notebook = jupytext.read(chapter_runs.source(chapter))
        key = run.metadata["acme_key"] if run is not None else chapter_runs.key(chapter)
        RUNS[chapter["number"]] = (key, run)
        download = out / f"{notebook_name(chapter)}.ipynb"
        text = nbformat.writes(for_download(notebook, chapter, BUILD, ROOT / "chapters"))
        if not download.exists() or download.read_text() != text:
            download.write_text(text)


def with_stored_outputs(notebook, path):
    """A chapter as myst-nb read it, with the outputs of its stored run."""
    kernel = notebook.metadata.get("kernelspec", {}).get("name", "")
    if not kernel.startswith("acme-stage-"):
        return notebook
    _, run = RUNS[int(kernel.rsplit("-", 1)[1])]
    if run is None:
        LOGGER.warning("%s: no current run of this chapter to show", path)
        return notebook
    read = [c for c in notebook.cells if c.cell_type == "code"]
    ran = [c for c in run.cells if c.cell_type == "code"]
    if [c.source.strip() for c in read] != [c.source.strip() for c in ran]:
        LOGGER.warning("%s: its stored run has other code cells than the page", path)
        return notebook
    for cell, executed in zip(read, ran):
        cell.outputs = executed.outputs
        cell.execution_count = executed.execution_count
    return notebook


def install_reader() -> None:
    plain = myst_nb_read.read_myst_markdown_notebook

    def read(text, config=None, add_source_map=False, path=None):
        return with_stored_outputs(plain(text, config=config, add_source_map=add_source_map,
                                         path=path), path)

    myst_nb_read.read_myst_markdown_notebook = read


def outdated_by_runs(app, env, added, changed, removed) -> list[str]:
    """Pages whose shown outputs changed although their text did not."""
    keys = {f"chapters/{notebook_name(c)}": RUNS[c["number"]][0] for c in chapters()}
    def written(*names: str) -> str:  # when the files a page reads were last written
        return " ".join(str((BUILD / n).stat().st_mtime_ns) if (BUILD / n).exists() else "-"
                        for n in names)

    keys["docs/bench"] = written("bench/results.json")
    keys["docs/conformance"] = written("conformance/results.json", "conformance/quick.json")
    before = getattr(env, "acme_output_keys", {})
    env.acme_output_keys = keys
    return [doc for doc, k in keys.items() if before.get(doc) != k and doc in env.found_docs]


def setup(app):
    app.add_directive("acme-snippet", SnippetDirective)
    app.add_directive("acme-diff", DiffDirective)
    app.add_directive("acme-stage", StageDirective)
    install_reader()
    app.connect("builder-inited", run_chapters)
    app.connect("env-get-outdated", outdated_by_runs)
    return {"parallel_read_safe": True, "version": "1"}
