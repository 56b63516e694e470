"""Chapter 4's autocast rules, registered from Python with torch.library.

Run after `import torch_acme` on a build without them (stage 3). Three of the
C++ tab's rules: mm and bmm in the autocast dtype (lower_precision_fp), exp in
float32 (fp32), and the fallthrough for every other op.
"""

import torch

ACME = "privateuseone"
AUTOCAST_KEY = torch._C.DispatchKey.AutocastPrivateUse1
SUPPORTED = (torch.float16, torch.bfloat16)

# torch.autocast asks the device module which dtypes it may lower to.
torch.get_device_module(ACME).get_amp_supported_dtype = lambda: list(SUPPORTED)

# Every op without a rule: nothing to cast, so skip the key. Keep the Library
# objects alive: when one is garbage collected, its registrations are removed.
fallthrough_lib = torch.library.Library("_", "IMPL")
fallthrough_lib.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")

# fp32 casts to one fixed dtype: torch.library.register_autocast says that in
# one line. Only for ops without keyword-only arguments: its kernel raises on
# them (sum(x, dtype=...) fails with "Custom ops do not support kwargs yet").
torch.library.register_autocast("aten::exp", ACME, torch.float32)


# lower_precision_fp casts to whatever dtype torch.autocast was given, which
# register_autocast cannot express: the kernel is written out.
def lower_precision_fp(op):
    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype(ACME)
        if dtype not in SUPPORTED:  # set directly with torch.set_autocast_dtype
            raise ValueError(f"{ACME} autocast: {dtype} is not a lower-precision dtype {ACME} "
                             "supports; use torch.float16 or torch.bfloat16")

        def cast(value):
            if isinstance(value, (list, tuple)):
                return type(value)(cast(v) for v in value)
            eligible = (isinstance(value, torch.Tensor) and value.is_floating_point()
                        and value.device.type == ACME and value.dtype != torch.float64)
            return value.to(dtype) if eligible else value

        # Call the op again from the top, without this key: autograd records
        # the casts, and the op is not intercepted twice.
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(AUTOCAST_KEY)):
            return op(*cast(args), **{k: cast(v) for k, v in kwargs.items()})
    return kernel


autocast_lib = torch.library.Library("aten", "IMPL")
for op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
    autocast_lib.impl(op, lower_precision_fp(op), "AutocastPrivateUse1")
