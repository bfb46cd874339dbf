"""`fedprivacy report DIR`: the figures and report.md of a sweep, from its sweep.csv and cell folders.

report.md holds the tables behind the figures: accuracy per setting (mean, standard deviation,
95% t-interval and count over seeds, the binomial standard error of one run's accuracy on its
evaluation rows, mean best-round accuracy, the largest ε any client spent, whether every cell kept every
client within budget), the non-private baselines, the paired differences between settings that
share seeds (fedprivacy.reports.sweep_arms; with `holm`, their p-values adjusted by Holm 1979 over
every pair), budget use per setting (the spread of ε spent / ε budget over clients, clients that
ran out of budget) and the cells that failed.
A sweep none of whose cells completed still gets report.md, with why each cell failed.
When the grid varies `split-seed` (`SweepData.split_key`), a setting's splits are replicates like its
seeds: its rows pool them (seeds nested in splits, `statistics.two_stage_interval`), and so do the
baselines' rows, one per setting.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fedprivacy.errors import InputError
from fedprivacy.reports.statistics import binomial_se, two_stage_interval
from fedprivacy.reports.sweep_arms import (
    HOLM_COLUMNS,
    NOT_RESOLVED,
    OWN_OPTIMUM,
    SAME_TUNED,
    TUNED_COLUMNS,
    arm_table,
    paired_table,
    pairs_shown,
)
from fedprivacy.reports.sweep_data import SEED, SweepData, load_sweep
from fedprivacy.reports.sweep_figures import write_figures
from fedprivacy.reports.sweep_tuning import tuning_markdown
from fedprivacy.sweepfiles import REPORT


def _markdown(table: pd.DataFrame) -> str:
    if not len(table):
        return "(none)"
    return table.astype(object).where(table.notna(), None).to_markdown(index=False, floatfmt=".4f", missingval="—")


def summarise(table: pd.DataFrame, keys: list[str], **aggregations: tuple[str, str]) -> pd.DataFrame:
    """`table` aggregated per combination of `keys` (a single row when there are none)."""
    if not keys:
        return table.groupby(lambda _: 0).agg(**aggregations).reset_index(drop=True)
    return table.groupby(keys, sort=False).agg(**aggregations).reset_index()


def accuracy_table(data: SweepData) -> pd.DataFrame:
    return arm_table(data)


def baseline_table(data: SweepData) -> pd.DataFrame:
    """The baselines with the binomial s.e. of their accuracy: a baseline evaluates on the rows of
    the cell it took its schedule from (same data, seed and clients), so it has that cell's count."""
    if data.baselines.empty:
        return data.baselines
    rows = (
        data.cells.set_index("cell")["evaluation_rows"] if "evaluation_rows" in data.cells else pd.Series(dtype=float)
    )
    evaluation_rows = data.baselines["schedule_from"].map(lambda name: rows.get(f"cells/{name}", float("nan")))
    if data.split_key and data.split_key in data.baselines:
        return _pooled_baselines(data, evaluation_rows)
    return data.baselines.assign(
        binomial_se=[binomial_se(p, m) for p, m in zip(data.baselines["final_accuracy"], evaluation_rows)],
        evaluation_rows=evaluation_rows.astype("Int64"),
    )


def _pooled_baselines(data: SweepData, evaluation_rows: pd.Series) -> pd.DataFrame:
    """One baseline row per setting, pooled over its splits and seeds as the arms are: the mean over
    splits of each split's mean, its interval over split means, the binomial s.e. at that mean on
    the fewest evaluation rows."""
    baselines = data.baselines.assign(evaluation_rows=evaluation_rows)
    keys = [k for k in data.setting_keys if k in baselines]
    split = data.split_key
    found = baselines.groupby(keys, sort=False, dropna=False) if keys else [((), baselines)]
    rows = []
    for values, group in found:
        interval = two_stage_interval(group["final_accuracy"].to_numpy(dtype=float), group[split].tolist())
        fewest = group["evaluation_rows"].min()
        rows.append(
            {
                **dict(zip(keys, values if isinstance(values, tuple) else (values,))),
                "splits": group[split].nunique(),
                "seeds": group[SEED].nunique() if SEED in group else 1,
                "final_accuracy": interval.mean,
                "ci95_low": interval.low,
                "ci95_high": interval.high,
                "best_accuracy": group["best_accuracy"].mean(),
                "binomial_se": binomial_se(interval.mean, fewest),
                "evaluation_rows": None if pd.isna(fewest) else int(fewest),
            }
        )
    table = pd.DataFrame(rows)
    table["evaluation_rows"] = table["evaluation_rows"].astype("Int64")
    return table


def budget_table(data: SweepData) -> pd.DataFrame:
    return summarise(
        data.clients.assign(exhausted=data.clients["status"].eq("exhausted")),
        data.setting_keys,
        client_runs=("budget_used", "size"),
        used_min=("budget_used", "min"),
        used_median=("budget_used", "median"),
        used_max=("budget_used", "max"),
        out_of_budget=("exhausted", "sum"),
    )


def client_accuracy_table(data: SweepData) -> pd.DataFrame:
    """Per setting, over its clients and seeds: each client's accuracy on its own test rows at its
    last federated evaluation (min, median, max); empty when no client evaluated."""
    if "accuracy" not in data.clients or data.clients["accuracy"].isna().all():
        return pd.DataFrame()
    return summarise(
        data.clients.dropna(subset=["accuracy"]),
        data.setting_keys,
        client_runs=("accuracy", "size"),
        accuracy_min=("accuracy", "min"),
        accuracy_median=("accuracy", "median"),
        accuracy_max=("accuracy", "max"),
    ).round({"accuracy_min": 4, "accuracy_median": 4, "accuracy_max": 4})


def _client_accuracy(data: SweepData) -> list[str]:
    table = client_accuracy_table(data)
    if table.empty:
        return []
    return [
        "## Accuracy per client",
        "",
        "Each client's accuracy on its own test rows at its last federated evaluation (the global model; "
        "clients.csv's `accuracy`, with each run's clients.png), over the setting's clients and seeds. A wide "
        "spread says the one global model serves some clients far worse than others.",
        "",
        _markdown(table),
        "",
    ]


def _figure(path: Path, caption: str) -> str:
    return f"![{caption}]({path.name})\n\n(also [{path.with_suffix('.svg').name}]({path.with_suffix('.svg').name}))"


def _heading(data: SweepData) -> list[str]:
    counts = data.cells["status"].value_counts()
    grid = "; ".join(f"{key} = {', '.join(map(str, values))}" for key, values in data.grid.items())
    return [
        f"# Sweep report: {data.name}",
        "",
        f"{len(data.cells)} cells: {counts.get('completed', 0)} completed, {counts.get('failed', 0)} failed, "
        f"{counts.get('pending', 0)} pending. Grid: {grid}. Means, standard deviations and 95% intervals "
        f"(Student's t) are {_over(data)}; accuracy is the central test accuracy after the last round, and "
        "`binomial_se` = sqrt(p(1 − p)/m) is the standard error of one run's accuracy p from its m evaluation "
        "rows (`evaluation_rows`) alone.",
        "",
    ]


def _over(data: SweepData) -> str:
    """What the means and intervals are over: seeds, or splits and the seeds nested in them."""
    if not data.split_key:
        return "over seeds"
    return (
        f"over splits (`{data.split_key}`): each split's mean over its seeds, then the mean, sd and t-interval "
        "of those split means (splits − 1 degrees of freedom; over seeds where one split completed)"
    )


def _mean_over(data: SweepData) -> str:
    return "over splits of each split's mean over its seeds" if data.split_key else "over seeds"


def _coverage(data: SweepData) -> str:
    """One sentence: which sources of variation an interval covers."""
    if data.split_key:
        return (
            "An interval covers the variation between splits (each split-seed's partition and train/validation/test "
            "split) and between seeds within them (initial weights, client sampling)."
        )
    return (
        "An interval covers the variation between seeds within one split (a fixed split-seed; with split-seed −1 "
        "each seed also cuts its own split), not between splits: put split-seed in [grid] to pool over them."
    )


def _single_seeds(arms: pd.DataFrame) -> list[str]:
    """Say which rows have no interval: a single seed (of a single split) gives no spread to build one from."""
    single = arms["seeds"] < 2 if len(arms) else pd.Series(dtype=bool)
    if "splits" in arms:
        single &= arms["splits"] < 2
    count = int(single.sum())
    if not count:
        return []
    ran = "one split and one seed" if "splits" in arms else "one seed"
    return [f"{count} of {len(arms)} settings ran {ran}: no sd and no interval (—) for them.", ""]


def _paired_differences(data: SweepData, pairs: pd.DataFrame) -> list[str]:
    """One table per axis of the grid: settings that differ only along it, compared seed by seed."""
    lines = [
        "## Paired differences",
        "",
        "Two settings that differ along one axis of the grid (a key, or a linked group's keys together) and "
        "ran the same seeds, compared seed by seed: "
        "`difference_mean` is the mean over the shared seeds of b's final accuracy minus a's (b after a in "
        "the grid's order), `ci95_low`–`ci95_high` its 95% t-interval over those seeds. "
        f"`{NOT_RESOLVED}`: the interval holds 0, or fewer than 2 shared seeds give none; else `b higher` "
        "or `b lower`. Every pair is in [paired_differences.csv](paired_differences.csv), with its paired "
        "t-test's `p_value`.",
        "",
        *_pooled_pairs_paragraph(data),
        *_tuned_paragraph(pairs),
        *_holm_paragraph(pairs),
    ]
    if pairs.empty:
        return [*lines, "(none: no two settings that differ along one axis share a seed)", ""]
    for name, axis in data.axes.items():
        shown, left_out = pairs_shown(pairs, name, axis)
        if shown.empty:
            continue
        more = f" ({left_out} more, of values further apart, in paired_differences.csv)" if left_out else ""
        lines += [f"### {name}: b − a{more}", "", _markdown(shown), ""]
    return lines


def _pooled_pairs_paragraph(data: SweepData) -> list[str]:
    """How pairs pool over splits: (split, seed) units, per-split means, the interval over them."""
    if not data.split_key:
        return []
    return [
        f"Pooled over splits: the units both settings ran are ({data.split_key}, seed) pairs (`shared_seeds` counts "
        "them, `shared_splits` their splits); b − a is averaged per split over its shared seeds, and with 2 or more "
        "shared splits the mean, interval and `p_value` are over those split means (splits − 1 degrees of "
        "freedom), else over the seeds of the one split.",
        "",
    ]


def _tuned_paragraph(pairs: pd.DataFrame) -> list[str]:
    """What a tuned sweep's pair compares: each arm ran at the values its own tuning chose."""
    if TUNED_COLUMNS[0] not in pairs:
        return []
    return [
        "Each arm ran at the values its own tuning chose ([tune], see Tuning): `tuned_a` and `tuned_b` are a's "
        f"and b's. `{OWN_OPTIMUM}`: they differ, so b − a compares the two settings each at its own tuned "
        "optimum, not the axis alone at fixed values. "
        f"`{SAME_TUNED}`: both arms chose the same values, so the pair holds them equal and differs along its "
        "axis alone.",
        "",
    ]


def _holm_paragraph(pairs: pd.DataFrame) -> list[str]:
    """What Holm's correction covers: every pair of paired_differences.csv with a p-value."""
    if HOLM_COLUMNS[0] not in pairs:
        return []
    family = int(pairs["p_value"].notna().sum())
    return [
        "`p_holm` is `p_value` adjusted by Holm's step-down (Holm 1979) over the family of every pair in "
        f"paired_differences.csv that has a p-value ({family} in all: every axis, not only the rows shown here), "
        "so that, as far as the t-test's assumptions hold, the chance that any pair whose expected difference "
        "is 0 gets `b higher` or `b lower` in `verdict_holm` (`p_holm` < 0.05) is at most 5%. `verdict` is each "
        "pair's own test, uncorrected. A pair with fewer than 2 shared seeds has no p-value: it is outside the "
        "family and its Holm fields are blank (—).",
        "",
    ]


def _no_better_cells(data: SweepData) -> list[str]:
    """The completed cells whose final accuracy is no better than predicting the largest class."""
    if "beats_largest_class" not in data.cells:  # a sweep.csv written before it had the column
        return []
    flagged = data.cells[data.cells["beats_largest_class"].eq(False)]  # NaN: not measured
    if flagged.empty:
        return []
    return [
        "## Cells no better than the largest class",
        "",
        f"{len(flagged)} completed cells end no more than 1.96 standard errors above always predicting the largest "
        "class of their evaluation rows (`largest_class_share`): their models learned nothing the accuracy shows. "
        "More local steps (epochs), another learning-rate, more rounds or a larger ε may help; tune them ([tune]).",
        "",
        _markdown(flagged[["cell", "final_accuracy", "largest_class_share", "evaluation_rows"]]),
        "",
    ]


def _failed_cells(data: SweepData) -> list[str]:
    return [
        "## Failed cells",
        "",
        _markdown(data.cells[data.cells["status"] == "failed"][["cell", "error"]]),
        "",
    ]


def failures_markdown(data: SweepData) -> str:
    """The report of a sweep none of whose cells completed: why they failed, no figures."""
    return "\n".join(
        [
            *_heading(data),
            "No cell completed, so there are no figures or tables yet.",
            "",
            *_failed_cells(data),
        ]
    )


def _federation_rounds(pngs: list[Path]) -> list[str]:
    """The federation's ε per round, where the sweep has client-level DP."""
    if not pngs:
        return []
    return [
        "The federation's client-level ε spent per round (its own ledger; it protects each member's "
        "participation against whoever sees the models, not against the server):",
        "",
        _figure(pngs[0], "federation ε spent per round"),
        "",
    ]


def report_markdown(data: SweepData, figures: list[Path], pairs: pd.DataFrame | None = None, holm: bool = False) -> str:
    """report.md; `pairs` is paired_table's (made here, with Holm's columns when `holm`, if not given)."""
    pngs = [p for p in figures if p.suffix == ".png"]
    arms = accuracy_table(data)
    lines = [
        *_heading(data),
        "## Accuracy",
        "",
        f"Final accuracy per setting: the mean {_mean_over(data)} with its 95% interval (bars), against the grid "
        "and against the largest ε any client actually spent (its mean over seeds; a horizontal bar spans the "
        f"seeds' values where they differ). {_coverage(data)} `binomial_se` is not part of it: it is the test-set "
        "sampling error of a single run's accuracy.",
        "",
        _figure(pngs[0], "final accuracy"),
        "",
        _figure(pngs[4], "final accuracy against ε spent"),
        "",
        _markdown(arms),
        "",
        *_single_seeds(arms),
        "### Non-private baseline",
        "",
        "FedAvg of plain local SGD on the same clients, model, initial weights and local schedule "
        "(sims.baseline), once per setting outside the keys it does not read (privacy, aggregation, server optimiser); "
        "`schedule_from` is the cell whose private plan gave the schedule (q and T depend on ε). It also takes that "
        "cell's learning rate, chosen for clipped, noisy steps: without clipping it can be too large (or too many "
        "steps), which puts the baseline below private cells. `baseline-learning-rate` gives it its own η "
        "([sweep]: one value; [tune]: candidates chosen on validation rows).",
        "",
        _markdown(baseline_table(data)),
        "",
        *_no_better_cells(data),
        *_paired_differences(data, paired_table(data, holm) if pairs is None else pairs),
        "## Accuracy per round",
        "",
        _figure(pngs[1], "accuracy per round"),
        "",
        "## ε spent per round",
        "",
        _figure(pngs[2], "largest ε spent per round"),
        "",
        *_federation_rounds(pngs[5:]),
        "## Budget use per client",
        "",
        "ε spent / ε budget of each client (`used`, over clients and seeds); `out_of_budget` counts clients "
        "that stopped because their next round would have exceeded their budget.",
        "",
        _figure(pngs[3], "budget use per client"),
        "",
        _markdown(budget_table(data)),
        "",
        *_client_accuracy(data),
        *_failed_cells(data),
    ]
    return "\n".join(lines)


def write_report(sweep_dir: Path, out: Path | None = None, holm: bool = False) -> list[Path]:
    """Write the figures (PNG and SVG) and report.md into `out` (default `<sweep_dir>/report`);
    `holm` adds the paired differences' Holm-adjusted p-values and verdicts."""
    data = load_sweep(sweep_dir)
    if not data.cells["status"].isin(["completed", "failed"]).any():
        raise InputError("sweep_dir", str(sweep_dir), "has no finished cell yet: nothing to report")
    out = out or sweep_dir / REPORT
    try:
        out.mkdir(parents=True, exist_ok=True)
        figures = write_figures(data, out) if not data.completed.empty else []
        tables, markdown = [], out / "report.md"
        if figures:
            pairs = paired_table(data, holm)
            tables.append(out / "paired_differences.csv")
            pairs.to_csv(tables[0], index=False)
            text = report_markdown(data, figures, pairs)
        else:
            text = failures_markdown(data)
        markdown.write_text(text + tuning_markdown(sweep_dir), encoding="utf-8")  # "" without [tune]
    except OSError as error:
        raise InputError("out", str(out), f"cannot write the report there: {error.strerror or error}") from None
    return [*figures, *tables, markdown]
