"""A vendor copies a stage snapshot and builds it alone, with its own CMakeLists.txt."""

import json
import shutil
import subprocess
import sys

import pytest

from conftest import CHAPTERS, built_stages, stage_dir
from test_stage_matrix import PROBE_SCRIPT


def pytest_generate_tests(metafunc):
    if "stage" in metafunc.fixturenames:
        stages = built_stages(metafunc.config)
        # The bare runtime, built with CMake alone. The newest stage is built
        # through pip, from a copy, by tests/test_packaging.py.
        chosen = [stages[0]]
        metafunc.parametrize("stage", chosen, ids=[f"stage-{s:02d}" for s in chosen])


def test_snapshot_builds_and_works_alone(stage, tmp_path):
    copy = tmp_path / "vendor"
    shutil.copytree(stage_dir(stage), copy)
    assert not list(copy.rglob("*.so")), "the copy must start without build outputs"
    text = "\n".join(p.read_text() for p in copy.rglob("*") if p.is_file())
    for marker in ("//>", "//<", "//@", "#>", "#<", "#@"):
        assert f"{marker} ch" not in text, f"chapter marker {marker} left in stage {stage}"

    configure = ["cmake", "-S", str(copy), "-B", str(copy / "build"), "-G", "Ninja",
                 f"-DPython3_EXECUTABLE={sys.executable}"]
    if shutil.which("ccache"):
        configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
    for command in (configure, ["cmake", "--build", str(copy / "build")]):
        proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    env = {"PYTHONPATH": str(copy / "src"), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(PROBE_SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    present = {int(k): v for k, v in json.loads(proc.stdout.splitlines()[-1]).items()}
    assert present == {c["number"]: c["number"] <= stage for c in CHAPTERS}, proc.stderr
