"""One probe per chapter: does the capability that chapter adds work here?

Run as a script inside a stage's environment; prints {chapter: true/false} as
JSON. Each probe exercises the capability for real and checks its result; any
exception means "absent".
"""

import json
import sys


def ch00_runtime():
    from torch_acme import runtime

    ptr = runtime.malloc(4)
    runtime.copy_to_device(ptr, b"acme")
    ok = runtime.copy_to_host(ptr, 4) == b"acme"
    runtime.free(ptr)
    return ok


def ch01_minimal_ops():
    import torch
    import torch_acme  # noqa: F401

    host = torch.arange(6.0).reshape(2, 3)
    return torch.equal(host.to("privateuseone").t().cpu(), host.t())


def ch02_cpu_fallback():
    import torch
    import torch_acme  # noqa: F401

    host = torch.arange(6.0)
    return torch.equal(torch.sin(host.to("privateuseone")).cpu(), torch.sin(host))


def ch03_autograd():
    import torch
    import torch_acme  # noqa: F401

    # backward() on the device needs the hooks, and tanh's autograd is acme's own.
    x = torch.tensor([0.5, -1.0], device="privateuseone", requires_grad=True)
    y = torch.tanh(x)
    y.sum().backward()
    expected = 1 - torch.tanh(torch.tensor([0.5, -1.0])) ** 2
    return "Acme" in y.grad_fn.name() and torch.allclose(x.grad.cpu(), expected)


def ch04_autocast():
    import torch
    import torch_acme  # noqa: F401

    a = torch.ones(2, 2, device="privateuseone")
    with torch.autocast(device_type="privateuseone", dtype=torch.bfloat16):
        low = torch.mm(a, a)
        high = torch.softmax(a.to(torch.bfloat16), dim=0)
    return low.dtype == torch.bfloat16 and high.dtype == torch.float32


def ch05_generator():
    import torch
    import torch_acme  # noqa: F401

    # A device generator that honours its seed, through a native random kernel.
    g = torch.Generator(device="privateuseone")
    g.manual_seed(7)
    first = torch.empty(8, device="privateuseone").uniform_(generator=g).cpu()
    g.manual_seed(7)
    second = torch.empty(8, device="privateuseone").uniform_(generator=g).cpu()
    return g.device.type == "privateuseone" and torch.equal(first, second)


PROBES = {0: ch00_runtime, 1: ch01_minimal_ops, 2: ch02_cpu_fallback, 3: ch03_autograd,
          4: ch04_autocast, 5: ch05_generator}


def main():
    results = {}
    for number, probe in PROBES.items():
        try:
            results[number] = bool(probe())
        except Exception as error:  # absent capabilities fail in many ways
            results[number] = False
            print(f"ch{number:02d}: {type(error).__name__}: {error}".splitlines()[0], file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
