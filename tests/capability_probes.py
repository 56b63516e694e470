"""One probe per chapter: does the capability that chapter adds work here?

Run as a script inside a stage's environment; prints {chapter: true/false} as
JSON. Each probe exercises the capability for real and checks its result; any
exception means "absent".
"""

import json
import sys


def device(index=None):
    """The backend's device string: "privateuseone" until chapter 8 renames it."""
    import torch

    name = torch._C._get_privateuse1_backend_name()
    return name if index is None else f"{name}:{index}"


def ch00_runtime():
    from torch_acme import runtime

    ptr = runtime.malloc(4)
    runtime.copy_to_device(ptr, b"acme")
    ok = runtime.copy_to_host(ptr, 4) == b"acme"
    runtime.free(ptr)
    return ok


def ch01_minimal_ops():
    import torch
    import torch_acme  # noqa: F401

    host = torch.arange(6.0).reshape(2, 3)
    return torch.equal(host.to(device()).t().cpu(), host.t())


def ch02_cpu_fallback():
    import torch
    import torch_acme  # noqa: F401

    host = torch.arange(6.0)
    return torch.equal(torch.sin(host.to(device())).cpu(), torch.sin(host))


def ch03_autograd():
    import torch
    import torch_acme  # noqa: F401

    # backward() on the device needs the hooks; tanh's backward op has an acme
    # kernel, under PyTorch's own graph node.
    x = torch.tensor([0.5, -1.0], device=device(), requires_grad=True)
    y = torch.tanh(x)
    y.sum().backward()
    expected = 1 - torch.tanh(torch.tensor([0.5, -1.0])) ** 2
    # An optimizer built before the model moves still trains it: Module.to
    # keeps the Parameter objects (_has_compatible_shallow_copy_type).
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.to(device()).weight.detach().cpu()
    model(torch.ones(1, 2, device=device())).sum().backward()
    optimizer.step()
    trained = not torch.equal(model.weight.detach().cpu(), before)
    return (torch._C._dispatch_has_kernel_for_dispatch_key("aten::tanh_backward", "PrivateUse1")
            and y.grad_fn.name() == "TanhBackward0" and torch.allclose(x.grad.cpu(), expected)
            and trained)


def ch04_autocast():
    import torch
    import torch_acme  # noqa: F401

    a = torch.ones(2, 2, device=device())
    with torch.autocast(device_type=device(), dtype=torch.bfloat16):
        low = torch.mm(a, a)
        high = torch.softmax(a.to(torch.bfloat16), dim=0)
    return low.dtype == torch.bfloat16 and high.dtype == torch.float32


def ch05_generator():
    import torch
    import torch_acme  # noqa: F401

    # A device generator that honours its seed, through a native random kernel.
    g = torch.Generator(device=device())
    g.manual_seed(7)
    first = torch.empty(8, device=device()).uniform_(generator=g).cpu()
    g.manual_seed(7)
    second = torch.empty(8, device=device()).uniform_(generator=g).cpu()
    return g.device.type == device() and torch.equal(first, second)


def ch06_device_guard():
    import torch
    import torch_acme  # noqa: F401

    # Streams and timed events on device 1; mixing devices in one op is refused.
    stream = torch.Stream(device=device(1))
    start, end = torch.Event(device=device(1), enable_timing=True), torch.Event(device=device(1), enable_timing=True)
    start.record(stream)
    end.record(stream)
    end.synchronize()
    timed = start.elapsed_time(end) >= 0
    try:
        # cat has no device check of its own (add's TensorIterator has one):
        # before chapter 6 the fallback would quietly run it on the CPU.
        torch.cat([torch.ones(2, device=device(0)), torch.ones(2, device=device(1))])
        refused = False
    except RuntimeError:
        refused = True
    return stream.device_index == 1 and timed and refused


def ch07_serialization():
    import io

    import torch
    import torch_acme  # noqa: F401

    t = torch.arange(6.0).to(device())
    torch.ops.acme.set_backend_meta(t, 7)
    buffer = io.BytesIO()
    torch.save({"t": t, "view": t[2:]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    return (loaded["t"].device.type == device() and torch.equal(loaded["t"].cpu(), t.cpu())
            and torch.ops.acme.get_backend_meta(loaded["t"]) == 7
            and loaded["view"].untyped_storage().data_ptr() == loaded["t"].untyped_storage().data_ptr())


def ch08_renaming():
    import torch
    import torch_acme  # noqa: F401

    t = torch.ones(2, device="acme:1")
    return str(t.device) == "acme:1" and torch.acme.device_count() >= 2


def ch09_generated_methods():
    import torch
    import torch_acme  # noqa: F401

    t = torch.ones(2).acme()
    layer = torch.nn.Linear(2, 2).acme()
    return t.is_acme and layer.weight.is_acme and torch.ones(2).untyped_storage().acme().is_acme


def ch10_native_kernels():
    import torch
    import torch_acme  # noqa: F401

    # add has a kernel of acme's own (not the CPU fallback), and it is right.
    rows = torch._C._dispatch_dump_table("aten::add.Tensor").splitlines()
    row = next(r for r in rows if r.startswith("PrivateUse1"))
    a = torch.arange(6.0)
    return "native_kernels.cpp" in row and torch.equal((a.to(device()) + 1).cpu(), a + 1)


def ch11_hooks():
    import torch
    import torch_acme  # noqa: F401

    # Pinned memory, a non_blocking copy back, a storage resize and lazy
    # initialization all go through the hooks chapter 11 completes.
    pinned = torch.arange(4.0).pin_memory()
    back = pinned.to(device()).to("cpu", non_blocking=True)
    storage = torch.ones(2, device=device()).untyped_storage()
    storage.resize_(16)
    module = getattr(torch, device())
    return (pinned.is_pinned() and torch.equal(back, pinned) and storage.nbytes() == 16
            and module.is_initialized())


def ch12_memory():
    import torch
    import torch_acme  # noqa: F401

    # The caching allocator answers torch.accelerator's memory questions, and
    # a freed block serves the next tensor of its size without the runtime.
    before = torch.accelerator.memory_allocated()
    t = torch.empty(1000, device=device())
    grew = torch.accelerator.memory_allocated() - before
    address = t.data_ptr()
    del t
    again = torch.empty(1000, device=device())
    module = getattr(torch, device())
    return grew == 4096 and again.data_ptr() == address and module.memory_reserved() > 0


def ch13_routed_ops():
    import torch
    import torch_acme  # noqa: F401

    # A convolution, an LSTM step and a view that ATen routes past the CPU
    # fallback, each compared with the CPU.
    x = torch.arange(18.0).reshape(1, 2, 3, 3)
    w = torch.ones(1, 2, 2, 2)
    conv = torch.nn.functional.conv2d(x.to(device()), w.to(device())).cpu()
    cell = torch.nn.LSTMCell(2, 2)
    hx, cx = cell.to(device())(x[0, :, 0, :2].t().contiguous().to(device()))
    reference = cell.cpu()(x[0, :, 0, :2].t().contiguous())
    repeated = torch.arange(3.0).to(device()).repeat(2).cpu()
    return (torch.equal(conv, torch.nn.functional.conv2d(x, w))
            and torch.allclose(hx.cpu(), reference[0]) and torch.allclose(cx.cpu(), reference[1])
            and torch.equal(repeated, torch.arange(3.0).repeat(2)))


def ch14_conformance():
    import torch
    import torch_acme  # noqa: F401

    # A silent difference from CUDA that the conformance run found:
    # training-mode batch norm moves the running statistics.
    norm = torch.nn.BatchNorm1d(2).to(device())
    norm(torch.tensor([[0.0, 1.0], [2.0, 5.0]], device=device()))
    return torch.allclose(norm.running_mean.cpu(), torch.tensor([0.1, 0.3]))


def ch15_custom_ops():
    import torch
    import torch_acme  # noqa: F401

    # acme's own operators, in C++ (bias_gelu) and Python (swiglu), with
    # gradients, and aten::rms_norm served by acme's fused kernel.
    x = torch.linspace(-2, 2, 6).reshape(2, 3)
    bias = torch.tensor([0.5, -1.0, 0.0])
    on_device = x.to(device()).requires_grad_()
    y = torch.ops.acme.bias_gelu(on_device, bias.to(device()))
    y.sum().backward()
    reference = x.clone().requires_grad_()
    torch.nn.functional.gelu(reference + bias).sum().backward()
    gated = torch.ops.acme.swiglu(x.to(device()), x.to(device())).cpu()
    fused = "rms_norm.cpp" in torch._C._dispatch_dump_table("aten::_fused_rms_norm")
    return (torch.allclose(y.detach().cpu(), torch.nn.functional.gelu(x + bias))
            and torch.allclose(on_device.grad.cpu(), reference.grad)
            and torch.allclose(gated, torch.nn.functional.silu(x) * x) and fused)


def ch16_storage():
    import multiprocessing

    import torch
    import torch_acme  # noqa: F401

    # An acme tensor through a pipe arrives as a second mapping of the same
    # memory (a write through one is seen through the other), and tensor
    # metadata set from Python survives.
    sending, receiving = multiprocessing.get_context("spawn").Pipe()
    sent = torch.zeros(3, device=device())
    torch._C._set_tensor_metadata(sent, {"probe": True})
    sending.send(sent)
    received = receiving.recv()
    received.fill_(4.0)
    return (torch.equal(sent.cpu(), torch.full((3,), 4.0))
            and torch._C._get_tensor_metadata(sent).get("probe") is True)


def ch17_packaging():
    from importlib.metadata import EntryPoint

    # What `import torch` does with the "torch.backends" entry point the
    # package declares (pyproject.toml): load the object it names, call it.
    entry = EntryPoint(name="torch_acme", value="torch_acme:_autoload", group="torch.backends")
    try:
        hook = entry.load()
    except AttributeError:
        return False
    hook()
    return True


def ch18_async():
    import torch
    import torch_acme  # noqa: F401
    from torch_acme import runtime

    # An op queued behind 50 ms of earlier work on the stream runs after it:
    # events recorded around the op bracket its work, and the host does not
    # wait for it. (Before, the op ran on the host at once and the two events
    # completed together.) The host's time for the call is the yardstick, not
    # a fixed one: on a busy machine two events may complete a little apart.
    import time

    x = torch.rand(512, 512, device=device())
    begin = torch.Event(device=device(), enable_timing=True)
    end = torch.Event(device=device(), enable_timing=True)
    runtime.sleep_kernel(0, 50_000)
    begin.record()
    start = time.perf_counter()
    y = x @ x
    call_ms = (time.perf_counter() - start) * 1e3
    end.record()
    end.synchronize()
    elapsed = begin.elapsed_time(end)
    return (elapsed > 0.2 and elapsed > 2 * call_ms
            and torch.allclose(y.cpu(), x.cpu() @ x.cpu(), atol=1e-3))


def ch19_profiler():
    import torch
    import torch_acme  # noqa: F401
    from torch.profiler import ProfilerActivity, profile

    # torch.profiler records the product's kernel as device work on acme,
    # linked to the aten::mm that launched it. (Before, no device activity.)
    x = torch.rand(64, 64, device=device())
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        x @ x
    ops = {e.id: e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU}
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.PrivateUse1
               and e.name == "aten::mm"]
    return len(kernels) == 1 and ops[kernels[0].linked_correlation_id].name == "aten::mm"


def ch20_compile():
    import torch
    import torch_acme  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401 - what torch.compile loads first
    from torch._inductor.codegen.common import (get_wrapper_codegen_for_device,
                                                init_backend_registration)

    # torch.compile's default backend fuses acme code into one compiled kernel.
    # (Before: Inductor knows no code generator for the device, and fails.)
    init_backend_registration()
    if get_wrapper_codegen_for_device(device()) is None:
        return False  # what torch.compile would fail on, after a costly trace
    x = torch.randn(1000)
    compiled = torch.compile(lambda t: (t * 2).sin() + 1)
    return torch.allclose(compiled(x.to(device())).cpu(), (x * 2).sin() + 1, atol=1e-5)


def ch21_distributed():
    import torch
    import torch.distributed as dist
    import torch_acme  # noqa: F401

    # init_process_group() with no backend finds one for acme tensors, and its
    # collectives run. (Before: "we don't know which communication backend to
    # use for this accelerator".) One rank here; tests/test_distributed.py has two.
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.arange(4.0, device=device())
        dist.all_reduce(t)
        out = torch.empty(4, device=device())
        dist.all_gather_into_tensor(out, t)
        return torch.equal(out.cpu(), torch.arange(4.0))
    finally:
        dist.destroy_process_group()


def ch22_quantization():
    import torch
    import torch_acme  # noqa: F401

    # Quantized tensors live on acme: quantized there, moved there, read back.
    # (Before: chapter 13's fallback refuses the QuantizedPrivateUse1 key.)
    x = torch.linspace(-1, 1, 11)
    q = torch.quantize_per_tensor(x.to(device()), 0.1, 3, torch.qint8)
    moved = torch.quantize_per_tensor(x, 0.1, 3, torch.qint8).to(device())
    # And the int8 and float8 products have kernels of acme's own. (Before:
    # they run, through the CPU fallback.)
    own = all(torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "PrivateUse1")
              for op in ("_int_mm", "_weight_int8pack_mm", "_scaled_mm"))
    return (q.device.type == device() and torch.equal(q.int_repr().cpu(), moved.int_repr().cpu())
            and torch.equal(q.dequantize().cpu(), moved.cpu().dequantize()) and own)


def ch23_capstone():
    import torch
    import torch_acme  # noqa: F401

    # SyncBatchNorm's per-process statistics on acme. (Before: PyTorch has this
    # operator for CUDA only, so not even the CPU fallback could run it.)
    x = torch.randn(4, 3, 5, 5)
    mean, invstd = torch.batch_norm_stats(x.to(device()), 1e-5)
    var, expected_mean = torch.var_mean(x, dim=(0, 2, 3), correction=0)
    return (torch.allclose(mean.cpu(), expected_mean, atol=1e-6)
            and torch.allclose(invstd.cpu(), (var + 1e-5).rsqrt(), rtol=1e-5))


PROBES = {0: ch00_runtime, 1: ch01_minimal_ops, 2: ch02_cpu_fallback, 3: ch03_autograd,
          4: ch04_autocast, 5: ch05_generator, 6: ch06_device_guard, 7: ch07_serialization,
          8: ch08_renaming, 9: ch09_generated_methods, 10: ch10_native_kernels,
          11: ch11_hooks, 12: ch12_memory, 13: ch13_routed_ops,
          14: ch14_conformance, 15: ch15_custom_ops, 16: ch16_storage, 17: ch17_packaging,
          18: ch18_async, 19: ch19_profiler, 20: ch20_compile,
          21: ch21_distributed, 22: ch22_quantization, 23: ch23_capstone}


def main():
    results = {}
    for number, probe in PROBES.items():
        try:
            results[number] = bool(probe())
        except Exception as error:  # absent capabilities fail in many ways
            results[number] = False
            print(f"ch{number:02d}: {type(error).__name__}: {error}".splitlines()[0], file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
