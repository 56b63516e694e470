"""Chapter 21: torch.distributed on acme, with real processes.

Each test starts every rank as a process of its own (distributed_workers.py)
against the last stage, and bounds it with a timeout: a hang fails the test,
it never stalls the suite. The workers compare every result with the CPU's;
these tests check what they report: the values, DDP and FSDP2 against one
process on the whole batches, and the message each fault gives every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import LAST, ROOT, stage_built, stage_path
from tools.rendezvous import hosted_stores

if LAST < 21:
    pytest.skip("the last stage predates chapter 21", allow_module_level=True)

from torch_acme.distributed import _WHOLE_GROUP as WHOLE_GROUP  # noqa: E402  (PyTorch 2.13)

WORKERS = Path(__file__).with_name("distributed_workers.py")
DEVICE = "acme"


def environment(tmp_path: Path) -> dict:
    if not stage_built(LAST):
        pytest.fail(f"stage {LAST} is not built: run tools/build_stages.py")
    return dict(os.environ, PYTHONPATH=str(stage_path(LAST)), TORCH_DEVICE_BACKEND_AUTOLOAD="0",
                DIST_TMP=str(tmp_path), PYTHONUNBUFFERED="1")


def run_ranks(scenario: str, tmp_path: Path, world: int = 2, timeout: float = 120,
              **env: str) -> list[dict]:
    """Starts every rank; returns each one's exit code, RESULT and output."""
    # Stores on ports the OS chose, hosted here (init_forms makes three groups).
    with hosted_stores(3 if scenario == "init_forms" else 1) as (ports, store_env):
        return _run_ranks(scenario, tmp_path, world, timeout, ",".join(map(str, ports)),
                          {**environment(tmp_path), **store_env, **env})


def _run_ranks(scenario, tmp_path, world, timeout, ports, env) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, str(WORKERS), scenario, str(r), str(world), ports],
                              env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    ranks = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            ranks.append({"code": p.returncode, "output": out,
                          "result": json.loads(lines[-1][7:]) if lines else None})
    finally:
        for p in procs:
            p.kill()
    return ranks


def succeeded(ranks: list[dict]) -> list[dict]:
    for r, rank in enumerate(ranks):
        assert rank["code"] == 0 and rank["result"] is not None, \
            f"rank {r} failed:\n{rank['output'][-4000:]}"
    return [rank["result"] for rank in ranks]


def test_every_collective_matches_the_cpu(tmp_path):
    # all_reduce in 10 dtypes with every ReduceOp each allows, PREMUL_SUM,
    # messages larger than the staging buffers, broadcast, all_gather (list and
    # tensor), reduce_scatter, all_to_all (even and uneven), send/recv,
    # reduce/gather/scatter, objects, async handles and futures, stream order,
    # barrier.
    results = succeeded(run_ranks("collectives", tmp_path))
    for result in results:
        assert result["checks"] == 170  # how many cases ran; each compared itself
        # Queued behind 0.2 s of work on its stream, the collective had not run
        # when the call returned: it is asynchronous, ordered by the stream.
        assert result["async_returned_before_done"]


def test_three_ranks(tmp_path):
    # Shares of a third, a rank in the middle of the ring, uneven all_to_all.
    results = succeeded(run_ranks("collectives", tmp_path, world=3, timeout=240,
                                  ACME_DEVICE_COUNT="3"))
    assert [r["checks"] for r in results] == [170] * 3


def test_each_way_to_init_gives_acme_tensors_acme_and_gloo_when_asked(tmp_path):
    results = succeeded(run_ranks("init_forms", tmp_path))
    both = f"cpu:gloo,{DEVICE}:{DEVICE}"
    for result in results:
        assert set(result) == {"None", DEVICE, both}
        for form, seen in result.items():
            assert seen["acme"] == DEVICE and seen["default_for_device"] == DEVICE
            assert seen["sums"][0] == [2.0, 2.0]
            if form == both or WHOLE_GROUP:
                assert seen["cpu"] == "gloo" and seen["sums"][1] == [2.0, 2.0]
            else:  # as init_process_group() gives CUDA tensors NCCL and CPU tensors nothing
                assert seen["cpu"] is None
                assert seen["sums"][1] == "No backend type associated with device type cpu"


def test_split_group_makes_a_child_in_the_order_asked(tmp_path):
    results = succeeded(run_ranks("split", tmp_path))
    if WHOLE_GROUP:  # on PyTorch 2.13 the group asked to bind to a device is not the one made
        for r in results:
            assert r["error"] == ("No device associated with the default pg, not safe to split "
                                  "any process groups")
        return
    assert [r["child_rank"] for r in results] == [1, 0]
    for r in results:
        assert r["broadcast"] == [1.0, 1.0]  # from global rank 1, the child's rank 0
        assert r["sum"] == 3.0 and r["backend"] == DEVICE


def test_a_collective_waits_on_its_own_stream_and_keeps_its_inputs(tmp_path):
    rank0, rank1 = succeeded(run_ranks("overlap", tmp_path))
    # Rank 1 came a second late; rank 0's compute stream had run its next op
    # (and synchronized) while the gather was still waiting for it.
    assert rank0["compute_done_while_pending"]
    # The input rank 0 dropped at once was not overwritten by the next tensor.
    assert rank0["gathered"] == rank1["gathered"] == [[5.0], [7.0]]


def test_debug_detail_wraps_acmes_backend(tmp_path):
    results = succeeded(run_ranks("detail", tmp_path, TORCH_DISTRIBUTED_DEBUG="DETAIL"))
    for r, result in enumerate(results):
        if WHOLE_GROUP:  # PyTorch 2.13: c10d takes a whole group as it is
            assert result["backend"] == "Backend"
            assert result["message"].startswith("acme backend: all_reduce failed:")
            continue
        # c10d's wrapper compares the ranks' shapes over gloo first, and
        # names both, before acme's own check would.
        assert result["backend"] == "_ProcessGroupWrapper", result
        assert result["error"] == "RuntimeError", result
        assert "Detected mismatch between collectives on ranks" in result["message"]


def test_ddp_equals_one_process_on_the_whole_batches(tmp_path):
    result = succeeded(run_ranks("ddp", tmp_path))[0]
    assert result["moved"] > 0.1  # the parameters did train
    assert result[DEVICE] < 1e-5 and result["cpu"] < 1e-5


def test_ddp_script_under_torchrun(tmp_path):
    env = environment(tmp_path)
    script = str(ROOT / "tools" / "ddp_train.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2"]
    done = subprocess.run([*torchrun, script, "--save", str(tmp_path / "ddp.pt")], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    done = subprocess.run([sys.executable, script, "--world", "1", "--save",
                           str(tmp_path / "one.pt")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    ddp, one = torch.load(tmp_path / "ddp.pt"), torch.load(tmp_path / "one.pt")
    assert set(ddp) == set(one)
    for name in one:
        torch.testing.assert_close(ddp[name], one[name], rtol=1e-5, atol=1e-6)


def test_fsdp2_equals_one_process(tmp_path):
    result = succeeded(run_ranks("fsdp", tmp_path))[0]
    assert result["cpu"] < 1e-5


def test_tensor_parallel_attention_and_custom_ops_equal_one_process(tmp_path):
    # DTensor refuses an operator without a sharding strategy; acme registers
    # strategies for the operators it adds or routes to (torch_acme/sharding.py).
    for result in succeeded(run_ranks("tensor_parallel", tmp_path)):
        assert result["forward"] < 1e-5 and result["no_grad"] < 1e-5, result
        assert result["gradients"] < 1e-4, result


def test_a_rank_that_exits_fails_the_others_at_once(tmp_path):
    rank0, rank1 = run_ranks("rank_exits", tmp_path)
    assert rank1["code"] == 3
    result = rank0["result"]
    assert result["error"] == "DistBackendError", rank0["output"][-3000:]
    assert "all_reduce #2: rank 1 (pid " in result["message"]
    assert "exited; rank 0 was waiting for it" in result["message"]
    # Seen from its lock, not from the 20 s timeout.
    assert result["seconds"] < 10
    # The communicator stays failed, with the first reason.
    assert result["after"]["error"] == "DistBackendError"
    assert result["after"]["message"] == result["message"]


def test_a_rank_that_never_comes_times_out(tmp_path):
    rank0, rank1 = run_ranks("rank_hangs", tmp_path)
    assert rank1["code"] == 0
    result = rank0["result"]
    assert result["error"] == "DistBackendError", rank0["output"][-3000:]
    assert result["message"] == ("acme backend: all_reduce failed: all_reduce #2: timed out "
                                 "after 3.0 s; rank 0 was waiting for rank 1")
    assert 3.0 <= result["seconds"] < 8.0


def test_ranks_that_disagree_all_get_the_same_error(tmp_path):
    results = succeeded(run_ranks("sizes_differ", tmp_path))
    for r, result in enumerate(results):
        assert result["all_reduce"]["error"] == "DistBackendError"
        assert result["all_reduce"]["message"] == (
            "acme backend: all_reduce failed: all_reduce #1: the ranks disagree: rank 0 called "
            "all_reduce of 10 float32 (sum), rank 1 called all_reduce of 12 float32 (sum)")
        assert result["all_to_all"]["message"].endswith(
            "all_to_all #1: rank 1 expects 2 elements from rank 0, which sends it 1")
        mismatch = "recv from rank 0: rank 1 expects 3 int32 from rank 0, which sends 3 float32"
        # The receiver sees it; the sender's send had completed, so its next
        # call on that communicator reports it.
        if r == 1:
            assert result["send/recv"]["message"].endswith(mismatch)
        else:
            assert result["send/recv"]["error"] is None
        assert result["next"]["error"] == "DistBackendError"
        assert result["next"]["message"].endswith(mismatch)


def test_a_tensor_on_the_wrong_device(tmp_path):
    rank0, rank1 = succeeded(run_ranks("wrong_device", tmp_path))
    assert rank0["error"] == "ValueError"
    assert rank0["message"] == (
        "acme backend: the tensor is on acme:1, but rank 0 of this group uses acme:0 (one "
        "device per rank: call torch.acme.set_device(rank) before the first collective)")
    assert rank1["error"] == "DistBackendError"
    assert rank1["message"] == ("acme backend: all_reduce failed: all_reduce #2: timed out "
                                "after 3.0 s; rank 1 was waiting for rank 0")
