#@ ch20
"""When torch.compile's modules load, tell them about acme (chapter 20).

Dynamo needs acme's device interface (dynamo.py) and Inductor its code
generator (inductor.py). Both import the compiler, which costs about a second:
more than `import torch_acme` costs in all, and a price scripts that never
compile should not pay. So nothing registers at import; each registration runs
right after the compiler module it extends has loaded. PyTorch has no "on load"
callback for Dynamo (2.15 added one for Inductor, `_inductor_backend_init` on the
device module; 2.13 and 2.14 have neither): an import hook (a finder on
sys.meta_path) serves both, on every release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading

# The compiler's module -> acme's module that registers with it on import.
_REGISTRATIONS = {
    "torch._dynamo": "torch_acme.dynamo",
    "torch._inductor.compile_fx": "torch_acme.inductor",
}


class _RegisterAfterLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module in _REGISTRATIONS it returns the
    usual spec, with a loader that imports acme's module right after it."""

    def __init__(self):
        self._asking = threading.local()  # set while it asks the other finders

    def find_spec(self, name, path, target=None):
        if name not in _REGISTRATIONS or getattr(self._asking, "name", None) == name:
            return None
        self._asking.name = name
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._asking.name = None
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return None  # not there, or a loader of another kind: import it as usual
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            importlib.import_module(_REGISTRATIONS[name])

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Register now with what has loaded; hook the rest."""
    for compiler_module, acme_module in _REGISTRATIONS.items():
        if compiler_module in sys.modules:
            importlib.import_module(acme_module)
    sys.meta_path.insert(0, _RegisterAfterLoad())
