"""The .ipynb a reader downloads: the executed run, with every directive turned
into the text it stands for, so the notebook reads in any Jupyter without the
book's Sphinx extensions.

Directives with no notebook equivalent become what the page shows: a snippet
or literalinclude becomes a captioned code block, the stage box becomes
instructions, a dropdown becomes a quoted section, tabs become bold headings,
a {doc} link becomes its text, and index entries go.
"""

from __future__ import annotations

import ast
import json
import re
import textwrap
from pathlib import Path

import nbformat


def _code_block(caption: str, language: str, code: str) -> str:
    return f"*{caption}*\n\n```{language}\n{code.rstrip()}\n```"


def _options(body: str) -> tuple[dict[str, str], str]:
    """A fenced directive's `:name: value` lines, and the rest of its body."""
    options, rest = {}, []
    for line in body.splitlines():
        match = re.match(r"^:([\w-]+):\s*(.*)$", line)
        if match and not rest:
            options[match[1]] = match[2]
        else:
            rest.append(line)
    return options, "\n".join(rest).strip("\n")


_INCLUDE_OPTIONS = {"language", "caption", "pyobject", "start-at", "start-after", "end-at",
                    "end-before", "dedent"}
_LANGUAGES = {".py": "python", ".cpp": "c++", ".h": "c++", ".toml": "toml"}


def _included(path: Path, options: dict[str, str]) -> str:
    """What a literalinclude with these options shows (the options the book uses)."""
    unknown = set(options) - _INCLUDE_OPTIONS
    if unknown:  # a new option would otherwise be ignored, and the excerpt wrong
        raise ValueError(f"literalinclude of {path.name}: options {sorted(unknown)} are not "
                         "turned into notebook text (docs/_ext/acme_downloads.py)")
    text = path.read_text()
    if "pyobject" in options:  # "name" or "Class.method"
        body, node = ast.parse(text).body, None
        for name in options["pyobject"].split("."):
            node = next(n for n in body if getattr(n, "name", None) == name)
            body = getattr(node, "body", [])
        lines = text.splitlines()
        start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        return textwrap.dedent("\n".join(lines[start - 1:node.end_lineno]))
    lines = text.splitlines()
    for name, keep in (("start-at", True), ("start-after", False)):
        if name in options:
            first = next(i for i, line in enumerate(lines) if options[name] in line)
            lines = lines[first if keep else first + 1:]
    for name, keep in (("end-at", True), ("end-before", False)):
        if name in options:
            last = next(i for i, line in enumerate(lines) if options[name] in line)
            lines = lines[:last + 1 if keep else last]
    if "dedent" in options:  # without a value: as far as every line allows
        if options["dedent"]:
            raise ValueError(f"literalinclude of {path.name}: only a bare :dedent: is supported")
        return textwrap.dedent("\n".join(lines))
    return "\n".join(lines)


def for_download(notebook, chapter: dict, build: Path, chapters_dir: Path):
    """A copy of `notebook` with its markdown directives resolved."""
    notebook = nbformat.reads(nbformat.writes(notebook), as_version=4)
    index = json.loads((build / "snippets" / "index.json").read_text())
    number = chapter["number"]

    def snippet(match) -> str:
        indent, tag, name = match[1], match[2], match[3]
        entry = index[tag][name]
        where = entry["file"] if entry["kind"] == "file" else f"{entry['file']} ({name})"
        block = _code_block(where, entry["language"], (build / entry["snippet"]).read_text())
        if match[4]:  # :simulator: what a real device does instead (the page's label)
            block = f"**Simulator.** {match[4].strip()}\n\n{block}"
        return "\n".join(indent + line if line else line for line in block.splitlines())

    def literalinclude(match) -> str:
        options, _ = _options(match[2])
        path = (chapters_dir / match[1]).resolve()
        caption = options.get("caption") or path.relative_to(chapters_dir.parent).as_posix()
        language = options.get("language", _LANGUAGES.get(path.suffix, ""))
        return _code_block(caption, language, _included(path, options))

    def admonition(match) -> str:
        _, body = _options(match[2])
        return "\n".join(["> **" + match[1].strip() + "**", ">",
                          *("> " + line if line else ">" for line in body.splitlines())])

    replacements = [
        (re.compile(r"^( *)```\{acme-snippet\} (ch\d\d) (\S+)\n(?: *:simulator: *([^\n]*)\n)? *```",
                    re.M), snippet),
        (re.compile(r"^```\{literalinclude\} (\S+)\n(.*?)^```", re.M | re.S), literalinclude),
        (re.compile(r"^```\{acme-stage\} \d+\n```", re.M), lambda m: (
            f"> This notebook is chapter {number} of *Out of Tree*. It runs in the Jupyter "
            f"kernel `acme-stage-{number:02d}`, against stage {number}'s build: see the "
            "first cell.")),
        (re.compile(r"^```\{acme-diff\} \d+\n```", re.M), lambda m: (
            f"The diff from stage {number - 1} to stage {number} is on this chapter's page, "
            f"and in `_build/diffs/stage-{number:02d}.diff` after a build.")),
        (re.compile(r"^```\{index\}[^\n]*\n```\n?", re.M), lambda m: ""),  # the site's index
        (re.compile(r"^:::\{admonition\} ([^\n]*)\n(.*?)^:::$", re.M | re.S), admonition),
        (re.compile(r"^::::\{tabs\}\n|^:{3,4}$\n?", re.M), lambda m: ""),
        (re.compile(r"^:::\{group-tab\} (.+)$", re.M), lambda m: f"**{m[1]}**"),
        (re.compile(r"\{doc\}`([^`<]+?) *<[^`]*>`"), lambda m: m[1]),
    ]
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            for pattern, replace in replacements:
                cell.source = pattern.sub(replace, cell.source)
    notebook.cells.insert(0, nbformat.v4.new_markdown_cell(how_to_run(number)))
    return notebook


def how_to_run(number: int) -> str:
    return f"""\
**How to run this notebook.** It runs in the Jupyter kernel `acme-stage-{number:02d}`,
which imports stage {number}'s build of the acme backend. In a clone of the book
(`README.md` there has the two set-up commands):

```console
$ nox -s chapter-{number}          # builds stages 0..{number}, installs their kernels, runs them
$ .nox/acme/bin/pip install jupyterlab
$ JUPYTER_PATH=$PWD/_build/jupyter .nox/acme/bin/jupyter lab
```

then open this file from any folder and choose the kernel "acme stage {number}".
The kernel finds the book's helpers (`tools/chapter_support.py`) by itself."""
