"""Accuracy against both levels of privacy: the federation's client-level ε_fed (DP-FedAvg on the
server) × each client's record-level ε (its own DP-SGD plan), on a federation of many members.

Every cell is one fast-engine run (`sims.fast.engine.run_fast`) of the same run config but for the
two budgets. ε = ∞ means the level is off: ε_fed = ∞ runs without client-level DP and samples
`fraction-train` = cohort/M members per round (the same expected cohort as the client-level cells,
drawn without replacement); ε per record = ∞ runs the clients with clipping and noise off
(`run_fast(private=False)`, the non-private baseline's mechanism), the server's level unchanged.
The seeds are the runs' `seed` and `noise-seed`, so every number is reproducible.

Writes `<name>.json` (every run's numbers and each cell's mean and standard deviation over the
seeds) and `<name>.png` (accuracy against ε_fed, one line per record-level ε) into `--out`.

Usage: python experiments/two_levels.py --out docs/figures [--data-path PUMS_FILE] [--members 1000]
       [--seeds 3] [--update-clip-quantile 0.5 --name two_levels_adaptive]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from sims.fast.engine import run_fast

FEDERATION_EPSILONS = (1.0, 2.0, 4.0, 8.0, math.inf)
RECORD_EPSILONS = (1.0, 4.0, math.inf)


def run_config(args: argparse.Namespace, federation_epsilon: float, record_epsilon: float, seed: int) -> dict:
    """One cell's run config (see the module docstring for what ∞ turns off)."""
    data: dict[str, Any] = {"dataset": "synthetic", "synthetic-examples": args.members * args.rows}
    if args.data_path is not None:  # PUMS rows dealt out at random (iid) to the members
        data = {"dataset": "pums", "data-path": str(args.data_path), "pums-age": "bands", "partitioning": "iid"}
    config: dict[str, Any] = {
        **data,
        "model": args.model,
        "num-server-rounds": args.rounds,
        "learning-rate": args.learning_rate,
        "clip-norm": args.clip_norm,
        "epochs": args.epochs,
        "rule": "calibrated",
        "fraction-evaluate": 0.0,
        "seed": seed,
        "split-seed": 0,
        "noise-seed": seed,
        "results-dir": str(args.runs),
        "epsilon": record_epsilon if math.isfinite(record_epsilon) else 1.0,  # unused when off
        "delta": args.delta,
    }
    if math.isfinite(federation_epsilon):
        config.update(
            {
                "federation-epsilon": federation_epsilon,
                "federation-cohort": float(args.cohort),
                "update-clip": args.update_clip,
                "update-clip-quantile": args.update_clip_quantile,
                "federation-rule": "calibrated",
            }
        )
    else:
        config["fraction-train"] = args.cohort / args.members
    return config


def run_cell(args: argparse.Namespace, federation_epsilon: float, record_epsilon: float, seed: int) -> dict:
    config = run_config(args, federation_epsilon, record_epsilon, seed)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # seeded noise: for experiments only
        folder, _ = run_fast(config, args.members, private=math.isfinite(record_epsilon), say=lambda _: None)
    summary = json.loads((folder / "summary.json").read_text())
    return {
        "federation_epsilon": federation_epsilon,
        "record_epsilon": record_epsilon,
        "seed": seed,
        "final_accuracy": summary["final_accuracy"],
        "largest_class_share": summary["largest_class_share"],
        "record_epsilon_spent_max": summary["epsilon_spent_max"] if math.isfinite(record_epsilon) else None,
        "record_epsilon_spent_mean": summary["epsilon_spent_mean"] if math.isfinite(record_epsilon) else None,
        "federation_epsilon_spent": summary.get("federation_epsilon_spent"),
        "federation_sigma": summary.get("federation", {}).get("sigma"),
        "wall_s": round(time.perf_counter() - started, 1),
        "folder": folder.name,  # under --runs
    }


def cells(runs: list[dict]) -> list[dict]:
    """Each (ε_fed, ε per record)'s mean and standard deviation of the final accuracy over seeds."""
    table = []
    for federation_epsilon in FEDERATION_EPSILONS:
        for record_epsilon in RECORD_EPSILONS:
            scores = [
                r["final_accuracy"]
                for r in runs
                if r["federation_epsilon"] == federation_epsilon and r["record_epsilon"] == record_epsilon
            ]
            if scores:
                table.append(
                    {
                        "federation_epsilon": federation_epsilon,
                        "record_epsilon": record_epsilon,
                        "accuracy_mean": statistics.fmean(scores),
                        "accuracy_sd": statistics.stdev(scores) if len(scores) > 1 else 0.0,
                        "seeds": len(scores),
                    }
                )
    return table


def draw(table: list[dict], largest_class: float, path: Path) -> None:
    """Accuracy against ε_fed (∞ drawn at the right), one line per record-level ε, and what always
    predicting the test rows' largest class scores."""
    positions = {e: i for i, e in enumerate(FEDERATION_EPSILONS)}
    fig = Figure(figsize=(6, 3.8), layout="tight")
    axes = fig.subplots()
    axes.axhline(largest_class, color="grey", linestyle=":", label="largest class")
    for index, record_epsilon in enumerate(RECORD_EPSILONS):
        rows = [c for c in table if c["record_epsilon"] == record_epsilon]
        axes.errorbar(
            [positions[c["federation_epsilon"]] for c in rows],
            [c["accuracy_mean"] for c in rows],
            yerr=[c["accuracy_sd"] for c in rows],
            marker="o",
            capsize=3,
            color=f"C{index}",
            label=f"ε per record {'∞ (off)' if math.isinf(record_epsilon) else f'{record_epsilon:g}'}",
        )
    axes.set_xticks(range(len(FEDERATION_EPSILONS)))
    axes.set_xticklabels(["∞ (off)" if math.isinf(e) else f"{e:g}" for e in FEDERATION_EPSILONS])
    axes.set_xlabel("federation's client-level ε_fed")
    axes.set_ylabel("final test accuracy (mean ± sd over seeds)")
    axes.legend(fontsize="small")
    fig.savefig(path, dpi=120)


def _strict(value: Any) -> Any:
    """`value` with ∞ written as the string "inf": JSON has no infinity."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for <name>.json and <name>.png")
    parser.add_argument("--runs", type=Path, default=Path("runs/two_levels"), help="the runs' folders")
    parser.add_argument("--members", type=int, default=1000)
    parser.add_argument(
        "--data-path", type=Path, help="a PUMS file (shared/data/pums/fulton_pums5_full.csv); none: synthetic rows"
    )
    parser.add_argument("--rows", type=int, default=250, help="synthetic rows per member (80%% train, 20%% test)")
    parser.add_argument("--model", default="logreg")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--cohort", type=int, default=100, help="expected members per round pM")
    parser.add_argument("--update-clip", type=float, default=1.0, help="S (adaptive clipping: its first value)")
    parser.add_argument(
        "--update-clip-quantile", type=float, default=0.0, help="0: a fixed S; in (0, 1): adaptive clipping"
    )
    parser.add_argument("--name", default="two_levels", help="the output files' stem")
    parser.add_argument("--learning-rate", type=float, default=1.0)
    parser.add_argument("--clip-norm", type=float, default=1.0)
    parser.add_argument("--epochs", type=float, default=8.0, help="each client's planned epochs k over the run")
    parser.add_argument("--delta", type=float, default=1e-3, help="each client's δ (below 1/N for its rows)")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}  # as given
    args.runs = args.runs.absolute()
    args.data_path = None if args.data_path is None else args.data_path.absolute()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    grid = [(f, r, s) for f in FEDERATION_EPSILONS for r in RECORD_EPSILONS for s in range(args.seeds)]
    for number, (federation_epsilon, record_epsilon, seed) in enumerate(grid, start=1):
        runs.append(run_cell(args, federation_epsilon, record_epsilon, seed))
        last = runs[-1]
        print(
            f"[{number}/{len(grid)}] ε_fed {federation_epsilon:g}, ε per record {record_epsilon:g}, seed {seed}: "
            f"accuracy {last['final_accuracy']:.4f} ({last['wall_s']:.0f} s)",
            flush=True,
        )
    table = cells(runs)
    (args.out / f"{args.name}.json").write_text(
        json.dumps(_strict({"settings": settings, "cells": table, "runs": runs}), indent=2) + "\n"
    )
    draw(table, max(r["largest_class_share"] for r in runs), args.out / f"{args.name}.png")
    for cell in table:
        print(
            f"ε_fed {cell['federation_epsilon']:g}  ε per record {cell['record_epsilon']:g}: "
            f"{cell['accuracy_mean']:.4f} ± {cell['accuracy_sd']:.4f}"
        )


if __name__ == "__main__":
    main()
