"""Chapter 2: what the CPU fallback copies, and where its results go.

Runs on the last stage, where these ops still have no acme kernel (each test
first checks that the dispatcher really sends them to the fallback).
"""

import warnings

import torch
import torch_acme  # noqa: F401 - registers the backend
from torch.profiler import ProfilerActivity, profile

from conftest import dispatch_row

DEVICE = torch._C._get_privateuse1_backend_name()


def route(op: str) -> str:
    """What the dispatch table runs for `op` on PrivateUse1, as the table names it."""
    row = dispatch_row(op)
    return row.rsplit("[", 1)[1].rstrip("]") if row else "nothing"


def crossings(call) -> list[tuple[str, int]]:
    """(direction, elements) of each copy between the device and the host during call()."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            call()
    seen, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop(0)
        todo[:0] = event.children
        if event.name in ("aten::_copy_from", "aten::_copy_from_and_resize"):
            source, destination = [i for i in event.extra_fields.inputs
                                   if isinstance(i, torch._C._profiler._TensorMetadata)][:2]
            if source.device != destination.device:
                seen.append(("host" if destination.device.type == "cpu" else "device",
                             torch.Size(source.sizes).numel()))
    return seen


def test_a_structured_op_falls_back_as_out_and_copies_its_fresh_output_both_ways():
    assert route("aten::sin") == "default backend kernel"
    assert route("aten::sin.out") == "backend fallback"
    host = torch.randn(1000)
    x = host.to(DEVICE)
    results = []
    copies = crossings(lambda: results.append(torch.sin(x)))
    assert torch.allclose(results[0].cpu(), torch.sin(host))
    # The input and the result made on the device go to the host; the result comes back.
    assert copies == [("host", 1000), ("host", 1000), ("device", 1000)], copies


def test_an_op_that_is_not_structured_copies_its_input_and_result_only():
    assert route("aten::flip") == "backend fallback"
    host = torch.randn(100, 4)
    x = host.to(DEVICE)
    results = []
    copies = crossings(lambda: results.append(torch.flip(x, (0,))))
    assert torch.equal(results[0].cpu(), torch.flip(host, (0,)))
    assert copies == [("host", 400), ("device", 400)], copies


def test_a_device_argument_wins_wherever_it_sits():
    lib = torch.library.Library("fallback_test", "DEF")
    try:
        lib.define("scaled_to(Tensor x, Device device) -> Tensor")
        lib.define("scaled_on(Device device, Tensor x) -> Tensor")
        lib.impl("scaled_to", lambda x, device: (2 * x).to(device), "CPU")
        lib.impl("scaled_on", lambda device, x: (2 * x).to(device), "CPU")
        host = torch.arange(3.0)
        x = host.to(DEVICE)
        for device in (torch.device("cpu"), x.device):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the fallback's once-per-op warning
                after = torch.ops.fallback_test.scaled_to(x, device)
                before = torch.ops.fallback_test.scaled_on(device, x)
            for result in (after, before):
                assert result.device == device
                assert torch.equal(result.cpu(), 2 * host)
    finally:
        del lib
