"""Differential fuzzing, small and seeded: tools/fuzz.py's programs agree on acme and on the CPU.

`nox -s fuzz` runs ten thousand programs or more; here a fixed slice of them
(seed 0, or ACME_FUZZ_SEED) runs in a few seconds, and the fuzzer's own parts
(generation, comparison, shrinking) are checked to catch what they claim to.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import LAST
from tools import fuzz
from torch_acme import _build_info

pytestmark = pytest.mark.skipif(_build_info.STAGE != LAST,
                                reason=f"fuzzes the finished backend (stage {LAST})")

SEED = int(os.environ.get("ACME_FUZZ_SEED", "0"))
PROGRAMS = 1000


@pytest.fixture(scope="module", autouse=True)
def backend():
    fuzz.load_backend()


def test_programs_agree_on_acme_and_the_cpu():
    report = fuzz.run(seed=SEED, programs=PROGRAMS)
    print(report.summary())
    assert report.programs == PROGRAMS and report.autograd > 0
    assert not report.mismatches, "\n\n".join(text for _, text in report.mismatches[:3])


def test_programs_are_reproducible():
    first = [fuzz.generate(SEED, i).text() for i in range(5)]
    again = [fuzz.generate(SEED, i).text() for i in range(5)]
    assert first == again
    assert len(set(first)) == 5 and all(len(t.splitlines()) >= 16 for t in first)
    assert fuzz.generate(SEED + 1, 0).text() != first[0]


def test_known_issues_stay_out_unless_asked_for():
    texts = [fuzz.generate(SEED, i).text() for i in range(300)]
    assert not any(".repeat(" in t or "logical_not" in t for t in texts)
    with_known = [fuzz.generate(SEED, i, include_known=True).text() for i in range(300)]
    assert any(".repeat(" in t for t in with_known)


# ---- the comparison catches what it should ----

def compare_runs(program_text: str, device_text: str | None = None, **vars) -> list[str]:
    """Runs two texts (the device one may differ, to plant a bug) and compares them."""
    stmts = [fuzz.Stmt(line, line.split(" = ")[0] if " = " in line else None)
             for line in program_text.splitlines()]
    program = fuzz.Program(0, 0, stmts)
    for stmt in stmts:
        if stmt.target:
            program.vars[stmt.target] = fuzz.Var(stmt.target, vars.get(stmt.target, "D0"))
    device_stmts = stmts if device_text is None else [
        fuzz.Stmt(line, s.target) for line, s in zip(device_text.splitlines(), stmts)]
    dev = fuzz.execute(device_stmts, on_device=True)
    cpu = fuzz.execute(stmts, on_device=False)
    try:
        return fuzz.compare(program, dev, cpu)
    finally:
        dev.ns.clear()
        cpu.ns.clear()


def test_agreeing_programs_pass():
    assert compare_runs("v0 = torch.arange(6.0, device=D0).reshape(2, 3)\nv1 = v0.t()\nv1.add_(1)") == []


def test_a_wrong_value_is_caught():
    problems = compare_runs("v0 = torch.arange(4.0, device=D0)\nv0[1] = 5",
                            "v0 = torch.arange(4.0, device=D0)\nv0[2] = 5")
    assert problems and problems[0].startswith("v0: differs at (1,): 1.0 on acme, 5.0 on the CPU")


def test_a_negative_zero_is_caught():
    problems = compare_runs("v0 = torch.zeros(2, device=D0)", "v0 = -torch.zeros(2, device=D0)")
    assert problems and "differs" in problems[0]


def test_a_lost_alias_is_caught():
    # A "view" that is really a copy: the write through it is lost.
    problems = compare_runs("v0 = torch.zeros(4, device=D0)\nv1 = v0[1:]\nv1.fill_(2)",
                            "v0 = torch.zeros(4, device=D0)\nv1 = v0[1:].clone()\nv1.fill_(2)")
    assert any(p.startswith("v0: differs") for p in problems), problems


def test_layout_device_and_error_parity_are_caught():
    assert "layout" in compare_runs("v0 = torch.zeros(2, 3, device=D0)",
                                    "v0 = torch.zeros(3, 2, device=D0).t()")[0]
    assert "expected acme:1" in compare_runs("v0 = torch.zeros(2, device=D1)",
                                             "v0 = torch.zeros(2, device=D0)", v0="D1")[0]
    problems = compare_runs("v0 = torch.zeros(2, device=D0)\nv0.add_(1)",
                            "v0 = torch.zeros(2, device=D0)\nv0.add_(torch.ones(3, device=D0))")
    assert "raised RuntimeError on acme, nothing on the CPU" in problems[0]


def test_bounds_allow_reordered_sums_and_nothing_more():
    x = torch.randn(1000, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    reordered = x[torch.randperm(1000, generator=torch.Generator().manual_seed(1))].sum()
    bound = fuzz._b_sum(x)
    assert fuzz.compare_tensor(reordered, x.sum(), "cpu", bound) is None
    assert fuzz.compare_tensor(x.sum() + 0.5, x.sum(), "cpu", bound) is not None
    exact = fuzz.compare_tensor(x.sum() + 1e-2, x.sum(), "cpu", None)
    assert exact.startswith("differs at ()")


def test_shrinking_keeps_only_what_the_mismatch_needs():
    text = "\n".join(["v0 = torch.ones(3, device=D0)", "v1 = torch.zeros(2, device=D1)",
                      "v2 = v0 * 2", "v3 = v1 + 1", "v4 = v2.sum()"])
    program = fuzz.Program(0, 0, [fuzz.Stmt(line, line.split(" = ")[0]) for line in text.splitlines()])
    for stmt in program.stmts:
        program.vars[stmt.target] = fuzz.Var(stmt.target, "D1" if stmt.target in ("v1", "v3") else "D0")
    # Plant a bug: on acme, v2 is one too large.
    planted = fuzz.Stmt("v2 = v0 * 2 + (str(v0.device) != 'cpu')", "v2")
    program.stmts[2] = planted
    stmts, problems = fuzz.shrink(program)
    assert [s.code for s in stmts] == ["v0 = torch.ones(3, device=D0)", planted.code]
    assert problems[0].startswith("v2: differs")
    text = fuzz.repro(program, stmts, problems)
    assert "shrunk from 5 to 2 statements" in text and "--seed 0 --program 0" in text
    compile(text, "<repro>", "exec")  # a runnable script
