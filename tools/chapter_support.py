"""Helpers the chapter notebooks use in their hidden cells and failure demos.

A chapter's kernel (installed by tools/build_stages.py --kernels) sets
ACME_STAGE_DIR to the stage build it must run against; these helpers check that
and reach the neighbouring stages for "what fails before this chapter" cells.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import os
import re
import runpy
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import traceback
import warnings
from pathlib import Path

try:
    import preforked  # tools/ is on sys.path (the chapters' kernels)
except ImportError:
    from tools import preforked


# The book's clone. Helpers run code from its chapters/ folder, so a downloaded
# notebook opened anywhere behaves as the book's page did.
BOOK = Path(__file__).resolve().parent.parent


def stage_dir(number: int) -> Path:
    """Stage `number`'s snapshot (sources only)."""
    return Path(os.environ["ACME_STAGE_DIR"]).parent / f"stage-{number:02d}"


def stage_path(number: int) -> Path:
    """What goes on sys.path to import stage `number`'s build (tools/build_stages.py)."""
    return Path(os.environ["ACME_STAGE_DIR"]).parent.parent / "packages" / f"stage-{number:02d}"


# The widest output line that fits the page's text column without scrolling.
OUTPUT_WIDTH = 88

# Build-machine paths a reader must not see, and what each becomes: a stage's
# files by their path inside the stage, PyTorch's by their path inside the
# package, temporary files by their name, PyTorch's "(Triggered internally at
# <source path>)" tail not at all.
_MACHINE_PATHS = [
    (re.compile(r" \(Triggered internally at [^)]*\)"), ""),
    (re.compile(r"(?:/[^\s:'\"]*)?/stages/stage-\d\d/"), ""),
    (re.compile(r"(?:/[^\s:'\"]*)?/packages/stage-\d\d/"), "src/"),
    (re.compile(re.escape(sysconfig.get_paths()["purelib"]) + "/"), ""),
    (re.compile(re.escape(tempfile.gettempdir()) + r"/[^/\s'\"]+/"), ""),
    (re.compile(re.escape(str(BOOK)) + "/"), ""),
]


def clean(text: str) -> str:
    """`text` without build-machine paths (see _MACHINE_PATHS)."""
    for pattern, replacement in _MACHINE_PATHS:
        text = pattern.sub(replacement, text)
    return text


def wrap(text: str) -> str:
    """`text` with every line longer than OUTPUT_WIDTH folded, its continuations indented."""
    lines = text.split("\n")
    if all(len(line) <= OUTPUT_WIDTH for line in lines):
        return text
    folded = []
    for line in lines:
        if len(line) <= OUTPUT_WIDTH:
            folded.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        folded += textwrap.wrap(line, OUTPUT_WIDTH, subsequent_indent=indent + "    ",
                                break_on_hyphens=False) or [line[:OUTPUT_WIDTH]]
    return "\n".join(folded)


class _CleanStream:
    """The kernel's stdout or stderr, writing clean() text that fits the column.

    Whole lines only: print() writes its pieces one call at a time, and a line
    can be folded only once it is complete (the rest goes out on flush()).
    """

    def __init__(self, stream):
        self._stream = stream
        self._partial = ""

    def write(self, text):
        complete, newline, self._partial = (self._partial + text).rpartition("\n")
        if newline:
            self._stream.write(wrap(clean(complete)) + "\n")
        return len(text)

    def flush(self):
        if self._partial:
            self._stream.write(wrap(clean(self._partial)))
            self._partial = ""
        return self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as a reader needs it: its type and message, not the file it came from."""
    print(f"{category.__name__}: {message}", file=sys.stderr if file is None else file)


def _show_exception(shell, etype, value, tb, tb_offset=None):
    """A failing cell shows its exception line (and message), not PyTorch's frames."""
    # What IPython's own handler records, and last_error() reads.
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb
    text = clean(f"{etype.__name__}: {value}")
    if "Could not run" in text and "\n\n" in text:
        # The dispatcher goes on to explain selective builds and to list every
        # dispatch key the op has a kernel for: dozens of lines, none of them
        # what the cell is about.
        first = text.split(". ")[0] + "."
        keys = sum(1 for line in text.partition("\n\n")[2].splitlines() if line.strip())
        text = f"{first}\n[... the dispatcher's advice and its {keys} kernel registrations]"
    lines = [piece for line in text.splitlines()
             for piece in textwrap.wrap(line, OUTPUT_WIDTH, subsequent_indent="    ") or [""]]
    shell._showtraceback(etype, value, lines)
    return lines


def clean_outputs() -> None:
    """Outputs without build-machine paths: exceptions and warnings by message."""
    warnings.showwarning = _show_warning
    if not isinstance(sys.stdout, _CleanStream):
        sys.stdout, sys.stderr = _CleanStream(sys.stdout), _CleanStream(sys.stderr)
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if shell is not None:
        shell.set_custom_exc((BaseException,), _show_exception)


# The CPU fallback's notice, once per op ("acme: aten::sin.out has no acme kernel
# and runs on the CPU ..."): chapter 2's subject, noise in every later output.
# Cells that record warnings with simplefilter("always") still see it.
FALLBACK_NOTICE = r".* has no \S+ kernel and runs on the CPU"


def check_stage(number: int) -> None:
    """Fail unless this kernel imports stage `number`'s build of torch_acme;
    after chapter 2, hide the fallback's notice in the notebook's outputs."""
    clean_outputs()
    if number > 2:
        warnings.filterwarnings("ignore", message=FALLBACK_NOTICE)
    assert Path(os.environ["ACME_STAGE_DIR"]).resolve() == stage_dir(number).resolve(), (
        f"this kernel serves {os.environ['ACME_STAGE_DIR']}, not stage {number}")
    expected = stage_path(number).resolve()
    spec = importlib.util.find_spec("torch_acme")
    assert spec is not None and spec.origin, "torch_acme is not importable in this kernel"
    package = Path(spec.origin).resolve().parent
    assert package.is_relative_to(expected), f"torch_acme comes from {package}, not {expected}"
    info = runpy.run_path(str(package / "_build_info.py"))
    assert info["STAGE"] == number, f"the build in {package} is stage {info['STAGE']}"


def at_stage(number: int, code: str, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run `code` in a new process against stage `number` (one backend per process),
    as `python -c code` would: a child forked from a process that has imported
    torch and nothing of acme (tools/preforked.py), which saves each call that import;
    with `fresh`, a new interpreter (for what happens at exit)."""
    env = dict(os.environ, PYTHONPATH=str(stage_path(number)))
    return preforked.python(["-c", code], env, cwd=BOOK / "chapters", timeout=300, fresh=fresh)


def on_ranks(number: int, code: str, world: int = 2, timeout: float = 120,
             **env: str) -> list[subprocess.CompletedProcess]:
    """Run `code` as `world` processes against stage `number`, each with the
    environment torchrun gives a rank (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT), so `init_process_group()` finds its peers."""
    try:
        from rendezvous import hosted_stores
    except ImportError:
        from tools.rendezvous import hosted_stores
    # The rendezvous store is hosted here, on a port the OS chose (MASTER_PORT),
    # as torchrun's agent hosts it; the ranks join it as clients.
    with hosted_stores() as (_, store_env):
        procs = []
        for rank in range(world):
            rank_env = dict(os.environ, PYTHONPATH=str(stage_path(number)), RANK=str(rank),
                            LOCAL_RANK=str(rank), WORLD_SIZE=str(world), **store_env, **env)
            procs.append(subprocess.Popen([sys.executable, "-c", code], env=rank_env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          cwd=BOOK / "chapters"))
        done = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=timeout)
                done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        finally:
            for p in procs:
                p.kill()
    return done


@functools.cache
def compiled_accelerator() -> str | None:
    """The accelerator PyTorch itself was built with ("cuda" in the CUDA wheels), or
    None for a CPU-only build: the one the accelerator layer answers with until a
    PrivateUse1 backend registers (chapter 3). Asked in a process without torch_acme."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    code = "import torch; a = torch.accelerator.current_accelerator(); print(a.type if a else '')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    return proc.stdout.strip() or None


def last_error() -> BaseException:
    """The exception the previous cell raised (and forget it, so it is never reused).

    The traceback is dropped too: its frames would keep the failing call's
    tensors (and their device memory) alive.
    """
    error = getattr(sys, "last_value", None)
    assert error is not None, "the previous cell did not raise"
    del sys.last_value
    # IPython keeps its own reference to the traceback (for %debug): empty the
    # frames themselves, so no failed call's locals outlive the cell. The same
    # for the exceptions it was raised from (a compiler wraps the one that
    # failed, whose frames hold the graph's inputs).
    chained, seen = error, set()
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__cause__ or chained.__context__
    sys.last_traceback = sys.last_type = None
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if shell is not None:
        shell.InteractiveTB.tb = None
        shell._last_traceback = None
    return error.with_traceback(None)


def check_no_leaks() -> None:
    """Every byte of device memory a chapter allocated must be free at its end."""
    import time

    from torch_acme import runtime

    gc.collect()
    for device in range(runtime.device_count()):
        # An acme backward runs on the autograd engine's device thread, which
        # lets go of its graph just after backward() returns: allow it 0.5 s.
        for attempt in range(50):
            stats = runtime.memory_stats(device)
            in_use = stats["bytes_in_use"], stats["blocks_in_use"]
            cached = None
            if importlib.import_module("torch_acme._build_info").STAGE >= 12:
                # The caching allocator keeps freed blocks' segments: give them back.
                import torch

                torch.accelerator.empty_cache()
                cached = dict(torch.accelerator.memory_stats(device))
                stats = runtime.memory_stats(device)
                in_use = stats["bytes_in_use"], stats["blocks_in_use"]
            if in_use == (0, 0):
                break
            time.sleep(0.01)
        assert cached is None or cached["allocation.all.current"] == 0, (device, cached)
        assert in_use == (0, 0), (device, stats)


def third_party_dir() -> Path:
    """Where tools/build_stages.py builds chapter 15's stand-in library, boxkit."""
    return Path(os.environ["ACME_STAGE_DIR"]).parent.parent / "third_party"


def installed_view(snapshot: Path, package: Path, dest: Path) -> Path:
    """A stage's build laid out as `pip install` lays it out, without compiling again.

    `dest` gets the package (a link to the stage build `package`) and the
    .dist-info that the build backend (scikit-build-core) writes for the stage
    `snapshot`, entry points included: with `dest` on sys.path, Python sees the
    stage as installed. Returns `dest`.
    """
    dest.mkdir(parents=True, exist_ok=True)
    if not (dest / "torch_acme").exists():
        (dest / "torch_acme").symlink_to(package, target_is_directory=True)
    hook = ("import sys, scikit_build_core.build as backend\n"
            "print(backend.prepare_metadata_for_build_wheel(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", hook, str(dest)], cwd=snapshot,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return dest


def fresh_venv(path: Path) -> Path:
    """A new virtual environment that sees this one's packages (torch, pip) through a
    .pth file: offline, and nothing of the book's build folder on sys.path. Without
    a pip of its own, whose older setuptools would shadow the one torch requires.
    Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   capture_output=True, timeout=300)
    site = next((path / "lib").glob("python3*/site-packages"))
    (site / "book_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return path / "bin" / "python"


def as_installed(number: int, code: str, **env: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python that sees stage `number` as `pip install` leaves it
    (see installed_view), with autoloading on, as a user's Python has it."""
    site = installed_view(stage_dir(number), stage_path(number) / "torch_acme",
                          Path(tempfile.mkdtemp()) / "site-packages")
    environment = {**os.environ, "PYTHONPATH": str(site), "TORCH_DEVICE_BACKEND_AUTOLOAD": "1", **env}
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True,
                          text=True, timeout=300)


_ROW = re.compile(r"^(\w+): (fallthrough )?registered at (\S+?)(?::\d+)? \[([^\]]+)\]$")


def dispatch_rows(table: str, keys: list[str]) -> dict[str, str]:
    """A dispatch table (torch._C._dispatch_dump_table) reduced to what serves each key.

    "PrivateUse1: registered at .../rms_norm.cpp:77 [kernel]" becomes
    "rms_norm.cpp"; PyTorch's own entries are named by kind.
    """
    found = {}
    for line in table.splitlines():
        match = _ROW.match(line.strip())
        if not match or match.group(1) not in keys:
            continue
        _, fallthrough, where, kind = match.groups()
        source = Path(where).name
        if fallthrough:
            found[match.group(1)] = f"fallthrough ({source})"
        elif kind == "math kernel":
            found[match.group(1)] = "composite (math kernel)"
        elif source == "VariableFallbackKernel.cpp":
            found[match.group(1)] = "autograd fallback"
        elif source.startswith("VariableType"):
            found[match.group(1)] = "generated autograd kernel"
        elif source == "cpu_fallback.cpp":
            found[match.group(1)] = "CPU fallback (cpu_fallback.cpp)"
        elif source == "library.py":
            found[match.group(1)] = "from Python (torch.library)"
        else:
            found[match.group(1)] = source
    return {key: found.get(key, "-") for key in keys}


def draw_dispatch_tables(ax, op: str, columns: dict[str, dict[str, str]]) -> None:
    """One operator's dispatch keys (rows) in several stages (columns), as a table."""
    keys = list(next(iter(columns.values())))
    cells = [[column[key] for column in columns.values()] for key in keys]
    ax.axis("off")
    table = ax.table(cellText=cells, rowLabels=keys, colLabels=list(columns), loc="center",
                     cellLoc="left")
    table.auto_set_font_size(False)
    table.set_fontsize(8.5)
    table.scale(1, 1.35)
    for (row, col), cell in table.get_celld().items():
        if row > 0 and col >= 1 and cells[row - 1][col] != cells[row - 1][0]:
            cell.set_facecolor("#fff2cc")  # changed by this chapter
    ax.set_title(op, family="monospace", fontsize=10)
