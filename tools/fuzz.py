"""Differential fuzzing: random programs of tensor ops, run on acme and on the CPU, compared.

A program is a list of Python statements over variables v0, v1, ...: tensor
creation (floating, integer, bool and complex dtypes), views (slices,
transposes, permutes, expands, dtype views, lazy conjugates...),
in-place ops (often through a view, so the base must see the write),
element-wise ops, reductions, matrix products, dtype conversions, copies
between acme:0, acme:1 and the host, and (in one program in five) a backward
pass. The same text runs twice, with the device names D0, D1 and HOST bound
to ("acme:0", "acme:1", "cpu") and then to ("cpu", "cpu", "cpu"); afterwards
every variable must agree between the two runs: same dtype, shape, strides,
storage offset, device (acme:0 / acme:1 / cpu as the program placed it),
which variables share storage, which statements raised (and the exception
type), and the values, as follows.

Exact (bit for bit, NaN equal to NaN): creation, views, copies, conversions,
indexing, element-wise arithmetic (IEEE +, -, *, / and sqrt are correctly
rounded, so any correct kernel gives the same bits), comparisons, min/max and
arg-min/max, integer reductions, and everything computed from exact values.

Within a documented bound (the result is then *terminal*: compared, never an
operand, because a later exact op would amplify an allowed difference):

- sum, mean, cumsum and matrix products of floating-point values. A kernel may
  add in another order; the forward error of a sum of n terms is at most
  n * eps * sum|terms| (Higham, "Accuracy and Stability of Numerical
  Algorithms", 4.2), so the bound is n * eps_acc * (the same op on |inputs|),
  computed in float64 on the CPU run. eps_acc is float32's eps for float16 and
  bfloat16 inputs (PyTorch accumulates them in float32), the input's own eps
  otherwise; n is the number of terms (the reduced size, or the inner
  dimension of a product). Mean divides the bound by n.
- prod: n * eps_acc * prod|x| (each multiplication rounds once).
- norm (2-norm): (n + 2) * eps_acc * |result| (squares and sum are positive;
  the square root halves the relative error and rounds once).
- softmax: (n + 4) * eps_acc * |result| (n exponentials of about an ulp each,
  a sum of n positive terms, a division); log_softmax: (n + 4) * eps_acc *
  (1 + |result|), the same error on the log of the sum, which is absolute.
- addmm: the matrix product's bound plus eps_acc * (|bias| + |a| @ |b|), for
  the one more rounding of the sum.
- exp, log, sin, tanh, sigmoid, pow(x, 1.5): 4 ulp of the result. PyTorch's CPU
  kernels use SLEEF's vector code (1 ulp) for full vectors and libm for the
  tail, so even two correct kernels may differ by an ulp or two.
- gradients of backward passes: 256 * eps * max|gradient| per tensor. A
  gradient is a sum of contributions (several uses of a variable, the
  sum-to-size of a broadcast), in an order a backend may choose.
- Every bounded result may also differ by its own final rounding, 2 * eps of
  its dtype relative to the CPU's value (float16/bfloat16 results round a
  float32 value that may itself differ slightly).

Every program must also give its device memory back: the bytes and blocks in
use on each device are the same after it (its variables deleted) as before.

Some programs are never generated, because PyTorch itself leaves their outcome
undefined or different by device (each exclusion is explained in the code):
in-place writes into expanded tensors, in-place ops whose operand partially
overlaps the destination, floats written into integer tensors out of range,
setitem from a 0-dim CPU tensor, moves between "devices" without copy=True
(the CPU run would alias), and, in autograd programs, in-place changes to a
tensor some op may have saved for backward (upstream PyTorch leaks those in a
reference cycle, on the CPU too). And some differences are representation,
not results: the stride of a dimension of size 1, the lazy conjugate bit, the
sign of a zero part of a complex number (PyTorch's own CPU kernels disagree
on it), requires_grad of non-float tensors, and the gradients left behind by
a backward pass that raised.

Known issues (KNOWN_ISSUES): divergences this fuzzer found in acme, reported
and left out of the programs until fixed; --include-known puts them back.

Programs are seeded: program i of seed s is the same on every machine, so a
mismatch is reproduced with ``--seed s --program i``. On a mismatch the
program is shrunk (statements are dropped while the mismatch stays) and
printed as a standalone script.

Usage:
    python tools/fuzz.py --programs 10000 [--seed 0]     # run, report mismatches
    python tools/fuzz.py --seed 0 --program 123 --show    # print one program
    python tools/fuzz.py --seed 0 --program 123           # run one program
The package comes from the last stage of ACME_BUILD_DIR (default _build), or
from PYTHONPATH if torch_acme is importable already.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# ---- the program's vocabulary ----

FLOATS = ["float32", "float64", "float16", "bfloat16"]
INTS = ["int64", "int32", "int16", "int8", "uint8"]
COMPLEX = ["complex64", "complex128"]
DTYPES = FLOATS * 3 + INTS + ["bool"] + COMPLEX  # floats most often
SAME_SIZE = {"float32": ["int32"], "int32": ["float32"], "float64": ["int64"],
             "int64": ["float64"], "float16": ["int16", "bfloat16"], "bfloat16": ["float16", "int16"],
             "int16": ["float16", "bfloat16"], "int8": ["uint8"], "uint8": ["int8"]}
INTEGER = set(INTS)

# Divergences found by this fuzzer and reported to the backend's authors. The
# generator avoids them unless --include-known is given, so the suite stays
# green while they are open; remove an entry once its fix lands.
KNOWN_ISSUES = {
    "repeat": "Tensor.repeat raises NotImplementedError on acme: PyTorch builds it on "
              "aten::unfold, a view op that has no acme kernel (so the fallback refuses it)",
    "non_blocking_to_host": ".to('cpu', non_blocking=True) raises NotImplementedError: PyTorch "
                            "allocates the host side pinned, and acme's hooks have no "
                            "getPinnedMemoryAllocator",
    "complex_parts": ".real, .imag and torch.view_as_real of a complex acme tensor raise "
                     "NotImplementedError: they are built on aten::view_as_real, a view op that "
                     "has no acme kernel",
}

PRELUDE = '''\
def rand(seed, shape, dtype, kind="dyadic"):
    """Random CPU data: small multiples of 1/8 ("dyadic", exact in every float
    dtype) or scaled normals ("normal"); integers in [-20, 20); bools; complex
    numbers made of two such reals."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        real = torch.float32 if dtype == torch.complex64 else torch.float64
        return torch.complex(rand(seed, shape, real, kind), rand(seed + 1, shape, real, kind))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(-20, 20, shape, generator=g).to(dtype)
    if kind == "dyadic":
        return (torch.randint(-64, 64, shape, generator=g) / 8).to(dtype)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 4).to(dtype)
'''


@dataclass
class Var:
    name: str
    where: str            # "D0", "D1" or "HOST"
    shape: tuple = ()
    dtype: str = "float32"
    tensor: bool = True
    terminal: bool = False   # bounded result: compared only
    view: bool = False       # shares storage with an earlier variable
    grad: bool = False       # requires grad
    used: bool = False       # an operand of some statement since it was made


@dataclass
class Stmt:
    code: str
    target: str | None = None
    bound: str | None = None  # CPU-run expression for the allowed difference of `target`
    compiled: object = None

    def code_object(self):
        if self.compiled is None:
            self.compiled = compile(self.code, "<fuzz program>", "exec")
        return self.compiled


@dataclass
class Program:
    seed: int
    index: int
    stmts: list[Stmt] = field(default_factory=list)
    vars: dict[str, Var] = field(default_factory=dict)
    autograd: bool = False

    def text(self) -> str:
        return "\n".join(s.code for s in self.stmts)


def dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


# ---- running a program ----

ACME_NAMES = None  # ("acme:0", "acme:1", "cpu") once torch_acme is imported


def namespace(on_device: bool) -> dict:
    import torch

    ns = {"torch": torch}
    exec(PRELUDE_CODE, ns)
    ns["D0"], ns["D1"], ns["HOST"] = ACME_NAMES if on_device else ("cpu", "cpu", "cpu")
    ns.update(BOUND_HELPERS)
    return ns


@dataclass
class Run:
    ns: dict
    outcomes: list  # per statement: None or the exception's type name
    bounds: dict
    messages: list = field(default_factory=list)  # per statement: None or the message
    late: str | None = None  # a kernel failure the final synchronize reported (acme)


def execute(stmts: list[Stmt], on_device: bool) -> Run:
    ns = namespace(on_device)
    outcomes, messages, bounds = [], [], {}
    late = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for stmt in stmts:
            try:
                exec(stmt.code_object(), ns)
                outcomes.append(None)
                messages.append(None)
            except Exception as error:  # noqa: BLE001 - compared between the runs
                outcomes.append(type(error).__name__)
                messages.append(str(error))
                continue
            if stmt.bound and not on_device:
                try:
                    bounds[stmt.target] = eval(stmt.bound, ns)
                except Exception:  # noqa: BLE001 - no bound: the comparison is exact
                    pass
        if on_device:
            # From chapter 18 a kernel may fail after its statement returned:
            # the program's own last failure is reported here, not in the next.
            import torch

            for index in range(torch.accelerator.device_count()):
                try:
                    torch.accelerator.synchronize(index)
                except Exception as error:  # noqa: BLE001 - compared with the CPU's
                    late = late or str(error)
    return Run(ns, outcomes, bounds, messages, late)


def late_failure(dev: Run, cpu: Run) -> int | None:
    """The statement whose error the device reported late, if that is what differs.

    A kernel whose data makes it fail (an index out of range, an integer
    division by zero) runs after its statement returned (chapter 18): the CPU
    raises in the statement, acme in a later one or in the final synchronize,
    as torch.AcceleratorError naming the kernel and carrying the CPU's message.
    From that statement on the runs differ by design, so they are not compared.
    """
    first = next((i for i, (a, b) in enumerate(zip(dev.outcomes, cpu.outcomes)) if a != b), None)
    if first is None or dev.outcomes[first] is not None or cpu.outcomes[first] is None:
        return None
    reported = [m for o, m in zip(dev.outcomes[first + 1:], dev.messages[first + 1:])
                if o == "AcceleratorError"] + ([dev.late] if dev.late else [])
    cause = cpu.messages[first]
    if reported and "kernel" in reported[0] and cause and cause in reported[0]:
        return first
    return None


# Helpers the CPU run evaluates for bounds (float64, on the CPU).

def _acc_eps(t):
    import torch

    if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.complex64):
        return torch.finfo(torch.float32).eps
    if t.dtype in (torch.float64, torch.complex128):
        return torch.finfo(torch.float64).eps
    return 0.0


def _abs64(t):
    """|t| in float64 (the modulus, for complex numbers)."""
    import torch

    t = t.detach()
    if t.is_complex():
        return t.resolve_conj().to(torch.complex128).abs()
    return t.double().abs()


def _terms(t, dim):
    if dim is None:
        return max(t.numel(), 1)
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return max(math.prod(t.shape[d] for d in dims), 1)


def _b_sum(t, dim=None, keepdim=False, mean=False):
    n = _terms(t, dim)
    s = _abs64(t).sum() if dim is None else _abs64(t).sum(dim, keepdim=keepdim)
    return n * _acc_eps(t) * s / (n if mean else 1)


def _b_cumsum(t, dim):
    return _terms(t, dim) * _acc_eps(t) * _abs64(t).cumsum(dim)


def _b_prod(t, dim=None):
    n = _terms(t, dim)
    p = _abs64(t).prod() if dim is None else _abs64(t).prod(dim)
    return n * _acc_eps(t) * p


def _b_norm(t, result):
    return (t.numel() + 2) * _acc_eps(t) * _abs64(result)


def _b_matmul(a, b):
    k = a.shape[-1] if a.dim() else 1
    return k * max(_acc_eps(a), _acc_eps(b)) * (_abs64(a) @ _abs64(b))


def _b_addmm(c, a, b):
    product = _abs64(a) @ _abs64(b)
    return _b_matmul(a, b) + max(_acc_eps(a), _acc_eps(c)) * (_abs64(c) + product)


def _b_softmax(t, dim, result, log=False):
    n = t.shape[dim] if t.dim() else 1
    scale = 1 + _abs64(result) if log else _abs64(result)
    return (n + 4) * _acc_eps(t) * scale


def _b_ulps(result, ulps=4):
    return ulps * _eps(result.dtype) * _abs64(result)


def _eps(dtype):
    """The machine epsilon of a floating or complex dtype (of its parts)."""
    import torch

    return torch.finfo(dtype.to_real() if dtype.is_complex else dtype).eps


PRELUDE_CODE = compile(PRELUDE, "<fuzz prelude>", "exec")
BOUND_HELPERS = {f.__name__: f for f in (_b_sum, _b_cumsum, _b_prod, _b_norm, _b_matmul, _b_addmm,
                                           _b_softmax, _b_ulps)}


# ---- comparing two runs ----

def compare(program: Program, dev: Run, cpu: Run, stats: dict | None = None) -> list[str]:
    """Every difference between the runs, as a sentence; [] if they agree.

    `stats` counts statements that raised on both sides alike ("errors"),
    bounded comparisons ("bounded") and those of them that were bit-exact
    anyway ("bounded_exact")."""
    import torch

    stats = {} if stats is None else stats
    problems = []
    late = late_failure(dev, cpu)
    if late is not None:
        stats["late"] = stats.get("late", 0) + 1
        return []
    if dev.late:
        problems.append(f"a kernel failed after the last statement: {dev.late}")
    for i, (a, b) in enumerate(zip(dev.outcomes, cpu.outcomes)):
        if a != b:
            problems.append(f"statement {i + 1} `{program.stmts[i].code}` raised "
                            f"{a or 'nothing'} on acme, {b or 'nothing'} on the CPU")
    if problems:
        return problems
    stats["errors"] = stats.get("errors", 0) + sum(o is not None for o in cpu.outcomes)
    # A backward pass that raised leaves partial gradients behind, and which ones
    # depends on the order of the device threads (one per acme device), not on
    # the kernels: compare gradients only after a backward pass that succeeded.
    backward_failed = any(o is not None and s.code.startswith("torch.autograd.backward")
                          for o, s in zip(cpu.outcomes, program.stmts))
    devices = dict(zip(("D0", "D1", "HOST"), ACME_NAMES))
    storages: dict[str, tuple] = {}
    for name, var in program.vars.items():
        if name not in dev.ns and name not in cpu.ns:
            continue
        d, c = dev.ns.get(name), cpu.ns.get(name)
        if not var.tensor:
            if not same_scalar(d, c):
                problems.append(f"{name}: {d!r} on acme, {c!r} on the CPU")
            continue
        bound = cpu.bounds.get(name)
        problem = compare_tensor(d, c, devices[var.where], bound)
        if bound is not None and isinstance(c, torch.Tensor):
            stats["bounded"] = stats.get("bounded", 0) + 1
            if problem is None and exact_bits(d, c):
                stats["bounded_exact"] = stats.get("bounded_exact", 0) + 1
        if problem:
            problems.append(f"{name}: {problem}")
            continue
        if d.requires_grad and is_leaf(d) and is_leaf(c) and not backward_failed:
            gd, gc = d.grad, c.grad
            if (gd is None) != (gc is None):
                problems.append(f"{name}.grad: {gd is not None} on acme, {gc is not None} on the CPU")
            elif gd is not None:
                finite = gc.detach().double().abs()
                finite = finite[finite.isfinite()]
                scale = finite.amax() if finite.numel() else 0.0  # inf and nan must match exactly
                bound = 256 * torch.finfo(gc.dtype).eps * scale
                problem = compare_tensor(gd, gc, devices[var.where], bound, layout=False)
                stats["gradients"] = stats.get("gradients", 0) + 1
                if problem is None and exact_bits(gd, gc):
                    stats["gradients_exact"] = stats.get("gradients_exact", 0) + 1
                if problem:
                    problems.append(f"{name}.grad: {problem}")
        if d.numel() and c.numel():
            storages[name] = (storage_key(d), storage_key(c))
    # Views: the same variables share storage in both runs.
    names = sorted(storages)
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            shared_dev = storages[x][0] == storages[y][0]
            shared_cpu = storages[x][1] == storages[y][1]
            if shared_dev != shared_cpu:
                problems.append(f"{x} and {y} share storage on {'acme' if shared_dev else 'the CPU'} "
                                f"only")
    return problems


def is_leaf(t) -> bool:
    try:
        return t.is_leaf
    except RuntimeError:  # a multi-output view whose base was modified in place
        return False


def exact_bits(d, c) -> bool:
    return compare_tensor(d, c, str(d.device), None, layout=False) is None


def storage_key(t):
    return (str(t.device), t.untyped_storage().data_ptr())


def same_scalar(a, b) -> bool:
    """Python values from .item() and .tolist(): equal, NaN equal to NaN, -0.0 not to 0.0."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_scalar(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    return type(a) is type(b) and a == b


def compare_tensor(d, c, device, bound, layout=True) -> str | None:
    import torch

    if not isinstance(d, torch.Tensor) or not isinstance(c, torch.Tensor):
        return f"{type(d).__name__} on acme, {type(c).__name__} on the CPU"
    if str(d.device) != device:
        return f"on {d.device}, expected {device}"
    if d.dtype != c.dtype:
        return f"dtype {d.dtype} on acme, {c.dtype} on the CPU"
    if d.shape != c.shape:
        return f"shape {tuple(d.shape)} on acme, {tuple(c.shape)} on the CPU"
    # The stride of a dimension of size 1 is never used (nor any of an empty tensor's).
    if layout and d.numel() and (
            [st for st, sz in zip(d.stride(), d.shape) if sz > 1]
            != [st for st, sz in zip(c.stride(), c.shape) if sz > 1]
            or d.storage_offset() != c.storage_offset()):
        return (f"layout (strides {d.stride()}, offset {d.storage_offset()}) on acme, "
                f"({c.stride()}, {c.storage_offset()}) on the CPU")
    # (Only for dtypes that can have gradients: PyTorch's setitem fills from a
    # 0-dim CPU tensor with fill_, whose autograd marks even a bool destination,
    # and from any other device with copy_, which does not.)
    if d.dtype.is_floating_point and d.requires_grad != c.requires_grad:
        return f"requires_grad {d.requires_grad} on acme, {c.requires_grad} on the CPU"
    # A lazy conjugation or negation (x.conj(), x.conj().imag) is representation.
    dh = d.detach().to("cpu").resolve_conj().resolve_neg()
    ch = c.detach().resolve_conj().resolve_neg()
    complex_parts = dh.is_complex()
    if complex_parts:  # compare the parts
        dh, ch = torch.view_as_real(dh), torch.view_as_real(ch)
        if bound is not None:
            bound = bound.unsqueeze(-1)
    if dh.dtype.is_floating_point:
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dh.element_size()]
        same = (dh.contiguous().view(bits) == ch.contiguous().view(bits)) | (dh.isnan() & ch.isnan())
        if complex_parts:
            # PyTorch's CPU kernels disagree with themselves about the sign of a
            # zero part of a complex number: Vectorized<complex>::neg computes
            # 0 - x and the scalar path -x, and the layout decides which runs.
            same |= (dh == 0) & (ch == 0)
    else:
        same = dh == ch
    if bool(same.all()):
        return None
    if bound is not None and dh.dtype.is_floating_point:
        ref = ch.double()
        allowed = bound + 2 * _eps(ch.dtype) * ref.abs()
        diff = (dh.double() - ref).abs()
        ok = same | (diff.isfinite() & (diff <= allowed))
        if bool(ok.all()):
            return None
        where = (~ok).nonzero()[0].tolist()
        index = tuple(where)
        return (f"differs beyond its bound at {index}: {dh[index].item()!r} on acme, "
                f"{ch[index].item()!r} on the CPU (allowed {float(allowed[index]):.3g})")
    where = (~same).nonzero()[0].tolist() if same.dim() else []
    index = tuple(where)
    return (f"differs at {index or '()'}: {dh[index].item()!r} on acme, {ch[index].item()!r} on the "
            f"CPU ({int((~same).sum())} of {same.numel()} elements)")


# ---- generating a program ----

class Generator:
    """Builds a program statement by statement, running each on the CPU as it
    goes (the "shadow") to know the shapes and dtypes the next ones can use."""

    def __init__(self, seed: int, index: int, length: int, include_known: bool = False):
        self.include_known = include_known
        self.rng = random.Random(f"acme-fuzz:{seed}:{index}")
        self.program = Program(seed, index, autograd=self.rng.random() < 0.2)
        self.length = length
        self.shadow = namespace(on_device=False)
        self.count = 0

    # -- helpers --

    def new_name(self) -> str:
        name = f"v{self.count}"
        self.count += 1
        return name

    def live(self, pred=lambda v: True, include_terminal=False) -> list[Var]:
        return [v for v in self.program.vars.values()
                if v.tensor and (include_terminal or not v.terminal) and pred(v)]

    def pick(self, pred=lambda v: True) -> Var | None:
        candidates = self.live(pred)
        if not candidates:
            return None
        # Prefer recent variables, so chains of views and ops form.
        if self.rng.random() < 0.7:
            return self.rng.choice(candidates[-5:])
        return self.rng.choice(candidates)

    def shape(self, min_dims=0, max_dims=3) -> tuple:
        dims = self.rng.randint(min_dims, max_dims)
        sizes = [self.rng.choice([1, 2, 3, 4, 5]) for _ in range(dims)]
        if sizes and self.rng.random() < 0.05:
            sizes[self.rng.randrange(dims)] = 0  # an empty tensor now and then
        return tuple(sizes)

    def where(self) -> str:
        return self.rng.choices(["D0", "D1", "HOST"], weights=[6, 3, 1])[0]

    def emit(self, code: str, target: str | None = None, *, where: str | None = None,
             terminal=False, view=False, bound=None, keep_errors=0.25) -> bool:
        """Runs `code` on the shadow and records it; False if it raised (and was dropped)."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exec(code, self.shadow)
        except Exception:  # noqa: BLE001
            if self.rng.random() < keep_errors:  # errors must match too
                self.program.stmts.append(Stmt(code))
            return False
        self.program.stmts.append(Stmt(code, target, bound))
        for name in re.findall(r"\bv\d+\b", code.split(" = ", 1)[-1] if target else code):
            if name in self.program.vars:
                self.program.vars[name].used = True
        if target is not None:
            value = self.shadow[target]
            var = Var(target, where or "D0", terminal=terminal, view=view)
            self.program.vars[target] = var
            self.refresh(var, value)
        # In-place metadata ops (t_, unsqueeze_) change shapes: re-read them all.
        for var in self.program.vars.values():
            if var.name in self.shadow:
                self.refresh(var, self.shadow[var.name])
        return True

    def refresh(self, var: Var, value) -> None:
        import torch

        if isinstance(value, torch.Tensor):
            var.shape, var.dtype, var.grad = tuple(value.shape), dtype_name(value), value.requires_grad
        else:
            var.tensor = False

    def values(self, var: Var):
        return self.shadow[var.name]

    def leaf(self, var: Var) -> bool | None:
        """Whether var is an autograd leaf; None if PyTorch refuses to say (a
        multi-output view whose base was modified in place)."""
        try:
            return self.values(var).is_leaf
        except RuntimeError:
            return None

    def is_float(self, var: Var) -> bool:
        return var.dtype in FLOATS

    def index_in(self, size: int) -> int:
        return self.rng.randrange(-size, size) if size else 0

    def partner(self, x: Var, same_dtype=False) -> str:
        """A second operand for x: a variable that broadcasts with it, on the same
        device, a Python scalar, or a CPU scalar tensor."""
        import torch

        r = self.rng.random()
        if r < 0.2:
            return repr(self.rng.choice([2, -1, 0.5, 3.0, 0, -2.5]))
        if r < 0.3:
            return f"torch.tensor({self.rng.choice([1.5, -2, 4, 0.25])})"  # a CPU scalar: allowed

        def fits(v: Var) -> bool:
            if v.where != x.where or (same_dtype and v.dtype != x.dtype) or not self.plain(v):
                return False
            try:
                torch.broadcast_shapes(v.shape, x.shape)
                return True
            except RuntimeError:
                return False

        y = self.pick(fits)
        if y is None or self.rng.random() < 0.3:
            y = self.create(shape=x.shape[self.rng.randint(0, len(x.shape)):], where=x.where,
                            dtype=x.dtype if same_dtype or self.rng.random() < 0.6 else None)
        return y.name if y else "1"

    # -- statement kinds --

    def create(self, shape=None, where=None, dtype=None, grad=False) -> Var | None:
        name = self.new_name()
        shape = self.shape() if shape is None else tuple(shape)
        where = where or self.where()
        dtype = dtype or (self.rng.choice(FLOATS[:2]) if grad else self.rng.choice(DTYPES))
        form = self.rng.random()
        if form < 0.6 or grad:
            kind = self.rng.choice(["dyadic", "dyadic", "normal"])
            code = (f"{name} = rand({self.rng.randrange(10**6)}, {shape}, torch.{dtype}, "
                    f"{kind!r}).to({where})")
            if grad:
                code += ".requires_grad_()"
        elif form < 0.75:
            value = self.rng.choice([0, 1, -3, 2.5, 0.125])
            code = f"{name} = torch.full({shape}, {value}, dtype=torch.{dtype}, device={where})"
        elif form < 0.85:
            code = f"{name} = torch.arange({math.prod(shape)}, dtype=torch.{dtype}, device={where}).reshape({shape})"
        elif form < 0.95:
            fn = self.rng.choice(["zeros", "ones"])
            code = f"{name} = torch.{fn}({shape}, dtype=torch.{dtype}, device={where})"
        else:
            n = self.rng.randint(1, 4)
            code = f"{name} = torch.eye({n}, dtype=torch.{dtype}, device={where})"
        if self.emit(code, name, where=where, keep_errors=0):
            return self.program.vars[name]
        return None

    def make_view(self) -> None:
        x = self.pick()
        if x is None:
            return
        n, s, r = len(x.shape), x.shape, self.rng
        options = []
        if n:
            d = r.randrange(n)
            start, stop = r.randint(-s[d], s[d]), r.randint(-s[d], s[d] + 1)
            parts = [":"] * d + [f"{start}:{stop}:{r.randint(1, 3)}"]
            options.append(f"{x.name}[{', '.join(parts)}]")
            if s[d]:
                options.append(f"{x.name}.select({d}, {self.index_in(s[d])})")
                options.append(f"{x.name}[{self.index_in(s[0])}]" if s[0] else f"{x.name}[0:0]")
                length = r.randint(0, s[d])
                options.append(f"{x.name}.narrow({d}, {r.randint(0, s[d] - length)}, {length})")
            options.append(f"{x.name}.squeeze({d})")
            options.append(f"{x.name}.unsqueeze({r.randint(-n - 1, n)})")
            perm = list(range(n))
            r.shuffle(perm)
            options.append(f"{x.name}.permute({tuple(perm)})")
            options.append(f"{x.name}.movedim({d}, {r.randrange(n)})")
            options.append(f"{x.name}.unbind({d})[{r.randrange(s[d])}]" if s[d] else f"{x.name}.t()" if n <= 2 else f"{x.name}.mT")
            k = r.randint(1, 3)
            options.append(f"{x.name}.split({k}, {d})[0]")
            options.append(f"{x.name}.chunk({k}, {d})[-1]")
        if n >= 2:
            d0, d1 = r.sample(range(n), 2)
            options.append(f"{x.name}.transpose({d0}, {d1})")
            options.append(f"{x.name}.diagonal({r.randint(-1, 1)}, {d0}, {d1})")
            options.append(f"{x.name}.mT")
        if n <= 2:
            options.append(f"{x.name}.t()")
        numel = math.prod(s)
        shape2 = factor_shape(numel, r)
        options.append(f"{x.name}.view({shape2})")
        options.append(f"{x.name}.reshape({shape2})")
        options.append(f"{x.name}.flatten()")
        if x.dtype in COMPLEX:
            options += [f"{x.name}.conj()"] * 3  # a lazily conjugated view
            if self.include_known:
                options += [f"{x.name}.real", f"{x.name}.imag", f"torch.view_as_real({x.name})"]
        options.append(f"{x.name}.expand({expanded(s, r)})")
        if x.dtype in SAME_SIZE and n and not x.grad:
            options.append(f"{x.name}.view(torch.{r.choice(SAME_SIZE[x.dtype])})")
        if n and s[-1] and s[-1] % 2 == 0:
            options.append(f"{x.name}.unflatten(-1, (2, {s[-1] // 2}))")
        name = self.new_name()
        self.emit(f"{name} = {r.choice(options)}", name, where=x.where, view=True)

    def in_place(self) -> None:
        def target(v: Var) -> bool:
            # Not a leaf (or a view of one) that requires grad: PyTorch refuses those.
            if v.grad and (v.view or self.leaf(v) is not False):
                return False
            # Nor a tensor that requires grad and that an earlier op used: that op
            # may have saved it for backward, and modifying a saved tensor in place
            # makes a reference cycle through the autograd graph that no collector
            # frees. Upstream PyTorch leaks it on every device, the CPU included
            # (e.g. y = x.square(); x.add_(y)), so acme's leak check would fail.
            if v.grad and v.used:
                return False
            # The same cycle through a view: in an autograd program, nothing that
            # shares storage with a variable some op has already used is
            # modified in place (x = b * y; b.view(-1).mul_(x) leaks b and x).
            if self.program.autograd and any(o.used for o in self.sharing(v)):
                return False
            # Not an expanded tensor (elements sharing memory): PyTorch documents
            # writes into one as unsupported. The CPU still allows fill_, zero_
            # and masked_fill_ there; acme refuses them all, with PyTorch's own
            # "more than one element of the written-to tensor" error.
            value = self.values(v)
            return all(st != 0 or sz <= 1 for st, sz in zip(value.stride(), value.shape))

        t = self.pick(lambda v: target(v) and self.plain(v))
        if t is None:
            return
        r = self.rng
        n = len(t.shape)
        options = [f"{t.name}.zero_()", f"{t.name}.fill_({r.choice([1, -2, 0.5])})",
                   f"{t.name}.add_({self.partner(t)})", f"{t.name}.mul_({self.partner(t)})",
                   f"{t.name}.clamp_({r.choice([-2, -1, 0])}, {r.choice([0, 1, 3])})",
                   f"{t.name}.neg_()", f"{t.name}.copy_({self.copy_source(t)})",
                   f"{t.name}.masked_fill_({t.name} > 0, {r.choice([0, 7, -1])})"]
        if t.dtype in COMPLEX:
            options += [f"{t.name}.div_({self.partner(t)})"]
        if t.dtype in FLOATS:
            options += [f"{t.name}.div_({self.partner(t)})", f"{t.name}.abs_()",
                        f"{t.name}.sub_({self.partner(t)}, alpha=2)"]
        if n and t.shape[0]:
            options.append(f"{t.name}[{self.index_in(t.shape[0])}] = {r.choice([3, -1, 0.5])}")
            options.append(f"{t.name}[{r.randint(0, t.shape[0])}:] = {self.copy_source(t, tail=True)}")
        if n >= 2 and not t.grad:
            options.append(f"{t.name}.t_()" if n == 2 else f"{t.name}.transpose_(0, {n - 1})")
        if not t.grad and n < 4:
            options.append(f"{t.name}.unsqueeze_({r.randint(0, n)})")
        code = r.choice(options)
        # setitem from a 0-dim CPU tensor fills with its .item() (range-checked)
        # into any device but the CPU, where it copies: PyTorch's own difference.
        if "] = " in code and any(
                self.program.vars[n].where == "HOST" and self.program.vars[n].shape == ()
                for n in re.findall(r"\bv\d+\b", code.split("] = ", 1)[1]) if n in self.program.vars):
            return
        # An operand that partially overlaps the destination makes an in-place
        # op unsupported in PyTorch: the CPU raises where it can tell, and
        # otherwise gives a result that depends on its loop order; and setitem
        # treats a 0-dim CPU source (fill_) unlike any other (copy_). Not generated.
        if self.overlapping(t, code):
            return
        # A float written into an integer tensor must fit: out of range (or NaN)
        # the conversion is undefined in C++, and PyTorch itself then differs by
        # device (a CPU 0-dim source is copied, wrapping, into a CPU tensor, but
        # range-checked by fill_ into any other device's).
        if t.dtype in INTEGER and not self.fits(t, code):
            return
        # The same cycle as above, at once: t.mul_(t) saves t for its own backward.
        if t.grad and "masked_fill_" not in code and re.findall(r"\bv\d+\b", code).count(t.name) > 1:
            return
        self.emit(code, where=t.where)

    def fits(self, t: Var, code: str) -> bool:
        """Whether every floating-point tensor `code` names fits t's integer dtype."""
        import torch

        info = torch.iinfo(getattr(torch, t.dtype))
        for name in set(re.findall(r"\bv\d+\b", code)) - {t.name}:
            other = self.shadow.get(name)
            if isinstance(other, torch.Tensor) and other.is_floating_point() and other.numel():
                values = other.detach().double()
                if not (bool(values.isfinite().all()) and info.min <= float(values.min())
                        and float(values.max()) <= info.max):
                    return False
        return True

    def sharing(self, v: Var) -> list[Var]:
        """v and every other tensor variable on the same storage (views of each other)."""
        ptr = self.values(v).untyped_storage().data_ptr()
        return [o for o in self.live(include_terminal=True) if o.name in self.shadow
                and (o is v or (ptr and self.values(o).untyped_storage().data_ptr() == ptr))]

    def overlapping(self, t: Var, code: str) -> bool:
        """Whether a variable named in `code` shares t's storage without being t's exact view."""
        target = self.values(t)
        for name in set(re.findall(r"\bv\d+\b", code)) - {t.name}:
            other = self.shadow.get(name)
            if (other is not None and other.numel() and target.numel()
                    and other.untyped_storage().data_ptr() == target.untyped_storage().data_ptr()
                    and (other.stride(), other.storage_offset()) != (target.stride(), target.storage_offset())):
                return True
        return False

    def copy_source(self, t: Var, tail=False) -> str:
        """What to copy into t: any device, any dtype, broadcastable."""
        import torch

        def fits(v: Var) -> bool:
            if tail:
                return v.shape == () or v.shape == t.shape[1:]
            try:
                return torch.broadcast_shapes(v.shape, t.shape) == torch.Size(t.shape)
            except RuntimeError:
                return False

        y = self.pick(fits)
        if y is None or self.rng.random() < 0.3:
            shape = t.shape[1:] if tail else t.shape[self.rng.randint(0, len(t.shape)):]
            y = self.create(shape=shape)  # on a random device: copies cross devices
        return y.name if y else "0"

    def plain(self, v: Var) -> bool:
        """Any variable will do. (Until chapter 18, empty complex and bool tensors were
        left out: acme's launch() returned before the kernel's dtype check when empty.)"""
        return True

    def elementwise(self) -> None:
        x = self.pick(self.plain)
        if x is None:
            return
        r, name = self.rng, self.new_name()
        f = self.is_float(x)
        binary = ["torch.add({x}, {y})", "{x} - {y}", "{x} * {y}", "{x} / {y}",
                  "torch.maximum({x}, {y})", "torch.minimum({x}, {y})", "{x} < {y}", "{x} == {y}",
                  "torch.where({x} > 0, {x}, {y})", "torch.floor_divide({x}, {y})",
                  "torch.remainder({x}, {y})", "torch.add({x}, {y}, alpha=3)",
                  "torch.div({x}, {y}, rounding_mode='floor')",
                  "torch.div({x}, {y}, rounding_mode='trunc')", "{x} >= {y}", "{x} != {y}",
                  "{x} <= {y}", "{x} > {y}", "torch.sub({x}, {y}, alpha=0.5)"]
        unary = ["-{x}", "{x}.abs()", "{x}.clamp(-1, 2)", "{x}.square()", "{x}.sign()",
                 "{x}.isnan()", "{x}.nan_to_num()",
                 "{x}.clone()", "{x}.contiguous()", "{x}.flip(0)" if x.shape else "{x}.clone()",
                 "torch.cat([{x}, {x}], {d})", "torch.stack([{x}, {x}])",
                 "{x}.masked_fill({x} < 0, 5)", "torch.roll({x}, 1)", "{x}.float()",
                 "{x}.to(torch.float16)", "{x}.double()", "{x}.bool()", "{x}.to(torch.bfloat16)"]
        if x.dtype in COMPLEX:
            unary += ["{x}.conj().clone()", "{x}.resolve_conj()", "torch.conj_physical({x})",
                      "{x} * {x}.conj()"]
        if f:
            unary += ["{x}.sqrt()", "{x}.reciprocal()", "{x}.floor()", "{x}.round()", "{x}.relu()",
                      "{x}.trunc()"]
            if self.convertible(x):
                unary += ["{x}.to(torch.int32)", "{x}.long()", "{x}.to(torch.int8)"]
        else:
            unary += ["{x}.bitwise_not()", "{x} & {x}" if x.dtype != "uint8" else "{x} | 1",
                      "{x}.long()", "{x}.to(torch.int16)"]
        if self.include_known:
            unary += ["{x}.repeat({rep})", "torch.logical_not({x})"]
            binary.append("torch.logical_and({x}, {y})")
        if x.shape and x.shape[0]:
            idx = [r.randrange(x.shape[0]) for _ in range(r.randint(1, 4))]
            unary += [f"{{x}}.index_select(0, torch.tensor({idx}, device={x.where}))",
                      f"{{x}}[torch.tensor({idx}, device={x.where})]"]
        if len(x.shape) == 2:
            unary += ["torch.tril({x})", "torch.triu({x}, 1)"]
        template = r.choice(binary if r.random() < 0.5 else unary)
        code = template.format(x=x.name, y=self.partner(x) if "{y}" in template else "",
                               d=r.randrange(len(x.shape)) if x.shape else 0,
                               rep=tuple(r.randint(1, 2) for _ in range(max(len(x.shape), 1))))
        self.emit(f"{name} = {code}", name, where=x.where)

    def convertible(self, x: Var) -> bool:
        """float -> int is defined only for finite values in range."""
        values = self.values(x)
        if values.numel() == 0:
            return True
        return bool(values.isfinite().all()) and float(values.abs().max()) < 127

    def transcendental(self) -> None:
        x = self.pick(lambda v: v.dtype in FLOATS)
        if x is None:
            return
        name = self.new_name()
        fn = self.rng.choice(["{x}.exp()", "{x}.log()", "{x}.sin()", "{x}.tanh()",
                              "torch.sigmoid({x})", "{x}.pow(1.5)"])
        self.emit(f"{name} = {fn.format(x=x.name)}", name, where=x.where, terminal=True,
                  bound=f"_b_ulps({name})")

    def reduction(self) -> None:
        x = self.pick(self.plain)
        if x is None:
            return
        r, name = self.rng, self.new_name()
        n = len(x.shape)
        d = r.randrange(n) if n else None
        dim = "" if d is None else f"{d}"
        if r.random() < 0.4:  # order-independent: exact
            options = [f"{x.name}.amax({dim})" if n else f"{x.name}.max()",
                       f"{x.name}.amin({dim})" if n else f"{x.name}.min()",
                       f"{x.name}.argmax({dim})", f"{x.name}.argmin({dim})",
                       f"({x.name} > 0).any({dim})", f"({x.name} != 0).all({dim})",
                       f"torch.count_nonzero({x.name}{', ' + dim if dim else ''})"]
            if n:
                options.append(f"torch.sort({x.name}, dim={d}, stable=True).values")
                options.append(f"{x.name}.max({d}).values")
                options.append(f"{x.name}.min({d}, keepdim=True).indices")
            else:
                options.append(f"{x.name}.max()")
            if x.dtype not in FLOATS:
                options += [f"{x.name}.sum({dim})", f"{x.name}.cumsum({d if n else 0})"]
            self.emit(f"{name} = {r.choice(options)}", name, where=x.where)
            return
        if x.dtype in COMPLEX:  # order-dependent sums of complex numbers
            code, bound = r.choice([(f"{x.name}.sum({dim})", f"_b_sum({x.name}, {d})"),
                                    (f"{x.name}.mean({dim})", f"_b_sum({x.name}, {d}, mean=True)"),
                                    (f"{x.name}.cumsum({d if n else 0})",
                                     f"_b_cumsum({x.name}, {d if n else 0})")])
            self.emit(f"{name} = {code}", name, where=x.where, terminal=True, bound=bound)
            return
        if x.dtype not in FLOATS:
            return
        keep = r.random() < 0.3
        options = [
            (f"{x.name}.sum({dim}{', keepdim=True' if keep and dim else ''})",
             f"_b_sum({x.name}, {d}, {keep and d is not None})"),
            (f"{x.name}.mean({dim})", f"_b_sum({x.name}, {d}, mean=True)"),
            (f"{x.name}.cumsum({d if n else 0})", f"_b_cumsum({x.name}, {d if n else 0})"),
            (f"{x.name}.prod({dim})", f"_b_prod({x.name}, {d})"),
            (f"{x.name}.norm()", f"_b_norm({x.name}, {name})"),
            (f"torch.softmax({x.name}, {d if n else 0})", f"_b_softmax({x.name}, {d if n else 0}, {name})"),
            (f"torch.log_softmax({x.name}, {d if n else 0})",
             f"_b_softmax({x.name}, {d if n else 0}, {name}, log=True)"),
        ]
        code, bound = r.choice(options)
        self.emit(f"{name} = {code}", name, where=x.where, terminal=True, bound=bound)

    def matmul(self) -> None:
        x = self.pick(lambda v: v.dtype in FLOATS + COMPLEX and 1 <= len(v.shape) <= 3)
        if x is None:
            return
        r = self.rng
        k = x.shape[-1]
        # A right operand of matching inner size, on the same device.
        shape = (k,) if r.random() < 0.2 else (k, r.randint(1, 4))
        if len(x.shape) == 3 and r.random() < 0.5:
            shape = (x.shape[0], k, r.randint(1, 4))
        y = self.pick(lambda v: v.where == x.where and v.shape == shape and v.dtype == x.dtype)
        if y is None:
            y = self.create(shape=shape, where=x.where, dtype=x.dtype)
        if y is None:
            return
        name = self.new_name()
        if len(x.shape) == 2 and len(shape) == 2 and r.random() < 0.3:
            # addmm: bias + product, the bias broadcast from a row or a full matrix.
            bias_shape = (shape[1],) if r.random() < 0.5 else (x.shape[0], shape[1])
            c = self.create(shape=bias_shape, where=x.where, dtype=x.dtype)
            if c is None:
                return
            name = self.new_name()
            self.emit(f"{name} = torch.addmm({c.name}, {x.name}, {y.name})", name, where=x.where,
                      terminal=True, bound=f"_b_addmm({c.name}, {x.name}, {y.name})")
            return
        op = "torch.bmm" if len(x.shape) == 3 and len(shape) == 3 and r.random() < 0.5 else None
        if op is None and len(x.shape) == 2 and len(shape) == 2 and r.random() < 0.5:
            op = "torch.mm"
        code = f"{op}({x.name}, {y.name})" if op else f"{x.name} @ {y.name}"
        self.emit(f"{name} = {code}", name, where=x.where, terminal=True,
                  bound=f"_b_matmul({x.name}, {y.name})")

    def transfer(self) -> None:
        x = self.pick()
        if x is None:
            return
        r, name = self.rng, self.new_name()
        dest = r.choice([w for w in ("D0", "D1", "HOST") if w != x.where] + [x.where])
        # copy=True always: on the CPU run every "device" is the CPU, and without
        # it .to() would return the same tensor there but a copy on acme.
        extra = ""
        if r.random() < 0.3:
            extra += f", torch.{r.choice(FLOATS)}"
        if r.random() < 0.2 and (dest != "HOST" or self.include_known):
            extra += ", non_blocking=True"
        self.emit(f"{name} = {x.name}.to({dest}{extra}, copy=True)", name, where=dest)

    def scalar(self) -> None:
        x = self.pick(lambda v: math.prod(v.shape) > 0)
        if x is None:
            return
        name = self.new_name()
        index = ", ".join(str(self.index_in(s)) for s in x.shape)
        code = f"{name} = {x.name}[{index}].item()" if index else f"{name} = {x.name}.item()"
        if self.rng.random() < 0.3:
            code = f"{name} = {x.name}.tolist()"
        self.emit(code, name, where="HOST")  # refresh() marks it as a Python value

    def backward(self) -> None:
        """Ends an autograd program: backward from every result that needs it."""
        outputs = [v for v in self.live(lambda v: v.grad, include_terminal=True)
                   if self.leaf(v) is False]
        if not outputs:
            return
        chosen = self.rng.sample(outputs, min(len(outputs), 3))
        roots = ", ".join(f"{v.name}.sum()" for v in chosen)
        self.emit(f"torch.autograd.backward([{roots}])")

    # -- the whole program --

    def build(self) -> Program:
        r = self.rng
        if self.program.autograd:
            for _ in range(r.randint(1, 2)):
                self.create(where=r.choice(["D0", "D0", "D1"]), grad=True)
            kinds = [(self.make_view, 4), (self.elementwise_grad, 6), (self.transfer, 2),
                     (self.in_place, 1), (self.create, 1)]
        else:
            for _ in range(r.randint(1, 3)):
                self.create()
            kinds = [(self.create, 2), (self.make_view, 6), (self.in_place, 5),
                     (self.elementwise, 6), (self.transcendental, 1), (self.reduction, 3),
                     (self.matmul, 2), (self.transfer, 3), (self.scalar, 1)]
        funcs, weights = zip(*kinds)
        while len(self.program.stmts) < self.length:
            r.choices(funcs, weights)[0]()
        if self.program.autograd:
            self.backward()
        return self.program

    def elementwise_grad(self) -> None:
        x = self.pick(lambda v: v.dtype in FLOATS[:2])
        if x is None:
            return
        r, name = self.rng, self.new_name()
        template = r.choice(["{x} * {y}", "{x} + {y}", "{x} - {y}", "{x} / 2", "-{x}",
                             "{x}.relu()", "{x}.clamp(-1, 1)", "torch.maximum({x}, {y})",
                             "torch.where({x} > 0, {x}, {y})", "{x}.square()", "{x}.clone()",
                             "torch.cat([{x}, {x}])", "{x}.abs()", "{x}.double()", "{x}.float()"])
        y = self.partner(x, same_dtype=True) if "{y}" in template else ""
        self.emit(f"{name} = {template.format(x=x.name, y=y)}", name, where=x.where)


def factor_shape(numel: int, r: random.Random) -> tuple:
    if numel == 0:
        return (0, r.randint(1, 3))
    dims = []
    left = numel
    for p in (2, 3, 5):
        while left % p == 0 and r.random() < 0.6:
            dims.append(p)
            left //= p
    dims.append(left)
    r.shuffle(dims)
    if r.random() < 0.3:
        dims[r.randrange(len(dims))] = -1
    return tuple(dims)


def expanded(shape: tuple, r: random.Random) -> tuple:
    out = [s if s != 1 else r.choice([1, 2, 3]) for s in shape]
    if r.random() < 0.5:
        out.insert(0, r.randint(1, 3))
    return tuple(out)


def generate(seed: int, index: int, length: int = 16, include_known: bool = False) -> Program:
    return Generator(seed, index, length, include_known).build()


# ---- checking, shrinking, reporting ----

def device_memory() -> list[tuple[int, int]]:
    import torch
    from torch_acme import runtime

    # The caching allocator (chapter 12) keeps freed blocks: hand them back
    # first, so that the runtime's figures count live tensors only.
    if hasattr(torch.accelerator, "empty_cache"):
        try:
            torch.accelerator.empty_cache()
        except RuntimeError:  # no DeviceAllocator before chapter 12
            pass
    stats = [runtime.memory_stats(d) for d in range(runtime.device_count())]
    return [(s["bytes_in_use"], s["blocks_in_use"]) for s in stats]


def check(program: Program, stmts: list[Stmt] | None = None, stats: dict | None = None) -> list[str]:
    """The program's mismatches, and a leak of device memory once it is gone."""
    stmts = program.stmts if stmts is None else stmts
    trial = Program(program.seed, program.index, stmts, program.vars, program.autograd)
    before = device_memory()
    dev = execute(stmts, on_device=True)
    cpu = execute(stmts, on_device=False)
    try:
        problems = compare(trial, dev, cpu, stats)
    finally:
        dev.ns.clear()
        cpu.ns.clear()
    after = device_memory()
    if after != before:
        import gc

        gc.collect()  # only now: it costs milliseconds, and cycles are rare
        after = device_memory()
        if after != before:
            problems.append(f"device memory (bytes, blocks) per device: {before} before the "
                            f"program, {after} after it")
    return problems


def shrink(program: Program) -> tuple[list[Stmt], list[str]]:
    """Drops statements, last first, as long as some mismatch remains."""
    stmts = list(program.stmts)
    problems = check(program, stmts)
    changed = True
    while changed:
        changed = False
        for i in reversed(range(len(stmts))):
            trial = stmts[:i] + stmts[i + 1:]
            found = check(program, trial)
            if found:
                stmts, problems, changed = trial, found, True
    return stmts, problems


def repro(program: Program, stmts: list[Stmt], problems: list[str]) -> str:
    body = "\n".join(s.code for s in stmts)
    shown = "\n".join(f"#   {p}" for p in problems[:5])
    return f'''\
# acme fuzz: seed {program.seed}, program {program.index}, shrunk from {len(program.stmts)} to \
{len(stmts)} statements.
# Rerun: python tools/fuzz.py --seed {program.seed} --program {program.index}
# The runs disagree:
{shown}
import torch, torch_acme

{PRELUDE}
PROGRAM = """
{body}
"""
runs = {{}}
for label, (D0, D1, HOST) in {{"acme": ("acme:0", "acme:1", "cpu"), "cpu": ("cpu", "cpu", "cpu")}}.items():
    runs[label] = dict(torch=torch, rand=rand, D0=D0, D1=D1, HOST=HOST)
    exec(PROGRAM, runs[label])
for name in sorted(k for k in runs["cpu"] if k.startswith("v")):
    print(name, "acme:", runs["acme"].get(name), " cpu:", runs["cpu"].get(name))
'''


def signature(problem: str) -> str:
    """A mismatch with its names and numbers blanked, to count mismatches by kind."""
    problem = re.sub(r"^statement \d+ ", "", problem)
    problem = re.sub(r"\bv\d+\b", "v", problem)
    return re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "#", problem)


def load_backend() -> None:
    """Imports torch_acme, from the last stage of ACME_BUILD_DIR unless importable already."""
    global ACME_NAMES
    try:
        import torch_acme  # noqa: F401
    except ImportError:
        import tomllib

        build = Path(os.environ.get("ACME_BUILD_DIR", ROOT / "_build")).resolve()
        last = tomllib.loads((ROOT / "chapters" / "chapters.toml").read_text())["chapter"][-1]["number"]
        sys.path.insert(0, str(build / "packages" / f"stage-{last:02d}"))
        import torch_acme  # noqa: F401
    import torch

    name = torch._C._get_privateuse1_backend_name()
    ACME_NAMES = (f"{name}:0", f"{name}:1", "cpu")


@dataclass
class Report:
    programs: int = 0
    statements: int = 0
    autograd: int = 0
    stats: dict = field(default_factory=dict)
    mismatches: list = field(default_factory=list)  # (program index, repro text)
    kinds: dict = field(default_factory=dict)  # mismatch signature -> count
    seconds: float = 0.0

    def summary(self) -> str:
        s = self.stats
        return (f"{self.programs} programs ({self.autograd} with a backward pass), "
                f"{self.statements} statements ({s.get('errors', 0)} raised alike on both sides, "
                f"{s.get('late', 0)} programs with a kernel failure reported late), "
                f"{s.get('bounded', 0)} bounded comparisons ({s.get('bounded_exact', 0)} bit-exact "
                f"anyway), {s.get('gradients', 0)} gradients ({s.get('gradients_exact', 0)} bit-exact); "
                f"{len(self.mismatches)} mismatches; {self.seconds:.1f} s")


def run(seed: int = 0, programs: int = 200, start: int = 0, length: int = 16,
        shrink_mismatches: bool = True, progress=None, include_known: bool = False) -> Report:
    load_backend()
    report = Report()
    began = time.perf_counter()
    for index in range(start, start + programs):
        program = generate(seed, index, length, include_known)
        problems = check(program, stats=report.stats)
        report.programs += 1
        report.autograd += program.autograd
        report.statements += len(program.stmts)
        if problems:
            stmts, problems = shrink(program) if shrink_mismatches else (program.stmts, problems)
            report.mismatches.append((index, repro(program, stmts, problems)))
            kind = signature(problems[0])
            report.kinds[kind] = report.kinds.get(kind, 0) + 1
        if progress and (index + 1 - start) % progress == 0:
            print(f"  {index + 1 - start} programs, {len(report.mismatches)} mismatches",
                  file=sys.stderr, flush=True)
    report.seconds = time.perf_counter() - began
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--start", type=int, default=0, help="index of the first program")
    parser.add_argument("--program", type=int, help="run (or --show) this one program")
    parser.add_argument("--length", type=int, default=16, help="statements per program")
    parser.add_argument("--show", action="store_true", help="print the program, do not run it")
    parser.add_argument("--max-reports", type=int, default=10)
    parser.add_argument("--include-known", action="store_true",
                        help="also generate the known issues (KNOWN_ISSUES)")
    args = parser.parse_args()

    load_backend()
    if args.program is not None:
        program = generate(args.seed, args.program, args.length, args.include_known)
        if args.show:
            print(program.text())
            return 0
        problems = check(program)
        if not problems:
            print(f"program {args.program}: acme and the CPU agree ({len(program.stmts)} statements)")
            return 0
        stmts, problems = shrink(program)
        print(repro(program, stmts, problems))
        return 1
    report = run(args.seed, args.programs, args.start, args.length,
                 progress=max(args.programs // 10, 1), include_known=args.include_known)
    for index, text in report.mismatches[: args.max_reports]:
        print(text)
    for kind, count in sorted(report.kinds.items(), key=lambda item: -item[1]):
        print(f"{count:6} x {kind}")
    if not args.include_known:
        for key, why in KNOWN_ISSUES.items():
            print(f"not generated (known issue {key}): {why}")
    print(f"fuzz seed {args.seed}: {report.summary()}")
    return 1 if report.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
