"""Chapter 20: torch.compile on acme.

Dynamo captures acme code through acme's device interface; Inductor writes the
fused kernels as the CPU's C++ and acme's wrapper code runs them through the
runtime, on the current stream, with device-side addresses. Every comparison
here is against eager acme and against the CPU, computed in the same test.
"""

from __future__ import annotations

import copy
import importlib
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_acme  # noqa: F401 - registers torch.acme
from conftest import LAST, stage_env
from tools.compile_models import MODELS, chain, forward_backward
from torch_acme import runtime

pytestmark = [
    pytest.mark.skipif(importlib.import_module("torch_acme._build_info").STAGE < 20,
                       reason="chapter 20's compiler backend is not in this stage"),
    pytest.mark.filterwarnings("ignore:.*runs on the CPU:UserWarning"),
]

TOL = {"atol": 1e-5, "rtol": 1e-4}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def acme_kernels_of(fn):
    """Names of the kernels the runtime ran on acme while `fn` ran."""
    torch.acme.synchronize()
    runtime.activity_enable(True)
    try:
        fn()
        torch.acme.synchronize()
    finally:
        runtime.activity_enable(False)
    return [r["name"] for r in runtime.activity_flush() if r["kind"] == "kernel"]


# ---- the three models of the issue (tools/compile_models.py) ----

@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_compiles_forward_and_backward(name, dynamic):
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    cpu_model = cls()
    eager_model, compiled_model = cls().to("acme"), cls().to("acme")
    eager_model.load_state_dict(cpu_model.state_dict())
    compiled_model.load_state_dict(cpu_model.state_dict())
    x = torch.randn(shape)

    expected_cpu = forward_backward(cpu_model, x)
    expected_acme = forward_backward(eager_model, x.to("acme"))
    compiled = torch.compile(compiled_model, dynamic=dynamic)
    got = None

    def run():
        nonlocal got
        got = forward_backward(compiled, x.to("acme"))

    kernels = acme_kernels_of(run)
    assert any(k.startswith("cpp_fused_") for k in kernels), kernels  # Inductor's, on acme

    for want_cpu, want_acme, have in zip(expected_cpu[:2] + tuple(expected_cpu[2]),
                                         expected_acme[:2] + tuple(expected_acme[2]),
                                         got[:2] + tuple(got[2])):
        assert have.device.type == "acme"
        torch.testing.assert_close(have.cpu(), want_acme.cpu(), **TOL)
        torch.testing.assert_close(have.cpu(), want_cpu, **TOL)
    if dynamic:  # another batch size: the same graph, no recompile
        bigger = torch.randn((2 * shape[0], *shape[1:]))
        torch.testing.assert_close(compiled(bigger.to("acme")).detach().cpu(),
                                   cpu_model(bigger).detach(), **TOL)


@pytest.mark.parametrize("name", list(MODELS))
def test_no_graph_break_in_the_models(name):
    cls, shape = MODELS[name]
    explanation = torch._dynamo.explain(cls().to("acme"))(torch.randn(shape, device="acme"))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_dynamic_shapes_reuse_one_graph_across_sizes():
    def f(x):
        return (x.sin() * 2 + x.cos()).sum(0)

    compiled = torch.compile(f, dynamic=True)
    for rows in (5, 9, 17):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(compiled(x.to("acme")).cpu(), f(x), **TOL)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


# ---- how the kernels run ----

def test_a_chain_of_elementwise_ops_is_one_kernel_launch():
    x = torch.randn(4096, device="acme")
    compiled = torch.compile(chain)
    compiled(x)
    eager = acme_kernels_of(lambda: chain(x))
    fused = acme_kernels_of(lambda: compiled(x))
    assert len(eager) >= 5  # acme's own kernels; sin, cos and exp run on the CPU (fallback)
    assert len(fused) == 1 and fused[0].startswith("cpp_fused_"), fused
    torch.testing.assert_close(compiled(x).cpu(), chain(x.cpu()), **TOL)


def test_compiled_kernels_run_on_the_current_stream_in_order():
    x = torch.zeros(1024, device="acme")
    compiled = torch.compile(lambda t: t * 2 + 1)
    compiled(x)
    side = torch.Stream(device="acme")
    with side:
        torch.acme._sleep(20_000)  # 20 ms of work ahead of the kernels on this stream
        x.add_(3)                 # eager, queued behind the sleep
        y = compiled(x)           # queued behind both: must see x == 3
    side.synchronize()
    assert torch.equal(y.cpu(), torch.full((1024,), 7.0))
    runtime.activity_enable(True)
    try:
        with side:
            compiled(x)
        side.synchronize()
    finally:
        runtime.activity_enable(False)
    kernels = [r for r in runtime.activity_flush() if r["kind"] == "kernel"]
    assert [r["stream"] for r in kernels] == [side.native_handle]


def test_a_graph_on_the_second_device_stays_there():
    if torch.acme.device_count() < 2:
        pytest.skip("needs two acme devices")
    x = torch.randn(100)
    y = torch.compile(chain)(x.to("acme:1"))
    assert y.device == torch.device("acme:1") and torch.acme.current_device() == 0
    torch.testing.assert_close(y.cpu(), chain(x), **TOL)


def test_generated_kernels_touch_device_memory_only_through_the_runtime(tmp_path):
    # The same kernel, called once through the launcher (device-side view) and
    # once with the host mapping of device memory: checked mode ends the
    # process on the second, naming the allocation.
    script = textwrap.dedent('''
        import ctypes, torch, torch_acme
        from torch._inductor.codecache import CppCodeCache
        from torch_acme.inductor import acme_kernel_source
        cpu_kernel = """async_compile.cpp_pybinding(['const float*', 'float*'], r\'\'\'
        #include <torch/csrc/inductor/cpp_prefix.h>
        extern "C" void kernel(const float* in_ptr0, float* out_ptr0) {
            out_ptr0[0] = 2 * in_ptr0[0];
        }
        \'\'\')"""
        signature, source = acme_kernel_source("double_it", cpu_kernel)
        entry = ctypes.cast(CppCodeCache.load(source).kernel, ctypes.c_void_p).value
        x, y = torch.full((1,), 21.0, device="acme"), torch.empty(1, device="acme")
        torch_acme._C._launch_compiled("double_it", entry, signature, (x, y))
        print("through the runtime:", y.item(), flush=True)
        host = (ctypes.c_uint64 * 2)(x.data_ptr(), y.data_ptr())
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(entry)(host)
        print("not reached", flush=True)
    ''')
    proc = subprocess.run([sys.executable, "-c", script], env=stage_env(LAST), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert "through the runtime: 42.0" in proc.stdout, proc.stderr
    assert "not reached" not in proc.stdout
    assert proc.returncode != 0
    assert "the host touched device memory" in proc.stderr


def test_a_failing_compiled_kernel_is_reported_naming_it():
    x = torch.randn(4, 3, device="acme")
    index = torch.tensor([1, 7], device="acme")
    compiled = torch.compile(lambda t, i: t[i] * 2)
    compiled(x, index)  # returns: the kernel fails later, on the stream
    failure = r"kernel cpp_fused_\w+ failed.*index out of bounds"
    with pytest.raises(torch.AcceleratorError, match=failure):
        torch.acme.synchronize()


# ---- what must give the same results compiled and eager ----

def test_custom_ops_compile():
    x, bias = torch.randn(16, 32, device="acme"), torch.randn(32, device="acme")

    def f(x, b):
        return torch.ops.acme.swiglu(x, x * 2) + torch.ops.acme.bias_gelu(x, b)

    explanation = torch._dynamo.explain(f)(x, bias)
    assert explanation.graph_break_count == 0
    xs = [x.clone().requires_grad_() for _ in range(2)]
    eager, compiled = f(xs[0], bias), torch.compile(f)(xs[1], bias)
    eager.sum().backward()
    compiled.sum().backward()
    torch.testing.assert_close(compiled, eager, **TOL)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, **TOL)


def test_autocast_gives_the_same_dtypes_and_values():
    x, w = torch.randn(64, 32, device="acme"), torch.randn(32, 16, device="acme")

    def f(x, w):
        with torch.autocast("acme", dtype=torch.bfloat16):
            return (x @ w).relu() + 1, (x @ w).float().softmax(-1)

    eager, compiled = f(x, w), torch.compile(f)(x, w)
    assert [t.dtype for t in compiled] == [t.dtype for t in eager] == [torch.bfloat16,
                                                                        torch.float32]
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=1e-2, rtol=1e-2)


def test_dropout_with_a_seed_matches_eager_forward_and_backward():
    x = torch.randn(256, 64, device="acme")

    def f(x):
        return F.dropout(x * 2, p=0.5, training=True)

    results = []
    for fn in (f, torch.compile(f)):
        leaf = x.clone().requires_grad_()
        torch.manual_seed(7)
        out = fn(leaf)
        out.sum().backward()
        results.append((out, leaf.grad))
    (eager, eager_grad), (compiled, compiled_grad) = results
    assert torch.equal(compiled.cpu(), eager.cpu())
    assert torch.equal(compiled_grad.cpu(), eager_grad.cpu())
    assert 0.4 < (eager_grad == 0).float().mean().item() < 0.6


# ---- the places Inductor treats only "cpu" as its C++ backend ----

def test_a_cpu_scalar_beside_acme_tensors_stays_a_scalar():
    x = torch.randn(6, 5)

    def f(t):
        return torch.tensor(2.0) * t + 1

    y = torch.compile(f)(x.to("acme"))
    assert y.device.type == "acme"
    torch.testing.assert_close(y.cpu(), f(x), **TOL)


@pytest.mark.parametrize("case", ["permuted", "transposed", "contiguous", "keepdim"])
def test_argmax_over_all_dims_counts_in_logical_order(case):
    x = torch.randn(4, 5, 6)
    f = {"permuted": lambda t: t.permute(2, 0, 1).argmax(),
         "transposed": lambda t: t.transpose(0, 2).argmin(),
         "contiguous": lambda t: t.argmax(),
         "keepdim": lambda t: t.permute(1, 0, 2).argmax(keepdim=True)}[case]
    got, want = torch.compile(f)(x.to("acme")), f(x)
    assert got.shape == want.shape and torch.equal(got.cpu(), want)


def test_identical_kernels_on_the_cpu_and_on_acme_stay_apart():
    def f(a, b):
        return (a * 2 + 1).sin(), (b * 2 + 1).sin()  # the same fused kernel, twice

    a, b = torch.randn(64), torch.randn(64)
    on_cpu, on_acme = torch.compile(f)(a, b.to("acme"))
    assert on_cpu.device.type == "cpu" and on_acme.device.type == "acme"
    torch.testing.assert_close(on_cpu, (a * 2 + 1).sin(), **TOL)
    torch.testing.assert_close(on_acme.cpu(), (b * 2 + 1).sin(), **TOL)


def test_acme_tensors_made_inside_the_compiled_function():
    x = torch.randn(32)

    def f(t):
        return t.to("acme").sin() * torch.ones(32, device="acme")

    got = torch.compile(f)(x)
    assert got.device.type == "acme"
    torch.testing.assert_close(got.cpu(), x.sin(), **TOL)


def test_attention_with_dropout_matches_eager_under_a_seed():
    q = torch.randn(2, 4, 16, 8, device="acme")

    def f(t):
        return F.scaled_dot_product_attention(t, t, t, dropout_p=0.3)

    torch.manual_seed(5)
    eager = f(q)
    torch.manual_seed(5)
    compiled = torch.compile(f)(q)
    torch.testing.assert_close(compiled.cpu(), eager.cpu(), **TOL)


def test_the_backend_code_version_is_in_the_cache_key():
    import uuid

    from torch._dynamo.utils import counters
    from torch_acme import inductor_config

    x = torch.randn(8, device="acme")
    run = uuid.uuid4().hex  # versions no earlier run has cached a graph for
    seen = []
    for version in (f"one-{run}", f"one-{run}", f"two-{run}"):
        torch._dynamo.reset()
        counters.clear()
        with inductor_config.patch(code_version=version):
            torch.compile(lambda t: (t * 3).cos())(x)
        seen.append("hit" if counters["inductor"]["fxgraph_cache_hit"] else "miss")
    assert seen == ["miss", "hit", "miss"]


def test_the_compile_fx_patch_is_in_place_and_the_users_options_win(monkeypatch):
    # Chapter 20's one patch of Inductor: compile_fx replaced process-wide. It
    # relies on torch.compile's Inductor backend importing compile_fx at each
    # call; a release that imports it once would silently bypass the settings.
    import inspect

    import torch._dynamo.backends.inductor as inductor_backend
    import torch._inductor.compile_fx as compile_fx_module
    from torch_acme import inductor

    assert compile_fx_module.compile_fx is inductor.compile_fx
    assert "from torch._inductor.compile_fx import compile_fx" in inspect.getsource(inductor_backend.inductor)
    seen, real = [], inductor._compile_fx

    def original(model, example_inputs, *args, config_patches=None, **kwargs):
        seen.append(config_patches)
        return real(model, example_inputs, *args, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(inductor, "_compile_fx", original)
    torch.compile(lambda t: t.sin() + 1, options={"fallback_random": False})(torch.randn(4, device="acme"))
    torch.compile(lambda t: t.cos() + 1)(torch.randn(4))  # a CPU graph: no settings
    acme_patches, cpu_patches = seen[0], seen[-1]
    assert acme_patches["cuda_backend"] == "cpp" and acme_patches["fallback_random"] is False
    assert not (cpu_patches or {}).get("cuda_backend"), cpu_patches


# ---- Dynamo and the device's own calls ----

def test_a_compiled_function_follows_the_current_device():
    if torch.acme.device_count() < 2:
        pytest.skip("needs two acme devices")

    def f(x):
        return x + torch.acme.current_device(), torch.acme.current_stream()

    compiled = torch.compile(f)
    x = torch.zeros(4)
    try:
        for device in (0, 1):
            torch.acme.set_device(device)
            got, stream = compiled(x.to(f"acme:{device}"))
            assert torch.equal(got.cpu(), torch.full((4,), float(device)))
            assert stream.device_index == device
    finally:
        torch.acme.set_device(0)


def test_dynamo_traces_device_queries_without_breaking_the_graph():
    def f(x):
        stream = torch.acme.current_stream()
        return x.sin() + torch.acme.device_count() + torch.acme.current_device(), stream

    x = torch.randn(8, device="acme")
    explanation = torch._dynamo.explain(f)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    got, stream = torch.compile(f, fullgraph=True)(x)
    torch.testing.assert_close(got, f(x)[0], **TOL)
    assert stream == torch.acme.current_stream()


def test_streams_in_a_compiled_graph_run_without_inductor_and_say_so():
    def f(x):
        side = torch.Stream(device="acme")
        with side:
            y = x.cos() * 2
        torch.acme.current_stream().wait_stream(side)
        torch.acme.synchronize()
        return y + 1

    x = torch.randn(64, device="acme")
    assert torch._dynamo.explain(f)(x).graph_break_count == 0
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(f)(x)
    assert any("streams, events or synchronize" in str(w.message) for w in caught)
    torch.testing.assert_close(got, f(x), **TOL)


def test_unsupported_wrappers_raise_naming_the_device():
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed,
                       match="acme: torch.compile with the C\\+\\+ wrapper"):
        torch.compile(lambda t: t + 1, options={"cpp_wrapper": True})(
            torch.ones(2, device="acme"))


def test_acmes_own_dynamo_backend_gets_aten_graphs_and_keeps_acmes_kernels_whole():
    from torch._dynamo.backends.registry import list_backends
    from torch_acme import graph_backend

    assert graph_backend.NAME in list_backends()
    graph_backend.graphs.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 2))
    twin = copy.deepcopy(model).to("acme")
    x = torch.rand(4, 8)
    got = torch.compile(twin, backend=graph_backend.NAME)(x.to("acme"))
    got.sum().backward()
    want = model(x)
    want.sum().backward()
    torch.testing.assert_close(got.cpu(), want, **TOL)
    for mine, theirs in zip(twin.parameters(), model.parameters()):
        torch.testing.assert_close(mine.grad.cpu(), theirs.grad, **TOL)
    forward, backward = graph_backend.graphs
    assert (forward["kind"], backward["kind"]) == ("forward", "backward")
    # Operators acme has kernels for reach the compiler whole; core ATen's
    # table alone would split GELU's backward into erf, exp and arithmetic.
    assert "aten.gelu_backward.default" in backward["ops"]
    assert "aten.native_layer_norm_backward.default" in backward["ops"]
    assert forward["no_kernel"] == backward["no_kernel"] == []
    from torch._decomp import core_aten_decompositions
    assert torch.ops.aten.gelu_backward.default in core_aten_decompositions()
    assert torch.ops.aten.gelu_backward.default not in graph_backend.decompositions()
    # An operator without an acme kernel is named (it takes the CPU fallback).
    graph_backend.graphs.clear()
    t = torch.rand(5, device="acme")
    torch.testing.assert_close(torch.compile(lambda a: a.cumsum(0) * 2,
                                             backend=graph_backend.NAME)(t).cpu(),
                               t.cpu().cumsum(0) * 2)
    assert graph_backend.graphs[0]["no_kernel"] == ["aten.cumsum.default"]
