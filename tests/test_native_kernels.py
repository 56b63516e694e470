"""Chapter 10: every native kernel against the CPU.

Runs in the pytest process, which imports the newest stage under test. Each
case computes the same expression on CPU tensors and on acme tensors (views
are taken on each device, so strided inputs stay strided) and requires the
same values, dtype, shape and strides, with no operator of the case reaching
the CPU fallback. A last test checks that the cases cover every operator
whose acme kernel is registered from csrc/aten/native_kernels.cpp.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_acme  # noqa: F401
from conftest import dispatch_row
from torch_acme import _build_info

if _build_info.STAGE < 10:
    # Scoping, not hiding: before chapter 10 there are no native kernels.
    pytest.skip(f"the stage under test ({_build_info.STAGE}) predates chapter 10",
                allow_module_level=True)

NAME = torch._C._get_privateuse1_backend_name()


def native_kernels() -> set[str]:
    """The operators whose acme kernel comes from native_kernels.cpp."""
    ops = torch._C._dispatch_get_registrations_for_dispatch_key("PrivateUse1")
    return {op for op in ops if "native_kernels.cpp" in dispatch_row(op)}


class Record(TorchDispatchMode):
    """Notes every operator called on acme tensors (the outermost call only)."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                   if isinstance(a, torch.Tensor)]
        if any(t.device.type == NAME for t in tensors):
            name = func.name()
            self.ops.add(name[: -len(".default")] if name.endswith(".default") else name)
        return func(*args, **kwargs)


COVERED: set[str] = set()  # filled by the cases, checked by the last test


def tensors_of(result):
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in result if isinstance(t, torch.Tensor)]


def same(on_acme: torch.Tensor, on_cpu: torch.Tensor, label: str, tolerance: float = 0) -> None:
    """Same dtype, shape, strides and values: equal, or within `tolerance` relative to the CPU's."""
    assert on_acme.device.type == NAME, label
    assert on_acme.dtype == on_cpu.dtype, (label, on_acme.dtype, on_cpu.dtype)
    assert on_acme.shape == on_cpu.shape, (label, on_acme.shape, on_cpu.shape)
    if on_cpu.numel() > 1:
        assert on_acme.stride() == on_cpu.stride(), (label, on_acme.stride(), on_cpu.stride())
    atol = 1e-5 if tolerance else 0  # with a tolerance, a little slack around zero too
    torch.testing.assert_close(on_acme.cpu(), on_cpu, rtol=tolerance, atol=atol, equal_nan=True,
                               msg=lambda m: f"{label}: {m}")


def check(fn, *inputs, view=None, label="", tolerance=0):
    """fn(*inputs) on the CPU and on acme; `view` makes each input strided first.

    Values must be equal unless a `tolerance` (relative) is given.
    """
    view = view or (lambda *ts: ts)
    on_cpu = view(*[t.clone() for t in inputs])
    on_acme = view(*[t.to(NAME) for t in inputs])
    expected = fn(*on_cpu)
    record = Record()
    with record:
        result = fn(*on_acme)
    fallbacks = {op for op in record.ops if "cpu_fallback.cpp" in dispatch_row(op)
                 or "backend fallback" in dispatch_row(op)}
    assert not fallbacks, f"{label}: {sorted(fallbacks)} ran on the CPU fallback"
    COVERED.update(record.ops)
    for got, want in zip(tensors_of(result), tensors_of(expected), strict=True):
        same(got, want, label, tolerance)
    for got, want in zip(on_acme, on_cpu):  # in-place forms: the inputs too
        same(got, want, label + " (input)", tolerance)


def sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).round().to(dtype) / 2
    return torch.randint(-9, 10, shape, generator=g).to(dtype)


def nonzero(shape, dtype, seed=1):
    t = sample(shape, dtype, seed)
    return torch.where(t == 0, torch.ones((), dtype=dtype), t)


# ---- elementwise arithmetic ------------------------------------------------

# (left shape, right shape, view): broadcast (of both operands, or of the right
# one along either dimension), strided and 0-dim operands. With both operands
# transposed the output itself is column-major: `same` checks that its strides
# follow the CPU's.
LAYOUTS = {
    "same": ((3, 5), (3, 5), None),
    "broadcast": ((3, 1), (1, 5), None),
    "broadcast-one-side-column": ((3, 5), (3, 1), None),
    "broadcast-one-side-row": ((3, 5), (1, 5), None),
    "transposed": ((5, 3), (3, 5), lambda a, b: (a.t(), b)),
    "both-transposed": ((5, 3), (5, 3), lambda a, b: (a.t(), b.t())),
    "sliced": ((3, 10), (3, 5), lambda a, b: (a[:, ::2], b)),
    "zero-dim": ((3, 5), (), None),
    "empty": ((0, 5), (1, 5), None),
}
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32]
MIXED = [(torch.int64, torch.float32), (torch.float16, torch.float32), (torch.int32, torch.int64),
         (torch.bool, torch.float64)]

ARITHMETIC = {
    "add": lambda a, b: a + b,
    "add-alpha": lambda a, b: torch.add(a, b, alpha=3),
    "sub": lambda a, b: a - b,
    "sub-alpha": lambda a, b: torch.sub(a, b, alpha=2),
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "div-floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "div-trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "maximum": torch.maximum,  # acme's own device-style loop (elementwise.h)
    "minimum": torch.minimum,
}
INPLACE = {
    "add_": lambda a, b: a.add_(b, alpha=2),
    "sub_": lambda a, b: a.sub_(b),
    "mul_": lambda a, b: a.mul_(b),
    "div_": lambda a, b: a.div_(b),
    "div_-trunc": lambda a, b: a.div_(b, rounding_mode="trunc"),
}
OUT = {
    "add": lambda a, b, out: torch.add(a, b, alpha=2, out=out),
    "sub": lambda a, b, out: torch.sub(a, b, out=out),
    "mul": lambda a, b, out: torch.mul(a, b, out=out),
    "div": lambda a, b, out: torch.div(a, b, out=out),
    "div-floor": lambda a, b, out: torch.div(a, b, rounding_mode="floor", out=out),
    "maximum": lambda a, b, out: torch.maximum(a, b, out=out),
    "minimum": lambda a, b, out: torch.minimum(a, b, out=out),
}


def integral(dtype):
    return not dtype.is_floating_point and dtype != torch.bool


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", ARITHMETIC)
def test_arithmetic(op, layout, dtype):
    left, right, view = LAYOUTS[layout]
    a, b = sample(left, dtype), nonzero(right, dtype)
    if layout == "both-transposed":  # the case is about a column-major output
        assert not ARITHMETIC[op](*view(a, b)).is_contiguous()
    check(ARITHMETIC[op], a, b, view=view, label=f"{op} {layout} {dtype}")


@pytest.mark.parametrize("dtypes", MIXED, ids=str)
@pytest.mark.parametrize("op", ARITHMETIC)
def test_arithmetic_type_promotion(op, dtypes):
    a, b = sample((3, 5), dtypes[0]), nonzero((3, 5), dtypes[1])
    if dtypes[0] == torch.bool and op.startswith("sub"):
        return  # sub refuses bool on every device
    check(ARITHMETIC[op], a, b, label=f"{op} {dtypes}")


@pytest.mark.parametrize("scalar", [2, 2.5, True], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16], ids=str)
def test_arithmetic_with_python_scalars(dtype, scalar):
    a = nonzero((4, 3), dtype)
    for label, fn in {"+": lambda t: t + scalar, "-": lambda t: t - scalar,
                      "*": lambda t: t * scalar, "/": lambda t: t / 2,
                      "r-": lambda t: 3 - t, "r*": lambda t: scalar * t,
                      "add.Scalar": lambda t: torch.ops.aten.add.Scalar(t, scalar),
                      "mul.Scalar": lambda t: torch.ops.aten.mul.Scalar(t, 3),
                      "div.Scalar": lambda t: torch.ops.aten.div.Scalar(t, 4)}.items():
        if label == "-" and scalar is True:  # no subtraction of bools, on any device
            continue
        check(fn, a, label=f"{label} {scalar} {dtype}")


def test_arithmetic_with_cpu_scalar_tensor():
    a = sample((3, 4), torch.float32)
    check(lambda t: t * torch.tensor(3.0), a, label="cpu 0-dim")
    check(lambda t: t + torch.tensor(2), a, label="cpu 0-dim int")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["same", "broadcast-right", "transposed", "sliced"])
@pytest.mark.parametrize("op", INPLACE)
def test_arithmetic_inplace(op, layout, dtype):
    if op.startswith("div_") and "trunc" not in op and integral(dtype):
        return  # true division cannot write floats into an integer tensor (on any device)
    shapes = {"same": ((3, 5), (3, 5), None), "broadcast-right": ((3, 5), (1, 5), None),
              "transposed": ((5, 3), (3, 5), lambda a, b: (a.t(), b)),
              "sliced": ((3, 10), (3, 5), lambda a, b: (a[:, ::2], b))}
    left, right, view = shapes[layout]
    check(INPLACE[op], sample(left, dtype), nonzero(right, dtype), view=view,
          label=f"{op} {layout} {dtype}")


@pytest.mark.parametrize("out_kind", ["empty", "right-shape", "transposed", "wider-dtype"])
@pytest.mark.parametrize("op", OUT)
def test_arithmetic_out(op, out_kind):
    a, b = sample((3, 5), torch.float32), nonzero((3, 5), torch.float32)

    def run(x, y):
        out = {"empty": lambda: torch.empty(0, device=x.device),
               "right-shape": lambda: torch.full((3, 5), 7.0, device=x.device),
               "transposed": lambda: torch.zeros(5, 3, device=x.device).t(),
               "wider-dtype": lambda: torch.zeros(3, 5, dtype=torch.float64, device=x.device),
               }[out_kind]()
        returned = OUT[op](x, y, out)
        assert returned is out
        return out

    check(run, a, b, label=f"{op} out={out_kind}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_arithmetic_out_every_dtype(dtype):
    a, b = sample((3, 5), dtype), nonzero((3, 5), dtype)
    ops = [torch.add, torch.sub, torch.mul] + [torch.div] * dtype.is_floating_point
    for fn in ops:
        check(lambda x, y: fn(x, y, out=torch.empty(0, dtype=dtype, device=x.device)), a, b,
              label=f"{fn.__name__} out=empty {dtype}")
        check(lambda x, y: fn(x, y, out=torch.zeros(5, 3, dtype=dtype, device=x.device).t()),
              a, b, label=f"{fn.__name__} out=transposed {dtype}")
    check(lambda x, y: torch.div(x, y, rounding_mode="floor",
                                 out=torch.empty(0, dtype=dtype, device=x.device)),
          a, b, label=f"div floor out=empty {dtype}")


@pytest.mark.parametrize("fn", [torch.maximum, torch.minimum], ids=lambda f: f.__name__)
def test_own_kernel_nan_bool_and_cpu_scalars(fn):
    """maximum and minimum run acme's device-style loop (elementwise.h): a NaN
    wins, bools are logical, a CPU 0-dim operand on either side travels as a
    kernel argument, in its own dtype."""
    nan = float("nan")
    check(fn, torch.tensor([1.0, nan, 3.0, nan]), torch.tensor([nan, 2.0, 1.0, nan]), label="nan")
    check(fn, sample((3, 4), torch.bool), sample((3, 4), torch.bool, seed=2), label="bool")
    a = sample((3, 4), torch.float16)
    check(lambda t: fn(t, torch.tensor(0.5)), a, label="cpu 0-dim float32 right")
    check(lambda t: fn(torch.tensor(1), t), a, label="cpu 0-dim int64 left")
    check(lambda t: fn(t.t(), torch.tensor(-1.5, dtype=torch.float64)), a, label="transposed")


def test_own_kernel_splits_offsets_beyond_32_bits():
    # Three elements 2 GiB apart in one storage: the last lies 4 GiB in, past
    # 32-bit offsets, so binary_kernel splits the iterator. Unsplit, its offset
    # would wrap to the first element's (max would read [4, 7, 4]). Only the
    # three elements' pages are touched.
    big = torch.empty(2**32 + 1, dtype=torch.int8, device=NAME)
    x = big[:: 2**31]
    x.fill_(4)
    x[1], x[2] = 7, 8
    y = torch.tensor([1, 5, 2], dtype=torch.int8, device=NAME)
    assert torch.maximum(x, y).cpu().tolist() == [4, 7, 8]
    assert torch.minimum(x, y).cpu().tolist() == [1, 5, 2]
    del big, x
    if _build_info.STAGE >= 12:  # the caching allocator would keep the 4 GiB reserved
        getattr(torch, NAME).empty_cache()


@pytest.mark.skipif(_build_info.STAGE < 14, reason="chapter 14 gives silu_backward its kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16],
                         ids=str)
def test_silu_backward_through_its_stub(dtype):
    grad, x = sample((4, 6), dtype), sample((4, 6), dtype, seed=3)
    check(torch.ops.aten.silu_backward, grad, x, label=f"silu_backward {dtype}")
    check(torch.ops.aten.silu_backward, grad, x, view=lambda g, t: (g.t(), t.t()),
          label=f"silu_backward transposed {dtype}")
    check(lambda g, t: torch.ops.aten.silu_backward(g, t, grad_input=torch.empty(0, dtype=dtype,
                                                                                  device=t.device)),
          grad, x, label=f"silu_backward.grad_input {dtype}")


def test_scalar_into_a_wider_out():
    a = nonzero((3, 5), torch.float32)
    check(lambda x: torch.add(x, 1, out=torch.empty(0, dtype=torch.float64, device=x.device)), a,
          label="add scalar out=float64")
    check(lambda x: x * torch.tensor(2), a, label="cpu 0-dim int64 operand")


def test_inplace_refuses_what_the_cpu_refuses():
    for fn in [lambda a, b: a.add_(b),  # the result would not fit in `a`
               lambda a, b: torch.add(a.int(), b, out=torch.empty(0, dtype=torch.int32,
                                                                  device=a.device))]:
        a, b = torch.ones(1, 5), torch.ones(3, 5)
        with pytest.raises(RuntimeError) as on_cpu:
            fn(a, b)
        with pytest.raises(RuntimeError) as on_acme:
            fn(a.to(NAME), b.to(NAME))
        assert str(on_acme.value) == str(on_cpu.value)


def test_shape_errors_match_the_cpu():
    a, b = torch.ones(3), torch.ones(4)
    with pytest.raises(RuntimeError) as on_cpu:
        a + b
    with pytest.raises(RuntimeError) as on_acme:
        a.to(NAME) + b.to(NAME)
    assert str(on_acme.value) == str(on_cpu.value)


# ---- comparisons -------------------------------------------------------------

COMPARISONS = ["eq", "ne", "lt", "le", "gt", "ge"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.bool], ids=str)
@pytest.mark.parametrize("op", COMPARISONS)
def test_comparisons(op, dtype):
    a, b = sample((4, 5), dtype, 0), sample((4, 5), dtype, 1)
    fn = getattr(torch, op)
    check(lambda x, y: fn(x, y), a, b, label=f"{op} {dtype}")
    check(lambda x, y: fn(x, y), a, b[:1], label=f"{op} broadcast {dtype}")
    check(lambda x, y: fn(x.t(), y.t()), a, b, label=f"{op} transposed {dtype}")
    check(lambda x: fn(x, 1), a, label=f"{op} scalar {dtype}")
    check(lambda x: fn(x, 0.5), a, label=f"{op} float scalar {dtype}")
    check(lambda x, y: getattr(x, op + "_")(y), a, b, label=f"{op}_ {dtype}")
    check(lambda x: getattr(x, op + "_")(1), a, label=f"{op}_ scalar {dtype}")
    check(lambda x: getattr(x, op + "_")(0.5), a, label=f"{op}_ float scalar {dtype}")
    check(lambda x, y: fn(x.t(), y[:1].t()), a, b, label=f"{op} transposed broadcast {dtype}")
    check(lambda x, y: fn(x, y, out=torch.empty(0, dtype=torch.bool, device=x.device)), a, b,
          label=f"{op} out {dtype}")
    check(lambda x: fn(x, 1, out=torch.empty(0, dtype=torch.bool, device=x.device)), a,
          label=f"{op} scalar out {dtype}")


def test_comparisons_mixed_dtypes():
    a, b = sample((4, 5), torch.int64), sample((4, 5), torch.float32)
    for op in COMPARISONS:
        fn = getattr(torch, op)
        check(lambda x, y: fn(x, y), a, b, label=f"{op} int64 vs float32")
        check(lambda x: fn(x.int(), x.double()), a, label=f"{op} int32 vs float64")
        check(lambda x, y: fn(x, y, out=torch.empty(0, dtype=torch.float32, device=x.device)),
              a, b, label=f"{op} out float32")


# ---- reductions ----------------------------------------------------------------

REDUCTIONS = {
    "sum-dim": lambda t: t.sum(dim=1),
    "sum-dims-keepdim": lambda t: t.sum(dim=(0, 2), keepdim=True),
    "sum-all": lambda t: t.sum(),
    "sum-dtype": lambda t: t.sum(dim=0, dtype=torch.float64),
    "mean-dim": lambda t: t.float().mean(dim=2),
    "mean-all": lambda t: t.double().mean(),
    "amax": lambda t: t.amax(dim=1),
    "amin-keepdim": lambda t: t.amin(dim=(1, 2), keepdim=True),
    "max": lambda t: t.max(),
    "min": lambda t: t.min(),
    "max-dim": lambda t: t.max(dim=2),
    "min-dim-keepdim": lambda t: t.min(dim=0, keepdim=True),
    "argmax": lambda t: t.argmax(dim=1),
    "argmin-all": lambda t: t.argmin(),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("op", REDUCTIONS)
def test_reductions(op, strided, dtype):
    view = (lambda t: (t.permute(2, 0, 1),)) if strided else None
    check(REDUCTIONS[op], sample((3, 4, 5), dtype), view=view, label=f"{op} {dtype}")


def test_reductions_large_and_bool():
    big = torch.rand(1 << 20)  # large enough for the CPU's parallel, two-pass reduction
    check(lambda t: t.sum(dim=0), big, label="sum 1M")
    check(lambda t: t.mean(dim=0), big, label="mean 1M")
    check(lambda t: t.amax(dim=0), big, label="amax 1M")
    check(lambda t: t.sum(dim=1), sample((6, 7), torch.bool), label="sum bool")


def test_reduction_out_forms():
    t = sample((3, 4, 5), torch.float32)
    empty = lambda x, **kw: torch.empty(0, device=x.device, **kw)  # noqa: E731
    check(lambda x: torch.sum(x, 1, out=empty(x)), t, label="sum out")
    check(lambda x: torch.mean(x, (0, 1), out=empty(x)), t, label="mean out")
    check(lambda x: torch.amax(x, 2, out=empty(x)), t, label="amax out")
    check(lambda x: torch.amin(x, 2, out=empty(x)), t, label="amin out")
    check(lambda x: torch.argmax(x, 0, out=empty(x, dtype=torch.long)), t, label="argmax out")
    check(lambda x: torch.argmin(x, 0, out=empty(x, dtype=torch.long)), t, label="argmin out")
    check(lambda x: torch.max(x, out=empty(x)), t, label="max unary out")
    check(lambda x: torch.min(x, out=empty(x)), t, label="min unary out")
    check(lambda x: torch.max(x[:0], out=empty(x)), t, label="max unary out of nothing")
    check(lambda x: torch.max(x, 1, out=(empty(x), empty(x, dtype=torch.long))), t, label="max.dim out")
    check(lambda x: torch.min(x, 1, out=(empty(x), empty(x, dtype=torch.long))), t, label="min.dim out")


@pytest.mark.parametrize("shape, fn", [((0,), lambda t: t.max()), ((2, 3), lambda t: t.amax(dim=5)),
                                       ((2, 3), lambda t: t.sum(dim=(0, 0)))],
                         ids=["max of nothing", "bad dim", "repeated dim"])
def test_reduction_errors_match_the_cpu(shape, fn):
    with pytest.raises((RuntimeError, IndexError)) as on_cpu:
        fn(torch.ones(shape))
    with pytest.raises(on_cpu.type) as on_acme:
        fn(torch.ones(shape, device=NAME))
    assert str(on_acme.value) == str(on_cpu.value)


# ---- matrix products and softmax -------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_matrix_products(dtype):
    a, b, c = sample((6, 4), dtype), sample((4, 5), dtype, 1), sample((6, 5), dtype, 2)
    check(torch.mm, a, b, label=f"mm {dtype}")
    check(lambda x, y: torch.mm(x.t(), y.t()), b, a, label=f"mm transposed {dtype}")
    check(lambda x, y: x @ y, a, b, label=f"matmul {dtype}")
    check(lambda x, y: torch.mm(x, y, out=torch.empty(0, dtype=dtype, device=x.device)), a, b,
          label=f"mm out {dtype}")
    check(lambda s, x, y: torch.addmm(s, x, y, beta=0.5, alpha=2), c, a, b, label=f"addmm {dtype}")
    check(lambda s, x, y: torch.addmm(s[0], x, y), c, a, b, label=f"addmm broadcast {dtype}")
    check(lambda s, x, y: s.addmm_(x, y), c, a, b, label=f"addmm_ {dtype}")
    check(lambda s, x, y: torch.addmm(s, x, y, out=torch.empty(0, dtype=dtype, device=x.device)),
          c, a, b, label=f"addmm out {dtype}")
    p, q = sample((3, 6, 4), dtype), sample((3, 4, 5), dtype, 1)
    check(torch.bmm, p, q, label=f"bmm {dtype}")
    check(lambda x, y: torch.bmm(x, y, out=torch.empty(0, dtype=dtype, device=x.device)), p, q,
          label=f"bmm out {dtype}")
    check(lambda x, y: x @ y, p, b, label=f"matmul 3d @ 2d {dtype}")


# The CPU's bfloat16 linear goes through its own GEMM (oneDNN), whose order of
# float32 accumulation may differ by machine: one bfloat16 rounding step apart
# (2 ** -7 relative) is the same result.
LINEAR_TOLERANCE = {torch.float32: 0, torch.float64: 0, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", LINEAR_TOLERANCE, ids=str)
def test_linear(dtype):
    layer = torch.nn.Linear(4, 3)
    x = sample((5, 4), dtype)
    w, b = layer.weight.detach().to(dtype), layer.bias.detach().to(dtype)
    linear = torch.nn.functional.linear
    tolerance = LINEAR_TOLERANCE[dtype]
    check(lambda x, w, b: linear(x, w, b), x, w, b, label=f"linear {dtype}", tolerance=tolerance)
    check(lambda x, w: linear(x, w), x, w, label=f"linear no bias {dtype}", tolerance=tolerance)
    check(lambda x, w, b: linear(x, w, b), sample((2, 5, 4), dtype), w, b,
          label=f"linear 3d {dtype}", tolerance=tolerance)


def test_large_matmul():
    a, b = torch.rand(256, 256), torch.rand(256, 256)
    check(torch.mm, a, b, label="mm 256")


def test_matrix_product_errors_match_the_cpu():
    a, b = torch.ones(2, 3), torch.ones(4, 5)
    with pytest.raises(RuntimeError) as on_cpu:
        torch.mm(a, b)
    with pytest.raises(RuntimeError) as on_acme:
        torch.mm(a.to(NAME), b.to(NAME))
    assert str(on_acme.value) == str(on_cpu.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax(dim, dtype):
    t = sample((4, 6), dtype)
    check(lambda x: torch.softmax(x, dim), t, label=f"softmax {dim} {dtype}")
    check(lambda x: torch.log_softmax(x, dim), t, label=f"log_softmax {dim} {dtype}")
    check(lambda x: torch.softmax(x.t(), dim), t, label=f"softmax transposed {dim} {dtype}")
    check(lambda x: torch.log_softmax(x.t(), dim), t, label=f"log_softmax transposed {dim} {dtype}")
    check(lambda x: torch.softmax(x, dim, dtype=torch.float64), t, label=f"softmax dtype {dim}")
    empty = lambda x: torch.empty(0, dtype=dtype, device=x.device)  # noqa: E731
    check(lambda x: torch._softmax(x, dim, False, out=empty(x)), t, label=f"_softmax out {dtype}")
    check(lambda x: torch._log_softmax(x, dim, False, out=empty(x)), t,
          label=f"_log_softmax out {dtype}")


# ---- fill, zero, copy ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.float16], ids=str)
def test_fill_and_zero(dtype):
    t = sample((4, 6), dtype)
    check(lambda x: x.fill_(1), t, label=f"fill_ {dtype}")
    check(lambda x: x[:, ::2].fill_(True), t, label=f"fill_ strided {dtype}")
    check(lambda x: x.zero_(), t, label=f"zero_ {dtype}")
    check(lambda x: x.t().zero_(), t, label=f"zero_ transposed {dtype}")
    check(lambda x, v: x.fill_(v), t, torch.tensor(1, dtype=dtype), label=f"fill_ acme 0-dim {dtype}")
    check(lambda x: x.fill_(torch.tensor(0)), t, label=f"fill_ cpu 0-dim {dtype}")
    check(lambda x: torch.ones(3, 2, dtype=dtype, device=x.device), t, label="ones")
    check(lambda x: torch.zeros(0, dtype=dtype, device=x.device), t, label="zeros empty")


COPY_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
               torch.int8, torch.uint8, torch.bool, torch.complex64]


@pytest.mark.filterwarnings("ignore:Casting complex values to real")
@pytest.mark.parametrize("dst", COPY_DTYPES, ids=str)
@pytest.mark.parametrize("src", COPY_DTYPES, ids=str)
def test_copy_between_dtypes(src, dst):
    t = sample((4, 6), src) if src != torch.complex64 else torch.randn(4, 6, dtype=src)
    check(lambda x: x.to(dst), t, label=f"to {src}->{dst}")
    check(lambda x, y: y.copy_(x), t, torch.zeros(4, 6, dtype=dst), label=f"copy_ {src}->{dst}")
    check(lambda x, y: y.t().copy_(x.t()), t, torch.zeros(4, 6, dtype=dst),
          label=f"copy_ transposed {src}->{dst}")


def test_copy_layouts():
    t = sample((4, 6), torch.float32)
    check(lambda x, y: y.t().copy_(x.t()), t, torch.zeros(4, 6), label="copy_ transposed")
    check(lambda x, y: y.copy_(x[:1]), t, torch.zeros(4, 6), label="copy_ broadcast")
    check(lambda x, y: y[:, ::2].copy_(x[:, 1::2]), t, torch.zeros(4, 6), label="copy_ strided")
    check(lambda x, y: y.copy_(x.t().contiguous().t()), t, torch.zeros(4, 6),
          label="copy_ from column-major")
    check(lambda x: x.t().contiguous(), t, label="contiguous")
    check(lambda x: x.clone(), t, label="clone")
    check(lambda x: x[2:4].copy_(x[0:2]), t, label="copy_ between rows")
    with pytest.raises(RuntimeError) as on_cpu:
        t[1:3].copy_(t[0:2])  # partial overlap: refused
    with pytest.raises(RuntimeError) as on_acme:
        a = t.to(NAME)
        a[1:3].copy_(a[0:2])
    assert str(on_acme.value) == str(on_cpu.value)


def test_copy_across_devices():
    t = torch.arange(12.0).reshape(3, 4)
    one = t.to(f"{NAME}:1")
    moved = one.to(f"{NAME}:0", dtype=torch.float64)
    assert moved.device == torch.device(f"{NAME}:0")
    assert torch.equal(moved.cpu(), t.double())
    back = torch.empty(3, 4, device=f"{NAME}:1").copy_(moved)
    assert torch.equal(back.cpu(), t)


def test_lazy_conjugation_and_negation():
    z = torch.randn(3, dtype=torch.complex64)
    check(lambda x: x.conj().clone(), z, label="conj clone")
    check(lambda x, y: y.copy_(x.conj()), z, torch.zeros(3, dtype=torch.complex64), label="copy_ conj")
    check(lambda x: x.conj().cpu().to(x.device), z, label="conj to the host")
    check(lambda x: torch._neg_view(x).clone(), z, label="neg view clone")


# ---- devices -------------------------------------------------------------------------


def test_outputs_live_on_the_inputs_device():
    from torch_acme import runtime

    a = torch.ones(64, device=f"{NAME}:1")
    before = runtime.memory_stats(1)["blocks_in_use"]
    for result in [a + a, a.sum(dim=0), torch.mm(a.view(8, 8), a.view(8, 8)),
                   torch.softmax(a, 0), a.to(torch.float64), a > 0]:
        assert result.device == torch.device(f"{NAME}:1")
    assert runtime.current_device() == 0  # the kernels restored the current device
    del result
    assert runtime.memory_stats(1)["blocks_in_use"] == before


@pytest.mark.parametrize("fn", [lambda a, b: a + b, lambda a, b: a.add_(b), torch.mm,
                                lambda a, b: torch.addmm(a, a, b), lambda a, b: a.eq(b),
                                lambda a, b: torch.sum(a, 0, out=b)],
                         ids=["add", "add_", "mm", "addmm", "eq", "sum out"])
def test_mixed_devices_are_refused(fn):
    a, b = torch.ones(2, 2, device=f"{NAME}:0"), torch.ones(2, 2, device=f"{NAME}:1")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        fn(a, b)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        fn(a, torch.ones(2, 2))


# ---- coverage: this file must exercise every native kernel ---------------------------


def test_every_native_kernel_is_checked():
    if not COVERED:
        pytest.skip("the coverage check needs the whole module: it collects what the cases ran")
    kernels = native_kernels()
    assert "aten::add.Tensor" in kernels
    missing = kernels - COVERED
    assert not missing, f"native kernels no case exercised: {sorted(missing)}"
