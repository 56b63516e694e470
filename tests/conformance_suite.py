"""PyTorch's own OpInfo and ModuleInfo samples, run on acme and compared with the CPU.

This is the file a vendor adapts: a device-generic test class, instantiated by
PyTorch's `instantiate_device_type_tests` for the PrivateUse1 device, whatever
it is called. It is not collected by `pytest tests` (thousands of tests);
`tools/conformance.py` runs it in crash-isolated workers, and it also runs
directly:

    python -m pytest tests/conformance_suite.py -k "test_forward_add_"

Three things make it work for an out-of-tree backend (chapter 14 explains them):

1. The backend is imported *before* `torch.testing._internal.common_device_type`:
   that module decides at import time which device test bases exist, and it
   only adds `PrivateUse1TestBase` when `torch.<name>.is_available()` is true.
2. `only_for="privateuse1"`: the test classes are made for acme alone (the CPU
   is the reference inside each test, not a device under test).
3. acme's known gaps are declared with
   `PrivateUse1TestBase.set_test_configs(op_overrides=...)`, each with its
   reason, from the table in tools/conformance_overrides.py.

Each test compares every sample with the CPU. A test fails with `Mismatch`
when acme's numbers differ (or acme computes where the CPU refuses), with
`DeviceError` when acme raises where the CPU does not (or raises another
error); it is skipped with "the CPU" in its reason when the CPU itself cannot
run the op for that dtype. Besides OpInfo's samples as they are (forward,
backward, module), the edge sweeps change them: extremal values, an emptied
dimension, channels-last or non-contiguous inputs, out= tensors; second
derivatives; and OpInfo's error inputs.
"""

from __future__ import annotations

import math
import os
import re
import sys
import unittest
import unittest.mock
import warnings
from pathlib import Path

import torch_acme  # noqa: F401  (first: see 1. above)
import torch
from torch.testing._internal.common_device_type import (
    OpDTypes,
    PrivateUse1TestBase,
    instantiate_device_type_tests,
    ops,
)
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.common_modules import module_db, modules
from torch.testing._internal.common_utils import TestCase, noncontiguous_like
from torch.testing._internal.opinfo.core import DecorateInfo, SampleInput
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.conformance_overrides import OVERRIDES, Override  # noqa: E402

DEVICE = torch._C._get_privateuse1_backend_name()

# The dtypes the heatmap shows; an op is tested in those of them the CPU supports.
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.complex64, torch.int64, torch.uint8, torch.bool,
          torch.uint16, torch.uint32, torch.uint64)
MODULE_DTYPES = (torch.float32, torch.float64)

# Ops whose output is uninitialised memory: only shape, dtype, device and strides mean anything.
UNINITIALISED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                 "empty_permuted"}
# Ops that grow their input in place: from an emptied input, their result is uninitialised too.
GROWS = {"resize_", "resize_as_"}
# The CPU's LAPACK (oneMKL's ?gebal, under geev) crashes the process on a non-finite
# matrix (PyTorch's CPU kernel passes it on unchecked): there is no CPU answer to compare.
CPU_CRASHES_ON_NONFINITE = {"linalg.eig", "linalg.eigvals"}
# Second derivatives acme refuses on purpose, with a clear error (a row in
# tests/bad_inputs.toml): through attention with dropout, whose recomputed
# gradient would draw a second mask. Those samples are left out of test_gradgrad.
GRADGRAD_REFUSED = {
    "nn.functional.scaled_dot_product_attention": lambda sample: sample.kwargs.get("dropout_p", 0) > 0,
}

# Samples per (op, dtype): ACME_CONFORMANCE_SAMPLES=1 is the quick subset `nox -s tests` runs.
SAMPLES = int(os.environ.get("ACME_CONFORMANCE_SAMPLES", "0")) or None
# A random op's outputs are pooled over this many seeds before comparing distributions.
RANDOM_DRAWS = 100
# The harness seeds through its own reference: during a random op's draws
# torch.manual_seed itself is silenced (see _compare_random).
_manual_seed = torch.manual_seed


class Mismatch(AssertionError):
    """acme's result differs from the CPU's for the same sample."""


class DeviceError(RuntimeError):
    """acme raised where the CPU computed a result."""


class Close(Exception):
    """Outside the tolerances PyTorch's tests use on one device, inside the ones its
    CPU-versus-CUDA test (test_ops.py's test_compare_cpu) uses: atol = rtol = 1e-3.
    A different algorithm (attention computed blockwise or not) rounds differently;
    the run reports these apart from passes and from mismatches."""


CROSS_DEVICE_TOL = dict(atol=1e-3, rtol=1e-3)


# ---- samples: made on acme (as PyTorch's own tests make them on the device), copied to the CPU ----

def _copy(value, device: str):
    """A fresh copy of a sample's tensors for one run on `device` ("cpu" or acme).

    Tensors on acme go to `device`; tensors a sample keeps on the CPU on purpose
    (tensor_split's indices, say) stay there. Every run gets its own copies, so an
    in-place op cannot change the next run's input. Leaves stay leaves, and the
    device arguments of factory functions follow the run.
    """
    def move(x):
        if isinstance(x, torch.Tensor):
            target = device if x.device.type == DEVICE else x.device
            moved = x.detach().to(target, copy=True)
            return moved.requires_grad_(x.requires_grad) if x.is_leaf else moved
        if isinstance(x, torch.device) and x.type == DEVICE:
            return torch.device(device)
        if isinstance(x, str) and x.split(":")[0] == DEVICE:
            return device
        return x
    return tree_map(move, value)


def _to_cpu(value):
    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, value)


def _samples(op, dtype, requires_grad):
    torch.manual_seed(0)
    samples = op.sample_inputs(DEVICE, dtype, requires_grad=requires_grad)
    for i, sample in enumerate(samples):
        if SAMPLES is not None and i >= SAMPLES:
            return
        yield sample


def _run(op, sample, device: str, seed: int = 0, reshape=None, out=None):
    """Runs one sample on `device` ("cpu" or acme) from fresh copies; returns (inputs, output).

    `reshape` changes each copied tensor on its device (a copy made by `.to()`
    is contiguous again, so non-contiguous inputs are made after the copy);
    `out` is passed as the op's out= argument.
    """
    inputs = SampleInput(_copy(sample.input, device), args=_copy(sample.args, device),
                         kwargs=_copy(sample.kwargs, device),
                         output_process_fn_grad=sample.output_process_fn_grad,
                         broadcasts_input=sample.broadcasts_input, name=sample.name)
    if reshape is not None:
        inputs = _map_tensors(inputs, reshape)
    kwargs = inputs.kwargs if out is None else {**inputs.kwargs, "out": out}
    _manual_seed(seed)
    return inputs, op(inputs.input, *inputs.args, **kwargs)


def _differs(test, actual, expected, what: str, reference=None) -> Exception:
    """The failure for `actual` != `expected`: Close within the cross-device
    tolerance, else Mismatch. `what` says which sample and how they differ.

    `reference`, for half and bfloat16 only, makes the result in float64 on the
    CPU: PyTorch compares devices in one dtype (test_compare_cpu runs float32),
    and in 8 bits of mantissa two summation orders differ by far more than
    1e-3. There acme's result is Close when it is no farther from float64's
    than the CPU's is: a different rounding, not a worse one."""
    try:
        TestCase.assertEqual(test, actual, expected, **CROSS_DEVICE_TOL)
    except AssertionError:
        if reference is None or not _same_exact_parts(actual, expected):
            return Mismatch(what)
        try:
            exact = reference()
        except Exception:  # the op has no float64 form: nothing to measure against
            return Mismatch(what)
        ours, theirs = _distance(actual, exact), _distance(expected, exact)
        if ours <= theirs:
            return Close(f"no farther from float64 than the CPU ({ours:.3g} against {theirs:.3g}): {what}")
        return Mismatch(f"farther from float64 than the CPU ({ours:.3g} against {theirs:.3g}): {what}")
    return Close(what)


LOW_PRECISION = (torch.float16, torch.bfloat16)


def _in_float64(sample):
    """The sample with its half and bfloat16 tensors in float64."""
    def widen(t):
        if t.dtype not in LOW_PRECISION:
            return t
        return t.detach().double().requires_grad_(t.requires_grad)
    return _map_tensors(sample, widen)


def _inexact(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _same_exact_parts(actual, expected) -> bool:
    """Whether two results agree on everything but their floating-point tensors
    (indices, counts, flags): those must match exactly."""
    pairs = zip(tree_flatten(actual)[0], tree_flatten(expected)[0])
    return all(_inexact(a) or (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
               for a, b in pairs)


def _as_real64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().resolve_conj()
    return (torch.view_as_real(t) if t.is_complex() else t).double()


def _distance(values, exact) -> float:
    """The largest difference between two results' floating-point tensors, in
    float64 (inf when they disagree about which elements are finite)."""
    worst = 0.0
    for a, b in zip(tree_flatten(values)[0], tree_flatten(exact)[0]):
        if not (_inexact(a) and _inexact(b)):
            continue
        a, b = _as_real64(a), _as_real64(b)
        if a.shape != b.shape:
            return math.inf
        if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
            return math.inf
        finite = torch.isfinite(b)
        if finite.any():
            worst = max(worst, (a[finite] - b[finite]).abs().max().item())
    return worst


def _device_error(error: Exception, sample, what: str = "") -> DeviceError:
    return DeviceError(f"{type(error).__name__}: {_first(error)} ({what}the CPU ran {_describe(sample)})")


def _arguments(sample):
    """The sample's tensors after a run (what the op may have written)."""
    return [x for x in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
            if isinstance(x, torch.Tensor)]


def _describe(sample) -> str:
    text = sample.summary().replace(f'device="{DEVICE}:0"', "").replace('device="cpu"', "")
    return text if len(text) < 400 else text[:400] + "…"


def _floats(value) -> torch.Tensor:
    """Every number in an output, as one float64 vector (for distributions)."""
    leaves = [x for x in tree_flatten(_to_cpu(value))[0] if isinstance(x, (torch.Tensor, int, float))]
    parts = [torch.as_tensor(x).reshape(-1) for x in leaves]
    parts = [torch.view_as_real(p.resolve_conj()).reshape(-1) if p.is_complex() else p for p in parts]
    return torch.cat([p.to(torch.float64) for p in parts]) if parts else torch.zeros(0, dtype=torch.float64)


def _same_distribution(acme: torch.Tensor, cpu: torch.Tensor) -> str | None:
    """None when two pooled samples plausibly share a distribution, else why not.

    A two-sample Kolmogorov-Smirnov test: it needs no mean or variance (Cauchy
    has neither). Values within one draw can be correlated (dropout3d zeroes
    whole channels), so the sample size counted is the number of draws, not of
    values: a loose test, but an independent one, and with fixed seeds it is
    deterministic. A wrong probability or range is still far outside it.
    """
    acme, cpu = acme[torch.isfinite(acme)], cpu[torch.isfinite(cpu)]
    if acme.numel() == 0 or cpu.numel() == 0:
        return None if acme.numel() == cpu.numel() else "only one device gave finite values"
    a, c = acme.sort().values, cpu.sort().values
    points = torch.cat([a, c])
    f_a = torch.searchsorted(a, points, right=True) / a.numel()
    f_c = torch.searchsorted(c, points, right=True) / c.numel()
    d = (f_a - f_c).abs().max().item()
    critical = 1.95 * math.sqrt(2 / RANDOM_DRAWS)  # alpha = 0.001
    if d > critical:
        return (f"Kolmogorov-Smirnov D = {d:.3f} > {critical:.3f}; medians {a.median().item():.4g} "
                f"on {DEVICE}, {c.median().item():.4g} on the CPU")
    return None


# ---- the edge sweeps: what PyTorch's device-generic tests reach and OpInfo samples do not ----

def _form(inputs, out):
    """What a result is besides its values: the container types (a named tuple such as
    torch.return_types.frexp is not a plain tuple), and which input each output
    tensor shares memory with (a view, or the input itself), by position."""
    leaves, spec = tree_flatten(out)
    ins = [x for x in tree_flatten((inputs.input, inputs.args, inputs.kwargs))[0]
           if isinstance(x, torch.Tensor) and x.untyped_storage().nbytes()]

    def alias(t):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or not t.untyped_storage().nbytes():
            return None
        ptr = t.untyped_storage().data_ptr()
        return next((i for i, x in enumerate(ins) if x.untyped_storage().data_ptr() == ptr), None)

    return str(spec), type(out).__name__, [alias(t) for t in leaves]


def _check_form(cpu_in, cpu_out, acme_in, acme_out, sample):
    cpu, acme = _form(cpu_in, cpu_out), _form(acme_in, acme_out)
    if cpu[:2] != acme[:2]:
        raise Mismatch(f"the result's structure differs: {acme[1]} on {DEVICE}, {cpu[1]} on the CPU: "
                       f"{_describe(sample)}")
    if cpu[2] != acme[2]:
        raise Mismatch(f"outputs alias inputs differently (input index per output: {acme[2]} on "
                       f"{DEVICE}, {cpu[2]} on the CPU): {_describe(sample)}")


def _same_strides(a: torch.Tensor, c: torch.Tensor) -> bool:
    """Strides agree where they mean something: a dimension of size 1 has any
    stride, and a tensor with no elements any strides."""
    if a.shape != c.shape:
        return False
    return c.numel() == 0 or all(sa == sc for n, sa, sc in zip(c.shape, a.stride(), c.stride()) if n > 1)


def _check_strides(cpu_out, acme_out, where: str, only=lambda t: True) -> None:
    """Every strided output tensor (those `only` picks) strided as on the CPU."""
    for a, c in zip(tree_flatten(acme_out)[0], tree_flatten(cpu_out)[0]):
        if (isinstance(c, torch.Tensor) and c.layout == torch.strided and only(c)
                and not _same_strides(a, c)):
            raise Mismatch(f"output strides {a.stride()} on {DEVICE}, {c.stride()} on the CPU {where}")


def _map_tensors(sample, fn):
    """The sample with `fn` applied to each tensor argument (input, args, kwargs)."""
    def each(x):
        return fn(x) if isinstance(x, torch.Tensor) else x
    return SampleInput(tree_map(each, sample.input), args=tree_map(each, sample.args),
                       kwargs=tree_map(each, sample.kwargs),
                       output_process_fn_grad=sample.output_process_fn_grad, name=sample.name)


def _extremal(x: torch.Tensor) -> torch.Tensor:
    """A copy with inf, -inf and nan (and for complex, their mixtures) in its first elements."""
    if not (x.is_floating_point() or x.is_complex()) or x.numel() == 0 or x.layout != torch.strided:
        return x
    inf, nan = float("inf"), float("nan")
    values = ([complex(inf, nan), complex(-inf, 1), complex(nan, inf), complex(1, -inf), complex(inf, inf)]
              if x.is_complex() else [inf, -inf, nan])
    out = x.detach().clone()
    flat = out.view(-1) if out.is_contiguous() else None
    if flat is None:
        return x
    for i, v in enumerate(values[:flat.numel()]):
        flat[i] = v
    return out.requires_grad_(x.requires_grad)


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    form = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    if x.layout != torch.strided:
        return x
    return x.contiguous(memory_format=form).requires_grad_(x.requires_grad) if form else x


def _noncontiguous(x: torch.Tensor) -> torch.Tensor:
    """PyTorch's own helper (every other element of a buffer twice the size)."""
    return noncontiguous_like(x) if x.layout == torch.strided and x.numel() > 1 else x


# out= tensors made for a result tensor `t`: the shape an op resizes an empty
# output from silently, and a wrong one it resizes with a warning.
OUT_CASES = {
    "of the result's shape": lambda t: t.shape,
    "empty": lambda t: (0,),
    "of a wrong shape": lambda t: (t.numel() + 1,),
}


def _results(value) -> list:
    """An op's result as a list: a tensor, or the members of a tuple."""
    return [value] if isinstance(value, torch.Tensor) else list(value) if isinstance(value, tuple) else [None]


def _out_shapes(expected) -> bool:
    """Whether a result can be asked for through out=: a tensor or a tuple of strided tensors."""
    leaves = _results(expected)
    return bool(leaves) and all(isinstance(t, torch.Tensor) and t.layout == torch.strided for t in leaves)


def _out_run(op, sample, device, expected, shape) -> dict:
    """One run with out= tensors shaped by `shape`: what was raised, returned and warned."""
    single = isinstance(expected, torch.Tensor)
    made = [torch.empty(shape(t), dtype=t.dtype, device=device) for t in _results(expected)]
    out = made[0] if single else tuple(made)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _, returned = _run(op, sample, device, out=out)
        except Exception as e:
            return {"raised": type(e).__name__}
    back = _results(returned)
    return {"raised": None, "out": _to_cpu(out),
            "returned": len(back) == len(made) and all(b is m for b, m in zip(back, made)),
            "resized_warning": any("resized" in str(w.message) for w in caught)}


def _raised(op, sample, device) -> Exception | None:
    try:
        _run(op, sample, device)
    except Exception as e:
        return e
    return None


def _first(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else ""


def _emptied(x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.dim() == 0 or x.layout != torch.strided:
        return x
    shape = list(x.shape)
    shape[dim] = 0
    return x.new_empty(shape).requires_grad_(x.requires_grad)


def _outcome(op, sample, device, reshape=None):
    """("ok", output) or ("raised", exception type name) for one run."""
    try:
        return "ok", _run(op, sample, device, reshape=reshape)[1]
    except Exception as e:
        return "raised", type(e).__name__


def _tensor_args(sample):
    return [x for x in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
            if isinstance(x, torch.Tensor)]


class _SeededOps(TorchDispatchMode):
    """Notes whether any ATen op that draws random numbers ran."""

    seeded = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seeded |= torch.Tag.nondeterministic_seeded in func.tags
        return func(*args, **(kwargs or {}))


class TestConformance(TestCase):
    """Every OpInfo op and every ModuleInfo module, on acme, against the CPU."""

    # An op is random when its CPU run calls an ATen op tagged
    # nondeterministic_seeded (one that draws from a generator): PyTorch's own
    # mark, so no list of random ops is kept here. Such an op is compared by
    # reproducibility on acme and by distribution against the CPU.
    def _is_random(self, op, sample, reshape=None):
        with _SeededOps() as seen:
            _run(op, sample, "cpu", reshape=reshape)
        return seen.seeded

    def _compare_random(self, op, sample, acme_out):
        _, again = _run(op, sample, DEVICE, seed=0)
        try:
            self.assertEqual(_to_cpu(again), _to_cpu(acme_out))
        except AssertionError as e:
            raise Mismatch(f"a random op gave two results for one seed on {DEVICE}: "
                           f"{_describe(sample)}\n{e}") from None
        pooled = {}
        # Many random OpInfos seed themselves (wrapper_set_seed calls
        # torch.manual_seed(42)), so every draw would be the same draw: the
        # op's own call is silenced here and each draw gets its own seed.
        with unittest.mock.patch.object(torch, "manual_seed", lambda seed: None):
            for device in (DEVICE, "cpu"):
                draws = [_floats(_run(op, sample, device, seed=100 + i)[1]) for i in range(RANDOM_DRAWS)]
                pooled[device] = torch.cat(draws)
        why = _same_distribution(pooled[DEVICE], pooled["cpu"])
        if why:
            raise Mismatch(f"a random op's distribution differs ({why}): {_describe(sample)}")

    def _check_uninitialised(self, cpu_out, acme_out, sample):
        # On acme, unless the sample asks for the CPU (empty_like(x, device="cpu")).
        wanted = "cpu" if str(sample.kwargs.get("device", "")).startswith("cpu") else DEVICE
        for a, c in zip(tree_flatten(acme_out)[0], tree_flatten(cpu_out)[0]):
            if isinstance(c, torch.Tensor):
                same = (a.device.type == wanted and a.shape == c.shape and a.dtype == c.dtype
                        and a.stride() == c.stride())
                if not same:
                    raise Mismatch(f"uninitialised output differs: {a.shape} {a.dtype} {a.stride()} "
                                   f"on {a.device}, {c.shape} {c.dtype} {c.stride()} on the CPU: "
                                   f"{_describe(sample)}")

    @ops(op_db, dtypes=OpDTypes.supported, allowed_dtypes=DTYPES)
    def test_forward(self, device, dtype, op):
        ran = cpu_failures = 0
        for sample in _samples(op, dtype, requires_grad=False):
            try:
                cpu_in, cpu_out = _run(op, sample, "cpu")
            except Exception:
                cpu_failures += 1
                continue
            try:
                acme_in, acme_out = _run(op, sample, device)
            except Exception as e:
                raise _device_error(e, sample) from e
            ran += 1
            if op.name in UNINITIALISED:
                self._check_uninitialised(cpu_out, acme_out, sample)
                continue
            _check_form(cpu_in, cpu_out, acme_in, acme_out, sample)
            try:
                # The inputs too: an op that writes to an argument must write the same on both.
                self.assertEqual(_to_cpu((acme_out, _arguments(acme_in))), (cpu_out, _arguments(cpu_in)))
            except AssertionError as e:
                if self._is_random(op, sample):
                    self._compare_random(op, sample, acme_out)
                    continue
                exact = (lambda: _run(op, _in_float64(sample), "cpu")[1]) if dtype in LOW_PRECISION else None
                raise _differs(self, _to_cpu(acme_out), cpu_out, f"{_describe(sample)}\n{e}", exact) from None
        if not ran:
            raise unittest.SkipTest(f"the CPU raised on all {cpu_failures} samples" if cpu_failures
                                    else "the CPU has no samples for this dtype")

    @ops(op_db, dtypes=OpDTypes.supported_backward, allowed_dtypes=DTYPES)
    def test_backward(self, device, dtype, op):
        if not op.supports_autograd:
            raise unittest.SkipTest("the op has no derivative")
        ran = 0
        for sample in _samples(op, dtype, requires_grad=True):
            try:
                cpu_grads, cotangents = self._grads(op, sample, "cpu", None)
            except Exception:
                continue
            if cpu_grads is None:
                continue
            try:
                acme_grads, _ = self._grads(op, sample, device, cotangents)
            except Exception as e:
                raise _device_error(e, sample, "backward; ") from e
            ran += 1
            try:
                self.assertEqual(_to_cpu(acme_grads), cpu_grads)
            except AssertionError as e:
                if self._is_random(op, sample):
                    again, _ = self._grads(op, sample, device, cotangents)
                    try:
                        self.assertEqual(_to_cpu(again), _to_cpu(acme_grads))
                    except AssertionError as e2:
                        raise Mismatch(f"a random op's gradients differ between two runs with one "
                                       f"seed on {DEVICE}: {_describe(sample)}\n{e2}") from None
                    continue
                exact = None
                if dtype in LOW_PRECISION:
                    wide = [c.double() for c in cotangents]
                    exact = lambda: self._grads(op, _in_float64(sample), "cpu", wide)[0]  # noqa: E731
                raise _differs(self, _to_cpu(acme_grads), cpu_grads,
                               f"gradients: {_describe(sample)}\n{e}", exact) from None
        if not ran:
            raise unittest.SkipTest("the CPU has no differentiable samples for this dtype")

    def _grads(self, op, sample, device, cotangents):
        """Gradients of the op's outputs (weighted by `cotangents`) for the sample's leaves."""
        inputs, out = _run(op, sample, device)
        out = sample.output_process_fn_grad(out)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        leaves = [t for t in tree_flatten((inputs.input, inputs.args, inputs.kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs or not leaves:
            return None, None
        if cotangents is None:
            gen = torch.Generator().manual_seed(0)
            cotangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
        grads = torch.autograd.grad(outs, leaves, [c.to(device) for c in cotangents], allow_unused=True)
        return grads, cotangents

    # The edge sweeps. Each compares acme with the CPU on inputs OpInfo samples
    # rarely hold, the classes PyTorch's device-generic tests found differences in.

    def _compare_outcomes(self, op, sample, what, uninitialised=False, reshape=None):
        """Runs the sample on both; None when the CPU raised (and acme did too),
        else the two outputs (CPU, acme), once their values have been compared."""
        cpu = _outcome(op, sample, "cpu", reshape)
        acme = _outcome(op, sample, DEVICE, reshape)
        if cpu[0] == "raised":
            if acme[0] == "ok":
                raise Mismatch(f"{what}: the CPU raised {cpu[1]}, {DEVICE} returned a result: "
                               f"{_describe(sample)}")
            return None
        if acme[0] == "raised":
            raise DeviceError(f"{what}: {DEVICE} raised {acme[1]} (the CPU ran {_describe(sample)})")
        if uninitialised or op.name in UNINITIALISED:
            self._check_uninitialised(cpu[1], acme[1], sample)
        else:
            try:
                self.assertEqual(_to_cpu(acme[1]), _to_cpu(cpu[1]), exact_device=False)
            except AssertionError as e:
                if not self._is_random(op, sample, reshape):
                    raise _differs(self, _to_cpu(acme[1]), _to_cpu(cpu[1]),
                                   f"{what}: {_describe(sample)}\n{e}") from None
        return cpu[1], acme[1]

    @ops(op_db, dtypes=OpDTypes.supported, allowed_dtypes=(torch.float32, torch.complex64))
    def test_extremal(self, device, dtype, op):
        """inf, -inf and nan in every floating input (complex: in either part)."""
        if op.name in CPU_CRASHES_ON_NONFINITE:
            raise unittest.SkipTest("the CPU's LAPACK crashes the process on non-finite input")
        ran = 0
        for sample in _samples(op, dtype, requires_grad=False):
            if not any(t.is_floating_point() or t.is_complex() for t in _tensor_args(sample)):
                continue
            ran += self._compare_outcomes(op, _map_tensors(sample, _extremal), "extremal values") is not None
        if not ran:
            raise unittest.SkipTest("the CPU raised on every extremal sample, or none has a float input")

    @ops(op_db, dtypes=OpDTypes.supported, allowed_dtypes=(torch.float32,))
    def test_empty(self, device, dtype, op):
        """Each single-tensor sample with its first, then its last, dimension emptied
        (a reduction over an empty dimension gives its identity, or an error)."""
        ran = 0
        for sample in _samples(op, dtype, requires_grad=False):
            if len(_tensor_args(sample)) != 1 or not isinstance(sample.input, torch.Tensor):
                continue
            for dim in sorted({0, -1} if sample.input.dim() > 1 else {0}):
                emptied = _map_tensors(sample, lambda x: _emptied(x, dim))
                ran += self._compare_outcomes(op, emptied, f"dimension {dim} emptied",
                                              uninitialised=op.name in GROWS) is not None
        if not ran:
            raise unittest.SkipTest("the CPU raised on every emptied sample, or none has one tensor")

    @ops(op_db, dtypes=OpDTypes.supported, allowed_dtypes=(torch.float32,))
    def test_layout(self, device, dtype, op):
        """4-D and 5-D inputs channels-last: the values, and the outputs' memory format, as the CPU's."""
        ran = 0
        for sample in _samples(op, dtype, requires_grad=False):
            if not any(t.dim() in (4, 5) for t in _tensor_args(sample)):
                continue
            sample = _map_tensors(sample, _channels_last)
            outputs = self._compare_outcomes(op, sample, "channels-last inputs")
            if outputs is None:
                continue
            ran += 1
            if op.name in UNINITIALISED or self._is_random(op, sample):
                continue
            _check_strides(*outputs, f"for channels-last inputs: {_describe(sample)}")
        if not ran:
            raise unittest.SkipTest("no sample has a 4-D or 5-D input the CPU runs")

    @ops(op_db, dtypes=OpDTypes.supported, allowed_dtypes=(torch.float32,))
    def test_noncontiguous(self, device, dtype, op):
        """Every tensor argument non-contiguous (every other element of a larger buffer,
        made on its device): the values, and the outputs' strides, as the CPU's."""
        ran = 0
        for sample in _samples(op, dtype, requires_grad=False):
            if not any(t.numel() > 1 and t.layout == torch.strided for t in _tensor_args(sample)):
                continue
            outputs = self._compare_outcomes(op, sample, "non-contiguous inputs", reshape=_noncontiguous)
            if outputs is None:
                continue
            ran += 1
            if op.name in UNINITIALISED or self._is_random(op, sample, _noncontiguous):
                continue
            _check_strides(*outputs, f"for non-contiguous inputs: {_describe(sample)}")
        if not ran:
            raise unittest.SkipTest("no sample has a tensor of two or more elements the CPU runs")

    @ops([op for op in op_db if op.supports_out], dtypes=OpDTypes.supported,
         allowed_dtypes=(torch.float32,))
    def test_out(self, device, dtype, op):
        """out=: an output of the result's shape, an empty one and one of a wrong shape.
        On acme as on the CPU: written, returned (the same tensor), strided and resized
        alike, with the CPU's warning when an output with elements is resized."""
        ran = 0
        for sample in _samples(op, dtype, requires_grad=False):
            try:
                _, expected = _run(op, sample, "cpu")
            except Exception:
                continue
            if not _out_shapes(expected):
                continue
            for case, shape in OUT_CASES.items():
                cpu = _out_run(op, sample, "cpu", expected, shape)
                acme = _out_run(op, sample, device, expected, shape)
                where = f"out= {case}: {_describe(sample)}"
                if cpu["raised"]:
                    if not acme["raised"]:
                        raise Mismatch(f"the CPU raised {cpu['raised']}, {DEVICE} wrote the output; {where}")
                    continue
                if acme["raised"]:
                    raise DeviceError(f"{acme['raised']} ({where})")
                ran += 1
                for key, what in (("returned", "the op returned its out= tensor"),
                                  ("resized_warning", "the resize warning")):
                    if acme[key] != cpu[key]:
                        raise Mismatch(f"{what}: {acme[key]} on {DEVICE}, {cpu[key]} on the CPU; {where}")
                _check_strides(cpu["out"], acme["out"], f"in out= ({where})")
                if op.name in UNINITIALISED or self._is_random(op, sample):
                    continue
                # An output the CPU left at another shape than the result's is one the op
                # does not write (native_batch_norm's saved statistics in eval mode): its
                # memory is uninitialised on both devices.
                outs = [(a, c) for a, c, r in zip(_results(acme["out"]), _results(cpu["out"]),
                                                  _results(expected)) if c.shape == r.shape]
                try:
                    self.assertEqual([a for a, _ in outs], [c for _, c in outs])
                except AssertionError as e:
                    raise _differs(self, [a for a, _ in outs], [c for _, c in outs], f"{where}\n{e}") from None
        if not ran:
            raise unittest.SkipTest("the CPU raised on every out= sample, or none returns only tensors")

    @ops([op for op in op_db if op.error_inputs_func is not None], dtypes=OpDTypes.none)
    def test_errors(self, device, op):
        """OpInfo's error inputs: where the CPU raises, acme raises too, at the call, the
        exception the OpInfo declares for this device (its type and message), or the CPU's."""
        ran = 0
        for error_input in op.error_inputs(device):
            sample, pattern = error_input.sample_input, error_input.error_regex
            cpu = _raised(op, sample, "cpu")
            if cpu is None:
                continue  # an error input for another device (or the CPU's gap)
            where = f"{_describe(sample)}; the CPU raised {type(cpu).__name__}: {_first(cpu)}"
            try:
                _run(op, sample, device)
            except Exception as e:
                acme = e
            else:
                try:
                    getattr(torch, DEVICE).synchronize()
                except Exception as e:
                    raise DeviceError(f"raised only at the next synchronize, {type(e).__name__}: "
                                      f"{_first(e)} ({where})") from None
                raise Mismatch(f"{DEVICE} returned a result where {where}")
            ran += 1
            # The OpInfo's own contract for this device (what CUDA is held to), or the CPU's.
            declared = isinstance(acme, error_input.error_type) and re.search(pattern, str(acme))
            as_cpu = isinstance(acme, type(cpu)) and (re.search(pattern, str(acme))
                                                      or not re.search(pattern, str(cpu)))
            if not (declared or as_cpu):
                raise DeviceError(f"{type(acme).__name__}: {_first(acme)}, where the OpInfo expects "
                                  f"{error_input.error_type.__name__} matching {pattern!r} ({where})")
        if not ran:
            raise unittest.SkipTest("no error input raises on the CPU")

    @ops([op for op in op_db if op.supports_gradgrad], dtypes=OpDTypes.supported_backward,
         allowed_dtypes=(torch.float64, torch.complex128))
    def test_gradgrad(self, device, dtype, op):
        """Second derivatives: the gradient of (gradient · v) with respect to the inputs."""
        if not op.supports_autograd:
            raise unittest.SkipTest("the op has no derivative")
        ran = linear = 0
        refused = GRADGRAD_REFUSED.get(op.name, lambda sample: False)
        for sample in _samples(op, dtype, requires_grad=True):
            if refused(sample):
                continue
            try:
                cpu = self._gradgrads(op, sample, "cpu")
            except Exception:
                continue
            if cpu is None:
                linear += 1
                continue
            try:
                acme = self._gradgrads(op, sample, device)
            except Exception as e:
                raise _device_error(e, sample, "second derivative; ") from e
            ran += 1
            try:
                self.assertEqual(_to_cpu(acme), cpu)
            except AssertionError as e:
                if self._is_random(op, sample):
                    continue
                raise _differs(self, _to_cpu(acme), cpu, f"second derivative: {_describe(sample)}\n{e}"
                               ) from None
        if not ran and linear:
            raise unittest.SkipTest("the gradient does not depend on the inputs (a linear op): "
                                    "no second derivative to compare")
        if not ran:
            raise unittest.SkipTest("the CPU has no twice-differentiable samples for this dtype")

    def _gradgrads(self, op, sample, device):
        inputs, out = _run(op, sample, device)
        out = sample.output_process_fn_grad(out)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        leaves = [t for t in tree_flatten((inputs.input, inputs.args, inputs.kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs or not leaves:
            return None
        gen = torch.Generator().manual_seed(0)
        cots = [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(device) for o in outs]
        grads = torch.autograd.grad(outs, leaves, cots, create_graph=True, allow_unused=True)
        used = [(g, x) for g, x in zip(grads, leaves) if g is not None and g.requires_grad]
        if not used:
            return None
        vs = [torch.randn(g.shape, generator=gen, dtype=g.dtype).to(device) for g, _ in used]
        total = sum((g * v).sum() for (g, _), v in zip(used, vs))
        if total.is_complex():
            total = total.real
        return torch.autograd.grad(total, leaves, allow_unused=True)

    @modules(module_db, allowed_dtypes=MODULE_DTYPES)
    def test_module(self, device, dtype, module_info, training):
        module_cls = module_info.module_cls
        torch.manual_seed(0)
        inputs = module_info.module_inputs_func(module_info, device=device, dtype=dtype,
                                                requires_grad=True, training=training)
        ran = 0
        for module_input in inputs[:SAMPLES]:
            if module_input.forward_input is None:
                continue
            for channels_last in (False, True):
                if channels_last and not _has_channels_last_input(module_input):
                    continue
                try:
                    cpu = _module_run(module_cls, module_input, "cpu", dtype, training, channels_last)
                except Exception:
                    continue
                try:
                    acme = _module_run(module_cls, module_input, device, dtype, training, channels_last)
                except Exception as e:
                    raise DeviceError(f"{type(e).__name__}: {_first(e)} "
                                      f"({module_input.desc or 'default'}, channels_last={channels_last})"
                                      ) from e
                ran += 1
                where = f"{module_input.desc or 'default input'}, channels_last={channels_last}"
                # The memory format too (group norm's output, channels-last in): strides as the CPU's.
                _check_strides(cpu[0], acme[0], f"({where})",
                               only=lambda t: t.dim() in (4, 5) and t.numel() > 1)
                try:
                    self.assertEqual(_to_cpu(acme), cpu)
                except AssertionError as e:
                    again = _module_run(module_cls, module_input, device, dtype, training, channels_last)
                    other = _module_run(module_cls, module_input, "cpu", dtype, training, channels_last, seed=1)
                    try:
                        TestCase.assertEqual(self, other, cpu)
                    except AssertionError:  # random (dropout, RReLU): reproducible on acme?
                        try:
                            self.assertEqual(_to_cpu(again), _to_cpu(acme))
                            continue
                        except AssertionError as e2:
                            raise Mismatch(f"a random module gave two results for one seed: {where}\n{e2}"
                                           ) from None
                    raise _differs(self, _to_cpu(acme), cpu, f"{where}\n{e}") from None
        if not ran:
            raise unittest.SkipTest("the CPU raised on every input")


def _has_channels_last_input(module_input) -> bool:
    args = tree_flatten((module_input.forward_input.args, module_input.forward_input.kwargs))[0]
    return any(isinstance(a, torch.Tensor) and a.dim() in (4, 5) for a in args)


def _module_run(module_cls, module_input, device, dtype, training, channels_last, seed=0):
    """Builds the module (same seed, so same parameters), runs forward and backward on `device`.

    Returns the outputs, the inputs' gradients and the parameters' gradients.
    The parameters always come from seed 0; `seed` seeds the forward pass only,
    so two seeds differ only where the module itself draws random numbers.
    """
    torch.manual_seed(0)
    c_args, c_kwargs = (module_input.constructor_input.args, module_input.constructor_input.kwargs)
    # Built on the CPU for both runs, then moved: a constructor given device="acme"
    # would draw its initial parameters from acme's generator, not the CPU's.
    module = module_cls(*_copy(c_args, "cpu"), **_copy(c_kwargs, "cpu")).to(dtype)
    module = module.to(device)
    module.train(training)
    args = _copy(module_input.forward_input.args, device)
    kwargs = _copy(module_input.forward_input.kwargs, device)
    if channels_last:
        module = module.to(memory_format=torch.channels_last)

        def fmt(x):
            if isinstance(x, torch.Tensor) and x.dim() in (4, 5):
                form = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
                moved = x.detach().to(memory_format=form)
                return moved.requires_grad_(x.requires_grad)
            return x
        args, kwargs = tree_map(fmt, args), tree_map(fmt, kwargs)
    torch.manual_seed(seed)
    out = module(*args, **kwargs)
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    params = [p for p in module.parameters() if p.requires_grad]
    grads = ()
    if outs and (leaves or params):
        gen = torch.Generator().manual_seed(0)
        cotangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(device) for o in outs]
        grads = torch.autograd.grad(outs, leaves + params, cotangents, allow_unused=True)
    buffers = [b for b in module.buffers()]
    return _to_cpu((out, grads, buffers))


# acme's known gaps, each with its reason, are a table in
# tools/conformance_overrides.py (the conformance page prints it too).
#
# linear_cross_entropy's chunked path picks its accumulation per (device type,
# dtype): for half and bfloat16 the CPU accumulates in float32 and keeps more
# intermediates in it ("accurate"); CUDA, and acme as CUDA
# (src/torch_acme/mixed_precision.py), accumulate in float32 but keep the rest
# in the input's dtype ("compact"). The float16 cases differ from the CPU by
# that choice, as CUDA's do; a user who wants the CPU's numbers passes
# LinearCrossEntropyOptions(acc_policy="accurate").
def _decorate(row: Override) -> DecorateInfo:
    decorator = unittest.skip(row.reason) if row.kind == "skip" else unittest.expectedFailure
    dtypes = None if row.dtypes is None else tuple(getattr(torch, name) for name in row.dtypes)
    return DecorateInfo(decorator, "TestConformance", row.test, dtypes=dtypes)


ACME_OVERRIDES: dict[str, list[DecorateInfo]] = {}
_RELEASE = torch.__version__.split("+")[0]
for _row in OVERRIDES:
    if _row.releases is None or _RELEASE in _row.releases:
        ACME_OVERRIDES.setdefault(_row.op, []).append(_decorate(_row))

PrivateUse1TestBase.set_test_configs(op_overrides=ACME_OVERRIDES)
instantiate_device_type_tests(TestConformance, globals(), only_for="privateuse1")
