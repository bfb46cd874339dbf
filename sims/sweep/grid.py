"""The cells of a sweep: every combination of the grid's values, named, sized and validated up front.

The axes are [grid]'s keys, one value each, then the [linked.<name>] groups in file order, one
step (every key's i-th value) each; the cells are their product with the last axis varying fastest.
When the scenario compares adp with DP-SGD, every cell takes the shared step-size schedule
(`SweepSpec.shared_lr_schedule`), so the rules differ only in how they allocate noise.

A cell's name is its varied values (every key of every axis), readable and safe as a folder name
on any file system, e.g. `epsilon=0.25_rule=proactive_seed=0`. Numbers keep their shortest exact
form (0.1 stays 0.1, 1.0 becomes 1); a string with characters unsafe in a file name has them
replaced by `-` and a short digest of the original appended, so two different values can never
share a name.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass
from typing import Any

from fedprivacy.data.partition import load_clients
from fedprivacy.errors import InputError
from fedprivacy.recipe import check_model_builds, model_and_data, partition_kwargs, require_data_file
from fedprivacy.runconfig import DEFAULTS, RunSettings, parse_run_config
from sims.sweep.spec import SweepSpec

UNSAFE = re.compile(r"[^A-Za-z0-9.+-]")
MAX_NAME = 120
# Any absolute folder for validating a cell (parse_run_config insists on one); cell runners set the real one.
PLACEHOLDER_RESULTS_DIR = "/cell-results"


@dataclass(frozen=True)
class Cell:
    """One run of the sweep: its grid values, its whole run config (but results-dir) and its clients."""

    name: str
    params: dict[str, Any]
    run_config: dict[str, Any]
    num_clients: int


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def value_text(value: Any) -> str:
    """A grid value as it appears in a cell name."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        return str(value)
    safe = UNSAFE.sub("-", value) or "-"
    return safe if safe == value else f"{safe}-{_digest(value)}"


def cell_name(params: dict[str, Any]) -> str:
    """`key=value_key=value…`, shortened with a digest when it would be an unwieldy folder name."""
    name = "_".join(f"{key}={value_text(value)}" for key, value in params.items()) or "default"
    return name if len(name) <= MAX_NAME else f"{name[: MAX_NAME - 9]}-{_digest(name)}"


def _settings(config: dict[str, Any]) -> RunSettings:
    return parse_run_config({**config, "results-dir": PLACEHOLDER_RESULTS_DIR})


def _client_count(spec: SweepSpec, settings: RunSettings, counted: dict[str, int]) -> int:
    """`[sweep] clients`, or one per natural partition of the data (counted once per data setting)."""
    if spec.clients is not None:
        return spec.clients
    if not settings.partition_by:
        raise InputError(
            "sweep.clients",
            None,
            f"needs a number of clients: partitioning {settings.partitioning!r} without "
            "partition-by has no natural clients",
        )
    partition = partition_kwargs(settings, None)
    # everything that shapes the clients (source, its options and split) but the seed, which only deals rows
    data = repr(sorted((key, value) for key, value in partition.items() if key != "seed"))
    if data not in counted:
        counted[data] = len(load_clients(**partition))
    return counted[data]


def axes(spec: SweepSpec) -> list[list[dict[str, Any]]]:
    """The grid's axes in declared order, each a list of steps (the values one step sets): a
    [grid] key's values one by one, then each linked group's i-th values together."""
    found = [[{key: value} for value in values] for key, values in spec.grid.items()]
    for group in spec.linked.values():
        found.append([dict(zip(group, step, strict=True)) for step in zip(*group.values(), strict=True)])
    return found


def schedule_note(spec: SweepSpec) -> str | None:
    """The line a sweep prints when it gives every cell adp's step-size schedule (None: it does not)."""
    if spec.shared_lr_schedule is None:
        return None
    return (
        f"matched schedule: every cell steps with lr-schedule={spec.shared_lr_schedule!r} (adp's), so adp and "
        "DP-SGD differ only in their noise (matched-schedule = false in the sweep table keeps each rule's own)"
    )


def _check_model_once(settings: RunSettings, built: set[tuple[Any, ...]]) -> None:
    """`check_model_builds` once per model and the data it is built on: a model the trainer refuses
    fails the sweep's validation, not each of its cells."""
    key = model_and_data(settings)
    if key not in built:
        check_model_builds(settings)
        built.add(key)


def cells(spec: SweepSpec) -> list[Cell]:
    """Every cell of the grid in declared order (the last axis varies fastest), each validated."""
    found, counted, built = [], {}, set()
    for combination in itertools.product(*axes(spec)):
        params = {key: value for step in combination for key, value in step.items()}
        config = {**DEFAULTS, **spec.run, **params}
        del config["results-dir"]
        if spec.shared_lr_schedule is not None:
            config["lr-schedule"] = spec.shared_lr_schedule
        if spec.seeded_noise:
            config["noise-seed"] = config["seed"]
        settings = _settings(config)  # every cell's run config is validated before anything runs
        require_data_file(settings)
        _check_model_once(settings, built)
        num_clients = _client_count(spec, settings, counted)
        settings.check_clients(num_clients, field="sweep.clients")
        found.append(Cell(cell_name(params), params, config, num_clients))
    names = [cell.name for cell in found]
    clash = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if clash is not None:  # only a digest collision could get here: values are unique per key
        raise InputError("grid", clash, "two cells would share this folder name")
    return found
