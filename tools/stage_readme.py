"""The README.md every stage snapshot carries (written by tools/splitter.py).

A vendor copies a stage folder out of the book's build and starts from it: the
README is what they read first. It says how to build, try, install and rename
that stage, and what it contains. The "Try it" command is run against every
stage's build by tests/test_packaging.py, so it cannot go stale.
"""

from __future__ import annotations

from pathlib import PurePosixPath

# The chapter that names the device (before it: PrivateUse1's default name),
# and the one that makes `import torch` load the backend by itself.
NAMED = 8
AUTOLOAD = 17

LAYERS = [
    ("csrc/runtime/", "the vendor runtime: a plain C API, no PyTorch anywhere"),
    ("csrc/aten/", "the torch glue, one capability per file"),
    ("csrc/python/", "the Python bindings of the glue and the runtime"),
    ("csrc/stable/", "kernels against PyTorch's stable ABI, one library for every release"),
    ("src/torch_acme/", "the Python package users import"),
    ("build_support/", "build-time helpers (the torch pin in the wheel's metadata)"),
]


def device_name(stage: int) -> str:
    return "acme" if stage >= NAMED else "privateuseone"


def try_command(stage: int) -> str:
    """A one-line check that this stage works, for its README (and its test)."""
    if stage == 0:
        return 'import torch_acme; print(torch_acme.runtime.device_count(), "devices")'
    if stage >= AUTOLOAD:
        return f'import torch; print((torch.arange(3.0).to("{device_name(stage)}") + 1).cpu())'
    return f'import torch, torch_acme; print(torch.arange(3.0).to("{device_name(stage)}").cpu())'


def _files_by_layer(files: list[str]) -> list[str]:
    lines = []
    for prefix, what in LAYERS:
        names = sorted(PurePosixPath(f).name for f in files if f.startswith(prefix))
        if names:
            lines.append(f"- `{prefix}`: {what}. {', '.join(f'`{n}`' for n in names)}")
    return lines


def render(chapters, stage: int, files: list[str]) -> str:
    """The README of stage `stage`; `chapters` are the manifest's, `files` the snapshot's."""
    current = next(c for c in chapters if c.number == stage)
    name = device_name(stage)
    upto = [c for c in chapters if c.number <= stage]
    parts = [
        f"# torch_acme, stage {stage}: {current.title}",
        "",
        f"The acme backend for PyTorch as it stands after chapter {stage} of *Out of Tree*, "
        f'"{current.title}". This folder builds on its own: copy it anywhere.',
        "",
        "## Build and install",
        "",
        "In the Python environment that has PyTorch:",
        "",
        "```console",
        "pip install scikit-build-core",
        "pip install --no-build-isolation .",
        "```",
        "",
        "`--no-build-isolation` compiles against the PyTorch you have. Without it, pip would "
        "build in a fresh environment and fetch a PyTorch of its own to compile against. "
        "PyTorch's C++ API and ABI change from one release to the next, so the package "
        "requires exactly the release it was built against (`torch==X.Y.Z` in its metadata). "
        "A wheel to hand to others who run that release:",
        "",
        "```console",
        "pip wheel --no-build-isolation --no-deps -w dist .",
        "```",
        "",
        "For work on the C++ without installing, CMake alone builds in place (the libraries "
        "land beside the Python files in `src/torch_acme/`):",
        "",
        "```console",
        'cmake -S . -B build -G Ninja -DPython3_EXECUTABLE="$(command -v python)"',
        "cmake --build build",
        'PYTHONPATH=src python -c "import torch_acme"',
        "```",
        "",
        "## Try it",
        "",
        "```console",
        f"python -c '{try_command(stage)}'",
        "```",
        "",
    ]
    if stage >= AUTOLOAD:
        parts += [
            "`import torch` loads the backend by itself: the package declares a "
            '`torch.backends` entry point. `TORCH_DEVICE_BACKEND_AUTOLOAD=0` turns that off.',
            "",
        ]
    parts += [
        f"The book's own tests for this stage run in the book's repository: `nox -s chapter-{stage}`.",
        "",
        "## Rename",
        "",
    ]
    if stage >= NAMED:
        parts.append(
            f'The device is called `{name}` in one place: `DEVICE_NAME` in '
            "`src/torch_acme/__init__.py`. Change it, reinstall, and the device string, "
            f"`torch.{name}`, the generated methods (`tensor.{name}()`), the Python operators' "
            "namespace and the messages follow.")
        if stage >= AUTOLOAD:
            parts += [
                "",
                "Not renamed by it: the package and distribution names (`src/torch_acme/`, "
                "`name` in `pyproject.toml`), the C++ operators' namespace (`acme::`, a token "
                "in `TORCH_LIBRARY_FRAGMENT`), and the vendor runtime's own names "
                "(`acme*` functions, `ACME_*` environment variables). Chapter 17 lists why."]
    else:
        parts.append(
            "This stage calls the device `privateuseone`, PyTorch's default name; chapter "
            f"{NAMED} gives it a name of its own, set in one place.")
    parts += [
        "",
        "## What is here",
        "",
        f"The capabilities of chapters 0 to {stage}:",
        "",
        *(f"{c.number}. {c.title}" for c in upto),
        "",
        "Files, by layer (no file reaches up a layer):",
        "",
        *_files_by_layer(files),
        "- `CMakeLists.txt` builds the runtime library and the extension module `_C`; "
        "`pyproject.toml` makes the folder a Python project (scikit-build-core runs CMake).",
        "",
    ]
    return "\n".join(parts)
