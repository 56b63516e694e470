"""Chapter 23: how many CPU threads an acme kernel runs on (csrc/aten/kernel_threads.h).

The count is seen from inside the kernels through their arithmetic: ATen splits
a float sum into one partial sum per thread, so a sum on one thread and the
same sum on two round differently. Each check first makes sure its input is
one where they do, so it cannot pass without telling the counts apart.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from conftest import LAST, run_in_stage

if LAST < 23:
    pytest.skip("the last stage predates chapter 23", allow_module_level=True)

SCRIPT = textwrap.dedent("""\
    import json
    import torch
    torch.set_num_threads(2)  # the device's count is the host's when acme loads
    import torch_acme
    from torch_acme import _C

    ONE_THREAD_BELOW = 1 << 20  # kOneThreadBelow

    def telling(n):
        # A float32 vector whose sum differs on one thread and on two.
        generator = torch.Generator().manual_seed(0)
        while True:
            x = torch.randn(n, generator=generator)
            torch.set_num_threads(1)
            one = x.sum()
            torch.set_num_threads(2)
            two = x.sum()
            if one != two:
                return x, one, two

    @torch.library.custom_op("threads_test::total", mutates_args=())
    def total(x: torch.Tensor, fail: bool) -> torch.Tensor:
        if fail:
            raise RuntimeError("the graph fails here")
        return x.sum()  # an eager acme sum, launched by the host

    @total.register_fake
    def _(x, fail):
        return x.new_empty(())

    def threads_of(result, one, two):
        result = result.cpu()
        return 1 if result == one else 2 if result == two else None

    seen = {}
    small, one, two = telling(300_000)
    large, large_one, large_two = telling(ONE_THREAD_BELOW)
    on_acme = small.to("acme")
    seen["small eager"] = threads_of(on_acme.sum(), one, two)
    seen["at the bound"] = threads_of(large.to("acme").sum(), large_one, large_two)
    graph = torch.compile(lambda t, fail: total(t, fail) + 0, fullgraph=True)
    seen["small in a graph"] = threads_of(graph(on_acme, False), one, two)
    seen["small after a graph"] = threads_of(total(on_acme, False), one, two)
    try:
        graph(on_acme, True)
    except RuntimeError as e:
        assert "the graph fails here" in str(e), e
    else:
        raise AssertionError("the failing graph did not raise")
    seen["small after a failed graph"] = threads_of(on_acme.sum(), one, two)
    seen["host threads"] = torch.get_num_threads()
    print(json.dumps(seen))
""")


def test_small_kernels_run_on_one_thread_and_graphs_on_all():
    proc = run_in_stage(LAST, SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {
        "small eager": 1,                 # below kOneThreadBelow, outside a graph
        "at the bound": 2,                # kOneThreadBelow elements: the device's count
        "small in a graph": 2,            # inside a compiled graph's call
        "small after a graph": 1,         # the graph's flag ends with its call
        "small after a failed graph": 1,  # ... when the call raises too
        "host threads": 2,                # the host's own count is left alone
    }, seen
