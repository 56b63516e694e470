"""Chapter 4: acme's autocast policy table, op by op, against the dispatcher and the CPU.

Every op of the table runs under autocast to float16 and to bfloat16, with
float32, low-precision and mixed inputs. Its output dtype must be the one its
policy promises, its values those of the op computed in float32 on the CPU
(within the low dtype's rounding), and, where the CPU's autocast gives the
same dtype, the CPU's autocast result: bit for bit for the matrix products.
"""

from __future__ import annotations

import importlib
import itertools
import warnings

import pytest
import torch

import torch_acme
from autocast_cases import LOW, MIXES, RECIPES, expected_dtype, make_inputs
from conftest import dispatch_row

STAGE = importlib.import_module("torch_acme._build_info").STAGE
pytestmark = pytest.mark.skipif(STAGE < 4, reason="chapter 4's autocast is not in this stage")

DEVICE = torch._C._get_privateuse1_backend_name()
POLICIES = dict(torch_acme._C.autocast.policies()) if STAGE >= 4 else {}
# A few units in the last place of each low dtype.
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 4e-2}
# The (op, mix) pairs the CPU's autocast refuses, for either low dtype: it
# leaves mixed inputs to these ops as they are, and their CPU kernels want one
# dtype (test_what_the_cpu_autocast_refuses pins this).
CPU_REFUSES = {("aten::layer_norm", "mixed"), ("aten::dot", "mixed")}


def on_cpu_autocast(op: str, mix: str, low: torch.dtype) -> torch.Tensor:
    """The op of the table under the CPU's own autocast, from the same inputs."""
    with torch.autocast(device_type="cpu", dtype=low):
        return RECIPES[op](make_inputs("cpu", mix, low))


def test_the_table_is_what_the_dispatcher_has():
    registered = {name for name in torch._C._dispatch_get_all_op_names()
                  if torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastPrivateUse1")}
    assert registered == set(POLICIES), registered ^ set(POLICIES)
    for op in POLICIES:
        row = dispatch_row(op, "AutocastPrivateUse1")
        assert "autocast.cpp" in row and "[kernel]" in row, row
    # Every other op skips the key.
    assert "fallthrough" in dispatch_row("aten::sin", "AutocastPrivateUse1")


def test_every_op_of_the_table_has_a_recipe():
    assert set(RECIPES) == set(POLICIES), set(RECIPES) ^ set(POLICIES)
    assert set(POLICIES.values()) <= {"lower_precision_fp", "fp32", "fp32_set_opt_dtype",
                                      "promote"}


@pytest.mark.parametrize("op, low, mix", list(itertools.product(sorted(POLICIES), LOW, MIXES)),
                         ids=lambda v: str(v).removeprefix("torch.").removeprefix("aten::"))
def test_policy(op, low, mix):
    policy, recipe = POLICIES[op], RECIPES[op]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback's notices
        with torch.autocast(device_type=DEVICE, dtype=low):
            result = recipe(make_inputs(DEVICE, mix, low)).cpu()
    assert result.dtype == expected_dtype(policy, mix, low)

    # Values: the op in float32 on the CPU, from the same (already rounded) inputs.
    reference = recipe(make_inputs("cpu", mix, low, as_float32=True))
    tolerance = 1e-5 if result.dtype == torch.float32 else TOLERANCE[low]
    torch.testing.assert_close(result.float(), reference, rtol=tolerance, atol=tolerance)

    # The CPU's autocast has policies of its own (and refuses some mixes, none
    # of them of a lower_precision_fp op: those must be compared, so an error
    # there fails the test); where it has acme's, the results agree.
    try:
        on_cpu = on_cpu_autocast(op, mix, low)
    except RuntimeError:
        if policy == "lower_precision_fp":
            raise
        return
    if policy == "lower_precision_fp":
        assert torch.equal(result, on_cpu)  # the same casts, then the same products
    elif on_cpu.dtype == result.dtype:
        torch.testing.assert_close(result, on_cpu, rtol=1e-5, atol=1e-5)


def test_what_the_cpu_autocast_refuses():
    # test_policy skips the comparison with the CPU's autocast where it
    # refuses: pinned here, so a change upstream shows up.
    refused = set()
    for op, low, mix in itertools.product(sorted(POLICIES), LOW, MIXES):
        try:
            on_cpu_autocast(op, mix, low)
        except RuntimeError:
            refused.add((op, low, mix))
    assert refused == {(op, low, mix) for op, mix in CPU_REFUSES for low in LOW}, refused
    assert all(POLICIES[op] != "lower_precision_fp" for op, _ in CPU_REFUSES)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8], ids=str)
def test_an_unsupported_dtype_warns_and_disables_autocast(dtype):
    a = torch.ones(2, 2, device=DEVICE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast(device_type=DEVICE, dtype=dtype):
            enabled = torch.is_autocast_enabled(DEVICE)
            result_dtype = torch.mm(a, a).dtype
    messages = [str(w.message) for w in caught if "autocast" in str(w.message)]
    assert not enabled and result_dtype == torch.float32
    assert messages and "target dtype is not supported. Disabling autocast" in messages[0]
    assert "torch.float16, torch.bfloat16" in messages[0]
