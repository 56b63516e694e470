"""Chapter 3: a script that ends right after backward() on acme exits cleanly.

Upstream PyTorch can abort at exit when an autograd device thread frees the
last Python tensor of a finished graph during interpreter finalization; acme
drains its device threads at exit (csrc/aten/autograd.cpp). Before that fix,
this script aborted in about 9 runs of 10 on this machine.
"""

from conftest import built_stages, run_in_stage

SCRIPT = """
import torch, torch_acme
device = torch._C._get_privateuse1_backend_name()
x = torch.tensor([0.5, -1.0], device=device, requires_grad=True)
(torch.tanh(x) * 2).sum().backward()
"""


def test_backward_then_exit_is_clean(pytestconfig):
    stage = built_stages(pytestconfig)[-1]
    if stage < 3:  # no autograd on acme before chapter 3: nothing to check there
        return
    for attempt in range(8):
        proc = run_in_stage(stage, SCRIPT, PYTHONWARNINGS="ignore")
        assert proc.returncode == 0, f"run {attempt}: exit {proc.returncode}\n{proc.stderr}"
        assert "terminate called" not in proc.stderr, proc.stderr
