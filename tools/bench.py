"""Benchmarks: acme's native kernels and CPU fallback against the CPU, and build times.

Every op figure is a ratio, acme time / CPU time, both measured in the same
process and run: the two are timed in alternation, round after round, and the
median of the per-round ratios is reported (with the median times). One
backend per process, so each configuration runs in a worker process of its
own: stage 10 (native kernels) and stage 9 (CPU fallback), each with checked
device memory (the default) and with ACME_CHECKED=0.

The build figures come from a copy of the repository's sources in a temporary
folder (the repository itself is never modified): a cold build of every stage
with ccache disabled, then rebuilds after touching and after editing one
chapter's source file in the copy.

Writes into OUT (default _build/bench): results.json (every number),
results.md (the tables docs/bench.md shows) and the plots as PNG files.

Usage: python tools/bench.py [--out DIR] [--rounds N] [--skip-build] [--quick]
(`nox -s bench` builds every stage, then runs this.)
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("ACME_BUILD_DIR", ROOT / "_build")).resolve()
NATIVE, FALLBACK = 10, 9  # the stages compared

# Targets from the chapter 10 issue: benchmarks, never asserted.
TARGETS = {
    "small": 1.3,     # native small op <= 1.3x CPU
    "matmul": 1.03,   # native 1024^2 matmul <= 1.03x CPU
    "fallback": 1.10,  # fallback overhead <= (both copies) x 1.10
}


# ---- the worker: runs inside one stage's environment -------------------------------


def worker(rounds: int) -> dict:
    """Times the ops in this process (one stage, one ACME_CHECKED); prints JSON."""
    import warnings

    import torch
    import torch_acme  # noqa: F401
    from torch_acme import _build_info

    warnings.simplefilter("ignore")  # the fallback's notes, once per op
    dev = torch._C._get_privateuse1_backend_name()
    timer = time.perf_counter

    def timed(fn, number):
        fn()  # warm up (first-call costs, allocator caches)
        start = timer()
        for _ in range(number):
            fn()
        return (timer() - start) / number

    def compare(on_cpu, on_acme, number):
        """acme/CPU ratio: median of per-round ratios; the two alternate within a round."""
        cpu_times, acme_times, ratios = [], [], []
        for _ in range(rounds):
            c = timed(on_cpu, number)
            a = timed(on_acme, number)
            cpu_times.append(c)
            acme_times.append(a)
            ratios.append(a / c)
        return {"ratio": statistics.median(ratios), "cpu_s": statistics.median(cpu_times),
                "acme_s": statistics.median(acme_times), "rounds": rounds, "number": number,
                "ratios": ratios}

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
        through_fallback = timed(lambda: torch.relu(dx), 20)
        to_host = timed(lambda: dx.cpu(), 20)
        to_device = timed(lambda: x.to(dev), 20)
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
    return results


def run_worker(stage: int, checked: bool, rounds: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(BUILD / "stages" / f"stage-{stage:02d}" / "src"),
               ACME_CHECKED="1" if checked else "0", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    done = subprocess.run([sys.executable, __file__, "--worker", "--rounds", str(rounds)],
                          env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"stage {stage} worker failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- build figures -------------------------------------------------------------------


def build_figures(jobs: int) -> dict:
    """Cold build and rebuilds of every stage, in a temporary copy of the sources."""
    env = dict(os.environ, CCACHE_DISABLE="1")
    with tempfile.TemporaryDirectory(prefix="acme-bench-") as tmp:
        copy = Path(tmp) / "repo"
        copy.mkdir()
        for name in ["csrc", "src", "chapters", "tools"]:
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


def report(results: dict) -> str:
    m = results["machine"]
    runs = results["runs"]
    quick = ("**A quick run** (`nox -s site` ran it because no fuller results existed): "
             f"{results['rounds']} rounds and no build figures. `nox -s bench` measures with "
             "more rounds and the builds, and the next site build shows its figures.")
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
        "| op | native, checked | native, unchecked | fallback, checked | fallback, unchecked |",
        "| --- | --- | --- | --- | --- |",
    ]
    for op in runs["native-checked"]["small"]:
        cells = [spread(runs[k]["small"][op]) for k in RUN_KEYS]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    lines += ["", "<!-- plot: small_ops.png -->", "", "**Large ops**: acme / CPU", "",
              "| op | native, checked | native, unchecked | fallback, checked | fallback, unchecked |",
              "| --- | --- | --- | --- | --- |"]
    for op in runs["native-checked"]["large"]:
        cells = [spread(runs[k]["large"][op]) for k in RUN_KEYS]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    lines += ["", "<!-- plot: large_ops.png -->", "",
              "**Fallback cost against its copies** (relu of 1M float32 elements, stage 9)", "",
              "| mode | relu on CPU | relu through the fallback | overhead | copy to host | "
              "copy to device | overhead / copies |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for checked in (True, False):
        f = runs[f"fallback-{mode(checked)}"]["fallback"]
        lines.append(f"| {mode(checked)} | {f['cpu_s'] * 1e3:.2f} ms | "
                     f"{f['fallback_s'] * 1e3:.2f} ms | {f['overhead_s'] * 1e3:.2f} ms | "
                     f"{f['to_host_s'] * 1e3:.2f} ms | {f['to_device_s'] * 1e3:.2f} ms | "
                     f"{f['overhead_over_copies']:.2f} ({min(f['ratios']):.2f}-"
                     f"{max(f['ratios']):.2f}) |")
    lines += ["", "<!-- plot: fallback_copies.png -->", "", "**Targets**", "",
              "| target | checked | unchecked |", "| --- | --- | --- |"]
    for name, key in [("native small op <= 1.3x CPU (worst of add, mul, sum)", "small"),
                      ("native 1024x1024 matmul <= 1.03x CPU", "matmul"),
                      ("fallback overhead <= the two copies + 10%", "fallback")]:
        cells = []
        for checked in (True, False):
            t = results["targets"][mode(checked)][key]
            cells.append(f"{t['value']:.2f}: {verdict(t['met'])}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    b = results.get("build")
    if b:
        lines += ["", f"**Builds** (every stage, {b['jobs']} parallel jobs, ccache disabled, in a "
                  "temporary copy of the sources)", "", "| build | seconds |", "| --- | --- |",
                  f"| cold: {b['stages']} stages, {b['objects']} objects | {b['cold_s']:.0f} |",
                  f"| nothing changed | {b['noop_s']:.1f} |",
                  f"| `native_kernels.cpp` touched (same content) | {b['touch_s']:.1f} |",
                  f"| a line added to `native_kernels.cpp` (chapter 10): "
                  f"{b['edit_ch10_compiled']} object compiled, stage 10 relinked "
                  f"| {b['edit_ch10_s']:.1f} |",
                  f"| a line added to `minimal_ops.cpp` (chapter 1): {b['edit_ch01_compiled']} "
                  f"objects compiled (one per variant of the headers it includes), stages 1-10 "
                  f"relinked | {b['edit_ch01_s']:.1f} |", "", "<!-- plot: builds.png -->"]
    return "\n".join(lines) + "\n"


RUN_KEYS = ["native-checked", "native-unchecked", "fallback-checked", "fallback-unchecked"]


def plots(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    colors = {"native-checked": "#1f77b4", "native-unchecked": "#9ecae1",
              "fallback-checked": "#d62728", "fallback-unchecked": "#fc9272"}
    written = []
    for group, title, target, target_label in [
            ("small", "Small ops (4 elements): acme time / CPU time", 1.3, "native target 1.3x"),
            ("large", "Large ops: acme time / CPU time", 1.03, "matmul target 1.03x")]:
        ops = list(runs["native-checked"][group])
        fig, ax = plt.subplots(figsize=(8, 3.8))
        width = 0.2
        for i, key in enumerate(RUN_KEYS):
            values = [runs[key][group][op]["ratio"] for op in ops]
            ax.bar([j + (i - 1.5) * width for j in range(len(ops))], values, width,
                   label=key.replace("-", ", "), color=colors[key])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(target, color="gray", linestyle="--", linewidth=0.8, label=target_label)
        ax.set_xticks(range(len(ops)), ops)
        ax.set_yscale("log")
        ax.set_ylabel("acme / CPU (log scale)")
        ax.set_title(title)
        fig.legend(fontsize=7, ncol=5, loc="lower center")
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        name = f"{group}_ops.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

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
    ax.set_title("Fallback cost against the two copies it implies")
    fig.legend(fontsize=7, ncol=2, loc="lower center")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(out / "fallback_copies.png", dpi=110)
    plt.close(fig)
    written.append("fallback_copies.png")

    b = results.get("build")
    if b:
        fig, ax = plt.subplots(figsize=(8, 2.8))
        items = [("cold", b["cold_s"]), ("no change", b["noop_s"]), ("touch ch10", b["touch_s"]),
                 ("edit ch10", b["edit_ch10_s"]), ("edit ch01", b["edit_ch01_s"])]
        ax.barh([k for k, _ in items][::-1], [v for _, v in items][::-1], color="#31a354")
        ax.set_xlabel("seconds")
        ax.set_title("Building every stage")
        fig.tight_layout()
        fig.savefig(out / "builds.png", dpi=110)
        plt.close(fig)
        written.append("builds.png")
    return written


def targets(runs: dict) -> dict:
    verdicts = {}
    for checked in (True, False):
        native = runs[f"native-{mode(checked)}"]
        small = max(r["ratio"] for r in native["small"].values())
        matmul = native["large"]["matmul 1024x1024"]["ratio"]
        fallback = runs[f"fallback-{mode(checked)}"]["fallback"]["overhead_over_copies"]
        verdicts[mode(checked)] = {
            "small": {"value": small, "met": small <= TARGETS["small"]},
            "matmul": {"value": matmul, "met": matmul <= TARGETS["matmul"]},
            "fallback": {"value": fallback, "met": fallback <= TARGETS["fallback"]},
        }
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "bench")
    parser.add_argument("--rounds", type=int, default=9, help="repetitions of every measurement")
    parser.add_argument("--skip-build", action="store_true", help="no build figures")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help="3 rounds, no build figures, labelled as a quick run (for the site)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.skip_build = 3, True
    if args.worker:
        print(json.dumps(worker(args.rounds)))
        return

    for stage in (NATIVE, FALLBACK):
        if not (BUILD / "stages" / f"stage-{stage:02d}" / "src" / "torch_acme" / "_build_info.py").exists():
            raise SystemExit(f"stage {stage} is not built in {BUILD}: run `nox -s bench`")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine(), "rounds": args.rounds, "quick": args.quick,
                     "load_before": load(),
                     "targets_wanted": TARGETS, "runs": {}}
    for stage, path in [(NATIVE, "native"), (FALLBACK, "fallback")]:
        for checked in (True, False):
            key = f"{path}-{mode(checked)}"
            print(f"timing {key} (stage {stage})", flush=True)
            results["runs"][key] = run_worker(stage, checked, args.rounds)
    results["targets"] = targets(results["runs"])
    if not args.skip_build:
        print("building every stage from scratch (several minutes)", flush=True)
        results["build"] = build_figures(args.jobs)
    results["load_after"] = load()
    results["plots"] = plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(report(results))
    print((out / "results.md").read_text())
    print(f"written to {out}")


if __name__ == "__main__":
    main()
