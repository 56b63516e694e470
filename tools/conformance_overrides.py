"""acme's declared conformance gaps: one row per operator and test, with its reason.

Plain data, so that both readers can import it: tests/conformance_suite.py turns
each row into a `DecorateInfo` for PyTorch's `set_test_configs(op_overrides=...)`,
and docs/conformance.md prints the table beside the results. A "skip" is for a
case the CPU gets wrong or checks on the CPU only; an "expected failure" must
keep failing: when a fix lands, unittest reports an unexpected success and the
row goes.
"""

from __future__ import annotations

from typing import NamedTuple


class Override(NamedTuple):
    op: str  # the OpInfo's full name
    test: str  # the test of TestConformance it applies to
    dtypes: tuple[str, ...] | None  # names of torch dtypes; None: every dtype
    kind: str  # "skip" or "expected failure"
    reason: str
    releases: tuple[str, ...] | None = None  # the PyTorch releases it holds for; None: all


_CHUNKED_REASON = ("half precision accumulates as CUDA's does (float32 sums, the rest in the input's "
                   "dtype); the CPU keeps more in float32 (src/torch_acme/mixed_precision.py)")

OVERRIDES: list[Override] = [
    Override("nn.functional.pixel_unshuffle", "test_empty", None, "skip",
             "wrong on the CPU: an empty input keeps its shape ((1, 1, 6, 0) for a factor of 3, "
             "where the op's shape rule, and CUDA, give (1, 9, 2, 0))"),
    *[Override(name, "test_extremal", None, "skip",
               "PyTorch checks q's range on the CPU only (as on CUDA): acme, like CUDA, returns nan")
      for name in ("quantile", "nanquantile")],
    *[Override(name, test, None, "skip",
               "the CPU's solution is a view of LAPACK's column-major workspace; acme's (through the "
               "fallback) has the same values, contiguous")
      for name in ("linalg.lstsq", "linalg.lstsq.grad_oriented")
      for test in ("test_layout", "test_noncontiguous", "test_out")],
    *[Override(name, "test_out", None, "skip",
               "wrong in PyTorch, on every device: with one transformed dimension, the out= form "
               "never writes out (its composite passes the arguments of conj_physical_out in the "
               "wrong order), so both devices return uninitialised memory; tests/test_conformance.py "
               "checks that the bug is still there")
      for name in ("fft.ihfft2", "fft.ihfftn")],
    Override("native_group_norm", "test_noncontiguous", None, "skip",
             "2.13's CPU kernel refuses non-contiguous input with an internal check (\"Expected "
             "X.is_contiguous(memory_format) to be true\"); acme, through the fallback, computes "
             "what 2.14 and 2.15's CPU kernels compute", releases=("2.13.0",)),
    Override("nn.functional.linear_cross_entropy.chunked", "test_forward", ("float16",),
             "expected failure", _CHUNKED_REASON),
    Override("nn.functional.linear_cross_entropy.chunked", "test_backward", ("float16",),
             "expected failure", _CHUNKED_REASON),
    Override("nn.functional.linear_cross_entropy.chunked_none", "test_forward", ("float16",),
             "expected failure", _CHUNKED_REASON),
    Override("nn.functional.linear_cross_entropy.chunked_none", "test_backward",
             ("float16", "bfloat16"), "expected failure", _CHUNKED_REASON),
]
