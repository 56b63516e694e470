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


PROBES = {0: ch00_runtime, 1: ch01_minimal_ops, 2: ch02_cpu_fallback}


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
