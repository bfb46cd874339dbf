"""A sweep's scenario: what a scenario file (TOML) or the command's flags declare, validated whole.

A scenario's tables ([grid] or [linked] is required):

    [sweep]      name, engine (a module of sims/sweep/engines), clients (simulated clients; omitted:
                 one per natural partition), baseline (true: also run the non-private baseline),
                 baseline-learning-rate (the baseline's η; default the cells' own, which may suit
                 clipped, noisy steps better than plain SGD),
                 seeded-noise (true: every cell's noise-seed is its seed, for reproducible experiments),
                 matched-schedule (true, the default: a grid of rules with adp gives every cell adp's
                 step-size schedule, so the rules differ only in their noise; see `shared_lr_schedule`)
    [run]        fixed run-config keys (fedprivacy.runconfig.DEFAULTS), the same in every cell
    [grid]       run-config key = [values]: the sweep runs every combination, one cell each
    [linked.<name>]  run-config keys with lists of one length: ONE axis of the grid whose i-th step
                 sets every key to its i-th value (ε with its own k, η with C so that η·C is held)
    [tune]       run-config key = [candidates]: each cell's setting chosen on validation rows before
                 it runs, with [sweep] tune-seeds, tune-select, tune-trials, split-seed (sims.sweep.tune_spec);
                 baseline-learning-rate = [candidates]: the non-private baseline's own η candidates
    [resources]  client-cpus, client-gpus: what each simulated client gets under the flower engine;
                 workers, device, worker-gpus: the fast engine's workers, their device (cpu, cuda or
                 auto) and each one's share of a GPU (0: the GPUs shared evenly)

Everything is checked before anything runs, and the first problem is one `InputError` naming the
field (`grid.epsilon`), the value and what is allowed: an unknown table or key, a value of the
wrong type (typed by the key's default), an empty grid, a duplicate cell (a value listed twice,
or a key both fixed and varied), a linked group that is empty, has lists of unequal lengths or
shares a key with [run], [grid] or another group, a common value beside a per-client list that
would override it (`epsilon` with `epsilons`, `delta` with `deltas`, `epochs` with
`client-epochs`), an unknown engine. The cells are the product of the axes in declared order,
[grid]'s keys then the linked groups in file order, the last varying fastest. Relative paths in a file
are relative to the file, so a scenario can name data beside the repository. The sweep sets
`results-dir` and the ledger (each cell gets its own), so a scenario may not.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedprivacy.errors import InputError
from fedprivacy.privacy.rules import find_rule
from fedprivacy.runconfig import DEFAULTS
from sims.sweep.engine_registry import engine_names
from sims.sweep.tune_spec import TUNE_OPTIONS, TuneSpec, read_tune

TABLES = ("sweep", "run", "grid", "linked", "tune", "resources")
SWEEP_KEYS = (
    "name",
    "engine",
    "clients",
    "baseline",
    "baseline-learning-rate",
    "seeded-noise",
    "matched-schedule",
    *TUNE_OPTIONS,
)
RESOURCE_KEYS = ("client-cpus", "client-gpus", "workers", "device", "worker-gpus")
FAST_DEVICES = ("cpu", "cuda", "auto")  # sims.fast.pool.DEVICES, without importing torch here
SET_BY_THE_SWEEP = ("results-dir", "ledger-path")
PATH_KEYS = ("data-path",)


@dataclass(frozen=True)
class Resources:
    """What Flower's simulation gives each client (flower engine): whole CPUs, a fraction of a GPU;
    and the fast engine's workers (1: in the sweep's process; more: Ray actors), their device and
    GPU share each (0: the GPUs shared evenly, `sims.fast.pool.gpu_share`)."""

    client_cpus: int = 1
    client_gpus: float = 0.0
    workers: int = 1
    worker_gpus: float = 0.0
    device: str = "auto"


@dataclass(frozen=True)
class SweepSpec:
    """A validated scenario: `run` holds the fixed keys, `grid` the varied ones in declared order,
    `linked` the groups of keys varied together (group name -> key -> values, all one length)."""

    name: str
    run: dict[str, Any]
    grid: dict[str, tuple[Any, ...]]
    linked: dict[str, dict[str, tuple[Any, ...]]] = field(default_factory=dict)
    matched_schedule: bool = True
    engine: str = "inprocess"
    clients: int | None = None
    baseline: bool = True
    baseline_learning_rate: float | None = None  # None: each baseline takes its cells' learning-rate
    seeded_noise: bool = False
    resources: Resources = field(default_factory=Resources)
    tune: TuneSpec | None = None  # [tune]: each cell's setting chosen on validation rows (sims.sweep.tuning)

    @property
    def varied(self) -> list[str]:
        """Every varied key in cell-name order: [grid]'s, then each linked group's."""
        return [*self.grid, *(key for group in self.linked.values() for key in group)]

    def values_of(self, key: str) -> tuple[Any, ...]:
        """The values a key takes across the cells: its grid or linked list, else its fixed value."""
        if key in self.grid:
            return self.grid[key]
        group = next((group for group in self.linked.values() if key in group), None)
        return group[key] if group is not None else (self.run.get(key, DEFAULTS[key]),)

    @property
    def shared_lr_schedule(self) -> str | None:
        """The lr-schedule every cell gets, or None (each its rule's own). `lr-schedule = ""` means
        the rule's own, inverse_sqrt for adp and constant for DP-SGD, so a grid over rules with adp
        would compare step sizes as well as noise; unless the scenario sets lr-schedule or
        `matched-schedule = false`, every cell takes adp's (Wu et al.'s comparison: the same steps,
        only the noise allocation differs)."""
        rules = set(self.values_of("rule"))
        if (
            not self.matched_schedule
            or "adp" not in rules
            or len(rules) < 2
            or "lr-schedule" in {*self.run, *self.varied, *(self.tune.space if self.tune else ())}
        ):
            return None
        return find_rule("adp").default_schedules(None)[0]

    def to_dict(self) -> dict[str, Any]:
        """The scenario as plain data (sweep.json), grid and linked values as lists."""
        return {
            "name": self.name,
            "engine": self.engine,
            "clients": self.clients,
            "baseline": self.baseline,
            "baseline_learning_rate": self.baseline_learning_rate,
            "seeded_noise": self.seeded_noise,
            "resources": vars(self.resources),
            "run": self.run,
            "grid": {key: list(values) for key, values in self.grid.items()},
            "linked": {
                name: {key: list(values) for key, values in group.items()} for name, group in self.linked.items()
            },
            "matched_schedule": self.matched_schedule,
            "shared_lr_schedule": self.shared_lr_schedule,
            "tune": self.tune.to_dict() if self.tune else None,
        }


def read_scenario(path: Path) -> dict[str, Any]:
    """The raw tables of a scenario file (validated by `validate`)."""
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise InputError("scenario", str(path), "no such file") from None
    except tomllib.TOMLDecodeError as error:
        raise InputError("scenario", str(path), f"not valid TOML: {error}") from None


def typed_value(field_name: str, key: str, value: Any) -> Any:
    """`value` as the type of the key's default (an int is a fine float); anything else is refused."""
    default = DEFAULTS[key]
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InputError(field_name, value, "must be a number")
        return float(value)
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(field_name, value, "must be an integer")
        return value
    if not isinstance(value, str):
        raise InputError(field_name, value, "must be a string")
    return value


def check_run_key(field_name: str, key: str, value: Any) -> None:
    """`key` must be a run-config key that a scenario may set."""
    if key in SET_BY_THE_SWEEP:
        raise InputError(
            field_name,
            value,
            "is set by the sweep (each cell writes under <out>/cells/<cell>/ with its own ledger); leave it out",
        )
    if key not in DEFAULTS:
        raise InputError(
            field_name,
            value,
            f"not a run-config key; known keys: {', '.join(k for k in DEFAULTS if k not in SET_BY_THE_SWEEP)}",
        )


def _path(value: str, base_dir: Path) -> str:
    """~ and $VARS expanded; a relative path is taken from `base_dir` (the scenario file's folder)."""
    if value.strip() == "":
        return value
    path = Path(os.path.expandvars(os.path.expanduser(value.strip())))
    return str(path if path.is_absolute() else (base_dir / path).resolve())


def _run_value(field_name: str, key: str, value: Any, base_dir: Path) -> Any:
    check_run_key(field_name, key, value)
    typed = typed_value(field_name, key, value)
    return _path(typed, base_dir) if key in PATH_KEYS else typed


def _table(raw: Mapping[str, Any], name: str) -> dict[str, Any]:
    table = raw.get(name, {})
    if not isinstance(table, dict):
        raise InputError(name, table, "must be a table ([" + name + "])")
    return table


def _grid(raw: Mapping[str, Any], run: Mapping[str, Any], base_dir: Path) -> dict[str, tuple[Any, ...]]:
    table = _table(raw, "grid")
    if not table and not _table(raw, "linked"):
        raise InputError(
            "grid",
            table,
            "needs at least one run-config key with a list of values, e.g. epsilon = [0.5, 1, 2] "
            "(or a [linked.<name>] group)",
        )
    grid = {}
    for key, values in table.items():
        name = f"grid.{key}"
        check_run_key(name, key, values)
        if key in run:
            raise InputError(name, values, f"{key} is also fixed in [run]: a key is either fixed or varied")
        typed = _values(name, key, values, base_dir)
        repeated = next((v for i, v in enumerate(typed) if v in typed[:i]), None)
        if repeated is not None:
            raise InputError(name, values, f"lists {repeated!r} twice: every cell of the grid must be different")
        grid[key] = tuple(typed)
    return grid


def _values(name: str, key: str, values: Any, base_dir: Path) -> list[Any]:
    """A non-empty list of a key's values, each typed like the key's default."""
    if not isinstance(values, list):
        raise InputError(name, values, "must be a list of values, e.g. [1, 2]")
    if not values:
        raise InputError(name, values, "needs at least one value")
    return [_run_value(name, key, value, base_dir) for value in values]


LINKED_EXAMPLE = "e.g. [linked.budget] with epsilon = [0.25, 1, 4] and epochs = [4, 8, 16]"


def _linked(
    raw: Mapping[str, Any], run: Mapping[str, Any], grid: Mapping[str, Any], base_dir: Path
) -> dict[str, dict[str, tuple[Any, ...]]]:
    """The [linked.<name>] groups. Each is one axis of the grid whose i-th step sets each of its
    keys to its i-th value, so a key belongs to one group and to neither [run] nor [grid]."""
    linked: dict[str, dict[str, tuple[Any, ...]]] = {}
    owner: dict[str, str] = {}  # key -> the group that varies it
    for name, table in _table(raw, "linked").items():
        prefix = f"linked.{name}"
        if not isinstance(table, dict):
            raise InputError(
                prefix, table, f"must be a table of run-config keys with lists of one length, {LINKED_EXAMPLE}"
            )
        if not table:
            raise InputError(
                prefix, table, f"needs at least one run-config key with a list of values, {LINKED_EXAMPLE}"
            )
        group: dict[str, tuple[Any, ...]] = {}
        for key, values in table.items():
            field_name = f"{prefix}.{key}"
            check_run_key(field_name, key, values)
            elsewhere = next(
                (place for place, keys in (("[run]", run), ("[grid]", grid)) if key in keys),
                f"[linked.{owner[key]}]" if key in owner else None,
            )
            if elsewhere is not None:
                raise InputError(
                    field_name,
                    values,
                    f"{key} is also in {elsewhere}: a key is fixed or on one axis of the grid, never both",
                )
            typed = _values(field_name, key, values, base_dir)
            first = next(iter(group), None)
            if first is not None and len(typed) != len(group[first]):
                raise InputError(
                    field_name,
                    values,
                    f"has {len(typed)} values, {prefix}.{first} has {len(group[first])}: a linked group's "
                    "i-th values go together, so every key needs one value per step",
                )
            group[key] = tuple(typed)
            owner[key] = name
        steps = list(zip(*group.values(), strict=True))
        repeated = next((step for i, step in enumerate(steps) if step in steps[:i]), None)
        if repeated is not None:
            raise InputError(
                prefix,
                {key: list(values) for key, values in group.items()},
                f"lists the step {dict(zip(group, repeated, strict=True))} twice: every cell of the grid "
                "must be different",
            )
        linked[name] = group
    return linked


def _axes(
    grid: Mapping[str, tuple[Any, ...]], linked: Mapping[str, Mapping[str, tuple[Any, ...]]]
) -> dict[str, tuple[str, tuple[Any, ...]]]:
    """Each varied key's field (`grid.epsilon`, `linked.budget.epsilon`) and its values."""
    axes = {key: (f"grid.{key}", values) for key, values in grid.items()}
    for name, group in linked.items():
        axes.update({key: (f"linked.{name}.{key}", values) for key, values in group.items()})
    return axes


def _flag(table: Mapping[str, Any], prefix: str, key: str, default: bool) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise InputError(f"{prefix}.{key}", value, "must be true or false")
    return value


def _resources(raw: Mapping[str, Any]) -> Resources:
    table = _table(raw, "resources")
    _known(table, "resources", RESOURCE_KEYS)
    cpus = table.get("client-cpus", 1)
    if isinstance(cpus, bool) or not isinstance(cpus, int) or cpus < 1:
        raise InputError(
            "resources.client-cpus", cpus, "must be a whole number of CPUs >= 1 (Flower takes no fractions)"
        )
    gpus = table.get("client-gpus", 0.0)
    if isinstance(gpus, bool) or not isinstance(gpus, int | float) or not 0 <= gpus <= 1:
        raise InputError(
            "resources.client-gpus",
            gpus,
            "must be a fraction of a GPU in [0, 1], e.g. 0.25 for four clients per GPU",
        )
    workers = table.get("workers", 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError("resources.workers", workers, "must be a whole number of fast-engine workers >= 1")
    worker_gpus = table.get("worker-gpus", 0.0)
    if isinstance(worker_gpus, bool) or not isinstance(worker_gpus, int | float) or not 0 <= worker_gpus <= 1:
        raise InputError(
            "resources.worker-gpus",
            worker_gpus,
            "must be a fraction of a GPU in [0, 1], e.g. 0.5 for two workers per GPU",
        )
    device = table.get("device", "auto")
    if device not in FAST_DEVICES:
        raise InputError("resources.device", device, f"must be one of {', '.join(FAST_DEVICES)}")
    if device == "cpu" and worker_gpus > 0:
        raise InputError("resources.worker-gpus", worker_gpus, "a GPU share needs device cuda or auto, not cpu")
    return Resources(
        client_cpus=cpus, client_gpus=float(gpus), workers=workers, worker_gpus=float(worker_gpus), device=device
    )


def _known(table: Mapping[str, Any], prefix: str, keys: tuple[str, ...]) -> None:
    unknown = [key for key in table if key not in keys]
    if unknown:
        raise InputError(
            f"{prefix}.{unknown[0]}",
            table[unknown[0]],
            f"not a [{prefix}] key; known keys: {', '.join(keys)}",
        )


def validate(raw: Mapping[str, Any], *, base_dir: Path, default_name: str) -> SweepSpec:
    """A `SweepSpec` from raw tables (a parsed file, or the flags); the first problem is an InputError."""
    unknown = [name for name in raw if name not in TABLES]
    if unknown:
        raise InputError(unknown[0], raw[unknown[0]], f"not a scenario table; known tables: {', '.join(TABLES)}")
    sweep = _table(raw, "sweep")
    _known(sweep, "sweep", SWEEP_KEYS)
    run = {key: _run_value(f"run.{key}", key, value, base_dir) for key, value in _table(raw, "run").items()}
    grid = _grid(raw, run, base_dir)
    linked = _linked(raw, run, grid, base_dir)
    axes = _axes(grid, linked)
    _one_source_per_budget(run, axes)
    engine = sweep.get("engine", "inprocess")
    if engine not in engine_names():
        raise InputError("sweep.engine", engine, f"must be one of: {', '.join(engine_names())}")
    clients = sweep.get("clients")
    if clients is not None and (isinstance(clients, bool) or not isinstance(clients, int) or clients < 1):
        raise InputError(
            "sweep.clients", clients, "must be an integer >= 1 (omit it for one client per natural partition)"
        )
    name = sweep.get("name", default_name)
    if not isinstance(name, str) or not name.strip():
        raise InputError("sweep.name", name, "must be a non-empty string")
    seeded_noise = _flag(sweep, "sweep", "seeded-noise", False)
    if seeded_noise and "noise-seed" in {*run, *axes}:
        raise InputError(
            "sweep.seeded-noise",
            True,
            "sets every cell's noise-seed to its seed: drop noise-seed from [run], [grid] and [linked]",
        )
    placed = {**{key: (f"run.{key}", (value,)) for key, value in run.items()}, **axes}
    tune = read_tune(
        raw, sweep, placed, lambda field_name, key, value: _run_value(field_name, key, value, base_dir), seeded_noise
    )
    if tune is not None and "split-seed" not in placed:  # every cell cuts its data as the tuning runs do
        run = {**run, "split-seed": tune.split_seed}
    return SweepSpec(
        name=name.strip(),
        run=run,
        grid=grid,
        linked=linked,
        matched_schedule=_flag(sweep, "sweep", "matched-schedule", True),
        engine=engine,
        clients=clients,
        baseline=_flag(sweep, "sweep", "baseline", True),
        seeded_noise=seeded_noise,
        resources=_resources(raw),
        baseline_learning_rate=_baseline_learning_rate(sweep),
        tune=tune,
    )


def _one_source_per_budget(run: Mapping[str, Any], axes: Mapping[str, tuple[str, tuple[Any, ...]]]) -> None:
    """A per-client list (`epsilons`, `deltas`, `client-epochs`) sets every client's value, so a
    common `epsilon`, `delta` or `epochs` beside it would be ignored: the cells would be labelled
    by a value none of them ran."""
    for lists, common in (("epsilons", "epsilon"), ("deltas", "delta"), ("client-epochs", "epochs")):
        listed = axes[lists][1] if lists in axes else ()
        if any(value != "" for value in (run.get(lists, ""), *listed)) and (common in run or common in axes):
            field_name, value = (
                (axes[common][0], list(axes[common][1])) if common in axes else (f"run.{common}", run[common])
            )
            raise InputError(
                field_name,
                value,
                f"{lists} is also given and sets every client's {common}, so this "
                f"would be ignored: give one or the other",
            )


def _baseline_learning_rate(sweep: Mapping[str, Any]) -> float | None:
    value = sweep.get("baseline-learning-rate")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InputError(
            "sweep.baseline-learning-rate",
            value,
            "must be a number > 0 (omit it to use the cells' learning-rate)",
        )
    return float(value)
