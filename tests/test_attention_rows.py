"""Chapter 23: attention a query row at a time (csrc/aten/attention_rows.cpp).

From chapter 23 acme's fused attention computes float32 and float64 inputs
in one pass per query row, four rows at a time, in blocks of eight numbers,
with its own e^x for float32 on AVX2 CPUs. The cases here are the edges of
that arithmetic, in float32 (chapter 13's tests are mostly float64): groups
of four rows and the rows left over, causal rows that see fewer keys than
their group, padding of keys and features to whole blocks, broadcast and
-inf biases, rows that see nothing, scores far enough apart that e^x falls
below the smallest float, NaN, and dropout's mask in forward and backward.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(
    importlib.import_module("torch_acme._build_info").STAGE < 23,
    reason="attention by rows arrives in chapter 23")

DEVICE = torch._C._get_privateuse1_backend_name()


def leaves(*shapes, scale=1.0):
    return [(torch.randn(*shape) * scale).requires_grad_() for shape in shapes]


def run(device, q, k, v, mask=None, **kwargs):
    """SDPA's output and the gradients of its leaves (q, k, v and a float mask) on `device`."""
    moved = [t.detach().to(device).requires_grad_(t.requires_grad) for t in (q, k, v)]
    if mask is not None:
        mask = mask.detach().to(device).requires_grad_(mask.requires_grad)
    out = F.scaled_dot_product_attention(*moved, attn_mask=mask, **kwargs)
    wanted = [t for t in (*moved, mask) if t is not None and t.requires_grad]
    torch.manual_seed(1)
    grads = torch.autograd.grad(out, wanted, torch.randn(out.shape).to(device))
    return [out.detach().cpu(), *(g.cpu() for g in grads)]


def assert_like_cpu(q, k, v, mask=None, **kwargs):
    expected = run("cpu", q, k, v, mask, **kwargs)
    actual = run(DEVICE, q, k, v, mask, **kwargs)
    for name, a, e in zip(("out", "dq", "dk", "dv", "dmask"), actual, expected):
        torch.testing.assert_close(a, e, msg=lambda m: f"{name}: {m}")


# (batch dims, queries, keys, features, values): 4-row groups with and
# without a remainder, keys and features that fill no whole block, one key.
SHAPES = {
    "lm": ((32, 4), 32, 32, 16, 16),
    "ragged": ((2, 3), 7, 11, 5, 3),
    "one-query": ((3,), 1, 9, 8, 8),
    "one-key": ((2, 2), 6, 1, 4, 4),
    "long": ((1, 1), 9, 70, 24, 9),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_float32_matches_the_cpu(shape, causal):
    batch, queries, keys, features, values = SHAPES[shape]
    torch.manual_seed(0)
    q, k, v = leaves((*batch, queries, features), (*batch, keys, features),
                     (*batch, keys, values))
    assert_like_cpu(q, k, v, is_causal=causal)


def test_a_broadcast_bias_and_its_gradient():
    torch.manual_seed(2)
    q, k, v = leaves((2, 3, 6, 8), (2, 3, 10, 8), (2, 3, 10, 8))
    bias = torch.randn(3, 1, 10).requires_grad_()  # over heads and keys, shared by queries
    assert_like_cpu(q, k, v, bias)


def test_rows_that_see_no_key_give_zeros():
    # A boolean mask that hides every key from some rows: their output is 0,
    # as on the CPU, and they pass no gradient on.
    torch.manual_seed(3)
    q, k, v = leaves((2, 2, 9, 8), (2, 2, 5, 8), (2, 2, 5, 8))
    mask = torch.rand(2, 2, 9, 5) > 0.4
    mask[:, :, 2] = False
    mask[1, 0, 7] = False
    assert_like_cpu(q, k, v, mask)
    out = F.scaled_dot_product_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
                                         attn_mask=mask.to(DEVICE)).cpu()
    assert torch.equal(out[:, :, 2], torch.zeros(2, 2, 8))


def test_scores_far_apart():
    # Every third key a hundred below the rest: e^x of their shifted scores
    # is below the smallest normal float, where the AVX2 e^x gives 0 and
    # std::exp a subnormal that changes no sum.
    torch.manual_seed(4)
    q, k, v = leaves((1, 2, 8, 4), (1, 2, 12, 4), (1, 2, 12, 4))
    bias = torch.zeros(8, 12)
    bias[:, ::3] = -100.0
    assert_like_cpu(q, k, v, bias)


def test_nan_stays_in_its_row():
    q, k, v = (torch.randn(1, 1, 8, 8) for _ in range(3))
    q[0, 0, 5, 3] = float("nan")
    out = F.scaled_dot_product_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)).cpu()
    assert out[0, 0, 5].isnan().all()
    torch.testing.assert_close(out[0, 0, :5], F.scaled_dot_product_attention(q, k, v)[0, 0, :5])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_mask_in_forward_and_backward(causal):
    # With the identity as values the output is the dropped-out attention
    # matrix: it shows the mask. The same computation spelled out on the CPU
    # with that mask gives the output and the gradients of q, k and v.
    torch.manual_seed(5)
    p, keys = 0.3, 13
    q, k = leaves((3, 2, 9, keys), (3, 2, keys, keys))
    eye = torch.eye(keys).expand(3, 2, keys, keys)
    torch.acme.manual_seed(42)
    probs = F.scaled_dot_product_attention(q.detach().to(DEVICE), k.detach().to(DEVICE),
                                           eye.to(DEVICE), dropout_p=p, is_causal=causal)
    keep = probs.cpu() != 0
    v = leaves((3, 2, keys, 6))[0]
    torch.acme.manual_seed(42)
    actual = run(DEVICE, q, k, v, dropout_p=p, is_causal=causal)

    def by_hand(q, k, v):
        scores = q @ k.transpose(-2, -1) / keys ** 0.5
        if causal:
            scores = scores.masked_fill(~torch.ones(9, keys, dtype=torch.bool).tril(), -torch.inf)
        return (scores.softmax(-1) * keep / (1 - p)) @ v

    out = by_hand(q, k, v)
    torch.manual_seed(1)
    expected = [out.detach(), *torch.autograd.grad(out, (q, k, v), torch.randn(out.shape))]
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
