"""The "Errors you will meet" cards, generated from tests/bad_inputs.toml.

``{acme-errors} devices``  one card per row of a topic: the input, the
    exception it raises (type and message fragment), and what it shows. Cards,
    not a table: three columns of code and messages do not fit a text column,
    let alone a phone (docs/_static/acme.css lets their code wrap).
    With ``:index:``, a list before the cards: each message, what causes it
    and the chapter that fixes it, linked to its card.

The same file drives tests/test_bad_inputs.py, which runs every row; the
page never restates a row by hand. A row whose topic no page renders is a
warning (an error under -W), so a new topic cannot silently go missing.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "tests" / "bad_inputs.toml"
MANIFEST = ROOT / "chapters" / "chapters.toml"
LOGGER = logging.getLogger(__name__)


def rows() -> list[dict]:
    return tomllib.loads(TABLE.read_text())["row"]


def chapters() -> dict[int, dict]:
    return {c["number"]: c for c in tomllib.loads(MANIFEST.read_text())["chapter"]}


def chapter_link(chapter: dict, docname: str) -> nodes.Node:
    """A paragraph linking the chapter that explains the error or its fix."""
    number = chapter["number"]
    ref = addnodes.pending_xref("", refdomain="std", reftype="doc", refexplicit=True,
                                reftarget=f"/chapters/{number:02d}-{chapter['slug']}",
                                refdoc=docname)
    ref += nodes.inline(text=f"Chapter {number}: {chapter['title']}")
    return nodes.paragraph("", "", nodes.Text("Explained in "), ref)


def text_with_code(text: str) -> list[nodes.Node]:
    """Plain text in which `backticks` become inline code."""
    parts = re.split(r"`([^`]+)`", " ".join(text.split()))
    return [nodes.literal(text=p) if i % 2 else nodes.Text(p) for i, p in enumerate(parts) if p]


def where(row: dict) -> str | None:
    """The comment that says where a fresh-process row runs."""
    if row.get("process", "this") != "fresh":
        return None
    said = ["in a fresh process"]
    if not row.get("backend", True):
        said.append("where torch_acme is not installed")
    if "stage" in row:
        said.append(f"against stage {row['stage']}")
    for key, value in row.get("env", {}).items():
        said.append(f"with {key}={value}")
    if row.get("cpu_only_torch"):
        said.append("with a CPU-only PyTorch")
    return "# " + ", ".join(said)


def input_text(row: dict) -> str:
    lines = []
    if "prepare" in row:
        lines += ["# earlier, in a process with acme:", row["prepare"].strip(), ""]
    if where(row):
        lines.append(where(row) + ":")
    if "setup" in row:
        lines.append(row["setup"].strip())
    lines.append(row["code"].strip())
    return "\n".join(lines)


def index_entry(row: dict, chapter: dict, docname: str) -> nodes.Node:
    """One line of the index: the message, linked to its card; the cause; the chapter."""
    card = nodes.reference("", "", nodes.literal(text=row["message"]), refid=row["id"])
    line = nodes.paragraph("", "", card, nodes.Text(f" ({row['error'].split('.')[-1]}): "
                                                    f"{row['title']}. "))
    line += chapter_link(chapter, docname).children
    return nodes.list_item("", line)


class ErrorsDirective(SphinxDirective):
    required_arguments = 1  # the topic
    option_spec = {"index": lambda argument: True}

    def run(self):
        topic = self.arguments[0]
        self.env.note_dependency(str(TABLE))
        self.env.note_dependency(str(MANIFEST))
        chosen = [r for r in rows() if r["topic"] == topic]
        if not chosen:
            raise self.error(f"no row of {TABLE.name} has topic {topic!r}")
        if not hasattr(self.env, "acme_errors_rendered"):
            self.env.acme_errors_rendered = {}  # docname -> ids of the rows it shows
        self.env.acme_errors_rendered.setdefault(self.env.docname, set()).update(
            r["id"] for r in chosen)

        manifest = chapters()
        cards = []
        if "index" in self.options:
            cards.append(nodes.bullet_list("", *(
                index_entry(r, manifest[r["chapter"]], self.env.docname) for r in chosen)))
        for row in chosen:
            code = input_text(row)
            card = nodes.container(classes=["acme-error-card"])
            title = nodes.paragraph("", "", nodes.strong(text=row["title"]))
            title["ids"].append(row["id"])
            card += title
            card += nodes.literal_block(code, code, language="python")
            card += nodes.paragraph("", "", nodes.Text("Raises "), nodes.literal(text=row["error"]),
                                    nodes.Text(", with a message containing "),
                                    nodes.literal(text=row["message"]))
            card += nodes.paragraph("", "", *text_with_code(row["demonstrates"]))
            card += chapter_link(manifest[row["chapter"]], self.env.docname)
            cards.append(card)
        return cards


def purge(app, env, docname) -> None:
    getattr(env, "acme_errors_rendered", {}).pop(docname, None)


def merge(app, env, docnames, other) -> None:
    if not hasattr(env, "acme_errors_rendered"):
        env.acme_errors_rendered = {}
    for docname in docnames:
        if docname in getattr(other, "acme_errors_rendered", {}):
            env.acme_errors_rendered[docname] = other.acme_errors_rendered[docname]


def check_every_row_shown(app, env) -> None:
    shown = set().union(*getattr(env, "acme_errors_rendered", {}).values())
    missing = {r["id"] for r in rows()} - shown
    if missing:
        LOGGER.warning("rows of %s on no page (add an acme-errors table for their topic): %s",
                       TABLE.name, ", ".join(sorted(missing)))


def setup(app):
    app.add_directive("acme-errors", ErrorsDirective)
    app.connect("env-purge-doc", purge)
    app.connect("env-merge-info", merge)
    app.connect("env-check-consistency", check_every_row_shown)
    return {"parallel_read_safe": True, "version": "1"}
