"""Sessions: chapter-N (build stage N, run chapters 0..N), tests, site.

All sessions share one environment (.nox/acme): torch alone is ~1 GB, and the
stages differ by build folder and kernel, not by Python packages.
"""

from __future__ import annotations

import hashlib
import os
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
    """Build every stage and run the whole test suite."""
    environment(session)
    build(session)
    run(session, "-m", "pytest", "tests", *session.posargs)


@nox.session
def site(session: nox.Session) -> None:
    """Build every stage, then the site with freshly executed chapters into _build/html."""
    environment(session)
    build(session)
    run(session, "tools/make_notebooks.py")
    run(session, "-m", "sphinx", "-W", "--keep-going", "-E", "-b", "html", ".", "_build/html")
