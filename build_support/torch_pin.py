"""Build-time metadata: the wheel requires the PyTorch release it was compiled against.

scikit-build-core calls this (pyproject.toml, [[tool.dynamic-metadata]]).
PyTorch's C++ API and ABI change between releases, so an extension built
against 2.13 may fail to load, or misbehave, under 2.14: pin the release.
"""


def dynamic_metadata(settings, project):
    try:
        import torch
    except ImportError as error:
        raise RuntimeError(
            "torch is not importable by the Python that builds this package. Install "
            "PyTorch first, then build in that environment without build isolation:\n"
            "    pip install --no-build-isolation .") from error
    release = torch.__version__.split("+")[0]  # 2.13.0+cpu matches torch==2.13.0
    return {"dependencies": [f"torch=={release}"]}
