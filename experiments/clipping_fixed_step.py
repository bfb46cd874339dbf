"""The clipping-norm trade-off at a fixed step η·C (experiment 4 of docs/experiments.md): tables and figure.

Each sweep folder is one η·C level (C and η linked, ε and k linked so that T is the same at every ε).
Prints, per sweep, the final test accuracy per C and ε as mean ± 95% t half-width over seeds, the
paired differences (same seeds) between neighbouring C, of every C against a reference C, of the
largest C against the smallest, and of every ε against the smallest ε, and the binomial s.e. of
one run; draws accuracy against C, one line per sweep and ε. Intervals are Student's t
(fedprivacy.reports.statistics); † marks a paired difference whose interval holds 0 (not resolved).

Usage: python experiments/clipping_fixed_step.py [SWEEP_DIR ...] [--reference-clip 0.1]
       [--out docs/figures/experiments/clipping_fixed_step.png]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from fedprivacy.reports.statistics import PairedDifference, binomial_se, paired_difference, t_interval
from fedprivacy.reports.sweep_data import load_sweep
from fedprivacy.reports.sweep_figures import save_png

SWEEPS = (Path("runs/clip-fixed"), Path("runs/clip-fixed-small"))
FIGURE = Path("docs/figures/experiments/clipping_fixed_step.png")
CLIP, RATE, EPSILON = "clip-norm", "learning-rate", "epsilon"


def signed(value: float, digits: int) -> str:
    """+0.0012 / −0.0012, with the minus sign the docs print."""
    return f"{value:+.{digits}f}".replace("-", "−")


def step_label(cells: pd.DataFrame) -> str:
    """`η·C = 3`: the step the sweep holds fixed (refused if its cells do not share one)."""
    steps = (cells[CLIP] * cells[RATE]).round(9).unique()
    if len(steps) != 1:
        raise SystemExit(f"η·C is not fixed in this sweep: {sorted(steps)}")
    return f"η·C = {steps[0]:g}"


def accuracy_by_seed(cells: pd.DataFrame, clip: float, epsilon: float) -> dict[int, float]:
    """Final accuracy per seed of the cells at one (C, ε)."""
    rows = cells[(cells[CLIP] == clip) & (cells[EPSILON] == epsilon)]
    return dict(zip(rows["seed"], rows["final_accuracy"]))


def mean_cell(cells: pd.DataFrame, clip: float, epsilon: float) -> str:
    """`0.718 ± 0.003`: mean ± 95% t half-width over the seeds."""
    interval = t_interval(list(accuracy_by_seed(cells, clip, epsilon).values()))
    if interval.high is None:
        return f"{interval.mean:.3f} (1 seed)"
    return f"{interval.mean:.3f} ± {interval.high - interval.mean:.3f}"


def difference_cell(difference: PairedDifference | None, digits: int = 4) -> str:
    """`+0.0009 [+0.0002, +0.0016]`, with † when the interval holds 0."""
    if difference is None or difference.interval.low is None:
        return "—"
    interval = difference.interval
    text = f"{signed(interval.mean, digits)} [{signed(interval.low, digits)}, {signed(interval.high, digits)}]"
    return text if difference.resolved else f"{text} †"


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table: the first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def accuracy_table(sweeps: dict[str, pd.DataFrame]) -> str:
    """C, then per sweep its η and the mean ± half-width at each ε."""
    clips = sorted({c for cells in sweeps.values() for c in cells[CLIP].unique()})
    header = ["C"]
    for label, cells in sweeps.items():
        header += [f"η ({label})", *(f"ε = {e:g}" for e in sorted(cells[EPSILON].unique()))]
    rows = []
    for clip in clips:
        row = [f"{clip:g}"]
        for cells in sweeps.values():
            rates = cells.loc[cells[CLIP] == clip, RATE].unique()
            row.append(f"{rates[0]:g}" if len(rates) == 1 else "—")
            row += [mean_cell(cells, clip, e) for e in sorted(cells[EPSILON].unique())]
        rows.append(row)
    return markdown(header, rows)


def contrast_table(sweeps: dict[str, pd.DataFrame], pairs: Sequence[tuple[float, float]], name: str) -> str:
    """Paired differences accuracy(b) − accuracy(a) for each (a, b) pair of C, per sweep and ε."""
    header = [name] + [
        f"{label}, ε = {e:g}" for label, cells in sweeps.items() for e in sorted(cells[EPSILON].unique())
    ]
    rows = []
    for a, b in pairs:
        row = [f"{a:g} → {b:g}"]
        for cells in sweeps.values():
            for e in sorted(cells[EPSILON].unique()):
                row.append(
                    difference_cell(paired_difference(accuracy_by_seed(cells, a, e), accuracy_by_seed(cells, b, e)))
                )
        rows.append(row)
    return markdown(header, rows)


def epsilon_table(sweeps: dict[str, pd.DataFrame]) -> str:
    """Paired differences of every larger ε against the smallest ε, per sweep and C."""
    header, columns = ["C"], []
    for label, cells in sweeps.items():
        epsilons = sorted(cells[EPSILON].unique())
        for e in epsilons[1:]:
            header.append(f"{label}, ε = {e:g} − ε = {epsilons[0]:g}")
            columns.append((cells, epsilons[0], e))
    clips = sorted({c for cells in sweeps.values() for c in cells[CLIP].unique()})
    rows = [
        [f"{clip:g}"]
        + [
            difference_cell(paired_difference(accuracy_by_seed(cells, clip, low), accuracy_by_seed(cells, clip, high)))
            for cells, low, high in columns
        ]
        for clip in clips
    ]
    return markdown(header, rows)


def binomial_range(sweeps: dict[str, pd.DataFrame]) -> str:
    """The binomial s.e. of one run at the lowest and highest mean accuracy of any (C, ε)."""
    errors = []
    for cells in sweeps.values():
        means = cells.groupby([CLIP, EPSILON]).agg(p=("final_accuracy", "mean"), m=("evaluation_rows", "min"))
        errors += [binomial_se(p, m) for p, m in zip(means["p"], means["m"])]
    errors = [e for e in errors if e is not None]
    if not errors:
        return "binomial s.e. of one run: unknown (no evaluation_rows in the cells' summary.json)"
    rows = int(min(m for cells in sweeps.values() for m in cells["evaluation_rows"]))
    return f"binomial s.e. of one run on its {rows} test rows: {min(errors):.4f}–{max(errors):.4f}"


def draw(sweeps: dict[str, pd.DataFrame], out: Path) -> Path:
    """Accuracy against C (log axis), mean and 95% t-interval, one line per sweep and ε."""
    figure = Figure(figsize=(7.0, 4.5))
    axes = figure.subplots()
    for style, (label, cells) in zip(("-", "--", ":", "-."), sweeps.items()):
        for colour, (epsilon, rows) in enumerate(cells.groupby(EPSILON)):
            clips = sorted(rows[CLIP].unique())
            intervals = [t_interval(rows.loc[rows[CLIP] == c, "final_accuracy"].tolist()) for c in clips]
            means = [interval.mean for interval in intervals]
            halves = [0.0 if v.high is None else v.high - v.mean for v in intervals]
            axes.errorbar(
                [c * (1.04 if colour else 0.96) for c in clips],  # ε side by side
                means,
                yerr=halves,
                linestyle=style,
                marker="o",
                capsize=3,
                color=f"C{colour}",
                label=f"ε = {epsilon:g}, {label} ({intervals[0].n} seeds)",
            )
    axes.set_xscale("log")
    axes.set(
        xlabel="clip norm C (η = (η·C)/C)",
        ylabel="final test accuracy (mean, 95% t-interval)",
    )
    axes.set_title("PUMS, calibrated, T = 512 at both ε (k = 16 at ε = 1, 32 at ε = 4)", fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    return save_png(figure, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "sweeps",
        type=Path,
        nargs="*",
        default=list(SWEEPS),
        help=f"sweep folders, one per η·C (default: {' '.join(map(str, SWEEPS))})",
    )
    parser.add_argument("--reference-clip", type=float, default=0.1, help="the C every other C is compared with")
    parser.add_argument("--out", type=Path, default=FIGURE, help="the figure (PNG)")
    args = parser.parse_args()
    sweeps = {}
    for folder in args.sweeps:
        cells = load_sweep(folder).measured
        sweeps[step_label(cells)] = cells
    clips = sorted({c for cells in sweeps.values() for c in cells[CLIP].unique()})
    print("Final test accuracy, mean ± 95% t half-width over seeds:\n")
    print(accuracy_table(sweeps))
    print("\nPaired differences between neighbouring C (the next C minus this one, same seeds; † not resolved):\n")
    print(contrast_table(sweeps, list(zip(clips, clips[1:])), "C → next C"))
    others = [(args.reference_clip, c) for c in clips if c != args.reference_clip]
    print(f"\nPaired differences against C = {args.reference_clip:g} (this C minus it):\n")
    print(contrast_table(sweeps, others, f"{args.reference_clip:g} → C"))
    print("\nPaired differences from the smallest to the largest C:\n")
    print(contrast_table(sweeps, [(clips[0], clips[-1])], "C → C"))
    print("\nPaired differences between budgets at the same C (same seeds):\n")
    print(epsilon_table(sweeps))
    print("\n" + binomial_range(sweeps))
    print(f"\nwrote {draw(sweeps, args.out)}")


if __name__ == "__main__":
    main()
