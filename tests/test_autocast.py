"""Chapter 4: acme's autocast policies, op by op, against CUDA's list, the dispatcher and the CPU.

acme registers the op lists PyTorch's own CUDA autocast expands. Here: the
set of ops with an AutocastPrivateUse1 kernel is the set with an AutocastCUDA
kernel on the running release (less cuDNN's own ops); PyTorch's own CUDA
autocast expectations (torch.testing._internal.autocast_test_lists) hold on
acme; and every op of the table, under autocast to float16 and to bfloat16
with float32, low-precision and mixed inputs, gives the dtype its policy
promises, the values of the op computed in float32 on the CPU (within the low
dtype's rounding) and, where the CPU's autocast gives the same dtype, the CPU's
autocast result.
"""

from __future__ import annotations

import importlib
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_acme
from autocast_cases import (CUDA_KERNEL_ONLY, LOW, MIXES, NO_CPU_KERNEL, RECIPES, expected_dtype,
                            make_inputs, reference)
from conftest import dispatch_row

STAGE = importlib.import_module("torch_acme._build_info").STAGE
pytestmark = pytest.mark.skipif(STAGE < 4, reason="chapter 4's autocast is not in this stage")

DEVICE = torch._C._get_privateuse1_backend_name()
POLICIES = dict(torch_acme._C.autocast.policies()) if STAGE >= 4 else {}
CAST = sorted(op for op, policy in POLICIES.items()
              if policy != "banned" and op not in CUDA_KERNEL_ONLY)
# A few units in the last place of each low dtype.
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 4e-2}


def registered(key: str) -> set[str]:
    return {name for name in torch._C._dispatch_get_all_op_names()
            if torch._C._dispatch_has_kernel_for_dispatch_key(name, key)}


def test_the_table_is_what_the_dispatcher_has():
    # acme's own operators bring their autocast kernels with them (chapter 15).
    own = {"acme::bias_gelu"} if STAGE >= 15 else set()
    assert registered("AutocastPrivateUse1") == set(POLICIES) | own
    for op in POLICIES:
        row = dispatch_row(op, "AutocastPrivateUse1")
        assert "autocast.cpp" in row and "[kernel]" in row, row
    for op in own:
        assert "custom_ops.cpp" in dispatch_row(op, "AutocastPrivateUse1")
    # Every other op skips the key.
    assert "fallthrough" in dispatch_row("aten::sin", "AutocastPrivateUse1")


def test_the_table_is_cudas_on_this_release():
    # What CUDA's autocast registered in this very process (a CPU build of
    # PyTorch registers it too): a release that adds an op to CUDA's list adds
    # it to acme's, or this fails.
    cuda = registered("AutocastCUDA")
    # cuDNN's own ops. A PyTorch built with cuDNN (the CUDA wheels) also has
    # _cudnn_rnn's rule (ATen/cudnn/AutocastRNN.cpp); a CPU build does not.
    cudnn_only = {op for op in cuda if op.startswith(("aten::cudnn_", "aten::_cudnn_"))}
    assert cudnn_only - {"aten::_cudnn_rnn"} == {"aten::cudnn_convolution",
                                                  "aten::cudnn_convolution_transpose"}
    assert set(POLICIES) == cuda - cudnn_only, set(POLICIES) ^ (cuda - cudnn_only)


def test_every_op_of_the_table_has_a_recipe():
    assert set(RECIPES) == set(POLICIES), set(RECIPES) ^ set(POLICIES)
    assert set(POLICIES.values()) == {"lower_precision_fp", "fp32", "fp32_set_opt_dtype",
                                      "fp32_append_dtype", "promote", "banned"}


@pytest.mark.parametrize("op, low, mix", list(itertools.product(CAST, LOW, MIXES)),
                         ids=lambda v: str(v).removeprefix("torch.").removeprefix("aten::"))
def test_policy(op, low, mix):
    policy, recipe = POLICIES[op], RECIPES[op]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback's notices, deprecations
        with torch.autocast(device_type=DEVICE, dtype=low):
            result = recipe(make_inputs(DEVICE, mix, low)).cpu()
        assert result.dtype == expected_dtype(policy, mix, low)

        # Values: the op in float32 on the CPU, from the same (already rounded) inputs.
        tolerance = 1e-5 if result.dtype == torch.float32 else TOLERANCE[low]
        torch.testing.assert_close(result.float(), reference(op, mix, low),
                                   rtol=tolerance, atol=tolerance)

        # The CPU's autocast has policies of its own, and refuses some mixes
        # (its kernels want one dtype where it casts nothing). Where it gives
        # acme's dtype, the results agree within the low dtype's rounding: its
        # list may lower an op inside a composite that CUDA's keeps in float32.
        if op in NO_CPU_KERNEL:
            return
        try:
            with torch.autocast(device_type="cpu", dtype=low):
                on_cpu = recipe(make_inputs("cpu", mix, low))
        except RuntimeError:
            assert mix != "float32", "the CPU's autocast refused float32 inputs"
            return
    if on_cpu.dtype == result.dtype:
        torch.testing.assert_close(result, on_cpu, rtol=TOLERANCE[low], atol=TOLERANCE[low])


@pytest.mark.parametrize("op", sorted(CUDA_KERNEL_ONLY))
def test_cudas_own_kernels_are_refused_by_name(op):
    assert op in POLICIES
    for device in (DEVICE, "cpu"):
        with pytest.raises(NotImplementedError, match=f"Could not run '{op}'"):
            with torch.autocast(device_type=device, dtype=torch.bfloat16):
                RECIPES[op](make_inputs(device, "float32", torch.bfloat16))


def run_listed(name, args, kwargs=None, module=torch):
    call = getattr(module, name, None) or getattr(torch.nn.functional, name, None)
    if call is None:  # a Tensor method such as __matmul__
        return getattr(args[0], name)(*args[1:], **(kwargs or {}))
    return call(*args, **(kwargs or {}))


def test_cudas_own_autocast_expectations_hold():
    # PyTorch's own lists of what CUDA's autocast must give (test/test_cuda.py
    # runs them on CUDA), built on acme tensors and run under acme's autocast.
    from torch.testing._internal.autocast_test_lists import AutocastTestLists

    lists = AutocastTestLists(DEVICE)
    expect = {"torch_fp16": torch.float16, "nn_fp16": torch.float16,
              "linalg_fp16": torch.float16, "methods_fp16": torch.float16,
              "torch_fp32": torch.float32, "nn_fp32": torch.float32,
              "methods_fp32": torch.float32, "torch_need_autocast_promote": torch.float32}
    modules = {"nn_fp16": torch._C._nn, "nn_fp32": torch._C._nn, "linalg_fp16": torch._C._linalg}
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for list_name, dtype in expect.items():
            for entry in getattr(lists, list_name):
                name, args, *rest = entry
                if name.startswith("cudnn_"):
                    continue  # cuDNN's own ops: no meaning on acme
                if name == "einsum":
                    continue  # its entry gives 2-D operands to a 4-D equation: fails anywhere
                kwargs = rest[0] if rest and isinstance(rest[0], dict) else None
                with torch.autocast(device_type=DEVICE, dtype=torch.float16):
                    out = run_listed(name, args, kwargs, modules.get(list_name, torch))
                out = out[0] if isinstance(out, tuple) else out
                assert out.dtype == dtype, (list_name, name, out.dtype)
                checked += 1
        for name, args, dtype in lists.torch_expect_builtin_promote:
            with torch.autocast(device_type=DEVICE, dtype=torch.float16):
                out = getattr(torch, name)(*args)
            if isinstance(out, torch.Tensor):
                assert out.dtype == dtype, (name, out.dtype)
            checked += 1
        for name, args, module in lists.banned:
            with torch.autocast(device_type=DEVICE, dtype=torch.float16):
                with pytest.raises(RuntimeError, match="unsafe to autocast"):
                    getattr(module, name)(*args)
            checked += 1
    assert checked > 100


def test_binary_cross_entropy_is_refused_inside_autocast_only():
    x = torch.rand(3, 4, device=DEVICE).sigmoid()
    y = torch.rand(3, 4, device=DEVICE)
    with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(x, y)
    expected = F.binary_cross_entropy(x.cpu(), y.cpu())
    torch.testing.assert_close(F.binary_cross_entropy(x, y).cpu(), expected)


def tiny_lm_losses(device: str, steps: int = 3) -> list[float]:
    """A small next-token model trained under bf16 autocast: each step's loss."""
    torch.manual_seed(0)
    vocab, width = 32, 16
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, width), torch.nn.Linear(width, width),
                                torch.nn.GELU(), torch.nn.LayerNorm(width),
                                torch.nn.Linear(width, vocab)).to(device)
    tokens = torch.randint(vocab, (8, 12)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32, loss.dtype
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_a_bf16_training_loop_reports_the_cpus_loss():
    # cross_entropy asks log_softmax for the logits' dtype (bfloat16), so the
    # loss is float32 only because nll_loss is in CUDA's fp32 list (before acme
    # took CUDA's list, it came out bfloat16). The CPU's own list lowers other
    # ops than CUDA's, hence a tolerance.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on_acme, on_cpu = tiny_lm_losses(DEVICE), tiny_lm_losses("cpu")
    assert on_acme[-1] < on_acme[0]
    torch.testing.assert_close(on_acme, on_cpu, rtol=1e-3, atol=0)


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
