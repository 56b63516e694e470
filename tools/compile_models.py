"""The models chapter 20 compiles: its tests, its page and the benchmark use
the same ones. Import after torch_acme (they are built on the device later)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def chain(x):
    """Eight elementwise ops: what Inductor fuses into one kernel."""
    return ((((x * 1.5 + 0.5).sin() * x).cos() - x) * 0.25).exp()


class MLP(nn.Module):
    """Linear layers with chains of elementwise ops between them to fuse."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 16)

    def forward(self, x):
        h = self.a(x)
        return self.b((F.gelu(h) * torch.sigmoid(h) + 0.5).tanh())


class Block(nn.Module):
    """A pre-norm transformer block: attention, layer norm, GELU."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(batch, length, width))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ConvBlock(nn.Module):
    """Convolution, batch norm, pooling and a residual connection."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.c1(x))), 2)
        x = F.relu(self.c2(x)) + x
        return self.fc(F.adaptive_avg_pool2d(x, 4).flatten(1))


# name -> (model class, input shape)
MODELS = {"mlp": (MLP, (8, 32)), "block": (Block, (2, 8, 32)), "cnn": (ConvBlock, (4, 3, 8, 8))}


def forward_backward(model, x):
    """The output, the input's gradient and the parameters' gradients."""
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.square().sum().backward()
    return out.detach(), x.grad, [p.grad for p in model.parameters()]
