"""Chapter 23: kernels whose host side waits for them run on the stream too.

Until chapter 23, attention, convolution, the random kernels and the
training kernels computed on whichever thread called them (the host, or
autograd's device thread) after waiting for the stream. From chapter 23
they run as kernels on the stream's worker while the caller waits
(run_on_stream in csrc/aten/run_on_stream.h): they show on the device's timeline,
they see the caller's stream, and what they raise keeps its Python type.
Once a call with given shapes has passed, the training kernels,
convolution and attention launch later calls with those shapes without
waiting.
"""

from __future__ import annotations

import importlib
import time
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import torch_acme  # noqa: F401 - registers torch.acme
from conftest import LAST, run_in_stage

pytestmark = pytest.mark.skipif(
    importlib.import_module("torch_acme._build_info").STAGE < 23,
    reason="chapter 23 runs waiting kernels on the stream")


def kernel_names(prof) -> set[str]:
    return {e.name for e in prof.events() if e.device_type == DeviceType.PrivateUse1}


def test_waiting_kernels_are_device_activities():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4, device="acme", requires_grad=True) for _ in range(3))
    image = torch.randn(2, 3, 8, 8, device="acme", requires_grad=True)
    weight = torch.randn(4, 3, 3, 3, device="acme", requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.25)
        c = F.gelu(F.conv2d(image, weight))
        d = F.dropout(c, 0.5)
        (a.sum() + d.sum()).backward()
    names = kernel_names(prof)
    for name in ("attention", "attention backward", "convolution", "convolution backward",
                 "aten::native_dropout", "aten::gelu", "aten::gelu_backward"):
        assert name in names, (name, sorted(names))


def test_an_error_raised_inside_keeps_its_type():
    logits = torch.randn(4, 3, device="acme")
    with pytest.raises(IndexError, match="out of bounds"):
        F.nll_loss(logits.log_softmax(-1), torch.tensor([0, 1, 2, 7], device="acme"))
    # The device goes on working: the error was the call's, not the stream's.
    assert torch.equal((logits * 2).cpu(), logits.cpu() * 2)


def test_results_on_a_side_stream_match_the_default_stream():
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 2, 16, 8, device="acme") for _ in range(3))
    image, weight = torch.randn(2, 3, 8, 8, device="acme"), torch.randn(4, 3, 3, 3, device="acme")
    expected = (F.scaled_dot_product_attention(q, k, v, is_causal=True),
                F.conv2d(image, weight), F.layer_norm(image, (8,)))
    side = torch.acme.Stream()
    side.wait_stream(torch.acme.current_stream())
    with torch.acme.stream(side):
        got = (F.scaled_dot_product_attention(q, k, v, is_causal=True),
               F.conv2d(image, weight), F.layer_norm(image, (8,)))
    torch.acme.current_stream().wait_stream(side)
    for e, g in zip(expected, got):
        assert torch.equal(e.cpu(), g.cpu())


def test_same_seed_same_masks_through_the_worker():
    # The dropout mask of attention is drawn inside its kernel (a launch from
    # a running kernel runs at once); the backward draws it again.
    q = torch.randn(2, 2, 8, 4, device="acme", requires_grad=True)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
        (grad,) = torch.autograd.grad(out.sum(), q)
        runs.append((out.detach().cpu(), grad.cpu()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    plain = F.scaled_dot_product_attention(q, q, q).detach().cpu()
    assert not torch.allclose(runs[0][0], plain)  # dropout did drop


def test_a_warning_inside_reaches_python_warnings():
    x = torch.randn(4, 3, device="acme")
    out = torch.empty(2, device="acme")  # the wrong shape, with elements: a resize warning
    with pytest.warns(UserWarning, match="was resized"):
        torch.clamp(x, 0, 1, out=out)
    assert out.shape == (4, 3) and torch.equal(out.cpu(), x.cpu().clamp(0, 1))


def test_results_made_in_inference_mode_are_inference_tensors():
    x = torch.randn(2, 3, 8, 8, device="acme")
    with torch.inference_mode():
        y = F.layer_norm(x, (8,))
    assert y.is_inference()


def test_a_body_waits_for_another_devices_stream():
    # bernoulli_ on acme:0 copies p from acme:1 inside its body: the copy
    # must wait for acme:1's stream, which is still busy filling p.
    p = torch.zeros(4096, device="acme:1")
    with torch.acme.device(1):
        torch.acme._sleep(100_000)  # microseconds: p.fill_ below runs after it
        p.fill_(1.0)
    x = torch.empty(4096, device="acme:0").bernoulli_(p)
    assert bool(x.cpu().eq(1).all())


def test_empty_cache_on_another_thread_while_a_kernel_allocates():
    # A kernel body allocates on the stream's worker. empty_cache used to
    # free segments (acmeFree waits for the streams) holding the cache's
    # lock, which the worker needed: both waited for ever.
    result = run_in_stage(LAST, textwrap.dedent("""
        import threading
        import torch, torch_acme
        import torch.nn.functional as F
        stop = threading.Event()
        def churn():
            while not stop.is_set():
                torch.acme.empty_cache()
        thread = threading.Thread(target=churn)
        thread.start()
        q = torch.randn(8, 4, 64, 16, device="acme")
        for _ in range(300):
            F.scaled_dot_product_attention(q, q, q)
            spare = torch.empty(4 << 20, device="acme")  # a whole segment to give back
            del spare
        torch.acme.synchronize()
        stop.set()
        thread.join()
        print("done")
    """))
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr[-2000:]


def test_a_body_does_not_reuse_memory_freed_after_its_launch():
    # Thread B's cat runs on the stream after a 100 ms kernel, and allocates
    # its result then. Meanwhile the main thread queues y = t * 1 behind it
    # and frees t: the caching allocator may hand t's block out again only to
    # work queued after y, never to the body queued before it.
    import threading
    n = 1 << 16
    x = torch.zeros(n, device="acme")
    t = torch.full((2 * n,), 7.0, device="acme")
    torch.acme.synchronize()
    torch.acme._sleep(100_000)  # microseconds
    launched = threading.Event()
    results = []

    def concatenate():
        launched.set()
        results.append(torch.cat([x, x]))

    thread = threading.Thread(target=concatenate)
    thread.start()
    launched.wait()
    time.sleep(0.02)  # the cat is queued, waiting behind the sleep
    y = t * 1
    del t
    thread.join()
    assert bool(y.cpu().eq(7).all()) and bool(results[0].cpu().eq(0).all())


def launched_or_waited(call):
    """Runs `call` behind a 200 ms device kernel: 'launched' if it returned
    with the stream still busy, 'waited' if it returned after the stream."""
    torch.acme.synchronize()
    torch.acme._sleep(200_000)  # microseconds
    result = call()
    busy = not torch.acme.current_stream().query()
    torch.acme.synchronize()
    return result, "launched" if busy else "waited"


@pytest.mark.parametrize("op", ["gelu", "layer_norm", "cat", "conv2d"])
def test_a_call_whose_shapes_passed_is_launched_without_waiting(op):
    # The first call with given shapes waits for its kernel, and so learns the
    # shapes of its results; a later call with the same shapes allocates them
    # on the host and is launched, as a CUDA kernel is.
    torch.manual_seed(0)
    x = torch.randn(3, 5, 6, 7, device="acme")  # shapes no other test uses
    w = torch.randn(4, 5, 3, 3, device="acme")
    call = {"gelu": lambda t: F.gelu(t),
            "layer_norm": lambda t: F.layer_norm(t, (7,)),
            "cat": lambda t: torch.cat([t, t * 2]),  # a list: the dtype is its tensors'
            "conv2d": lambda t: F.conv2d(t, w if t.device.type == "acme" else w.cpu())}[op]
    first, how = launched_or_waited(lambda: call(x))
    assert how == "waited"
    second, how = launched_or_waited(lambda: call(x))
    assert how == "launched"
    assert torch.equal(second.cpu(), first.cpu())
    torch.testing.assert_close(second.cpu(), call(x.cpu()))
    # Other shapes wait again.
    y = torch.randn(2, 5, 6, 7, device="acme")
    _, how = launched_or_waited(lambda: call(y))
    assert how == "waited"


def test_launched_backward_kernels_leave_unasked_gradients_undefined():
    # No bias, no affine weight: the backward kernels' third result (and
    # layer norm's second and third) is undefined. Launched calls make
    # undefined results where the first call did, and the gradients match.
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 5)
    w = torch.randn(4, 3, 3, 3)

    def gradients(device):
        xs, ws = (t.detach().to(device).requires_grad_() for t in (x, w))
        out = F.layer_norm(F.conv2d(xs, ws), (3,))
        (out * out).sum().backward()
        return xs.grad.cpu(), ws.grad.cpu()

    expected = gradients("cpu")
    for _ in range(3):  # the first waits; the others are launched
        for got, want in zip(gradients("acme"), expected):
            torch.testing.assert_close(got, want)


def test_dropout_takes_its_numbers_on_the_host_and_is_launched():
    # From chapter 23 native_dropout takes its counter range on the host, in
    # call order, and launches its kernel: element i still uses counter block
    # offset + i (chapter 5), and the next call starts where it stopped.
    from test_generator import bits64, blocks
    seed, n, p = 1234, 3000, 0.3
    uniform = lambda offset, k: torch.tensor(  # noqa: E731
        [(bits64(w) >> 11) / 2**53 for w in blocks(seed, offset, k)], dtype=torch.float64)
    x = torch.arange(1.0, 2 * n + 1, dtype=torch.float64, device="acme")
    torch.acme.manual_seed(seed)
    (first, first_mask), how = launched_or_waited(
        lambda: torch.ops.aten.native_dropout(x[:n], p, True))
    assert how == "launched"
    second, second_mask = torch.ops.aten.native_dropout(x[::2], p, True)  # strided input
    for (out, mask), offset, source in [((first, first_mask), 0, x[:n]),
                                        ((second, second_mask), n, x[::2])]:
        kept = uniform(offset, n) < 1 - p
        assert torch.equal(mask.cpu(), kept)
        assert torch.equal(out.cpu(), source.cpu() * kept * (1 / (1 - p)))  # x times 1/keep


def test_attention_takes_its_dropout_numbers_on_the_host_and_is_launched():
    # From chapter 23 attention takes its dropout counters on the host, in
    # call order, once its shapes have passed: the launched forward and
    # backward give the waiting calls' numbers, and the generator moves on by
    # as much. No bias; then the same with one, as the 2.14 math path passes it.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 5, device="acme", requires_grad=True) for _ in range(3))
    bias = torch.randn(9, 9, device="acme")

    def forward(**mask):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.4, **mask)

    for mask in ({"is_causal": True}, {"attn_mask": bias}):
        runs = []
        for expect in ("waited", "launched", "launched"):
            torch.acme.manual_seed(11)
            out, how = launched_or_waited(lambda: forward(**mask))
            assert how == expect, mask
            grads, how = launched_or_waited(
                lambda: torch.autograd.grad((out * out).sum(), (q, k, v)))
            assert how == expect, mask
            runs.append([out, *grads, torch.rand(3, device="acme")])  # where the counters stopped
        for run in runs[1:]:
            for got, want in zip(run, runs[0]):
                assert torch.equal(got.cpu(), want.cpu()), mask


def test_attention_dropout_keeps_chapter_5s_counter_blocks():
    # Element i of the mask (over the batch, heads, queries and keys) uses
    # counter block offset + i and bernoulli_'s test, waiting or launched.
    # With the identity as the values the output is the dropped-out
    # probabilities, none of them 0 unless dropped.
    from test_generator import bits64, blocks
    seed, p = 99, 0.4
    torch.manual_seed(0)
    q, k = torch.randn(3, 2, 6, 8, device="acme"), torch.randn(3, 2, 7, 8, device="acme")
    eye = torch.eye(7, device="acme").expand(3, 2, 7, 7)  # shapes no other test uses
    n = 3 * 2 * 6 * 7
    kept = torch.tensor([(bits64(w) >> 11) / 2**53 for w in blocks(seed, 0, n)],
                        dtype=torch.float64) < 1 - p
    for expect in ("waited", "launched"):
        torch.acme.manual_seed(seed)
        probs, how = launched_or_waited(
            lambda: F.scaled_dot_product_attention(q, k, eye, dropout_p=p))
        assert how == expect
        assert torch.equal(probs.cpu().ne(0).flatten(), kept)


def test_a_result_in_the_default_dtype_keeps_waiting():
    # sqrt of an integer tensor returns the default dtype, which a launched
    # kernel would read when it runs rather than when it was called: such
    # calls wait every time, and a change of the default dtype right after
    # one applies to the next call only.
    x = torch.arange(7, device="acme")
    for _ in range(2):
        y, how = launched_or_waited(lambda: torch.sqrt(x))
        assert how == "waited" and y.dtype == torch.float32
    before = torch.get_default_dtype()
    y = torch.sqrt(x)
    torch.set_default_dtype(torch.float64)
    try:
        z = torch.sqrt(x)
        assert y.dtype == torch.float32 and z.dtype == torch.float64
        assert torch.equal(z.cpu(), torch.sqrt(x.cpu()))
    finally:
        torch.set_default_dtype(before)
    torch.testing.assert_close(y.cpu(), torch.sqrt(x.cpu()))


def test_a_result_in_a_dtype_of_the_ops_own_is_launched():
    # max_pool2d's indices are int64 whatever its input: no default dtype is
    # read, so once its shapes have passed the call is launched, and both
    # results match the CPU's.
    torch.manual_seed(0)
    x = torch.randn(3, 2, 10, 6, device="acme")  # shapes no other test uses
    for expect in ("waited", "launched"):
        (out, indices), how = launched_or_waited(
            lambda: F.max_pool2d(x, 2, return_indices=True))
        assert how == expect
        want, want_indices = F.max_pool2d(x.cpu(), 2, return_indices=True)
        assert indices.dtype == torch.int64
        assert torch.equal(out.cpu(), want) and torch.equal(indices.cpu(), want_indices)


def test_a_loss_on_targets_copied_from_the_host_is_launched():
    # nll_loss checks its class indices at the call. Targets copied from the
    # host (a training step's) are read once their copy has run, not after
    # every kernel queued since: in range, the call is launched. So is its
    # backward, which checks them again.
    torch.manual_seed(0)
    logits = torch.randn(6, 11, device="acme", requires_grad=True)  # shapes no other test uses
    targets = torch.tensor([0, 3, 10, 5, -100, 7]).pin_memory().to("acme", non_blocking=True)
    for expect in ("waited", "launched"):
        loss, how = launched_or_waited(lambda: F.cross_entropy(logits, targets))
        assert how == expect
        (grad,), how = launched_or_waited(lambda: torch.autograd.grad(
            F.cross_entropy(logits, targets), logits))
        assert how == expect
    cpu_logits = logits.detach().cpu().requires_grad_()
    want = F.cross_entropy(cpu_logits, targets.cpu())
    want.backward()
    torch.testing.assert_close(loss.cpu(), want)
    torch.testing.assert_close(grad.cpu(), cpu_logits.grad)


@pytest.mark.parametrize("targets", ["computed on the device", "written since the copy"])
def test_a_loss_on_targets_the_host_has_not_seen_waits(targets):
    # Values the host cannot read from their copy are checked by the kernel,
    # waiting, so an index out of range still raises at the call.
    logits = torch.randn(5, 9, device="acme")  # shapes no other test uses
    copied = torch.tensor([0, 8, 2, 3, 4], device="acme")
    F.cross_entropy(logits, copied)  # these shapes pass
    if targets == "computed on the device":
        computed = copied * 1
        _, how = launched_or_waited(lambda: F.cross_entropy(logits, computed))
        assert how == "waited"
        return
    # The write is queued behind the sleep: the copy's values are in range, the
    # tensor's are not by the time the kernel runs. Its version tells.
    torch.acme.synchronize()
    torch.acme._sleep(200_000)  # microseconds
    copied[1] = 9
    with pytest.raises(IndexError, match="Target 9 is out of bounds"):
        F.cross_entropy(logits, copied)
    assert torch.equal((logits * 2).cpu(), logits.cpu() * 2)  # the device works on


def test_a_loss_on_copied_targets_out_of_range_raises_at_the_call():
    logits = torch.randn(7, 4, device="acme")  # shapes no other test uses
    F.cross_entropy(logits, torch.tensor([0, 1, 2, 3, 0, 1, 2], device="acme"))
    bad = torch.tensor([0, 1, 2, 3, 4, 1, 2]).pin_memory().to("acme", non_blocking=True)
    with pytest.raises(IndexError, match="Target 4 is out of bounds"):
        F.cross_entropy(logits, bad)
    assert torch.equal((logits * 2).cpu(), logits.cpu() * 2)


def test_an_embedding_backward_on_copied_indices_is_launched():
    torch.manual_seed(0)
    table = torch.nn.Embedding(13, 3).to("acme")  # shapes no other test uses
    tokens = torch.tensor([[1, 12, 0], [5, 5, 7]]).to("acme")
    for expect in ("waited", "launched"):
        (grad,), how = launched_or_waited(
            lambda: torch.autograd.grad((table(tokens) * 3).sum(), table.weight))
        assert how == expect
    cpu_table = torch.nn.Embedding(13, 3)
    cpu_table.load_state_dict({"weight": table.weight.detach().cpu()})
    (cpu_table(tokens.cpu()) * 3).sum().backward()
    torch.testing.assert_close(grad.cpu(), cpu_table.weight.grad)


def test_a_host_thread_waiting_for_the_stream_is_woken_once():
    # A thread in synchronize() sleeps until the stream reaches its target:
    # the worker does not wake it after every item it completes (each
    # wake-up would take a core from the device's threads). Counted by the
    # kernel: the thread's voluntary context switches while it waits.
    def switches() -> int:
        with open("/proc/thread-self/status") as status:
            for line in status:
                if line.startswith("voluntary_ctxt_switches"):
                    return int(line.split()[1])
        raise AssertionError("no voluntary_ctxt_switches in /proc/thread-self/status")

    torch.acme.synchronize()
    for _ in range(200):
        torch.acme._sleep(100)  # microseconds: 20 ms of queued work
    before = switches()
    torch.acme.synchronize()
    assert switches() - before < 20
