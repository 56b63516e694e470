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


_CHUNKED_REASON = ("half precision accumulates as CUDA's does (float32 sums, the rest in the input's "
                   "dtype); the CPU keeps more in float32 (src/torch_acme/mixed_precision.py)")

OVERRIDES: list[Override] = [
    Override("nn.functional.pixel_unshuffle", "test_empty", None, "skip",
             "wrong on the CPU: an empty input keeps its shape ((1, 1, 6, 0) for a factor of 3, "
             "where the op's shape rule, and CUDA, give (1, 9, 2, 0))"),
    *[Override(name, "test_extremal", None, "skip",
               "PyTorch checks q's range on the CPU only (as on CUDA): acme, like CUDA, returns nan")
      for name in ("quantile", "nanquantile")],
    *[Override(name, "test_layout", None, "skip",
               "the CPU's solution is a view of LAPACK's column-major workspace; acme's (through the "
               "fallback) has the same values, contiguous")
      for name in ("linalg.lstsq", "linalg.lstsq.grad_oriented")],
    Override("nn.functional.linear_cross_entropy.chunked", "test_forward", ("float16",),
             "expected failure", _CHUNKED_REASON),
    Override("nn.functional.linear_cross_entropy.chunked", "test_backward", ("float16",),
             "expected failure", _CHUNKED_REASON),
    Override("nn.functional.linear_cross_entropy.chunked_none", "test_forward", ("float16",),
             "expected failure", _CHUNKED_REASON),
    Override("nn.functional.linear_cross_entropy.chunked_none", "test_backward",
             ("float16", "bfloat16"), "expected failure", _CHUNKED_REASON),
]
