"""Issue #4: federated PUMS, 7 PUMA clients, logistic regression on 15 features, 20 rounds.

    python -m sims.federated_pums --data /abs/path/fulton_pums5_full.csv [--json out.json] [--search]

Scenarios (the private ones run the real ServerApp and ClientApp in process, sims.runner):
- non-private: FedAvg of plain local SGD, same partitions, model, schedule (steps, sampling) and
  test set (sims.baseline), with the private runs' η and with its own η chosen on validation;
- calibrated ε=1 and proactive ε=1 for every client;
- heterogeneous budgets ε = 0.5,1,1,2,2,4,8 (sorted PUMA order), calibrated rule.

Every private scenario asserts that every client's ε spent ≤ its budget. The table shows the final
and best-round test accuracy, the largest ε spent and the wall time; `--seeds N` adds the spread of
the final accuracy over N DP noise seeds from `sims.baseline.private_proxy` (the same trainer and
noise seeds as the apps without their ledger; the script checks it reproduces the apps' seed-0 run).

Hyperparameters (clip norm C, learning rate η, epochs k) were chosen on a validation split
carved from the clients' training rows (sims.validation), never the test set: `--search` re-runs
that grid search and reports the best setting; the script otherwise uses `CHOSEN`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedprivacy.participant import server_test_set
from fedprivacy.runconfig import parse_run_config
from sims.baseline import nonprivate_baseline, private_proxy
from sims.runner import RunResult, Scenario, run_scenario
from sims.validation import training_rows_file

ROUNDS = 20
HETEROGENEOUS = "0.5,1,1,2,2,4,8"
# Chosen by `--search` on the validation split (clients' training rows only), 2026-11-22: the best
# mean final validation accuracy of the private runs over rules {calibrated, proactive} × noise
# seeds {0, 1} was 0.7166 at C=0.1, η=30, k=16 (next: C=1, η=1, k=16 at 0.7130). A spot check of
# k=32 (T=2048) found nothing better (best 0.7165), so the grid stops at 16.
CHOSEN: dict[str, float] = {"clip-norm": 0.1, "learning-rate": 30.0, "epochs": 16.0}
# Plain SGD is unstable at the private runs' η=30 (unclipped gradients are up to ~50× larger than
# C=0.1), so the baseline is also reported with its own η, chosen on the same validation split at
# the same k (same steps and sampling): 0.7163 at η=3 (η=1: 0.7091, η=10: 0.6574, η=30: 0.6984).
CHOSEN_NONPRIVATE_LR = 3.0
GRID: dict[str, list[float]] = {
    "clip-norm": [0.1, 0.3, 1.0, 3.0],
    "learning-rate": [1.0, 3.0, 10.0, 30.0],
    "epochs": [0.0, 8.0, 16.0],  # 0: the planner's k (smallest meeting the proactive ln N condition)
}
SEARCH_RULES = ("calibrated", "proactive")
SEARCH_NOISE_SEEDS = (0, 1)


def base_config(data: Path, hyper: dict[str, float]) -> dict[str, Any]:
    """The run config shared by every scenario: 7 natural PUMA clients, logreg, 20 rounds."""
    return {
        "dataset": "pums",
        "data-path": str(data),
        "partition-by": "puma",
        "model": "logreg",
        "num-server-rounds": ROUNDS,
        "epsilon": 1.0,
        "seed": 0,
        "noise-seed": 0,  # reproducible noise: this is an experiment
        **hyper,
    }


def scenarios(data: Path, hyper: dict[str, float], heterogeneous: bool = True) -> list[Scenario]:
    base = base_config(data, hyper)
    found = [
        Scenario("ε=1 calibrated", {**base, "rule": "calibrated"}),
        Scenario("ε=1 proactive", {**base, "rule": "proactive"}),
    ]
    if heterogeneous:
        found.append(Scenario(f"ε={HETEROGENEOUS} calibrated", {**base, "rule": "calibrated", "epsilons": HETEROGENEOUS}))
    return found


def search(data: Path, workdir: Path, log=print) -> tuple[dict[str, float], float, list[dict[str, Any]]]:
    """Grid search on the validation split: (private choice, non-private η at the same k, rows).

    Private: the best mean final validation accuracy over rules and noise seeds. Non-private: the
    best final validation accuracy over η at the private choice's k (clipping does not apply)."""
    carved = training_rows_file(base_config(data, {}), workdir / "training_rows.csv")
    rows = []
    for clip, lr, epochs in itertools.product(*GRID.values()):
        hyper = {"clip-norm": clip, "learning-rate": lr, "epochs": epochs}
        config = base_config(carved, hyper)
        private = [
            private_proxy({**config, "rule": rule, "noise-seed": seed}).final_accuracy
            for rule in SEARCH_RULES
            for seed in SEARCH_NOISE_SEEDS
        ]
        plain = nonprivate_baseline(config).final_accuracy
        rows.append({**hyper, "val_private_mean": statistics.fmean(private), "val_private_min": min(private), "val_nonprivate": plain})
        log(f"  C={clip:<4g} η={lr:<4g} k={epochs:<3g} validation: private {rows[-1]['val_private_mean']:.4f} (min {min(private):.4f}), non-private {plain:.4f}")
    best = max(rows, key=lambda r: r["val_private_mean"])
    plain = max((r for r in rows if r["epochs"] == best["epochs"]), key=lambda r: r["val_nonprivate"])
    return {k: best[k] for k in GRID}, plain["learning-rate"], rows


def _fmt(value: float | None, digits: int = 4) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def table(results: list[dict[str, Any]]) -> str:
    head = f"{'scenario':<32} {'final acc':>9} {'best (round)':>14} {'max ε spent':>11} {'seeds mean±sd':>15} {'wall s':>7}"
    lines = [head, "-" * len(head)]
    for r in results:
        spread = "—" if r.get("seed_mean") is None else f"{r['seed_mean']:.4f}±{r['seed_sd']:.4f}"
        lines.append(
            f"{r['scenario']:<32} {r['final_accuracy']:>9.4f} {r['best_accuracy']:>7.4f} ({r['best_round']:>2}) "
            f"{_fmt(r['epsilon_spent_max']):>11} {spread:>15} {r['wall_s']:>7.1f}"
        )
    return "\n".join(lines)


def _spread(config: dict[str, Any], seeds: int, private: bool) -> tuple[float | None, float | None, list[float]]:
    if seeds < 2 or not private:
        return None, None, []
    finals = [private_proxy({**config, "noise-seed": s}).final_accuracy for s in range(seeds)]
    return statistics.fmean(finals), statistics.stdev(finals), finals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="absolute path of fulton_pums5_full.csv")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--results-dir", type=Path, help="where the apps write their results folders (default: a temp folder)")
    parser.add_argument("--search", action="store_true", help="re-run the validation grid search and use its choice")
    parser.add_argument("--seeds", type=int, default=5, help="DP noise seeds for the spread column (proxy; <2 turns it off)")
    parser.add_argument("--no-heterogeneous", action="store_true", help="skip the heterogeneous-budget scenario")
    args = parser.parse_args(argv)
    data = args.data.expanduser().resolve()
    if not data.is_file():
        print(f"--data {args.data}: no such file (the PUMS extract lives in shared/data/pums/)", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="federated-pums-"))
    results_dir = (args.results_dir or workdir / "results").resolve()

    hyper, plain_lr, grid_rows = dict(CHOSEN), CHOSEN_NONPRIVATE_LR, []
    if args.search:
        print(f"validation grid search ({len(list(itertools.product(*GRID.values())))} settings):", flush=True)
        hyper, plain_lr, grid_rows = search(data, workdir)
        print(f"chosen on validation: {hyper}; non-private learning rate {plain_lr:g}", flush=True)

    settings = parse_run_config(base_config(data, hyper))
    test = server_test_set(settings, 7)
    assert test is not None and test.features.shape[1] == 15, "expected the 15-feature PUMS layout"

    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    for label, lr in ((f"non-private, same η={hyper['learning-rate']:g}", hyper["learning-rate"]), (f"non-private, own η={plain_lr:g}", plain_lr)):
        baseline = nonprivate_baseline({**base_config(data, {**hyper, "learning-rate": lr}), "rule": "calibrated"}, name=label)
        results.append({**baseline.row(), "seed_mean": None, "seed_sd": None})
        print(f"{label}: final {baseline.final_accuracy:.4f}", flush=True)
    for run_id, scenario in enumerate(scenarios(data, hyper, not args.no_heterogeneous), start=1):
        result: RunResult = run_scenario(scenario, results_dir, run_id=run_id, quiet=True)
        result.check_budgets()  # every client's ε spent ≤ its budget, or this raises
        proxy = private_proxy(scenario.config())
        if [round(r["accuracy"], 6) for r in proxy.rounds] != [round(r["accuracy"], 6) for r in result.rounds]:
            print(f"note: the proxy does not reproduce {scenario.name} exactly; its seed spread is indicative", file=sys.stderr)
        mean, sd, finals = _spread(scenario.config(), args.seeds, True)
        results.append({**result.row(), "seed_mean": mean, "seed_sd": sd, "seed_finals": finals,
                        "per_client": [{k: c[k] for k in ("client_id", "num_examples", "epsilon_budget", "epsilon_spent", "sigma", "steps_all_runs")} for c in result.clients]})  # fmt: skip
        print(f"{scenario.name}: final {result.final_accuracy:.4f}, max ε spent {result.epsilon_spent_max:.4f} ({result.wall_s:.0f} s)", flush=True)

    print()
    print(table(results))
    # The target is judged against the stronger of the two non-private baselines.
    plain = max(r["final_accuracy"] for r in results[:2])
    verdicts = {}
    for r in results[2:4]:
        gap = plain - r["final_accuracy"]
        verdicts[r["scenario"]] = {"gap_pp": round(100 * gap, 2), "met": gap <= 0.02, "non_private": plain}
        print(f"target (ε=1 within 2 pp of non-private {plain:.4f}), {r['scenario']}: gap {100 * gap:+.2f} pp -> {'met' if gap <= 0.02 else 'NOT met'}")
    print(f"hyperparameters: {hyper}, non-private η {plain_lr:g}; total {time.perf_counter() - started:.0f} s; results under {results_dir}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"hyperparameters": hyper, "nonprivate_learning_rate": plain_lr, "grid": GRID, "search": grid_rows, "rounds": ROUNDS, "results": results, "target": verdicts}
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
