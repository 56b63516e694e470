"""How the book times acme against the CPU: one method, for the benchmark page
(tools/bench.py) and for the chapters' quick figures alike.

A figure is a ratio, acme's time over the CPU's, measured in the same process:
the two sides alternate within each round, and the figure is the median of the
per-round ratios, so a burst of load on this machine moves one round, not the
result. Chapters run fewer rounds than the benchmark and assert nothing about
the figures they print.
"""

from __future__ import annotations

import statistics
import time


def timed(fn, number: int, sync=None) -> float:
    """Seconds per call of `fn` over `number` calls, after one untimed call.

    `sync` (e.g. `torch.accelerator.synchronize`) closes the span where the work is
    asynchronous (from chapter 18 an acme op returns before its kernel has run), so
    the figure counts the work and not only the launches.
    """
    fn()  # warm up: first-call costs, allocator caches
    if sync:
        sync()
    start = time.perf_counter()
    for _ in range(number):
        fn()
    if sync:
        sync()
    return (time.perf_counter() - start) / number


def compare(on_cpu, on_acme, number: int, rounds: int, sync=None) -> dict:
    """acme/CPU: the median of per-round ratios; `sync` closes acme's spans."""
    cpu_times, acme_times, ratios = [], [], []
    # One untimed round each first: a process's first large allocations fault in
    # fresh pages on both sides, which is not what a round measures.
    timed(on_cpu, number)
    timed(on_acme, number, sync)
    for _ in range(rounds):
        c = timed(on_cpu, number)
        a = timed(on_acme, number, sync)
        cpu_times.append(c)
        acme_times.append(a)
        ratios.append(a / c)
    return {"ratio": statistics.median(ratios), "cpu_s": statistics.median(cpu_times),
            "acme_s": statistics.median(acme_times), "rounds": rounds, "number": number,
            # How much acme's own time moves from round to round (the ratios
            # also move with the CPU's).
            "ratios": ratios, "spread": max(acme_times) / min(acme_times),
            "cpu_times": cpu_times, "acme_times": acme_times}
