"""Benchmarks: acme's kernels, fallback and allocator against the CPU, and build times.

Every op figure is a ratio, acme time / CPU time, both measured in the same
process and run: the two are timed in alternation, round after round, and the
median of the per-round ratios is reported (with the median times). One
backend per process, so each configuration runs in a worker process of its
own: the newest stage ("native": native kernels and, from chapter 12, the
caching allocator) and stage 9 (CPU fallback), each with checked device memory
(the default) and with ACME_CHECKED=0, and the stage before the newest
("previous", checked mode only), to show what the newest chapter buys.

Besides the small and large ops, each worker times a Python loop of
`torch.ones(4, device=dev) + 1` against the same loop on the CPU (100,000
iterations per round for the newest stage, fewer for the older ones, whose
iterations cost far more), and a 4 MiB allocation, fill and free per
iteration. Where the stage has torch.accelerator memory statistics (the
caching allocator, stage 12 on), it also runs a fragmentation test: 100,000
cycles of mixed-size allocations and frees (log-uniform 512 B - 8 MiB, about
32 live tensors, a fixed seed), sampling the reserved bytes every 1000 cycles,
then frees everything and checks that empty_cache() leaves nothing reserved.

The build figures come from a copy of the repository's sources in a temporary
folder (the repository itself is never modified): a cold build of every stage
with ccache disabled, then rebuilds after touching and after editing one
chapter's source file in the copy.

Writes into OUT (default _build/bench): results.json (every number),
results.md (the tables docs/bench.md shows) and the plots as PNG files.

Usage: python tools/bench.py [--out DIR] [--rounds N] [--skip-build] [--quick]
(`nox -s bench` builds every stage, then runs this. --quick: 3 rounds, at most
10,000 loop iterations, 10,000 fragmentation cycles, no build figures.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("ACME_BUILD_DIR", ROOT / "_build")).resolve()
# The stages compared: the newest (its native kernels and caching allocator),
# the one before it (plain allocator) and the last one without native kernels.
NATIVE = tomllib.loads((ROOT / "chapters" / "chapters.toml").read_text())["chapter"][-1]["number"]
PREVIOUS, FALLBACK = NATIVE - 1, 9

# Python-loop iterations per round and fragmentation cycles: (full run, --quick).
LOOP_NUMBER = {"native": (100_000, 10_000), "other": (5_000, 1_000)}
CYCLES = (100_000, 10_000)

# Targets from the chapter 10 and chapter 12 issues: benchmarks, never asserted.
TARGETS = {
    "small": 1.3,     # native small op <= 1.3x CPU
    "matmul": 1.03,   # native 1024^2 matmul <= 1.03x CPU
    "fallback": 1.10,  # fallback overhead <= (both copies) x 1.10
    "loop": 1.5,      # torch.ones(4, device=dev) + 1 in a Python loop <= 1.5x CPU
    "large": 1.1,     # add 1M and mul 1M <= 1.1x CPU ...
    "large_spread": 1.5,  # ... with acme's slowest round <= 1.5x its fastest
    "reserved_after_empty_cache": 0,  # bytes still reserved once everything is freed
    "chain": 1.5,     # 1,000 dependent small ops + synchronize <= 1.5x CPU (chapter 18)
    "overlap": 1.0,   # copy and product on two streams < the two alone (chapter 18)
    "profiler": 2.0,  # a small model's forward passes profiled <= 2x unprofiled (chapter 19)
    "compiled_speedup": 2.0,  # 8 elementwise ops on 1M: eager acme / compiled acme >= 2
    "compiled_vs_cpu": 1.2,   # ... compiled acme / compiled CPU <= 1.2 (chapter 20)
    "ddp_vs_gloo": 1.2,  # a DDP step on 2 processes, acme / gloo on CPU tensors (chapter 21)
    "training": 0.9,  # tools/train.py steps per second, acme / CPU, each model (chapter 23)
    "import_ms": 150,  # what autoloading the backend adds to `import torch`, ms (chapter 17)
}


# ---- the worker: runs inside one stage's environment -------------------------------


def worker(rounds: int, loop_number: int, cycles: int) -> dict:
    """Times the ops in this process (one stage, one ACME_CHECKED); prints JSON."""
    import warnings

    import timing  # tools/timing.py: the method the chapters' quick figures use too
    import torch
    import torch_acme  # noqa: F401
    from torch_acme import _build_info

    warnings.simplefilter("ignore")  # the fallback's notes, once per op
    dev = torch._C._get_privateuse1_backend_name()
    sync = torch.accelerator.synchronize  # ends a span of acme work (timing.timed)

    def timed(fn, number, device_work=False):
        return timing.timed(fn, number, sync if device_work else None)

    def compare(on_cpu, on_acme, number):
        return timing.compare(on_cpu, on_acme, number, rounds, sync)

    results: dict = {"stage": _build_info.STAGE, "threads": torch.get_num_threads()}

    small = {}
    a, b = torch.rand(4), torch.rand(4)
    da, db = a.to(dev), b.to(dev)
    small["add"] = compare(lambda: a + b, lambda: da + db, 2000)
    small["mul"] = compare(lambda: a * b, lambda: da * db, 2000)
    small["sum"] = compare(lambda: a.sum(), lambda: da.sum(), 2000)
    results["small"] = small

    large = {}
    m = torch.rand(1024, 1024)
    dm = m.to(dev)
    large["matmul 1024x1024"] = compare(lambda: m @ m, lambda: dm @ dm, 2)
    x, y = torch.rand(1 << 20), torch.rand(1 << 20)
    dx, dy = x.to(dev), y.to(dev)
    large["add 1M"] = compare(lambda: x + y, lambda: dx + dy, 20)
    large["mul 1M"] = compare(lambda: x * y, lambda: dx * dy, 20)
    large["sum 1M"] = compare(lambda: x.sum(), lambda: dx.sum(), 20)
    large["amax 1M"] = compare(lambda: x.amax(0), lambda: dx.amax(0), 20)
    results["large"] = large

    # The fallback's cost against the two copies it implies. relu has no native
    # kernel at either stage: input to the host, relu there, result back. The
    # four timings alternate within each round, the ratio is taken per round.
    rows = []
    for _ in range(rounds):
        cpu = timed(lambda: torch.relu(x), 20)
        through_fallback = timed(lambda: torch.relu(dx), 20, device_work=True)
        to_host = timed(lambda: dx.cpu(), 20, device_work=True)
        to_device = timed(lambda: x.to(dev), 20, device_work=True)
        rows.append((cpu, through_fallback, to_host, to_device,
                     (through_fallback - cpu) / (to_host + to_device)))
    median = [statistics.median(column) for column in zip(*rows)]
    per_round = [row[4] for row in rows]
    results["fallback"] = {
        "op": "relu 1M (float32, 4 MiB)", "cpu_s": median[0], "fallback_s": median[1],
        "to_host_s": median[2], "to_device_s": median[3], "overhead_s": median[1] - median[0],
        "overhead_over_copies": median[4], "rounds": rounds, "number": 20,
        "ratios": per_round,
    }

    # The fixed cost of a device op as a Python loop sees it: a factory, an op and
    # two frees per iteration. The same call shape on both sides, so that the
    # argument parsing costs the same.
    results["loop"] = compare(lambda: torch.ones(4, device="cpu") + 1,
                              lambda: torch.ones(4, device=dev) + 1, loop_number)

    # An allocation large enough to need its own mapping without a cache, touched
    # (so its pages fault in checked mode), then freed.
    def alloc_fill_free(device: str) -> None:
        t = torch.empty(1 << 20, device=device)
        t.fill_(1.0)
        del t

    results["alloc"] = compare(lambda: alloc_fill_free("cpu"), lambda: alloc_fill_free(dev), 50)
    results["alloc"]["op"] = "empty(1M float32, 4 MiB) + fill_ + del"

    if _build_info.STAGE >= 18:
        results["async"] = asynchronous(torch, dev, rounds, compare, timed)
    if _build_info.STAGE >= 19:
        results["profiler"] = profiling(torch, dev, rounds, timed)
    if _build_info.STAGE >= 20:
        results["compile"] = compiling(torch, dev, rounds, timed)

    del da, db, dm, dx, dy  # the fragmentation test ends by freeing every tensor
    try:
        torch.accelerator.memory_reserved()
    except Exception:  # noqa: BLE001 - no DeviceAllocator for acme before chapter 12
        results["fragmentation"] = None
    else:
        results["fragmentation"] = fragmentation(torch, dev, cycles)
    return results


def asynchronous(torch, dev: str, rounds: int, compare, timed) -> dict:
    """Chapter 18: dependent chains, the host's cost of a launch, and two streams overlapping."""
    timer = time.perf_counter

    def chain(t):
        for _ in range(250):  # 1,000 dependent small ops
            t = t + 1.0
            t = t * 0.5
            t = t - 0.25
            t = t / 1.5
        return t

    a = torch.rand(64)
    da = a.to(dev)
    chained = compare(lambda: chain(a), lambda: chain(da), 5)

    # The host's time per launch: calls queued back to back, no synchronize in
    # the timed span (the queue is drained after it), against the CPU op.
    b, db = torch.rand(64), torch.rand(64).to(dev)
    launch, cpu_op = [], []
    for _ in range(rounds):
        torch.accelerator.synchronize()
        start = timer()
        for _ in range(2000):
            da + db
        launch.append((timer() - start) / 2000)
        torch.accelerator.synchronize()
        cpu_op.append(timed(lambda: a + b, 2000))

    # A 16 MiB copy from pinned memory on a second stream beside work on the
    # default stream, each alone and both at once. The work is a 2 ms kernel
    # that leaves the host's cores to the copy, as a real device's compute
    # leaves its copy engine alone (torch.acme._sleep, the stand-in
    # torch.cuda._sleep is for CUDA); and a 1024x1024 product, which on this
    # simulated device takes the same cores as the copy.
    side = torch.Stream(device=dev)
    pinned = torch.rand(4 << 20).pin_memory()
    m = torch.rand(1024, 1024).to(dev)

    def copy():
        with torch.acme.stream(side):
            pinned.to(dev, non_blocking=True)

    def overlap(work) -> dict:
        def both():
            copy()
            work()

        alone_copy, alone_work, together, ratios = [], [], [], []
        for _ in range(rounds):
            c = timed(copy, 5, device_work=True)
            w = timed(work, 5, device_work=True)
            t = timed(both, 5, device_work=True)
            alone_copy.append(c)
            alone_work.append(w)
            together.append(t)
            ratios.append(t / (c + w))
        return {"copy_s": statistics.median(alone_copy), "work_s": statistics.median(alone_work),
                "together_s": statistics.median(together), "ratio": statistics.median(ratios),
                "ratios": ratios}

    return {
        "chain": chained,
        "launch_s": statistics.median(launch), "cpu_op_s": statistics.median(cpu_op),
        "overlap_kernel": overlap(lambda: torch.acme._sleep(2000)),
        "overlap_product": overlap(lambda: m @ m),
    }


def profiling(torch, dev: str, rounds: int, timed) -> dict:
    """Chapter 19: a small model's forward passes under torch.profiler, against none."""
    from torch.profiler import ProfilerActivity, profile

    # Every op of this model has a native kernel: the profiler's cost is not
    # hidden behind the fallback's copies.
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Softmax(dim=-1),
                                torch.nn.Linear(64, 10)).to(dev)
    x = torch.rand(32, 64, device=dev)
    activities = [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]
    number = 20

    def forward():
        model(x)

    with profile(activities=activities):  # Kineto's one-time start-up, untimed
        forward()
    plain, profiled, stops, ratios = [], [], [], []
    for _ in range(rounds):
        p = timed(forward, number, device_work=True)
        with profile(activities=activities) as prof:
            q = timed(forward, number, device_work=True)
        start = time.perf_counter()
        prof.key_averages()  # stopping ends at __exit__; this is the analysis
        stops.append(time.perf_counter() - start)
        plain.append(p)
        profiled.append(q)
        ratios.append(q / p)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.PrivateUse1]
    return {"plain_s": statistics.median(plain), "profiled_s": statistics.median(profiled),
            "ratio": statistics.median(ratios), "ratios": ratios,
            "analysis_s": statistics.median(stops), "number": number,
            "kernels_per_profile": len(kernels)}


def compiling(torch, dev: str, rounds: int, timed) -> dict:
    """Chapter 20: a chain of 8 elementwise ops compiled and eager; a transformer
    block's compile time."""
    from compile_models import Block, chain  # beside this file

    x = torch.rand(1 << 20)
    dx = x.to(dev)
    on_cpu, on_acme = torch.compile(chain), torch.compile(chain)
    on_cpu(x)
    on_acme(dx)
    number = 20
    eager, compiled, compiled_cpu = [], [], []
    for _ in range(rounds):
        eager.append(timed(lambda: chain(dx), number, device_work=True))
        compiled.append(timed(lambda: on_acme(dx), number, device_work=True))
        compiled_cpu.append(timed(lambda: on_cpu(x), number))
    speedups = [e / c for e, c in zip(eager, compiled)]
    versus_cpu = [c / p for c, p in zip(compiled, compiled_cpu)]

    def compile_time(caches: bool) -> float:
        torch._dynamo.reset()
        block = Block(width=64).to(dev)
        h = torch.rand(4, 16, 64, device=dev, requires_grad=True)
        start = time.perf_counter()
        with torch._inductor.config.patch(force_disable_caches=not caches):
            torch.compile(block)(h).sum().backward()
        torch.accelerator.synchronize()
        return time.perf_counter() - start

    cold = compile_time(caches=False)
    compile_time(caches=True)  # fills the caches
    warm = compile_time(caches=True)
    return {"eager_s": statistics.median(eager), "compiled_s": statistics.median(compiled),
            "compiled_cpu_s": statistics.median(compiled_cpu), "number": number,
            "speedup": statistics.median(speedups), "speedups": speedups,
            "ratio": statistics.median(versus_cpu), "ratios": versus_cpu,
            "block_compile_cold_s": cold, "block_compile_warm_s": warm}


def fragmentation(torch, dev: str, cycles: int, window: int = 32, every: int = 1000) -> dict:
    """Mixed-size allocations and frees through the caching allocator; reserved bytes over time."""
    import math
    import random

    rng = random.Random(12)
    low, high = math.log(512), math.log(8 << 20)

    def allocate():
        return torch.empty(int(math.exp(rng.uniform(low, high))), dtype=torch.uint8, device=dev)

    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats()
    reserved_before = torch.accelerator.memory_reserved()
    live = [allocate() for _ in range(window)]
    reserved, allocated = [], []
    start = time.perf_counter()
    for cycle in range(cycles):
        if cycle % every == 0:
            reserved.append(torch.accelerator.memory_reserved())
            allocated.append(torch.accelerator.memory_allocated())
        # Free a random live tensor, allocate one in its place.
        victim = rng.randrange(len(live))
        live[victim] = live[-1]
        live.pop()
        live.append(allocate())
    elapsed = time.perf_counter() - start
    steady = torch.accelerator.memory_reserved()
    reserved.append(steady)
    allocated.append(torch.accelerator.memory_allocated())
    peak = torch.accelerator.max_memory_reserved()
    peak_allocated = torch.accelerator.max_memory_allocated()
    live.clear()
    cached = torch.accelerator.memory_reserved()
    torch.accelerator.empty_cache()
    return {
        "cycles": cycles, "window": window, "sizes": "log-uniform 512 B - 8 MiB", "seed": 12,
        "sample_every": every, "reserved_samples": reserved, "allocated_samples": allocated,
        "reserved_before": reserved_before, "peak_reserved": peak, "steady_reserved": steady,
        "peak_over_steady": peak / steady if steady else None,
        "peak_allocated": peak_allocated, "reserved_freed_before_empty_cache": cached,
        "reserved_after_empty_cache": torch.accelerator.memory_reserved(),
        "seconds_per_cycle": elapsed / cycles,
    }


def run_worker(stage: int, checked: bool, rounds: int, loop_number: int, cycles: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(BUILD / "packages" / f"stage-{stage:02d}"),
               ACME_CHECKED="1" if checked else "0", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    command = [sys.executable, __file__, "--worker", "--rounds", str(rounds),
               "--loop-number", str(loop_number), "--cycles", str(cycles)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"stage {stage} worker failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def distributed_figures(quick: bool) -> dict:
    """tools/dist_bench.py on two processes of stage NATIVE, in both modes."""
    from dist_bench import run  # beside this file

    figures = {}
    for checked in (True, False):
        env = dict(os.environ, PYTHONPATH=str(BUILD / "packages" / f"stage-{NATIVE:02d}"),
                   ACME_CHECKED="1" if checked else "0", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
        figures[mode(checked)] = run(quick, env=env)
    return figures


def training_protocol(quick: bool) -> tuple[int, int]:
    """(rounds, samples) of the training figures and of their noise floor."""
    # The epoch timed is 128 steps (32 when quick): at 32 the CNN's was over in
    # half a second, and one round's ratio swung by a fifth either way.
    return (1, 1024) if quick else (5, 4096)


def alternate(rounds: int, first, second) -> None:
    """Runs first() and second() `rounds` times, each going first in every
    other round, so neither always meets the machine as the other left it."""
    for number in range(rounds):
        for run in ((first, second) if number % 2 == 0 else (second, first)):
            run()


def training_figures(quick: bool) -> dict:
    """Chapter 23: tools/train.py itself, steps per second over its last epoch
    (compilation and warm-up done in the first), acme against the CPU. Each
    round runs the two devices back to back, each in a fresh process with the
    newest stage installed (tools/train_runs.py); the ratio is the median of
    the rounds'."""
    import train_runs  # beside this file

    site = train_runs.installed(BUILD, NATIVE)
    rounds, samples = training_protocol(quick)
    figures = {}
    with tempfile.TemporaryDirectory() as folder:
        for model in ("cnn", "lm"):
            for compiled in (False, True):
                args = ("--model", model, "--epochs", "2", "--samples", str(samples),
                        *(["--compile"] if compiled else []))
                cpu, acme = [], []

                def on_cpu():
                    cpu.append(train_runs.steps_per_second(train_runs.train(
                        site, Path(folder), *args, "--device", "cpu").check()))

                def on_acme():
                    run = train_runs.train(site, Path(folder), *args).check()
                    assert not run.fallback_ops, run.fallback_ops
                    acme.append(train_runs.steps_per_second(run))

                alternate(rounds, on_cpu, on_acme)
                ratios = [a / c for a, c in zip(acme, cpu)]
                figures[f"{model} {'compiled' if compiled else 'eager'}"] = {
                    "cpu_steps_s": statistics.median(cpu), "acme_steps_s": statistics.median(acme),
                    "ratio": statistics.median(ratios), "ratios": ratios}
    return figures


def training_noise_floor(quick: bool) -> dict:
    """The training figures' resolution on this machine: the same protocol as
    training_figures (the eager CNN, alternating order, median of the rounds),
    with the CPU on both sides: how far from 1.0 two devices at parity can read."""
    import train_runs

    site = train_runs.installed(BUILD, NATIVE)
    rounds, samples = training_protocol(quick)
    args = ("--model", "cnn", "--epochs", "2", "--samples", str(samples), "--device", "cpu")
    first, second = [], []
    with tempfile.TemporaryDirectory() as folder:
        def run_into(side):
            return lambda: side.append(train_runs.steps_per_second(
                train_runs.train(site, Path(folder), *args).check()))

        alternate(rounds, run_into(first), run_into(second))
    ratios = [b / a for a, b in zip(first, second)]
    return {"ratio": statistics.median(ratios), "ratios": ratios}


# ---- build figures -------------------------------------------------------------------


def build_figures(jobs: int) -> dict:
    """Cold build and rebuilds of every stage, in a temporary copy of the sources."""
    env = dict(os.environ, CCACHE_DISABLE="1")
    with tempfile.TemporaryDirectory(prefix="acme-bench-") as tmp:
        copy = Path(tmp) / "repo"
        copy.mkdir()
        for name in ["csrc", "src", "build_support", "chapters", "tools"]:
            shutil.copytree(ROOT / name, copy / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for name in ["CMakeLists.txt", "pyproject.toml"]:
            if (ROOT / name).exists():
                shutil.copy2(ROOT / name, copy / name)
        out = Path(tmp) / "_build"
        command = [sys.executable, str(copy / "tools" / "build_stages.py"), "--out", str(out),
                   "-j", str(jobs)]

        def timed_build() -> float:
            start = time.perf_counter()
            subprocess.run(command, env=env, check=True, cwd=copy, capture_output=True)
            return time.perf_counter() - start

        objects = lambda: len(list((out / "obj").glob("*.o")))  # noqa: E731
        figures = {"jobs": jobs, "cold_s": timed_build()}
        figures["objects"] = objects()
        figures["stages"] = len(list((out / "stages").glob("stage-*")))
        figures["noop_s"] = timed_build()
        # A touch changes no content: the stage snapshots stay identical, so
        # nothing is recompiled. That is part of the design, and measured.
        touched = copy / "csrc" / "aten" / "native_kernels.cpp"
        os.utime(touched)
        figures["touch_s"] = timed_build()
        # Edits: chapter 10's own file (one stage), then a chapter 1 file that
        # every later stage shares (one object, relinked into each stage).
        for key, rel in [("edit_ch10", "csrc/aten/native_kernels.cpp"),
                         ("edit_ch01", "csrc/aten/minimal_ops.cpp")]:
            with open(copy / rel, "a") as f:
                f.write("// bench: an edited line\n")
            before = objects()
            figures[f"{key}_s"] = timed_build()
            figures[f"{key}_compiled"] = objects() - before
    return figures


# ---- packaging figures (chapter 17) ---------------------------------------------------


def import_times(runs: int = 15) -> dict:
    """`import torch` in fresh processes, alone and with the final stage autoloaded (ms)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from chapter_support import installed_view

    timer = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
    times: dict[str, list[float]] = {"alone": [], "autoload": []}
    with tempfile.TemporaryDirectory(prefix="acme-bench-") as tmp:
        site = installed_view(BUILD / "stages" / f"stage-{NATIVE:02d}",
                              BUILD / "packages" / f"stage-{NATIVE:02d}" / "torch_acme", Path(tmp) / "site")
        for _ in range(runs):
            for key, switch in (("alone", "0"), ("autoload", "1")):
                env = dict(os.environ, PYTHONPATH=str(site), TORCH_DEVICE_BACKEND_AUTOLOAD=switch)
                done = subprocess.run([sys.executable, "-c", timer], env=env, capture_output=True,
                                      text=True, check=True)
                times[key].append(1000 * float(done.stdout.strip().splitlines()[-1]))
    median = {key: statistics.median(values) for key, values in times.items()}
    return {"runs": runs, "alone_ms": median["alone"], "autoload_ms": median["autoload"],
            "added_ms": median["autoload"] - median["alone"]}


def wheel_figures() -> dict:
    """`pip wheel` of the final stage from a clean copy, as a vendor builds it: cold with
    ccache off, and (when ccache is installed) into an empty cache, then from a second
    copy elsewhere with that cache warm."""
    sys.path.insert(0, str(ROOT / "tools"))
    from chapter_support import fresh_venv

    figures: dict = {"stage": NATIVE, "ccache": bool(shutil.which("ccache"))}
    with tempfile.TemporaryDirectory(prefix="acme-bench-") as tmp:
        python = fresh_venv(Path(tmp) / "venv")

        def build(name: str, **env_extra: str) -> float:
            project = Path(tmp) / name / "backend"
            shutil.copytree(BUILD / "stages" / f"stage-{NATIVE:02d}", project)
            env = {k: v for k, v in os.environ.items() if not k.startswith("CCACHE")}
            env.update(env_extra)
            start = time.perf_counter()
            subprocess.run([python, "-m", "pip", "wheel", "--no-build-isolation",
                            "--no-deps", "--no-index", "-w", str(Path(tmp) / name), str(project)],
                           env=env, check=True, capture_output=True)
            seconds = time.perf_counter() - start
            (wheel,) = (Path(tmp) / name).glob("*.whl")
            figures["wheel_bytes"] = wheel.stat().st_size
            return seconds

        figures["cold_s"] = build("plain", CCACHE_DISABLE="1")
        if figures["ccache"]:
            cache = {"CMAKE_CXX_COMPILER_LAUNCHER": "ccache", "CCACHE_DIR": str(Path(tmp) / "ccache"),
                     "CCACHE_BASEDIR": tmp, "CCACHE_NOHASHDIR": "1"}
            figures["ccache_cold_s"] = build("first", **cache)
            figures["ccache_warm_s"] = build("second", **cache)
    return figures


# ---- machine, report, plots ---------------------------------------------------------


def machine() -> dict:
    import torch

    model = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    info = {"cpu": model, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "system": platform.platform(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                        capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return info


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def mode(checked: bool) -> str:
    return "checked" if checked else "unchecked"


def spread(figure: dict) -> str:
    return (f"{figure['ratio']:.2f}x ({min(figure['ratios']):.2f}-"
            f"{max(figure['ratios']):.2f})")


def verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def column(key: str) -> str:
    """A table heading for one configuration, e.g. 'native (stage 12), checked'."""
    path, checked = key.split("-")
    return f"{path} (stage {STAGES[path]}), {checked}"


def memory_rows(runs: dict) -> list[tuple[str, dict, dict]]:
    """(label, stage PREVIOUS figure, stage NATIVE figure), checked mode, for the memory table."""
    old, new = runs["previous-checked"], runs["native-checked"]
    rows = [(f"{op} (4 elements)", old["small"][op], new["small"][op]) for op in new["small"]]
    rows.append(("loop", old["loop"], new["loop"]))
    rows += [(op, old["large"][op], new["large"][op]) for op in ("add 1M", "mul 1M")]
    rows.append(("alloc 4 MiB", old["alloc"], new["alloc"]))
    return rows


def memory_section(results: dict) -> list[str]:
    runs = results["runs"]
    old, new = runs["previous-checked"], runs["native-checked"]
    lines = [
        f"**Memory: stage {PREVIOUS} against stage {NATIVE}** (checked mode). Stage {PREVIOUS} "
        "maps every device allocation afresh, stage "
        f"{NATIVE} keeps freed blocks in a cache and hands them out again. Ratios are acme / CPU "
        f"with the lowest and highest round; the last column divides stage {PREVIOUS}'s figure "
        f"by stage {NATIVE}'s (above 1: stage {NATIVE} is faster by that factor).",
        "",
        f"| measurement | stage {PREVIOUS} | stage {NATIVE} | stage {PREVIOUS} / stage {NATIVE} |",
        "| --- | --- | --- | --- |",
    ]
    for label, a, b in memory_rows(runs):
        # For a time, how many times faster; for a ratio to the CPU, the same
        # (the CPU's time is the same in both stages, up to noise).
        gain = a["acme_s"] / b["acme_s"] if label == "alloc 4 MiB" else a["ratio"] / b["ratio"]
        if label == "loop":
            label = (f"Python loop of `torch.ones(4, device=dev) + 1` ({a['number']:,} / "
                     f"{b['number']:,} iterations a round), acme / CPU")
            cells = [spread(a), spread(b)]
        elif label == "alloc 4 MiB":
            label = "4 MiB `torch.empty` + `fill_(1.0)` + `del`, time per iteration"
            cells = [f"{f['acme_s'] * 1e6:.0f} µs; {spread(f)} the CPU" for f in (a, b)]
        elif label.endswith(" 1M"):
            label = f"{label} (float32), acme / CPU; slowest acme round / fastest"
            cells = [f"{spread(f)}; {f['spread']:.2f}" for f in (a, b)]
        else:
            label = f"{label}, acme / CPU"
            cells = [spread(a), spread(b)]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {gain:.2f} |")
    lines += ["", "<!-- plot: memory_stages.png -->", ""]
    frag = new.get("fragmentation")
    if not frag:
        lines += [f"**Fragmentation**: not measured (stage {NATIVE} has no memory statistics "
                  "in `torch.accelerator`).", ""]
        return lines
    met = frag["reserved_after_empty_cache"] == TARGETS["reserved_after_empty_cache"]
    lines += [
        f"**Fragmentation** (stage {NATIVE}, checked): {frag['cycles']:,} cycles, each freeing "
        f"a random one of {frag['window']} live tensors and allocating another (sizes "
        f"{frag['sizes']}, seed {frag['seed']}; {frag['seconds_per_cycle'] * 1e6:.1f} µs a "
        f"cycle), `torch.accelerator.memory_reserved()` sampled every {frag['sample_every']:,} "
        f"cycles. Reserved memory peaked at {mib(frag['peak_reserved'])} and stood at "
        f"{mib(frag['steady_reserved'])} after the last cycle: peak / steady "
        f"{frag['peak_over_steady']:.2f}. Live tensors peaked at "
        f"{mib(frag['peak_allocated'])}. With every tensor freed, the cache still held "
        f"{mib(frag['reserved_freed_before_empty_cache'])}; `torch.accelerator.empty_cache()` "
        f"then left {frag['reserved_after_empty_cache']} bytes reserved (target 0: "
        f"{verdict(met)}).",
    ]
    other = runs.get("native-unchecked", {}).get("fragmentation")
    if other:
        lines[-1] += (f" Unchecked: peak {mib(other['peak_reserved'])}, steady "
                      f"{mib(other['steady_reserved'])} ({other['peak_over_steady']:.2f}), "
                      f"{other['reserved_after_empty_cache']} bytes after `empty_cache()`.")
    lines += ["", "<!-- plot: fragmentation.png -->", ""]
    return lines


def async_section(results: dict) -> list[str]:
    """Chapter 18's figures, from the newest stage in both modes."""
    rows = []
    for checked in (True, False):
        a = results["runs"][f"native-{mode(checked)}"].get("async")
        if not a:
            return []
        c = a["chain"]
        cells = [f"{o['copy_s'] * 1e3:.2f} + {o['work_s'] * 1e3:.2f} ms alone, "
                 f"{o['together_s'] * 1e3:.2f} ms together ({o['ratio']:.2f} of the sum)"
                 for o in (a["overlap_kernel"], a["overlap_product"])]
        rows.append(f"| {mode(checked)} | {spread(c)} | {a['launch_s'] * 1e6:.1f} us | "
                    f"{a['cpu_op_s'] * 1e6:.1f} us | " + " | ".join(cells) + " |")
    return [f"**Asynchronous execution** (stage {NATIVE}, chapter 18). A chain of 1,000 "
            "dependent ops on 64 elements then `synchronize()`, acme / CPU; the host's time "
            "per `a + b` launch (queued back to back, no synchronize in the span) next to the "
            "CPU's time for the same op; a 16 MiB `non_blocking` copy from pinned memory on a "
            "second stream beside work on the default stream, each alone and both at once. "
            "The work is first a 2 ms kernel that leaves the host's cores free "
            "(`torch.acme._sleep`, standing in for a device's compute units, which leave its "
            "copy engine alone), then a 1024x1024 product, which on this simulated device "
            "competes with the copy for the same two cores.", "",
            "| mode | 1,000-op chain, acme / CPU | launch (host) | CPU op | copy + 2 ms kernel | "
            "copy + product |", "| --- | --- | --- | --- | --- | --- |",
            *rows, ""]


def profiler_section(results: dict) -> list[str]:
    """Chapter 19's figure, from the newest stage in both modes."""
    rows = []
    for checked in (True, False):
        p = results["runs"][f"native-{mode(checked)}"].get("profiler")
        if not p:
            return []
        rows.append(f"| {mode(checked)} | {p['plain_s'] * 1e3:.3f} ms | "
                    f"{p['profiled_s'] * 1e3:.3f} ms | {spread(p)} | "
                    f"{p['analysis_s'] * 1e3:.0f} ms | {p['kernels_per_profile']} |")
    return [f"**Profiler** (stage {NATIVE}, chapter 19). One forward pass of a small model "
            "(Linear 64-64, Softmax, Linear 64-10 on 32 rows; every op a native kernel) then "
            "`synchronize()`, without a profiler and inside `torch.profiler.profile` with CPU "
            "and acme activities (20 passes a profile); the analysis is `key_averages()` of "
            "one profile.", "",
            "| mode | unprofiled | profiled | profiled / unprofiled | analysis | kernels "
            "traced per profile |", "| --- | --- | --- | --- | --- | --- |", *rows, ""]


def compile_section(results: dict) -> list[str]:
    """Chapter 20's figures, from the newest stage in both modes."""
    rows = []
    for checked in (True, False):
        c = results["runs"][f"native-{mode(checked)}"].get("compile")
        if not c:
            return []
        rows.append(f"| {mode(checked)} | {c['eager_s'] * 1e3:.2f} ms | "
                    f"{c['compiled_s'] * 1e3:.2f} ms | {c['compiled_cpu_s'] * 1e3:.2f} ms | "
                    f"{c['speedup']:.1f} ({min(c['speedups']):.1f}-{max(c['speedups']):.1f}) | "
                    f"{spread(c)} | {c['block_compile_cold_s']:.1f} s | "
                    f"{c['block_compile_warm_s']:.1f} s |")
    return [f"**torch.compile** (stage {NATIVE}, chapter 20). A chain of 8 elementwise ops "
            "(mul, add, sin, mul, cos, sub, mul, exp) on 1M float32 elements, "
            "then `synchronize()`: eager on acme, compiled on acme (one fused kernel) and "
            "compiled on the CPU. The compile time is a transformer block's (width 64, 4 heads) "
            "first forward and backward: with Inductor's caches disabled (cold), and again "
            "with them filled (warm).", "",
            "| mode | eager acme | compiled acme | compiled CPU | eager / compiled | "
            "compiled acme / compiled CPU | block compile, cold | warm |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |", *rows, ""]


def distributed_section(results: dict) -> list[str]:
    """Chapter 21's figures: two processes, stage NATIVE, both modes."""
    d = results.get("distributed")
    if not d:
        return []
    rows, sizes = [], []
    for checked in (True, False):
        r = d[mode(checked)]
        rows.append(f"| {mode(checked)} | {r['ddp_acme_s'] * 1e3:.2f} ms | "
                    f"{r['ddp_gloo_cpu_s'] * 1e3:.2f} ms | {r['ratio']:.2f} "
                    f"({min(r['ratios']):.2f}-{max(r['ratios']):.2f}) |")
    checked = d["checked"]["allreduce"]
    device = next(k for k in checked if k != "gloo")
    for i, a in enumerate(checked[device]):
        u, g = d["unchecked"]["allreduce"][device][i], checked["gloo"][i]
        sizes.append(f"| {a['bytes'] // 1024:,} KiB | {a['seconds'] * 1e6:,.0f} us, "
                     f"{a['bus_gb_s']:.2f} GB/s | {u['seconds'] * 1e6:,.0f} us, "
                     f"{u['bus_gb_s']:.2f} GB/s | {g['seconds'] * 1e6:,.0f} us, "
                     f"{g['bus_gb_s']:.2f} GB/s |")
    return [f"**torch.distributed** (stage {NATIVE}, chapter 21, two processes on this "
            "machine). A DDP training step (`tools/ddp_train.py`'s model, 32 rows per rank, "
            "SGD) with acme tensors and acme's backend, against the same step with CPU "
            "tensors and gloo, in the same processes.", "",
            "| mode | DDP step, acme | DDP step, gloo on CPU | acme / gloo |",
            "| --- | --- | --- | --- |", *rows, "",
            "all_reduce of float32 tensors, one call after the other: time per call and bus "
            "bandwidth (bytes x 2(n-1)/n / time, NCCL's busBw).", "",
            "| size | acme, checked | acme, unchecked | gloo, CPU |", "| --- | --- | --- | --- |",
            *sizes, "", "<!-- plot: allreduce_bandwidth.png -->", ""]


def training_section(results: dict) -> list[str]:
    """Chapter 23's figures: the training script, checked mode."""
    t = results.get("training")
    if not t:
        return []
    rows = [f"| {name} | {f['cpu_steps_s']:.1f} | {f['acme_steps_s']:.1f} | {f['ratio']:.2f} "
            f"({min(f['ratios']):.2f}-{max(f['ratios']):.2f}) | "
            f"{verdict(f['ratio'] >= TARGETS['training'])} |" for name, f in t.items()]
    return [f"**Training** (stage {NATIVE}, chapter 23, checked mode). `tools/train.py`, "
            "unchanged, with its defaults (batch 32, AdamW, two DataLoader workers, dropout "
            "0.1, checkpointed transformer blocks): steps per second over its last epoch, "
            "on the CPU and on acme, run back to back (each first in every other round); "
            f"the ratio is the median of {len(next(iter(t.values()))['ratios'])} such rounds "
            "(their range in parentheses). "
            f"Target: acme / CPU >= {TARGETS['training']}.", "",
            "| model | CPU steps/s | acme steps/s | acme / CPU | target |",
            "| --- | --- | --- | --- | --- |", *rows, "", *noise_floor_lines(results)]


def noise_floor_lines(results: dict) -> list[str]:
    n = results.get("training_noise")
    if not n:
        return []
    return [f"The same protocol with the CPU on both sides (the eager CNN), as a measure of "
            f"the figures' resolution on this machine: {n['ratio']:.2f} "
            f"({min(n['ratios']):.2f}-{max(n['ratios']):.2f}): how far from 1.0 two devices "
            "at parity can read.", ""]


def report(results: dict) -> str:
    m = results["machine"]
    runs = results["runs"]
    n = results["numbers"]
    quick = ("**A quick run** (`nox -s site` ran it because no fuller results existed): "
             f"{results['rounds']} rounds, {n['loop_native']:,} loop iterations a round for stage "
             f"{NATIVE} and {n['loop_other']:,} for the others (instead of "
             f"{LOOP_NUMBER['native'][0]:,} and {LOOP_NUMBER['other'][0]:,}), "
             f"{n['cycles']:,} fragmentation cycles (instead of {CYCLES[0]:,}) and no build "
             "figures. `nox -s bench` measures with more rounds and the builds, and the next "
             "site build shows its figures.")
    headings = "| op | " + " | ".join(column(k) for k in RUN_KEYS) + " |"
    lines = [
        *([quick, ""] if results.get("quick") else []),
        f"Measured {m['date']} on {m['cores']} cores of an {m['cpu']}, torch {m['torch']}, "
        f"Python {m['python']} (commit {m.get('commit', '?')}). Load average before and "
        f"after: {results['load_before']} / {results['load_after']}. Each figure is the median "
        f"of {results['rounds']} rounds, with the lowest and highest round in parentheses; a "
        "ratio is acme time / CPU time in the same process.",
        "",
        "**Small ops** (4-element float32 tensors): acme / CPU",
        "",
        headings,
        "| --- | --- | --- | --- | --- |",
    ]
    for op in runs["native-checked"]["small"]:
        cells = [spread(runs[k]["small"][op]) for k in RUN_KEYS]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    lines += ["", "<!-- plot: small_ops.png -->", "", "**Large ops**: acme / CPU", "",
              headings, "| --- | --- | --- | --- | --- |"]
    for op in runs["native-checked"]["large"]:
        cells = [spread(runs[k]["large"][op]) for k in RUN_KEYS]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    lines += ["", "<!-- plot: large_ops.png -->", "",
              f"**Fallback cost against its copies** (relu of 1M float32 elements, stage "
              f"{FALLBACK})", "",
              "| mode | relu on CPU | relu through the fallback | overhead | copy to host | "
              "copy to device | overhead / copies |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for checked in (True, False):
        f = runs[f"fallback-{mode(checked)}"]["fallback"]
        lines.append(f"| {mode(checked)} | {f['cpu_s'] * 1e3:.2f} ms | "
                     f"{f['fallback_s'] * 1e3:.2f} ms | {f['overhead_s'] * 1e3:.2f} ms | "
                     f"{f['to_host_s'] * 1e3:.2f} ms | {f['to_device_s'] * 1e3:.2f} ms | "
                     f"{f['overhead_over_copies']:.2f} ({min(f['ratios']):.2f}-"
                     f"{max(f['ratios']):.2f}) |")
    lines += ["", "<!-- plot: fallback_copies.png -->", "", *memory_section(results),
              *async_section(results), *profiler_section(results), *compile_section(results),
              *distributed_section(results), *training_section(results),
              "**Targets** (benchmarks, never asserted)", "",
              "| target | checked | unchecked |", "| --- | --- | --- |"]
    ratio = lambda t: f"{t['value']:.2f}x: {verdict(t['met'])}"  # noqa: E731
    rows = [
        (f"native (stage {NATIVE}) small op <= {TARGETS['small']}x CPU (worst of add, mul, sum)",
         "small", ratio),
        (f"native (stage {NATIVE}) Python loop `torch.ones(4, device=dev) + 1` <= "
         f"{TARGETS['loop']}x CPU", "loop", ratio),
        *[(f"native (stage {NATIVE}) {op} <= {TARGETS['large']}x CPU, slowest acme round <= "
           f"{TARGETS['large_spread']}x the fastest", op,
           lambda t: f"{t['value']:.2f}x, {t['spread']:.2f}: {verdict(t['met'])}")
          for op in ("add 1M", "mul 1M")],
        (f"native (stage {NATIVE}) 1024x1024 matmul <= {TARGETS['matmul']}x CPU", "matmul",
         ratio),
        (f"fallback (stage {FALLBACK}) overhead <= the two copies + 10%", "fallback",
         lambda t: f"{t['value']:.2f}: {verdict(t['met'])}"),
        (f"native (stage {NATIVE}) `empty_cache()` leaves 0 bytes reserved after the "
         "fragmentation test", "empty_cache",
         lambda t: f"{t['value']} bytes: {verdict(t['met'])}"),
        (f"native (stage {NATIVE}) fragmentation, peak / steady reserved (reported, no target)",
         "peak_over_steady", lambda t: f"{t['value']:.2f}"),
        (f"native (stage {NATIVE}) 1,000 dependent small ops + `synchronize()` <= "
         f"{TARGETS['chain']}x CPU", "chain", ratio),
        (f"native (stage {NATIVE}) 16 MiB pinned copy on one stream beside a 2 ms kernel "
         "on another: together / (the two alone) < 1", "overlap",
         lambda t: f"{t['value']:.2f}: {verdict(t['met'])}"),
        (f"native (stage {NATIVE}) a small model's forward pass profiled <= "
         f"{TARGETS['profiler']}x unprofiled", "profiler", ratio),
        (f"native (stage {NATIVE}) 8 elementwise ops on 1M, eager / compiled >= "
         f"{TARGETS['compiled_speedup']}x", "compiled_speedup", ratio),
        (f"native (stage {NATIVE}) the same, compiled acme / compiled CPU <= "
         f"{TARGETS['compiled_vs_cpu']}x", "compiled_vs_cpu", ratio),
        (f"native (stage {NATIVE}) a DDP step on two processes, acme / gloo on CPU tensors <= "
         f"{TARGETS['ddp_vs_gloo']}x", "ddp_vs_gloo", ratio),
        (f"native (stage {NATIVE}) tools/train.py steps per second, acme / CPU, the slowest of "
         f"both models eager and compiled >= {TARGETS['training']}", "training", ratio),
    ]
    for name, key, show in rows:
        cells = []
        for checked in (True, False):
            t = results["targets"][mode(checked)].get(key)
            cells.append(show(t) if t and t["value"] is not None else "not measured")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    b = results.get("build")
    if b:
        lines += ["", f"**Builds** (every stage, {b['jobs']} parallel jobs, ccache disabled, in a "
                  "temporary copy of the sources)", "", "| build | seconds |", "| --- | --- |",
                  f"| cold: {b['stages']} stages, {b['objects']} objects | {b['cold_s']:.0f} |",
                  f"| nothing changed | {b['noop_s']:.1f} |",
                  f"| `native_kernels.cpp` touched (same content) | {b['touch_s']:.1f} |",
                  f"| a line added to `native_kernels.cpp` (chapter 10): "
                  f"{b['edit_ch10_compiled']} object(s) compiled, stages 10-{NATIVE} relinked "
                  f"| {b['edit_ch10_s']:.1f} |",
                  f"| a line added to `minimal_ops.cpp` (chapter 1): {b['edit_ch01_compiled']} "
                  f"objects compiled (one per variant of the headers it includes), stages "
                  f"1-{NATIVE} relinked | {b['edit_ch01_s']:.1f} |", "",
                  "<!-- plot: builds.png -->"]
    i = results.get("imports")
    if i:
        lines += ["", f"**Packaging** (chapter 17). `import torch` in a fresh process, median of "
                  f"{i['runs']} runs: {i['alone_ms']:.0f} ms alone, {i['autoload_ms']:.0f} ms with "
                  f"stage {NATIVE} autoloaded, so the backend adds {i['added_ms']:.0f} ms "
                  f"(goal: at most {TARGETS['import_ms']} ms): "
                  f"{verdict(i['added_ms'] <= TARGETS['import_ms'])}."]
    w = results.get("wheel")
    if w:
        lines += ["", f"`pip wheel --no-build-isolation` of stage {w['stage']} from a clean copy: "
                  f"{w['cold_s']:.0f} s with ccache off"]
        if w.get("ccache_cold_s") is not None:
            lines[-1] += (f", {w['ccache_cold_s']:.0f} s into an empty ccache, "
                          f"{w['ccache_warm_s']:.0f} s from a second copy with that cache warm")
        lines[-1] += f". The wheel: {w['wheel_bytes'] / 1024:.0f} KiB."
    return "\n".join(lines) + "\n"


STAGES = {"native": NATIVE, "previous": PREVIOUS, "fallback": FALLBACK}
# Every configuration timed: (name, stage, modes). "previous" only in checked mode,
# the mode where its allocator's cost shows.
CONFIGS = [("native", NATIVE, (True, False)), ("previous", PREVIOUS, (True,)),
           ("fallback", FALLBACK, (True, False))]
RUN_KEYS = ["native-checked", "native-unchecked", "fallback-checked", "fallback-unchecked"]


def plots(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    colors = {"native-checked": "#1f77b4", "native-unchecked": "#9ecae1",
              "fallback-checked": "#d62728", "fallback-unchecked": "#fc9272",
              "previous-checked": "#ff7f0e"}
    written = []

    def save(fig, name: str) -> None:
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    for group, title, target, target_label in [
            ("small", "Small ops (4 elements): acme time / CPU time", TARGETS["small"],
             f"native target {TARGETS['small']}x"),
            ("large", "Large ops: acme time / CPU time", TARGETS["matmul"],
             f"matmul target {TARGETS['matmul']}x")]:
        ops = list(runs["native-checked"][group])
        fig, ax = plt.subplots(figsize=(8, 3.8))
        width = 0.2
        for i, key in enumerate(RUN_KEYS):
            values = [runs[key][group][op]["ratio"] for op in ops]
            ax.bar([j + (i - 1.5) * width for j in range(len(ops))], values, width,
                   label=column(key), color=colors[key])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(target, color="gray", linestyle="--", linewidth=0.8, label=target_label)
        ax.set_xticks(range(len(ops)), ops)
        ax.set_yscale("log")
        ax.set_ylabel("acme / CPU (log scale)")
        ax.set_title(title)
        fig.legend(fontsize=7, ncol=3, loc="lower center")
        fig.tight_layout(rect=(0, 0.12, 1, 1))
        name = f"{group}_ops.png"
        save(fig, name)

    fig, ax = plt.subplots(figsize=(8, 3.2))
    labels, overheads, copies = [], [], []
    for checked in (True, False):
        f = runs[f"fallback-{mode(checked)}"]["fallback"]
        labels.append(mode(checked))
        overheads.append(f["overhead_s"] * 1e3)
        copies.append((f["to_host_s"] + f["to_device_s"]) * 1e3)
    positions = range(len(labels))
    ax.barh([p + 0.2 for p in positions], overheads, 0.4, color="#d62728",
            label="fallback overhead (relu through the fallback - relu on CPU)")
    ax.barh([p - 0.2 for p in positions], copies, 0.4, color="#969696",
            label="t.cpu() + x.to(acme) of the same 4 MiB")
    ax.set_yticks(list(positions), labels)
    ax.set_xlabel("milliseconds")
    ax.set_title(f"Fallback cost (stage {FALLBACK}) against the two copies it implies")
    fig.legend(fontsize=7, ncol=2, loc="lower center")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    save(fig, "fallback_copies.png")

    # What the caching allocator buys: stage PREVIOUS against stage NATIVE, checked.
    rows = memory_rows(runs)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.38
    for i, key in enumerate(["previous-checked", "native-checked"]):
        values = [row[1 + i]["ratio"] for row in rows]
        ax.bar([j + (i - 0.5) * width for j in range(len(rows))], values, width,
               label=column(key), color=colors[key])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [row[0].replace(" (4 elements)", "") for row in rows])
    ax.set_yscale("log")
    ax.set_ylabel("acme / CPU (log scale)")
    ax.set_title(f"Stage {PREVIOUS} (plain allocator) against stage {NATIVE} (caching allocator)")
    fig.legend(fontsize=7, ncol=2, loc="lower center")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    save(fig, "memory_stages.png")

    frags = [(key, runs[key]["fragmentation"])
             for key in ("native-checked", "native-unchecked")
             if runs.get(key, {}).get("fragmentation")]
    if frags:
        fig, ax = plt.subplots(figsize=(8, 3.4))
        for key, frag in frags:
            samples = frag["reserved_samples"]
            cycles = [min(i * frag["sample_every"], frag["cycles"]) for i in range(len(samples))]
            style = "-" if key.endswith("-checked") else ":"
            ax.plot(cycles, [s / 2**20 for s in samples], style, color=colors[key],
                    label=f"reserved, {column(key)}")
        key, frag = frags[0]
        samples = frag["allocated_samples"]
        cycles = [min(i * frag["sample_every"], frag["cycles"]) for i in range(len(samples))]
        ax.plot(cycles, [s / 2**20 for s in samples], color="#969696", linewidth=0.8,
                label=f"allocated (live tensors), {column(key)}")
        ax.set_xlabel("cycle")
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=0)
        ax.set_title(f"Fragmentation test: reserved memory over {frag['cycles']:,} cycles")
        fig.legend(fontsize=7, ncol=3, loc="lower center")
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        save(fig, "fragmentation.png")

    d = results.get("distributed")
    if d:
        fig, ax = plt.subplots(figsize=(8, 3.2))
        for key, label, color in (("checked", "acme, checked", "#1f77b4"),
                                  ("unchecked", "acme, unchecked", "#9ecae1"),
                                  ("gloo", "gloo, CPU tensors", "#d62728")):
            series = d["checked"]["allreduce"]
            series = series["gloo"] if key == "gloo" else next(
                v for k, v in d[key]["allreduce"].items() if k != "gloo")
            ax.plot([p["bytes"] for p in series], [p["bus_gb_s"] for p in series], "o-",
                    label=label, color=color)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per all_reduce")
        ax.set_ylabel("bus bandwidth, GB/s")
        ax.set_title("all_reduce on two processes")
        ax.legend(fontsize=8)
        fig.tight_layout()
        save(fig, "allreduce_bandwidth.png")

    b = results.get("build")
    if b:
        fig, ax = plt.subplots(figsize=(8, 2.8))
        items = [("cold", b["cold_s"]), ("no change", b["noop_s"]), ("touch ch10", b["touch_s"]),
                 ("edit ch10", b["edit_ch10_s"]), ("edit ch01", b["edit_ch01_s"])]
        ax.barh([k for k, _ in items][::-1], [v for _, v in items][::-1], color="#31a354")
        ax.set_xlabel("seconds")
        ax.set_title("Building every stage")
        fig.tight_layout()
        save(fig, "builds.png")
    return written


def targets(runs: dict) -> dict:
    verdicts = {}
    for checked in (True, False):
        native = runs[f"native-{mode(checked)}"]
        small = max(r["ratio"] for r in native["small"].values())
        matmul = native["large"]["matmul 1024x1024"]["ratio"]
        fallback = runs[f"fallback-{mode(checked)}"]["fallback"]["overhead_over_copies"]
        loop = native["loop"]["ratio"]
        verdicts[mode(checked)] = {
            "small": {"value": small, "met": small <= TARGETS["small"]},
            "matmul": {"value": matmul, "met": matmul <= TARGETS["matmul"]},
            "fallback": {"value": fallback, "met": fallback <= TARGETS["fallback"]},
            "loop": {"value": loop, "met": loop <= TARGETS["loop"]},
        }
        for op in ("add 1M", "mul 1M"):
            f = native["large"][op]
            verdicts[mode(checked)][op] = {
                "value": f["ratio"], "spread": f["spread"],
                "met": f["ratio"] <= TARGETS["large"] and f["spread"] <= TARGETS["large_spread"]}
        asynchronous = native.get("async")
        if asynchronous:
            chain = asynchronous["chain"]["ratio"]
            overlap = asynchronous["overlap_kernel"]["ratio"]
            verdicts[mode(checked)]["chain"] = {"value": chain, "met": chain <= TARGETS["chain"]}
            verdicts[mode(checked)]["overlap"] = {"value": overlap,
                                                  "met": overlap < TARGETS["overlap"]}
        profiled = native.get("profiler")
        if profiled:
            verdicts[mode(checked)]["profiler"] = {
                "value": profiled["ratio"], "met": profiled["ratio"] <= TARGETS["profiler"]}
        compiled = native.get("compile")
        if compiled:
            verdicts[mode(checked)]["compiled_speedup"] = {
                "value": compiled["speedup"],
                "met": compiled["speedup"] >= TARGETS["compiled_speedup"]}
            verdicts[mode(checked)]["compiled_vs_cpu"] = {
                "value": compiled["ratio"], "met": compiled["ratio"] <= TARGETS["compiled_vs_cpu"]}
        frag = native.get("fragmentation")
        if frag:
            left = frag["reserved_after_empty_cache"]
            verdicts[mode(checked)]["empty_cache"] = {
                "value": left, "met": left == TARGETS["reserved_after_empty_cache"]}
            verdicts[mode(checked)]["peak_over_steady"] = {"value": frag["peak_over_steady"],
                                                           "met": None}
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "bench")
    parser.add_argument("--rounds", type=int, default=9, help="repetitions of every measurement")
    parser.add_argument("--skip-build", action="store_true", help="no build figures")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loop-number", type=int, default=LOOP_NUMBER["native"][0],
                        help=argparse.SUPPRESS)
    parser.add_argument("--cycles", type=int, default=CYCLES[0], help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help="3 rounds, fewer loop iterations and fragmentation cycles, no build "
                             "figures, labelled as a quick run (for the site)")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.rounds, args.loop_number, args.cycles)))
        return
    if args.quick:
        args.rounds, args.skip_build = 3, True
    pick = 1 if args.quick else 0
    numbers = {"loop_native": LOOP_NUMBER["native"][pick],
               "loop_other": LOOP_NUMBER["other"][pick], "cycles": CYCLES[pick]}

    for _, stage, _ in CONFIGS:
        if not (BUILD / "packages" / f"stage-{stage:02d}" / "torch_acme" / "_build_info.py").exists():
            raise SystemExit(f"stage {stage} is not built in {BUILD}: run `nox -s bench`")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine(), "rounds": args.rounds, "quick": args.quick,
                     "stages": STAGES, "numbers": numbers, "load_before": load(),
                     "targets_wanted": TARGETS, "runs": {}}
    for path, stage, modes in CONFIGS:
        loop_number = numbers["loop_native"] if stage == NATIVE else numbers["loop_other"]
        for checked in modes:
            key = f"{path}-{mode(checked)}"
            print(f"timing {key} (stage {stage})", flush=True)
            results["runs"][key] = run_worker(stage, checked, args.rounds, loop_number,
                                              numbers["cycles"])
    print(f"timing torch.distributed on two processes (stage {NATIVE})", flush=True)
    results["distributed"] = distributed_figures(args.quick)
    results["targets"] = targets(results["runs"])
    for checked in (True, False):
        r = results["distributed"][mode(checked)]
        results["targets"][mode(checked)]["ddp_vs_gloo"] = {
            "value": r["ratio"], "met": r["ratio"] <= TARGETS["ddp_vs_gloo"]}
    print(f"timing tools/train.py on acme and on the CPU (stage {NATIVE})", flush=True)
    results["training"] = training_figures(args.quick)
    results["targets"]["checked"]["training"] = {
        "value": min(f["ratio"] for f in results["training"].values()),
        "met": all(f["ratio"] >= TARGETS["training"] for f in results["training"].values())}
    results["training_noise"] = training_noise_floor(args.quick)
    results["imports"] = import_times(5 if args.quick else 15)
    if not args.skip_build:
        print("building every stage from scratch (several minutes)", flush=True)
        results["build"] = build_figures(args.jobs)
        print("building the last stage's wheel, three times (about ten minutes)", flush=True)
        results["wheel"] = wheel_figures()
    results["load_after"] = load()
    results["plots"] = plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(report(results))
    print((out / "results.md").read_text())
    print(f"written to {out}")


if __name__ == "__main__":
    main()
