"""The command's flags as the raw tables of a scenario file, so that both go through one validation.

Flags are text; each value is read as the type of its run-config key's default, and a value that
is not is refused naming the flag. `--seeds 0-4` is a range (both ends included); lists are
comma-separated. `--grid KEY=V1,V2` varies any run-config key, `--set KEY=VALUE` fixes one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fedprivacy.errors import InputError
from fedprivacy.runconfig import DEFAULTS
from sims.sweep.spec import check_run_key

# flag name -> run-config key
RUN_FLAGS = {
    "dataset": "dataset",
    "data-path": "data-path",
    "partition-by": "partition-by",
    "partitioning": "partitioning",
    "model": "model",
    "rounds": "num-server-rounds",
    "fraction-train": "fraction-train",
}
GRID_FLAGS = {"epsilons": "epsilon", "rules": "rule", "seeds": "seed"}


def from_text(flag: str, key: str, text: str) -> Any:
    """One flag value as its key's type: float, int or str."""
    check_run_key(flag, key, text)
    default = DEFAULTS[key]
    kind = float if isinstance(default, float) else int if isinstance(default, int) else str
    try:
        return kind(text.strip())
    except ValueError:
        raise InputError(flag, text, "must be a number" if kind is float else "must be an integer") from None


def _integer_range(flag: str, text: str) -> list[int] | None:
    """`0-4` as [0, 1, 2, 3, 4]; None when `text` is not a range."""
    low, sep, high = text.partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        return None
    if int(high) < int(low):
        raise InputError(flag, text, "a range runs from low to high, e.g. 0-4")
    return list(range(int(low), int(high) + 1))


def values_from_text(flag: str, key: str, text: str) -> list[Any]:
    """A comma-separated list of values; integer keys also take ranges such as 0-4."""
    check_run_key(flag, key, text)
    ranges = isinstance(DEFAULTS[key], int)
    values: list[Any] = []
    for part in text.split(","):
        span = _integer_range(flag, part) if ranges else None
        values += span if span is not None else [from_text(flag, key, part)]
    return values


def _key_value(flag: str, item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise InputError(flag, item, "must be KEY=VALUE with a run-config key, e.g. clip-norm=0.1")
    return key.strip(), value


def scenario_from_flags(
    run_flags: Mapping[str, str | None],
    grid_flags: Mapping[str, str | None],
    sets: Sequence[str],
    grids: Sequence[str],
    sweep: Mapping[str, Any],
    resources: Mapping[str, Any],
) -> dict[str, Any]:
    """The raw tables (as a scenario file would give them) that the flags declare."""
    run = {
        RUN_FLAGS[flag]: from_text(flag, RUN_FLAGS[flag], text) for flag, text in run_flags.items() if text is not None
    }
    for item in sets:
        key, text = _key_value("set", item)
        run[key] = from_text(f"set {key}", key, text)
    grid = {
        GRID_FLAGS[flag]: values_from_text(flag, GRID_FLAGS[flag], text)
        for flag, text in grid_flags.items()
        if text is not None
    }
    for item in grids:
        key, text = _key_value("grid", item)
        grid[key] = values_from_text(f"grid {key}", key, text)
    return {
        "sweep": {key: value for key, value in sweep.items() if value is not None},
        "run": run,
        "grid": grid,
        "resources": {key: value for key, value in resources.items() if value is not None},
    }
