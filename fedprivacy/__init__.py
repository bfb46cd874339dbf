"""fedprivacy: federated, proactive DP-SGD (see README.md)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fedprivacy")  # the one version string: pyproject.toml's
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "unknown"
