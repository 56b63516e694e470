"""New Python processes for the tests and the chapters, without an `import torch` in each.

Many tests, and the chapters' `at_stage` cells, run a snippet against one stage
in a new process (one PrivateUse1 backend per process). Importing PyTorch's
CUDA wheel costs each of them about 2 CPU-seconds, more than most snippets
take. `python()` runs the snippet in a child forked from a server that has
imported torch and nothing of the book: the child takes the environment,
working folder and sys.path it was given, then runs the snippet as
`python -c` (or `python script.py`) would, and exits through Python's own
shutdown. A DataLoader worker starts the same way.

Only what cannot tell the difference is forked. The environment may differ
from the server's in PYTHONPATH, ACME_* variables and a one-word
PYTHONWARNINGS; anything else (TORCH_DEVICE_BACKEND_AUTOLOAD=1, TORCH_LOGS,
...), which PyTorch or Python read when they start, gets a new interpreter,
as do tests whose subject is `import torch` itself (they call subprocess) or
the interpreter's exit (they pass fresh=True: an autograd thread's race with
Python's shutdown, chapter 3, never showed in a forked child).
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

VARYING = ("PYTHONPATH", "PYTEST_CURRENT_TEST", "PYTHONWARNINGS")
WARNING_ACTIONS = ("", "ignore", "error", "default", "always")

SERVER = r"""
import importlib, json, os, shutil, sys, types, warnings
import torch  # what every child would import first: the cost paid once
folder = sys.argv[1]  # the children's output files
for name in sys.argv[2:]:  # and what the caller said all its children import
    importlib.import_module(name)

reply = sys.stdout
print(json.dumps({"ready": os.getpid()}), file=reply, flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid:
        print(json.dumps({"pid": pid}), file=reply, flush=True)
        status = os.waitpid(pid, 0)[1]
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), file=reply, flush=True)
        continue
    # The child. Its own process group, so a timeout stops what it starts too.
    os.setsid()
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, job["stdout"], os.O_WRONLY | os.O_TRUNC),
                            (2, job["stderr"], os.O_WRONLY | os.O_TRUNC)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    script = job["script"]
    sys.path[0] = os.path.dirname(os.path.abspath(script)) if script else ""
    sys.path[1:1] = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    if job["env"].get("PYTHONWARNINGS"):
        warnings.simplefilter(job["env"]["PYTHONWARNINGS"])
    sys.argv = job["argv"]
    main = types.ModuleType("__main__")
    if script:
        main.__file__ = script
    sys.modules["__main__"] = main
    try:
        exec(compile(job["code"], script or "<string>", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as error:
        # Reported as the interpreter reports an uncaught exception, without this frame.
        error = error.with_traceback(error.__traceback__.tb_next)
        sys.excepthook(type(error), error, error.__traceback__)
        sys.exit(1)
    sys.exit(0)
# Input ended: the owner stopped, or died without its atexit handlers (a
# notebook's kernel killed at shutdown). The folder goes with the server.
shutil.rmtree(folder, ignore_errors=True)
"""


def may_vary(name: str) -> bool:
    """What a child's environment may set apart from the server's."""
    return name in VARYING or name.startswith("ACME_")


def server_env() -> dict[str, str]:
    # Without what may vary: a test that sets ACME_* here does not restart the server.
    env = {k: v for k, v in os.environ.items() if not may_vary(k)}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    return env


class Server:
    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        self.env = server_env()
        self.folder = Path(tempfile.mkdtemp(prefix="acme-preforked-"))
        self.process = subprocess.Popen([sys.executable, "-c", SERVER, str(self.folder), *preload],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env,
                                        text=True, bufsize=1)
        if self.read(300) is None:
            raise RuntimeError("the process server did not start")

    def alive(self) -> bool:
        return self.process.poll() is None

    def read(self, timeout: float | None) -> dict | None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.process.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                return None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the process server died")
        return json.loads(line)

    def run(self, args: list[str], code: str, script: str | None, env: dict[str, str],
            cwd: str, timeout: float) -> subprocess.CompletedProcess:
        out, err = self.folder / "stdout", self.folder / "stderr"
        out.write_bytes(b"")
        err.write_bytes(b"")
        job = {"code": code, "script": script, "argv": args, "env": env, "cwd": cwd,
               "stdout": str(out), "stderr": str(err)}
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        pid = self.read(60)["pid"]
        answer = self.read(timeout)
        if answer is None:
            os.killpg(pid, signal.SIGKILL)
            self.read(60)
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout,
                                            out.read_text(), err.read_text())
        return subprocess.CompletedProcess([sys.executable, *args], answer["status"],
                                           out.read_text(), err.read_text())

    def stop(self) -> None:
        if self.alive():
            self.process.stdin.close()
            self.process.wait(60)
        shutil.rmtree(self.folder, ignore_errors=True)


_servers: dict[tuple[str, ...], Server] = {}
_lock = threading.Lock()


def forkable(args: list[str], env: dict[str, str]) -> bool:
    if not args or not (args[0] == "-c" and len(args) > 1 or args[0].endswith(".py")):
        return False
    base = server_env()
    differ = {k for k in set(env) | set(base) if env.get(k) != base.get(k)}
    return (all(may_vary(k) for k in differ)
            and env.get("PYTHONWARNINGS", "") in WARNING_ACTIONS)


def python(args: list[str], env: dict[str, str], cwd: str | Path | None = None,
           timeout: float = 300, fresh: bool = False,
           preload: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True,
    text=True, timeout=timeout)`, forked from the server when nothing can tell.
    `fresh=True` always starts a new interpreter: for what happens at exit, which
    a forked child does not repeat (chapter 3's exit race never shows in one).
    `preload`: PyTorch modules every child of this caller imports (torch._dynamo
    costs about a second): a server of their own imports them first."""
    cwd = str(cwd or os.getcwd())
    if fresh or not forkable(args, env):
        return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True,
                              text=True, timeout=timeout)
    with _lock:
        server = _servers.get(preload)
        if server is None or not server.alive() or server.env != server_env():
            if server is not None:
                server.stop()
            server = _servers[preload] = Server(preload)
            atexit.register(server.stop)
        if args[0] == "-c":
            code, script, argv = args[1], None, ["-c", *args[2:]]
        else:
            code, script, argv = Path(args[0]).read_text(), args[0], list(args)
        return server.run(argv, code, script, env, cwd, timeout)
