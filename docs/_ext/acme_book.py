"""Sphinx directives that tie chapter pages to the source tree.

``{acme-snippet} ch01 empty``  the code a chapter adds, from the splitter's
    snippet index, captioned with the file it lives in.
``{acme-diff} 1``              the collapsible diff from stage 0 to stage 1.
``{acme-stage} 1``             how to build the stage, and the notebook download.

Everything is read from _build/ (snippets/, diffs/), which `nox -s site` writes
before Sphinx runs; a missing file is an error, never an empty page.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import jupytext
from docutils import nodes
from sphinx import addnodes
from sphinx.directives.code import container_wrapper
from sphinx.errors import ExtensionError
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("ACME_BUILD_DIR", ROOT / "_build")).resolve()


def chapters() -> list[dict]:
    return tomllib.loads((ROOT / "chapters" / "chapters.toml").read_text())["chapter"]


def notebook_name(chapter: dict) -> str:
    return f"{chapter['number']:02d}-{chapter['slug']}"


class SnippetDirective(SphinxDirective):
    required_arguments = 2  # chapter tag (ch01) and snippet name

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
        return [container_wrapper(self, literal, f"`{where}`")]


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
        para += nodes.Text(". ")
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


def write_notebooks(app) -> None:
    """The .ipynb downloads: each chapter converted without outputs."""
    out = BUILD / "notebooks"
    out.mkdir(parents=True, exist_ok=True)
    for chapter in chapters():
        source = ROOT / "chapters" / f"{notebook_name(chapter)}.md"
        if not source.exists():
            raise ExtensionError(f"chapters.toml lists {source.name}, which does not exist")
        jupytext.write(jupytext.read(source), out / f"{notebook_name(chapter)}.ipynb")


def setup(app):
    app.add_directive("acme-snippet", SnippetDirective)
    app.add_directive("acme-diff", DiffDirective)
    app.add_directive("acme-stage", StageDirective)
    app.connect("builder-inited", write_notebooks)
    return {"parallel_read_safe": True, "version": "1"}
