"""Running tools/train.py as its users run it (chapter 23, its tests, the benchmark).

The script is never imported and never edited: each run is `python train.py
...` (or torchrun) in a fresh process whose Python sees a stage as
`pip install` leaves it, so `import torch` autoloads acme and the script finds
it through torch.accelerator alone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SCRIPT = Path(__file__).with_name("train.py")
FALLBACK = re.compile(r"(\S+) has no \S+ kernel and runs on the CPU")


def read_metrics(path: Path) -> list[dict]:
    """The metrics file's complete lines (a killed run may leave half a line)."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def installed(build: Path, number: int) -> Path:
    """A site folder holding stage `number` of the build folder `build` as
    `pip install` leaves it (BUILD/installed/stage-NN): made once, reused after."""
    from chapter_support import installed_view

    name = f"stage-{number:02d}"
    dest = build / "installed" / name
    if not any(dest.glob("*.dist-info")):
        installed_view(build / "stages" / name, build / "packages" / name / "torch_acme", dest)
    return dest


def _environment(site: Path, **env: str) -> dict[str, str]:
    """A user's Python with the stage installed: `import torch` autoloads it."""
    return {**os.environ, "PYTHONPATH": str(site), "TORCH_DEVICE_BACKEND_AUTOLOAD": "1", **env}


@dataclass
class Run:
    returncode: int
    stderr: str
    metrics: list[dict]

    @property
    def losses(self) -> list[float]:
        return [row["loss"] for row in self.metrics]

    @property
    def fallback_ops(self) -> list[str]:
        """The operators the CPU fallback warned about, in order."""
        return FALLBACK.findall(self.stderr)

    def check(self) -> "Run":
        assert self.returncode == 0, self.stderr[-3000:]
        return self


def train(site: Path, folder: Path, *args: str, ranks: int = 1, timeout: float = 600,
          **env: str) -> Run:
    """Runs the script on `ranks` processes with `args`, in `folder`, with
    `site` on the path; the metrics file it writes is read back."""
    folder.mkdir(parents=True, exist_ok=True)
    metrics = folder / f"metrics-{len(list(folder.glob('metrics-*')))}.jsonl"
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={ranks}"] if ranks > 1 else [sys.executable])
    done = subprocess.run([*launcher, str(SCRIPT), *args, "--metrics", str(metrics)],
                          cwd=folder, capture_output=True, text=True, timeout=timeout,
                          env=_environment(site, **env))
    return Run(done.returncode, done.stderr, read_metrics(metrics))


def train_killed(site: Path, folder: Path, *args: str, after_epochs: int = 1,
                 timeout: float = 600) -> tuple[Run, Run]:
    """Starts a run with --checkpoint, kills it (SIGKILL) a few steps after its
    checkpoint of epoch `after_epochs` is written, then runs the same command
    again, which resumes. Both runs append to one metrics file.

    The kill takes the run's whole process group at once, DataLoader workers
    included, as a scheduler preempting a job does. Killing the trainer alone
    leaves a worker that was handing it a batch's file descriptor to print a
    ConnectionResetError traceback from multiprocessing's resource sharer."""
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint, metrics = folder / "train.ckpt", folder / "metrics-killed.jsonl"
    command = [sys.executable, str(SCRIPT), *args, "--checkpoint", str(checkpoint),
               "--metrics", str(metrics)]
    env = _environment(site)
    first = subprocess.Popen(command, cwd=folder, env=env, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)

    def epochs_logged() -> int:
        return len({row["epoch"] for row in read_metrics(metrics)})

    deadline = time.monotonic() + timeout
    # Past the checkpoint: into the next epoch, by at least one step.
    while epochs_logged() <= after_epochs or not checkpoint.exists():
        assert first.poll() is None, f"the run ended before it was killed:\n{first.stderr.read()}"
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGKILL)
    _, first_err = first.communicate()
    killed_rows = read_metrics(metrics)
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=timeout)
    rows = read_metrics(metrics)
    return (Run(first.returncode, first_err, killed_rows),
            Run(done.returncode, done.stderr, rows[len(killed_rows):]))


def steps_per_second(run: Run) -> float:
    """Training speed over the run's last epoch (compilation and warm-up are over)."""
    last = max(row["epoch"] for row in run.metrics)
    times = [row["time"] for row in run.metrics if row["epoch"] == last]
    return (len(times) - 1) / (times[-1] - times[0])
