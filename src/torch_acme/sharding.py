#@ ch21
"""DTensor sharding strategies for the operators acme adds or routes to (chapter 21).

DTensor (tensor parallelism, FSDP2's compute) runs an operator on sharded
tensors only if it knows how the operator's outputs are sharded given its
inputs' shardings: a *strategy*, registered per operator. PyTorch registers
strategies for its own operators, but an operator only a backend reaches has
none, and DTensor refuses it ("does not have a sharding strategy
registered"). acme reaches two groups of them:

- ``aten::_scaled_dot_product_fused_attention_overrideable`` and its backward:
  where SDPA goes on a PrivateUse1 device (chapter 13). Their arguments line
  up with flash attention's forward and efficient attention's backward, so
  PyTorch's own strategy lists for those are reused, not copied.
- ``acme::bias_gelu`` (and its backward) and ``acme::swiglu``: acme's custom
  operators (chapter 15), elementwise, registered with DTensor's public
  ``register_sharding``.

``aten::rms_norm`` needs none: acme's kernels serve ``aten::_fused_rms_norm``
and its backward (chapter 15), which DTensor's own strategies cover.

``register()`` runs when the first acme process group is made: importing
DTensor costs more than half a second, which a program that never makes a
group should not pay.
"""

from __future__ import annotations

import types

import torch

_registered = False


def register() -> None:
    """Register acme's strategies with DTensor, once per process."""
    global _registered
    if _registered:
        return
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._op_schema import OpStrategy, RuntimeSchemaInfo
    from torch.distributed.tensor._ops._matrix_ops import (
        _scaled_dot_product_efficient_attention_backward_base_strategies as efficient_backward,
        _scaled_dot_product_flash_attention_base_strategies as flash_forward,
    )
    from torch.distributed.tensor._ops.utils import (expand_to_full_mesh_op_strategy,
                                                     register_op_strategy)
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten

    def bias_placement(bias, like):
        """A 4-D bias splits as q does (heads or batch) unless it broadcasts there."""
        shape = bias.strategies[0].output_spec.tensor_meta.shape
        if isinstance(like, Replicate) or len(shape) != 4 or shape[like.dim] == 1:
            return Replicate()
        return like

    # forward(q, k, v, attn_bias?, dropout_p, is_causal, return_debug_mask, *, scale):
    # flash's arguments with attn_bias inserted, and flash's nine outputs.
    @register_op_strategy(aten._scaled_dot_product_fused_attention_overrideable.default,
                          schema_info=RuntimeSchemaInfo(4))
    def attention(op_schema):
        args = op_schema.args_schema
        bias = args[3] if len(args) > 3 else None
        strategies = []
        for placements in flash_forward(types.SimpleNamespace(args_schema=args[:3] + args[4:])):
            placements = list(placements)  # 9 outputs, then q, k, v
            if isinstance(bias, OpStrategy):
                placements.append(bias_placement(bias, placements[9]))
            strategies.append(placements)
        return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema,
                                               strategies, input_index=9)

    # backward(grad_out, q, k, v, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q,
    # cum_seq_k, ...): its tensors come in efficient attention's backward order
    # (acme returns no cum_seq tensors), and it returns the same four gradients.
    @register_op_strategy(aten._scaled_dot_product_fused_attention_overrideable_backward.default)
    def attention_backward(op_schema):
        args = op_schema.args_schema
        if isinstance(args[8], OpStrategy) or isinstance(args[9], OpStrategy):
            raise NotImplementedError("acme: no sharding strategy for the overrideable SDPA "
                                      "backward with cumulative sequence lengths")
        strategies = efficient_backward(op_schema)
        if isinstance(args[4], OpStrategy):  # a broadcast bias: its gradient is a partial sum
            for placements in strategies[1:]:
                if isinstance(bias_placement(args[4], placements[0]), Replicate):
                    placements[3], placements[8] = Partial(), Replicate()
        return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False),
                                               op_schema, strategies, input_index=4)

    # The custom operators: x whole or split on any dimension; bias (x's last
    # dimension) split with x's last dimension, whole otherwise.
    def x_and_bias(x):
        pairs = [(Replicate(), Replicate())]
        return pairs + [(Shard(d), Shard(0) if d == x.ndim - 1 else Replicate())
                        for d in range(x.ndim)]

    @register_sharding(torch.ops.acme.bias_gelu.default)
    def bias_gelu(x, bias):
        return [([px], [px, pb]) for px, pb in x_and_bias(x)]

    @register_sharding(torch.ops.acme.bias_gelu_backward.default)
    def bias_gelu_backward(grad, x, bias):
        # grad_bias sums over every dimension but the last: partial when x is
        # split on another one.
        def bias_grad(px, pb):
            return pb if isinstance(px, Replicate) or px.dim == x.ndim - 1 else Partial()
        return [([px, bias_grad(px, pb)], [px, px, pb]) for px, pb in x_and_bias(x)]

    @register_sharding(torch.ops.acme.swiglu.default)
    def swiglu(gate, up):
        return [([p], [p, p]) for p in [Replicate()] + [Shard(d) for d in range(gate.ndim)]]

    _registered = True
