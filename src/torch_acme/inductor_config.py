#@ ch20
"""What Inductor's caches must know about acme's code generator (chapter 20).

Inductor caches compiled graphs on disk, keyed on PyTorch's version and its
own settings, not on the code of a backend outside PyTorch: after an update to
inductor.py, a graph compiled by the old version would be loaded again. A
config module handed to register_backend_for_device goes into the key; this
one holds a hash of inductor.py.
"""

import hashlib as _hashlib
import os as _os
import sys as _sys

from torch.utils._config_module import install_config_module as _install


def _hash_of(name: str) -> str:
    with open(_os.path.join(_os.path.dirname(__file__), name), "rb") as source:
        return _hashlib.sha256(source.read()).hexdigest()[:16]


code_version: str = _hash_of("inductor.py")

_install(_sys.modules[__name__])
