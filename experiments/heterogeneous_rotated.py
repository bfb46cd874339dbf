"""Heterogeneous budgets rotated over the PUMAs (experiment 5 of docs/experiments.md): tables, model, figure.

The first sweep folder is the main arm: the budgets' cyclic rotations over the PUMA clients plus
uniform arms (every client at one ε); the others (optional) run the same rotations under another
rule or aggregation and are compared with it seed by seed. Every folder needs the per_client.csv
that `python experiments/per_client_accuracy.py SWEEP_DIR --out SWEEP_DIR/per_client.csv` writes.

Prints: the global test accuracy per budget setting and arm (mean ± 95% t half-width over seeds);
the main arm's paired global comparisons (uniform largest against smallest ε, each rotation against
every client at the smallest ε); per PUMA, the mean accuracy at each own ε, the binomial s.e. of its
test rows and the paired differences own largest − own smallest ε and all at largest − all at
smallest; the additive least-squares model accuracy ~ PUMA + own-ε level (one fit per seed,
coefficients' mean ± 95% t half-width, R² and residual sd of the pooled fit; then with a rotation
term); and each other arm against the main one, globally and per PUMA. With `--local-only` (the
CSV `experiments/local_only.py` writes: each client trained alone on its own rows at its own ε),
each PUMA's local-only accuracy per own ε and the federation's gain over it, paired by seed. Draws
each PUMA's accuracy against its own ε (beside it, local-only). † marks an interval that holds 0
(not resolved).

Usage: python experiments/heterogeneous_rotated.py [MAIN_SWEEP_DIR [OTHER_SWEEP_DIR ...]]
       [--local-only MAIN_SWEEP_DIR/local_only.csv]
       [--out docs/figures/experiments/heterogeneous_rotated_per_client.png]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from fedprivacy.reports.statistics import Interval, PairedDifference, binomial_se, paired_difference, t_interval
from fedprivacy.reports.sweep_figures import save_png

SWEEPS = (Path("runs/het-rotated"), Path("runs/het-rotated-inv"), Path("runs/het-rotated-pro"))
FIGURE = Path("docs/figures/experiments/heterogeneous_rotated_per_client.png")
PER_CLIENT = "per_client.csv"
SETTING, OWN = "epsilons", "epsilon_budget"


@dataclass(frozen=True)
class Arm:
    """One sweep: its label (rule and aggregation), completed cells and per-client accuracies."""

    label: str
    cells: pd.DataFrame  # sweep.csv, completed cells: seed, epsilons, final_accuracy, …
    clients: pd.DataFrame  # per_client.csv: seed, epsilons, client, epsilon_budget, epsilon_spent, test_rows, accuracy

    @property
    def seeds(self) -> int:
        return self.cells["seed"].nunique()


def load_arm(folder: Path) -> Arm:
    """Read a sweep folder and its per_client.csv; refuse in one line when either is missing."""
    for needed in ("sweep.csv", PER_CLIENT):
        if not (folder / needed).is_file():
            raise SystemExit(
                f"{folder / needed} is missing (run the sweep, then experiments/per_client_accuracy.py"
                f" {folder} --out {folder / PER_CLIENT})"
            )
    cells = pd.read_csv(folder / "sweep.csv")
    cells = cells[cells["status"] == "completed"]
    config = json.loads((folder / cells["cell"].iloc[0] / "cell.json").read_text())["run_config"]
    aggregation = config["aggregation"]
    label = f"{config['rule']}, {'by examples' if aggregation == 'examples' else aggregation}"
    return Arm(label, cells, pd.read_csv(folder / PER_CLIENT, dtype={"client": str}))


def is_uniform(setting: str) -> bool:
    """Every client holds the same ε."""
    return len(set(setting.split(","))) == 1


def setting_name(setting: str) -> str:
    values = setting.split(",")
    return f"every client at {values[0]}" if is_uniform(setting) else ", ".join(values)


def signed(value: float, digits: int) -> str:
    """+0.012 / −0.012, with the minus sign the docs print."""
    return f"{value:+.{digits}f}".replace("-", "−")


def half_text(interval: Interval, digits: int = 3, sign: bool = False) -> str:
    """`0.712 ± 0.003` (`+0.001 ± 0.008 †` with sign=True: † when the interval holds 0)."""
    mean = signed(interval.mean, digits) if sign else f"{interval.mean:.{digits}f}"
    if interval.high is None:
        return f"{mean} (1 seed)"
    text = f"{mean} ± {interval.high - interval.mean:.{digits}f}"
    return text if not sign or interval.excludes_zero else f"{text} †"


def range_text(difference: PairedDifference | Interval | None, digits: int = 3) -> str:
    """`−0.030 [−0.033, −0.026]`, with † when the interval holds 0."""
    i = difference.interval if isinstance(difference, PairedDifference) else difference
    if i is None or i.low is None or i.high is None:
        return "—"
    text = f"{signed(i.mean, digits)} [{signed(i.low, digits)}, {signed(i.high, digits)}]"
    return text if i.excludes_zero else f"{text} †"


def by_seed(rows: pd.DataFrame, column: str) -> dict[int, float]:
    """The mean of `column` per seed (over rotations, when rows hold several)."""
    return rows.groupby("seed")[column].mean().to_dict()


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table: the first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def global_table(arms: Sequence[Arm]) -> str:
    """Global final accuracy per budget setting (rows, the main arm's order) and arm (columns)."""
    settings = list(dict.fromkeys(arms[0].cells[SETTING]))
    header = ["ε of the clients in sorted order", *(f"{arm.label} ({arm.seeds} seeds)" for arm in arms)]
    rows = []
    for setting in settings:
        row = [setting_name(setting)]
        for arm in arms:
            values = arm.cells.loc[arm.cells[SETTING] == setting, "final_accuracy"]
            row.append(half_text(t_interval(values.tolist())) if len(values) else "—")
        rows.append(row)
    return markdown(header, rows)


def uniform_comparisons(arm: Arm) -> list[str]:
    """Paired global differences: all at the largest ε − all at the smallest, each rotation − all at the smallest."""
    cells = arm.cells
    uniform = sorted((s for s in cells[SETTING].unique() if is_uniform(s)), key=lambda s: float(s.split(",")[0]))
    if not uniform:
        return ["(no uniform arm)"]
    low = by_seed(cells[cells[SETTING] == uniform[0]], "final_accuracy")
    lines = []
    for setting in [*uniform[1:], *(s for s in dict.fromkeys(cells[SETTING]) if not is_uniform(s))]:
        difference = paired_difference(low, by_seed(cells[cells[SETTING] == setting], "final_accuracy"))
        lines.append(f"  {setting_name(setting)} − {setting_name(uniform[0])}: {range_text(difference)}")
    return lines


def rotated(arm: Arm) -> pd.DataFrame:
    """The per-client rows of the rotations (the uniform arms left out)."""
    return arm.clients[~arm.clients[SETTING].map(is_uniform)]


def per_client_table(arm: Arm) -> str:
    """Per PUMA: test rows, binomial s.e., mean accuracy per own ε, own largest − own smallest, uniform likewise."""
    rot, clients = rotated(arm), arm.clients
    uniform = clients[clients[SETTING].map(is_uniform)]
    levels = sorted(rot[OWN].unique())
    lo, hi = f"{levels[0]:g}", f"{levels[-1]:g}"
    header = ["PUMA", "test rows", "binom. s.e.", *(f"own ε = {e:g}" for e in levels)]
    header += [f"own {hi} − own {lo}", f"all at {hi} − all at {lo}"]
    rows = []
    for client, own in rot.groupby("client"):
        test_rows = int(own["test_rows"].min())
        means = own.groupby(OWN)["accuracy"].mean()
        row = [client, str(test_rows), f"{binomial_se(own['accuracy'].mean(), test_rows):.3f}"]
        row += [f"{means[e]:.3f}" for e in levels]
        for rows_of in (own, uniform[uniform["client"] == client]):
            difference = paired_difference(
                by_seed(rows_of[rows_of[OWN] == levels[0]], "accuracy"),
                by_seed(rows_of[rows_of[OWN] == levels[-1]], "accuracy"),
            )
            row.append(half_text(difference.interval, sign=True) if difference else "—")
        rows.append(row)
    return markdown(header, rows)


def design(rows: pd.DataFrame, clients: list[str], levels: list[float], rotations: list[str]) -> np.ndarray:
    """Columns: intercept, PUMA indicators, rotation indicators, own-ε indicators (the first of each left out)."""
    columns = [np.ones(len(rows))]
    columns += [(rows["client"] == c).to_numpy(float) for c in clients[1:]]
    columns += [(rows[SETTING] == r).to_numpy(float) for r in rotations[1:]]
    columns += [(rows[OWN] == e).to_numpy(float) for e in levels[1:]]
    return np.column_stack(columns)


def additive_model(arm: Arm, with_rotation: bool) -> list[str]:
    """accuracy ~ PUMA (+ rotation) + own-ε level by least squares, one fit per seed; lines to print."""
    rot = rotated(arm)
    clients, levels = sorted(rot["client"].unique()), sorted(rot[OWN].unique())
    rotations = sorted(rot[SETTING].unique()) if with_rotation else []
    names = ["intercept", *(f"PUMA {c} − PUMA {clients[0]}" for c in clients[1:])]
    names += [f"rotation {r}" for r in rotations[1:]]
    names += [f"own ε {e:g} − own ε {levels[0]:g}" for e in levels[1:]]
    per_seed = np.array(
        [
            np.linalg.lstsq(design(rows, clients, levels, rotations), rows["accuracy"].to_numpy(), rcond=None)[0]
            for _, rows in rot.groupby("seed")
        ]
    )
    x = design(rot, clients, levels, rotations)
    beta = np.linalg.lstsq(x, rot["accuracy"].to_numpy(), rcond=None)[0]
    residual = rot["accuracy"].to_numpy() - x @ beta
    r2 = 1 - residual.var() / rot["accuracy"].var(ddof=0)
    lines = [
        f"  {len(rot)} (PUMA, rotation, seed) accuracies, {per_seed.shape[0]} seeds, rank {np.linalg.matrix_rank(x)}"
        f" of {x.shape[1]} columns; pooled fit: R² = {r2:.3f}, residual sd {residual.std(ddof=x.shape[1]):.4f}"
    ]
    shown = [i for i, name in enumerate(names) if not name.startswith(("intercept", "rotation"))]
    lines += [f"  {names[i]}: {half_text(t_interval(per_seed[:, i]), sign=True)}" for i in shown]
    puma = np.r_[0.0, beta[1 : len(clients)]]
    own = np.r_[0.0, beta[-(len(levels) - 1) :]]
    lines.append(f"  span of the PUMA effects {np.ptp(puma):.3f}, of the own-ε effects {np.ptp(own):.3f}")
    return lines


def arm_comparison(main: Arm, other: Arm) -> list[str]:
    """`other` − `main`, paired by seed: globally per rotation and over rotations, per PUMA, per own ε."""
    shared = [s for s in dict.fromkeys(main.cells[SETTING]) if s in set(other.cells[SETTING])]
    lines = ["  global, per rotation:"]
    for setting in shared:
        difference = paired_difference(
            by_seed(main.cells[main.cells[SETTING] == setting], "final_accuracy"),
            by_seed(other.cells[other.cells[SETTING] == setting], "final_accuracy"),
        )
        lines.append(f"    {setting_name(setting)}: {range_text(difference)}")
    over = paired_difference(
        by_seed(main.cells[main.cells[SETTING].isin(shared)], "final_accuracy"),
        by_seed(other.cells[other.cells[SETTING].isin(shared)], "final_accuracy"),
    )
    lines.append(f"  global, mean over the rotations: {range_text(over)}")
    keys = ["seed", SETTING, "client", OWN]
    pairs = rotated(main).merge(rotated(other), on=keys, suffixes=("_main", "_other"))
    pairs["difference"] = pairs["accuracy_other"] - pairs["accuracy_main"]
    lines.append("  per PUMA, mean over the rotations:")
    for client, rows in pairs.groupby("client"):
        lines.append(f"    {client}: {range_text(t_interval(rows.groupby('seed')['difference'].mean().tolist()))}")
    top = pairs[pairs[OWN] == pairs[OWN].max()]
    lines.append(f"  per PUMA, while it holds own ε = {pairs[OWN].max():g} ({main.label} → {other.label}):")
    for client, rows in top.groupby("client"):
        lines.append(
            f"    {client}: {rows['accuracy_main'].mean():.3f} → {rows['accuracy_other'].mean():.3f},"
            f" {half_text(t_interval(rows['difference'].tolist()), sign=True)}"
        )
    lines.append("  per own ε, mean over the PUMAs (ε spent: other / main):")
    for level, rows in pairs.groupby(OWN):
        spent = rows["epsilon_spent_other"].mean() / rows["epsilon_spent_main"].mean()
        lines.append(
            f"    {level:g}: {range_text(t_interval(rows.groupby('seed')['difference'].mean().tolist()))},"
            f" ε spent {rows['epsilon_spent_other'].mean():.3f} / {rows['epsilon_spent_main'].mean():.3f}"
            f" ({1 - spent:.0%} less)"
        )
    cells = [t_interval(rows["difference"].tolist()) for _, rows in pairs.groupby(["client", SETTING])]
    resolved = sum(i.excludes_zero for i in cells)
    largest = max(abs(i.mean) for i in cells)
    lines.append(f"  single (PUMA, rotation) pairs: {resolved} of {len(cells)} resolved, largest |mean| {largest:.3f}")
    return lines


def local_only_lines(arm: Arm, local: pd.DataFrame) -> list[str]:
    """Each PUMA alone at each own ε (mean over seeds), and federated − local-only paired by seed (the
    federated accuracy of a (PUMA, own ε, seed) is its mean over the rotations that give it that ε)."""
    rot = rotated(arm)
    levels = sorted(rot[OWN].unique())
    header = [
        "PUMA",
        *(f"own ε = {e:g}: local-only" for e in levels),
        *(f"federated − local-only at {e:g}" for e in levels),
    ]
    rows, gains = [], {e: {} for e in levels}
    for client, own in rot.groupby("client"):
        alone = local[local["client"] == client]
        row, gained = [client], []
        for level in levels:
            solo = alone[alone[OWN] == level].set_index("seed")["accuracy"].to_dict()
            federated = by_seed(own[own[OWN] == level], "accuracy")
            row.append(f"{np.mean(list(solo.values())):.3f}")
            difference = paired_difference(solo, federated)
            gained.append(half_text(difference.interval, sign=True) if difference else "—")
            for seed in difference.seeds if difference else ():
                gains[level].setdefault(seed, []).append(federated[seed] - solo[seed])
        rows.append(row + gained)
    lines = [markdown(header, rows), "", "Mean over the PUMAs, federated − local-only, paired by seed:"]
    lines += [
        f"  own ε = {level:g}: {range_text(t_interval([float(np.mean(v)) for v in by.values()]))}"
        for level, by in gains.items()
    ]
    return lines


def _shift(i: int) -> float:
    """The i-th PUMA's points, spread a little along the log ε axis so that their bars do not overlap."""
    return 1 + 0.03 * (i - 3)


def _per_client_axes(axes: Any, rows: pd.DataFrame, levels: list[float], column: str = OWN) -> dict[str, Any]:
    """Each PUMA's accuracy against its own ε (mean ± 95% t over seeds) on `axes`; the lines by PUMA."""
    lines = {}
    for i, (client, mine) in enumerate(rows.groupby("client")):
        per_seed = mine.groupby([column, "seed"])["accuracy"].mean().unstack()
        intervals = [t_interval(per_seed.loc[e].dropna().tolist()) for e in levels]
        halves = [0.0 if v.high is None else v.high - v.mean for v in intervals]
        lines[client] = axes.errorbar(
            np.array(levels) * _shift(i),
            [v.mean for v in intervals],
            yerr=halves,
            marker="o",
            capsize=3,
            label=f"PUMA {client}",
        )
    axes.set_xscale("log")
    axes.set_xticks(levels, [f"{v:g}" for v in levels])
    axes.grid(True, alpha=0.3)
    return lines


def draw(arm: Arm, out: Path, local: pd.DataFrame | None = None) -> Path:
    """Each PUMA's accuracy against its own ε over the rotations (o, mean ± 95% t), and in the uniform arms
    (x); with `local`, a second panel: each PUMA trained alone at its own ε."""
    rot, clients = rotated(arm), arm.clients
    uniform = clients[clients[SETTING].map(is_uniform)]
    levels = sorted(rot[OWN].unique())
    figure = Figure(figsize=(13, 4.8) if local is not None else (7.5, 4.8))
    panels = figure.subplots(1, 2, sharey=True) if local is not None else [figure.subplots()]
    axes = panels[0]
    for i, (client, line) in enumerate(_per_client_axes(axes, rot, levels).items()):
        own_uniform = uniform[uniform["client"] == client].groupby(OWN)["accuracy"].mean()
        axes.plot(
            np.array(own_uniform.index) * _shift(i),
            own_uniform.to_numpy(),
            linestyle="none",
            marker="x",
            markersize=9,
            color=line[0].get_color(),
        )
    axes.set(
        xlabel="the client's own ε (k = 16, so T = 1024 … 64)",
        ylabel="client's test accuracy",
    )
    axes.set_title(
        "Federated: the global model on each client's test rows (o: rotations, mean ± 95% t over "
        f"{arm.seeds} seeds;\nx: every client at {levels[0]:g} or at {levels[-1]:g})",
        fontsize=9,
    )
    axes.legend(fontsize=8, ncol=2, loc="lower left")
    if local is not None:
        _per_client_axes(panels[1], local, levels)
        panels[1].set(xlabel="the client's own ε (the same plan: T = 1024 … 64)")
        panels[1].set_title(
            "Local-only: each client alone on its own rows, its own model on its own test rows\n"
            f"(mean ± 95% t over {local['seed'].nunique()} seeds)",
            fontsize=9,
        )
    return save_png(figure, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "sweeps",
        type=Path,
        nargs="*",
        default=list(SWEEPS),
        help=f"sweep folders, the main arm first (default: {' '.join(map(str, SWEEPS))})",
    )
    parser.add_argument("--local-only", type=Path, help="experiments/local_only.py's CSV for the main sweep")
    parser.add_argument("--out", type=Path, default=FIGURE, help="the per-client figure (PNG)")
    args = parser.parse_args()
    arms = [load_arm(folder) for folder in args.sweeps]
    main_arm = arms[0]
    print("Global test accuracy, mean ± 95% t half-width over seeds:\n")
    print(global_table(arms))
    print(f"\nGlobal, paired by seed ({main_arm.label}; mean and 95% t-interval):")
    print("\n".join(uniform_comparisons(main_arm)))
    print(f"\nPer PUMA ({main_arm.label}): mean accuracy over the rotations and seeds at each own ε;")
    print("paired differences (same seed): mean ± 95% t half-width over the seeds\n")
    print(per_client_table(main_arm))
    print("\nAdditive model accuracy ~ PUMA + own-ε level (per-seed least squares; mean ± 95% t half-width):")
    print("\n".join(additive_model(main_arm, with_rotation=False)))
    print("With a rotation term:")
    print("\n".join(additive_model(main_arm, with_rotation=True)))
    for other in arms[1:]:
        print(f"\n{other.label} − {main_arm.label}, paired by seed (mean and 95% t-interval):")
        print("\n".join(arm_comparison(main_arm, other)))
    local = None
    if args.local_only is not None:
        local = pd.read_csv(args.local_only, dtype={"client": str})
        print(f"\nLocal-only ({local['seed'].nunique()} seeds): each client alone on its own rows at its own ε,")
        print("mean accuracy on its own test rows; federated − local-only: mean ± 95% t half-width over seeds\n")
        print("\n".join(local_only_lines(main_arm, local)))
    print(f"\nwrote {draw(main_arm, args.out, local)}")


if __name__ == "__main__":
    main()
