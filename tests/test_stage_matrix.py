"""A stage has exactly the capabilities of the chapters up to it, no more."""

import json
from pathlib import Path

import pytest

from capability_probes import PROBES
from conftest import CHAPTERS, built_stages, stage_env
from tools import preforked

PROBE_SCRIPT = Path(__file__).with_name("capability_probes.py")


def test_every_chapter_has_a_probe():
    assert sorted(PROBES) == [c["number"] for c in CHAPTERS]


def pytest_generate_tests(metafunc):
    if "stage" in metafunc.fixturenames:
        stages = built_stages(metafunc.config)
        metafunc.parametrize("stage", stages, ids=[f"stage-{s:02d}" for s in stages])


def test_stage_has_exactly_its_chapters(stage):
    # A new process per stage: one PrivateUse1 backend per process. The probes
    # of chapters 15 and 20 import Dynamo and Inductor at every stage: once here.
    proc = preforked.python([str(PROBE_SCRIPT)], stage_env(stage),
                            preload=("torch._dynamo", "torch._inductor.compile_fx"))
    assert proc.returncode == 0, proc.stderr
    present = {int(k): v for k, v in json.loads(proc.stdout.splitlines()[-1]).items()}
    expected = {c["number"]: c["number"] <= stage for c in CHAPTERS}
    assert present == expected, f"stage {stage}: {present}\n{proc.stderr}"
