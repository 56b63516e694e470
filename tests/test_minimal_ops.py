"""Chapter 1: what the minimal op set refuses, from stage 1 on.

Each check runs at stage 1, where chapter 1's own code is in place, and at the
last stage, whose later chapters must keep it.
"""

import json
import textwrap

import pytest

from conftest import LAST, run_in_stage

STAGES = [1, LAST]

PRELUDE = """
import json, torch, torch_acme
name = torch._C._get_privateuse1_backend_name()
module = getattr(torch, name)
"""


def in_stage(stage: int, code: str) -> dict:
    proc = run_in_stage(stage, PRELUDE + textwrap.dedent(code))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("stage", STAGES)
def test_set_refuses_a_storage_on_another_device(stage):
    seen = in_stage(stage, """
        t = torch.empty(0, device=name)
        errors = []
        for source in (torch.ones(3).untyped_storage(), torch.ones(3)):
            try:
                t.set_(source)
            except RuntimeError as error:
                errors.append(str(error))
        print(json.dumps({"errors": errors, "device": t.device.type, "numel": t.numel()}))
    """)
    assert len(seen["errors"]) == 2, seen
    assert all('to a storage on different device "cpu"' in e for e in seen["errors"]), seen
    assert seen["device"] != "cpu" and seen["numel"] == 0


@pytest.mark.parametrize("stage", STAGES)
def test_synchronize_honours_its_device_argument(stage):
    seen = in_stage(stage, """
        module.synchronize(1)
        after_one = module.current_device()
        module.synchronize(f"{name}:1")
        try:
            module.synchronize(7)
            refused = ""
        except Exception as error:
            refused = f"{type(error).__name__}: {error}"
        print(json.dumps({"current": [after_one, module.current_device()], "refused": refused}))
    """)
    # The current device is left alone, and a device that does not exist is refused.
    assert seen["current"] == [0, 0], seen
    assert "7" in seen["refused"] and "device" in seen["refused"].lower(), seen
