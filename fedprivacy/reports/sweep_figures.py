"""The sweep report's figures, each saved as PNG and SVG.

- accuracy against the x key (ε unless the grid does not vary it), one line per series: the mean
  final accuracy over seeds with its 95% t-interval as bars (none for one seed; cut at 0 and 1, as
  is every accuracy axis), a log axis for ε (and for other keys whose values span a factor of 8 or
  more), and the non-private baseline as a dashed line in its series' colour, or black in a style
  of its own (horizontal unless the x key changes the baseline too, e.g. epochs); legends name a
  data path by its file;
- accuracy against ε spent: the same means and bars against the largest ε any client of the cell
  actually spent (mean over seeds, a horizontal bar from the seeds' least to most where they
  differ), since a rule that stops short of its budget buys its accuracy with less ε than the grid says;
- accuracy per round and ε spent per round: one panel per series, one line per x value (means
  over seeds), the baseline's accuracy dashed in black;
- budget use: spent/budget of every client (columns) in every setting (rows), means over seeds.

When the grid varies `split-seed` (`SweepData.split_key`), a setting's splits are replicates like its
seeds: no line or row splits by them, and a bar is the interval over split means
(`statistics.two_stage_interval`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

from fedprivacy.reports.statistics import two_stage_interval
from fedprivacy.reports.sweep_data import SweepData

FORMATS = ("png", "svg")
PANEL_WIDTH, PANEL_HEIGHT = 5.0, 3.6
LOG_SPAN = 8.0


def save(fig: Figure, out: Path, stem: str) -> list[Path]:
    paths = [out / f"{stem}.{fmt}" for fmt in FORMATS]
    for path in paths:
        fig.savefig(path, dpi=120)
    return paths


def save_png(fig: Figure, path: Path) -> Path:
    """One laid-out PNG at `path`, its folder made if missing (the experiments' figures)."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _shown(value: object) -> str:
    """A grid value as a legend shows it: numbers in short form, a file path by its name."""
    if isinstance(value, float):
        return f"{value:g}"
    text = str(value)
    return Path(text).name if "/" in text else text


def label(keys: Sequence[str], values: Sequence[object]) -> str:
    """`rule=proactive, clip-norm=0.1`, or `all cells` when nothing varies."""
    return ", ".join(f"{k}={_shown(v)}" for k, v in zip(keys, values)) or "all cells"


def _accuracy_bars(means: Sequence[float], halves: Sequence[float]) -> np.ndarray:
    """95% interval bars as [below, above], cut at 0 and 1: a mean accuracy lies in [0, 1], so the
    interval's part outside says nothing (two seeds give t₀.₉₇₅,₁ = 12.7 and bars far past both)."""
    means, halves = np.asarray(means, dtype=float), np.asarray(halves, dtype=float)
    return np.vstack([np.minimum(halves, means), np.minimum(halves, 1.0 - means)])


def _accuracy_axis(axis: Axes) -> None:
    """The accuracy axis kept within [0, 1], with room for a line at 0 or 1 to show above the frame."""
    low, high = axis.get_ylim()
    axis.set_ylim(max(low, -0.02), min(high, 1.02))


BASELINE_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)))


def groups(table: pd.DataFrame, keys: Sequence[str]) -> list[tuple[tuple, pd.DataFrame]]:
    """(values, rows) for each combination of `keys` in the table (one group of everything without keys)."""
    if not keys:
        return [((), table)]
    return [
        (values if isinstance(values, tuple) else (values,), rows)
        for values, rows in table.groupby(list(keys), sort=False)
    ]


def _log_axis(axis: Axes, values: Sequence[float], always: bool) -> None:
    """A log x axis for ε (`always`), or for positive values spanning a factor of LOG_SPAN or more."""
    positive = [v for v in values if v > 0]
    if positive and len(positive) == len(values) and (always or max(positive) / min(positive) >= LOG_SPAN):
        axis.set_xscale("log")
        axis.set_xticks(sorted(set(positive)), [f"{v:g}" for v in sorted(set(positive))])
        axis.minorticks_off()


def _matching(table: pd.DataFrame, keys: Sequence[str], values: Sequence[object]) -> pd.DataFrame:
    """The rows of `table` that agree with (keys, values) on the keys it has."""
    mask = np.ones(len(table), dtype=bool)
    for key, value in zip(keys, values):
        if key in table:
            mask &= (table[key] == value).to_numpy()
    return table[mask]


ACCURACY_LABEL = "final test accuracy (mean, 95% interval over seeds)"
POOLED_ACCURACY_LABEL = "final test accuracy (mean, 95% interval over splits)"


def _accuracy_label(data: SweepData) -> str:
    return POOLED_ACCURACY_LABEL if data.split_key else ACCURACY_LABEL


def mean_and_half_width(values: Sequence[float], splits: Sequence[object] | None = None) -> tuple[float, float]:
    """The mean and its 95% t-interval's half width (NaN for one value: no bar is drawn); with each
    value's split, `two_stage_interval`'s over split means."""
    interval = two_stage_interval(values, splits)
    return interval.mean, (interval.high - interval.mean) if interval.high is not None else np.nan


def _arm_mean_and_half_width(data: SweepData, arm: pd.DataFrame) -> tuple[float, float]:
    """`mean_and_half_width` of an arm's final accuracy, over its splits when the report pools them."""
    return mean_and_half_width(arm["final_accuracy"], arm[data.split_key].tolist() if data.split_key else None)


def accuracy_figure(data: SweepData, out: Path) -> list[Path]:
    """Final accuracy against the x key per series (mean and 95% interval over seeds), with the baseline."""
    x_key, series = data.x_key, data.series_keys
    fig = Figure(figsize=(7, 4.5), layout="tight")
    axis = fig.subplots()
    completed = data.measured
    colours: dict[str, str] = {}  # a series' colour, for its own baseline
    if x_key is None:  # nothing numeric varies: one point per setting
        found = groups(completed, series)
        means, halves = zip(*(_arm_mean_and_half_width(data, rows) for _, rows in found))
        axis.errorbar(range(len(found)), means, yerr=_accuracy_bars(means, halves), fmt="o", capsize=4)
        axis.set_xticks(range(len(found)), [label(series, values) for values, _ in found], rotation=20, ha="right")
    else:
        for values, rows in groups(completed, series):
            points = sorted((x, *_arm_mean_and_half_width(data, arm)) for x, arm in rows.groupby(x_key))
            xs, means, halves = zip(*points)
            drawn = axis.errorbar(
                xs, means, yerr=_accuracy_bars(means, halves), fmt="o-", capsize=4, label=label(series, values)
            )
            colours[label(series, values)] = drawn.lines[0].get_color()
        _log_axis(axis, list(completed[x_key]), always=x_key == "epsilon")
        axis.set_xlabel("ε (per client)" if x_key == "epsilon" else x_key)
    _baseline_lines(data, axis, colours)
    _accuracy_axis(axis)
    axis.set_ylabel(_accuracy_label(data))
    axis.set_title(f"{data.name}: accuracy against {'ε' if x_key == 'epsilon' else x_key or 'setting'}")
    axis.grid(True, alpha=0.3)
    if axis.get_legend_handles_labels()[0]:  # one setting and no baseline: nothing to name
        axis.legend(fontsize=8)
    stem = f"accuracy_vs_{x_key}" if x_key else "accuracy_by_setting"
    return save(fig, out, stem)


def _plain_log_axis(axis: Axes, values: pd.Series, always: bool) -> None:
    """A log x axis (as `_log_axis` decides) ticked in plain numbers, for values that are not grid values;
    the 2…9 ticks between powers of ten are labelled only when the values span less than a decade."""
    if not len(values) or values.min() <= 0 or not (always or values.max() / values.min() >= LOG_SPAN):
        return
    axis.set_xscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    axis.xaxis.set_major_formatter(plain)
    axis.xaxis.set_minor_formatter(plain if values.max() / values.min() < 10 else NullFormatter())


def accuracy_vs_spent_figure(data: SweepData, out: Path) -> list[Path]:
    """Final accuracy against the largest ε a client spent, per series (points in order of ε spent),
    the baselines as horizontal dashed lines (a non-private run spends no ε to place it by)."""
    x_key, series = data.x_key, data.series_keys
    fig = Figure(figsize=(7, 4.5), layout="tight")
    axis = fig.subplots()
    completed = data.measured
    completed = completed[completed["epsilon_spent_max"].notna()]
    colours: dict[str, str] = {}
    for values, rows in groups(completed, series):
        points = []
        for _, arm in groups(rows, [x_key] if x_key else []):
            spent = arm["epsilon_spent_max"]
            points.append((spent.mean(), spent.min(), spent.max(), *_arm_mean_and_half_width(data, arm)))
        points.sort()
        xs, lows, highs, means, halves = (np.array(column, dtype=float) for column in zip(*points))
        spread = [xs - lows, highs - xs] if (highs > lows).any() else None
        bars = _accuracy_bars(means, halves)
        drawn = axis.errorbar(xs, means, yerr=bars, xerr=spread, fmt="o-", capsize=4, label=label(series, values))
        colours[label(series, values)] = drawn.lines[0].get_color()
    _plain_log_axis(axis, completed["epsilon_spent_max"], always=x_key == "epsilon")
    if not data.baselines.empty:
        keys = [k for k in data.baselines.columns if k in data.setting_keys]
        for index, (values, rows) in enumerate(groups(data.baselines, keys)):
            name = "non-private" + (f" ({label(keys, values)})" if keys else "")
            colour, style = _baseline_style(keys, values, series, colours, index)
            axis.axhline(rows["final_accuracy"].mean(), color=colour, linestyle=style, linewidth=1.2, label=name)
    _accuracy_axis(axis)
    axis.set_xlabel("largest ε spent by a client (mean over seeds; bar: least to most)")
    axis.set_ylabel(_accuracy_label(data))
    axis.set_title(f"{data.name}: accuracy against ε spent")
    axis.grid(True, alpha=0.3)
    if axis.get_legend_handles_labels()[0]:  # one setting and no baseline: nothing to name
        axis.legend(fontsize=8)
    return save(fig, out, "accuracy_vs_epsilon_spent")


def _baseline_style(
    keys: Sequence[str], values: Sequence[object], series: Sequence[str], colours: dict[str, str], index: int
) -> tuple[str, object]:
    """A baseline's colour and line style: its series' colour, dashed, when it belongs to one
    series; else black, in the `index`-th of `BASELINE_STYLES`, so no two baselines look alike."""
    mine = dict(zip(keys, values))
    if series and all(key in mine for key in series):
        colour = colours.get(label(series, [mine[key] for key in series]))
        if colour is not None:
            return colour, "--"
    return "black", BASELINE_STYLES[index % len(BASELINE_STYLES)]


def _baseline_lines(data: SweepData, axis: Axes, colours: dict[str, str]) -> None:
    if data.baselines.empty:
        return
    x_key = data.x_key
    keys = [k for k in data.baselines.columns if k in data.setting_keys and k != x_key]
    for index, (values, rows) in enumerate(groups(data.baselines, keys)):
        name = "non-private" + (f" ({label(keys, values)})" if keys else "")
        colour, style = _baseline_style(keys, values, data.series_keys, colours, index)
        if x_key in rows:  # the x key changes the baseline itself (e.g. epochs): a curve
            stats = rows.groupby(x_key)["final_accuracy"].mean().sort_index()
            axis.plot(stats.index, stats.to_numpy(), color=colour, linestyle=style, linewidth=1.2, label=name)
        else:
            axis.axhline(rows["final_accuracy"].mean(), color=colour, linestyle=style, linewidth=1.2, label=name)


def _panels(count: int) -> tuple[Figure, list[Axes]]:
    columns = min(count, 3)
    lines = -(-count // columns)
    fig = Figure(figsize=(PANEL_WIDTH * columns, PANEL_HEIGHT * lines), layout="tight")
    axes = np.atleast_1d(fig.subplots(lines, columns, squeeze=False)).ravel().tolist()
    for extra in axes[count:]:
        extra.set_visible(False)
    return fig, axes[:count]


def per_round_figure(
    data: SweepData, out: Path, column: str, ylabel: str, stem: str, with_baseline: bool
) -> list[Path]:
    """`column` of rounds.csv per round: a panel per series, a line per x value, means over seeds."""
    x_key, series = data.x_key, data.series_keys
    panels = groups(data.rounds, series)
    fig, axes = _panels(len(panels))
    x_values = sorted(data.rounds[x_key].unique()) if x_key else [None]
    colours = colormaps["viridis"](np.linspace(0, 0.9, len(x_values)))
    for axis, (values, rows) in zip(axes, panels):
        for colour, x in zip(colours, x_values):
            chosen = rows if x is None else rows[rows[x_key] == x]
            mean = chosen.groupby("round")[column].mean()
            axis.plot(
                mean.index,
                mean.to_numpy(),
                "o-",
                color=colour,
                markersize=3,
                label="mean" if x is None else label([x_key], [x]),
            )
        if with_baseline and not data.baseline_rounds.empty:
            baseline = _matching(data.baseline_rounds, series, values).groupby("round")["accuracy"].mean()
            name = "non-private" + _schedule_of(data, series, values)
            axis.plot(baseline.index, baseline.to_numpy(), "k--", linewidth=1.2, label=name)
        axis.set_title(label(series, values), fontsize=10)
        axis.set_xlabel("round")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_ylabel(ylabel)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
        if with_baseline:  # the accuracy panels
            _accuracy_axis(axis)
    return save(fig, out, stem)


def _schedule_of(data: SweepData, series: Sequence[str], values: Sequence[object]) -> str:
    """` (schedule of epsilon=1)` when the panel's baselines took their local schedule from cells
    of one x value: a baseline's q and T are those of its `schedule_from` cell, so its curve per
    round is comparable with that line only (empty when it cannot be said in one value)."""
    x_key = data.x_key
    if x_key is None or data.baselines.empty or "schedule_from" not in data.baselines:
        return ""
    cells = data.cells.set_index("cell")
    sources = _matching(data.baselines, series, values)["schedule_from"]
    found = {cells.at[f"cells/{name}", x_key] for name in sources if f"cells/{name}" in cells.index}
    return f" (schedule of {label([x_key], [found.pop()])})" if len(found) == 1 else ""


def budget_use_figure(data: SweepData, out: Path) -> list[Path]:
    """Each client's ε spent / ε budget (mean over seeds), one row per setting."""
    keys = data.setting_keys
    found = groups(data.clients, keys)
    table = pd.DataFrame([rows.groupby("client_id")["budget_used"].mean() for _, rows in found])
    fig = Figure(figsize=(max(6.0, 0.35 * table.shape[1] + 3), max(2.5, 0.32 * table.shape[0] + 1.5)), layout="tight")
    axis = fig.subplots()
    image = axis.imshow(table.to_numpy(dtype=float), vmin=0, vmax=1, cmap="viridis", aspect="auto")
    fig.colorbar(image, ax=axis, label="ε spent / ε budget")
    axis.set_yticks(range(table.shape[0]), [label(keys, values) for values, _ in found], fontsize=8)
    if table.shape[1] <= 40:
        axis.set_xticks(range(table.shape[1]), [str(c) for c in table.columns], rotation=90, fontsize=7)
    else:
        axis.set_xticks([])
    axis.set_xlabel(f"client ({table.shape[1]})")
    fig.suptitle("budget use per client (mean over seeds)", fontsize=11)  # centred on the figure, not the axes
    return save(fig, out, "budget_use")


def write_figures(data: SweepData, out: Path) -> list[Path]:
    return [
        *accuracy_figure(data, out),
        *per_round_figure(data, out, "accuracy", "test accuracy", "accuracy_vs_round", with_baseline=True),
        *per_round_figure(data, out, "epsilon_spent_max", "largest ε spent", "epsilon_vs_round", with_baseline=False),
        *budget_use_figure(data, out),
        *accuracy_vs_spent_figure(data, out),
        *federation_figure(data, out),
    ]


def federation_figure(data: SweepData, out: Path) -> list[Path]:
    """The federation's client-level ε spent per round, for sweeps with client-level DP (none otherwise)."""
    column = "federation_epsilon_spent"
    if column not in data.rounds or data.rounds[column].isna().all():
        return []
    return per_round_figure(data, out, column, "federation ε spent", "federation_epsilon_vs_round", False)
