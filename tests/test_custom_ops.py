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


def test_bias_gelu_second_derivative_raises_instead_of_zero():
    for device in ("cpu", DEVICE):
        x, b = leaves(torch.randn(2, 3), torch.randn(3), device=device)
        (gx,) = torch.autograd.grad(torch.ops.acme.bias_gelu(x, b).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="bias_gelu_backward.*not implemented|not implemented.*bias_gelu"):
            gx.sum().backward()


def test_bias_gelu_is_tagged_pt2_compliant():
    for op in (torch.ops.acme.bias_gelu.default, torch.ops.acme.bias_gelu_backward.default):
        assert torch.Tag.pt2_compliant_tag in op.tags


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_bias_gelu_under_autocast_is_what_its_pieces_give(dtype):
    # A Linear's float16 output meets a float32 bias: the unfused gelu(x + bias)
    # promotes, and so does the fused operator, on the CPU and on acme alike.
    torch.manual_seed(4)
    linear, bias, x = torch.nn.Linear(8, 6), torch.randn(6), torch.randn(5, 8)
    with torch.autocast("cpu", dtype=dtype):
        h = linear(x)
        expected = F.gelu(h + bias)
    assert h.dtype == dtype and expected.dtype == torch.float32
    for device in ("cpu", DEVICE):
        linear_d = torch.nn.Linear(8, 6).to(device)
        linear_d.load_state_dict(linear.state_dict())
        with torch.autocast(torch.device(device).type, dtype=dtype):
            y = torch.ops.acme.bias_gelu(linear_d(x.to(device)), bias.to(device))
        assert y.dtype == expected.dtype, (device, y.dtype)
        torch.testing.assert_close(y.cpu(), expected, **tolerance(dtype))


def test_custom_fwd_takes_the_devices_autocast_state():
    # PyTorch's decorators for a Python autograd.Function under autocast:
    # cast_inputs runs the forward in float32 with autocast off, and
    # custom_bwd runs the backward under the forward's autocast state.
    seen = {}

    class Square(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type=DEVICE, cast_inputs=torch.float32)
        def forward(ctx, x):
            seen["forward"] = (x.dtype, torch.is_autocast_enabled(DEVICE))
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @torch.amp.custom_bwd(device_type=DEVICE)
        def backward(ctx, grad):
            seen["backward"] = torch.is_autocast_enabled(DEVICE)
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    x = torch.randn(4, device=DEVICE, dtype=torch.float16, requires_grad=True)
    with torch.autocast(DEVICE, dtype=torch.float16):
        y = Square.apply(x)
    y.sum().backward()
    assert seen == {"forward": (torch.float32, False), "backward": False}, seen
    assert y.dtype == torch.float32 and x.grad.dtype == torch.float16
    torch.testing.assert_close(x.grad.cpu(), 2 * x.detach().cpu())


def test_a_fallthrough_on_a_floating_output_drops_the_gradient_silently():
    # Why chapter 15 keeps fallthroughs for integer outputs: on a float one,
    # the output simply does not require grad, and nothing says so.
    lib = torch.library.Library("acme_fallthrough_demo", "FRAGMENT")
    lib.define("twice(Tensor x) -> Tensor")
    # A kernel computes on the data, as a device kernel does (not through
    # differentiable ATen calls, which would record their own graph).
    lib.impl("twice", lambda x: x.detach() * 2, "CPU")
    lib.impl("twice", torch.library.fallthrough_kernel, "AutogradCPU")
    x = torch.ones(3, requires_grad=True)
    y = torch.ops.acme_fallthrough_demo.twice(x)
    assert not y.requires_grad and y.grad_fn is None
    lib._destroy()


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


def test_swiglu_is_in_the_products_namespace_beside_bias_gelu():
    # The namespace is the product's in Python as in C++ (chapter 8): a
    # renamed device (test_packaging's npu copy) keeps torch.ops.acme.
    for op in ("acme::swiglu", "acme::bias_gelu"):
        table = torch._C._dispatch_dump_table(op)
        assert "PrivateUse1: registered" in table and "CPU: registered" in table, op


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


# ---- aten::rms_norm: acme's kernels behind it, at _fused_rms_norm ----

RMS_CASES = [((4, 16), (16,), True, None), ((2, 3, 8), (3, 8), True, 1e-3),
             ((5, 7), (7,), False, None), ((3, 0), (0,), True, None)]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape, normalized, weighted, eps", RMS_CASES, ids=str)
def test_rms_norm_and_its_rstd_match_the_composite(shape, normalized, weighted, eps, dtype):
    # rstd, _fused_rms_norm's second output, is what autograd saves for the
    # backward: its shape, dtype (float for 16-bit inputs) and values too.
    torch.manual_seed(2)
    x = torch.randn(shape, dtype=dtype)
    weight = torch.randn(normalized, dtype=dtype) if weighted else None
    on_acme = None if weight is None else weight.to(DEVICE)
    expected = F.rms_norm(x, normalized, weight, eps)
    fused = F.rms_norm(x.to(DEVICE), normalized, on_acme, eps)
    torch.testing.assert_close(fused.cpu(), expected, **tolerance(dtype))
    _, expected_rstd = torch._fused_rms_norm(x, list(normalized), weight, eps)
    _, rstd = torch._fused_rms_norm(x.to(DEVICE), list(normalized), on_acme, eps)
    assert rstd.dtype == expected_rstd.dtype and rstd.shape == expected_rstd.shape
    torch.testing.assert_close(rstd.cpu(), expected_rstd, equal_nan=True, **tolerance(dtype))


def test_rms_norm_runs_the_fused_kernels_both_ways():
    x, w = torch.randn(4, 16, device=DEVICE, requires_grad=True), torch.randn(16, device=DEVICE)
    with torch.profiler.profile() as prof:
        F.rms_norm(x, (16,), w).sum().backward()
    names = {e.name for e in prof.events()}
    assert {"aten::_fused_rms_norm", "aten::_fused_rms_norm_backward"} <= names, names
    assert "aten::pow" not in names and "aten::rsqrt" not in names, names


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_rms_norm_gradients_match_the_cpu(dtype, weighted):
    torch.manual_seed(3)
    x, w = torch.randn(3, 4, 8, dtype=dtype), torch.randn(4, 8, dtype=dtype)
    x_cpu, w_cpu = leaves(x, w, device="cpu")
    x_dev, w_dev = leaves(x, w, device=DEVICE)
    grads = torch.randn(3, 4, 8, dtype=dtype)
    F.rms_norm(x_cpu, (4, 8), w_cpu if weighted else None).backward(grads)
    F.rms_norm(x_dev, (4, 8), w_dev if weighted else None).backward(grads.to(DEVICE))
    torch.testing.assert_close(x_dev.grad.cpu(), x_cpu.grad, **tolerance(dtype))
    if weighted:
        torch.testing.assert_close(w_dev.grad.cpu(), w_cpu.grad, **tolerance(dtype))


def test_rms_norm_second_derivative_matches_the_cpu():
    # With create_graph, PyTorch's formula differentiates in ATen operators
    # (acme's backward kernel serves only the first derivative).
    x = torch.randn(2, 5, dtype=torch.float64)

    def second(device):
        xi = x.to(device).requires_grad_()
        (g,) = torch.autograd.grad(F.rms_norm(xi, (5,)).pow(3).sum(), xi, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), xi)
        return gg.cpu()

    torch.testing.assert_close(second(DEVICE), second("cpu"))


@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
def test_rms_norm_results_have_the_cpus_strides(layout):
    x = torch.randn(2, 3, 4, 5)
    x = x.transpose(0, 2) if layout == "transposed" else x.to(memory_format=torch.channels_last)
    expected = F.rms_norm(x, (5,))
    result = F.rms_norm(x.to(DEVICE), (5,))
    assert result.stride() == expected.stride(), (result.stride(), expected.stride())
    torch.testing.assert_close(result.cpu(), expected)


def test_rms_norm_complex_mixed_dtypes_and_bad_shapes_as_on_the_cpu():
    # rms_norm itself sends these to its composite before _fused_rms_norm.
    z = torch.randn(2, 4, dtype=torch.complex64)
    zc, zd = z.clone().requires_grad_(), z.to(DEVICE).requires_grad_()
    F.rms_norm(zc, (4,)).abs().sum().backward()
    F.rms_norm(zd, (4,)).abs().sum().backward()
    torch.testing.assert_close(zd.grad.cpu(), zc.grad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Mismatch dtype between input and weight", on both
        half, weight = torch.randn(2, 4, dtype=torch.half), torch.randn(4)
        torch.testing.assert_close(F.rms_norm(half.to(DEVICE), (4,), weight.to(DEVICE)).cpu(),
                                   F.rms_norm(half, (4,), weight))
    with pytest.raises(RuntimeError, match="normalized_shape"):
        F.rms_norm(torch.ones(2, 4, device=DEVICE), (3,))


def test_rms_norm_dispatch_tables():
    def rows(op):
        return {line.split(":")[0]: line for line in torch._C._dispatch_dump_table(op).splitlines()}

    fused = rows("aten::_fused_rms_norm")
    assert "rms_norm.cpp" in fused["PrivateUse1"]
    # A backend kernel moves the autograd key from the composite to PyTorch's
    # generated autograd kernel, as on CUDA.
    assert "[autograd kernel]" in fused["AutogradPrivateUse1"] and "VariableType" in fused["AutogradPrivateUse1"]
    assert "rms_norm.cpp" in rows("aten::_fused_rms_norm_backward")["PrivateUse1"]
    assert "[math kernel]" in rows("aten::rms_norm")["PrivateUse1"]


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
