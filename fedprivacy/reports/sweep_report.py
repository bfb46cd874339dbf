"""`fedprivacy report DIR`: the figures and report.md of a sweep, from its sweep.csv and cell folders.

report.md holds the tables behind the figures: accuracy per setting (mean, standard deviation and
count over seeds, mean best-round accuracy, the largest ε any client spent, whether every cell
kept every client within budget), the non-private baselines, budget use per setting (the spread
of ε spent / ε budget over clients, clients that ran out of budget) and the cells that failed.
A sweep none of whose cells completed still gets report.md, with why each cell failed.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fedprivacy.errors import InputError
from fedprivacy.reports.sweep_data import SEED, SweepData, load_sweep
from fedprivacy.reports.sweep_figures import write_figures
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
    return summarise(
        data.completed,
        [k for k in (*data.series_keys, data.x_key) if k],
        seeds=("final_accuracy", "size"),
        final_accuracy_mean=("final_accuracy", "mean"),
        final_accuracy_sd=("final_accuracy", "std"),
        best_accuracy_mean=("best_accuracy", "mean"),
        epsilon_spent_max=("epsilon_spent_max", "max"),
        all_within_budget=("all_within_budget", "all"),
    )


def budget_table(data: SweepData) -> pd.DataFrame:
    return summarise(
        data.clients.assign(exhausted=data.clients["status"].eq("exhausted")),
        [k for k in data.grid if k != SEED],
        client_runs=("budget_used", "size"),
        used_min=("budget_used", "min"),
        used_median=("budget_used", "median"),
        used_max=("budget_used", "max"),
        out_of_budget=("exhausted", "sum"),
    )


def _figure(path: Path, caption: str) -> str:
    return f"![{caption}]({path.name})\n\n(also [{path.with_suffix('.svg').name}]({path.with_suffix('.svg').name}))"


def _heading(data: SweepData) -> list[str]:
    counts = data.cells["status"].value_counts()
    grid = "; ".join(f"{key} = {', '.join(map(str, values))}" for key, values in data.grid.items())
    return [
        f"# Sweep report: {data.name}",
        "",
        f"{len(data.cells)} cells: {counts.get('completed', 0)} completed, {counts.get('failed', 0)} failed, "
        f"{counts.get('pending', 0)} pending. Grid: {grid}. Means and standard deviations are over seeds; "
        "accuracy is the central test accuracy after the last round.",
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


def report_markdown(data: SweepData, figures: list[Path]) -> str:
    pngs = [p for p in figures if p.suffix == ".png"]
    lines = [
        *_heading(data),
        "## Accuracy",
        "",
        _figure(pngs[0], "final accuracy"),
        "",
        _markdown(accuracy_table(data)),
        "",
        "### Non-private baseline",
        "",
        "FedAvg of plain local SGD on the same clients, model, initial weights and local schedule "
        "(sims.baseline), once per setting outside the keys it does not read (privacy, aggregation, server optimiser); "
        "`schedule_from` is the cell whose private plan gave the schedule (q and T depend on ε).",
        "",
        _markdown(data.baselines),
        "",
        "## Accuracy per round",
        "",
        _figure(pngs[1], "accuracy per round"),
        "",
        "## ε spent per round",
        "",
        _figure(pngs[2], "largest ε spent per round"),
        "",
        "## Budget use per client",
        "",
        "ε spent / ε budget of each client (`used`, over clients and seeds); `out_of_budget` counts clients "
        "that stopped because their next round would have exceeded their budget.",
        "",
        _figure(pngs[3], "budget use per client"),
        "",
        _markdown(budget_table(data)),
        "",
        *_failed_cells(data),
    ]
    return "\n".join(lines)


def write_report(sweep_dir: Path, out: Path | None = None) -> list[Path]:
    """Write the figures (PNG and SVG) and report.md into `out` (default `<sweep_dir>/report`)."""
    data = load_sweep(sweep_dir)
    if not data.cells["status"].isin(["completed", "failed"]).any():
        raise InputError("sweep_dir", str(sweep_dir), "has no finished cell yet: nothing to report")
    out = out or sweep_dir / REPORT
    try:
        out.mkdir(parents=True, exist_ok=True)
        figures = write_figures(data, out) if not data.completed.empty else []
        markdown = out / "report.md"
        markdown.write_text(report_markdown(data, figures) if figures else failures_markdown(data), encoding="utf-8")
    except OSError as error:
        raise InputError("out", str(out), f"cannot write the report there: {error.strerror or error}") from None
    return [*figures, markdown]
