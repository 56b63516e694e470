"""The index page's pictures, drawn at build time from the stage snapshots.

``{acme-figure} layers``  the final stage's three layers, with the #include
    edges between them counted from the source (the build fails if one
    reaches up a layer).
``{acme-figure} stages``  how many lines of each layer every stage holds, and
    what each chapter adds (from the splitter's diffs).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from docutils import nodes
from sphinx.errors import ExtensionError
from sphinx.util.docutils import SphinxDirective

from acme_book import BUILD, chapters

FIGURES = BUILD / "figures"

# Layers, lowest first, by where their files live in a stage snapshot.
LAYERS = [("vendor runtime", ("csrc/runtime/",)),
          ("torch glue", ("csrc/aten/", "csrc/stable/")),
          ("Python face", ("csrc/python/", "src/torch_acme/"))]
COLOURS = ["#4c72b0", "#dd8452", "#55a868"]
PYTORCH = "PyTorch"


def _stage(number: int) -> Path:
    return BUILD / "stages" / f"stage-{number:02d}"


def _layer(relative: str) -> int | None:
    for index, (_, prefixes) in enumerate(LAYERS):
        if relative.startswith(prefixes):
            return index
    return None


def _sources(stage: Path):
    for path in sorted(stage.rglob("*")):
        relative = path.relative_to(stage).as_posix()
        if path.is_file() and path.suffix in {".h", ".cpp", ".py"} and _layer(relative) is not None:
            yield relative, path


def layer_sizes(stage: Path) -> tuple[list[int], list[int]]:
    """Files and lines of source in each layer."""
    files, lines = [0] * len(LAYERS), [0] * len(LAYERS)
    for relative, path in _sources(stage):
        files[_layer(relative)] += 1
        lines[_layer(relative)] += len(path.read_text().splitlines())
    return files, lines


_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def include_edges(stage: Path) -> dict[tuple[str, str], int]:
    """(from layer, to layer or PyTorch) -> how many #include lines make that edge."""
    edges: dict[tuple[str, str], int] = {}
    for relative, path in _sources(stage):
        if path.suffix == ".py":
            continue
        source = LAYERS[_layer(relative)][0]
        for bracket, target in _INCLUDE.findall(path.read_text()):
            if target.split("/")[0] in {"torch", "ATen", "c10", "pybind11", "Python.h"}:
                to = PYTORCH
            else:
                layer = _layer("csrc/" + target)
                if layer is None:
                    continue  # the C++ standard library, POSIX
                to = LAYERS[layer][0]
            edges[(source, to)] = edges.get((source, to), 0) + 1
    return edges


def draw_layers(path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    last = chapters()[-1]["number"]
    stage = _stage(last)
    edges = include_edges(stage)
    names = [name for name, _ in LAYERS]
    # The rule the layout keeps: no layer includes one above it, and the
    # runtime includes nothing of PyTorch's.
    for (source, to), count in edges.items():
        if to != PYTORCH and names.index(to) > names.index(source):
            raise ExtensionError(f"{count} #include lines in the {source} reach up to the {to}")
    if edges.get((names[0], PYTORCH)):
        raise ExtensionError("the vendor runtime includes PyTorch headers")
    files, lines = layer_sizes(stage)

    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    ax.set_xlim(-0.7, 10)
    ax.set_ylim(0, 6.2)
    ax.axis("off")
    centres = {}
    for index, name in enumerate(names):
        y = 0.3 + index * 2.0
        ax.add_patch(FancyBboxPatch((0.2, y), 5.6, 1.3, boxstyle="round,pad=0.05",
                                    facecolor=COLOURS[index], alpha=0.25,
                                    edgecolor=COLOURS[index]))
        prefixes = " + ".join(LAYERS[index][1])
        ax.text(3.0, y + 0.85, name, ha="center", fontsize=11, weight="bold")
        ax.text(3.0, y + 0.35, f"{prefixes}: {files[index]} files, {lines[index]:,} lines",
                ha="center", fontsize=8, family="monospace")
        centres[name] = (3.0, y, y + 1.3)
    ax.add_patch(FancyBboxPatch((7.2, 2.3), 2.5, 3.3, boxstyle="round,pad=0.05",
                                facecolor="0.9", edgecolor="0.5"))
    ax.text(8.45, 4.1, "PyTorch\n(torch, ATen, c10)", ha="center", va="center", fontsize=10)
    for (source, to), count in sorted(edges.items()):
        x, bottom, top = centres[source]
        if to == PYTORCH:
            ax.annotate("", xy=(7.2, bottom + 0.65), xytext=(5.85, bottom + 0.65),
                        arrowprops={"arrowstyle": "->", "color": "0.4"})
            ax.text(6.5, bottom + 0.75, f"{count}", ha="center", fontsize=8, color="0.3")
        elif names.index(source) - names.index(to) == 1:  # to the layer below
            _, to_bottom, to_top = centres[to]
            ax.annotate("", xy=(x, to_top + 0.05), xytext=(x, bottom - 0.05),
                        arrowprops={"arrowstyle": "->", "color": "0.4"})
            ax.text(x + 0.15, (bottom + to_top) / 2, f"{count}", fontsize=8, color="0.3",
                    va="center")
        elif to != source:  # past a layer: around the boxes, on the left
            _, to_bottom, to_top = centres[to]
            start, end = bottom + 0.65, (to_bottom + to_top) / 2
            ax.plot([0.15, -0.15, -0.15], [start, start, end], color="0.4", linewidth=1)
            ax.annotate("", xy=(0.15, end), xytext=(-0.15, end),
                        arrowprops={"arrowstyle": "->", "color": "0.4"})
            ax.text(-0.3, (start + end) / 2, f"{count}", fontsize=8, color="0.3",
                    va="center", ha="right")
    ax.set_title(f"Stage {last}: the three layers, and #include lines between them "
                 "(arrows point down only)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_stages(path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numbers = [c["number"] for c in chapters()]
    counts = [layer_sizes(_stage(n))[1] for n in numbers]
    totals = [sum(c) for c in counts]
    added = [total - previous for total, previous in zip(totals, [0, *totals[:-1]])]

    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    bottom = [0] * len(numbers)
    for index, (name, _) in enumerate(LAYERS):
        heights = [c[index] for c in counts]
        ax.bar(numbers, heights, bottom=bottom, color=COLOURS[index], label=name, width=0.75)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for n, top, plus in zip(numbers, bottom, added):
        ax.text(n, top + max(bottom) * 0.01, f"{plus:+}", ha="center", va="bottom",
                fontsize=6.5, rotation=90)
    ax.set_xticks(numbers)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_xlabel("stage (= the code a reader has after that chapter)")
    ax.set_ylabel("lines of source")
    ax.set_ylim(0, max(bottom) * 1.18)
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    ax.set_title("One marked source tree, split into a snapshot per chapter; "
                 "+N: the lines each chapter adds (net)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


DRAWINGS = {"layers": draw_layers, "stages": draw_stages}


def draw_all(app) -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    for name, draw in DRAWINGS.items():
        draw(FIGURES / f"{name}.png")


class FigureDirective(SphinxDirective):
    required_arguments = 1
    has_content = True  # the caption

    def run(self):
        name = self.arguments[0]
        if name not in DRAWINGS:
            raise self.error(f"no figure {name!r}: one of {sorted(DRAWINGS)}")
        path = FIGURES / f"{name}.png"
        # Relative to the page, so Sphinx copies the file into _images/.
        uri = os.path.relpath(path, Path(self.env.doc2path(self.env.docname)).parent)
        figure = nodes.figure()
        figure += nodes.image(uri=uri, alt=" ".join(self.content) or name)
        if self.content:
            figure += nodes.caption(text=" ".join(self.content))
        return [figure]


def setup(app):
    app.add_directive("acme-figure", FigureDirective)
    app.connect("builder-inited", draw_all)
    return {"parallel_read_safe": True, "version": "1"}
