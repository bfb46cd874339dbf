"""fedprivacy: federated, proactive DP-SGD (see README.md)."""

import os
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fedprivacy")  # the one version string: pyproject.toml's
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "unknown"

# PyTorch's Linux wheels run their CPU threads on GNU OpenMP, whose idle threads keep spinning
# (300,000 rounds by default, several milliseconds) after each parallel operation. On a machine
# with few cores they hold the cores that the ledger's writer and the accountant's threads need
# between the fast engine's batched operations: measured on 2 cores (benchmarks/sim_throughput.py,
# 1,000 clients), a round took 10-14% longer (MLP) and its accounting ~25% longer than with 10,000
# rounds. Read when PyTorch is first imported; a user's own OpenMP settings win.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
