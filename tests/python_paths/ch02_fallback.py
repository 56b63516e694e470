"""Chapter 2's CPU fallback, registered from Python with torch.library.

Run after `import torch_acme` on a build without the C++ fallback (stage 1).
The same three rules as csrc/aten/cpu_fallback.cpp: views never fall back,
one warning per op, results on the acme device.
"""

import functools
import warnings

import torch

ACME = "privateuseone"
_warned: set[str] = set()


def _tensors(value):
    """The tensors in one argument: itself, or the elements of a list of tensors."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in items if isinstance(v, torch.Tensor)]


def _map(fn, value):
    """`value` with fn applied to each tensor and device in it (lists included)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_map(fn, v) for v in value)
    return fn(value) if isinstance(value, (torch.Tensor, torch.device)) else value


def acme_cpu_fallback(op, *args, **kwargs):
    """A boxed kernel: `op` is any aten OpOverload, its arguments as Python values."""
    # Views never fall back: a CPU copy cannot share the device tensor's storage.
    for ret in op._schema.returns:
        if ret.alias_info is not None and not ret.alias_info.is_write:
            raise NotImplementedError(
                f"{ACME}: {op.name()} is a view operator and has no {ACME} kernel. A view cannot "
                "run on the CPU fallback, because its result must share the device tensor's "
                "storage.")

    # One warning per op, not per call: a training loop would drown the user.
    if op.name() not in _warned:
        _warned.add(op.name())
        warnings.warn(f"{ACME}: {op.name()} has no {ACME} kernel and runs on the CPU "
                      "(inputs copied to the host, results copied back).", stacklevel=2)

    # Results go to the device the op names, else to the first acme argument's
    # (for `2 // t` the first tensor is the CPU scalar 2).
    target = None

    def to_cpu(value):
        nonlocal target
        if isinstance(value, torch.device):  # a factory: run it on the CPU instead
            target = target or torch.device(value)
            return torch.device("cpu") if value.type == ACME else value
        if value.device.type == ACME:
            target = target or value.device
            return value.cpu()
        return value

    cpu_args = _map(to_cpu, args)
    cpu_kwargs = {name: _map(to_cpu, value) for name, value in kwargs.items()}
    # On CPU tensors the op dispatches to the CPU kernel: no redispatch needed.
    result = op(*cpu_args, **cpu_kwargs)

    # In-place and out= arguments: write the CPU result back into the acme tensor.
    written = {}
    for i, arg in enumerate(op._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if arg.name in kwargs:
            originals, copies = kwargs[arg.name], cpu_kwargs[arg.name]
        elif i < len(args):
            originals, copies = args[i], cpu_args[i]
        else:
            continue
        for original, copy in zip(_tensors(originals), _tensors(copies)):
            if copy is not original:
                if original.shape != copy.shape:  # out= placeholders get resized
                    original.resize_(copy.shape)
                original.copy_(copy)
                written[id(copy)] = original

    def settle(value):
        if isinstance(value, torch.Tensor):
            if id(value) in written:  # `add_` returns self: the acme tensor, not its copy
                return written[id(value)]
            if target is not None and target.type == ACME and value.device.type == "cpu":
                return value.to(target)
        return value

    return _map(settle, result)


# Keep the Library objects alive: when one is garbage collected, its
# registrations are removed. "_" means every namespace: every op without an
# acme kernel lands here.
fallback_lib = torch.library.Library("_", "IMPL")
fallback_lib.fallback(acme_cpu_fallback, dispatch_key="PrivateUse1")

# abs has a CompositeExplicitAutograd kernel, which the dispatcher prefers to a
# backend fallback (chapter 2's first trap): register the fallback as abs's own
# acme kernel. A per-op kernel receives no `op`, so bind it.
aten_lib = torch.library.Library("aten", "IMPL")
aten_lib.impl("abs", functools.partial(acme_cpu_fallback, torch.ops.aten.abs.default),
              "PrivateUse1")
