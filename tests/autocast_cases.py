"""How to call each op of acme's autocast policy table, and what its policy promises.

Shared by tests/test_autocast.py (which checks dtypes and values against the
last stage) and chapter 4 (which draws the table from the same calls at stage
4). Device-neutral: the device name is an argument, since it is
"privateuseone" before chapter 8 and "acme" after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# One call per op of the table, keyed by the op's name as the table gives it.
# `t(*shape)` makes the next floating-point input (see make_inputs);
# t.index(high, *shape) a long tensor of indices below `high`, t.sign(*shape)
# a float32 tensor of +1 and -1 (targets the policies leave as they are).
A = torch.ops.aten


RECIPES = {
    # lower_precision_fp
    "aten::_convolution.deprecated": lambda t: torch._convolution(
        t(1, 2, 5, 5), t(3, 2, 3, 3), t(3), [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
        False, False, True),
    "aten::_convolution": lambda t: torch._convolution(
        t(1, 2, 5, 5), t(3, 2, 3, 3), t(3), [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
        False, False, True, True),
    "aten::conv1d": lambda t: F.conv1d(t(1, 2, 5), t(3, 2, 3)),
    "aten::conv2d": lambda t: F.conv2d(t(1, 2, 5, 5), t(3, 2, 3, 3)),
    "aten::conv3d": lambda t: F.conv3d(t(1, 2, 4, 4, 4), t(3, 2, 2, 2, 2)),
    "aten::conv_tbc": lambda t: torch.conv_tbc(t(5, 1, 2), t(3, 2, 4), t(4)),
    "aten::conv_transpose1d": lambda t: F.conv_transpose1d(t(1, 2, 5), t(2, 3, 3)),
    "aten::conv_transpose2d.input": lambda t: F.conv_transpose2d(t(1, 2, 4, 4), t(2, 3, 3, 3)),
    "aten::conv_transpose3d.input":
        lambda t: F.conv_transpose3d(t(1, 2, 3, 3, 3), t(2, 3, 2, 2, 2)),
    "aten::convolution": lambda t: torch.convolution(
        t(1, 2, 5, 5), t(3, 2, 3, 3), t(3), [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
    "aten::prelu": lambda t: F.prelu(t(3, 4) - 1, t(1)),
    "aten::addmm": lambda t: torch.addmm(t(3, 5), t(3, 4), t(4, 5)),
    "aten::addmv": lambda t: torch.addmv(t(3), t(3, 4), t(4)),
    "aten::addr": lambda t: torch.addr(t(3, 4), t(3), t(4)),
    "aten::matmul": lambda t: torch.matmul(t(3, 4), t(4, 5)),
    "aten::einsum": lambda t: torch.einsum("ij,jk->ik", t(3, 4), t(4, 5)),
    "aten::mm": lambda t: torch.mm(t(3, 4), t(4, 5)),
    "aten::mv": lambda t: torch.mv(t(3, 4), t(4)),
    "aten::linalg_vecdot": lambda t: torch.linalg.vecdot(t(3, 4), t(3, 4)),
    "aten::linear": lambda t: F.linear(t(3, 4), t(5, 4), t(5)),
    "aten::addbmm": lambda t: torch.addbmm(t(3, 5), t(2, 3, 4), t(2, 4, 5)),
    "aten::baddbmm": lambda t: torch.baddbmm(t(2, 3, 5), t(2, 3, 4), t(2, 4, 5)),
    "aten::bmm": lambda t: torch.bmm(t(2, 3, 4), t(2, 4, 5)),
    "aten::chain_matmul": lambda t: torch.chain_matmul(t(3, 4), t(4, 5), t(5, 2)),
    "aten::linalg_multi_dot": lambda t: torch.linalg.multi_dot([t(3, 4), t(4, 5), t(5, 2)]),
    "aten::_thnn_fused_lstm_cell": lambda t: A._thnn_fused_lstm_cell(
        t(2, 8), t(2, 8), t(2, 2), t(8), t(8))[0],
    "aten::_thnn_fused_gru_cell": lambda t: A._thnn_fused_gru_cell(
        t(2, 6), t(2, 6), t(2, 2), t(6), t(6))[0],
    "aten::lstm_cell": lambda t: torch.lstm_cell(
        t(2, 3), [t(2, 2), t(2, 2)], t(8, 3), t(8, 2), t(8), t(8))[0],
    "aten::gru_cell": lambda t: torch.gru_cell(t(2, 3), t(2, 2), t(6, 3), t(6, 2), t(6), t(6)),
    "aten::rnn_tanh_cell":
        lambda t: torch.rnn_tanh_cell(t(2, 3), t(2, 2), t(2, 3), t(2, 2), t(2), t(2)),
    "aten::rnn_relu_cell":
        lambda t: torch.rnn_relu_cell(t(2, 3), t(2, 2), t(2, 3), t(2, 2), t(2), t(2)),
    "aten::_scaled_dot_product_flash_attention":
        lambda t: A._scaled_dot_product_flash_attention(t(1, 2, 3, 4), t(1, 2, 3, 4),
                                                        t(1, 2, 3, 4))[0],
    "aten::scaled_dot_product_attention":
        lambda t: F.scaled_dot_product_attention(t(1, 2, 3, 4), t(1, 2, 3, 4), t(1, 2, 3, 4)),
    # fp32
    "aten::acos": lambda t: torch.acos(t(3, 4) - 1),
    "aten::asin": lambda t: torch.asin(t(3, 4) - 1),
    "aten::cosh": lambda t: torch.cosh(t(3, 4)),
    "aten::erfinv": lambda t: torch.erfinv(t(3, 4) - 1),
    "aten::exp": lambda t: torch.exp(t(3, 4)),
    "aten::expm1": lambda t: torch.expm1(t(3, 4)),
    "aten::log": lambda t: torch.log(t(3, 4)),
    "aten::log10": lambda t: torch.log10(t(3, 4)),
    "aten::log2": lambda t: torch.log2(t(3, 4)),
    "aten::log1p": lambda t: torch.log1p(t(3, 4)),
    "aten::reciprocal": lambda t: torch.reciprocal(t(3, 4)),
    "aten::rsqrt": lambda t: torch.rsqrt(t(3, 4)),
    "aten::sinh": lambda t: torch.sinh(t(3, 4)),
    "aten::tan": lambda t: torch.tan(t(3, 4)),
    "aten::pow.Tensor_Scalar": lambda t: torch.pow(t(3, 4), 3),
    "aten::pow.Tensor_Tensor": lambda t: torch.pow(t(3, 4), t(3, 4)),
    "aten::pow.Scalar": lambda t: torch.pow(1.5, t(3, 4)),
    "aten::softplus": lambda t: F.softplus(t(3, 4)),
    "aten::layer_norm": lambda t: F.layer_norm(t(3, 4), (4,), t(4), t(4)),
    "aten::native_layer_norm": lambda t: torch.native_layer_norm(t(3, 4), [4], t(4), t(4), 1e-5)[0],
    "aten::rms_norm": lambda t: F.rms_norm(t(3, 4), (4,), t(4)),
    "aten::group_norm": lambda t: F.group_norm(t(2, 4, 3), 2, t(4), t(4)),
    "aten::frobenius_norm.dim": lambda t: A.frobenius_norm.dim(t(3, 4), [1]),
    "aten::nuclear_norm": lambda t: torch.nuclear_norm(t(3, 4)),
    "aten::nuclear_norm.dim": lambda t: torch.nuclear_norm(t(2, 3, 4), dim=(1, 2)),
    "aten::cosine_similarity": lambda t: F.cosine_similarity(t(3, 4), t(3, 4)),
    "aten::poisson_nll_loss": lambda t: F.poisson_nll_loss(t(3, 4), t(3, 4)),
    "aten::cosine_embedding_loss":
        lambda t: F.cosine_embedding_loss(t(3, 4), t(3, 4), t.sign(3)),
    "aten::nll_loss": lambda t: F.nll_loss(t(3, 4), t.index(4, 3)),
    "aten::nll_loss2d": lambda t: F.nll_loss(t(2, 4, 3, 3), t.index(4, 2, 3, 3)),
    "aten::hinge_embedding_loss": lambda t: F.hinge_embedding_loss(t(3, 4), t.sign(3, 4)),
    "aten::kl_div": lambda t: F.kl_div(t(3, 4), t(3, 4), reduction="batchmean"),
    "aten::l1_loss": lambda t: F.l1_loss(t(3, 4), t(3, 4)),
    "aten::smooth_l1_loss": lambda t: F.smooth_l1_loss(t(3, 4), t(3, 4) * 2, beta=0.5),
    "aten::huber_loss": lambda t: F.huber_loss(t(3, 4), t(3, 4) * 2, delta=0.5),
    "aten::mse_loss": lambda t: F.mse_loss(t(3, 4), t(3, 4)),
    "aten::margin_ranking_loss": lambda t: F.margin_ranking_loss(t(3), t(3), t.sign(3)),
    "aten::multilabel_margin_loss":
        lambda t: F.multilabel_margin_loss(t(3, 4), t.index(4, 3, 4)),
    "aten::soft_margin_loss": lambda t: F.soft_margin_loss(t(3, 4), t.sign(3, 4)),
    "aten::triplet_margin_loss": lambda t: F.triplet_margin_loss(t(3, 4), t(3, 4), t(3, 4)),
    "aten::multi_margin_loss": lambda t: F.multi_margin_loss(t(3, 4), t.index(4, 3)),
    "aten::binary_cross_entropy_with_logits":
        lambda t: F.binary_cross_entropy_with_logits(t(3, 4), t(3, 4)),
    "aten::dist": lambda t: torch.dist(t(3, 4), t(3, 4)),
    "aten::pdist": lambda t: F.pdist(t(3, 4)),
    "aten::cdist": lambda t: torch.cdist(t(3, 4), t(2, 4)),
    "aten::renorm": lambda t: torch.renorm(t(3, 4), 2, 0, 1.0),
    "aten::logsumexp": lambda t: torch.logsumexp(t(3, 4), 1),
    "aten::upsample_nearest1d": lambda t: F.interpolate(t(1, 2, 3), scale_factor=2),
    "aten::_upsample_nearest_exact1d":
        lambda t: F.interpolate(t(1, 2, 3), scale_factor=2, mode="nearest-exact"),
    "aten::upsample_nearest2d": lambda t: F.interpolate(t(1, 2, 3, 3), scale_factor=2),
    "aten::_upsample_nearest_exact2d":
        lambda t: F.interpolate(t(1, 2, 3, 3), scale_factor=2, mode="nearest-exact"),
    "aten::upsample_nearest3d": lambda t: F.interpolate(t(1, 2, 2, 2, 2), scale_factor=2),
    "aten::_upsample_nearest_exact3d":
        lambda t: F.interpolate(t(1, 2, 2, 2, 2), scale_factor=2, mode="nearest-exact"),
    "aten::upsample_linear1d":
        lambda t: F.interpolate(t(1, 2, 3), scale_factor=2, mode="linear"),
    "aten::upsample_bilinear2d":
        lambda t: F.interpolate(t(1, 2, 3, 3), scale_factor=2, mode="bilinear"),
    "aten::_upsample_bilinear2d_aa":
        lambda t: F.interpolate(t(1, 2, 4, 4), size=(3, 3), mode="bilinear", antialias=True),
    "aten::upsample_trilinear3d":
        lambda t: F.interpolate(t(1, 2, 2, 2, 2), scale_factor=2, mode="trilinear"),
    "aten::upsample_bicubic2d":
        lambda t: F.interpolate(t(1, 2, 3, 3), scale_factor=2, mode="bicubic"),
    "aten::_upsample_bicubic2d_aa":
        lambda t: F.interpolate(t(1, 2, 4, 4), size=(3, 3), mode="bicubic", antialias=True),
    # fp32_set_opt_dtype
    "aten::prod": lambda t: torch.prod(t(3, 4)),
    "aten::prod.dim_int": lambda t: torch.prod(t(3, 4), 1),
    "aten::softmax.int": lambda t: torch.softmax(t(3, 4), dim=1),
    "aten::log_softmax.int": lambda t: torch.log_softmax(t(3, 4), dim=1),
    "aten::cumprod": lambda t: torch.cumprod(t(3, 4), dim=1),
    "aten::cumsum": lambda t: torch.cumsum(t(3, 4), dim=1),
    "aten::linalg_vector_norm": lambda t: torch.linalg.vector_norm(t(3, 4)),
    "aten::linalg_matrix_norm": lambda t: torch.linalg.matrix_norm(t(3, 4), ord=1),
    "aten::linalg_matrix_norm.str_ord": lambda t: torch.linalg.matrix_norm(t(3, 4)),
    "aten::sum": lambda t: torch.sum(t(3, 4)),
    "aten::sum.dim_IntList": lambda t: torch.sum(t(3, 4), dim=1),
    # fp32_append_dtype: norm without a dtype= runs as norm with dtype=float32
    "aten::norm.Scalar": lambda t: A.norm.Scalar(t(3, 4), 2),
    "aten::norm.ScalarOpt_dim": lambda t: A.norm.ScalarOpt_dim(t(3, 4), 2, [1]),
    # promote
    "aten::addcdiv": lambda t: torch.addcdiv(t(3, 4), t(3, 4), t(3, 4)),
    "aten::addcmul": lambda t: torch.addcmul(t(3, 4), t(3, 4), t(3, 4)),
    "aten::atan2": lambda t: torch.atan2(t(3, 4), t(3, 4)),
    "aten::bilinear": lambda t: F.bilinear(t(2, 3), t(2, 4), t(5, 3, 4), t(5)),
    "aten::cross": lambda t: torch.cross(t(2, 3), t(2, 3), dim=1),
    "aten::dot": lambda t: torch.dot(t(4), t(4)),
    "aten::vdot": lambda t: torch.vdot(t(4), t(4)),
    "aten::grid_sampler": lambda t: F.grid_sample(t(1, 2, 3, 3), t(1, 2, 2, 2) - 1,
                                                  align_corners=False),
    "aten::index_put": lambda t: t(4, 3).index_put((t.index(4, 2),), t(2, 3)),
    "aten::tensordot": lambda t: torch.tensordot(t(2, 3, 4), t(3, 4, 5), dims=2),
    "aten::scatter_add": lambda t: t(3, 4).scatter_add(0, t.index(3, 2, 4), t(2, 4)),
    # banned
    "aten::binary_cross_entropy":
        lambda t: F.binary_cross_entropy(torch.sigmoid(t(3, 4)), t(3, 4) - 0.5),
}
# New in PyTorch 2.14, in CUDA's list (fp32) from then on: the square root of a
# symmetric positive-definite matrix. Built from one input without rounding
# (each sum adds zeros, 8x is exact): symmetric, and diagonally dominant.
def _sqrth(t):
    x = t(3, 3)
    low = torch.tril(x, -1)
    return torch.linalg.matrix_sqrth(low + low.mT + torch.diag_embed(8 * torch.diagonal(x)))


if hasattr(torch.linalg, "matrix_sqrth"):
    RECIPES["aten::linalg_matrix_sqrth"] = _sqrth

# Two ops of CUDA's list have kernels on CUDA and acme but none on the CPU:
# the reference computes them as their definitions do.
def _fused_lstm_cell(t):
    gates = t(2, 8) + t(2, 8)
    cx = t(2, 2)
    gates = gates + t(8) + t(8)
    i, f, g, o = gates.chunk(4, 1)
    cy = f.sigmoid() * cx + i.sigmoid() * g.tanh()
    return o.sigmoid() * cy.tanh()


def _fused_gru_cell(t):
    input_gates, hidden_gates, hx = t(2, 6), t(2, 6), t(2, 2)
    ir, ii, in_ = (input_gates + t(6)).chunk(3, 1)
    hr, hi, hn = (hidden_gates + t(6)).chunk(3, 1)
    reset, update = (ir + hr).sigmoid(), (ii + hi).sigmoid()
    new = (in_ + reset * hn).tanh()
    return new + update * (hx - new)


NO_CPU_KERNEL = {
    "aten::_thnn_fused_lstm_cell": _fused_lstm_cell,
    "aten::_thnn_fused_gru_cell": _fused_gru_cell,
}
# One op of CUDA's list is CUDA's own fused kernel: neither the CPU nor acme
# has one (acme's attention is the overrideable op, chapter 13), so the policy
# is registered but the call ends in a NotImplementedError that names the op.
CUDA_KERNEL_ONLY = {"aten::_scaled_dot_product_flash_attention"}


def reference(op: str, mix: str, low: torch.dtype) -> torch.Tensor:
    """The op computed in float32 on the CPU, from the same (already rounded) inputs."""
    recipe = NO_CPU_KERNEL.get(op, RECIPES[op])
    return recipe(make_inputs("cpu", mix, low, as_float32=True))


LOW = (torch.float16, torch.bfloat16)
# The input mixes: every input float32, every input in the autocast dtype
# ("low"), or the first float32 and the rest low ("mixed").
MIXES = ("float32", "low", "mixed")


def make_inputs(device: str, mix: str, low: torch.dtype, as_float32: bool = False):
    """t(*shape): the next input, the same values on every device, its dtype per `mix`.

    Values lie in [0.5, 1.5), so log and rsqrt are defined. With as_float32 the
    (already rounded) values come back as float32 CPU tensors: the reference.
    """
    generator = torch.Generator().manual_seed(0)
    count = 0
    target = "cpu" if as_float32 else device

    def t(*shape):
        nonlocal count
        first = count == 0
        count += 1
        dtype = torch.float32 if mix == "float32" or (mix == "mixed" and first) else low
        values = (torch.rand(shape, generator=generator) + 0.5).to(dtype)
        return values.float() if as_float32 else values.to(device)

    def index(high, *shape):
        # One dimension: distinct indices (index_put keeps one write per place).
        if len(shape) == 1:
            return torch.randperm(high, generator=generator)[:shape[0]].to(target)
        return torch.randint(high, shape, generator=generator).to(target)

    def sign(*shape):
        return (torch.randint(2, shape, generator=generator) * 2 - 1).float().to(target)

    t.index, t.sign = index, sign
    return t


def expected_dtype(policy: str, mix: str, low: torch.dtype) -> torch.dtype:
    """The output dtype an op with `policy` must give under autocast to `low`."""
    if policy == "lower_precision_fp":
        return low
    if policy in ("fp32", "fp32_set_opt_dtype", "fp32_append_dtype"):
        return torch.float32
    assert policy == "promote", policy
    return low if mix == "low" else torch.float32  # the widest of the inputs
