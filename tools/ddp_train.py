"""Data-parallel training as users write it (chapter 21): every process trains
a replica on its share of each batch; DistributedDataParallel averages the
gradients with all_reduce. Either launcher works:

    torchrun --standalone --nproc-per-node 2 tools/ddp_train.py --device acme
    python tools/ddp_train.py --device acme --spawn 2

--world 1 trains one process on the whole batches: what DDP must equal.
--save PATH writes rank 0's final parameters there (torch.save).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

FEATURES, CLASSES, BATCH = 32, 8, 64  # BATCH: the global batch, split among the ranks


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every replica starts equal (DDP also broadcasts rank 0's)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.GELU(), nn.LayerNorm(64),
                         nn.Linear(64, CLASSES))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank for a step; each rank trains on its rows."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, (x[:, :CLASSES].sum(1) * 3).long().clamp(0, CLASSES - 1)


def train(rank: int, world: int, device_type: str, steps: int, save: str | None = None,
          timing: list | None = None) -> None:
    if device_type != "cpu":
        import torch_acme  # noqa: F401  (a pip-installed stage autoloads instead)
        torch.accelerator.set_device_index(rank)  # one device per rank
    device = torch.device(device_type, rank) if device_type != "cpu" else torch.device("cpu")
    model = make_model().to(device)
    if world > 1:
        # No backend named: the accelerator's own (acme's, registered by
        # torch_acme); on the CPU, gloo.
        dist.init_process_group(None if device_type != "cpu" else "gloo", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        model = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for step in range(steps):
        if step == 2 and timing is not None:
            torch.accelerator.synchronize() if device_type != "cpu" else None
            start = time.perf_counter()
        x, y = global_batch(step)
        loss = nn.functional.cross_entropy(model(x[rows].to(device)), y[rows].to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
    final = {k: v.detach().cpu() for k, v in
             (model.module if world > 1 else model).state_dict().items()}
    if timing is not None:
        timing.append((time.perf_counter() - start) / (steps - 2))
    if save and rank == 0:
        torch.save(final, save)
    if world > 1:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, device_type: str, steps: int, save: str | None) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    train(rank, world, device_type, steps, save)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="acme")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--spawn", type=int, default=0, help="start this many processes")
    parser.add_argument("--world", type=int, default=0, help="1: one process, no DDP")
    parser.add_argument("--save")
    args = parser.parse_args()
    if args.spawn:  # as mp.spawn users do: host the rendezvous ourselves
        import torch.multiprocessing as mp

        store = None
        if "MASTER_PORT" not in os.environ:
            # Port 0: the OS picks a port and the store keeps it, so no other
            # process can take it first. This process hosts the store, as
            # torchrun's agent does; the flag makes every rank a client of it.
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                              TORCHELASTIC_USE_AGENT_STORE="True")
        mp.spawn(_spawned, args=(args.spawn, args.device, args.steps, args.save),
                 nprocs=args.spawn)
        del store
    elif args.world == 1:
        train(0, 1, args.device, args.steps, args.save)
    else:  # under torchrun: the environment says who we are
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.device, args.steps,
              args.save)


if __name__ == "__main__":
    main()
