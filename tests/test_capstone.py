"""Chapter 23: tools/train.py, written for torch.cuda, runs unchanged on acme.

Every run is the script itself in a fresh process that sees the last stage as
installed (tools/train_runs.py): on the CPU with --device cpu, on acme by
torch.accelerator's choice. No run may reach the CPU fallback. The chapter's
own run covers the rest of its claims: float32 eager runs against the CPU,
the compiled model with dropout, the same seed giving the same run, a killed
run resuming exactly, and DDP on two processes matching one.
"""

from __future__ import annotations

import sys

import pytest

from conftest import BUILD, LAST, ROOT

if LAST < 23:
    pytest.skip("the last stage predates chapter 23", allow_module_level=True)

sys.path.insert(0, str(ROOT / "tools"))
import train_runs  # noqa: E402

# Two epochs of 8 steps: enough to see a curve, cheap enough for every run.
SMALL = ("--samples", "256", "--epochs", "2")
STEPS = 16
# How far the two devices' losses may drift apart over 16 steps: float32
# rounding, or the half-precision type's (bfloat16 keeps 8 bits, float16 11).
TOLERANCE = {"off": 1e-5, "bf16": 2e-2, "fp16": 1e-2}


@pytest.fixture(scope="module")
def site():
    return train_runs.installed(BUILD, LAST)


def on_acme(run: train_runs.Run) -> train_runs.Run:
    """A finished run that trained on acme:0, every op on the device."""
    run.check()
    assert {row["device"] for row in run.metrics} == {"acme:0"}
    assert run.fallback_ops == [], run.fallback_ops
    return run


def assert_curves_agree(cpu: list[float], acme: list[float], rtol: float) -> None:
    assert len(cpu) == len(acme) == STEPS
    worst = max(abs(a - c) / abs(c) for a, c in zip(acme, cpu))
    assert worst <= rtol, (worst, cpu, acme)
    assert cpu[-1] < 0.9 * cpu[0], f"the model did not learn: {cpu}"


# Float32 and eager: the chapter's own run compares those, for both models.
@pytest.mark.parametrize("model,amp", [("cnn", "fp16"), ("lm", "bf16")])
def test_acme_follows_the_cpu_under_amp(site, tmp_path, model, amp):
    # Dropout off: the two devices' generators draw different masks (as CUDA's
    # and the CPU's do), so only a run without randomness can match.
    args = (*SMALL, "--model", model, "--amp", amp, "--dropout", "0")
    cpu = train_runs.train(site, tmp_path, *args, "--device", "cpu").check()
    assert {row["device"] for row in cpu.metrics} == {"cpu"}
    acme = on_acme(train_runs.train(site, tmp_path, *args))
    assert_curves_agree(cpu.losses, acme.losses, TOLERANCE[amp])


@pytest.mark.parametrize("model", ["cnn", "lm"])
def test_compiled_follows_the_cpu(site, tmp_path, model):
    # The LM compiles with activation checkpointing around its blocks.
    args = (*SMALL, "--model", model, "--dropout", "0")
    cpu = train_runs.train(site, tmp_path, *args, "--device", "cpu").check()
    acme = on_acme(train_runs.train(site, tmp_path, *args, "--compile"))
    assert_curves_agree(cpu.losses, acme.losses, TOLERANCE["off"])
