"""What an op depends on is what held when it was called, not when its kernel ran.

acme's launches are asynchronous (chapter 18): a kernel runs on the stream's
worker after the call returned. State the op reads (the default dtype, grad
mode, autocast, deterministic algorithms, the float32 matmul precision) may
have changed by then. The same program runs with asynchronous launches and
with ACME_LAUNCH_BLOCKING=1, each op called under changed state that is put
back before anything waits for the device, and behind enough queued work that
the kernel runs after the change is undone. Both runs must agree bit for bit,
and with the CPU under the same state.
"""

from __future__ import annotations

import textwrap

import torch

from conftest import LAST, run_in_stage

PROGRAM = textwrap.dedent("""
    import contextlib, sys, warnings
    import torch
    warnings.simplefilter("ignore")
    if DEVICE == "acme":
        import torch_acme

    def busy():
        # Queue work, so that what is launched next runs after the state is put back.
        if DEVICE == "acme":
            for _ in range(3):
                big @ big

    big = torch.ones(900, 900, device=DEVICE)
    ints = torch.arange(1, 1001, device=DEVICE)
    sevens = torch.full((1000,), 7, device=DEVICE)
    floats = torch.linspace(-3, 3, 1000, device=DEVICE)
    mat = torch.linspace(0, 1, 64 * 64, device=DEVICE).reshape(64, 64)
    out = {}

    @contextlib.contextmanager
    def default_dtype(dtype):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    @contextlib.contextmanager
    def deterministic():
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(False)

    @contextlib.contextmanager
    def matmul_precision(value):
        torch.set_float32_matmul_precision(value)
        try:
            yield
        finally:
            torch.set_float32_matmul_precision("highest")

    CASES = {
        "int / int": (lambda: default_dtype(torch.float64), lambda: ints / sevens),
        "int * 0.1": (lambda: default_dtype(torch.float64), lambda: ints * 0.1),
        "int + 0.5": (lambda: default_dtype(torch.float64), lambda: ints + 0.5),
        "int / 3": (lambda: default_dtype(torch.float64), lambda: ints / 3),
        "int < int * 0.5": (lambda: default_dtype(torch.float64), lambda: ints < sevens * 0.5),
        "int true_divide": (lambda: default_dtype(torch.float64),
                            lambda: torch.true_divide(ints, sevens)),
        "int ** 0.5": (lambda: default_dtype(torch.float64), lambda: ints ** 0.5),
        "float / int": (lambda: default_dtype(torch.float64), lambda: floats / sevens),
        "no_grad mul": (torch.no_grad, lambda: floats * 3),
        "autocast mm": (lambda: torch.autocast(DEVICE, dtype=torch.bfloat16), lambda: mat @ mat),
        "deterministic index_add": (deterministic, lambda: torch.zeros(8, device=DEVICE).index_add(
            0, ints[:64] % 8, floats[:64])),
        "medium mm": (lambda: matmul_precision("medium"), lambda: mat @ mat),
    }
    for name, (state, op) in CASES.items():
        busy()  # each op queued behind work, its state put back before that work is done
        with state():
            out[name] = op()
        if DEVICE == "acme":
            torch.acme.synchronize()  # the kernel runs now, under the state put back

    torch.save({k: v.cpu() for k, v in out.items()}, sys.argv[1])
""")


def run(tmp_path, device: str, blocking: str) -> dict[str, torch.Tensor]:
    path = tmp_path / f"{device}-{blocking}.pt"
    code = f"DEVICE = {device!r}\nimport sys; sys.argv = ['', {str(path)!r}]\n" + PROGRAM
    proc = run_in_stage(LAST, code, ACME_LAUNCH_BLOCKING=blocking)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(path)


def test_results_do_not_depend_on_when_kernels_run(tmp_path):
    queued, blocking = run(tmp_path, "acme", "0"), run(tmp_path, "acme", "1")
    on_cpu = run(tmp_path, "cpu", "0")
    assert queued.keys() == blocking.keys() == on_cpu.keys()
    # The CPU's autocast lowers mm to bfloat16 as acme's does; the rest is the
    # CPU's own arithmetic on both.
    differ = [name for name in queued
              if not (queued[name].dtype == blocking[name].dtype == on_cpu[name].dtype
                      and torch.equal(queued[name], blocking[name])
                      and torch.equal(queued[name], on_cpu[name]))]
    assert not differ, f"results that depend on when the kernel ran: {differ}"
