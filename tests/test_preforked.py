"""tests/preforked.py: a forked child behaves as `python -c` would, or a new
interpreter is started when the child could tell the difference."""

import os
import subprocess
import sys
import time

import pytest

from conftest import LAST, stage_env
from tools import preforked

PROBE = """
import os, sys
print("torch already imported:", "torch" in sys.modules)
print("argv:", sys.argv)
print("cwd:", os.getcwd())
print("path:", sys.path[:2])
print("ACME_DEVICE_COUNT:", os.environ.get("ACME_DEVICE_COUNT"))
import torch, torch_acme, warnings
print("device count:", torch.acme.device_count())
warnings.warn("shown?")
"""


def test_child_gets_the_stage_environment_folder_and_arguments(tmp_path):
    env = stage_env(LAST, ACME_DEVICE_COUNT="3")
    done = preforked.python(["-c", PROBE, "x", "y"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "torch already imported: True"  # forked: the server imported it
    assert lines[1] == "argv: ['-c', 'x', 'y']"
    assert lines[2] == f"cwd: {tmp_path}"
    assert lines[3] == f"path: ['', '{env['PYTHONPATH']}']"
    assert lines[4:] == ["ACME_DEVICE_COUNT: 3", "device count: 3"]
    assert "UserWarning: shown?" in done.stderr
    quiet = preforked.python(["-c", PROBE], stage_env(LAST, PYTHONWARNINGS="ignore"), tmp_path)
    assert quiet.returncode == 0 and "shown?" not in quiet.stderr, quiet.stderr


def test_failures_are_reported_as_python_reports_them(tmp_path):
    raised = preforked.python(["-c", "x = 1\nraise ValueError('bad value')"], stage_env(LAST))
    assert raised.returncode == 1
    assert raised.stderr == ('Traceback (most recent call last):\n'
                             '  File "<string>", line 2, in <module>\n'
                             'ValueError: bad value\n')
    exited = preforked.python(["-c", "import sys; print('out'); sys.exit(3)"], stage_env(LAST))
    assert (exited.returncode, exited.stdout) == (3, "out\n")
    crashed = preforked.python(["-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"],
                               stage_env(LAST))
    assert crashed.returncode == -11
    with pytest.raises(subprocess.TimeoutExpired):
        preforked.python(["-c", "import time; print('started', flush=True); time.sleep(60)"],
                         stage_env(LAST), timeout=2)
    after = preforked.python(["-c", "print('still serving')"], stage_env(LAST))
    assert after.stdout == "still serving\n"


def test_a_script_runs_as_main_beside_its_folder(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text("import sys\nif __name__ == '__main__':\n    print(__file__, sys.path[0])\n")
    done = preforked.python([str(script)], stage_env(LAST))
    assert done.stdout == f"{script} {tmp_path}\n", done.stderr


def test_what_torch_reads_at_import_gets_a_new_interpreter():
    for extra in ({"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}, {"TORCH_LOGS": "dynamo"},
                  {"PYTHONWARNINGS": "error::DeprecationWarning"}):
        env = stage_env(LAST, **extra)
        assert not preforked.forkable(["-c", "pass"], env), extra
        done = preforked.python(["-c", "import sys; print('torch' in sys.modules)"], env)
        assert done.stdout == "False\n", (extra, done.stderr)
    assert not preforked.forkable(["-m", "pip"], stage_env(LAST))
    assert preforked.forkable(["-c", "pass"], dict(os.environ, PYTHONPATH="x",
                                                   TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert sys.executable == preforked.python(
        ["-c", "import sys; print(sys.executable)"], stage_env(LAST)).stdout.strip()


OWNER = """
import os, signal, sys
sys.path.insert(0, {tools!r})
import preforked
done = preforked.python(["-c", "print('hello')"], preforked.server_env())
assert done.stdout == "hello\\n", done
[server] = preforked._servers.values()
print(server.folder, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no atexit: as a notebook's kernel is shut down
"""


def test_a_server_whose_owner_dies_removes_its_folder():
    tools = os.path.dirname(preforked.__file__)
    owner = subprocess.run([sys.executable, "-c", OWNER.format(tools=tools)],
                           capture_output=True, text=True, timeout=300)
    assert owner.returncode == -9, owner.stderr
    folder = owner.stdout.strip()
    assert folder and "acme-preforked-" in folder, owner.stdout
    # The server reads the end of its input when its owner dies, then removes the folder.
    for _ in range(600):
        if not os.path.exists(folder):
            break
        time.sleep(0.1)
    assert not os.path.exists(folder)
