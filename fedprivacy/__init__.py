"""fedprivacy: federated, proactive DP-SGD (see README.md)."""

import os
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fedprivacy")  # the one version string: pyproject.toml's
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "unknown"

# PyTorch's Linux wheels run their CPU threads on GNU OpenMP, whose idle threads keep spinning
# (300,000 rounds by default, milliseconds) after each parallel operation, on the cores that the
# fast engine's ledger writer and PLD threads need between its batched operations. Measured on 2
# cores (benchmarks/sim_throughput.py, a steady 1,000-client round, interleaved runs): see
# docs/benchmarks.md. Set on every machine, read when PyTorch is first imported (so `sims`,
# `clients` and `server` import this package first); a user's own OpenMP settings win.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
