"""Chapter 7: torch.save and torch.load of acme tensors, and acme's backend metadata.

Runs in the pytest process, which imports the newest stage under test; the
device is addressed through its current name (chapter 8 renames it).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

import torch_acme
from torch_acme import _build_info

if _build_info.STAGE < 7:
    # Scoping, not hiding: before chapter 7 there is nothing here to test.
    pytest.skip(f"the stage under test ({_build_info.STAGE}) predates chapter 7",
                allow_module_level=True)

from torch_acme.device import check_checkpoint  # noqa: E402

NAME = torch._C._get_privateuse1_backend_name()
DEVICE0, DEVICE1 = f"{NAME}:0", f"{NAME}:1"
set_meta, get_meta = torch.ops.acme.set_backend_meta, torch.ops.acme.get_backend_meta

# Every dtype a copy to and from the device handles (chapter 1's _copy_from
# moves bytes): the classic ones go through _rebuild_tensor_v2, the newer
# unsigned and float8 types through _rebuild_tensor_v3.
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
          torch.complex128, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
          torch.float8_e5m2]


def round_trip(obj, **load_args):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True, **load_args)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor's elements, on the CPU (NaN payloads included)."""
    return t.cpu().contiguous().reshape(-1).view(torch.uint8)


def random_bits(dtype, shape=(4, 6)):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, dtype=torch.bool)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8)
    return raw.view(dtype)


@pytest.fixture
def on_device_0():
    """Tests that switch devices leave device 0 current, as they found it."""
    previous = torch_acme.device.current_device()
    yield
    torch_acme.device.set_device(previous)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exact(dtype, no_leaks):
    torch.manual_seed(0)
    host = random_bits(dtype)
    loaded = round_trip(host.to(DEVICE0))
    assert loaded.device == torch.device(DEVICE0) and loaded.dtype == dtype
    assert loaded.shape == host.shape and loaded.stride() == host.stride()
    assert torch.equal(bits(loaded), bits(host))


def test_special_float_values_survive(no_leaks):
    host = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -3.5])
    loaded = round_trip(host.to(DEVICE0))
    assert torch.equal(bits(loaded), bits(host))


def test_views_still_share_storage(no_leaks):
    base = torch.arange(24.0).reshape(4, 6).to(DEVICE0)
    saved = {"base": base, "rows": base[1:3], "cols": base[:, ::2], "t": base.t(), "flat": base.view(-1)[5:]}
    loaded = round_trip(saved)
    storage = loaded["base"].untyped_storage().data_ptr()
    for key, original in saved.items():
        assert loaded[key].untyped_storage().data_ptr() == storage, key
        assert loaded[key].storage_offset() == original.storage_offset(), key
        assert loaded[key].stride() == original.stride(), key
        assert torch.equal(loaded[key].cpu(), original.cpu()), key
    # One storage in the archive, and writes through the base reach every view.
    loaded["base"].zero_()
    assert all(not loaded[k].cpu().any() for k in saved)


def test_views_are_saved_as_one_storage_record(no_leaks):
    base = torch.arange(6.0).to(DEVICE0)
    buffer = io.BytesIO()
    torch.save({"t": base, "tail": base[2:], "other": torch.ones(2).to(DEVICE0)}, buffer)
    names = zipfile.ZipFile(buffer).namelist()
    storages = sorted(n.split("/", 1)[1] for n in names if "/data/" in n)
    assert storages == ["data/0", "data/1"], names  # the view adds no record of its own


def test_a_view_alone_saves_its_whole_storage(no_leaks):
    big = torch.zeros(100_000).to(DEVICE0)
    loaded = round_trip(big[:10])
    assert loaded.untyped_storage().nbytes() == big.untyped_storage().nbytes()
    assert round_trip(big[:10].clone()).untyped_storage().nbytes() == 40


def test_state_dict_round_trip(no_leaks):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(DEVICE0)
    state = round_trip(model.state_dict())
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(DEVICE0)
    fresh.load_state_dict(state)
    for key, value in model.state_dict().items():
        assert state[key].device == value.device
        assert torch.equal(bits(state[key]), bits(value)), key
    x = torch.randn(3, 4).to(DEVICE0)
    assert torch.equal(fresh(x).cpu(), model(x).cpu())


def test_device_1_tensors_come_back_on_device_1(no_leaks, on_device_0):
    t = torch.arange(5.0).to(DEVICE1)
    assert t.untyped_storage().device == torch.device(DEVICE1)
    loaded = round_trip(t)
    assert loaded.device == torch.device(DEVICE1) and torch.equal(loaded.cpu(), t.cpu())
    assert torch_acme.device.current_device() == 0  # the restore left device 0 current


def test_a_model_trained_on_device_1_matches_the_cpu_and_saves_there(no_leaks, on_device_0):
    # Most chapters at once: the guard (device 1), ops through acme's kernels and
    # the fallback with their backwards, an optimizer, and the state saved and loaded.
    def train(device):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                  torch.nn.Linear(8, 1)).to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x, y = torch.randn(16, 4).to(device), torch.randn(16, 1).to(device)
        for _ in range(3):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
        return net, loss

    net, loss = train(DEVICE1)
    net_cpu, loss_cpu = train("cpu")
    assert loss.device == torch.device(DEVICE1)
    torch.testing.assert_close(loss.cpu(), loss_cpu, rtol=1e-5, atol=1e-6)
    restored = round_trip(net.state_dict())
    for key, value in net.state_dict().items():
        assert restored[key].device == torch.device(DEVICE1), key
        assert torch.equal(restored[key].cpu(), value.cpu()), key
        torch.testing.assert_close(value.cpu(), net_cpu.state_dict()[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("map_location", [DEVICE1, torch.device(DEVICE1), {DEVICE0: DEVICE1},
                                          lambda storage, location: storage.to(device=torch.device(DEVICE1))],
                         ids=["str", "torch.device", "dict", "callable"])
def test_map_location_to_the_other_device(map_location, no_leaks, on_device_0):
    t = torch.arange(5.0).to(DEVICE0)
    set_meta(t, 42)
    loaded = round_trip({"t": t, "view": t[1:]}, map_location=map_location)
    assert loaded["t"].device == torch.device(DEVICE1) and torch.equal(loaded["t"].cpu(), t.cpu())
    assert loaded["view"].untyped_storage().data_ptr() == loaded["t"].untyped_storage().data_ptr()
    assert get_meta(loaded["t"]) == 42


def test_map_location_cpu_drops_only_the_device(no_leaks):
    t = torch.arange(5.0).to(DEVICE0)
    set_meta(t, 3)
    loaded = round_trip(t, map_location="cpu")
    assert loaded.device.type == "cpu" and torch.equal(loaded, t.cpu())
    # The tag belongs to acme tensors: a CPU tensor does not keep it.
    assert get_meta(loaded.to(DEVICE0)) == -1


def test_missing_device_index_is_a_clear_error(no_leaks):
    t = torch.arange(3.0).to(DEVICE0)
    with pytest.raises(RuntimeError, match=rf"{NAME.upper()} device 9 but torch\.{NAME}\.device_count\(\) is 2"):
        round_trip(t, map_location=f"{NAME}:9")


@pytest.mark.parametrize("tag", [0, 1, 7, 128, 255])
def test_backend_meta_round_trip(tag, no_leaks):
    t = torch.arange(4.0).to(DEVICE0)
    set_meta(t, tag)
    entries = torch._C._get_tensor_metadata(t)
    assert entries["acme.format"] is True
    assert sum(entries[f"acme.format.bit{b}"] << b for b in range(8)) == tag
    loaded = round_trip({"t": t, "view": t[1:]})
    assert get_meta(loaded["t"]) == tag
    assert get_meta(loaded["view"]) == -1  # a view is another tensor: no tag of its own


def test_backend_meta_absent_unless_set(no_leaks):
    t = torch.arange(4.0).to(DEVICE0)
    assert get_meta(t) == -1
    assert torch._C._get_tensor_metadata(t) == {}
    assert get_meta(round_trip(t)) == -1


def test_backend_meta_follows_parameters_and_detach(no_leaks):
    layer = torch.nn.Linear(2, 2).to(DEVICE0)
    set_meta(layer.weight, 9)
    state = layer.state_dict()  # detached tensors: the tag is shared with them
    assert get_meta(state["weight"]) == 9 and get_meta(state["bias"]) == -1
    loaded = round_trip(state)
    copied = torch.nn.Linear(2, 2).to(DEVICE0)
    copied.load_state_dict(loaded)  # copies bytes into the existing parameters
    assert get_meta(copied.weight) == -1
    assigned = torch.nn.Linear(2, 2).to(DEVICE0)
    assigned.load_state_dict(loaded, assign=True)  # keeps the loaded tensors
    assert get_meta(assigned.weight) == 9
    # A new tensor computed from a tagged one starts untagged.
    assert get_meta(layer.weight.clone()) == -1


def test_backend_meta_bad_input(no_leaks):
    t = torch.arange(4.0).to(DEVICE0)
    with pytest.raises(ValueError, match="a format tag is a number from 0 to 255, got 256"):
        set_meta(t, 256)
    with pytest.raises(ValueError, match="got -1"):
        set_meta(t, -1)
    tagged = torch.arange(4.0).to(DEVICE0)
    set_meta(tagged, 29)
    with pytest.raises(ValueError, match="a format tag is a number from 0 to 255, got 300"):
        set_meta(tagged, 300)
    assert get_meta(tagged) == 29  # a refused tag leaves the old one in place
    with pytest.raises(NotImplementedError, match="'acme::get_backend_meta' with arguments from the 'CPU' backend"):
        get_meta(torch.ones(2))
    with pytest.raises(RuntimeError, match="damaged checkpoint: the format tag has no 'acme.format.bit1' entry"):
        torch._C._set_tensor_metadata(t, {"acme.format": True, "acme.format.bit0": True})
    assert get_meta(t) == -1


def test_backend_meta_does_not_reach_fake_tensors(no_leaks):
    # torch.compile traces on FakeTensors: shape, dtype and device, but not
    # BackendMeta (chapter 16 says so). If a release starts copying it, this
    # fails and the chapter's sentence changes.
    from torch._subclasses.fake_tensor import FakeTensorMode

    t = torch.arange(4.0).to(DEVICE0)
    set_meta(t, 12)
    torch._C._set_tensor_metadata(t, {"checked_by_tool": True})
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(t)
    assert fake.device == t.device and fake.shape == t.shape
    assert torch._C._get_tensor_metadata(fake) == {}
    assert get_meta(t) == 12 and torch._C._get_tensor_metadata(t)["checked_by_tool"]
    packed = torch.ops.acme.pack_linear_weight(torch.ones(4, 3, device=DEVICE0))
    with pytest.raises(NotImplementedError, match="Cannot access storage of OpaqueTensorImpl"):
        with FakeTensorMode() as mode:
            mode.from_tensor(packed)
    del packed


def test_device_context_manager(on_device_0):
    module = getattr(torch, NAME)
    with module.device(1):
        assert module.current_device() == 1
        with module.device(DEVICE0):
            assert module.current_device() == 0
        assert module.current_device() == 1
        with module.device(None):
            assert module.current_device() == 1
    assert module.current_device() == 0
    with pytest.raises(ValueError, match=f"expected a device of type {NAME}, got cpu"):
        module.device("cpu")


def test_loading_without_the_backend(tmp_path, no_leaks):
    path = tmp_path / "checkpoint.pt"
    t = torch.arange(6.0).to(DEVICE0)
    torch.save({"t": t}, path)
    # A process where torch_acme is not importable at all.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = f"""
import importlib.util, torch
assert importlib.util.find_spec("torch_acme") is None
try:
    torch.load({str(path)!r})
except RuntimeError as error:
    print("ERROR", error)
loaded = torch.load({str(path)!r}, map_location="cpu")
print("CPU", loaded["t"].tolist())
"""
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    if NAME == "privateuseone":
        expected = "The PRIVATEUSEONE device module is not registered"
    else:  # a renamed backend's tag matches no deserializer PyTorch knows
        expected = f"don't know how to restore data location of torch.storage.UntypedStorage (tagged with {DEVICE0})"
    assert expected in proc.stdout, proc.stdout
    assert "CPU [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]" in proc.stdout


@pytest.fixture
def checkpoint():
    buffer = io.BytesIO()
    torch.save({"t": torch.arange(4096.0).to(DEVICE0)}, buffer)
    return buffer.getvalue()


def record_start(data: bytes, suffix: str) -> int:
    """Where the bytes of the archive record ending in `suffix` begin."""
    info = next(i for i in zipfile.ZipFile(io.BytesIO(data)).infolist() if i.filename.endswith(suffix))
    # The local header's name and extra lengths (PyTorch pads the extra field
    # to align the data; the central directory's copy of it is shorter).
    name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
    return info.header_offset + 30 + name_length + extra_length


def test_intact_checkpoint_passes_the_check(checkpoint, no_leaks):
    buffer = io.BytesIO(checkpoint)
    check_checkpoint(buffer)
    assert buffer.tell() == 0
    assert torch.equal(torch.load(buffer)["t"].cpu(), torch.arange(4096.0))


def test_truncated_checkpoint(checkpoint, tmp_path, no_leaks):
    # A small file: the zip reader's own, clear message.
    small = io.BytesIO()
    torch.save(torch.arange(4.0).to(DEVICE0), small)
    small_cut = io.BytesIO(small.getvalue()[:-10])
    with pytest.raises(RuntimeError, match="failed finding central directory"):
        torch.load(small_cut)
    with pytest.raises(RuntimeError, match="not a complete torch.save checkpoint"):
        check_checkpoint(small_cut)
    # A realistic one (a few kB and more): torch.load's error says nothing useful.
    cut = tmp_path / "cut.pt"
    cut.write_bytes(checkpoint[: len(checkpoint) // 2])
    with pytest.raises(OSError, match=r"\[Errno 22\] Invalid argument"):
        torch.load(cut)
    with pytest.raises(ValueError, match="negative seek value"):
        torch.load(io.BytesIO(checkpoint[:-10]))
    with pytest.raises(RuntimeError, match=re.escape(f"{cut}: not a complete torch.save checkpoint")):
        check_checkpoint(cut)
    with pytest.raises(RuntimeError, match="not a complete torch.save checkpoint"):
        check_checkpoint(io.BytesIO(checkpoint[:-1]))


def test_flipped_byte_in_tensor_data(checkpoint, no_leaks):
    damaged = bytearray(checkpoint)
    damaged[record_start(checkpoint, "/data/0") + 4 * 100] ^= 0xFF
    # torch.load does not verify the CRC-32s torch.save wrote: wrong data, no error.
    loaded = torch.load(io.BytesIO(bytes(damaged)))["t"].cpu()
    assert (loaded != torch.arange(4096.0)).nonzero().flatten().tolist() == [100]
    with pytest.raises(RuntimeError, match=r"corrupted checkpoint: record '.*/data/0' fails its CRC-32 check"):
        check_checkpoint(io.BytesIO(bytes(damaged)))


def test_flipped_byte_in_the_pickle(checkpoint):
    damaged = bytearray(checkpoint)
    # Flip the first GLOBAL opcode (c, for torch._utils._rebuild_tensor_v2): the
    # weights-only unpickler rejects the byte, and its message blames weights_only.
    start = record_start(checkpoint, "/data.pkl")
    damaged[checkpoint.index(b"ctorch._utils", start)] ^= 0xFF
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed") as error:
        torch.load(io.BytesIO(bytes(damaged)))
    # ... and it suggests giving up the safe path, which would not repair the file.
    assert "with `weights_only` set to `False` will likely succeed" in str(error.value)
    with pytest.raises(RuntimeError, match=r"record '.*/data.pkl' fails its CRC-32 check"):
        check_checkpoint(io.BytesIO(bytes(damaged)))


def test_checkpoint_without_crcs_is_reported(tmp_path):
    path = tmp_path / "no_crc.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(torch.arange(3.0), path)
    finally:
        torch.serialization.set_crc32_options(True)
    with pytest.raises(RuntimeError, match="carries no CRC-32s to verify"):
        check_checkpoint(path)
    with pytest.raises(RuntimeError, match="not a complete torch.save checkpoint"):
        check_checkpoint(io.BytesIO(b""))


# ---- chapter 16: a packed weight (an OpaqueTensorImpl) saved, copied, moved ----

def packed_weight(device=DEVICE0):
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(6, 5, generator=g)
    return weight, torch.ops.acme.pack_linear_weight(weight.to(device))


def is_packed(t: torch.Tensor) -> bool:
    return not torch._C._has_storage(t)


@pytest.mark.skipif(_build_info.STAGE < 16, reason="packed weights come with chapter 16")
def test_a_packed_weight_saves_as_the_weight_it_packs():
    weight, packed = packed_weight()
    assert is_packed(packed)
    on_cpu = packed.cpu()  # unpacked: the CPU has no packed layout
    assert on_cpu.device.type == "cpu" and on_cpu.is_contiguous() and torch.equal(on_cpu, weight)
    buffer = io.BytesIO()
    torch.save({"w": packed}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)["w"]
    # PyTorch saves a PrivateUse1 tensor without storage through .cpu() and
    # rebuilds it on the device: an ordinary acme tensor with the values.
    assert loaded.device == packed.device and not is_packed(loaded)
    assert torch.equal(loaded.cpu(), weight)


@pytest.mark.skipif(_build_info.STAGE < 16, reason="packed weights come with chapter 16")
def test_a_packed_weight_copies_and_moves_packed():
    import copy

    weight, packed = packed_weight()
    x = torch.randn(4, 5)
    expected = torch.nn.functional.linear(x, weight)
    module = getattr(torch, NAME)
    module.synchronize()
    before = module.memory_allocated()
    twin = copy.deepcopy(packed)  # clone, for a tensor without storage
    assert module.memory_allocated() - before >= weight.numel() * 4  # a copy of its own
    moved = packed.to(DEVICE1)
    half = packed.to(torch.float16)
    for copied, device in [(twin, DEVICE0), (moved, DEVICE1), (half, DEVICE0)]:
        assert is_packed(copied) and str(copied.device) == device and copied.shape == (6, 5)
        got = torch.ops.acme.packed_linear(x.to(device, copied.dtype), copied)
        torch.testing.assert_close(got.cpu().float(), expected, rtol=2e-3, atol=2e-3)
    # Ordinary tensors keep PyTorch's own _to_copy and clone.
    t = torch.arange(6.0).reshape(2, 3).t().to(DEVICE0)
    assert t.clone().stride() == t.stride() and t.to(DEVICE1).stride() == t.cpu().stride()
    assert t.clone(memory_format=torch.contiguous_format).is_contiguous()
    del twin, moved, half, packed, t
