"""Chapter 21's measurements, on two processes: a DDP training step on acme
against the same DDP step with gloo on CPU tensors, and all_reduce bus
bandwidth from 1 KiB to 64 MiB (acme's backend, and gloo's for reference).

    python tools/dist_bench.py [--quick]     # prints rank 0's JSON

tools/bench.py and the chapter call run(). The processes import torch_acme
from the environment they inherit (a stage's PYTHONPATH, or an installed one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = [1 << k for k in range(10, 27, 2)]  # bytes: 1 KiB, 4 KiB, ... 64 MiB


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """GB/s each rank's link carries in a ring all_reduce: the usual yardstick
    (NCCL's busBw), which makes sizes and rank counts comparable."""
    return nbytes * 2 * (world - 1) / world / seconds / 1e9


def rank_main(rank: int, world: int, port: int, quick: bool) -> dict:
    import warnings

    warnings.simplefilter("ignore")  # the fallback's notices
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch_acme

    sys.path.insert(0, str(Path(__file__).parent))
    from ddp_train import BATCH, global_batch, make_model

    device_name = torch_acme.DEVICE_NAME
    torch.accelerator.set_device_index(rank)
    dist.init_process_group(f"cpu:gloo,{device_name}:{device_name}",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dev = torch.device(device_name, rank)
    sync = {device_name: torch.accelerator.synchronize, "cpu": lambda: None}

    # DDP: the same model, batch and optimizer; acme's backend against gloo.
    x, y = global_batch(0)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    runs = {}
    for kind, where in ((device_name, dev), ("cpu", torch.device("cpu"))):
        model = DDP(make_model().to(where))
        runs[kind] = (model, torch.optim.SGD(model.parameters(), lr=0.01),
                      x[rows].to(where), y[rows].to(where))

    def steps(kind: str, number: int) -> float:
        model, opt, inputs, labels = runs[kind]
        sync[kind]()
        start = time.perf_counter()
        for _ in range(number):
            loss = F.cross_entropy(model(inputs), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
        sync[kind]()
        return (time.perf_counter() - start) / number

    rounds, number = (3, 20) if quick else (9, 50)
    for kind in runs:
        steps(kind, 3)  # warm up: buckets, caches
    acme_times, cpu_times = [], []
    for _ in range(rounds):
        acme_times.append(steps(device_name, number))
        cpu_times.append(steps("cpu", number))
    ratios = [a / c for a, c in zip(acme_times, cpu_times)]

    # all_reduce: float32 tensors of each size, one call after the other.
    bandwidth = {device_name: [], "gloo": []}
    for nbytes in SIZES:
        for kind, where in ((device_name, dev), ("gloo", torch.device("cpu"))):
            t = torch.ones(nbytes // 4, device=where)
            calls = max(3, min(200 if not quick else 50, (64 << 20) // nbytes))
            dist.all_reduce(t)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(t)
            sync[kind if kind != "gloo" else "cpu"]()
            seconds = (time.perf_counter() - start) / calls
            bandwidth[kind].append({"bytes": nbytes, "seconds": seconds,
                                    "bus_gb_s": bus_bandwidth(nbytes, seconds, world)})
    dist.destroy_process_group()
    return {"world": world, "rounds": rounds, "steps_per_round": number,
            "ddp_acme_s": statistics.median(acme_times), "ddp_gloo_cpu_s": statistics.median(cpu_times),
            "ratio": statistics.median(ratios), "ratios": ratios, "allreduce": bandwidth,
            "checked": os.environ.get("ACME_CHECKED", "1") != "0"}


def run(quick: bool = False, env: dict | None = None, world: int = 2,
        timeout: float = 600) -> dict:
    """Starts the ranks; returns rank 0's figures."""
    try:
        from rendezvous import hosted_stores
    except ImportError:
        from tools.rendezvous import hosted_stores
    with hosted_stores() as (ports, store_env):  # on a port the OS chose, hosted here
        command = [sys.executable, __file__, "--port", str(ports[0]), "--world", str(world)]
        command += ["--quick"] if quick else []
        procs = [subprocess.Popen([*command, "--rank", str(r)],
                                  env={**(os.environ if env is None else env), **store_env},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        try:
            outs = [p.communicate(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"a rank of tools/dist_bench.py failed:\n{err[-3000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and calls")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    if args.rank is None:
        print(json.dumps(run(args.quick, world=args.world), indent=1))
        return
    result = rank_main(args.rank, args.world, args.port, args.quick)
    if args.rank == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
