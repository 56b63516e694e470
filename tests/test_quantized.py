"""Chapter 22: quantized tensors on acme, against the CPU's.

Every result is compared with what PyTorch's quantized CPU kernels give for the
same input: integers bit for bit, dequantized values exactly, parameters
equal. Ops acme has no quantized kernel for raise an error naming the op.
"""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import pytest
import torch

import torch_acme
from torch_acme import _build_info

if _build_info.STAGE < 22:
    pytest.skip(f"the stage under test ({_build_info.STAGE}) predates chapter 22",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import quantized_models  # noqa: E402

DEVICE = torch_acme.DEVICE_NAME


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def same_quantized(on_acme: torch.Tensor, on_cpu: torch.Tensor) -> None:
    assert on_acme.device.type == DEVICE and on_acme.is_quantized
    assert on_acme.dtype == on_cpu.dtype and on_acme.shape == on_cpu.shape
    assert on_acme.qscheme() == on_cpu.qscheme()
    if on_cpu.qscheme() == torch.per_tensor_affine:
        assert on_acme.q_scale() == on_cpu.q_scale()
        assert on_acme.q_zero_point() == on_cpu.q_zero_point()
    else:
        assert on_acme.q_per_channel_axis() == on_cpu.q_per_channel_axis()
        assert torch.equal(on_acme.q_per_channel_scales().cpu(), on_cpu.q_per_channel_scales())
        assert torch.equal(on_acme.q_per_channel_zero_points().cpu(),
                           on_cpu.q_per_channel_zero_points())
    ints = on_acme.int_repr()
    assert ints.device.type == DEVICE
    assert torch.equal(ints.cpu(), on_cpu.int_repr())
    assert torch.equal(on_acme.dequantize().cpu(), on_cpu.dequantize())


def inputs():
    g = torch.Generator().manual_seed(0)
    yield torch.randn(37, generator=g) * 3
    yield torch.randn(4, 5, 6, generator=g)
    yield torch.randn(6, 5, generator=g).t()  # not contiguous
    yield torch.randn(2, 3, 4, 5, generator=g).contiguous(memory_format=torch.channels_last)
    yield torch.empty(0, 3)
    yield torch.tensor([float("inf"), -float("inf"), 1e30, -1e30, 0.05, -0.05, 0.15, 0.25])


@pytest.mark.parametrize("dtype, zero_point", [(torch.quint8, 128), (torch.qint8, 3),
                                               (torch.qint32, -7)])
def test_quantize_per_tensor_matches_the_cpu(dtype, zero_point):
    for x in inputs():
        same_quantized(torch.quantize_per_tensor(x.to(DEVICE), 0.1, zero_point, dtype),
                       torch.quantize_per_tensor(x, 0.1, zero_point, dtype))
        # tensor-valued parameters too
        scale, zp = torch.tensor(0.1), torch.tensor(zero_point)
        same_quantized(torch.quantize_per_tensor(x.to(DEVICE), scale, zp, dtype),
                       torch.quantize_per_tensor(x, scale, zp, dtype))


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("params_on", ["cpu", DEVICE])
def test_quantize_per_channel_matches_the_cpu(axis, params_on):
    x = torch.randn(4, 6, 3, generator=torch.Generator().manual_seed(1))
    channels = x.shape[axis]
    scales = torch.linspace(0.01, 0.2, channels, dtype=torch.float64)
    zero_points = torch.arange(channels) - 1
    for dtype in (torch.qint8, torch.quint8):
        zps = zero_points if dtype == torch.qint8 else zero_points + 100
        on_cpu = torch.quantize_per_channel(x, scales, zps, axis, dtype)
        on_acme = torch.quantize_per_channel(x.to(DEVICE), scales.to(params_on),
                                             zps.to(params_on), axis, dtype)
        same_quantized(on_acme, on_cpu)


def test_float_zero_points_per_channel():
    # The float-parameter scheme embedding bags use.
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    scales, zero_points = torch.rand(5) * 0.1 + 0.01, torch.randn(5)
    on_cpu = torch.quantize_per_channel(x, scales, zero_points, 0, torch.quint8)
    on_acme = torch.quantize_per_channel(x.to(DEVICE), scales, zero_points, 0, torch.quint8)
    assert on_acme.qscheme() == torch.per_channel_affine_float_qparams
    same_quantized(on_acme, on_cpu)


def test_copies_both_ways_keep_everything():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
    for on_cpu in (torch.quantize_per_tensor(x, 0.05, 10, torch.quint8),
                   torch.quantize_per_channel(x, torch.tensor([0.1, 0.2, 0.3]),
                                              torch.tensor([0, 1, -1]), 0, torch.qint8)):
        moved = on_cpu.to(DEVICE)
        same_quantized(moved, on_cpu)
        back = moved.cpu()
        assert back.device.type == "cpu" and torch.equal(back, on_cpu)
        assert torch.equal(moved.to(f"{DEVICE}:1").cpu(), on_cpu)  # device to device
        same_quantized(moved.clone(), on_cpu)
        assert torch.equal(moved, on_cpu.to(DEVICE))
        assert not torch.equal(moved, torch.quantize_per_tensor(x, 0.05, 11, torch.quint8)
                               .to(DEVICE))


def test_views_follow_the_cpu():
    x = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(4))
    per_tensor = torch.quantize_per_tensor(x, 0.05, 3, torch.qint8)
    per_channel = torch.quantize_per_channel(x, torch.rand(6, dtype=torch.float64) * 0.1 + 0.01,
                                             torch.zeros(6, dtype=torch.long), 1, torch.qint8)
    views = [lambda t: t[1], lambda t: t[:, 2:5], lambda t: t.transpose(0, 2),
             lambda t: t.reshape(4, 30) if t.qscheme() == torch.per_tensor_affine else t[0],
             lambda t: t.unsqueeze(0), lambda t: t[:1].squeeze(0), lambda t: t.permute(2, 0, 1),
             lambda t: t.contiguous(), lambda t: t.view(24, 5) if t.qscheme()
             == torch.per_tensor_affine else t.squeeze()]
    for q in (per_tensor, per_channel):
        on_acme = q.to(DEVICE)
        for view in views:
            try:
                expected = view(q)
            except RuntimeError as cpu_error:  # per-channel tensors take no new strides
                with pytest.raises(RuntimeError) as acme_error:
                    view(on_acme)
                assert str(acme_error.value) == str(cpu_error)
                continue
            got = view(on_acme)
            if expected.qscheme() != torch.per_tensor_affine:
                assert got.q_per_channel_axis() == expected.q_per_channel_axis()
            assert torch.equal(got.dequantize().cpu(), expected.dequantize())
            assert torch.equal(got.int_repr().cpu(), expected.int_repr())


@pytest.mark.parametrize("scheme", ["per_tensor", "per_channel"])
def test_save_and_load(scheme):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    if scheme == "per_tensor":
        on_cpu = torch.quantize_per_tensor(x, 0.02, 5, torch.quint8)
    else:
        on_cpu = torch.quantize_per_channel(x, torch.tensor([0.1, 0.2, 0.3]),
                                            torch.tensor([0, 1, 2]), 0, torch.qint8)
    buffer = io.BytesIO()
    torch.save({"w": on_cpu.to(DEVICE)}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)["w"]
    same_quantized(loaded, on_cpu)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, map_location="cpu")["w"], on_cpu)


def test_quantize_runs_on_the_stream():
    # Queued behind 50 ms of work, then read: the stream orders it.
    x = torch.randn(1000, generator=torch.Generator().manual_seed(6))
    d = x.to(DEVICE)
    torch.acme._sleep(50_000)
    d.mul_(2)
    q = torch.quantize_per_tensor(d, 0.1, 0, torch.qint8)
    same_quantized(q, torch.quantize_per_tensor(x * 2, 0.1, 0, torch.qint8))


def test_dynamic_linear_matches_pytorchs_quantized_cpu_module():
    g = torch.Generator().manual_seed(8)
    linear = torch.nn.Linear(32, 16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(16, 32, generator=g))
    x = torch.randn(8, 32, generator=g) * 2
    model = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear),
                                                   {torch.nn.Linear}, dtype=torch.qint8)
    cpu_module = model[0]
    expected = cpu_module(x)  # FBGEMM's kernel
    qw, bias = cpu_module.weight(), cpu_module.bias()
    got = quantized_models.dynamic_linear(x.to(DEVICE), qw.to(DEVICE), bias.to(DEVICE))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
    # The same math on the CPU gives FBGEMM's result too: the path is the module's.
    torch.testing.assert_close(quantized_models.dynamic_linear(x, qw, bias), expected,
                               rtol=1e-5, atol=1e-5)


def test_unsupported_ops_name_the_op():
    q = torch.quantize_per_tensor(torch.randn(4).to(DEVICE), 0.1, 0, torch.quint8)
    with pytest.raises(NotImplementedError) as error:
        q + q
    assert str(error.value).startswith(f"{DEVICE}: aten::add.Tensor has no kernel for quantized "
                                       f"{DEVICE} tensors. Dequantize first")
    for op, call in [("aten::relu", torch.relu), ("aten::mul.Tensor", lambda t: t * 2),
                     ("aten::sum.dim_IntList", lambda t: t.sum()),
                     ("aten::fill_.Scalar", lambda t: t.fill_(1)),
                     # PyTorch's own quantized arithmetic, which the chapter names
                     ("quantized::add", lambda t: torch.ops.quantized.add(t, t, 0.1, 0))]:
        with pytest.raises(NotImplementedError) as error:
            call(q)
        assert str(error.value).startswith(f"{DEVICE}: {op} has no kernel for quantized"), op


def test_sub_byte_types_are_refused():
    with pytest.raises(ValueError, match="quantized tensors of QUInt4x2 are not supported"):
        torch.quantize_per_tensor(torch.randn(4).to(DEVICE), 0.1, 0, torch.quint4x2)


def test_copy_into_an_existing_quantized_tensor_follows_the_cpu():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    src = torch.quantize_per_tensor(x, 0.02, 5, torch.quint8)
    for dst_device, src_device in ((DEVICE, "cpu"), ("cpu", DEVICE), (DEVICE, DEVICE)):
        dst = torch.quantize_per_tensor(y, 0.5, 1, torch.quint8).to(dst_device)
        dst.copy_(src.to(src_device))  # takes the source's scale and zero point
        assert (dst.q_scale(), dst.q_zero_point()) == (0.02, 5)
        assert torch.equal(dst.cpu(), src)
    # Floats into a quantized tensor: quantized with its parameters, as on the CPU.
    on_cpu = torch.quantize_per_tensor(y, 0.05, 2, torch.qint8)
    on_acme = on_cpu.to(DEVICE)
    on_cpu.copy_(x)
    on_acme.copy_(x.to(DEVICE))
    same_quantized(on_acme, on_cpu)
    with pytest.raises(RuntimeError, match="Copying from quantized Tensor to non-quantized"):
        torch.empty(3, 4, device=DEVICE).copy_(src.to(DEVICE))
    with pytest.raises(RuntimeError, match="Quantized Copy only works with same qscheme"):
        torch.quantize_per_channel(y, torch.ones(3), torch.zeros(3, dtype=torch.long), 0,
                                   torch.quint8).to(DEVICE).copy_(src.to(DEVICE))


def test_copy_between_devices_waits_for_the_source():
    x = torch.randn(1000)
    d = x.to(f"{DEVICE}:0")
    torch.acme._sleep(50_000)  # acme:0's stream is busy; the quantize is queued behind it
    q = torch.quantize_per_tensor(d * 2, 0.1, 0, torch.qint8)
    moved = q.to(f"{DEVICE}:1")
    assert moved.device.index == 1
    same_quantized(moved, torch.quantize_per_tensor(x * 2, 0.1, 0, torch.qint8))


def test_per_channel_parameters_on_the_device():
    x = torch.randn(4, 3)
    scales, zero_points = torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0, 1, 2, 3])
    on_acme = torch.quantize_per_channel(x.to(DEVICE), scales.to(DEVICE),
                                         zero_points.to(DEVICE), 0, torch.qint8)
    back = on_acme.cpu()
    assert back.device.type == "cpu" and back.q_per_channel_scales().device.type == "cpu"
    assert torch.equal(back, torch.quantize_per_channel(x, scales, zero_points, 0, torch.qint8))


def test_host_parameters_are_read_when_called():
    x, scales = torch.randn(4, 3), torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    zero_points = torch.zeros(4, dtype=torch.long)
    torch.acme._sleep(50_000)
    on_acme = torch.quantize_per_channel(x.to(DEVICE), scales, zero_points, 0, torch.qint8)
    scales.mul_(100)  # after the call, before the kernel ran
    expected = torch.quantize_per_channel(x, scales / 100, zero_points, 0, torch.qint8)
    assert torch.equal(on_acme.int_repr().cpu(), expected.int_repr())


def test_bad_zero_points_fail_at_the_call():
    with pytest.raises(ValueError, match=r"zero points must lie in \[-128, 127\]"):
        torch.quantize_per_channel(torch.randn(2, 2, device=DEVICE), torch.ones(2),
                                   torch.tensor([0, 300]), 0, torch.qint8)


def test_non_dense_tensors_move():
    q = torch.quantize_per_tensor(torch.randn(4, 6), 0.1, 0, torch.quint8)[:, ::2]
    moved = q.to(DEVICE)
    assert torch.equal(moved.cpu(), q.contiguous())


def test_overlapping_copies_and_mixed_devices_are_refused():
    q = torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.quint8).to(DEVICE)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        q[1:].copy_(q[:-1])
    with pytest.raises(RuntimeError, match="Cannot compare two tensors on different devices"):
        torch.equal(q, q.cpu())


def test_view_copies_work():
    q = torch.quantize_per_tensor(torch.randn(2, 3), 0.1, 0, torch.quint8)
    on_acme = q.to(DEVICE)
    for op in (lambda t: torch.ops.aten.unsqueeze_copy(t, 0),
               lambda t: torch.ops.aten.alias_copy(t)):
        assert torch.equal(op(on_acme).cpu(), op(q))
