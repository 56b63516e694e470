"""Chapter 14: PyTorch's OpInfo and ModuleInfo samples on acme, and the runner that runs them.

`nox -s conformance` runs every sample of every op in eleven dtypes, forward and
backward, every module, and the edge sweeps. Here the quick subset runs: the
first sample of every op in float32 forward and through the edge sweeps (second
derivatives in float64; every error input), and the first input of every module
in float32, in the same crash-isolated workers, with the same judgement.
The runner itself is checked with a suite of planted outcomes: a crash, a hang,
a mismatch, a clear error, a skip and a known failure each land where they should.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import LAST, composites_where_the_cpu_has_a_kernel, run_in_stage
from tools import conformance, versions
from torch_acme import _build_info

pytestmark = pytest.mark.skipif(_build_info.STAGE < 14,
                                reason=f"the stage under test ({_build_info.STAGE}) predates chapter 14")

# What the issue asks of the finished backend: of the tests the CPU can run,
# at least 99 % of op tests and 98 % of module tests pass on acme, with no
# crash and no silent mismatch.
OP_TARGET, MODULE_TARGET = 0.99, 0.98


@pytest.fixture(scope="module")
def quick():
    run = conformance.run(stage=LAST, quick=True)
    conformance.save(run, conformance.BUILD / "conformance" / "quick.json", stage=LAST, quick=True,
                     command="python tools/conformance.py --quick")
    print(conformance.describe(run))
    return run


def test_quick_subset_has_no_crash_and_no_silent_mismatch(quick):
    bad = [f"{r['status']}: {r['test']}: {r['reason'][:500]}" for r in quick.results
           if r["status"] in ("crash", "mismatch", "harness", "xpass")]
    assert not bad, "\n".join(bad)


def test_quick_subset_meets_the_pass_targets(quick):
    summary = conformance.summary(quick.results)
    assert summary["forward"]["judged"] > 600 and summary["module"]["judged"] > 100
    assert summary["forward"]["pass_rate"] >= OP_TARGET, summary["forward"]
    assert summary["module"]["pass_rate"] >= MODULE_TARGET, summary["module"]
    # The edge sweeps: each judges hundreds of ops (layout: those with 4-D or 5-D samples;
    # out: those with an out= form; errors: those whose OpInfo has error inputs).
    for kind, least in {"extremal": 500, "empty": 300, "layout": 30, "noncontiguous": 400,
                        "out": 300, "errors": 150, "gradgrad": 200}.items():
        assert summary[kind]["judged"] > least, (kind, summary[kind])
        assert summary[kind]["pass_rate"] >= OP_TARGET, (kind, summary[kind])


def test_quick_subset_covers_every_op_and_module(quick):
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.testing._internal.common_modules import module_db

    ops = {r["name"] for r in quick.results if r["kind"] == "forward"}
    modules = {r["name"] for r in quick.results if r["kind"] == "module"}
    float32_ops = {op.formatted_name for op in op_db if "float32" in str(op.dtypes)}
    assert float32_ops <= ops, sorted(float32_ops - ops)[:10]
    assert {m.formatted_name for m in module_db} <= modules


def test_the_published_whole_run_is_current_and_has_no_crash_or_silent_mismatch(quick):
    # The run the site and chapter 14 show where `nox -s conformance` has not
    # run (docs/_generated/, written by `tools/conformance.py --publish`).
    data = conformance.load(conformance.PUBLISHED)
    meta = data["meta"]
    assert not meta.get("quick") and not meta.get("select"), meta
    assert meta["torch"].split("+")[0] == versions.pinned_release() and meta["stage"] == LAST, meta
    assert {r["kind"] for r in data["results"]} == set(conformance.KINDS)
    bad = [f"{r['status']}: {r['test']}: {r['reason'][:300]}" for r in data["results"]
           if r["status"] in ("crash", "mismatch", "harness", "xpass")]
    assert not bad, "\n".join(bad)
    if torch.__version__.split("+")[0] == versions.pinned_release():
        # Every test the quick subset ran is in it: a new OpInfo, sweep or stage
        # asks for a new whole run.
        missing = sorted({r["test"] for r in quick.results} - {r["test"] for r in data["results"]})
        assert not missing, f"{len(missing)} tests not in the published run, e.g. {missing[:5]}"
    # A whole run: every sample in eleven dtypes, several times what the quick subset judges.
    judged = conformance.summary(data["results"])["forward"]["judged"]
    assert judged > 4 * conformance.summary(quick.results)["forward"]["judged"], judged


def test_pytorch_still_leaves_ihfftn_out_unwritten():
    # Why tools/conformance_overrides.py skips test_out for fft.ihfft2 and
    # fft.ihfftn: with one transformed dimension their composite's
    # at::conj_physical_out(tmp, out) writes into tmp (the out= overload takes
    # out first), so out keeps whatever it held. When this fails, PyTorch has
    # fixed it, and the two rows go.
    x = torch.randn(5, 6, 7)
    for transform in (torch.fft.ihfftn, torch.fft.ihfft2):
        result = transform(x, dim=(2,))
        out = torch.full(result.shape, 7 + 7j, dtype=result.dtype)
        assert transform(x, dim=(2,), out=out) is out
        assert (out == 7 + 7j).all(), transform
        assert not torch.equal(out, result)


PLANTED = '''
import os, time, unittest
import torch_acme
from torch.testing._internal.common_utils import TestCase

class Mismatch(AssertionError):
    pass

class DeviceError(RuntimeError):
    pass

class Close(Exception):
    pass

class TestConformanceFAKE(TestCase):
    def test_forward_first_fake_float32(self):
        pass
    def test_forward_crash_fake_float32(self):
        os.abort()
    def test_forward_hang_fake_float32(self):
        time.sleep(60)
    def test_forward_wrong_fake_float32(self):
        raise Mismatch("2 != 3")
    def test_forward_rounding_fake_float32(self):
        raise Close("2e-5 apart")
    def test_forward_refused_fake_float32(self):
        raise DeviceError("NotImplementedError: no kernel")
    def test_forward_cpu_cannot_fake_float32(self):
        raise unittest.SkipTest("the CPU raised on all 2 samples")
    @unittest.expectedFailure
    def test_forward_known_fake_float32(self):
        raise Mismatch("a known gap")
    @unittest.expectedFailure
    def test_forward_fixed_fake_float32(self):
        pass
    def test_forward_broken_harness_fake_float32(self):
        raise KeyError("oops")
    def test_module_nn_Thing_train_mode_fake_float64(self):
        pass
'''


def test_runner_isolates_crashes_and_classifies_outcomes(tmp_path):
    suite = tmp_path / "planted_suite.py"
    suite.write_text(PLANTED)
    run = conformance.run(stage=LAST, suite=suite, timeout=10)
    got = {r["name"]: r for r in run.results}
    assert {name: r["status"] for name, r in got.items()} == {
        "first": "pass", "crash": "crash", "hang": "crash", "wrong": "mismatch", "rounding": "close",
        "refused": "error", "cpu_cannot": "cpu-unsupported", "known": "xfail",
        "fixed": "xpass", "broken_harness": "harness", "nn_Thing": "pass"}
    assert "signal 6" in got["crash"]["reason"]
    assert "hung" in got["hang"]["reason"]
    assert got["nn_Thing"]["mode"] == "train" and got["nn_Thing"]["dtype"] == "float64"
    assert "2 != 3" in got["wrong"]["reason"]


def test_results_file_round_trips(tmp_path):
    run = conformance.Run(results=[{"test": "T.test_forward_add_acme_float32", "status": "pass",
                                    "reason": "", "seconds": 0.1, **conformance.parse(
                                        "T.test_forward_add_acme_float32")}], seconds=1.0)
    conformance.save(run, tmp_path / "r.json", stage=LAST)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["summary"]["forward"]["pass_rate"] == 1.0
    assert data["results"][0]["name"] == "add"


def test_no_implicit_composite_runs_where_the_cpu_has_a_kernel():
    # AutogradCPU skips a CompositeImplicitAutograd kernel when the CPU has its
    # own; AutogradPrivateUse1 ran it until chapter 14 registered an acme
    # kernel for those ops (silu_backward's native, the others the CPU
    # fallback). A new such op fails here.
    assert composites_where_the_cpu_has_a_kernel("CompositeImplicitAutograd") == []


# The edge sweeps (extremal values, emptied dimensions, channels-last inputs,
# out= tensors, second derivatives) on the cases that made chapter 14 change
# code: at stage 13 they report each difference, at the last stage each passes.
EDGE_CASES = (r"test_(layout_nn_functional_(pixel_shuffle|pad_replicate)_acme_float32"
              r"|gradgrad_nn_functional_scaled_dot_product_attention_acme_float64"
              r"|module_nn_ReflectionPad3d_acme_float32|out_mode_acme_float32)$")


@pytest.mark.parametrize("stage", [13, LAST])
def test_edge_sweeps_find_what_chapter_14_fixed(stage, last_stage_cases):
    results = (last_stage_cases if stage == LAST
               else conformance.run(stage=stage, select=EDGE_CASES).results)
    results = [r for r in results if re.search(EDGE_CASES, r["test"])]
    got = {r["name"]: r for r in results}
    assert set(got) == {"nn_functional_pixel_shuffle", "nn_functional_pad_replicate",
                        "nn_functional_scaled_dot_product_attention", "nn_ReflectionPad3d", "mode"}, got
    if stage == LAST:
        assert all(r["status"] == "pass" for r in results), results
        return
    for name in ("nn_functional_pixel_shuffle", "nn_functional_pad_replicate", "nn_ReflectionPad3d"):
        assert got[name]["status"] == "mismatch" and "strides" in got[name]["reason"], got[name]
    sdpa = got["nn_functional_scaled_dot_product_attention"]
    assert sdpa["status"] == "error" and "derivative for" in sdpa["reason"], sdpa
    assert got["mode"]["status"] == "error" and "RuntimeError" in got["mode"]["reason"], got["mode"]


# linear_cross_entropy's chunked path asks PyTorch's Python which dtype to
# accumulate half precision in, by device type: float32 on CUDA and the CPU,
# the input's dtype elsewhere. On 2.15 a bfloat16 sample then differed from the
# CPU by 2.6 % with no error; from chapter 14 acme answers as CUDA.
ACC_PROBE = ("import torch, torch_acme\n"
             "from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions\n"
             "print(LinearCrossEntropyOptions._resolve_auto_acc_dtype(\n"
             "    torch.bfloat16, torch.device(torch_acme.DEVICE_NAME)))")
LCE_BFLOAT16 = r"test_(forward|backward)_nn_functional_linear_cross_entropy_chunked_acme_bfloat16$"


@pytest.fixture(scope="module")
def last_stage_cases():
    """The edge cases and the linear_cross_entropy ones at the last stage, in one
    run: a run's workers cost more to start than these tests take."""
    return conformance.run(stage=LAST, select=f"(?:{EDGE_CASES})|(?:{LCE_BFLOAT16})").results


def test_linear_cross_entropy_accumulates_half_precision_as_on_cuda(last_stage_cases):
    assert run_in_stage(13, ACC_PROBE).stdout.strip() == "None"
    assert run_in_stage(14, ACC_PROBE).stdout.strip() == "torch.float32"
    options = torch.nn.modules.linear_cross_entropy_options.LinearCrossEntropyOptions
    assert options._resolve_auto_acc_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    results = [r for r in last_stage_cases if re.search(LCE_BFLOAT16, r["test"])]
    assert len(results) == 2 and all(r["status"] == "pass" for r in results), results


def test_form_check_sees_named_tuples_and_aliasing():
    import conformance_suite as suite
    from torch.testing._internal.opinfo.core import SampleInput

    x = torch.arange(4.0)
    inputs = SampleInput(x)
    suite._check_form(inputs, x.view(2, 2), inputs, x.view(2, 2), inputs)  # the same: no error
    with pytest.raises(suite.Mismatch, match="alias inputs differently"):
        suite._check_form(inputs, x.view(2, 2), inputs, x.clone(), inputs)
    with pytest.raises(suite.Mismatch, match="structure differs"):
        suite._check_form(inputs, torch.frexp(x), inputs, tuple(torch.frexp(x)), inputs)



ONLY_FOR = """
import torch, torch_acme
from torch.testing._internal.common_device_type import instantiate_device_type_tests
from torch.testing._internal.common_utils import TestCase

class TestTiny(TestCase):
    def test_device(self, device):
        pass

scope = {{"TestTiny": TestTiny}}
instantiate_device_type_tests(TestTiny, scope, only_for={name!r})
made = scope[next(iter(scope))]
print(made.__name__, sorted(n for n in dir(made) if n.startswith("test_device")))
"""


def test_only_for_takes_either_name_of_the_backend():
    # Chapter 14: common_device_type normalises the backend's name, so
    # only_for="privateuse1" and only_for="acme" make the same class (one
    # instantiation per process: a second one would find the base renamed).
    device = torch._C._get_privateuse1_backend_name()
    made = {}
    for name in ("privateuse1", device, "cpu"):
        out = run_in_stage(LAST, ONLY_FOR.format(name=name))
        assert out.returncode == 0, out.stderr
        made[name] = out.stdout.strip().splitlines()[-1]
    assert made["privateuse1"] == made[device] == f"TestTinyPRIVATEUSE1 ['test_device_{device}']", made
    assert made["cpu"] == "TestTinyCPU ['test_device_cpu']", made


def test_every_declared_gap_names_a_real_operator_test_and_dtype():
    """A row of tools/conformance_overrides.py with a misspelt operator or test
    would decorate nothing, and the gap would go unnoticed: each must exist."""
    from pathlib import Path

    from torch.testing._internal.common_methods_invocations import op_db
    from tools.conformance_overrides import OVERRIDES

    names = {op.full_name for op in op_db}
    suite = (Path(__file__).parent / "conformance_suite.py").read_text()
    for row in OVERRIDES:
        assert row.op in names, row
        assert re.search(rf"^    def {row.test}\(self, device, ", suite, re.M), row
        assert row.kind in ("skip", "expected failure"), row
        assert all(isinstance(getattr(torch, name, None), torch.dtype) for name in row.dtypes or ()), row
        assert row.reason, row
        assert row.releases is None or set(row.releases) <= set(versions.RELEASES), row
