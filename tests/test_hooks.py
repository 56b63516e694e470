"""Chapter 11: the PrivateUse1 hooks and the device module, as torch.cuda users rely on them.

Lazy initialization and fork() need processes of their own (this one has long
since initialized acme); the rest runs here, against the last stage.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_acme
from conftest import LAST, run_in_stage, stage_env

pytestmark = pytest.mark.skipif(importlib.import_module("torch_acme._build_info").STAGE < 11,
                                reason="chapter 11's hooks are not in this stage")


def run_json(code: str, *, stage: int = LAST, **env: str):
    """Run `code` in a fresh stage process; it prints one JSON line last."""
    proc = run_in_stage(stage, textwrap.dedent(code), **env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


# ---- lazy initialization and fork ----

def test_import_does_not_initialize_and_first_tensor_does():
    out = run_json("""
        import json, torch, torch_acme
        before = [torch.acme.is_initialized(), torch.acme._initialized,
                  torch.acme.is_available(), torch.acme.device_count()]
        t = torch.ones(2, device="acme")
        after = [torch.acme.is_initialized(), torch.acme._initialized]
        torch.acme.init()  # idempotent
        print(json.dumps([before, after]))
    """)
    assert out == [[False, False, True, 2], [True, True]]


FORK_CODE = """
    import json, multiprocessing as mp, torch, torch_acme

    def child(kind):
        try:
            if kind == "new tensor":
                return ["ok", torch.ones(2, device="acme").sum().item()]
            if kind == "inherited tensor":
                return ["ok", (inherited + 1).sum().item()]
            if kind == "seed":
                torch.manual_seed(1)
                torch.acme.manual_seed(1)
                return ["ok", torch.acme._is_in_bad_fork()]
            if kind == "count":
                return ["ok", [torch.acme.device_count(), torch.acme.is_available()]]
        except RuntimeError as error:
            return ["error", str(error).splitlines()[0]]

    def in_fork(kind):
        with mp.get_context("fork").Pool(1) as pool:
            return pool.apply(child, (kind,))
"""


def test_fork_before_initialization_leaves_the_child_free():
    out = run_json(FORK_CODE + """
    inherited = None
    print(json.dumps([in_fork("new tensor"), in_fork("seed"), torch.acme.is_initialized()]))
    """)
    assert out == [["ok", 2.0], ["ok", False], False]


def test_fork_after_initialization_poisons_the_child():
    out = run_json(FORK_CODE + """
    inherited = torch.ones(2, device="acme")
    results = {k: in_fork(k) for k in ["new tensor", "inherited tensor", "seed", "count"]}
    # The parent is unaffected.
    results["parent"] = (inherited + 1).sum().item()
    print(json.dumps(results))
    """)
    assert out["new tensor"][0] == "error"
    assert out["new tensor"][1].startswith("Cannot re-initialize acme in forked subprocess")
    # An inherited tensor skips lazy init; the runtime itself refuses.
    assert out["inherited tensor"][0] == "error"
    assert "acmeErrorForkedChild" in out["inherited tensor"][1]
    # Seeding in such a child is a no-op, as DataLoader workers need.
    assert out["seed"] == ["ok", True]
    assert out["count"] == ["ok", [2, True]]
    assert out["parent"] == 4.0


def test_spawned_child_uses_the_device(tmp_path):
    # spawn re-imports the main module in the child: it must be a file.
    script = tmp_path / "spawn_child.py"
    script.write_text(textwrap.dedent("""
        import json, multiprocessing as mp, torch, torch_acme

        def child():
            return torch.arange(3.0, device="acme").sum().item()

        if __name__ == "__main__":
            torch.ones(1, device="acme")
            with mp.get_context("spawn").Pool(1) as pool:
                print(json.dumps(pool.apply(child)))
    """))
    proc = subprocess.run([sys.executable, str(script)], env=stage_env(LAST), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == 3.0


# ---- no device, bad configuration ----

def test_no_devices():
    out = run_json("""
        import json, torch, torch_acme
        results = [torch.acme.is_available(), torch.acme.device_count(),
                   torch.accelerator.is_available(), torch.accelerator.device_count()]
        torch.manual_seed(3)       # seeds nothing, raises nothing
        torch.acme.manual_seed(3)
        torch.acme.seed_all()
        for call in [torch.acme.init, lambda: torch.ones(1, device="acme")]:
            try:
                call()
                results.append(None)
            except RuntimeError as error:
                results.append(str(error).splitlines()[0])
        print(json.dumps(results))
    """, ACME_DEVICE_COUNT="0")
    assert out[:4] == [False, 0, False, 0]
    for message in out[4:]:
        assert message.startswith("acmeErrorNoDevice: no acme device is present"), message


def test_bad_configuration_is_not_available():
    out = run_json("""
        import json, warnings, torch, torch_acme
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            available = torch.acme.is_available()
        print(json.dumps([available, [str(w.message) for w in caught]]))
    """, ACME_DEVICE_COUNT="many")
    available, warned = out
    assert available is False
    assert any(w.startswith('acme initialization: acmeErrorInitialization: ACME_DEVICE_COUNT="many"')
               for w in warned), warned


# ---- pinned memory ----

def test_pin_memory_and_non_blocking_copies():
    host = torch.arange(12.0).reshape(3, 4)
    assert not host.is_pinned()
    pinned = host.pin_memory()
    assert pinned.is_pinned() and pinned.device.type == "cpu" and torch.equal(pinned, host)
    assert pinned.pin_memory() is pinned  # already pinned: no copy
    on_device = pinned.to("acme", non_blocking=True)
    back = on_device.to("cpu", non_blocking=True)
    torch.acme.synchronize()
    assert back.is_pinned() and torch.equal(back, host)
    assert not on_device.is_pinned()
    # A strided view pins as a contiguous copy.
    assert torch.equal(host.t().pin_memory(), host.t())
    empty = torch.empty(5, pin_memory=True)
    assert empty.is_pinned() and empty[2:].is_pinned()


def test_dataloader_pin_memory_in_a_cpu_pipeline_and_with_workers():
    out = run_json("""
        import json, torch, torch_acme
        from torch.utils.data import DataLoader, TensorDataset

        data = TensorDataset(torch.arange(32.0).reshape(16, 2), torch.arange(16))
        results = []
        for workers in (0, 2):
            loader = DataLoader(data, batch_size=4, pin_memory=True, num_workers=workers)
            batches = list(loader)
            results.append([all(x.is_pinned() and y.is_pinned() for x, y in batches),
                            torch.equal(torch.cat([x for x, _ in batches]), data.tensors[0])])
        # On the device: pinned batches, moved without blocking.
        moved = [x.to("acme", non_blocking=True) for x, _ in DataLoader(data, batch_size=8, pin_memory=True)]
        results.append(torch.equal(torch.cat(moved).cpu(), data.tensors[0]))
        print(json.dumps(results))
    """)
    assert out == [[True, True], [True, True], True]


def test_pinned_memory_in_the_runtime():
    from torch_acme import runtime

    ptr = runtime.host_alloc(100)
    try:
        assert ptr % 4096 == 0
        assert runtime.host_is_pinned(ptr) and runtime.host_is_pinned(ptr + 99)
        assert not runtime.host_is_pinned(ptr + 100)
    finally:
        runtime.host_free(ptr)
    assert not runtime.host_is_pinned(ptr)
    with pytest.raises(runtime.AcmeError, match="not the base of a pinned host allocation"):
        runtime.host_free(ptr)


# ---- storage resize ----

@pytest.mark.parametrize("device", ["acme:0", "acme:1"])
@pytest.mark.parametrize("new_size", [0, 8, 12, 64])
def test_storage_resize(device, new_size):
    t = torch.arange(3, dtype=torch.int32, device=device)
    storage = t.untyped_storage()
    storage.resize_(new_size)
    assert storage.nbytes() == new_size and storage.device == torch.device(device)
    kept = min(new_size, 12)
    assert bytes(storage.cpu())[:kept] == bytes(torch.arange(3, dtype=torch.int32).untyped_storage())[:kept]


def test_resizing_a_storage_acme_did_not_allocate_is_refused():
    t = torch.ones(4, device="acme")
    borrowed = torch._C._construct_storage_from_data_pointer(t.data_ptr(), t.device, 16)
    assert not borrowed.resizable()
    with pytest.raises(RuntimeError, match="acme: cannot resize this storage: it is not resizable"):
        borrowed.resize_(32)
    assert torch.equal(t.cpu(), torch.ones(4))


# ---- properties and capability ----

def test_device_properties_and_capability():
    properties = torch.acme.get_device_properties(1)
    assert properties.name == torch.acme.get_device_name(1) == "acme A1 (simulated)"
    assert torch.acme.get_device_capability(1) == (properties.major, properties.minor) == (1, 0)
    assert properties.total_memory == 16 << 30 and properties.checked
    assert "acme A1" in repr(properties)


# The capability's promise, dtype by dtype: a tensor of each dtype it lists can
# be made on the device, cloned there and copied to the host and back; one it
# leaves out cannot.
CAPABILITY_MATCHES_THE_DEVICE = """
import json, warnings, torch, torch_acme
warnings.simplefilter("ignore")
device = torch._C._get_privateuse1_backend_name()

def holds(dtype):
    try:
        if dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4):
            t = torch._empty_affine_quantized([4], dtype=dtype, device=device, scale=0.5,
                                              zero_point=0)
        else:
            t = torch.empty(4, dtype=dtype, device=device)
        return t.clone().cpu().to(device).device.type == device
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False

listed = torch.accelerator.get_device_capability(0)["supported_dtypes"]
every = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
print(json.dumps({str(d): [d in listed, holds(d)] for d in every}))
"""


@pytest.mark.parametrize("stage", sorted({11, 22, LAST}))
def test_the_capability_lists_exactly_the_dtypes_the_device_holds(stage):
    if stage > LAST:
        pytest.skip(f"stage {stage} is not built")
    verdicts = run_json(CAPABILITY_MATCHES_THE_DEVICE, stage=stage)
    wrong = {name: listed for name, (listed, holds) in verdicts.items() if listed != holds}
    assert not wrong, f"listed (True) but not held, or held but not listed: {wrong}"
    assert verdicts["torch.float8_e4m3fn"] == [True, True]  # held, as a GPU without fp8 units does
    assert verdicts["torch.qint8"] == [stage >= 22] * 2


def test_device_properties_follow_the_configuration():
    out = run_json("""
        import json, torch, torch_acme
        p = torch.acme.get_device_properties(0)
        print(json.dumps([p.total_memory, p.checked]))
    """, ACME_DEVICE_MEMORY="64M", ACME_CHECKED="0")
    assert out == [64 << 20, False]


# ---- checkpointing restores the device RNG ----

def checkpointed_grads(device: str, use_checkpoint: bool, reentrant: bool = False):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16).to(device)
    x = torch.randn(8, 16).to(device).requires_grad_()

    def block(inp):
        return torch.nn.functional.dropout(layer(inp).relu(), p=0.5, training=True)

    torch.manual_seed(1)
    out = checkpoint(block, x, use_reentrant=reentrant) if use_checkpoint else block(x)
    dropped = (out == 0).float().mean().item()
    out.sum().backward()
    return dropped, torch.cat([x.grad.flatten(), layer.weight.grad.flatten()]).cpu()


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("device", ["acme", "cpu"])
def test_checkpoint_around_dropout_gives_the_gradients_without_it(device, reentrant):
    dropped, plain = checkpointed_grads(device, use_checkpoint=False)
    assert dropped > 0.5  # dropout (and relu) zeroed outputs: the mask matters
    assert torch.equal(checkpointed_grads(device, True, reentrant)[1], plain)


def test_empty_host_cache_with_no_host_allocator_registered():
    # Why chapter 11 registers its pinned allocator as PrivateUse1's
    # at::HostAllocator too: at stage 10 there is none. Once the device has
    # been used, PyTorch 2.13 and 2.14 crash in this call; 2.15 returns.
    proc = run_in_stage(10, "import torch, torch_acme; torch.ones(2, device='acme'); "
                            "torch.accelerator.empty_host_cache(); print('returned')")
    if torch.torch_version.TorchVersion(torch.__version__) >= "2.15":
        assert proc.returncode == 0 and proc.stdout.strip() == "returned", proc.stderr
    else:
        assert proc.returncode == -11, (proc.returncode, proc.stderr)  # SIGSEGV
