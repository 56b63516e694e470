"""Runs tests/conformance_suite.py in crash-isolated workers and writes the results.

    python tools/conformance.py                 # everything: every sample, ops and modules
    python tools/conformance.py --quick         # one sample per op, float32 (float64 for second
                                                # derivatives); no first backward (what `nox -s tests` runs)
    python tools/conformance.py -k conv         # tests whose name matches the regular expression "conv"
    python tools/conformance.py --publish       # keep the last whole run with the book (docs/_generated/)

Each worker is a Python process that imports the backend and the suite once,
then runs the tests it is sent one at a time and answers with one JSON line
per test. A worker that dies (a segfault, an abort) or stops answering is
recorded as a crash against the test it was running, and a new worker takes
the remaining tests. Results go to _build/conformance/results.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("ACME_BUILD_DIR", ROOT / "_build")).resolve()
CHAPTERS = tomllib.loads((ROOT / "chapters" / "chapters.toml").read_text())["chapter"]
LAST = CHAPTERS[-1]["number"]

# What a result can be, in the order the heatmap and the summary show them.
STATUSES = ("pass", "close", "mismatch", "error", "crash", "harness", "cpu-unsupported", "skipped", "xfail", "xpass")
DTYPE_ORDER = ("float32", "float64", "float16", "bfloat16", "complex64", "int64", "uint8", "bool",
               "uint16", "uint32", "uint64")
TEST_TIMEOUT = 300  # seconds one test may take before its worker is declared hung
TESTS_PER_EXTRA_WORKER = 40  # a selection gets a worker per 40 tests, up to `workers`
SUITE = ROOT / "tests" / "conformance_suite.py"


# ---- the worker: runs inside the stage's environment ----

def worker(stage: int, suite_path: Path) -> None:
    """Reads test names from stdin, answers with one JSON line each on stdout."""
    import importlib.util
    import warnings

    answer = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the tests print goes to stderr, never into the answers
    sys.path[:0] = [str(BUILD / "packages" / f"stage-{stage:02d}"), str(suite_path.parent)]
    warnings.simplefilter("ignore")
    spec = importlib.util.spec_from_file_location(suite_path.stem, suite_path)
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)

    classes = {name: getattr(suite, name) for name in dir(suite)
               if name.startswith("TestConformance") and name != "TestConformance"}
    answer.write(json.dumps({"ready": sorted(f"{c}.{t}" for c, cls in classes.items()
                                             for t in dir(cls) if t.startswith("test_")
                                             and callable(getattr(cls, t)))}) + "\n")
    for line in sys.stdin:
        test_id = line.strip()
        cls_name, _, method = test_id.partition(".")
        result = Outcome()
        started = time.perf_counter()
        classes[cls_name](method).run(result)
        answer.write(json.dumps({"test": test_id, "status": result.status, "reason": result.reason,
                                 "seconds": round(time.perf_counter() - started, 3)}) + "\n")


def _first_line(text: str, limit: int = 600) -> str:
    text = text.split("To execute this test, run")[0]  # unittest's advice, not the reason
    text = " ".join(text.strip().split())
    return text if len(text) <= limit else text[:limit] + "…"


class Outcome:
    """A unittest result for one test, reduced to a status and a reason."""

    def __init__(self):
        self.status, self.reason = "pass", ""

    def __getattr__(self, name):  # the rest of unittest's result protocol: nothing to record
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None

    shouldStop = False
    failfast = False

    @staticmethod
    def _cause(exc):
        """The suite's own exception, under any that PyTorch's decorators wrapped it in."""
        seen = exc
        while seen is not None:
            if type(seen).__name__ in ("Mismatch", "DeviceError", "Close"):
                return seen
            seen = seen.__cause__ or seen.__context__
        return exc

    def addFailure(self, test, err):
        self.addError(test, err)

    def addError(self, test, err):
        exc = self._cause(err[1])
        kind = type(exc).__name__
        if kind == "Mismatch":
            self.status, self.reason = "mismatch", _first_line(str(exc), 1500)
        elif kind == "Close":
            self.status, self.reason = "close", _first_line(str(exc), 1500)
        elif kind == "DeviceError":
            self.status, self.reason = "error", _first_line(str(exc))
        else:
            self.status, self.reason = "harness", _first_line(f"{kind}: {exc}")

    def addSubTest(self, test, subtest, err):
        if err is not None:
            self.addFailure(test, err) if issubclass(err[0], AssertionError) else self.addError(test, err)

    def addSkip(self, test, reason):
        self.status = "cpu-unsupported" if reason.startswith("the CPU") else "skipped"
        self.reason = _first_line(reason)

    def addExpectedFailure(self, test, err):
        self.status, self.reason = "xfail", _first_line(str(err[1]))

    def addUnexpectedSuccess(self, test):
        self.status, self.reason = "xpass", "declared a known failure, but it passes"


# ---- the driver ----

@dataclass
class Worker:
    process: subprocess.Popen
    log: Path
    test: str | None = None
    deadline: float = 0.0
    buffer: str = ""


@dataclass
class Run:
    results: list = field(default_factory=list)
    seconds: float = 0.0


def parse(test_id: str) -> dict:
    """Splits TestConformanceACME.test_forward_nn_functional_conv2d_acme_float32 into its parts."""
    method = test_id.partition(".")[2]
    m = re.fullmatch(rf"test_({'|'.join(KINDS)})_(.+)_[a-z0-9]+_([a-z0-9]+)", method)
    kind, name, dtype = m.groups() if m else ("?", method, "?")
    if kind == "?" or kind == "errors":  # error inputs have no dtype: test_errors_<op>_<device>
        m = re.fullmatch(r"test_errors_(.+)_[a-z0-9]+", method)
        if m:
            kind, name, dtype = "errors", m.group(1), "any"
    mode = ""
    if kind == "module":
        for suffix in ("_train_mode", "_eval_mode"):
            if name.endswith(suffix):
                name, mode = name[: -len(suffix)], suffix[1:-5]
    return {"kind": kind, "name": name, "dtype": dtype, "mode": mode}


def start_worker(stage: int, suite: Path, env: dict, logdir: Path, number: int) -> Worker:
    log = logdir / f"worker-{number}.log"
    process = subprocess.Popen([sys.executable, __file__, "--worker", "--stage", str(stage),
                                "--suite", str(suite)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
                               env=env, text=True, bufsize=1)
    return Worker(process, log)


def read_line(worker: Worker, timeout: float) -> str | None:
    """The worker's next line, or None if it died or stayed silent for `timeout` seconds."""
    with selectors.DefaultSelector() as sel:
        sel.register(worker.process.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return None
    line = worker.process.stdout.readline()
    return line or None


def crash_reason(worker: Worker, timed_out: bool, timeout: float) -> str:
    if timed_out:
        worker.process.kill()
        worker.process.wait()
        return f"no answer within {timeout:g} s (hung); the worker was killed"
    code = worker.process.wait()
    tail = [line for line in worker.log.read_text(errors="replace").splitlines() if line.strip()][-3:]
    how = f"signal {-code}" if code < 0 else f"exit status {code}"
    return _first_line(f"the worker died ({how}): " + " | ".join(tail))


def run(stage: int = LAST, workers: int = 2, select: str | None = None, quick: bool = False,
        progress=None, suite: Path = SUITE, timeout: float = TEST_TIMEOUT) -> Run:
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", PYTHONWARNINGS="ignore",
               PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    if quick:
        env["ACME_CONFORMANCE_SAMPLES"] = "1"
    logdir = Path(tempfile.mkdtemp(prefix="acme-conformance-"))
    started = time.perf_counter()
    # A whole run starts its workers together. A selection waits for the first
    # worker's list of tests: a few tests do not pay for another worker's start
    # (importing torch and its OpInfo database costs more than they take).
    pool = [start_worker(stage, suite, env, logdir, i) for i in range(1 if select else workers)]
    ready = read_line(pool[0], 600)
    if ready is None:
        raise RuntimeError("the first worker did not start:\n" + pool[0].log.read_text()[-3000:])
    tests = json.loads(ready)["ready"]
    if quick:
        # float32 forward, modules and edge sweeps; second derivatives in float64.
        tests = [t for t in tests if parse(t)["kind"] != "backward" and (
            t.endswith("_float32") or parse(t)["kind"] == "errors"
            or (parse(t)["kind"] == "gradgrad" and t.endswith("_float64")))]
    if select:
        tests = [t for t in tests if re.search(select, t)]
        wanted = min(workers, -(-len(tests) // TESTS_PER_EXTRA_WORKER))
        pool += [start_worker(stage, suite, env, logdir, i) for i in range(1, wanted)]
    for w in pool[1:]:
        if read_line(w, 600) is None:
            raise RuntimeError("a worker did not start:\n" + w.log.read_text()[-3000:])
    # The slow tests first, so that no worker is left with one at the end.
    tests.sort(key=lambda t: {"module": 0, "backward": 1, "gradgrad": 1}.get(parse(t)["kind"], 2))
    queue, run_ = list(reversed(tests)), Run()
    done = 0

    def send(w: Worker) -> None:
        w.test = queue.pop()
        w.deadline = time.monotonic() + timeout
        w.process.stdin.write(w.test + "\n")
        w.process.stdin.flush()

    def record(result: dict) -> None:
        nonlocal done
        result.update(parse(result["test"]))
        run_.results.append(result)
        done += 1
        if progress:
            progress(done, len(tests), result)

    for w in pool:
        if queue:
            send(w)
    with selectors.DefaultSelector() as sel:
        for w in pool:
            sel.register(w.process.stdout, selectors.EVENT_READ, w)
        while any(w.test for w in pool):
            events = sel.select(timeout=5)
            busy = {key.data.process.pid for key, _ in events}
            for w in list(pool):
                if w.test is None:
                    continue
                timed_out = w.process.pid not in busy and time.monotonic() > w.deadline
                if w.process.pid not in busy and not timed_out:
                    continue
                line = None if timed_out else w.process.stdout.readline()
                if line:
                    result = json.loads(line)
                    w.test = None
                    record(result)
                    if queue:
                        send(w)
                    continue
                # Died or hung: the test it was running is the crash; a new worker goes on.
                record({"test": w.test, "status": "crash", "reason": crash_reason(w, timed_out, timeout),
                        "seconds": None})
                sel.unregister(w.process.stdout)
                pool.remove(w)
                if queue:
                    fresh = start_worker(stage, suite, env, logdir, len(run_.results) + 100)
                    if read_line(fresh, 600) is None:
                        raise RuntimeError("a replacement worker did not start")
                    pool.append(fresh)
                    sel.register(fresh.process.stdout, selectors.EVENT_READ, fresh)
                    send(fresh)
    for w in pool:
        w.process.stdin.close()
        w.process.wait()
    shutil.rmtree(logdir, ignore_errors=True)  # what a crash left in a log is in its result
    run_.seconds = time.perf_counter() - started
    return run_


# ---- what a run says ----

# forward, backward and module run OpInfo's and ModuleInfo's samples as they are;
# the edge sweeps change them (extremal values, an emptied dimension, channels-last
# or non-contiguous inputs, out= tensors), go one derivative further (gradgrad),
# or run OpInfo's error inputs (errors).
KINDS = ("forward", "backward", "module", "extremal", "empty", "layout", "noncontiguous", "out",
         "errors", "gradgrad")
JUDGED = ("pass", "close", "mismatch", "error", "crash", "xfail", "xpass", "harness")


def summary(results: list) -> dict:
    """Counts per kind, and the pass rate over the tests the CPU could run.

    A "close" result passes: it is within the tolerance PyTorch's own CPU-versus-CUDA
    comparison allows. Skipped tests and those the CPU cannot run are not judged.
    """
    out = {}
    for kind in KINDS:
        counts = Counter(r["status"] for r in results if r["kind"] == kind)
        judged = sum(counts[s] for s in JUDGED)
        passed = counts["pass"] + counts["close"]
        out[kind] = {"counts": dict(counts), "judged": judged,
                     "pass_rate": passed / judged if judged else None,
                     "exact_rate": counts["pass"] / judged if judged else None}
    return out


def describe(run_: Run) -> str:
    lines = []
    for kind, s in summary(run_.results).items():
        if not s["judged"] and not s["counts"]:
            continue
        rate = f"{100 * s['pass_rate']:.2f} %" if s["pass_rate"] is not None else "n/a"
        counts = ", ".join(f"{k} {v}" for k, v in sorted(s["counts"].items()))
        exact = f", {100 * s['exact_rate']:.2f} % within PyTorch's own tolerances" if s["judged"] else ""
        lines.append(textwrap.fill(f"{kind:>13}: {rate} pass of {s['judged']} judged{exact} ({counts})",
                                   88, subsequent_indent=" " * 15))
    lines.append(f"{len(run_.results)} tests in {run_.seconds:.0f} s")
    return "\n".join(lines)


def save(run_: Run, path: Path, **meta) -> None:
    import datetime

    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"meta": {"torch": torch.__version__, "seconds": round(run_.seconds, 1),
                     "date": datetime.date.today().isoformat(), "cores": os.cpu_count(), **meta},
            "summary": summary(run_.results), "results": run_.results}
    path.write_text(json.dumps(data, indent=1))


# A whole run, kept with the book (`--publish`): the conformance page and chapter 14
# show it where `nox -s conformance` has not run (a whole run takes a quarter of an
# hour on two cores, too long for every site build). Compact: one row per test.
PUBLISHED = ROOT / "docs" / "_generated" / "conformance-run.json.gz"
_KEEP_REASON = ("close", "mismatch", "error", "crash", "harness", "xfail", "xpass")


def publish(source: Path, target: Path = PUBLISHED) -> dict:
    import gzip

    data = load(source)
    meta = data["meta"]
    if meta.get("quick") or meta.get("select"):
        raise SystemExit(f"{source} is not a whole run: publish what `nox -s conformance` wrote")
    if "date" not in meta:  # a run saved before save() recorded its date
        meta["date"] = time.strftime("%Y-%m-%d", time.gmtime(source.stat().st_mtime))
    rows = [[r["test"], r["status"],
             r["reason"] if r["status"] in _KEEP_REASON else r["reason"][:100], r["seconds"]]
            for r in sorted(data["results"], key=lambda r: r["test"])]
    text = json.dumps({"meta": meta, "rows": rows}, separators=(",", ":"))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(gzip.compress(text.encode(), mtime=0))
    return load(target)


COLOURS = {"pass": "#4caf50", "close": "#a5d6a7", "mismatch": "#d32f2f", "error": "#ff9800",
           "crash": "#000000", "harness": "#7b1fa2", "xfail": "#ffeb3b", "xpass": "#e91e63",
           "cpu-unsupported": "#d9d9d9", "skipped": "#9e9e9e", "untested": "#ffffff"}


# The chapter that deals with an operator's family, for the results a reader will
# want to follow up: the first pattern (over OpInfo and ModuleInfo names) that
# matches. Anything else has no kernel of acme's and runs through chapter 2's
# fallback.
FAMILIES = (
    (r"sparse|nested|quantiz", 13),  # layouts acme refuses (layouts.cpp)
    (r"attention|Transformer", 13),  # attention.cpp
    (r"conv", 13),  # convolution.cpp
    (r"layer_norm|LayerNorm", 23),  # training_kernels.cpp
    (r"batch_norm|BatchNorm|instance_norm|silu|mish|pixel_(un)?shuffle|pad|"
     r"linear_cross_entropy|^mode$", 14),  # the fixes of the conformance run
    (r"^(normal|uniform|rand|bernoulli|multinomial|exponential|geometric|cauchy|poisson|"
     r"log_normal)|dropout|RReLU", 5),  # random_ops.cpp
)


def chapter_of(name: str) -> dict:
    """The manifest's entry (number, slug, title) for an operator or module name."""
    number = next((n for pattern, n in FAMILIES if re.search(pattern, name, re.IGNORECASE)), 2)
    return next(c for c in CHAPTERS if c["number"] == number)


# The heatmap's bottom rows: one per edge sweep, the worst of an op's results in it.
SWEEPS = ("extremal", "empty", "layout", "noncontiguous", "out", "errors", "gradgrad")
WORST_FIRST = ("crash", "mismatch", "harness", "error", "xpass", "xfail", "close", "pass",
               "cpu-unsupported", "skipped")


def heatmap(results: list, strips: int = 4):
    """Ops × (forward and backward per dtype, then one row per edge sweep), one
    coloured cell per test; returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    names = sorted({r["name"] for r in results if r["kind"] in ("forward", "backward")})
    # Integers and bool have no gradients: backward rows only for the others.
    rows = ([("forward", d) for d in DTYPE_ORDER]
            + [("backward", d) for d in DTYPE_ORDER if d in ("float32", "float64", "float16", "bfloat16",
                                                              "complex64")]
            + [(k, "*") for k in SWEEPS])
    order = list(COLOURS)
    cell = {}
    for r in results:
        if r["status"] not in COLOURS:
            continue
        if r["kind"] in SWEEPS:
            key = (r["name"], r["kind"], "*")
            if key in cell and WORST_FIRST.index(order[cell[key]]) <= WORST_FIRST.index(r["status"]):
                continue
        else:
            key = (r["name"], r["kind"], r["dtype"])
        cell[key] = order.index(r["status"])
    per_strip = -(-len(names) // strips) if names else 1
    named = per_strip <= 40  # few enough ops per strip to name each one
    label_room = 0.065 * max(map(len, names), default=0) if named else 0.0
    fig, axes = plt.subplots(strips, 1, figsize=(8.6, (1.75 + label_room) * strips + 0.8),
                             squeeze=False)
    for i, ax in enumerate(axes[:, 0]):
        chunk = names[i * per_strip:(i + 1) * per_strip]
        grid = [[cell.get((n, k, d), order.index("untested")) for n in chunk] for k, d in rows]
        ax.imshow(grid or [[0]], aspect="auto", interpolation="nearest",
                  cmap=ListedColormap(list(COLOURS.values())), vmin=0, vmax=len(order) - 1)
        ax.set_yticks(range(len(rows)), [f"{k[:3]} {d}" if d != "*" else k for k, d in rows],
                      fontsize=4.5)
        if named:
            ax.set_xticks(range(len(chunk)), chunk, fontsize=6, rotation=90)
        else:  # the first and the last of the strip
            ax.set_xticks([0, len(chunk) - 1], [chunk[0], chunk[-1]], fontsize=5)
        for line in (len(DTYPE_ORDER), len(rows) - len(SWEEPS)):  # forward | backward | sweeps
            ax.axhline(line - 0.5, color="white", linewidth=1)
    shown = {r["status"] for r in results} | {"untested"}
    fig.legend(handles=[Patch(facecolor=c, edgecolor="#bbbbbb", label=s)
                        for s, c in COLOURS.items() if s in shown],
               loc="upper center", ncol=6, fontsize=6, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    return fig


def load(path: Path | None = None) -> dict:
    """A run's meta, summary and results, from a run's file or the published one."""
    path = path or BUILD / "conformance" / "results.json"
    if path.suffix != ".gz":
        return json.loads(path.read_text())
    import gzip

    data = json.loads(gzip.decompress(path.read_bytes()))
    results = [{"test": t, "status": st, "reason": why, "seconds": sec, **parse(t)}
               for t, st, why, sec in data["rows"]]
    return {"meta": data["meta"], "summary": summary(results), "results": results}


def latest() -> tuple[dict, str]:
    """The run to show, and where it comes from: this machine's whole run if it
    made one (`nox -s conformance`), else the one published with the book."""
    local = BUILD / "conformance" / "results.json"
    if local.exists():
        return load(local), "this machine's run"
    return load(PUBLISHED), "the run published with the book"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=LAST)
    parser.add_argument("--suite", type=Path, default=SUITE, help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one sample per op, float32 forward")
    parser.add_argument("-k", dest="select", help="only tests whose name matches this regular expression")
    parser.add_argument("--out", type=Path, help="results file (default _build/conformance/results.json)")
    parser.add_argument("--publish", action="store_true",
                        help=f"keep the last whole run with the book ({PUBLISHED.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.stage, args.suite)
        return 0
    if args.publish:
        published = publish(args.out or BUILD / "conformance" / "results.json")
        print(f"{len(published['results'])} results written to {PUBLISHED.relative_to(ROOT)}")
        return 0

    def progress(done, total, result):
        if result["status"] not in ("pass", "cpu-unsupported", "skipped"):
            print(f"[{done}/{total}] {result['status']}: {result['test']}: {result['reason'][:300]}",
                  flush=True)
        elif done % 250 == 0:
            print(f"[{done}/{total}]", flush=True)

    run_ = run(args.stage, args.workers, args.select, args.quick, progress)
    # Only a whole run replaces results.json, which the site's page shows.
    name = "selection.json" if args.select else "quick.json" if args.quick else "results.json"
    out = args.out or BUILD / "conformance" / name
    save(run_, out, stage=args.stage, quick=args.quick, select=args.select,
         command="python " + " ".join(["tools/conformance.py", *(argv or sys.argv[1:])]))
    print(describe(run_))
    print(f"written to {out}")
    bad = [r for r in run_.results if r["status"] in ("mismatch", "crash", "xpass", "harness")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
