"""Two sweeps with the same grid, paired seed by seed: B − A per arm, with 95% t-intervals.

A sweep's report pairs the arms of one grid; two settings that a single grid cannot hold (e.g. a
constant and a decaying step, whose run-config keys exclude each other) run as two sweeps with the
same grid keys, clients, split-seed and seeds. This matches their completed cells on every grid
key, pairs them by seed (fedprivacy.reports.statistics.paired_difference), and prints, per arm,
each sweep's mean ± 95% t half-width (with its tuned values) and B − A. † marks an interval that
holds 0 (not resolved).

Usage: python experiments/paired_sweeps.py SWEEP_A SWEEP_B
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from fedprivacy.reports.statistics import paired_difference, t_interval


def grid_keys(sweep: Path) -> list[str]:
    """The varied keys of a sweep (its grid's, then its linked groups'), from sweep.json."""
    spec = json.loads((sweep / "sweep.json").read_text())
    return [*spec["grid"], *(key for group in spec.get("linked", {}).values() for key in group)]


def completed(sweep: Path) -> pd.DataFrame:
    table = pd.read_csv(sweep / "sweep.csv")
    return table[table["status"] == "completed"]


def text(value: object) -> str:
    """A grid or tuned value as a scenario writes it (0.1, 16, "constant")."""
    return f"{value:g}" if isinstance(value, int | float) else str(value)


def signed(value: float) -> str:
    return f"{value:+.3f}".replace("-", "−")


def arm_lines(a: pd.DataFrame, b: pd.DataFrame, keys: list[str], names: tuple[str, str]) -> list[str]:
    """One line per arm (the shared keys but the seed) present in both sweeps."""
    arms = [key for key in keys if key != "seed"]
    lines = []
    for values, mine in a.groupby(arms, sort=False):
        values = values if isinstance(values, tuple) else (values,)
        theirs = b.loc[(b[arms] == pd.Series(dict(zip(arms, values, strict=True)))).all(axis=1)]
        if theirs.empty:
            continue
        label = ", ".join(f"{key} = {text(value)}" for key, value in zip(arms, values, strict=True))
        parts = []
        for name, rows in zip(names, (mine, theirs), strict=True):
            interval = t_interval(rows["final_accuracy"].tolist())
            tuned = ", ".join(f"{c[6:]} = {text(rows[c].iloc[0])}" for c in rows.columns if c.startswith("tuned."))
            parts.append(f"{name} {interval.mean:.3f} ± {interval.high - interval.mean:.3f} ({tuned or 'untuned'})")
        difference = paired_difference(
            mine.set_index("seed")["final_accuracy"].to_dict(), theirs.set_index("seed")["final_accuracy"].to_dict()
        )
        interval = difference.interval
        spread = f"{signed(interval.mean)} [{signed(interval.low)}, {signed(interval.high)}]"
        lines.append(f"{label}: {'; '.join(parts)}; B − A {spread}{'' if interval.excludes_zero else ' †'}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="sweep A")
    parser.add_argument("b", type=Path, help="sweep B")
    args = parser.parse_args()
    keys = grid_keys(args.a)
    if set(keys) != set(grid_keys(args.b)) or "seed" not in keys:
        raise SystemExit(f"{args.a} and {args.b} must vary the same keys, seed among them")
    print(f"A = {args.a}, B = {args.b}: final test accuracy, mean ± 95% t half-width over seeds; B − A paired by seed")
    print("\n".join(arm_lines(completed(args.a), completed(args.b), keys, ("A", "B"))))


if __name__ == "__main__":
    main()
