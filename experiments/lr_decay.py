"""Step-size decay against a tuned constant step under central DP-SGD on the digits CNN: Wu et al.'s
(ADP-SGD) appendix F.3, redone with the constant step tuned.

The appendix trains a CNN on MNIST for 50 epochs at noise multipliers σ ∈ {1.6, 3.2, 6.4, 12.8} with
η_t = 1/sqrt(2 + c·t), c ∈ {1e-5, 1e-3, 1e-2, 0.1, 0.5}, against c = 0: a constant 1/√2 that nothing
tuned (it tunes neither the constant nor the decay's η). Here: the embedded digits (8×8 images,
1,797 rows), the project's CNN, per-example clipping at C = 1, Poisson sampling at an expected batch
of 64, the same σ, c and epochs; σ is certified by PLD (δ = 1e-5) for its (q, T).

What a referee would ask for:
- the constant step's η is chosen per σ among `--constant-lrs`, and the decay's c per σ among the
  paper's c's and c = 2 (its η stays 1, as in the paper), on validation rows: 20 % of the training
  rows, cut by the same stratified rule and seed as a sweep's `[tune]` (fedprivacy.data.splits);
- tuning runs use `--tune-seeds`; the test seeds (`--seeds`) train on all training rows and are
  scored on the test rows (20 %, fixed by `--split-seed`, the same for every seed), which no tuning
  run reads;
- the arms on the test rows, paired by seed (a seed fixes the initial model, the Poisson samples
  and the noise): the paper's constant 1/√2, the tuned constant, and the decay at every c (the one
  with the tuned c is "the tuned decay"); differences with 95 % t-intervals
  (fedprivacy.reports.statistics).

Prints the tables, writes lr_decay.json (every run) and lr_decay.png into `--out`.

Usage: python experiments/lr_decay.py [--seeds 0,1,2,3,4] [--epochs 50] [--out docs/figures/experiments]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from fedprivacy.data import load_dataset
from fedprivacy.data.splits import train_and_evaluation_rows
from fedprivacy.data.types import Dataset
from fedprivacy.models import build_model, evaluate_model
from fedprivacy.privacy.accountants import NoiseEvent, pld_epsilon
from fedprivacy.privacy.plan import Plan
from fedprivacy.reports.statistics import Interval, paired_difference, t_interval
from fedprivacy.training import DPTrainer

SIGMAS = (1.6, 3.2, 6.4, 12.8)
# the paper's c > 0, and 2 beyond them (a first search chose the paper's largest, 0.5, at σ ≥ 6.4)
DECAYS = (1e-5, 1e-3, 1e-2, 0.1, 0.5, 2.0)
CONSTANT_LRS = (0.01, 0.03, 0.1, 0.3, 1.0)
OFFSET = 2.0  # a in η_t = η/sqrt(a + c·t): the paper's a = 2, so c = 0 is the constant 1/√2
DELTA = 1e-5
FRACTION = 0.2  # the test rows of all rows, and the validation rows of the training rows
PAPER, TUNED = "paper constant 1/√2", "tuned constant"


@dataclass(frozen=True)
class Run:
    """One training run: its noise, step schedule (c = None: constant η), seed and rows."""

    sigma: float
    learning_rate: float
    decay: float | None
    seed: int
    on: str  # "validation": fit rows, scored on validation rows; "test": training rows, scored on test rows


def rows(on: str, split_seed: int) -> tuple[Dataset, Dataset]:
    """(rows trained on, rows scored on): the test split is fixed by `split_seed` either way."""
    data = load_dataset("digits", None, images=True)
    validation = FRACTION if on == "validation" else 0.0
    train, scored = train_and_evaluation_rows(data.labels, FRACTION, validation, (split_seed,))
    return data.subset(train), data.subset(scored)


def plan(n: int, run: Run, q: float, steps: int) -> Plan:
    """A one-round plan with the run's σ, certified by PLD, and its step sizes."""
    epsilon = pld_epsilon([NoiseEvent(run.sigma, q, steps)], DELTA)
    decaying = run.decay is not None
    return Plan(
        client_id="central",
        rule="calibrated",
        n=n,
        epsilon=epsilon,
        delta=DELTA,
        clip_norm=1.0,
        sigma=run.sigma,
        sampling_rate=q,
        steps=steps,
        rounds=1,
        noise_segments=((run.sigma, steps),),
        epsilon_pld=epsilon,
        epsilon_rdp=epsilon,
        learning_rate=run.learning_rate,
        lr_schedule="inverse_sqrt" if decaying else "constant",
        lr_params={"a": OFFSET, "c": run.decay} if decaying else {},
    )


def accuracy(run: Run, epochs: float, batch: int, split_seed: int) -> dict[str, float]:
    """Train one run and score it; returns its accuracy, steps and ε."""
    torch.set_num_threads(1)
    train, scored = rows(run.on, split_seed)
    n = len(train.labels)
    q = batch / n
    the_plan = plan(n, run, q, math.ceil(epochs / q))
    torch.manual_seed(run.seed)
    model = build_model("cnn", train.features.shape[1:], int(train.num_classes))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # seeded noise: for experiments only
        DPTrainer(model, the_plan, train.features, train.labels, seed=run.seed).run_steps(the_plan.steps)
    return {"accuracy": evaluate_model(model, scored)[1], "steps": the_plan.steps, "epsilon": the_plan.epsilon_pld}


def run_all(runs: list[Run], args: argparse.Namespace) -> list[dict[str, object]]:
    """Every run's record, in order, on `--jobs` processes."""
    train = functools.partial(accuracy, epochs=args.epochs, batch=args.batch, split_seed=args.split_seed)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        return [{**asdict(run), **outcome} for run, outcome in zip(runs, pool.map(train, runs), strict=True)]


def tuning_runs(sigma: float, tune_seeds: list[int], constant_lrs: list[float]) -> list[Run]:
    constant = [Run(sigma, lr, None, seed, "validation") for lr in constant_lrs for seed in tune_seeds]
    decay = [Run(sigma, 1.0, c, seed, "validation") for c in DECAYS for seed in tune_seeds]
    return constant + decay


def best(records: list[dict[str, object]], key: str) -> tuple[float, dict[float, float]]:
    """The candidate value of `key` with the highest mean validation accuracy (the first on a tie)."""
    scores: dict[float, list[float]] = {}
    for record in records:
        scores.setdefault(record[key], []).append(record["accuracy"])
    means = {value: float(np.mean(accuracies)) for value, accuracies in scores.items()}
    return max(means, key=lambda value: (means[value], -list(means).index(value))), means


def signed(value: float) -> str:
    return f"{value:+.3f}".replace("-", "−")


def difference_text(a: dict[int, float], b: dict[int, float]) -> tuple[str, Interval]:
    """`b − a` paired by seed: `+0.012 [−0.004, +0.028]`, † when the interval holds 0."""
    interval = paired_difference(a, b).interval
    text = f"{signed(interval.mean)} [{signed(interval.low)}, {signed(interval.high)}]"
    return (text if interval.excludes_zero else f"{text} †"), interval


def draw(results: list[dict[str, object]], out: Path, title: str) -> Path:
    """Left: each arm's test accuracy against σ (mean ± 95 % t). Right: the paired differences."""
    figure = Figure(figsize=(10, 4.2))
    left, right = figure.subplots(1, 2)
    sigmas = [r["sigma"] for r in results]
    shown = {
        PAPER: lambda r: PAPER,
        TUNED: lambda r: TUNED,
        "tuned decay (η = 1, c tuned)": lambda r: decay_arm(r["tuned"]["decay"]),
    }
    for offset, (arm, key) in zip((-0.04, 0.0, 0.04), shown.items(), strict=True):
        intervals = [t_interval(list(r["test"][key(r)].values())) for r in results]
        left.errorbar(
            np.array(sigmas) * (1 + offset),
            [i.mean for i in intervals],
            yerr=[i.high - i.mean for i in intervals],
            marker="o",
            capsize=3,
            label=arm,
        )
    for offset, name in zip(
        (-0.03, 0.03), ("tuned decay − tuned constant", "tuned decay − paper constant"), strict=True
    ):
        intervals = [r["differences"][name] for r in results]
        right.errorbar(
            np.array(sigmas) * (1 + offset),
            [i["mean"] for i in intervals],
            yerr=[[i["mean"] - i["low"] for i in intervals], [i["high"] - i["mean"] for i in intervals]],
            marker="o",
            capsize=3,
            label=name,
        )
    right.axhline(0, color="black", linewidth=0.8)
    for axes, ylabel in ((left, "test accuracy"), (right, "paired difference (95 % t-interval)")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(sigmas, [f"{s:g}" for s in sigmas])
        axes.set(xlabel="noise multiplier σ", ylabel=ylabel)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    figure.savefig(out / "lr_decay.png", dpi=110)
    return out / "lr_decay.png"


def test_arms(sigma: float, tuned: dict[str, object]) -> dict[str, Run]:
    """The arms on the test rows (seed 0 as a template): the paper's constant, the tuned constant,
    every c of the paper at η = 1 (the tuned decay is the one with the tuned c)."""
    arms = {PAPER: Run(sigma, 1.0, 0.0, 0, "test"), TUNED: Run(sigma, tuned["learning_rate"], None, 0, "test")}
    return arms | {decay_arm(c): Run(sigma, 1.0, c, 0, "test") for c in DECAYS}


def decay_arm(c: float) -> str:
    return f"decay c = {c:g}"


def summary(sigma: float, tuned: dict[str, object], test: dict[str, dict[int, float]]) -> dict[str, object]:
    """The σ's paired differences (b − a by seed); prints them beside each arm's mean."""
    chosen = decay_arm(tuned["decay"])
    pairs = {
        "tuned decay − tuned constant": (TUNED, chosen),
        "tuned decay − paper constant": (PAPER, chosen),
        "tuned constant − paper constant": (PAPER, TUNED),
        **{f"{decay_arm(c)} − tuned constant": (TUNED, decay_arm(c)) for c in DECAYS},
    }
    differences = {name: difference_text(test[a], test[b]) for name, (a, b) in pairs.items()}
    for arm, accuracies in test.items():
        interval = t_interval(list(accuracies.values()))
        mark = " (tuned decay)" if arm == chosen else ""
        print(f"    {arm}{mark}: {interval.mean:.3f} ± {interval.high - interval.mean:.3f}")
    for name, (text, _) in differences.items():
        print(f"    {name}: {text}")
    return {name: asdict(interval) for name, (_, interval) in differences.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4", help="test seeds (comma-separated)")
    parser.add_argument("--tune-seeds", default="1000,1001", help="tuning seeds, apart from the test seeds")
    parser.add_argument("--split-seed", type=int, default=0, help="the seed of the test and validation splits")
    parser.add_argument("--epochs", type=float, default=50.0, help="epochs k = qT (the paper's 50)")
    parser.add_argument("--batch", type=int, default=64, help="expected batch qN")
    parser.add_argument("--constant-lrs", default=",".join(f"{lr:g}" for lr in CONSTANT_LRS))
    parser.add_argument("--sigmas", default=",".join(f"{s:g}" for s in SIGMAS))
    parser.add_argument("--jobs", type=int, default=1, help="processes (one thread each)")
    parser.add_argument("--out", type=Path, default=Path("docs/figures/experiments"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    tune_seeds = [int(s) for s in args.tune_seeds.split(",")]
    if set(seeds) & set(tune_seeds):
        parser.error(f"--tune-seeds {tune_seeds} share a seed with --seeds {seeds}: tuning needs seeds of its own")
    constant_lrs = [float(v) for v in args.constant_lrs.split(",")]
    sigmas = [float(v) for v in args.sigmas.split(",")]
    started = time.perf_counter()
    tuning = run_all([run for sigma in sigmas for run in tuning_runs(sigma, tune_seeds, constant_lrs)], args)
    tuned = {}
    for sigma in sigmas:
        mine = [r for r in tuning if r["sigma"] == sigma]
        lr, lr_scores = best([r for r in mine if r["decay"] is None], "learning_rate")
        c, c_scores = best([r for r in mine if r["decay"] is not None], "decay")
        tuned[sigma] = {"learning_rate": lr, "decay": c, "constant_scores": lr_scores, "decay_scores": c_scores}
        print(
            f"σ = {sigma:g}: validation chose constant η = {lr:g} ("
            + ", ".join(f"{k:g}: {v:.3f}" for k, v in lr_scores.items())
            + f") and decay c = {c:g} ("
            + ", ".join(f"{k:g}: {v:.3f}" for k, v in c_scores.items())
            + ")",
            flush=True,
        )
    keys = [(sigma, arm, seed) for sigma in sigmas for arm in test_arms(sigma, tuned[sigma]) for seed in seeds]
    runs = [replace(test_arms(sigma, tuned[sigma])[arm], seed=seed) for sigma, arm, seed in keys]
    tested = run_all(runs, args)
    by_key = dict(zip(keys, tested, strict=True))
    results = []
    print("\nTest accuracy, mean ± 95% t half-width over seeds; paired differences [95% t-interval], † not resolved")
    for sigma in sigmas:
        test = {
            arm: {seed: by_key[sigma, arm, seed]["accuracy"] for seed in seeds}
            for arm in test_arms(sigma, tuned[sigma])
        }
        first = by_key[sigma, PAPER, seeds[0]]
        print(f"σ = {sigma:g} (ε = {first['epsilon']:.3f} at δ = {DELTA:g}, T = {first['steps']}):")
        differences = summary(sigma, tuned[sigma], test)
        results.append(
            {
                "sigma": sigma,
                "epsilon": first["epsilon"],
                "steps": first["steps"],
                "tuned": tuned[sigma],
                "test": test,
                "differences": differences,
            }
        )
    wall = time.perf_counter() - started
    title = (
        f"DP-SGD, digits CNN, {args.epochs:g} epochs, batch {args.batch}, C = 1; test seeds {args.seeds}; "
        "η (constant) and c (decay, η = 1) tuned per σ on validation rows"
    )
    print(f"\nwrote {draw(results, args.out, title)} ({len(tuning)} tuning and {len(tested)} test runs, {wall:.0f} s)")
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    record = {
        "settings": settings,
        "wall_s": round(wall),
        "results": results,
        "tuning_runs": tuning,
        "test_runs": tested,
    }
    (args.out / "lr_decay.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
