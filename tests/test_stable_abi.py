"""The stable-ABI kernel library (csrc/stable, chapter 17): it imports nothing of
libtorch but the C shim, computes what the CPU computes on every stage that
has it (host loop at 17, a kernel on the current stream from 18), and one
compiled copy serves every release this machine has a build of."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import BUILD, LAST, ROOT, stage_env, stage_path

FIRST = 17  # the chapter that adds csrc/stable
LIBRARY = "libacme_stable.so"

PROBE = r"""
import json
import torch, torch_acme
gen = torch.Generator().manual_seed(0)
gate, up = torch.randn(33, 17, generator=gen), torch.randn(33, 17, generator=gen)
want = torch.nn.functional.silu(gate) * up
g, u = gate.to("acme"), up.to("acme")
# Queued work first: the kernel must see the results of what ran before it.
g2 = g * 2
got = {
    "plain": torch.ops.acme_stable.swiglu(g, u).cpu(),
    "after-queued-work": torch.ops.acme_stable.swiglu(g2, u).cpu(),
    "transposed": torch.ops.acme_stable.swiglu(g.t(), u.t()).cpu(),
    "empty": torch.ops.acme_stable.swiglu(g[:0], u[:0]).cpu(),
}
wants = {"plain": want, "after-queued-work": torch.nn.functional.silu(gate * 2) * up,
         "transposed": want.t(), "empty": want[:0]}
out = torch.ops.acme_stable.swiglu(g, u)
errors = {}
for name, call in {
    "dtype": lambda: torch.ops.acme_stable.swiglu(g, u.double()),
    "shape": lambda: torch.ops.acme_stable.swiglu(g, u[:2]),
    "devices": lambda: torch.ops.acme_stable.swiglu(g, up),
    "cpu": lambda: torch.ops.acme_stable.swiglu(gate, up),
}.items():
    try:
        call()
        errors[name] = None
    except Exception as e:
        errors[name] = [type(e).__name__, str(e).splitlines()[0]]
print(json.dumps({
    "torch": torch.__version__,
    "match": {k: torch.allclose(got[k], wants[k], rtol=1e-6, atol=1e-6) for k in got},
    "shapes": {k: list(got[k].shape) == list(wants[k].shape) for k in got},
    "out": [str(out.device), str(out.dtype), out.is_contiguous()],
    "errors": errors,
}))
"""


def run_probe(python: str, env: dict[str, str]) -> dict:
    done = subprocess.run([python, "-c", PROBE], env=env, capture_output=True, text=True,
                          timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check(result: dict) -> None:
    assert all(result["match"].values()), result
    assert all(result["shapes"].values()), result
    assert result["out"] == ["acme:0", "torch.float32", True], result
    errors = result["errors"]
    assert errors["dtype"][0] == "RuntimeError", errors
    assert errors["dtype"][1].endswith("acme_stable::swiglu: expected float32 gate and up"), errors
    assert errors["shape"][1].endswith("gate and up must have the same shape"), errors
    assert errors["devices"][1].endswith("gate and up are on different devices"), errors
    # No CPU kernel: the dispatcher's own error, which names the op and the key.
    assert errors["cpu"][0] == "NotImplementedError", errors
    assert "'acme_stable::swiglu' with arguments from the 'CPU' backend" in errors["cpu"][1], errors
    # The message names the source inside the stage, not a build machine's path.
    assert "csrc/stable/swiglu.cpp:" in errors["dtype"][1] and str(ROOT) not in errors["dtype"][1], errors


@pytest.mark.skipif(LAST < FIRST, reason="the stage under test predates chapter 17")
def test_the_stable_library_imports_the_c_shim_alone():
    library = stage_path(LAST) / "torch_acme" / LIBRARY
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True,
                               text=True, check=True).stdout.split()
    symbols = [s for s in undefined if not re.fullmatch(r"[Uw]|[0-9a-f]+", s)]
    # C++ symbols of PyTorch's own (c10::, at::, torch::) would tie it to one release.
    cxx = [s for s in symbols if re.match(r"_ZN(K|St)?\d*(c10|at|torch)\d", s) or "c10" in s]
    assert not cxx, cxx
    shim = {s for s in symbols if s.startswith(("aoti_torch_", "torch_"))}
    assert {"torch_library_impl", "aoti_torch_create_device_guard"} <= shim, shim
    needed = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True,
                            check=True).stdout
    assert "[libtorch_python.so]" not in needed and "[libtorch_cpu.so]" in needed, needed


@pytest.mark.parametrize("stage", sorted({FIRST, 18, LAST}))
def test_stable_swiglu_matches_the_cpu(stage):
    if stage > LAST:
        pytest.skip(f"stage {stage} is not built")
    check(run_probe(sys.executable, stage_env(stage)))


def other_builds() -> list[tuple[str, Path, Path]]:
    """(release, python, build folder) of every other release's build on this
    machine: the book's own (_build) when this run is a compat run, and the
    compat runs' (_build/torch-X) otherwise."""
    found = []
    candidates = [("book", ROOT / ".nox" / "acme", ROOT / "_build")] + [
        (d.name.removeprefix("torch-"), ROOT / ".nox" / d.name, d)
        for d in sorted((ROOT / "_build").glob("torch-*"))]
    for release, env_dir, build in candidates:
        python = env_dir / "bin" / "python"
        if build.resolve() == BUILD or not python.exists():
            continue
        if not (build / "packages" / f"stage-{LAST:02d}" / "torch_acme" / LIBRARY).exists():
            continue
        found.append((release, python, build))
    return found


@pytest.mark.skipif(LAST < FIRST, reason="the stage under test predates chapter 17")
def test_one_stable_library_serves_every_release(tmp_path):
    """This build's libacme_stable.so in each other release's torch_acme, in
    place of the one built there: the same file, the same results."""
    others = other_builds()
    if not others:
        pytest.skip("no build of another release on this machine (nox -s compat makes them)")
    ours = stage_path(LAST) / "torch_acme" / LIBRARY
    for release, python, build in others:
        site = tmp_path / release
        shutil.copytree(build / "packages" / f"stage-{LAST:02d}", site)
        shutil.copyfile(ours, site / "torch_acme" / LIBRARY)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ACME_")}
        env.update(PYTHONPATH=str(site), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
        result = run_probe(str(python), env)
        assert result["torch"].split("+")[0] != torch.__version__.split("+")[0], (release, result)
        check(result)
