"""A scenario's `[tune]` table and its `[sweep] tune-*` options, validated (sims.sweep.spec calls it).

    [tune]    run-config key = [candidate values], e.g. learning-rate = [0.3, 1, 3]: every cell's
              setting is chosen among these on validation rows before the cell runs (sims.sweep.tuning);
              and baseline-learning-rate = [candidates]: the non-private baseline's own η candidates
              (default: [tune]'s learning-rate list, which is sized for clipped, noisy steps)
    [sweep]   tune-seeds (the tuning runs' seeds, default [1000, 1001]: never a cell's seed),
              tune-seeds-close (extra seeds for the best candidate and those close to it, default the
              three seeds after the largest tune seed that no cell uses, [1002, 1003, 1004] with the
              default seeds; [] adds none),
              tune-select ("final": the mean final validation accuracy; "best-round": the mean of
              each run's best round), tune-trials (0: every combination; n: n combinations drawn at
              random, the same n for the same scenario), split-seed (default 0: every run of the
              sweep cuts its clients' data the same way, so they share test rows and the tuning's
              validation rows come from the cells' own training rows),
              tune-private (true: private random search, Papernot & Steinke 2022: a random number
              of trials, mean tune-trials-mean and shape tune-trials-shape, each a candidate drawn
              at random, scored on validation rows with Gaussian noise of std tune-score-noise
              records; its cost per client in choice.json; sims.sweep.private_tuning)

This module only checks; the values are typed by sims.sweep.spec (`value`), so a candidate is
typed and its path resolved like any other run-config value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fedprivacy.errors import InputError, positive
from fedprivacy.runconfig import DEFAULTS

PRIVATE_OPTIONS = ("tune-trials-mean", "tune-trials-shape", "tune-score-noise")
TUNE_OPTIONS = (
    "tune-seeds",
    "tune-seeds-close",
    "tune-select",
    "tune-trials",
    "split-seed",
    "tune-private",
    *PRIVATE_OPTIONS,
)
SELECTIONS = ("final", "best-round")
MAX_TRIALS_MEAN = 1000  # a mean number of private trials beyond it is a typo, not a search
DEFAULT_SEEDS = (1000, 1001)
DEFAULT_CLOSE_COUNT = 3  # tune-seeds-close when not given: this many seeds after the largest tune seed
# Keys that decide which rows or which randomness a run gets: the tuning sets them itself (the
# tuning runs' seeds, evaluate-on = "validation", the sweep's split-seed), so they cannot be searched.
NOT_TUNABLE = ("seed", "noise-seed", "split-seed", "evaluate-on", "validation-fraction", "test-fraction")
# Fixed or varied elsewhere, these would contradict the tuning: cells evaluate on test rows, and a
# split-seed of -1 (the run's seed) would cut the tuning runs' rows from other data than the cells'.
REFUSED_BESIDE_TUNE = ("evaluate-on",)
# Not a run-config key: the non-private baseline's own η candidates (sims.sweep.baseline_jobs.baseline_tuning). Plain
# SGD tolerates other steps than clipped, noisy SGD, so the cells' learning-rate list can miss its best.
BASELINE_KEY = "baseline-learning-rate"


@dataclass(frozen=True)
class PrivateSearch:
    """Private random search: K ~ a truncated negative binomial of mean `trials_mean` and shape
    `trials_shape` (1: geometric), each trial's validation score a count of correct predictions
    with Gaussian noise of std `score_noise` records; `seeded`: the draws come from the arm's
    name (reproducible, for experiments), otherwise from a fresh OS key per arm."""

    trials_mean: float = 10.0
    trials_shape: float = 1.0
    score_noise: float = 10.0
    seeded: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "trials_mean": self.trials_mean,
            "trials_shape": self.trials_shape,
            "score_noise": self.score_noise,
            "seeded": self.seeded,
        }


@dataclass(frozen=True)
class TuneSpec:
    """The search space (key -> candidate values, in declared order) and how the tuning runs."""

    space: dict[str, tuple[Any, ...]]
    seeds: tuple[int, ...] = DEFAULT_SEEDS
    select: str = "final"
    trials: int = 0  # 0: every combination of the space
    split_seed: int = 0
    baseline_learning_rates: tuple[float, ...] = ()  # empty: the baseline tunes over space["learning-rate"]
    close_seeds: tuple[int, ...] = (1002, 1003, 1004)  # extra seeds for close candidates (sims.sweep.tuning)
    private: PrivateSearch | None = None  # tune-private = true: the cells' tuning is private random search

    @property
    def combinations(self) -> int:
        return math.prod(len(values) for values in self.space.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "space": {key: list(values) for key, values in self.space.items()},
            "seeds": list(self.seeds),
            "select": self.select,
            "trials": self.trials,
            "split_seed": self.split_seed,
            "baseline_learning_rate": list(self.baseline_learning_rates),
            "close_seeds": list(self.close_seeds),
            "private": self.private.to_dict() if self.private else None,
        }


Placed = Mapping[str, tuple[str, tuple[Any, ...]]]  # key -> (its field, e.g. "grid.seed"; its values)


def _space(
    table: Mapping[str, Any], placed: Placed, value: Callable[[str, str, Any], Any]
) -> dict[str, tuple[Any, ...]]:
    space = {}
    for key, values in table.items():
        name = f"tune.{key}"
        if key in NOT_TUNABLE:
            raise InputError(
                name,
                values,
                "decides which rows or seeds a run uses, which the tuning sets itself: tune any run-config key "
                f"but {', '.join(NOT_TUNABLE)}",
            )
        if key in placed:
            raise InputError(
                name, values, f"{key} is also in {placed[key][0]}: a key is fixed, varied or tuned, one of the three"
            )
        if not isinstance(values, list) or not values:
            raise InputError(name, values, "must be a non-empty list of candidate values, e.g. [0.3, 1, 3]")
        typed = [value(name, key, candidate) for candidate in values]
        repeated = next((v for i, v in enumerate(typed) if v in typed[:i]), None)
        if repeated is not None:
            raise InputError(name, values, f"lists {repeated!r} twice: every candidate must be different")
        space[key] = tuple(typed)
    return space


def _baseline_rates(candidates: Any, sweep: Mapping[str, Any]) -> tuple[float, ...]:
    """[tune] baseline-learning-rate: learning rates > 0, each once, for a baseline the sweep runs."""
    name = f"tune.{BASELINE_KEY}"
    if candidates is None:
        return ()
    if "baseline-learning-rate" in sweep:
        raise InputError(
            name,
            candidates,
            f"sweep.baseline-learning-rate = {sweep['baseline-learning-rate']!r} also sets the baseline's η: give "
            "one fixed η there or candidates here, not both",
        )
    if sweep.get("baseline") is False:
        raise InputError(name, candidates, "tunes the non-private baseline, but sweep.baseline = false runs none")
    if not isinstance(candidates, list) or not candidates:
        raise InputError(name, candidates, "must be a non-empty list of learning rates > 0, e.g. [0.3, 1, 3]")
    rates = []
    for candidate in candidates:
        if isinstance(candidate, bool) or not isinstance(candidate, int | float):
            raise InputError(name, candidates, f"{candidate!r} is not a number: every candidate must be a number > 0")
        try:
            rates.append(positive(name, candidate))
        except InputError:
            raise InputError(name, candidates, f"{candidate!r}: every candidate must be a finite number > 0") from None
    repeated = next((rate for i, rate in enumerate(rates) if rate in rates[:i]), None)
    if repeated is not None:
        raise InputError(name, candidates, f"lists {repeated!r} twice: every candidate must be different")
    return tuple(rates)


def _seed_list(
    sweep: Mapping[str, Any], key: str, seeds: Any, placed: Placed, example: str, empty: bool
) -> tuple[int, ...]:
    """A list of tuning seeds: integers >= 0, each once, none a cell's seed."""
    name = f"sweep.{key}"
    if (
        not isinstance(seeds, list)
        or (not seeds and not empty)
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds)
    ):
        kind = "a list" if empty else "a non-empty list"
        raise InputError(name, seeds, f"must be {kind} of integers >= 0, e.g. {example}")
    if len(set(seeds)) != len(seeds):
        raise InputError(name, seeds, "lists a seed twice: each tuning run needs its own")
    field_name, used = placed.get("seed", ("the default seed", (DEFAULTS["seed"],)))
    clash = next((s for s in seeds if s in used), None)
    if clash is not None:
        raise InputError(
            name,
            seeds,
            f"{clash} is also a cell's seed ({field_name} = {list(used)}): the chosen setting is tested on "
            "fresh seeds, so the tuning runs need seeds no cell uses",
        )
    return tuple(seeds)


def _seeds(sweep: Mapping[str, Any], placed: Placed) -> tuple[int, ...]:
    return _seed_list(sweep, "tune-seeds", sweep.get("tune-seeds", list(DEFAULT_SEEDS)), placed, "[1000, 1001]", False)


def _close_seeds(sweep: Mapping[str, Any], placed: Placed, seeds: tuple[int, ...]) -> tuple[int, ...]:
    """[sweep] tune-seeds-close: the extra seeds of close candidates ([] for none). Not given: the
    DEFAULT_CLOSE_COUNT smallest seeds above the largest tune seed that no cell uses."""
    if "tune-seeds-close" not in sweep:
        used = set(placed.get("seed", ("", (DEFAULTS["seed"],)))[1])
        found: list[int] = []
        seed = max(seeds)
        while len(found) < DEFAULT_CLOSE_COUNT:
            seed += 1
            if seed not in used:
                found.append(seed)
        return tuple(found)
    close = _seed_list(sweep, "tune-seeds-close", sweep["tune-seeds-close"], placed, "[1002, 1003, 1004]", True)
    clash = next((s for s in close if s in seeds), None)
    if clash is not None:
        raise InputError(
            "sweep.tune-seeds-close",
            list(close),
            f"{clash} is also in sweep.tune-seeds = {list(seeds)}: the extra seeds must be other seeds than the "
            "tune seeds, e.g. [1002, 1003, 1004]",
        )
    return close


def _integer(sweep: Mapping[str, Any], key: str, default: int, low: int, high: int | None, allowed: str) -> int:
    number = sweep.get(key, default)
    if isinstance(number, bool) or not isinstance(number, int) or number < low or (high is not None and number > high):
        raise InputError(f"sweep.{key}", number, allowed)
    return number


def _split_seed(sweep: Mapping[str, Any], placed: Placed) -> int:
    """[sweep] split-seed, or a split-seed of [run]/[grid]/[linked] (then never -1)."""
    split_seed = _integer(
        sweep, "split-seed", 0, 0, None, "must be an integer >= 0: the seed of every run's partition and splits"
    )
    if "split-seed" not in placed:
        return split_seed
    field_name, values = placed["split-seed"]
    if "split-seed" in sweep:
        raise InputError("sweep.split-seed", split_seed, f"split-seed is also in {field_name}: give it in one place")
    if -1 in values:
        raise InputError(
            field_name,
            list(values),
            "-1 cuts each run's data by its own seed, so the tuning runs (other seeds) would validate on other rows "
            "than the cells train on: give a seed >= 0, or drop it for [sweep] split-seed (default 0)",
        )
    return split_seed


def _number(sweep: Mapping[str, Any], key: str, default: float, low: float, strict: bool, allowed: str) -> float:
    number = sweep.get(key, default)
    if (
        isinstance(number, bool)
        or not isinstance(number, int | float)
        or not math.isfinite(number)
        or number < low
        or (strict and number == low)
    ):
        raise InputError(f"sweep.{key}", number, allowed)
    return float(number)


def _private(sweep: Mapping[str, Any], select: str, trials: int, seeded: bool) -> PrivateSearch | None:
    """[sweep] tune-private and its options (refused without it, and beside what they replace)."""
    private = sweep.get("tune-private", False)
    if not isinstance(private, bool):
        raise InputError("sweep.tune-private", private, "must be true (private random search) or false")
    if not private:
        given = next((key for key in PRIVATE_OPTIONS if key in sweep), None)
        if given is not None:
            raise InputError(f"sweep.{given}", sweep[given], "sets the private tuning: it needs tune-private = true")
        return None
    if select != "final":
        raise InputError(
            "sweep.tune-select",
            select,
            "private tuning scores each trial once, on its final validation accuracy: use 'final' (a best round "
            "would release every round's score)",
        )
    if "tune-trials" in sweep:
        raise InputError(
            "sweep.tune-trials",
            trials,
            "private tuning draws the number of trials at random (the cost depends on it): give tune-trials-mean",
        )
    mean = _number(
        sweep,
        "tune-trials-mean",
        10.0,
        1.0,
        False,
        f"must be a number in [1, {MAX_TRIALS_MEAN}]: the mean number of trials",
    )
    if mean > MAX_TRIALS_MEAN:
        raise InputError(
            "sweep.tune-trials-mean", mean, f"must be a number in [1, {MAX_TRIALS_MEAN}]: the mean number of trials"
        )
    return PrivateSearch(
        mean,
        _number(
            sweep,
            "tune-trials-shape",
            1.0,
            0.0,
            False,
            "must be a number >= 0: the shape of the trial count's distribution (0 logarithmic, 1 geometric)",
        ),
        _number(
            sweep,
            "tune-score-noise",
            10.0,
            0.0,
            True,
            "must be a number > 0: the std of the Gaussian noise on each trial's count of correct validation rows",
        ),
        seeded,
    )


def read_tune(
    raw: Mapping[str, Any],
    sweep: Mapping[str, Any],
    placed: Placed,
    value: Callable[[str, str, Any], Any],
    seeded: bool = False,
) -> TuneSpec | None:
    """The scenario's tuning, or None without a [tune] table (then the tune-* options are refused).

    `placed` maps each key of [run], [grid] and [linked] to its field and values; `value(field,
    key, v)` types a run-config value as sims.sweep.spec does; `seeded`: the sweep's seeded-noise."""
    table = raw.get("tune")
    if table is None:
        given = next((key for key in TUNE_OPTIONS if key in sweep), None)
        if given is not None:
            raise InputError(f"sweep.{given}", sweep[given], "sets how the sweep tunes: it needs a [tune] table")
        return None
    if not isinstance(table, dict) or not table:
        raise InputError(
            "tune", table, "must be a table of run-config keys with candidate lists, e.g. learning-rate = [0.3, 1, 3]"
        )
    baseline_rates = _baseline_rates(table.get(BASELINE_KEY), sweep)
    space = _space({key: values for key, values in table.items() if key != BASELINE_KEY}, placed, value)
    if not space:
        raise InputError(
            "tune",
            table,
            f"tunes only the baseline: [tune] needs a run-config key for the cells beside {BASELINE_KEY} "
            "(for a baseline η of your own, give [sweep] baseline-learning-rate = <η>)",
        )
    beside = next((key for key in REFUSED_BESIDE_TUNE if key in placed), None)
    if beside is not None:
        field_name, values = placed[beside]
        raise InputError(
            field_name,
            list(values),
            "is set by the tuning (validation rows for the tuning runs, test rows for the cells): leave it out",
        )
    select = sweep.get("tune-select", "final")
    if select not in SELECTIONS:
        raise InputError("sweep.tune-select", select, f"must be one of: {', '.join(SELECTIONS)}")
    combinations = math.prod(len(values) for values in space.values())
    trials = _integer(
        sweep,
        "tune-trials",
        0,
        0,
        combinations,
        f"must be an integer in [0, {combinations}]: 0 tries all {combinations} combinations of [tune], "
        "n > 0 draws n of them at random",
    )
    seeds = _seeds(sweep, placed)
    return TuneSpec(
        space,
        seeds,
        select,
        trials,
        _split_seed(sweep, placed),
        baseline_rates,
        _close_seeds(sweep, placed, seeds),
        _private(sweep, select, trials, seeded),
    )
