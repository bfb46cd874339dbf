"""A sweep's arms and the paired comparisons between them, as the report's tables.

An arm is a setting: a cell's grid values without the seed, whose seeds are its replicates. Each
arm gets its mean final accuracy with a 95% t-interval over seeds and the binomial standard error
of one run's accuracy on its evaluation rows. Two arms that differ in exactly one grid key and ran
the same seeds are compared seed by seed (`statistics.paired_difference`): rule against rule or ε
against ε with everything else, the seed's data and sampling included, held fixed.

When the grid varies `split-seed` (`SweepData.split_key`), an arm's replicates are its (split, seed)
runs: its accuracy is the mean over splits of each split's mean over its seeds, its interval the
t-interval over those split means (`statistics.two_stage_interval`), and a pair is compared on the
(split, seed) units both ran, per split first and then over the shared splits.

In a sweep with [tune] each arm runs at the values its own tuning chose, so two arms of a pair may
also differ in those: the pair names both sides' tuned values and says which comparison it is.
Every pair has its paired t-test's p-value; on request (`holm`) the pairs' p-values are adjusted
as one family by Holm's step-down (Holm 1979), and a verdict read off the adjusted ones.
"""

from __future__ import annotations

from collections.abc import Hashable

import pandas as pd

from fedprivacy.reports.statistics import binomial_se, holm_adjusted, paired_difference, two_stage_interval
from fedprivacy.reports.sweep_data import SEED, SweepData
from fedprivacy.reports.sweep_tuning import value_text

NOT_RESOLVED = "not resolved"
# A key with more values than this shows only neighbouring values' pairs in report.md (all of them
# are in paired_differences.csv), and no key shows more than MAX_SHOWN pairs.
ALL_PAIRS_UP_TO = 3
MAX_SHOWN = 30
PAIR_COLUMNS = ("a", "b", "shared_seeds", "difference_mean", "ci95_low", "ci95_high", "verdict")
TUNED_COLUMNS = ("tuned_a", "tuned_b", "compared")  # a tuned sweep's pairs only, after b
HOLM_COLUMNS = ("p_holm", "verdict_holm")  # with holm only, after p_value
HOLM_LEVEL = 0.05  # verdict_holm resolves a pair whose adjusted p-value is below this (the intervals' 95%)
OWN_OPTIMUM = "each arm at its own tuned optimum"
SAME_TUNED = "tuned values equal"


def arm_keys(data: SweepData) -> list[str]:
    """The setting's keys: the lines' keys, then the horizontal axis's and those linked with it."""
    rest = [k for k in data.setting_keys if k not in data.series_keys]
    return [*data.series_keys, *sorted(rest, key=lambda k: k != data.x_key)]


def _arms(cells: pd.DataFrame, keys: list[str]) -> list[tuple[tuple, pd.DataFrame]]:
    """(grid values, cells) per arm, in the order the cells come (one arm of everything without keys)."""
    if not keys:
        return [((), cells)] if len(cells) else []
    found = cells.groupby(keys, sort=False, dropna=False)
    return [(values if isinstance(values, tuple) else (values,), rows) for values, rows in found]


def arm_table(data: SweepData) -> pd.DataFrame:
    """Per arm: seeds, mean, sd and 95% interval of the final accuracy, its binomial s.e. and
    evaluation rows, mean best accuracy, the largest ε any client spent (and, with client-level DP,
    the clients' mean and the federation's ε spent), whether every cell kept every client within budget.

    `evaluation_rows` is the smallest over the arm's seeds (a seed can split the data differently), so
    `binomial_se` = sqrt(p(1 − p)/evaluation_rows) at the mean accuracy p errs on the wide side.

    Pooled over splits (`SweepData.split_key`), `splits` (the arm's split-seeds) comes before `seeds`
    (its distinct seeds), and the mean, sd and interval are `two_stage_interval`'s, over split means.
    """
    keys = arm_keys(data)
    split = data.split_key
    rows = []
    for values, cells in _arms(data.measured, keys):
        splits = cells[split].tolist() if split else None
        interval = two_stage_interval(cells["final_accuracy"].to_numpy(), splits)
        evaluation_rows = cells["evaluation_rows"].min() if "evaluation_rows" in cells else float("nan")
        counts = {"seeds": interval.n}
        if split:
            seeds = cells[SEED].nunique() if SEED in cells else 1
            counts = {"splits": cells[split].nunique(), "seeds": seeds}
        rows.append(
            {
                **dict(zip(keys, values)),
                **counts,
                "final_accuracy_mean": interval.mean,
                "final_accuracy_sd": interval.sd,
                "ci95_low": interval.low,
                "ci95_high": interval.high,
                "binomial_se": binomial_se(interval.mean, evaluation_rows),
                "evaluation_rows": None if pd.isna(evaluation_rows) else int(evaluation_rows),
                "best_accuracy_mean": cells["best_accuracy"].mean(),
                "epsilon_spent_max": cells["epsilon_spent_max"].max(),
                **_both_levels(cells),
                "all_within_budget": bool(cells["all_within_budget"].astype(bool).all()),
            }
        )
    table = pd.DataFrame(rows)
    if len(table):
        table["evaluation_rows"] = table["evaluation_rows"].astype("Int64")
    return table


def _both_levels(cells: pd.DataFrame) -> dict[str, float]:
    """For sweeps with client-level DP: the clients' mean record-level ε spent (mean over the arm's
    cells) beside the largest, and the federation's ε spent (largest over the cells)."""
    if "federation_epsilon_spent" not in cells or cells["federation_epsilon_spent"].isna().all():
        return {}
    return {
        "epsilon_spent_mean": cells["epsilon_spent_mean"].mean(),
        "federation_epsilon_spent": cells["federation_epsilon_spent"].max(),
    }


def _step(keys: list[str], values: tuple) -> Hashable:
    """An axis's value in a pair: the key's own value, or `k=v, k=v` for a linked group's step."""
    return values[0] if len(keys) == 1 else ", ".join(f"{k}={v}" for k, v in zip(keys, values))


def _along(data: SweepData, arms: list[tuple], keys: list[str], axis: list[str]) -> dict[tuple, list[tuple]]:
    """The arms grouped by their values outside `axis`, each group in grid order along it."""
    inside = [keys.index(k) for k in axis]
    outside = [i for i in range(len(keys)) if i not in inside]
    steps = data.cells[axis].apply(tuple, axis=1) if len(data.cells) else pd.Series(dtype=object)
    order = {step: index for index, step in enumerate(pd.unique(steps))}  # sweep.csv lists cells in grid order
    fixed: dict[tuple, list[tuple]] = {}
    for values in arms:
        fixed.setdefault(tuple(values[i] for i in outside), []).append(values)
    for group in fixed.values():
        group.sort(key=lambda values: order.get(tuple(values[i] for i in inside), len(order)))
    return fixed


def _verdict(mean: float, resolved: bool) -> str:
    return NOT_RESOLVED if not resolved else "b higher" if mean > 0 else "b lower"


def _tuned_text(values: dict | None) -> str | None:
    return None if values is None else ", ".join(f"{key}={value_text(value)}" for key, value in values.items())


def _tuned_columns(tuned: dict[tuple, dict | None], a: tuple, b: tuple) -> dict[str, str | None]:
    """Both sides' tuned values and what the pair compares: `compared` blank when a side has no choice."""
    found = (tuned.get(a), tuned.get(b))
    compared = None if None in found else SAME_TUNED if found[0] == found[1] else OWN_OPTIMUM
    return {"tuned_a": _tuned_text(found[0]), "tuned_b": _tuned_text(found[1]), "compared": compared}


def _with_holm(table: pd.DataFrame) -> pd.DataFrame:
    """`p_holm` over every pair with a p-value (the others blank) and the verdict it gives at 5%."""
    adjusted = holm_adjusted([None if pd.isna(p) else p for p in table["p_value"]])
    verdicts = [
        None if p is None else _verdict(mean, p < HOLM_LEVEL) for p, mean in zip(adjusted, table["difference_mean"])
    ]
    return table.assign(
        p_holm=pd.Series([float("nan") if p is None else p for p in adjusted], index=table.index, dtype=float),
        verdict_holm=pd.Series(verdicts, index=table.index, dtype=object),
    )


def paired_table(data: SweepData, holm: bool = False) -> pd.DataFrame:
    """Every pair of arms that differ along one axis (a key, or a linked group's keys together) and
    share a seed: the mean of b − a over the shared seeds (b after a in grid order) and its 95%
    interval. `neighbours`: no arm lies between a and b along the axis; `verdict`: `b higher`,
    `b lower`, or `not resolved` (the interval holds 0, or fewer than 2 shared seeds give none);
    `p_value`: the paired t-test's (blank with fewer than 2 shared seeds).

    A tuned sweep's pairs add `tuned_a`, `tuned_b` (`key=value, …`: the values each arm's tuning
    chose) and `compared`: OWN_OPTIMUM where they differ, SAME_TUNED where they are equal. `holm`
    adds HOLM_COLUMNS: the p-values adjusted over every pair that has one, and the verdict at 5%.

    Pooled over splits (`SweepData.split_key`), the units are (split-seed, seed) pairs: `shared_seeds`
    counts the shared units, `shared_splits` (after it) their splits, and with 2 or more shared splits
    the interval and `p_value` are over the per-split means of b − a (`two_stage_interval`)."""
    keys = arm_keys(data)
    measured = data.measured
    split = data.split_key
    seeds = measured[SEED] if SEED in measured else pd.Series(0, index=measured.index)
    if split:
        seeds = pd.Series(list(zip(measured[split], seeds)), index=measured.index, dtype=object)
    arms = _arms(measured, keys)
    accuracy = {values: dict(zip(seeds.loc[cells.index], cells["final_accuracy"])) for values, cells in arms}
    tuned = {values: data.tuned.get(cells["cell"].iloc[0]) for values, cells in arms} if data.tuned else {}
    rows = []
    for name, axis in data.axes.items():
        inside = [keys.index(k) for k in axis]
        for arms in _along(data, list(accuracy), keys, axis).values():
            for i, a in enumerate(arms):
                for j, b in enumerate(arms[i + 1 :], start=i + 1):
                    pair = paired_difference(accuracy[a], accuracy[b], nested=bool(split))
                    if pair is None:
                        continue
                    interval = pair.interval
                    rows.append(
                        {
                            "differs_in": name,
                            **{k: (None if k in axis else v) for k, v in zip(keys, a)},
                            "a": _step(axis, tuple(a[p] for p in inside)),
                            "b": _step(axis, tuple(b[p] for p in inside)),
                            **(_tuned_columns(tuned, a, b) if tuned else {}),
                            "neighbours": j == i + 1,
                            "shared_seeds": len(pair.seeds),
                            **({"shared_splits": pair.splits} if split else {}),
                            "difference_mean": interval.mean,
                            "ci95_low": interval.low,
                            "ci95_high": interval.high,
                            "verdict": _verdict(interval.mean, pair.resolved),
                            "p_value": pair.p_value,
                        }
                    )
    tuned_columns = list(TUNED_COLUMNS) if tuned else []
    columns = ["differs_in", *keys, "a", "b", *tuned_columns, "neighbours", *_pair_columns(bool(split)), "p_value"]
    # object columns first, so a key's blank (its own axis) keeps the others' integers integers
    table = pd.DataFrame(rows, columns=columns, dtype=object)
    numbers = {"difference_mean": float, "ci95_low": float, "ci95_high": float, "p_value": float}
    counts = {"shared_seeds": int, **({"shared_splits": int} if split else {})}
    table = table.astype({"neighbours": bool, **counts, **numbers})
    return _with_holm(table) if holm else table


def _pair_columns(pooled: bool) -> list[str]:
    """PAIR_COLUMNS after b: `shared_splits` after `shared_seeds` when pooled over splits."""
    after = list(PAIR_COLUMNS[2:])
    return [*after[:1], "shared_splits", *after[1:]] if pooled else after


def pairs_shown(pairs: pd.DataFrame, name: str, axis: list[str]) -> tuple[pd.DataFrame, int]:
    """The pairs along axis `name` (its keys `axis`) that report.md shows: the other keys as columns,
    then PAIR_COLUMNS (a tuned sweep's TUNED_COLUMNS after b; with Holm's columns, `p_value` and
    HOLM_COLUMNS last); and how many it leaves to paired_differences.csv. All pairs when the axis
    has few values, else those of neighbouring values; at most MAX_SHOWN."""
    along = pairs[pairs["differs_in"] == name]
    values = set(along["a"]) | set(along["b"])
    chosen = along if len(values) <= ALL_PAIRS_UP_TO else along[along["neighbours"]]
    others = [c for c in pairs.columns[1 : list(pairs.columns).index("a")] if c not in axis]
    tuned = [c for c in TUNED_COLUMNS if c in pairs]
    tests = ["p_value", *HOLM_COLUMNS] if HOLM_COLUMNS[0] in pairs else []
    shown = chosen.head(MAX_SHOWN)[[*others, "a", "b", *tuned, *_pair_columns("shared_splits" in pairs), *tests]]
    return shown, len(along) - len(shown)
