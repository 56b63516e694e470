"""Chapter 13: the ops ATen routes to the device, against the CPU.

Convolutions of every dimension and kind, the recurrent layers and cells,
scaled dot-product attention through the fused overrideable path, and the view
ops the CPU fallback refuses. Each case runs the same module or function on
CPU and acme from the same parameters and inputs, then compares the outputs
and every gradient (inputs and parameters). float64 cases compare tightly;
float32, half and bfloat16 with the tolerances PyTorch's own tests use.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_acme  # noqa: F401
from conftest import composites_where_the_cpu_has_a_kernel
from torch_acme import _build_info

if _build_info.STAGE < 13:
    pytest.skip(f"the stage under test ({_build_info.STAGE}) predates chapter 13",
                allow_module_level=True)

DEVICE = torch._C._get_privateuse1_backend_name()


@pytest.fixture(autouse=True)
def quiet_fallback():
    # Padding modes and pooling still run on the CPU fallback, which warns.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def on(device, tree):
    """Copies of the tensors in `tree` on `device`, leaves again where they were."""
    if isinstance(tree, torch.Tensor):
        out = tree.detach().to(device)
        return out.requires_grad_(tree.requires_grad)
    if isinstance(tree, (list, tuple)):
        return type(tree)(on(device, t) for t in tree)
    return tree


def flat(result):
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, nn.utils.rnn.PackedSequence):
        return [result.data]
    if isinstance(result, (list, tuple)):
        return [t for r in result for t in flat(r)]
    return []


def compare_module(module: nn.Module, *inputs, rtol=None, atol=None):
    """Forward and backward of `module` on CPU and acme, compared."""
    torch.manual_seed(0)
    acme_module = copy.deepcopy(module).to(DEVICE)
    results = {}
    for device, mod in (("cpu", module), (DEVICE, acme_module)):
        args = on(device, inputs)
        out = flat(mod(*args))
        grads = [torch.ones_like(o).mul_(0.5).add_(torch.arange(o.numel(), device=device)
                                                    .reshape(o.shape).remainder(7).to(o.dtype))
                 for o in out]
        differentiable = [(o, g) for o, g in zip(out, grads) if o.requires_grad]
        leaves = [a for a in flat(args) if a.requires_grad] + list(mod.parameters())
        if differentiable:
            got = torch.autograd.grad([o for o, _ in differentiable],
                                      leaves, [g for _, g in differentiable],
                                      allow_unused=True)
        else:
            got = []
        results[device] = ([o.detach() for o in out], list(got))
    for expected, actual in zip(results["cpu"][0] + results["cpu"][1],
                                results[DEVICE][0] + results[DEVICE][1]):
        if expected is None:
            assert actual is None
            continue
        assert actual.device.type == DEVICE
        torch.testing.assert_close(actual.cpu(), expected, rtol=rtol, atol=atol)
    return results


def leaf(*shape, dtype=torch.float64, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


# ---- convolution ----

CONVOLUTIONS = [
    ("conv1d", lambda: nn.Conv1d(4, 6, 3), (2, 4, 11)),
    ("conv1d-stride-pad-dilation", lambda: nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2),
     (2, 4, 13)),
    ("conv1d-unbatched", lambda: nn.Conv1d(4, 6, 3), (4, 9)),
    ("conv2d", lambda: nn.Conv2d(3, 4, 3), (2, 3, 8, 7)),
    ("conv2d-no-bias", lambda: nn.Conv2d(3, 4, (3, 2), bias=False), (2, 3, 8, 7)),
    ("conv2d-grouped", lambda: nn.Conv2d(4, 6, 3, groups=2, padding=1), (2, 4, 6, 6)),
    ("conv2d-depthwise", lambda: nn.Conv2d(4, 8, 3, groups=4), (2, 4, 6, 6)),
    ("conv2d-same", lambda: nn.Conv2d(3, 4, 4, padding="same", dilation=2), (1, 3, 9, 9)),
    ("conv2d-valid", lambda: nn.Conv2d(3, 4, 3, padding="valid", stride=(2, 1)), (1, 3, 9, 9)),
    ("conv2d-reflect", lambda: nn.Conv2d(3, 4, 3, padding=2, padding_mode="reflect"), (2, 3, 6, 6)),
    ("conv2d-replicate", lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="replicate"),
     (2, 3, 6, 6)),
    ("conv2d-circular", lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"),
     (2, 3, 6, 6)),
    ("conv3d", lambda: nn.Conv3d(2, 3, 3, padding=1, stride=(1, 2, 1)), (1, 2, 5, 6, 4)),
    ("conv3d-grouped-dilated", lambda: nn.Conv3d(4, 4, 2, groups=2, dilation=2), (1, 4, 5, 5, 5)),
    ("conv-transpose1d", lambda: nn.ConvTranspose1d(4, 3, 3, stride=2, output_padding=1),
     (2, 4, 7)),
    ("conv-transpose2d", lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, groups=2),
     (2, 4, 5, 5)),
    ("conv-transpose2d-dilated", lambda: nn.ConvTranspose2d(3, 2, 3, dilation=2, bias=False),
     (1, 3, 4, 5)),
    ("conv-transpose3d", lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), (1, 2, 3, 3, 3)),
]


@pytest.mark.parametrize("make, shape", [c[1:] for c in CONVOLUTIONS],
                         ids=[c[0] for c in CONVOLUTIONS])
def test_convolution_matches_cpu(make, shape):
    torch.manual_seed(1)
    compare_module(make().double(), leaf(*shape))


def test_convolution_float32_channels_last():
    torch.manual_seed(2)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last).requires_grad_()
    results = compare_module(nn.Conv2d(3, 5, 3, padding=1), x)
    # The memory format travels through acme's kernel as it does on the CPU.
    out = results[DEVICE][0][0]
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_convolution_complex():
    torch.manual_seed(3)
    x = torch.randn(2, 3, 9, dtype=torch.complex128)
    w = torch.randn(4, 3, 3, dtype=torch.complex128)
    expected = F.conv1d(x, w, padding=1)
    torch.testing.assert_close(F.conv1d(x.to(DEVICE), w.to(DEVICE), padding=1).cpu(), expected)


def test_convolution_double_backward():
    torch.manual_seed(4)
    conv = nn.Conv2d(2, 3, 3).double()
    x = leaf(1, 2, 5, 5)

    def second_order(device):
        mod = copy.deepcopy(conv).to(device)
        xd = on(device, x)
        (g,) = torch.autograd.grad(mod(xd).pow(2).sum(), xd, create_graph=True)
        return torch.autograd.grad(g.sum(), list(mod.parameters()))

    for expected, actual in zip(second_order("cpu"), second_order(DEVICE)):
        torch.testing.assert_close(actual.cpu(), expected)


def test_convolution_is_acme_kernel():
    row = next(r for r in torch._C._dispatch_dump_table("aten::convolution_overrideable")
               .splitlines() if r.startswith("PrivateUse1"))
    assert "convolution.cpp" in row and "fallback" not in row


# ---- recurrent layers and cells ----

RNNS = [
    ("lstm", lambda: nn.LSTM(3, 4)),
    ("lstm-2-layers-bidirectional", lambda: nn.LSTM(3, 4, num_layers=2, bidirectional=True)),
    ("lstm-batch-first-no-bias", lambda: nn.LSTM(3, 4, batch_first=True, bias=False)),
    ("lstm-projection", lambda: nn.LSTM(3, 5, proj_size=2)),
    ("gru", lambda: nn.GRU(3, 4)),
    ("gru-2-layers-bidirectional", lambda: nn.GRU(3, 4, num_layers=2, bidirectional=True)),
    ("gru-no-bias", lambda: nn.GRU(3, 4, bias=False)),
    ("rnn-tanh", lambda: nn.RNN(3, 4, num_layers=2)),
    ("rnn-relu", lambda: nn.RNN(3, 4, nonlinearity="relu", bidirectional=True)),
]


@pytest.mark.parametrize("make", [r[1] for r in RNNS], ids=[r[0] for r in RNNS])
def test_recurrent_layer_matches_cpu(make):
    torch.manual_seed(5)
    module = make().double()
    x = leaf(4, 2, 3) if not module.batch_first else leaf(2, 4, 3)
    compare_module(module, x)


@pytest.mark.parametrize("make", [r[1] for r in RNNS if "2-layers" in r[0]],
                         ids=[r[0] for r in RNNS if "2-layers" in r[0]])
def test_recurrent_layer_with_initial_state(make):
    torch.manual_seed(6)
    layer = make().double()
    lstm = isinstance(layer, nn.LSTM)

    class WithState(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x, *state):
            return self.layer(x, state if lstm else state[0])

    state = (leaf(4, 3, 4), leaf(4, 3, 4)) if lstm else (leaf(4, 3, 4),)
    compare_module(WithState(), leaf(5, 3, 3), *state)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_packed_sequences(kind):
    torch.manual_seed(7)
    layer = (nn.LSTM if kind == "lstm" else nn.GRU)(3, 4, num_layers=2,
                                                    bidirectional=True).double()
    padded = leaf(5, 3, 3)
    lengths = torch.tensor([5, 3, 2])

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            packed = nn.utils.rnn.pack_padded_sequence(x, lengths)
            out, _ = self.layer(packed)
            return nn.utils.rnn.pad_packed_sequence(out)[0]

    compare_module(Packed(), padded)


CELLS = [
    ("lstm-cell", lambda: nn.LSTMCell(3, 4), True),
    ("lstm-cell-no-bias", lambda: nn.LSTMCell(3, 4, bias=False), True),
    ("gru-cell", lambda: nn.GRUCell(3, 4), False),
    ("gru-cell-no-bias", lambda: nn.GRUCell(3, 4, bias=False), False),
]


@pytest.mark.parametrize("make, lstm", [c[1:] for c in CELLS], ids=[c[0] for c in CELLS])
def test_cells_match_cpu(make, lstm):
    torch.manual_seed(8)
    cell = make().double()
    h = leaf(2, 4)
    state = (h, leaf(2, 4)) if lstm else h

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = cell

        def forward(self, x, *s):
            return self.cell(x, s if lstm else s[0])

    compare_module(Step(), leaf(2, 3), *(state if lstm else (state,)))
    # Unbatched input, no state: the cell makes its own zeros.
    compare_module(cell, leaf(3))


def test_cells_float32_and_half():
    torch.manual_seed(9)
    compare_module(nn.LSTMCell(3, 4), torch.randn(2, 3, requires_grad=True))
    x = torch.randn(2, 3)
    for dtype in (torch.float16, torch.bfloat16):
        cell = nn.GRUCell(3, 4).to(dtype)
        expected = cell(x.to(dtype))
        actual = copy.deepcopy(cell).to(DEVICE)(x.to(dtype).to(DEVICE))
        # The fused cell adds each bias to its gates (the CPU's addmm adds it
        # inside the matmul), so 16-bit results may differ by a rounding step.
        torch.testing.assert_close(actual.cpu(), expected, atol=1e-2, rtol=1e-2)


def test_lstm_uses_the_fused_cell():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        nn.LSTM(3, 4).to(DEVICE)(torch.randn(2, 1, 3, device=DEVICE))
    assert "aten::_thnn_fused_lstm_cell" in {e.name for e in prof.events()}


# ---- scaled dot-product attention ----

def sdpa_pair(q, k, v, **kwargs):
    """SDPA on CPU (its own kernels) and acme (the fused path), outputs and grads."""
    results = []
    for device in ("cpu", DEVICE):
        qd, kd, vd = on(device, (q, k, v))
        mask = kwargs.get("attn_mask")
        kw = dict(kwargs, attn_mask=on(device, mask)) if mask is not None else kwargs
        out = F.scaled_dot_product_attention(qd, kd, vd, **kw)
        leaves = [t for t in (qd, kd, vd, kw.get("attn_mask")) if t is not None and t.requires_grad]
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out)) if leaves else []
        results.append((out, grads))
    return results


SDPA_CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "scale": {"scale": 0.3},
    "bool-mask": {"attn_mask": torch.rand(5, 7) > 0.3},
    "float-mask-with-grad": {"attn_mask": torch.randn(2, 1, 5, 7, dtype=torch.float64,
                                                      requires_grad=True)},
    "fully-masked-row": {"attn_mask": torch.tensor([[False] * 7] + [[True] * 7] * 4)},
}


@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_matches_cpu(case):
    torch.manual_seed(10)
    q, k, v = leaf(2, 3, 5, 8), leaf(2, 3, 7, 8), leaf(2, 3, 7, 6)
    (expected, expected_grads), (actual, actual_grads) = sdpa_pair(q, k, v, **SDPA_CASES[case])
    torch.testing.assert_close(actual.cpu(), expected)
    assert actual.grad_fn.name() == "ScaledDotProductFusedAttentionOverrideableBackward0"
    for e, a in zip(expected_grads, actual_grads):
        torch.testing.assert_close(a.cpu(), e)


def test_sdpa_kernel_with_no_keys():
    # F.scaled_dot_product_attention answers an empty key itself, but the op
    # can be called directly (the compiler does): nothing to attend to gives
    # zeros and a log-sum-exp of -inf, as on the CPU, not an error.
    q, k, v = (torch.randn(2, 3, length, 8, device=DEVICE) for length in (5, 0, 0))
    out, logsumexp, *_ = torch.ops.aten._scaled_dot_product_fused_attention_overrideable(q, k, v)
    assert torch.equal(out.cpu(), torch.zeros(2, 3, 5, 8))
    assert torch.equal(logsumexp.cpu(), torch.full((2, 3, 5), -math.inf))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sdpa_reduced_precision(dtype):
    torch.manual_seed(11)
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=dtype) for _ in range(3))
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(dtype)
    actual = F.scaled_dot_product_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.cpu(), expected)


def test_sdpa_backend_choice_follows_the_user():
    q = torch.randn(1, 1, 4, 8, device=DEVICE)
    assert torch._fused_sdp_choice(q, q, q) == SDPBackend.OVERRIDEABLE.value
    with sdpa_kernel([SDPBackend.MATH]):
        assert torch._fused_sdp_choice(q, q, q) == SDPBackend.MATH.value
        out = F.scaled_dot_product_attention(q, q, q)
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(*[q.cpu()] * 3))
    # Grouped-query attention has no fused form: the math path serves it.
    kv = torch.randn(1, 1, 4, 8, device=DEVICE)
    q4 = torch.randn(1, 2, 4, 8, device=DEVICE)
    assert torch._fused_sdp_choice(q4, kv, kv, enable_gqa=True) == SDPBackend.MATH.value
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q4, kv, kv, enable_gqa=True).cpu(),
        F.scaled_dot_product_attention(q4.cpu(), kv.cpu(), kv.cpu(), enable_gqa=True))


def dropout_run(seed, q, k, v, p):
    torch.acme.manual_seed(seed)
    qd, kd, vd = on(DEVICE, (q, k, v))
    out = F.scaled_dot_product_attention(qd, kd, vd, dropout_p=p)
    grads = torch.autograd.grad(out, (qd, kd, vd), torch.ones_like(out))
    return out, grads


def test_sdpa_dropout_uses_the_device_generator_and_one_mask():
    torch.manual_seed(12)
    p = 0.4
    q, k = leaf(2, 2, 6, 8), leaf(2, 2, 7, 8)
    # With v the identity, the output is the dropped-out attention matrix
    # itself: it shows the mask that the seed selects.
    eye = torch.eye(7, dtype=torch.float64).expand(2, 2, 7, 7).clone().requires_grad_()
    probs, _ = dropout_run(123, q, k, eye, p)
    keep = probs.detach().cpu() != 0
    assert 0.5 < keep.double().mean() < 0.7  # 1 - p, on 168 draws
    v = leaf(2, 2, 7, 5)
    out, grads = dropout_run(123, q, k, v, p)
    again, _ = dropout_run(123, q, k, v, p)
    other, _ = dropout_run(124, q, k, v, p)
    assert torch.equal(out.cpu(), again.cpu())  # the acme seed decides the mask
    assert not torch.equal(out.cpu(), other.cpu())
    # Forward and backward both used that mask: compare with the same
    # computation on the CPU, spelled out, with the mask applied by hand.
    qc, kc, vc = on("cpu", (q, k, v))
    attn = torch.softmax(qc @ kc.transpose(-2, -1) / 8 ** 0.5, dim=-1)
    expected = (attn * keep / (1 - p)) @ vc
    expected_grads = torch.autograd.grad(expected, (qc, kc, vc), torch.ones_like(expected))
    torch.testing.assert_close(out.detach().cpu(), expected.detach())
    for e, a in zip(expected_grads, grads):
        torch.testing.assert_close(a.cpu(), e)


def test_multihead_attention_matches_cpu():
    torch.manual_seed(13)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).double()
    x = leaf(2, 5, 8)

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    compare_module(SelfAttention(), x)


def test_transformer_encoder_layer_matches_cpu():
    torch.manual_seed(14)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0,
                                       batch_first=True).double()
    compare_module(layer, leaf(2, 5, 8))


# ---- the Transformer's fast path ----

FAST_PATH_MASKS = {"none": (None, None), "padding": ("padding", None), "causal": (None, "causal")}


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask", list(FAST_PATH_MASKS))
def test_the_dense_fast_paths_run_on_acmes_kernels(mask, need_weights):
    # nn.MultiheadAttention (self-attention) and TransformerEncoderLayer in
    # eval mode without grad call _native_multi_head_attention and
    # _transformer_encoder_layer_fwd on PrivateUse1 too: PyTorch's composites,
    # registered for acme (nested.cpp), not the CPU fallback.
    torch.manual_seed(19)
    padding, attn = FAST_PATH_MASKS[mask]
    x = torch.randn(3, 5, 8)
    key_padding = (torch.arange(5) >= torch.tensor([5, 3, 2]).unsqueeze(1)) if padding else None
    causal = nn.Transformer.generate_square_subsequent_mask(5) if attn else None
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()

    def run(device):
        on = lambda t: None if t is None else t.to(device)  # noqa: E731
        with torch.no_grad(), torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            m = copy.deepcopy(mha).to(device)
            out, weights = m(on(x), on(x), on(x), key_padding_mask=on(key_padding),
                             attn_mask=on(causal), need_weights=need_weights)
            encoded = copy.deepcopy(layer).to(device)(on(x), src_mask=on(causal),
                                                      src_key_padding_mask=on(key_padding))
        events = prof.events()
        fell_back = {e.name for e in events for c in e.cpu_children if c.name == "aten::_to_cpu"}
        return (out, weights, encoded), {e.name for e in events}, fell_back

    expected, cpu_names, _ = run("cpu")
    actual, acme_names, fell_back = run(DEVICE)
    for name in ("aten::_native_multi_head_attention", "aten::_transformer_encoder_layer_fwd"):
        assert name in cpu_names and name in acme_names  # the fast path on both
    # The CPU fallback moves its arguments with _to_cpu. Without a mask nothing
    # takes it; a mask adds operators acme has no kernel for, on the attention
    # scores and the mask (baddbmm: q.kT + mask). No operator that reads a weight.
    on_scores = {"aten::_masked_softmax", "aten::masked_fill_", "aten::baddbmm"}
    assert fell_back <= (on_scores if mask != "none" else set()), fell_back
    for got, want in zip(actual, expected):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5, equal_nan=True)


ENCODERS = {
    "relu": dict(activation="relu", norm_first=False),
    "gelu": dict(activation="gelu", norm_first=False),
    "norm-first": dict(activation="relu", norm_first=True),  # PyTorch packs nothing here
}
LENGTHS = {"ragged": [5, 3, 1], "full": [5, 5, 5], "one-empty": [4, 0, 2]}


@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("kind", list(ENCODERS))
def test_transformer_encoder_fast_path_matches_cpu(kind, lengths):
    # In eval mode with a padding mask, nn.TransformerEncoder packs its input
    # into a nested tensor, runs _transformer_encoder_layer_fwd on it and pads
    # it back (on the CPU, CUDA and PrivateUse1 alike): acme's nested.cpp.
    torch.manual_seed(18)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, **ENCODERS[kind])
    encoder = nn.TransformerEncoder(layer, 2).eval()
    sizes = LENGTHS[lengths]
    src = torch.randn(len(sizes), max(sizes), 8)
    padding = torch.arange(max(sizes)).unsqueeze(0) >= torch.tensor(sizes).unsqueeze(1)
    def run(module, device):
        with torch.no_grad(), torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = module(src.to(device), src_key_padding_mask=padding.to(device))
        nested = {"aten::_nested_tensor_from_mask", "aten::to_padded_tensor"}
        return out, nested <= {event.name for event in prof.events()}

    expected, cpu_packed = run(encoder, "cpu")
    actual, acme_packed = run(copy.deepcopy(encoder).to(DEVICE), DEVICE)
    assert acme_packed == cpu_packed == (not ENCODERS[kind]["norm_first"])  # the same path
    assert actual.shape == expected.shape
    # The padding's rows too: the packed path's zeros, or what the dense path
    # computes there (NaN for a sequence with no token, on both).
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_a_nested_tensor_the_user_made_is_still_refused():
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(NotImplementedError, match=f"{DEVICE} has no nested tensors"):
        nested.to(DEVICE).sum()


# ---- views ----

def test_views_share_storage():
    base = torch.arange(8.0, device=DEVICE)
    windows = base.unfold(0, 3, 2)
    assert windows.data_ptr() == base.data_ptr() and windows._base is base
    windows[1, 0] = 100.0  # element 2 of base
    assert base[2].item() == 100.0
    z = torch.tensor([1 + 2j, 3 - 4j], device=DEVICE)
    pairs = torch.view_as_real(z)
    assert pairs.untyped_storage().data_ptr() == z.untyped_storage().data_ptr()
    z.imag.mul_(10)
    assert torch.equal(pairs.cpu(), torch.tensor([[1.0, 20.0], [3.0, -40.0]]))
    back = torch.view_as_complex(pairs)
    assert back.data_ptr() == z.data_ptr()


def test_what_the_views_enable():
    torch.manual_seed(15)
    x = torch.randn(2, 3)
    assert torch.equal(x.to(DEVICE).repeat(2, 3).cpu(), x.repeat(2, 3))
    assert torch.equal(x.to(DEVICE).tile((2,)).cpu(), x.tile((2,)))
    z = torch.randn(4, dtype=torch.complex64)
    words = str(z.to(DEVICE)).split()  # the device suffix may move a line break
    assert words == (str(z)[:-1] + f", device='{DEVICE}:0')").split()
    assert torch.equal(z.to(DEVICE).real.cpu(), z.real)
    signal = torch.randn(64)
    torch.testing.assert_close(
        torch.stft(signal.to(DEVICE), 16, return_complex=True).cpu(),
        torch.stft(signal, 16, return_complex=True))
    compare_module(nn.InstanceNorm2d(3, affine=True).double(), leaf(2, 3, 5, 5))


# ---- composite kernels where the CPU has its own ----

def test_no_composite_runs_where_the_cpu_has_a_kernel():
    """The scan behind cpu_fallback.cpp's `ch13 register-cpu-kernels` block."""
    # CompositeExplicitAutogradNonFunctional kernels call the op's out= form,
    # which reaches the CPU kernel; CompositeImplicitAutograd ones are chapter
    # 14's (tests/test_conformance.py).
    assert composites_where_the_cpu_has_a_kernel("CompositeExplicitAutograd") == []


@pytest.mark.parametrize("loss", [F.mse_loss, F.smooth_l1_loss, F.l1_loss, F.huber_loss,
                                  F.binary_cross_entropy_with_logits, F.soft_margin_loss],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_losses_warn_only_where_the_cpu_warns(loss, reduction):
    # mse_loss and smooth_l1_loss's generic kernels called their .out form with
    # a 0-dim result, which the CPU's kernel resized with a deprecation warning.
    torch.manual_seed(17)
    x, y = torch.randn(3, 4), torch.rand(3, 4)

    def resize_warnings(device):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = loss(x.to(device), y.to(device), reduction=reduction).cpu()
        return result, [str(w.message) for w in caught if "resized" in str(w.message)]

    (on_acme, acme_warned), (on_cpu, cpu_warned) = resize_warnings(DEVICE), resize_warnings("cpu")
    assert acme_warned == cpu_warned == []
    assert torch.equal(on_acme, on_cpu)


def test_layer_norm_over_one_element_matches_cpu():
    # Found by comparing OpInfo samples: the composite decomposition left a
    # rounding residue that rstd (~316) magnified.
    torch.manual_seed(16)
    x, w, b = torch.randn(3, 1), torch.randn(1), torch.randn(1)
    expected = F.layer_norm(x, (1,), w, b)
    actual = F.layer_norm(x.to(DEVICE), (1,), w.to(DEVICE), b.to(DEVICE)).cpu()
    assert torch.equal(actual, expected)
    compare_module(nn.GroupNorm(2, 4).double(), leaf(2, 4, 3))


def test_sdpa_query_of_another_rank_matches_cpu():
    # A 3-D query against 4-D keys broadcasts on the math path; acme's fused
    # kernel has no such form (nor have CUDA's), so the choice sends it there.
    torch.manual_seed(14)
    q, k, v = leaf(4, 3, 8), leaf(4, 4, 6, 8), leaf(4, 4, 6, 8)
    (expected, expected_grads), (actual, actual_grads) = sdpa_pair(q, k, v, is_causal=True)
    torch.testing.assert_close(actual.cpu(), expected)
    for e, a in zip(expected_grads, actual_grads):
        torch.testing.assert_close(a.cpu(), e)


@pytest.mark.parametrize("case", ["plain", "causal", "float-mask-with-grad"])
def test_sdpa_second_derivative_matches_cpu(case):
    # Chapter 14: the fused backward is differentiable again (recomputed on
    # ATen's math path when a graph is asked for). The CPU's reference runs
    # its math path, the one CPU route with a second derivative.
    torch.manual_seed(15)
    q, k, v = leaf(2, 3, 5, 8), leaf(2, 3, 7, 8), leaf(2, 3, 7, 6)
    kwargs = SDPA_CASES[case]
    results = []
    for device in ("cpu", DEVICE):
        qd, kd, vd = on(device, (q, k, v))
        mask = kwargs.get("attn_mask")
        kw = dict(kwargs, attn_mask=on(device, mask)) if mask is not None else kwargs
        with sdpa_kernel([SDPBackend.MATH] if device == "cpu" else [SDPBackend.OVERRIDEABLE]):
            out = F.scaled_dot_product_attention(qd, kd, vd, **kw)
        leaves = [t for t in (qd, kd, vd, kw.get("attn_mask")) if t is not None and t.requires_grad]
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out), create_graph=True)
        second = torch.autograd.grad(sum((g * g).sum() for g in grads), leaves)
        results.append((out.grad_fn.name(), [s.detach().cpu() for s in second]))
    assert results[1][0] == "ScaledDotProductFusedAttentionOverrideableBackward0"
    for e, a in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, e)
