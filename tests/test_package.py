"""What importing the package does to the process: PyTorch's OpenMP threads are told to stop
spinning soon after each parallel operation (fedprivacy/__init__.py), before PyTorch loads, from
every entry point."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Records GOMP_SPINCOUNT at the moment `torch` starts loading (libgomp reads it then), then imports the module.
_PROBE = """
import importlib.abc, os, sys
seen = []
class Probe(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("GOMP_SPINCOUNT"))
        return None
sys.meta_path.insert(0, Probe())
import importlib
importlib.import_module(sys.argv[1])
print(seen[0] if seen else "torch not imported")
"""


def _run(code: str, *args: str, **environment: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**clean, **environment},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.mark.parametrize(
    "environment, expected",
    [
        ({}, "10000"),  # unset: the short spin
        ({"GOMP_SPINCOUNT": "5"}, "5"),  # the user's own count
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "None"),  # the user's own policy: no count added
    ],
)
def test_importing_fedprivacy_shortens_openmp_spinning_unless_the_user_chose(environment, expected):
    assert _run("import os, fedprivacy; print(os.environ.get('GOMP_SPINCOUNT'))", **environment) == expected


@pytest.mark.parametrize(
    # not fedprivacy.cli: it loads torch only inside a command (tests/test_runconfig_keys.py checks its --help)
    "entry",
    ["sims.fast.engine", "sims.fast.worker", "clients.app", "server.app"],
)
def test_every_entry_point_sets_it_before_pytorch_loads(entry):
    """A script that starts from the fast engine, or Flower loading the apps, gets the setting in
    time: OpenMP reads it once, when PyTorch loads."""
    assert _run(_PROBE, entry) == "10000"
