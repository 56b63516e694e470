"""Chapter 1: copies between acme and the CPU, for layouts the chapters only sample."""

import pytest
import torch
import torch_acme

DEVICE = torch._C._get_privateuse1_backend_name()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_lazy_conjugate_views_copy_without_recursion(dtype):
    # Used to overflow the stack: the Conjugate fallback's clone called
    # _copy_from, which went through the Conjugate fallback again.
    c = torch.tensor([1 + 2j, 3 - 1j, -0.5 + 4j], dtype=dtype)
    lazy = c.to(DEVICE).conj()
    assert torch.equal(lazy.cpu(), c.conj())
    assert torch.equal(lazy.clone().cpu(), c.conj())
    assert torch.equal(lazy[::2].cpu(), c.conj()[::2])
    assert torch.equal(torch._neg_view(c.to(DEVICE)).cpu(), -c)
    target = torch.zeros(6, dtype=dtype, device=DEVICE)[::2]
    target.conj().copy_(c)
    assert torch.equal(target.cpu(), c.conj())


@pytest.mark.parametrize("shape,perm", [((3, 4), (1, 0)), ((2, 3, 4), (2, 0, 1))])
def test_strided_round_trips(shape, perm):
    host = torch.randn(shape)
    dev = host.to(DEVICE).permute(perm)
    assert torch.equal(dev.cpu(), host.permute(perm))
    target = torch.empty(tuple(reversed(shape)), device=DEVICE).permute(*reversed(range(len(shape))))
    target.copy_(host)
    assert torch.equal(target.cpu(), host)
