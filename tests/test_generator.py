"""Chapter 5: acme's generator and random kernels, checked against the algorithm and the maths.

The stream is Philox4x32-10, so it can be recomputed on the host: a Python
Philox is checked against the known-answer vectors Random123 (the authors'
reference implementation) publishes, then acme's uniform and normal samples
are rebuilt from the seed alone. The rest checks the distributions'
parameters, every dtype random_ fills, strided destinations, the per-device
generators and the errors for bad input.
"""

from __future__ import annotations

import importlib
import math
import re
import warnings

import pytest
import torch

import torch_acme  # noqa: F401

pytestmark = pytest.mark.skipif(importlib.import_module("torch_acme._build_info").STAGE < 5,
                                reason="chapter 5's generator is not in this stage")

DEVICE = torch._C._get_privateuse1_backend_name()
MODULE = torch.get_device_module(DEVICE)
MASK = 0xFFFFFFFF


# ---- the algorithm ----

def philox4x32_10(counter, key):
    """Philox4x32-10 (Salmon et al., SC 2011): four 32-bit words from a counter and a key."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_ in range(10):
        if round_:  # the key schedule: Weyl sequences of the golden ratio and sqrt(3) - 1
            k0, k1 = (k0 + 0x9E3779B9) & MASK, (k1 + 0xBB67AE85) & MASK
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK, (p0 >> 32) ^ c3 ^ k1, p0 & MASK
    return c0, c1, c2, c3


def test_philox_matches_the_published_known_answers():
    # Random123's kat_vectors for philox4x32_10: (counter, key, expected).
    known_answers = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((MASK,) * 4, (MASK, MASK), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for counter, key, expected in known_answers:
        assert philox4x32_10(counter, key) == expected


def blocks(seed: int, offset: int, n: int):
    """Counter blocks offset .. offset + n - 1 under `seed`: element i's four words."""
    key = (seed & MASK, seed >> 32)
    return [philox4x32_10((b & MASK, b >> 32, 0, 0), key) for b in range(offset, offset + n)]


def bits64(words, first=0):
    return words[first] << 32 | words[first + 1]


def test_float64_uniform_is_philox_from_the_seed_and_the_offset():
    # Element i of an op is counter block offset + i: 53 bits, divided by 2^53.
    seed = 0x0123456789ABCDEF
    g = torch.Generator(device=DEVICE)
    g.manual_seed(seed)
    first = torch.empty(8, dtype=torch.float64, device=DEVICE).uniform_(generator=g).cpu()
    assert g.get_offset() == 8  # one counter block per element
    second = torch.empty(5, dtype=torch.float64, device=DEVICE).uniform_(generator=g).cpu()
    expect = lambda offset, n: torch.tensor(  # noqa: E731
        [(bits64(w) >> 11) / 2**53 for w in blocks(seed, offset, n)], dtype=torch.float64)
    assert torch.equal(first, expect(0, 8))
    assert torch.equal(second, expect(8, 5))  # the next op starts where the first left off


def test_long_runs_cross_batches_and_the_32_bit_carry():
    # Kernels draw counter blocks in batches (32 at a time from chapter 23, by
    # AVX2 where the CPU has it): a batch that crosses block 2^32, where the
    # counter's high word changes, and a short last batch must still give
    # block offset + i for every i.
    seed, offset, n = 0xFEDCBA9876543210, 2**32 - 45, 1003
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    g.set_offset(offset)
    got = torch.empty(n, dtype=torch.float64, device=DEVICE).uniform_(generator=g).cpu()
    expected = torch.tensor([(bits64(w) >> 11) / 2**53 for w in blocks(seed, offset, n)],
                            dtype=torch.float64)
    assert torch.equal(got, expected)
    # bernoulli_ draws the same blocks: element i is kept when its uniform is below p.
    g.manual_seed(seed)
    g.set_offset(offset)
    kept = torch.empty(n, device=DEVICE).bernoulli_(0.3, generator=g).cpu()
    assert torch.equal(kept, (expected < 0.3).float())


def test_float32_uniform_uses_exactly_24_bits():
    seed = 77
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    got = torch.empty(64, device=DEVICE).uniform_(generator=g).cpu()
    expected = torch.tensor([(bits64(w) >> 40) / 2**24 for w in blocks(seed, 0, 64)])
    assert torch.equal(got, expected)
    assert torch.equal(got * 2**24, (got * 2**24).round())  # every sample k / 2^24, so < 1


def test_normal_is_box_muller_of_the_same_blocks():
    seed = 5
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    got = torch.empty(64, dtype=torch.float64, device=DEVICE).normal_(generator=g).cpu()
    expected = []
    for w in blocks(seed, 0, 64):
        u1 = 1.0 - (bits64(w, 0) >> 11) / 2**53
        u2 = (bits64(w, 2) >> 11) / 2**53
        expected.append(math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2))
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-12, atol=1e-12)


def test_layout_does_not_change_the_numbers():
    # Element i draws counter block offset + i, whatever the tensor's strides:
    # a transposed tensor and a strided slice get the contiguous tensor's values,
    # and the bytes between the slice's elements are left alone.
    g = torch.Generator(device=DEVICE)
    g.manual_seed(1)
    contiguous = torch.empty(4, 6, device=DEVICE).uniform_(generator=g).cpu()
    g.manual_seed(1)
    transposed = torch.empty(6, 4, device=DEVICE).t()
    transposed.uniform_(generator=g)
    g.manual_seed(1)
    base = torch.zeros(4, 12, device=DEVICE)
    base[:, ::2].uniform_(generator=g)
    assert torch.equal(transposed.cpu(), contiguous)
    assert torch.equal(base.cpu()[:, ::2], contiguous)
    assert torch.equal(base.cpu()[:, 1::2], torch.zeros(4, 6))


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed", "sliced"])
def test_dropout_results_have_the_cpus_layout(layout, train):
    x = torch.randn(2, 3, 4, 10)
    x = {"contiguous": x, "channels_last": x.to(memory_format=torch.channels_last),
         "transposed": x.transpose(1, 3), "sliced": x[..., ::2]}[layout]
    expected_out, expected_mask = torch.native_dropout(x, 0.5, train)
    with torch.random.fork_rng(devices=[0], device_type=DEVICE):
        MODULE.manual_seed(3)
        out, mask = torch.native_dropout(x.to(DEVICE), 0.5, train)
        MODULE.manual_seed(3)
        dense_out, dense_mask = torch.native_dropout(x.contiguous().to(DEVICE), 0.5, train)
    assert out.stride() == expected_out.stride() and mask.stride() == expected_mask.stride()
    assert out.device.type == DEVICE and mask.dtype == torch.bool
    # The layout changes no number: element i keeps the draw it has in a contiguous copy.
    assert torch.equal(out.cpu(), dense_out.cpu()) and torch.equal(mask.cpu(), dense_mask.cpu())
    torch.testing.assert_close(out.cpu(), x * mask.cpu() * (2.0 if train else 1.0))
    assert bool(mask.all()) != train  # training drops some elements, evaluation none


# ---- distributions and dtypes ----

def test_bernoulli_frequency():
    torch.manual_seed(2024)
    n = 1_000_000
    coin = torch.bernoulli(torch.full((n,), 0.3, device=DEVICE)).cpu()
    assert set(coin.unique().tolist()) == {0.0, 1.0}
    # Five standard errors: sqrt(0.3 * 0.7 / n) is about 0.00046.
    assert abs(coin.mean().item() - 0.3) < 5 * math.sqrt(0.21 / n)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32,
                                   torch.int64, torch.bool, torch.float32, torch.float64],
                         ids=str)
def test_random_stays_in_the_dtype(dtype):
    g = torch.Generator(device=DEVICE).manual_seed(3)
    r = torch.empty(10_000, dtype=dtype, device=DEVICE).random_(generator=g).cpu()
    assert r.dtype == dtype
    as_double = r.to(torch.float64)
    assert (as_double >= 0).all()
    if dtype.is_floating_point:  # random_ keeps to the integers the mantissa holds exactly
        limit = {torch.float32: 2**24, torch.float64: 2**53}[dtype]
    else:
        limit = 1 if dtype == torch.bool else torch.iinfo(dtype).max
    assert as_double.max() <= limit
    assert len(r.unique()) > 1


def test_parameters_are_honoured():
    torch.manual_seed(4)
    bounded = torch.empty(10_000, dtype=torch.int8, device=DEVICE).random_(-5, 5).cpu()
    assert bounded.min() == -5 and bounded.max() == 4
    wide = torch.empty(1000, device=DEVICE).uniform_(-3.0, 7.0).cpu()
    assert wide.min() >= -3 and wide.max() < 7
    shifted = torch.empty(100_000, dtype=torch.float64, device=DEVICE).normal_(10.0, 2.0).cpu()
    assert abs(shifted.mean() - 10) < 0.05 and abs(shifted.std() - 2) < 0.05
    halves = torch.rand(1000, device=DEVICE, dtype=torch.bfloat16).cpu()
    assert halves.dtype == torch.bfloat16 and 0 <= halves.min() and halves.max() < 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_uniform_has_the_cpus_grid(dtype):
    # Sampled in float and rounded once, as the CPU does: thousands of
    # distinct values below 1, and exact zeros only where a sample rounds up
    # to 1 (then it becomes 0): one in 2^9 for bfloat16, 2^12 for float16.
    # Drawing only the dtype's own 8 or 11 bits gives 256 or 2048 values and
    # twice the zeros.
    n = 2**20
    torch.manual_seed(11)
    on_cpu = torch.rand(n, dtype=dtype)
    on_acme = torch.rand(n, dtype=dtype, device=DEVICE).cpu()
    rate = torch.finfo(dtype).eps / 4  # the share that rounds up to 1
    for sample in (on_cpu, on_acme):
        zeros = (sample == 0).sum().item()
        assert abs(zeros - n * rate) < 5 * math.sqrt(n * rate), (zeros, n * rate)
        assert 0 <= sample.min() and sample.max() < 1
    distinct_cpu, distinct_acme = on_cpu.unique().numel(), on_acme.unique().numel()
    assert abs(distinct_acme - distinct_cpu) < 0.05 * distinct_cpu, (distinct_acme, distinct_cpu)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_unsigned_integers_draw_in_range(dtype):
    g = torch.Generator(device=DEVICE).manual_seed(9)
    drawn = torch.randint(3, 1000, (20_000,), dtype=dtype, device=DEVICE, generator=g).cpu()
    assert drawn.dtype == dtype
    as_int = drawn.to(torch.int64)
    assert as_int.min() == 3 and as_int.max() == 999
    g.manual_seed(9)
    again = torch.randint(3, 1000, (20_000,), dtype=dtype, device=DEVICE, generator=g).cpu()
    assert torch.equal(drawn, again)


def _bounds_cases():
    def empty(dtype):
        return lambda device: torch.empty(3, dtype=dtype, device=device)
    u8, i32, i64 = empty(torch.uint8), empty(torch.int32), empty(torch.int64)
    f16, bf16, f32 = empty(torch.float16), empty(torch.bfloat16), empty(torch.float32)
    u32, u64 = empty(torch.uint32), empty(torch.uint64)
    return {
        "uint8 to 300": lambda d: u8(d).random_(0, 300),
        "uint8 from -1": lambda d: u8(d).random_(-1, 5),
        "int32 to 2^40": lambda d: i32(d).random_(0, 2**40),
        "float16 to 70000": lambda d: f16(d).random_(0, 70000),
        "float16 to 65504": lambda d: f16(d).random_(0, 65504),
        "float16 to 4096": lambda d: f16(d).random_(0, 4096),
        "bfloat16 from 5": lambda d: bf16(d).random_(5, None),
        "uint64 from 0": lambda d: u64(d).random_(0, None),
        "uint32 from 7": lambda d: u32(d).random_(7, None),
        "uint32 plain": lambda d: u32(d).random_(),
        "uint32 to 7": lambda d: u32(d).random_(7),
        "int32 every int64": lambda d: i32(d).random_(-2**63, None),
        "int64 every int64": lambda d: i64(d).random_(-2**63, None),
        "float32 to inf": lambda d: f32(d).uniform_(0, float("inf")),
        "float32 from -1e39": lambda d: f32(d).uniform_(-1e39, 1),
        "float16 span": lambda d: f16(d).uniform_(-6e4, 6e4),
        "float16 half span": lambda d: f16(d).uniform_(-3e4, 3e4),
    }


@pytest.mark.parametrize("case", list(_bounds_cases()))
def test_random_bounds_are_the_cpus(case):
    # What the CPU accepts, acme accepts; what it refuses, acme refuses with
    # the same message (a kernel's name in quotes aside), except where the
    # CPU's names its kernel and acme says what the call asked for.
    own_words = {"int32 every int64"}

    def outcome(device):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the CPU's out-of-range float16 warning
                _bounds_cases()[case](device)
        except (RuntimeError, NotImplementedError) as error:
            message = re.sub(r'"\w+"', '"kernel"', str(error).splitlines()[0])
            return type(error).__name__, "" if case in own_words else message
        return "ok", ""
    assert outcome(DEVICE) == outcome("cpu")


# ---- per-device generators ----

def test_each_device_has_its_own_default_generator():
    assert MODULE.device_count() >= 2
    previous = MODULE.current_device()
    try:
        MODULE.set_device(1)
        MODULE.manual_seed(123)  # the current device only
        MODULE.set_device(0)
        MODULE.manual_seed(5)
        assert MODULE.default_generator(1).initial_seed() == 123
        assert MODULE.default_generator(0).initial_seed() == 5
        assert MODULE.default_generator(torch.device(DEVICE, 1)) is MODULE.default_generator(1)
        MODULE.seed_all()  # one fresh nondeterministic seed, on every device
        seeds = {MODULE.default_generator(i).initial_seed() for i in range(MODULE.device_count())}
        assert len(seeds) == 1 and seeds != {5}
    finally:
        MODULE.set_device(previous)


# ---- bad input ----

def _bad_inputs():
    t = lambda: torch.empty(3, device=DEVICE)  # noqa: E731
    return {
        "float state": (lambda: MODULE.set_rng_state(torch.zeros(16)),
                        "RNG state must be a torch.ByteTensor"),
        "cpu state": (lambda: MODULE.set_rng_state(torch.get_rng_state()),
                      "generator state must be 16 bytes"),
        "uniform range": (lambda: t().uniform_(1.0, 0.0),
                          "uniform_ expects to return a [from, to) range, but found from=1 > to=0"),
        "normal std": (lambda: t().normal_(0.0, -1.0),
                       "normal expects std >= 0.0, but found std -1"),
        "random_ range": (lambda: t().random_(5, 5),
                          "'from' to be less than 'to', but got from=5 >= to=5"),
        "uint8 bounds": (lambda: torch.empty(3, dtype=torch.uint8, device=DEVICE).random_(0, 300),
                         "to - 1 is out of bounds for unsigned char"),
        "bernoulli p": (lambda: t().bernoulli_(1.5),
                        "bernoulli_ expects p to be in [0, 1], but got p=1.5"),
        "bernoulli p tensor": (lambda: t().bernoulli_(torch.tensor([0.1, 2.0, 0.3])),
                               "all elements of p to be in [0, 1], but found 2"),
        "cpu generator": (lambda: t().uniform_(generator=torch.Generator()),
                          f"Expected a '{DEVICE}' device type for generator but found 'cpu'"),
        "expanded tensor": (lambda: torch.empty(1, device=DEVICE).expand(4).uniform_(),
                            "more than one element of the written-to tensor"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_input_is_refused_with_a_clear_message(case):
    call, message = _bad_inputs()[case]
    with pytest.raises((RuntimeError, TypeError)) as caught:
        call()
    assert message in str(caught.value)
