"""Chapter 15: operators of acme's own, a third-party library's operator, and a
CompositeImplicitAutograd operator overridden for the device.

Each operator is compared with a reference computed from PyTorch's own ops on
the CPU (values and gradients), passes opcheck on both devices, and runs
under torch.compile(backend="aot_eager") with the same results as eagerly.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_acme  # noqa: F401
from conftest import THIRD_PARTY
from torch_acme import _build_info

if _build_info.STAGE < 15:
    pytest.skip(f"the stage under test ({_build_info.STAGE}) predates chapter 15",
                allow_module_level=True)

from torch_acme.testing import autograd_registration_check, opcheck  # noqa: E402

sys.path.insert(0, str(THIRD_PARTY))
import boxkit  # noqa: E402

DEVICE = torch._C._get_privateuse1_backend_name()
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def quiet_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def tolerance(dtype):
    return {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
            torch.float32: dict(atol=1e-5, rtol=1.3e-6), torch.float64: {}}[dtype]


def leaves(*tensors, device):
    return [t.detach().to(device).requires_grad_(t.is_floating_point()) for t in tensors]


# ---- acme::bias_gelu (C++: schema, CPU/acme/Meta kernels, autograd) ----

@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 3, 16), (0, 4)], ids=str)
@pytest.mark.parametrize("device", ["cpu", DEVICE])
def test_bias_gelu_matches_gelu_of_sum(device, shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64) * 3
    bias = torch.randn(shape[-1], dtype=torch.float64)
    x_dev, b_dev = leaves(x.to(dtype), bias.to(dtype), device=device)
    y = torch.ops.acme.bias_gelu(x_dev, b_dev)
    assert y.device.type == device and y.dtype == dtype and y.is_contiguous()
    x_ref, b_ref = leaves(x, bias, device="cpu")  # reference in float64 from PyTorch's gelu
    y_ref = F.gelu(x_ref + b_ref)
    torch.testing.assert_close(y.detach().cpu().double(), y_ref.detach(), **tolerance(dtype))
    grad = torch.randn(shape, dtype=torch.float64)
    y.backward(grad.to(dtype).to(device))
    y_ref.backward(grad)
    torch.testing.assert_close(x_dev.grad.cpu().double(), x_ref.grad, **tolerance(dtype))
    # grad_bias sums a column: its error grows with the rows summed
    rows = max(1, x.numel() // shape[-1])
    scale = {k: v * rows for k, v in tolerance(dtype).items()}
    torch.testing.assert_close(b_dev.grad.cpu().double(), b_ref.grad, **scale)


def test_bias_gelu_same_on_both_devices_bit_for_bit():
    x, bias = torch.randn(8, 33), torch.randn(33)
    on_cpu = torch.ops.acme.bias_gelu(x, bias)
    on_acme = torch.ops.acme.bias_gelu(x.to(DEVICE), bias.to(DEVICE))
    assert torch.equal(on_acme.cpu(), on_cpu)


def test_bias_gelu_non_contiguous_input():
    x, bias = torch.randn(6, 4).t(), torch.randn(6)
    y = torch.ops.acme.bias_gelu(x.to(DEVICE), bias.to(DEVICE))
    torch.testing.assert_close(y.cpu(), F.gelu(x + bias))


def test_bias_gelu_gradcheck_on_acme():
    x = torch.randn(3, 4, dtype=torch.float64, device=DEVICE, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, device=DEVICE, requires_grad=True)
    assert torch.autograd.gradcheck(torch.ops.acme.bias_gelu, (x, b))


@pytest.mark.parametrize("make, message", [
    (lambda d: (torch.ones(2, 3, device=d), torch.ones(4, device=d)), "bias must be 1-D with x's last"),
    (lambda d: (torch.ones(2, 3, device=d), torch.ones(3, dtype=torch.float64, device=d)),
     "bias has dtype Double but x has Float"),
    (lambda d: (torch.ones(2, 3, dtype=torch.long, device=d), torch.ones(3, dtype=torch.long, device=d)),
     "expected a floating-point x"),
    (lambda d: (torch.ones(2, 3, device=d), torch.ones(3)), "bias is on cpu but x is on"),
])
@pytest.mark.parametrize("device", [DEVICE, "meta"])
def test_bias_gelu_refuses_bad_arguments_on_every_device(device, make, message):
    x, bias = make(device)
    if message.startswith("bias is on") and device == "meta":
        bias = bias.to("cpu")
    with pytest.raises(RuntimeError, match=message):
        torch.ops.acme.bias_gelu(x, bias)


def test_bias_gelu_meta_kernel_gives_shapes_only():
    y = torch.ops.acme.bias_gelu(torch.empty(4, 5, 6, device="meta"), torch.empty(6, device="meta"))
    assert y.device.type == "meta" and y.shape == (4, 5, 6) and y.is_contiguous()
    gx, gb = torch.ops.acme.bias_gelu_backward(torch.empty(2, 6, device="meta"),
                                               torch.empty(2, 6, device="meta"),
                                               torch.empty(6, device="meta"))
    assert gx.shape == (2, 6) and gb.shape == (6,)


def test_bias_gelu_dispatch_table():
    table = torch._C._dispatch_dump_table("acme::bias_gelu")
    rows = {line.split(":")[0]: line for line in table.splitlines()}
    for key in ("CPU", "PrivateUse1", "Meta", "AutogradCPU", "AutogradPrivateUse1"):
        assert "custom_ops.cpp" in rows[key] and "[kernel]" in rows[key], rows.get(key)


# ---- acme::swiglu (Python: torch.library.custom_op) ----

@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_swiglu_matches_reference(dtype):
    torch.manual_seed(1)
    gate, up = torch.randn(4, 10, dtype=torch.float64), torch.randn(4, 10, dtype=torch.float64)
    g, u = leaves(gate.to(dtype), up.to(dtype), device=DEVICE)
    y = torch.ops.acme.swiglu(g, u)
    g_ref, u_ref = leaves(gate, up, device="cpu")
    y_ref = F.silu(g_ref) * u_ref
    torch.testing.assert_close(y.detach().cpu().double(), y_ref.detach(), **tolerance(dtype))
    grad = torch.randn(4, 10, dtype=torch.float64)
    y.backward(grad.to(dtype).to(DEVICE))
    y_ref.backward(grad)
    torch.testing.assert_close(g.grad.cpu().double(), g_ref.grad, **tolerance(dtype))
    torch.testing.assert_close(u.grad.cpu().double(), u_ref.grad, **tolerance(dtype))


def test_swiglu_refuses_mismatched_shapes():
    with pytest.raises(RuntimeError, match=r"swiglu: gate \(2, 3\) and up \(3, 2\)"):
        torch.ops.acme.swiglu(torch.ones(2, 3, device=DEVICE), torch.ones(3, 2, device=DEVICE))


def test_swiglu_is_registered_under_the_device_name():
    table = torch._C._dispatch_dump_table(f"{torch_acme.DEVICE_NAME}::swiglu")
    assert "PrivateUse1: registered" in table and "CPU: registered" in table


# ---- boxkit::nms (a third-party operator; acme adds the device kernel) ----

def random_boxes(n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    corner = torch.rand(n, 2, generator=g, dtype=dtype) * 10
    size = torch.rand(n, 2, generator=g, dtype=dtype) * 4
    scores = torch.rand(n, generator=g, dtype=dtype).round(decimals=1)  # many ties
    return torch.cat([corner, corner + size], 1), scores


@pytest.mark.parametrize("n", [0, 1, 7, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.7, 1.0])
def test_nms_matches_the_library_cpu_kernel(n, dtype, threshold):
    boxes, scores = random_boxes(n, dtype, seed=n)
    expected = boxkit.nms(boxes, scores, threshold)
    kept = boxkit.nms(boxes.to(DEVICE), scores.to(DEVICE), threshold)
    assert kept.device.type == DEVICE and kept.dtype == torch.long
    assert torch.equal(kept.cpu(), expected)


def test_nms_runs_acme_kernel_and_skips_autograd():
    rows = {line.split(":")[0]: line
            for line in torch._C._dispatch_dump_table("boxkit::nms").splitlines()}
    assert "third_party_ops.cpp" in rows["PrivateUse1"]
    assert rows["AutogradPrivateUse1"].startswith("AutogradPrivateUse1: fallthrough")
    boxes, scores = random_boxes(10)
    boxes = boxes.to(DEVICE).requires_grad_()
    kept = boxkit.nms(boxes, scores.to(DEVICE), 0.5)
    assert not kept.requires_grad and kept.grad_fn is None


def test_nms_refuses_mixed_devices():
    boxes, scores = random_boxes(4)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        boxkit.nms(boxes.to(DEVICE), scores, 0.5)


# ---- aten::rms_norm (CompositeImplicitAutograd, overridden for acme) ----

RMS_CASES = [((4, 16), (16,), True, None), ((2, 3, 8), (3, 8), True, 1e-3),
             ((5, 7), (7,), False, None), ((3, 0), (0,), True, None)]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape, normalized, weighted, eps", RMS_CASES, ids=str)
def test_rms_norm_matches_the_composite(shape, normalized, weighted, eps, dtype):
    torch.manual_seed(2)
    x = torch.randn(shape, dtype=dtype)
    weight = torch.randn(normalized, dtype=dtype) if weighted else None
    expected = F.rms_norm(x, normalized, weight, eps)
    with torch.no_grad():  # the fused kernel's path
        fused = F.rms_norm(x.to(DEVICE), normalized, None if weight is None else weight.to(DEVICE), eps)
    torch.testing.assert_close(fused.cpu(), expected, **tolerance(dtype))


def test_rms_norm_paths_fused_without_grad_composite_with_grad():
    x, w = torch.randn(4, 16, device=DEVICE), torch.randn(16, device=DEVICE)

    def ops_run(**grad):
        xi, wi = x.clone().requires_grad_(**grad), w.clone()
        with torch.profiler.profile() as prof:
            F.rms_norm(xi, (16,), wi)
        return {e.name for e in prof.events()}

    assert "aten::pow" not in ops_run(requires_grad=False)
    assert "aten::pow" in ops_run(requires_grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_rms_norm_gradients_match_the_cpu(dtype):
    torch.manual_seed(3)
    x, w = torch.randn(3, 4, 8, dtype=dtype), torch.randn(8, dtype=dtype)
    x_cpu, w_cpu = leaves(x, w, device="cpu")
    x_dev, w_dev = leaves(x, w, device=DEVICE)
    F.rms_norm(x_cpu, (8,), w_cpu).square().sum().backward()
    F.rms_norm(x_dev, (8,), w_dev).square().sum().backward()
    torch.testing.assert_close(x_dev.grad.cpu(), x_cpu.grad)
    torch.testing.assert_close(w_dev.grad.cpu(), w_cpu.grad)


def test_rms_norm_complex_and_bad_shapes_go_to_the_composite():
    z = torch.randn(2, 4, dtype=torch.complex64)
    with torch.no_grad():
        torch.testing.assert_close(F.rms_norm(z.to(DEVICE), (4,)).cpu(), F.rms_norm(z, (4,)))
        with pytest.raises(RuntimeError, match="normalized_shape"):
            F.rms_norm(torch.ones(2, 4, device=DEVICE), (3,))


def test_rms_norm_dispatch_table_after_the_override():
    rows = {line.split(":")[0]: line for line in torch._C._dispatch_dump_table("aten::rms_norm").splitlines()}
    assert "rms_norm.cpp" in rows["PrivateUse1"] and "rms_norm.cpp" in rows["AutogradPrivateUse1"]
    assert "[math kernel]" in rows["CPU"] and "[math kernel]" in rows["AutogradCPU"]


# ---- opcheck and torch.compile, every custom operator ----

def opcheck_cases(device):
    torch.manual_seed(4)
    boxes, scores = random_boxes(30)

    def grad(*ts):
        return [t.to(device).requires_grad_() for t in ts]

    return {
        "acme::bias_gelu": (torch.ops.acme.bias_gelu.default, grad(torch.randn(3, 5), torch.randn(5))),
        "acme::bias_gelu_backward": (torch.ops.acme.bias_gelu_backward.default,
                                     [t.to(device) for t in (torch.randn(3, 5), torch.randn(3, 5), torch.randn(5))]),
        "acme::swiglu": (torch.ops.acme.swiglu.default, grad(torch.randn(2, 6), torch.randn(2, 6))),
        "boxkit::nms": (torch.ops.boxkit.nms.default, [boxes.to(device), scores.to(device), 0.4]),
    }


@pytest.mark.parametrize("name", list(opcheck_cases("cpu")))
@pytest.mark.parametrize("device", ["cpu", DEVICE])
def test_opcheck(device, name):
    op, args = opcheck_cases(device)[name]
    if device == "cpu":
        results = torch.library.opcheck(op, args)  # all four of PyTorch's tests
    else:
        results = opcheck(op, args)  # the three that support acme, plus ours
    assert set(results) == {"test_schema", "test_autograd_registration", "test_faketensor",
                            "test_aot_dispatch_dynamic"}
    assert set(results.values()) == {"SUCCESS"}, results


def test_autograd_registration_check_catches_a_backward_hidden_in_the_kernel():
    lib = torch.library.Library("acme_check_demo", "DEF")
    try:
        lib.define("scale(Tensor x) -> Tensor")

        class Double(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, grad):
                return grad * 2

        lib.impl("scale", lambda x: Double.apply(x), "PrivateUse1")  # the mistake
        x = torch.ones(3, device=DEVICE, requires_grad=True)
        with pytest.raises(AssertionError, match="no kernel at AutogradPrivateUse1"):
            autograd_registration_check(torch.ops.acme_check_demo.scale.default, (x,), {})
    finally:
        lib._destroy()


def test_opcheck_catches_a_fake_kernel_with_the_wrong_shape():
    @torch.library.custom_op("acme_check_demo::halve", mutates_args=())
    def halve(x: torch.Tensor) -> torch.Tensor:
        return x / 2

    @halve.register_fake
    def _(x):
        return x.new_empty(x.shape[0] + 1)

    with pytest.raises(torch.testing._internal.optests.generate_tests.OpCheckError,
                       match="test_faketensor failed"):
        opcheck(halve, (torch.ones(3, device=DEVICE),))


@pytest.mark.parametrize("name", ["bias_gelu", "swiglu"])
def test_compiled_forward_and_backward_match_eager(name):
    torch._dynamo.reset()
    op = getattr(torch.ops.acme, name)
    torch.manual_seed(5)
    a = torch.randn(4, 6)
    b = torch.randn(6) if name == "bias_gelu" else torch.randn(4, 6)

    def step(a, b):
        return (op(a, b) * 3).sum()

    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        x, y = leaves(a, b, device=DEVICE)
        loss = fn(x, y)
        loss.backward()
        results.append((loss.detach().cpu(), x.grad.cpu(), y.grad.cpu()))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_compiled_nms_has_a_data_dependent_size():
    torch._dynamo.reset()
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    try:
        boxes, scores = random_boxes(40)
        compiled = torch.compile(lambda b, s: boxkit.nms(b, s, 0.3) + 1, backend="aot_eager",
                                 fullgraph=True)
        kept = compiled(boxes.to(DEVICE), scores.to(DEVICE))
        assert torch.equal(kept.cpu(), boxkit.nms(boxes, scores, 0.3) + 1)
    finally:
        torch._dynamo.config.capture_dynamic_output_shape_ops = False
