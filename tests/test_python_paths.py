"""The Python tabs of chapters 2-4 work: each registration, run from Python on the
stage *before* its chapter, gives that stage the chapter's capability.

Each test runs one fresh process against the earlier stage (one PrivateUse1
backend per process): it first shows the capability missing, then executes the
file from tests/python_paths/ the chapter includes, then checks the capability
against the CPU and that the Python registration is what serves it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from conftest import THIRD_PARTY, built_stages, run_in_stage

PATHS = Path(__file__).resolve().parent / "python_paths"

# Shared by every script: a helper for dispatch-table rows, and the file to run.
PRELUDE = """
import gc, runpy, warnings
import torch
import torch_acme

def row(op, key):
    rows = torch._C._dispatch_dump_table(op).splitlines()
    return next((r for r in rows if r.startswith(key + ":")), "")

def register():
    return runpy.run_path({path!r})

def count_backward_calls(function):
    # Wraps an autograd.Function's backward; returns the list of devices it saw.
    calls = []
    backward = function.backward
    def counted(ctx, grad):
        calls.append(grad.device.type)
        return backward(ctx, grad)
    function.backward = staticmethod(counted)
    return calls
"""


def run(request, stage: int, chapter: int, filename: str, body: str):
    if chapter not in built_stages(request.config):
        pytest.skip(f"chapter {chapter} is beyond --upto")
    code = (textwrap.dedent(PRELUDE).format(path=str(PATHS / filename))
            + textwrap.dedent(body) + "\nprint('python path checked')\n")
    proc = run_in_stage(stage, code)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("python path checked"), (
        f"stage {stage} with {filename} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_ch02_fallback_from_python_at_stage_1(request):
    run(request, 1, 2, "ch02_fallback.py", """
        from torch_acme import runtime

        # Stage 1: only the minimal ops; sin has nowhere to go on acme.
        try:
            torch.sin(torch.zeros(2, device="privateuseone"))
        except NotImplementedError as error:
            assert "PrivateUse1" in str(error), error
        else:
            raise AssertionError("stage 1 already runs sin on acme")
        assert not torch._C._dispatch_has_backend_fallback(torch._C.DispatchKey.PrivateUse1)

        register()
        fallback_row = row("aten::tril_indices", "PrivateUse1")
        assert "ch02_fallback.py" in fallback_row and "[backend fallback]" in fallback_row, fallback_row
        abs_row = row("aten::abs", "PrivateUse1")
        assert "ch02_fallback.py" in abs_row and "[kernel]" in abs_row, abs_row

        def check():
            x_cpu = torch.linspace(-2, 2, 12).reshape(3, 4)
            x = x_cpu.to("privateuseone")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cases = {
                    "sin": (torch.sin(x), torch.sin(x_cpu)),
                    "add": (x + 1, x_cpu + 1),
                    "matmul": (x @ x.t(), x_cpu @ x_cpu.t()),
                    "softmax": (torch.softmax(x, dim=1), torch.softmax(x_cpu, dim=1)),
                    "max": (x.max(), x_cpu.max()),
                    "topk": (torch.topk(x, 2).indices, torch.topk(x_cpu, 2).indices),
                    "abs": (torch.abs(x), torch.abs(x_cpu)),
                    "2 // t": (2 // x, 2 // x_cpu),
                    "tril_indices": (torch.tril_indices(3, 3, device="privateuseone"),
                                     torch.tril_indices(3, 3)),
                }
                for _ in range(3):
                    torch.cos(x)
            for name, (on_acme, on_cpu) in cases.items():
                assert on_acme.device.type == "privateuseone", (name, on_acme.device)
                assert torch.equal(on_acme.cpu(), on_cpu), name

            # One warning per op, however often it runs.
            messages = [str(w.message) for w in caught]
            assert sum("aten::cos" in m for m in messages) == 1, messages
            assert any("aten::sin.out has no privateuseone kernel" in m for m in messages), messages

            # In-place and out= write into the acme tensor (out= resized from [0]).
            y = x.clone()
            assert y.mul_(2) is y and torch.equal(y.cpu(), x_cpu * 2)
            out = torch.empty(0, device="privateuseone")
            torch.exp(x, out=out)
            assert out.shape == x.shape and torch.equal(out.cpu(), torch.exp(x_cpu))
            d = x.diagonal()  # an as_strided view: fill_ falls back and writes through it
            d.fill_(0.0)
            assert torch.equal(x.cpu().diagonal(), torch.zeros(3))

            # Views never fall back.
            try:
                x.unfold(0, 2, 1)
            except NotImplementedError as error:
                assert "aten::unfold is a view operator" in str(error), error
            else:
                raise AssertionError("unfold fell back")

        check()
        gc.collect()
        assert runtime.memory_stats(0)["bytes_in_use"] == 0, runtime.memory_stats(0)
    """)


def test_ch03_tanh_autograd_from_python_at_stage_2(request):
    run(request, 2, 3, "ch03_autograd.py", """
        x_cpu = torch.tensor([0.5, -1.0, 2.0])
        x = x_cpu.to("privateuseone").requires_grad_()

        # Stage 2: tanh on acme records PyTorch's own formula.
        assert "VariableType" in row("aten::tanh", "AutogradPrivateUse1")
        assert torch.tanh(x).grad_fn.name() == "TanhBackward0"

        warnings.simplefilter("ignore")  # the CPU fallback's notices
        path = register()
        tanh_row = row("aten::tanh", "AutogradPrivateUse1")
        assert "ch03_autograd.py" in tanh_row and "[kernel]" in tanh_row, tanh_row
        # Only acme's entry changed: the CPU and sin keep PyTorch's formulas.
        assert "VariableType" in row("aten::tanh", "AutogradCPU")
        assert torch.sin(x).grad_fn.name() == "SinBackward0"

        calls = count_backward_calls(path["AcmeTanh"])

        y = torch.tanh(x)
        assert y.grad_fn.name() == "AcmeTanhBackward", y.grad_fn.name()
        assert torch.equal(y.detach().cpu(), torch.tanh(x_cpu))

        # The autograd engine cannot run on acme yet at stage 2: it needs the
        # PrivateUse1 hooks (chapter 3's C++, with no Python route). The node the
        # Python kernel recorded is itself callable, and gives tanh's gradient.
        # (A PyTorch built with an accelerator of its own, e.g. a CUDA wheel,
        # hands the engine that one instead: it fails in that device's runtime.)
        try:
            y.sum().backward()
        except RuntimeError as error:
            if torch.accelerator.current_accelerator() is None:
                assert "Cannot access accelerator device" in str(error), error
        else:
            raise AssertionError("stage 2 ran backward on acme")
        grad = y.grad_fn.apply(torch.ones(3, device="privateuseone"))
        x_ref = x_cpu.clone().requires_grad_()
        torch.tanh(x_ref).sum().backward()
        assert calls == ["privateuseone"], calls
        assert grad.device.type == "privateuseone"
        assert torch.allclose(grad.cpu(), x_ref.grad), (grad.cpu(), x_ref.grad)
    """)


def test_ch03_python_override_runs_end_to_end_at_stage_3(request):
    # With the hooks present (stage 3), the engine runs the Python override's
    # backward end to end. (acme's own C++ override is registered on request
    # only: the entry is PyTorch's formula until this file takes it.)
    run(request, 3, 3, "ch03_autograd.py", """
        assert "VariableType" in row("aten::tanh", "AutogradPrivateUse1")
        warnings.simplefilter("ignore")
        path = register()
        tanh_row = row("aten::tanh", "AutogradPrivateUse1")
        assert "ch03_autograd.py" in tanh_row and "[kernel]" in tanh_row, tanh_row

        calls = count_backward_calls(path["AcmeTanh"])

        x_cpu = torch.tensor([0.5, -1.0, 2.0])
        x = x_cpu.to("privateuseone").requires_grad_()
        y = torch.tanh(x)
        assert y.grad_fn.name() == "AcmeTanhBackward", y.grad_fn.name()
        y.sum().backward()
        x_ref = x_cpu.clone().requires_grad_()
        torch.tanh(x_ref).sum().backward()
        assert calls == ["privateuseone"], calls
        assert torch.allclose(x.grad.cpu(), x_ref.grad), (x.grad.cpu(), x_ref.grad)

        x64 = torch.randn(5, dtype=torch.float64).to("privateuseone").requires_grad_()
        assert torch.autograd.gradcheck(torch.tanh, (x64,))
        assert torch.autograd.gradgradcheck(torch.tanh, (x64,))
    """)


def test_ch04_autocast_from_python_at_stage_3(request):
    run(request, 3, 4, "ch04_autocast.py", """
        a_cpu = torch.rand(3, 4, generator=torch.Generator().manual_seed(0)) + 0.5
        b_cpu = torch.rand(4, 5, generator=torch.Generator().manual_seed(1)) + 0.5
        a, b = a_cpu.to("privateuseone"), b_cpu.to("privateuseone")

        # Stage 3: torch.autocast refuses the device, and no op has a rule.
        try:
            with torch.autocast(device_type="privateuseone", dtype=torch.bfloat16):
                pass
        except AssertionError as error:
            assert "get_amp_supported_dtype" in str(error), error
        else:
            raise AssertionError("stage 3 already supports autocast")
        assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm", "AutocastPrivateUse1")

        warnings.simplefilter("ignore")  # the CPU fallback's notices
        register()
        mm_row = row("aten::mm", "AutocastPrivateUse1")
        assert "ch04_autocast.py" in mm_row and "[kernel]" in mm_row, mm_row
        assert "[kernel]" in row("aten::exp", "AutocastPrivateUse1")
        assert "fallthrough" in row("aten::sin", "AutocastPrivateUse1")

        for low in (torch.float16, torch.bfloat16):
            leaf = a.clone().requires_grad_()
            leaf_cpu = a_cpu.clone().requires_grad_()
            with torch.autocast(device_type="privateuseone", dtype=low):
                mm = torch.mm(leaf, b)
                bmm = torch.bmm(a[None], b[None])
                exp = torch.exp(a.to(low))
                sin = torch.sin(a)
            with torch.autocast(device_type="cpu", dtype=low):
                mm_cpu = torch.mm(leaf_cpu, b_cpu)
                bmm_cpu = torch.bmm(a_cpu[None], b_cpu[None])
            # lower_precision_fp: the autocast dtype, bit for bit the CPU's autocast.
            assert mm.dtype == bmm.dtype == low, (mm.dtype, bmm.dtype)
            assert torch.equal(mm.cpu(), mm_cpu) and torch.equal(bmm.cpu(), bmm_cpu), low
            # fp32: a low-precision input computed in float32.
            assert exp.dtype == torch.float32
            assert torch.equal(exp.cpu(), torch.exp(a_cpu.to(low).float())), low
            # No rule: the fallthrough leaves sin alone.
            assert sin.dtype == torch.float32 and torch.equal(sin.cpu(), torch.sin(a_cpu))
            # The cast is in the graph: a float32 leaf gets a float32 gradient.
            mm.float().sum().backward()
            mm_cpu.float().sum().backward()
            assert leaf.grad.dtype == torch.float32
            assert torch.allclose(leaf.grad.cpu(), leaf_cpu.grad), low

        assert torch.mm(a, b).dtype == torch.float32  # outside autocast: unchanged

        # A dtype set around torch.autocast's own check is refused, as in C++.
        torch.set_autocast_enabled("privateuseone", True)
        torch.set_autocast_dtype("privateuseone", torch.float64)
        try:
            torch.mm(a, b)
        except ValueError as error:
            assert "torch.float64 is not a lower-precision dtype privateuseone supports" in str(error)
        else:
            raise AssertionError("mm ran with a float64 autocast dtype")
        finally:
            torch.set_autocast_enabled("privateuseone", False)
    """)


def test_ch15_third_party_kernel_from_python_at_stage_14(request):
    proc = run(request, 14, 15, "ch15_third_party.py", f"""
        import sys
        sys.path.insert(0, {str(THIRD_PARTY)!r})
        import boxkit

        g = torch.Generator().manual_seed(0)
        corner = torch.rand(60, 2, generator=g) * 10
        boxes = torch.cat([corner, corner + torch.rand(60, 2, generator=g) * 4], 1)
        scores = torch.rand(60, generator=g).round(decimals=1)
        expected = boxkit.nms(boxes, scores, 0.3)

        # Stage 14: no acme kernel; chapter 2's fallback runs the library's CPU kernel.
        assert "cpu_fallback.cpp" in row("boxkit::nms", "PrivateUse1"), row("boxkit::nms", "PrivateUse1")
        before = boxkit.nms(boxes.to("acme"), scores.to("acme"), 0.3)
        assert torch.equal(before.cpu(), expected)

        register()
        assert "ch15_third_party.py" in row("boxkit::nms", "PrivateUse1"), row("boxkit::nms", "PrivateUse1")
        assert row("boxkit::nms", "AutogradPrivateUse1").startswith("AutogradPrivateUse1: fallthrough")
        for threshold in (0.0, 0.3, 0.7, 1.0):
            kept = boxkit.nms(boxes.to("acme").requires_grad_(), scores.to("acme"), threshold)
            assert kept.device.type == "acme" and not kept.requires_grad
            assert torch.equal(kept.cpu(), boxkit.nms(boxes, scores, threshold)), threshold
    """)
    # The fallback's one-time notice came from the call before registering only.
    assert proc.stderr.count("boxkit::nms has no acme kernel") == 1, proc.stderr
