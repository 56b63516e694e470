"""acme: a simulated accelerator plugged into PyTorch through PrivateUse1."""

#> ch17 autoload
def _autoload():
    """The "torch.backends" entry point (pyproject.toml): PyTorch calls it at the
    end of `import torch`. Importing this package has done all the work.

    Defined before `import torch` below: when a script imports torch_acme first,
    torch's import calls back into this half-imported module and finds it.
    """


#< ch17 autoload
#> ch01 import-torch
# From chapter 1 on, _C links libtorch and registers kernels when it loads:
# torch must be imported first.
import torch

#< ch01 import-torch
#> ch08 name
# The one place that names the device. A process can rename PrivateUse1 once,
# and must do it first: rename, then register the module, then create tensors.
DEVICE_NAME = "acme"
torch.utils.rename_privateuse1_backend(DEVICE_NAME)

#< ch08 name
#> ch17 release-check
# The libraries work with the release they were compiled against only.
# Under another, loading them fails with an undefined C++ symbol (or worse,
# succeeds): say which two releases met, before _C loads.
from ._built_against import TORCH as _BUILT_AGAINST

if torch.__version__.split("+")[0] != _BUILT_AGAINST.split("+")[0]:
    raise ImportError(
        f"torch_acme was compiled against PyTorch {_BUILT_AGAINST}, but this Python has "
        f"PyTorch {torch.__version__}. Install torch=={_BUILT_AGAINST.split('+')[0]}, or "
        f"rebuild torch_acme against {torch.__version__.split('+')[0]} "
        f"(pip install --no-build-isolation .).")

#< ch17 release-check
#> ch00 load-runtime
from . import _C
from ._C import runtime  # the vendor runtime, driven directly (chapter 0)
#< ch00 load-runtime
#> ch03 drain-at-exit
import atexit

# See csrc/aten/autograd.cpp: without this, a script that ends right after a
# backward() on acme can abort at exit (an upstream race in PyTorch).
atexit.register(_C._drain_autograd_threads)
#< ch03 drain-at-exit

#> ch01 device-module
from . import device

#> ch01 register-module < ch08 register-named
# # Creating a tensor on the device makes PyTorch import `torch.privateuseone`.
# torch._register_device_module("privateuseone", device)
#< ch01 register-module
#> ch08 register-named
# Creating a tensor on the device makes PyTorch import `torch.acme`.
torch._register_device_module(DEVICE_NAME, device)
#< ch08 register-named
#> ch09 generated-methods

# t.acme(), t.is_acme, module.acme(), storage.acme(), storage.is_acme,
# packed_sequence.acme(): the conveniences torch.cuda users reach for. No
# unsupported_dtype: it refuses only TypedStorage.acme(), and acme holds every
# dtype it can copy (torch.accelerator.get_device_capability, chapter 11).
torch.utils.generate_methods_for_privateuse1_backend(
    for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True)
#< ch09 generated-methods
#> ch14 mixed-precision
# Precision PyTorch's Python picks by device type: acme answers as CUDA.
from . import mixed_precision

mixed_precision.install()
#< ch14 mixed-precision
#> ch15 python-ops
# Operators defined in Python (torch.ops.acme.swiglu): after the rename, so
# their device kernels register under the device's name.
from . import ops
#< ch15 python-ops
#> ch16 register-multiprocessing
# acme tensors through torch.multiprocessing: registers the reducers.
from . import multiprocessing
#< ch16 register-multiprocessing
#> ch17 load-stable
# Kernels built against PyTorch's stable ABI (csrc/stable): one library for
# every release from 2.13 on, registering torch.ops.acme_stable.
import os as _os

torch.ops.load_library(_os.path.join(_os.path.dirname(__file__), "libacme_stable.so"))
#< ch17 load-stable
#> ch20 compiler
# torch.compile: Dynamo and Inductor learn about acme when they load.
from . import compiler_hooks

compiler_hooks.install()
#< ch20 compiler
#> ch21 register-distributed
# torch.distributed: a collective backend for acme tensors.
from . import distributed
#< ch21 register-distributed
#> ch23 checkpoint-rng
# Dropout inside compiled activation checkpointing: PyTorch's RNG wrappers.
from . import checkpoint_rng
#< ch23 checkpoint-rng
#< ch01 device-module

__all__ = [
#> ch08 name-export
    "DEVICE_NAME",
#< ch08 name-export
    "runtime",
#> ch01 device-module-export
    "device",
#< ch01 device-module-export
]
