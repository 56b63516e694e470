#@ ch20
"""A Dynamo backend of acme's own, where a vendor's graph compiler plugs in
(chapter 20).

`torch.compile(model, backend="acme_graph")` hands `compile_graph` each graph
that AOTAutograd makes: forward and backward apart, functional, in ATen
operators, with example inputs of the real dtypes and shapes. A vendor's
compiler would lower it to its own program. acme has none, so this backend
records which operators the graph holds and which of them have no acme kernel
(they take the CPU fallback), and runs the graph as it is.
"""

from __future__ import annotations

import functools

import torch
from torch._dynamo import register_backend
from torch._ops import OpOverload

NAME = f"{torch._C._get_privateuse1_backend_name()}_graph"

# One entry per graph compiled: its kind, its operators, those without a kernel.
graphs: list[dict] = []


def has_kernel(op: OpOverload) -> bool:
    """Whether acme runs `op` with a kernel: its own, or one PyTorch writes
    for every backend from other operators (views, most factories)."""
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)
               for key in ("PrivateUse1", "CompositeExplicitAutograd"))


def decompositions() -> dict:
    """Core ATen's decompositions for the operators acme has no kernel for. A
    compiler keeps whole what it runs well (gelu_backward, layer norm) and
    has the rest split into operators it knows."""
    from torch._decomp import core_aten_decompositions
    return {op: fn for op, fn in core_aten_decompositions().items()
            if isinstance(op, OpOverload) and not has_kernel(op)}


def compile_graph(kind: str, gm: torch.fx.GraphModule, example_inputs) -> object:
    ops = [node.target for node in gm.graph.nodes
           if node.op == "call_function" and isinstance(node.target, OpOverload)]
    graphs.append({"kind": kind, "ops": [str(op) for op in ops],
                   "no_kernel": sorted({str(op) for op in ops if not has_kernel(op)})})
    # A vendor's compiler returns its program here. It is called with the
    # inputs in one list (the boxed convention), which it may free early.
    from torch._functorch.aot_autograd import make_boxed_func
    return make_boxed_func(gm.forward)


@functools.cache
def _aot_autograd():
    from torch._dynamo.backends.common import aot_autograd
    return aot_autograd(fw_compiler=functools.partial(compile_graph, "forward"),
                        bw_compiler=functools.partial(compile_graph, "backward"),
                        decompositions=decompositions)


# Registered when torch._dynamo loads (dynamo.py imports this module then),
# when AOTAutograd may not be importable yet: it is imported at the first call.
@register_backend(name=NAME)
def backend(gm: torch.fx.GraphModule, example_inputs):
    return _aot_autograd()(gm, example_inputs)
