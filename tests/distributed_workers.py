"""One rank of a test_distributed.py scenario: run as
`python distributed_workers.py SCENARIO RANK WORLD PORT`. Each scenario checks
its results against the CPU in the worker and raises on any difference; the
last line it prints is `RESULT <json>` with what the test asserts on.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

warnings.simplefilter("ignore")  # fallback notices and deprecations: not under test here

import torch_acme  # noqa: E402

DEVICE = torch_acme.DEVICE_NAME


def init(rank: int, world: int, port: int, backend=None, seconds: float = 60,
         **options) -> torch.device:
    torch.accelerator.set_device_index(rank)
    # The store on `port` is hosted by the test (tools/rendezvous.py). From
    # PyTorch 2.14 a rank joins it as a client only if it is the agent's store,
    # MASTER_ADDR:MASTER_PORT; for any other port rank 0 would try to serve it
    # (EADDRINUSE). init_forms makes three groups, each on a store of its own.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=seconds),
                            **options)
    return torch.device(DEVICE, rank)


def value(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s input: different on every rank, exact in every dtype."""
    if dtype == torch.bool:
        return torch.arange(n) % (rank + 2) == 0
    if dtype.is_complex:
        return torch.complex(torch.arange(n) + rank * 1.0, torch.full((n,), rank + 0.5)).to(dtype)
    base = torch.arange(n, dtype=torch.float64) % 7
    if dtype.is_floating_point:
        return ((base + 1) * (rank + 1) * 0.25).to(dtype)
    return (base.long() + 3 * rank + 1).to(dtype)


def expected(op, dtype: torch.dtype, n: int, world: int) -> torch.Tensor:
    """The reduction computed on the CPU, one rounding at the end (as acme does)."""
    inputs = [value(r, n, dtype) for r in range(world)]
    wide = torch.complex128 if dtype.is_complex else (
        torch.float64 if dtype.is_floating_point else torch.int64)
    xs = [x.to(wide) if dtype != torch.bool else x for x in inputs]
    R = dist.ReduceOp
    out = xs[0].clone()
    for x in xs[1:]:
        if op in (R.SUM, R.AVG):
            out = out | x if dtype == torch.bool else out + x
        elif op == R.PRODUCT:
            out = out & x if dtype == torch.bool else out * x
        elif op == R.MIN:
            out = torch.minimum(out, x)
        elif op == R.MAX:
            out = torch.maximum(out, x)
        elif op == R.BAND:
            out = out & x
        elif op == R.BOR:
            out = out | x
        elif op == R.BXOR:
            out = out ^ x
    if op == R.AVG:
        out = out / world
    if dtype in (torch.float16, torch.bfloat16):  # acme rounds from float32, as the CPU does
        out = out.to(torch.float32)
    return out.to(dtype)


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    if not (torch.equal(got, want) if not want.dtype.is_floating_point and not want.dtype.is_complex
            else torch.allclose(got, want, rtol=1e-6, atol=0)):
        raise AssertionError(f"{what}: got {got[:8].tolist()}, want {want[:8].tolist()}")


# ---- scenarios ----

def collectives(rank: int, world: int, port: int) -> dict:
    dev = init(rank, world, port)
    R, checks = dist.ReduceOp, []
    floats = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    ints = [torch.int32, torch.int64, torch.int8, torch.uint8]
    cases = [(op, dt) for dt in floats for op in (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX)]
    cases += [(op, dt) for dt in ints for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR,
                                                 R.BXOR)]
    cases += [(op, torch.bool) for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX)]
    cases += [(op, torch.complex64) for op in (R.SUM, R.AVG)]
    for op, dtype in cases:
        for n in (0, 1, 13):  # empty, one element, not a multiple of the ranks
            t = value(rank, n, dtype).to(dev)
            dist.all_reduce(t, op=op)
            same(t, expected(op, dtype, n, world), f"all_reduce {op} {dtype} n={n}")
            checks.append(f"all_reduce {op} {dtype}")
    # PREMUL_SUM: each input times the factor, then the sum
    t = value(rank, 9, torch.float32).to(dev)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    same(t, expected(R.SUM, torch.float32, 9, world) * 0.5, "premul_sum")
    t = value(rank, 9, torch.bfloat16).to(dev)  # a tensor factor; the dtype stays bfloat16
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor(0.25)))
    assert t.dtype == torch.bfloat16
    same(t, (expected(R.SUM, torch.bfloat16, 9, world).float() * 0.25).bfloat16(), "premul tensor")
    try:  # integers have no premultiplied sum: refused on the spot, on every rank
        dist.all_reduce(torch.ones(3, dtype=torch.int32, device=dev),
                        op=dist._make_nccl_premul_sum(2.0))
        raise AssertionError("PREMUL_SUM of int32 was accepted")
    except ValueError as error:
        assert "PREMUL_SUM needs floating-point tensors" in str(error), error
    # Larger than one staging slot (4 MiB): several chunks.
    big = 3_000_001
    t = value(rank, big, torch.float32).to(dev)
    dist.all_reduce(t)
    same(t, expected(R.SUM, torch.float32, big, world), "all_reduce in chunks")
    # broadcast: every root, a dtype the runtime moves as bytes (int16), complex
    for root in range(world):
        for dtype in (torch.float32, torch.int16, torch.complex64, torch.bool):
            t = value(rank, 11, dtype).to(dev)
            dist.broadcast(t, src=root)
            same(t, value(root, 11, dtype), f"broadcast {dtype} from {root}")
    t = value(rank, 2_000_001, torch.float32).to(dev)  # several 4 MiB chunks
    dist.broadcast(t, src=world - 1)
    same(t, value(world - 1, 2_000_001, torch.float32), "broadcast in chunks")
    checks.append("broadcast")
    # all_gather (list) and all_gather_into_tensor, one of them in chunks
    for n in (5, 2_500_000):
        outs = [torch.empty(n, device=dev) for _ in range(world)]
        dist.all_gather(outs, value(rank, n, torch.float32).to(dev))
        for r in range(world):
            same(outs[r], value(r, n, torch.float32), f"all_gather n={n} from {r}")
    flat = torch.empty(world * 6, dtype=torch.int16, device=dev)
    dist.all_gather_into_tensor(flat, value(rank, 6, torch.int16).to(dev))
    same(flat, torch.cat([value(r, 6, torch.int16) for r in range(world)]), "all_gather_into_tensor")
    checks.append("all_gather")
    # reduce_scatter_tensor: rank r gets block r of the sum (also in chunks)
    for n, op in ((4, R.SUM), (1_200_000, R.SUM), (4, R.MAX)):
        out = torch.empty(n, device=dev)
        dist.reduce_scatter_tensor(out, value(rank, n * world, torch.float32).to(dev), op=op)
        same(out, expected(op, torch.float32, n * world, world)[rank * n:(rank + 1) * n],
             f"reduce_scatter_tensor n={n} {op}")
    checks.append("reduce_scatter_tensor")
    # all_to_all_single: even splits, then uneven ones (rank r sends r+1+q rows to rank q)
    rows = torch.arange(world * 3 * 2, dtype=torch.float32).reshape(world * 3, 2) + 100 * rank
    out = torch.empty_like(rows, device=dev)
    dist.all_to_all_single(out, rows.to(dev))
    want = torch.cat([(torch.arange(world * 3 * 2, dtype=torch.float32).reshape(world * 3, 2)
                       + 100 * r)[rank * 3:(rank + 1) * 3] for r in range(world)])
    same(out, want, "all_to_all_single even")
    send_splits = [rank + 1 + q for q in range(world)]
    recv_splits = [r + 1 + rank for r in range(world)]
    src = torch.arange(sum(send_splits) * 3, dtype=torch.int16).reshape(-1, 3) + 1000 * rank
    out = torch.empty(sum(recv_splits), 3, dtype=torch.int16, device=dev)
    dist.all_to_all_single(out, src.to(dev), recv_splits, send_splits)
    pieces = []
    for r in range(world):
        theirs = [r + 1 + q for q in range(world)]
        start = sum(theirs[:rank])
        pieces.append((torch.arange(sum(theirs) * 3, dtype=torch.int16).reshape(-1, 3)
                       + 1000 * r)[start:start + theirs[rank]])
    same(out, torch.cat(pieces), "all_to_all_single uneven")
    block = 700_001  # more than one round's share of the slot per destination
    src = value(rank, world * block, torch.float32)
    out = torch.empty(world * block, device=dev)
    dist.all_to_all_single(out, src.to(dev))
    same(out, torch.cat([value(r, world * block, torch.float32)[rank * block:(rank + 1) * block]
                         for r in range(world)]), "all_to_all_single in rounds")
    checks.append("all_to_all_single")
    # send/recv around the ring, one message larger than the 1 MiB channel, one empty
    for n in (7, 600_000, 0):
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        got = torch.empty(n, device=dev)
        if rank % 2 == 0:
            dist.send(value(rank, n, torch.float32).to(dev), nxt)
            dist.recv(got, prev)
        else:
            dist.recv(got, prev)
            dist.send(value(rank, n, torch.float32).to(dev), nxt)
        same(got, value(prev, n, torch.float32), f"send/recv n={n}")
    checks.append("send/recv")
    # reduce, gather, scatter to root 1
    t = value(rank, 5, torch.float32).to(dev)
    dist.reduce(t, dst=1)
    same(t, expected(R.SUM, torch.float32, 5, world) if rank == 1 else value(rank, 5, torch.float32),
         "reduce")
    outs = [torch.empty(4, device=dev) for _ in range(world)] if rank == 1 else None
    dist.gather(value(rank, 4, torch.float32).to(dev), outs, dst=1)
    if rank == 1:
        for r in range(world):
            same(outs[r], value(r, 4, torch.float32), "gather")
    got = torch.empty(3, device=dev)
    dist.scatter(got, [torch.full((3,), 10.0 + r, device=dev) for r in range(world)]
                 if rank == 1 else None, src=1)
    same(got, torch.full((3,), 10.0 + rank), "scatter")
    checks.append("reduce/gather/scatter")
    # objects travel through acme tensors too
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(world)], objs
    # async_op: the handle waits; the future's value is the result
    t = value(rank, 1 << 20, torch.float32).to(dev)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    same(t, expected(R.SUM, torch.float32, 1 << 20, world), "async all_reduce")
    fut = dist.all_reduce(value(rank, 4, torch.float32).to(dev), async_op=True).get_future()
    same(fut.wait()[0], expected(R.SUM, torch.float32, 4, world), "future value")
    checks.append("async")
    # Stream order: the collective runs after the work queued before it on the
    # current stream, even while that work is still running.
    side = torch.Stream(device=dev)
    with side:
        torch.acme._sleep(200_000)  # keeps the stream busy 0.2 s
        t = torch.ones(4, device=dev) * (rank + 1)  # queued behind the sleep
        work = dist.all_reduce(t, async_op=True)
        queued_before_done = not work.is_completed()
        work.wait()
        same(t, torch.full((4,), float(sum(range(1, world + 1)))), "on a side stream")
    checks.append("stream order")
    dist.barrier()
    dist.destroy_process_group()
    return {"checks": len(checks), "async_returned_before_done": queued_before_done}


def init_forms(rank: int, world: int, ports: list[int]) -> dict:
    """Which backend each way of calling init_process_group gives acme and CPU tensors."""
    seen = {}
    for i, form in enumerate([None, DEVICE, f"cpu:gloo,{DEVICE}:{DEVICE}"]):
        dev = init(rank, world, ports[i], form)  # a store of its own per group
        pg = dist.group.WORLD
        t = torch.ones(2, device=dev)
        dist.all_reduce(t)
        try:
            cpu = pg._get_backend(torch.device("cpu")).name()
            c = torch.ones(2)
            dist.all_reduce(c)
            cpu_sum = c.tolist()
        except RuntimeError as e:
            cpu, cpu_sum = None, str(e).splitlines()[0]
        seen[str(form)] = {
            "acme": pg._get_backend(dev).name(), "cpu": cpu, "sums": [t.cpu().tolist(), cpu_sum],
            "default_for_device": dist.get_default_backend_for_device(DEVICE)}
        dist.destroy_process_group()
    return seen


def split(rank: int, world: int, port: int) -> dict:
    """split_group: a child group over the parent's ranks in another order."""
    # PyTorch 2.14 splits only a group bound to a device (2.15 also without)
    dev = init(rank, world, port, device_id=torch.device(DEVICE, rank))
    try:
        child = dist.split_group(split_ranks=[list(reversed(range(world)))])
    except RuntimeError as e:  # PyTorch 2.13: the whole group acme's factory makes
        return {"error": str(e)}  # there keeps no device_id
    t = torch.full((2,), float(rank), device=dev)
    dist.broadcast(t, group=child, group_src=0)  # the child's rank 0: the last global rank
    s = torch.full((1,), float(rank + 1), device=dev)
    dist.all_reduce(s, group=child)
    return {"child_rank": dist.get_rank(child), "broadcast": t.cpu().tolist(),
            "sum": s.item(), "backend": child._get_backend(dev).name()}


def overlap(rank: int, world: int, port: int) -> dict:
    """The caller's stream goes on while a collective waits for a late rank,
    and an input dropped at once stays untouched until the collective reads it."""
    dev = init(rank, world, port)
    dist.all_reduce(torch.ones(1, device=dev))  # the communicator is up
    torch.accelerator.synchronize()
    n = 1 << 16
    out = torch.empty(world * n, device=dev)
    result = {}
    if rank == 1:
        time.sleep(1.0)  # rank 0 queues its gather and computes meanwhile
        dist.all_gather_into_tensor(out, torch.full((n,), 7.0, device=dev))
    else:
        inp = torch.full((n,), 5.0, device=dev)
        work = dist.all_gather_into_tensor(out, inp, async_op=True)
        del inp  # freed now; without recordStream the next block would be it
        junk = torch.full((n,), -1.0, device=dev)
        torch.accelerator.current_stream().synchronize()
        result["compute_done_while_pending"] = not work.is_completed()
        work.wait()
        del junk
    result["gathered"] = [out[:n].unique().tolist(), out[n:].unique().tolist()]
    return result


def detail(rank: int, world: int, port: int) -> dict:
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL (set by the test): c10d's wrapper
    checks every collective's shapes across ranks before acme's backend runs it."""
    dev = init(rank, world, port, f"cpu:gloo,{DEVICE}:{DEVICE}", seconds=20)
    wrapped = type(dist.group.WORLD._get_backend(dev)).__name__
    result = failure(lambda: dist.all_reduce(torch.ones(10 + 2 * rank, device=dev)))
    return {"backend": wrapped, **result}


def ddp(rank: int, world: int, port: int) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    import ddp_train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    path = os.path.join(os.environ["DIST_TMP"], "ddp.pt")
    ddp_train.train(rank, world, DEVICE, 6, save=path)
    if rank != 0:
        return {}
    dist_params = torch.load(path)
    result = {}
    for device in (DEVICE, "cpu"):  # one process, the whole batches
        one = os.path.join(os.environ["DIST_TMP"], f"one-{device}.pt")
        ddp_train.train(0, 1, device, 6, save=one)
        ref = torch.load(one)
        result[device] = max((dist_params[k] - ref[k]).abs().max().item() for k in ref)
    initial = ddp_train.make_model().state_dict()
    result["moved"] = max((dist_params[k] - initial[k]).abs().max().item() for k in initial)
    return result


def fsdp(rank: int, world: int, port: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    import ddp_train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.accelerator.set_device_index(rank)
    mesh = init_device_mesh(DEVICE, (world,))
    dev = torch.device(DEVICE, rank)
    model = ddp_train.make_model().to(dev)
    for layer in model:
        if any(p.requires_grad for p in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rows = slice(rank * ddp_train.BATCH // world, (rank + 1) * ddp_train.BATCH // world)
    for step in range(6):
        x, y = ddp_train.global_batch(step)
        loss = torch.nn.functional.cross_entropy(model(x[rows].to(dev)), y[rows].to(dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
    full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    if rank != 0:
        return {}
    one = os.path.join(os.environ["DIST_TMP"], "one-fsdp.pt")
    ddp_train.train(0, 1, "cpu", 6, save=one)
    ref = torch.load(one)
    return {"cpu": max((full[k] - ref[k]).abs().max().item() for k in ref)}


def tensor_parallel(rank: int, world: int, port: int) -> dict:
    """An attention block and an MLP of acme's custom operators, split over the
    ranks with DTensor (q, k, v and the MLP's inputs by columns, the outputs by
    rows), so SDPA, its backward, rms_norm, bias_gelu and swiglu all run on
    sharded DTensors; against the unsplit block on the CPU."""
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    batch, seq, width, heads = 2, 6, 32, 4
    ops = torch.ops.acme  # the product's namespace, whatever the device is called

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
            self.norm = nn.Parameter(torch.rand(width) + 0.5)
            self.up = nn.Linear(width, 2 * width, bias=False)
            self.up_bias = nn.Parameter(torch.randn(2 * width) * 0.1)
            self.gate = nn.Linear(width, 2 * width, bias=False)
            self.down = nn.Linear(2 * width, width)

        def forward(self, x):
            b, s, _ = x.shape

            def split(t):  # -1: the heads (all of them, as a DTensor)
                return t.view(b, s, -1, width // heads).transpose(1, 2)
            a = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)),
                                               split(self.v(x)), is_causal=True)
            h = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
            n = F.rms_norm(h, (width,), self.norm, 1e-6)
            up = ops.bias_gelu(self.up(n), self.up_bias)
            return h + self.down(ops.swiglu(self.gate(n), up))

    torch.manual_seed(0)
    reference, x = Block(), torch.randn(batch, seq, width)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.accelerator.set_device_index(rank)
    mesh = init_device_mesh(DEVICE, (world,))
    model = Block()
    model.load_state_dict(reference.state_dict())
    model.to(torch.device(DEVICE, rank))
    columns, rows = ColwiseParallel(use_local_output=False), RowwiseParallel(use_local_output=False)
    parallelize_module(model, mesh, {"q": columns, "k": columns, "v": columns, "o": rows,
                                     "up": columns, "gate": columns, "down": rows})
    model.norm = nn.Parameter(distribute_tensor(model.norm.data, mesh, [Replicate()]))
    model.up_bias = nn.Parameter(distribute_tensor(model.up_bias.data, mesh, [Shard(0)]))

    xr = x.clone().requires_grad_()
    expected = reference(xr)
    (expected * expected).sum().backward()
    y = model(DTensor.from_local(x.to(torch.device(DEVICE, rank)), mesh, [Replicate()]))
    (y * y).sum().backward()
    result = {"forward": (y.full_tensor().cpu() - expected.detach()).abs().max().item()}
    result["gradients"] = max(
        (p.grad.full_tensor().cpu() - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters()))
    with torch.no_grad():  # rms_norm on the fused kernel, through DTensor's _fused_rms_norm strategy
        again = model(DTensor.from_local(x.to(torch.device(DEVICE, rank)), mesh, [Replicate()]))
    result["no_grad"] = (again.full_tensor().cpu() - expected.detach()).abs().max().item()
    dist.destroy_process_group()
    return result


# ---- faults: each must end in a clear error well inside the timeout ----

def failure(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # what the user sees
        return {"error": type(e).__name__, "message": str(e).splitlines()[0],
                "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def rank_exits(rank: int, world: int, port: int) -> dict:
    dev = init(rank, world, port, seconds=20)
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)  # the communicator is up
    torch.accelerator.synchronize()
    if rank == 1:
        os._exit(3)  # dies without a word
    result = failure(lambda: dist.all_reduce(t))
    result["after"] = failure(lambda: dist.all_reduce(t))  # the communicator stays failed
    return result


def rank_hangs(rank: int, world: int, port: int) -> dict:
    dev = init(rank, world, port, seconds=3)
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    if rank == 1:
        time.sleep(8)  # alive, but never comes
        return {}
    return failure(lambda: dist.all_reduce(t))


def sizes_differ(rank: int, world: int, port: int) -> dict:
    dev = init(rank, world, port, seconds=20)
    result = {"all_reduce": failure(lambda: dist.all_reduce(torch.ones(10 + 2 * rank, device=dev)))}
    group = dist.new_group()  # a fresh communicator for each case
    splits = [1, 1] if rank == 0 else [2, 0]
    result["all_to_all"] = failure(lambda: dist.all_to_all_single(
        torch.empty(2, device=dev), torch.ones(2, device=dev), splits, [1, 1], group=group))
    group = dist.new_group()
    t = torch.ones(3, device=dev) if rank == 0 else torch.ones(3, dtype=torch.int32, device=dev)
    result["send/recv"] = failure(
        lambda: dist.send(t, 1, group=group) if rank == 0 else dist.recv(t, 0, group=group))
    # rank 0 returns from send before the receiver checked; its wait is the next collective
    result["next"] = failure(lambda: dist.all_reduce(torch.ones(1, device=dev), group=group))
    return result


def wrong_device(rank: int, world: int, port: int) -> dict:
    dev = init(rank, world, port, seconds=3)
    dist.all_reduce(torch.ones(2, device=dev))  # binds rank r to acme:r
    other = torch.device(DEVICE, 1 - rank)
    if rank == 0:
        result = failure(lambda: dist.all_reduce(torch.ones(2, device=other)))
        time.sleep(5)  # stays alive: rank 1 must time out, not see rank 0 exit
        return result
    return failure(lambda: dist.all_reduce(torch.ones(2, device=dev)))  # waits for rank 0


SCENARIOS = {f.__name__: f for f in (collectives, init_forms, split, overlap, detail, ddp, fsdp,
                                      tensor_parallel, rank_exits, rank_hangs,
                                      sizes_differ, wrong_device)}

if __name__ == "__main__":
    # The ports of stores the test hosts (tools/rendezvous.py); the ranks join
    # them as clients (TORCHELASTIC_USE_AGENT_STORE is set in their environment).
    name, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ports = [int(p) for p in sys.argv[4].split(",")]
    result = SCENARIOS[name](rank, world, ports if name == "init_forms" else ports[0])
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # a failed communicator's group is not torn down cleanly by c10d
