#@ ch01
"""The device module PyTorch finds as ``torch.privateuseone``.

Its functions mirror ``torch.cuda``'s so that code written for one reads the same
for the other; each is a thin call into the vendor runtime.
"""

from ._C import runtime


def is_available() -> bool:
    return device_count() > 0


#> ch01 device-count < ch11 device-count
# def device_count() -> int:
#     return runtime.device_count()
#< ch01 device-count
#> ch11 device-count
def device_count() -> int:
    """The number of acme devices; 0, with a warning, if the runtime cannot start."""
    try:
        return runtime.device_count()
    except runtime.AcmeError as error:
        import warnings

        import torch

        # As torch.cuda.device_count() does when the driver fails: "no devices",
        # so that is_available() answers False instead of raising.
        name = torch._C._get_privateuse1_backend_name()
        warnings.warn(f"{name} initialization: {error}", stacklevel=2)
        return 0
#< ch11 device-count


#> ch01 current-device < ch20 current-device
# def current_device() -> int:
#     return runtime.current_device()
#< ch01 current-device
#> ch20 current-device
def current_device() -> int:
    """The current device's index. Asked through torch.accelerator, which
    Dynamo knows: compiled code that depends on it is guarded on the answer."""
    import torch

    return torch.accelerator.current_device_index()
#< ch20 current-device


def set_device(device) -> None:
    runtime.set_device(_index(device))


#> ch01 synchronize < ch18 synchronize
# def synchronize(device=None) -> None:
#     """Waits for all work queued on `device` (default: the current one)."""
#     previous = runtime.current_device()
#     runtime.set_device(previous if device is None else _index(device))
#     try:
#         runtime.synchronize()
#     finally:
#         runtime.set_device(previous)
#< ch01 synchronize
#> ch18 synchronize
def synchronize(device=None) -> None:
    """Waits for all work on every stream of `device` (default: the current one).

    Through PyTorch's accelerator API, so that a kernel's failure arrives as
    torch.AcceleratorError, as from torch.cuda.synchronize().
    """
    import torch

    index = _index_or_current(device)
    # PyTorch skips synchronizing a device type nothing has initialized yet,
    # without looking at the index: checked here, as torch.cuda does.
    if not 0 <= index < device_count():
        raise RuntimeError(f"{torch._C._get_privateuse1_backend_name()}: invalid device index "
                           f"{index}: there are {device_count()} "
                           f"{torch._C._get_privateuse1_backend_name()} devices")
    torch.accelerator.synchronize(index)
#< ch18 synchronize


#> ch18 sleep
def _sleep(microseconds: int) -> None:
    """Queues a kernel that keeps the current stream busy (torch.cuda._sleep's twin)."""
    runtime.sleep_kernel(current_stream().native_handle, int(microseconds))


#< ch18 sleep
#> ch06 stream-helpers
# Streams as torch.cuda users know them. torch.Stream and torch.accelerator
# reach acme through its device guard; these helpers only name the device.

def current_stream(device=None):
    """This thread's current stream on `device` (default: the current device)."""
    import torch

    return torch.accelerator.current_stream(_index_or_current(device))


def default_stream(device=None):
    """The default stream of `device`: the one every thread starts with."""
    import torch

    index = _index_or_current(device)
    kind = torch.accelerator.current_stream(index).device_type
    return torch.Stream(stream_id=0, device_index=index, device_type=kind)


def set_stream(stream) -> None:
    """Makes `stream` current on its device (and its device current), on this thread."""
    import torch

    torch.accelerator.set_stream(stream)


def stream(stream):
    """``with stream(s):`` runs the block with `s` current; ``stream(None)`` does nothing."""
    import contextlib

    return contextlib.nullcontext() if stream is None else stream


def _index_or_current(device) -> int:
    return current_device() if device is None else _index(device)
#> ch21 stream-classes


# torch.acme.Stream and torch.acme.Event, as torch.cuda has them: FSDP2
# (chapter 21) makes its streams and events through the device module. The
# generic classes reach acme through its device guard already.
def __getattr__(name: str):
    if name in ("Stream", "Event"):
        import torch

        return getattr(torch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
#< ch21 stream-classes


#< ch06 stream-helpers
#> ch04 amp
def get_amp_supported_dtype() -> list:
    """The dtypes ``torch.autocast`` accepts for acme devices.

    PyTorch (2.13 to 2.15) asks the device module for exactly this and nothing else; the
    list comes from the same C++ table the autocast kernels check against.
    """
    import torch

    from ._C import autocast

    return [getattr(torch, name) for name in autocast.lower_precision_dtypes()]


#< ch04 amp
def _index(device) -> int:
    """Accepts 1, "privateuseone:1" or torch.device("privateuseone", 1) (acme from chapter 8)."""
    if isinstance(device, int):
        return device
    import torch

    device = torch.device(device)
    name = torch._C._get_privateuse1_backend_name()
    if device.type != name:
        raise ValueError(f"expected a device of type {name}, got {device}")
    return current_device() if device.index is None else device.index

#> ch05 random
# Random numbers: torch.cuda's seeding API over acme's per-device default
# generators (csrc/aten/generator.cpp). Each call locks the generator, through
# torch.Generator's own methods.


def default_generator(device=None):
    """The default generator of `device` (None: the current device)."""
    import torch

    index = current_device() if device is None else _index(device)
    return torch.ops.acme.default_generator(index)


#> ch05 bad-fork < ch11 -
# def _is_in_bad_fork() -> bool:
#     # torch.manual_seed seeds a PrivateUse1 backend only if its module has this
#     # and manual_seed_all. Chapter 11 tracks fork(); until then only the
#     # runtime's streams (chapter 6) notice it, and refuse in a child.
#     return False
#
#
#< ch05 bad-fork
#> ch05 manual-seed < ch11 manual-seed
# def manual_seed(seed: int) -> None:
#     """Seeds the current device's default generator."""
#     default_generator().manual_seed(int(seed))
#< ch05 manual-seed
#> ch11 manual-seed
def _can_seed() -> bool:
    # Without devices, or in a forked child that cannot use them, there is no
    # generator to seed: as with torch.cuda, seeding is then a no-op.
    return device_count() > 0 and not _is_in_bad_fork()


def manual_seed(seed: int) -> None:
    """Seeds the current device's default generator."""
    if _can_seed():
        default_generator().manual_seed(int(seed))
#< ch11 manual-seed


def manual_seed_all(seed: int) -> None:
    """Seeds every device's default generator; torch.manual_seed calls this."""
    for index in range(device_count()):
        default_generator(index).manual_seed(int(seed))


def seed() -> None:
    """Seeds the current device with a nondeterministic random number."""
#> ch11 seed-guard
    if not _can_seed():
        return
#< ch11 seed-guard
    default_generator().seed()


def seed_all() -> None:
    """Seeds every device with one nondeterministic random number."""
#> ch11 seed-all-guard
    if not _can_seed():
        return
#< ch11 seed-all-guard
    fresh = default_generator(0).seed()
    for index in range(1, device_count()):
        default_generator(index).manual_seed(fresh)


def initial_seed() -> int:
    """The current device's seed."""
    return default_generator().initial_seed()


def get_rng_state(device=None):
    """The generator state of `device` (None: the current one) as a CPU uint8 tensor."""
    return default_generator(device).get_state()


def set_rng_state(new_state, device=None) -> None:
    """Restores a state that get_rng_state returned."""
    default_generator(device).set_state(new_state)


def get_rng_state_all() -> list:
    return [get_rng_state(index) for index in range(device_count())]


def set_rng_state_all(new_states) -> None:
    for index, state in enumerate(new_states):
        set_rng_state(state, index)

#< ch05 random

#> ch07 serialization
#> ch07 device-context
# Saving and loading. torch.save needs nothing from this module; torch.load
# restores a storage to an acme device inside `with torch.<backend>.device(...)`
# (torch/_utils.py, _to) and checks is_available() and device_count() first
# (torch/serialization.py, _validate_device).


class device:
    """Makes `device` current inside a ``with`` block, like ``torch.cuda.device``.

    ``device`` may be an index, a device string or a torch.device; None or -1
    leave the current device alone.
    """

    def __init__(self, device):
        self.index = -1 if device is None or device == -1 else _index(device)
        self.previous = -1

    def __enter__(self):
        self.previous = current_device()
        if self.index not in (-1, self.previous):
            runtime.set_device(self.index)
        return self

    def __exit__(self, *exc_info):
        if self.index not in (-1, self.previous):
            runtime.set_device(self.previous)
        return False

#< ch07 device-context
#> ch07 check-checkpoint


def check_checkpoint(f) -> None:
    """Raises RuntimeError unless `f` is a complete, intact ``torch.save`` file.

    torch.save writes a CRC-32 for every record of its zip archive, but
    torch.load never verifies them: a flipped byte in a tensor's data loads
    silently, and a truncated file fails with whatever error the zip reader hits
    first. This reads the whole archive once and checks every record. `f` is a
    path or a seekable binary file; a file's position is restored.
    """
    import os
    import zipfile

    is_path = isinstance(f, (str, os.PathLike))
    name = os.fspath(f) if is_path else getattr(f, "name", None)
    where = f"{name}: " if name else ""
    start = None if is_path else f.tell()
    try:
        with zipfile.ZipFile(f) as archive:
            records = archive.infolist()
            if records and all(r.CRC == 0 for r in records if r.file_size):
                raise RuntimeError(
                    f"{where}the checkpoint carries no CRC-32s to verify (it was written "
                    "with torch.serialization.set_crc32_options(False))")
            damaged = archive.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError, OSError) as error:
        raise RuntimeError(
            f"{where}not a complete torch.save checkpoint (truncated, or not a zip "
            f"archive): {error}") from error
    finally:
        if start is not None:
            f.seek(start)
    if damaged is not None:
        raise RuntimeError(
            f"{where}corrupted checkpoint: record '{damaged}' fails its CRC-32 check")

#< ch07 check-checkpoint
#< ch07 serialization
#> ch11 lazy-init

# ---- initialization (chapter 11) ----
# Importing torch_acme touches no device. PyTorch calls _lazy_init() before
# the first acme tensor is made from Python (torch/csrc/utils/device_lazy_init.cpp),
# and reads _initialized / is_initialized() to learn whether device state
# exists: torch.utils.checkpoint saves and restores the device's RNG state
# only then.
import threading

from . import _C

_initialized = False
_initialization_lock = threading.Lock()


def _is_in_bad_fork() -> bool:
    """True in a child of fork() whose parent had initialized acme."""
    return _C._is_in_bad_fork()


def is_initialized() -> bool:
    """Whether acme is initialized in this process."""
    return _initialized and not _is_in_bad_fork()


def _lazy_init() -> None:
    global _initialized
    if is_initialized():
        return
    with _initialization_lock:
        if is_initialized():
            return
        if _is_in_bad_fork():
            import torch

            name = torch._C._get_privateuse1_backend_name()
            raise RuntimeError(
                f"Cannot re-initialize {name} in forked subprocess. To use {name} with "
                "multiprocessing, you must use the 'spawn' start method")
        _C._init()  # the hooks' init(): raises if there is no device
        _initialized = True


def init() -> None:
    """Initialize acme now, rather than at the first tensor."""
    _lazy_init()
#< ch11 lazy-init
#> ch11 properties


class _AcmeDeviceProperties:
    """What ``get_device_properties`` returns, named like torch.cuda's."""

    def __init__(self, fields: dict):
        self.name = fields["name"]
        self.major = fields["major"]
        self.minor = fields["minor"]
        self.total_memory = fields["total_memory"]
        self.checked = fields["checked"]

    def __repr__(self) -> str:
        return (f"_AcmeDeviceProperties(name='{self.name}', major={self.major}, "
                f"minor={self.minor}, total_memory={self.total_memory // 2**20}MB, "
                f"checked={self.checked})")


def get_device_properties(device=None) -> _AcmeDeviceProperties:
    """Name, architecture version, memory and mode of `device` (default: current)."""
    return _AcmeDeviceProperties(runtime.device_properties(_index_or_current(device)))


def get_device_name(device=None) -> str:
    return get_device_properties(device).name


def get_device_capability(device=None) -> tuple[int, int]:
    """The architecture version as (major, minor), like torch.cuda's."""
    properties = get_device_properties(device)
    return properties.major, properties.minor
#< ch11 properties
#> ch12 memory


# ---- memory (chapter 12) ----
# The figures come from the caching allocator (csrc/aten/caching_allocator.cpp)
# through torch.accelerator, which reads any c10::DeviceAllocator: these only
# give them torch.cuda's names and accept a device the way torch.cuda does.
import torch


def memory_stats(device=None) -> dict:
    """The caching allocator's statistics for `device`, flattened as torch.cuda's."""
    return dict(torch.accelerator.memory_stats(_index_or_current(device)))


def memory_allocated(device=None) -> int:
    """Bytes held by live tensors on `device` (block sizes, so rounded up to 512)."""
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device=None) -> int:
    """The peak of memory_allocated() since start or reset_peak_memory_stats()."""
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device=None) -> int:
    """Bytes the allocator holds from the runtime: in use plus cached."""
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device=None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device=None) -> None:
    torch.accelerator.reset_peak_memory_stats(_index_or_current(device))


def reset_accumulated_memory_stats(device=None) -> None:
    torch.accelerator.reset_accumulated_memory_stats(_index_or_current(device))


def empty_cache() -> None:
    """Returns every cached, unused segment of every device to the runtime."""
    torch.accelerator.empty_cache()


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of `device`, as the runtime counts them."""
    return torch.accelerator.get_memory_info(_index_or_current(device))


def host_memory_stats() -> dict:
    """Statistics of the pinned host memory cache (PyTorch's CachingHostAllocator)."""
    return _C._host_memory_stats()


def memory_snapshot(device=None) -> list:
    """The allocator's segments on `device` and their blocks, with torch.cuda.memory_snapshot's
    keys (no allocation stacks: `frames` is empty), so that PyTorch's
    torch.cuda._memory_viz reads it. A segment's `stream` is acme's stream id."""
    return _C._memory_snapshot(_index_or_current(device))


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """A table of the allocator's statistics, in the spirit of torch.cuda.memory_summary."""
    stats = memory_stats(device)
    index = _index_or_current(device)

    def size(n: int) -> str:
        for unit in ("B", "KiB", "MiB", "GiB"):
            if abs(n) < 1024 or unit == "GiB":
                return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
            n /= 1024

    rows = [("Allocated memory", "allocated_bytes", size),
            ("Requested memory", "requested_bytes", size),
            ("Reserved memory", "reserved_bytes", size),
            ("Cached, split blocks", "inactive_split_bytes", size),
            ("Allocations", "allocation", str),
            ("Reserved segments", "segment", str)]
    line = "+" + "-" * 74 + "+"
    heading = f"{torch._C._get_privateuse1_backend_name()} memory summary, device {index}"
    out = [line, f"| {heading:^72} |", line,
           f"| {'metric':<24}|{'current':>11} |{'peak':>11} |{'allocated':>11} |{'freed':>10} |",
           line]
    for title, key, fmt in rows:
        for pool, label in [("all", title), ("large_pool", "  from the large pool"),
                            ("small_pool", "  from the small pool")]:
            if abbreviated and pool != "all":
                continue
            cells = [fmt(stats[f"{key}.{pool}.{kind}"])
                     for kind in ("current", "peak", "allocated", "freed")]
            out.append(f"| {label:<24}|{cells[0]:>11} |{cells[1]:>11} |{cells[2]:>11} |"
                       f"{cells[3]:>10} |")
        out.append(line)
    for text in (f"segments taken from the runtime: {stats['num_device_alloc']}, "
                 f"returned: {stats['num_device_free']}",
                 f"retries after emptying the cache: {stats['num_alloc_retries']}, "
                 f"out-of-memory errors: {stats['num_ooms']}"):
        out.append(f"| {text:<72} |")
    out.append(line)
    return "\n".join(out)
#< ch12 memory
#> ch16 ipc-collect


def ipc_collect() -> None:
    """Release device memory this process sent to others once they have all let it
    go (torch.cuda.ipc_collect). Sending runs it too."""
    _C._ipc_collect()
#< ch16 ipc-collect
