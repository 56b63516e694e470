"""Build-time metadata: the wheel requires the PyTorch release it was compiled against,
and its version says which release that is.

scikit-build-core calls this (pyproject.toml, [[tool.dynamic-metadata]]).
PyTorch's C++ API and ABI change between releases, so an extension built
against 2.13 may fail to load, or misbehave, under 2.14: pin the release.
The version is that release with a post-release number of the backend's own
(2.15.0.post1): PyPI refuses local versions (2.15.0+acme1), and a user reads
at a glance which torch a wheel goes with (torch_npu numbers its wheels so).
"""

# This backend's own release on a given PyTorch release: raise it for a fix
# published without a new PyTorch release.
POST = 1


def dynamic_metadata(settings, project):
    try:
        import torch
    except ImportError as error:
        raise RuntimeError(
            "torch is not importable by the Python that builds this package. Install "
            "PyTorch first, then build in that environment without build isolation:\n"
            "    pip install --no-build-isolation .") from error
    release = torch.__version__.split("+")[0]  # 2.13.0+cpu matches torch==2.13.0
    return {"dependencies": [f"torch=={release}"], "version": f"{release}.post{POST}"}
