"""Sessions: chapter-N (build stage N, run chapters 0..N), tests, site, bench, conformance, compat.

All sessions share one environment (.nox/acme): torch alone is ~1 GB, and the
stages differ by build folder and kernel, not by Python packages.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent.resolve()
ENV = ROOT / ".nox" / "acme"
PYTHON = ENV / "bin" / "python"
CHAPTERS = tomllib.loads((ROOT / "chapters" / "chapters.toml").read_text())["chapter"]

nox.options.default_venv_backend = "none"
nox.options.sessions = ["tests"]


def environment(session: nox.Session) -> None:
    """Create the shared environment, or bring it up to date with requirements.txt."""
    requirements = (ROOT / "requirements.txt").read_bytes()
    stamp = ENV / ".requirements-sha256"
    wanted = hashlib.sha256(requirements).hexdigest()
    if not PYTHON.exists():
        session.run(sys.executable, "-m", "venv", str(ENV), external=True)
    if not stamp.exists() or stamp.read_text() != wanted:
        # uv, when installed, fetches and unpacks the ~3 GB of PyTorch and its
        # CUDA libraries in parallel (.ci/run installs it); otherwise pip.
        # Byte-compiled at install, as pip does: not by each first import.
        uv = shutil.which("uv")
        if uv:
            session.run(uv, "pip", "install", "-q", "--compile-bytecode", "--python", str(PYTHON),
                        "-r", "requirements.txt", external=True)
        else:
            session.run(str(PYTHON), "-m", "pip", "install", "-q", "-r", "requirements.txt", external=True)
        stamp.write_text(wanted)


def run(session: nox.Session, *args: str, **kwargs) -> None:
    env = {"PATH": f"{ENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    session.run(str(PYTHON), *args, external=True, env=env, **kwargs)


def build(session: nox.Session, upto: int | None = None) -> None:
    args = ["tools/build_stages.py", "--kernels"]
    if upto is not None:
        args += ["--upto", str(upto)]
    run(session, *args)


def make_chapter_session(number: int, title: str) -> None:
    @nox.session(name=f"chapter-{number}")
    def chapter(session: nox.Session) -> None:
        environment(session)
        build(session, number)
        run(session, "-m", "pytest", "tests/test_chapters.py", "-q", f"--upto={number}", *session.posargs)

    chapter.__doc__ = f"Build stage {number} ({title}) and run chapters 0..{number}."


for _chapter in CHAPTERS:
    make_chapter_session(_chapter["number"], _chapter["title"])


@nox.session
def tests(session: nox.Session) -> None:
    """Build every stage and run the whole test suite, on two pytest-xdist workers."""
    environment(session)
    build(session)
    run(session, "-m", "pytest", "tests", "-n", "2", *session.posargs)


@nox.session
def site(session: nox.Session) -> None:
    """Build every stage, then the site into _build/html (chapters run only if their last run is stale)."""
    environment(session)
    build(session)
    # The benchmark page shows measured figures: a quick run (about 40 s) when
    # `nox -s bench` has not written fuller ones.
    if not (ROOT / "_build" / "bench" / "results.json").exists():
        run(session, "tools/bench.py", "--quick")
    # The conformance page shows this machine's `nox -s conformance` run, or
    # the whole run published with the book (docs/_generated/).
    # Doctrees beside the site, not inside the folder one publishes.
    shutil.rmtree(ROOT / "_build" / "html" / ".doctrees", ignore_errors=True)
    # Incremental: a page is rebuilt when its text, its snippets or the run its
    # outputs come from changed (docs/_ext/acme_book.py).
    run(session, "-m", "sphinx", "-W", "--keep-going", "-b", "html",
        "-d", "_build/doctrees", ".", "_build/html")


@nox.session
def bench(session: nox.Session) -> None:
    """Build every stage, then time native kernels, fallback and builds into _build/bench."""
    environment(session)
    build(session)
    run(session, "tools/bench.py", *session.posargs)


@nox.session
def conformance(session: nox.Session) -> None:
    """Build every stage, then run PyTorch's OpInfo and ModuleInfo samples on acme against the CPU."""
    environment(session)
    build(session)
    # Writes _build/conformance/results.json, which the site's conformance page
    # shows; `python tools/conformance.py --publish` keeps it with the book.
    run(session, "tools/conformance.py", *session.posargs)


# ---- the version matrix (chapter 17, docs/versions.md) ----

# The releases besides the book's own (requirements.txt) that every stage must
# build and pass on; tools/versions.py lists all of them, oldest first.
def compat_releases() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from tools.versions import RELEASES, pinned_release

    return [r for r in RELEASES if r != pinned_release()]


@nox.session
def compat(session: nox.Session) -> None:
    """Build every stage against each other PyTorch release and run the whole suite there.

    nox -s compat                          # every release in tools/versions.py but the book's
    nox -s compat -- --release 2.14.1      # one of them; later arguments go to pytest
    """
    args = list(session.posargs)
    releases = compat_releases()
    if args[:1] == ["--release"]:
        wanted = args[1]
        if wanted not in releases:
            session.error(f"--release {wanted}: not one of {', '.join(releases)} (tools/versions.py)")
        releases, args = [wanted], args[2:]
    requirements = [line for line in (ROOT / "requirements.txt").read_text().splitlines()
                    if line.strip() and not line.startswith(("#", "torch=="))]
    for release in releases:
        # An environment and a build folder per release: a build serves one release only.
        env_dir = ROOT / ".nox" / f"torch-{release}"
        python = env_dir / "bin" / "python"
        wanted = hashlib.sha256("\n".join([release, *requirements]).encode()).hexdigest()
        stamp = env_dir / ".requirements-sha256"
        if not python.exists():
            session.run(sys.executable, "-m", "venv", str(env_dir), external=True)
        if not stamp.exists() or stamp.read_text() != wanted:
            session.run(str(python), "-m", "pip", "install", "-q", f"torch=={release}",
                        *requirements, external=True)
            stamp.write_text(wanted)
        build_dir = ROOT / "_build" / f"torch-{release}"
        env = {"PATH": f"{env_dir / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
               "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "ACME_BUILD_DIR": str(build_dir)}
        session.run(str(python), "tools/build_stages.py", "--kernels", "--out", str(build_dir),
                    external=True, env=env)
        session.run(str(python), "-m", "pytest", "tests", "-n", "2", *args, external=True, env=env)


# ---- reliability: sanitizers and differential fuzzing ----

# What `nox -s sanitize` runs: the runtime, bad inputs, threads, leaks, a fuzz
# smoke run, serialization, the native kernels, the stage matrix and a few
# chapters (each notebook runs in its own kernel, which inherits the
# sanitizer environment).
SANITIZED_TESTS = ["tests/test_runtime.py", "tests/test_bad_inputs.py", "tests/test_threads.py",
                   "tests/test_leaks.py", "tests/test_fuzz.py", "tests/test_serialization.py",
                   "tests/test_native_kernels.py", "tests/test_copies.py", "tests/test_device_guard.py",
                   "tests/test_clean_exit.py",
                   "tests/test_stage_matrix.py", "tests/test_chapters.py", "-k",
                   "not test_chapter_runs_against_its_stage or ch00 or ch02 or ch06 or ch07 or ch10"]


@nox.session
def sanitize(session: nox.Session) -> None:
    """Build every stage with ASan and UBSan (into <build>/sanitize) and run the reliability tests there."""
    environment(session)
    base = Path(os.environ.get("ACME_BUILD_DIR", ROOT / "_build")).resolve()
    run(session, "tools/build_stages.py", "--kernels", "--sanitize", "--out", str(base))

    def gcc_file(name: str) -> str:
        return session.run("gcc", f"-print-file-name={name}", external=True, silent=True).strip()

    # Python is not built with ASan, so its runtime must be loaded first, and
    # libstdc++ with it (else ASan's __cxa_throw interceptor finds no real
    # __cxa_throw: python does not link libstdc++, and the first C++ exception
    # aborts with "CHECK failed: real___cxa_throw").
    session.env["LD_PRELOAD"] = f"{gcc_file('libasan.so')} {gcc_file('libstdc++.so')}"
    session.env["ACME_BUILD_DIR"] = str(base / "sanitize")
    # Every Python allocation through malloc, so ASan checks them and LeakSanitizer
    # can tell reachable from leaked (pymalloc's arenas are invisible to it).
    session.env["PYTHONMALLOC"] = "malloc"
    # handle_segv=0: in checked mode the runtime installs a SIGSEGV handler that
    # reports a host access to device memory, then lets the fault kill the
    # process as before (tests/test_runtime.py expects death by SIGSEGV). With
    # ASan's own handler installed first, the runtime would chain to it, and the
    # re-raised fault would end in ASan's "SEGV on unknown address" report and
    # ASan's exit status instead. ASan still reports every invalid access it
    # instruments; only wild faults lose its stack trace (the runtime's report
    # and the signal remain).
    # exitcode=86: a sanitizer report is never mistaken for a Python exception's 1.
    session.env["ASAN_OPTIONS"] = ("detect_leaks=1:handle_segv=0:exitcode=86:strict_string_checks=1:"
                                   "detect_stack_use_after_return=1:check_initialization_order=1")
    session.env["LSAN_OPTIONS"] = f"suppressions={ROOT / 'tools' / 'sanitizers' / 'lsan.supp'}:print_suppressions=0"
    session.env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1:exitcode=86"
    run(session, "-m", "pytest", *(session.posargs or SANITIZED_TESTS))


@nox.session
def fuzz(session: nox.Session) -> None:
    """Build every stage and run 10,000 random programs on acme and on the CPU (tools/fuzz.py)."""
    environment(session)
    build(session)
    run(session, "tools/fuzz.py", "--programs", "10000", *session.posargs)
