"""Train a small CNN or a small transformer language model, written the way
torch.cuda training scripts are written. Nothing in it names a backend: the
device is whatever `torch.accelerator` reports (or --device), so the same file
runs on a CPU, a CUDA GPU, or any accelerator whose package is installed.

    python train.py --model cnn                      # the accelerator, else the CPU
    python train.py --model lm --amp bf16 --compile
    python train.py --model cnn --device cpu --metrics cpu.jsonl
    torchrun --nproc-per-node 2 train.py --model cnn # DistributedDataParallel

With --checkpoint, the state is saved at the end of every epoch and a run
started again resumes from it: the same losses as a run never stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler

# --- data: synthetic, but learnable; sample i is the same on every device -----


class Shapes(Dataset):
    """3x16x16 images of one of 10 classes: a bright bar at one of 10 places."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = int(torch.randint(10, (), generator=g))
        image = torch.randn(3, 16, 16, generator=g) * 0.5
        row, col = divmod(label, 5)
        image[label % 3, 2 + 6 * row:6 + 6 * row, 1 + 3 * col:3 + 3 * col] += 2.0
        return image, label


class Counting(Dataset):
    """Token sequences that count up by a per-sequence step, with noise: the
    next token is predictable from the ones before it."""

    VOCAB = 64

    def __init__(self, size: int, seed: int, length: int = 32):
        self.size, self.seed, self.length = size, seed, length

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start, step = torch.randint(self.VOCAB, (2,), generator=g)
        tokens = (start + (step % 7 + 1) * torch.arange(self.length + 1)) % self.VOCAB
        noise = torch.rand(self.length + 1, generator=g) < 0.05
        tokens[noise] = torch.randint(self.VOCAB, (int(noise.sum()),), generator=g)
        return tokens[:-1], tokens[1:]


# --- models --------------------------------------------------------------------


class ConvNet(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.features = nn.Sequential(
            # No bias before a batch norm: it would cancel it (and AdamW would
            # still move it, by rounding noise alone).
            nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(32 * 16, 10))

    def forward(self, x):
        return self.head(self.features(x))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(a.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, dropout: float, width: int = 64, heads: int = 4, depth: int = 2,
                 length: int = 32):
        super().__init__()
        self.embed = nn.Embedding(Counting.VOCAB, width)
        self.position = nn.Parameter(torch.randn(length, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.out = nn.Linear(width, Counting.VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position
        for block in self.blocks:
            # Activation checkpointing: the block's activations are recomputed
            # in backward, its dropout masks with them (the RNG state is kept).
            x = checkpoint(block, x, use_reentrant=False) if self.training else block(x)
        return self.out(self.ln(x))


# --- training --------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["cnn", "lm"], default="cnn")
    p.add_argument("--device", help="default: the current accelerator, else the CPU")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=512, help="per epoch")
    p.add_argument("--batch-size", type=int, default=32, help="global, split among ranks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--fused", action="store_true", help="fused AdamW (default: foreach)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", help="save here every epoch; resume from it if it exists")
    p.add_argument("--metrics", help="append one JSON line per step to this file")
    p.add_argument("--save", help="write the final parameters here")
    return p.parse_args(argv)


def train_step(model, forward, optimizer, scaler, inputs, targets, amp_dtype=None):
    """One optimizer step on one batch; returns the loss and the gradients' norm."""
    autocast = (torch.autocast(inputs.device.type, dtype=amp_dtype) if amp_dtype
                else contextlib.nullcontext())
    with autocast:
        logits = forward(inputs)
        loss = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(optimizer)  # skipped if the gradients overflowed (float16)
    scaler.update()
    return loss, norm


def main(argv=None):
    args = parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.device:
        device = torch.device(args.device)
    elif torch.accelerator.is_available():
        device = torch.accelerator.current_accelerator()
    else:
        device = torch.device("cpu")
    if device.type != "cpu":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.accelerator.set_device_index(local_rank)
        device = torch.device(device.type, local_rank)
    if distributed:
        # The backend that serves this device type (nccl for cuda, gloo for the CPU).
        dist.init_process_group(dist.get_default_backend_for_device(device))

    torch.manual_seed(args.seed)  # every generator: the CPU's and the accelerator's
    if args.model == "cnn":
        data, model = Shapes(args.samples, args.seed), ConvNet(args.dropout)
    else:
        data, model = Counting(args.samples, args.seed), TinyLM(args.dropout)
    model = model.to(device)
    if distributed:
        # Batch statistics over the global batch, as one process would see it.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = DistributedDataParallel(model)
    forward = torch.compile(model) if args.compile else model

    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size // world, sampler=sampler,
                        num_workers=args.workers, pin_memory=device.type != "cpu",
                        persistent_workers=args.workers > 0, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                                  **({"fused": True} if args.fused else {"foreach": True}))
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    epoch = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, map_location="cpu")  # load_state_dict moves it
        (model.module if distributed else model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"]["cpu"])
        if device.type != "cpu":
            torch.get_device_module(device).set_rng_state(state["rng"]["device"], device)
        epoch = state["epoch"]

    log = open(args.metrics, "a") if args.metrics and rank == 0 else None
    step = epoch * len(loader)
    for epoch in range(epoch, args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            loss, norm = train_step(model, forward, optimizer, scaler, inputs, targets,
                                    amp_dtype)
            if distributed:  # report the global batch's loss, not this rank's share
                loss = loss.detach().clone()
                dist.all_reduce(loss)
                loss /= world
            if log:
                log.write(json.dumps({"device": str(device), "epoch": epoch, "step": step,
                                      "loss": loss.item(),
                                      "grad_norm": norm.item(), "time": time.time()}) + "\n")
                log.flush()
            step += 1
        if args.checkpoint and rank == 0:
            state = {"model": (model.module if distributed else model).state_dict(),
                     "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch + 1, "rng": {"cpu": torch.get_rng_state()}}
            if device.type != "cpu":
                state["rng"]["device"] = torch.get_device_module(device).get_rng_state(device)
            torch.save(state, args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)  # never a torn file
    if args.save and rank == 0:
        torch.save({k: v.cpu() for k, v in
                    (model.module if distributed else model).state_dict().items()}, args.save)
    if log:
        log.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
