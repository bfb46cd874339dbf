"""The names of the sweep's engines: the modules of `sims/sweep/engines/` (that package's docstring
says why), read from the folder without importing it, so that the scenario's checks
(`sims.sweep.spec`) need no engine and no engine's types."""

from __future__ import annotations

import pkgutil
from pathlib import Path

ENGINES = Path(__file__).with_name("engines")


def engine_names() -> tuple[str, ...]:
    """The engines a sweep can run on: the modules of `sims/sweep/engines/`."""
    return tuple(sorted(module.name for module in pkgutil.iter_modules([str(ENGINES)])))
