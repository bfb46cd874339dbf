"""Does a decaying step size beat a constant one under DP-SGD? The digits CNN analogue of Wu et
al.'s (ADP-SGD) appendix F.3: η_t = 1/sqrt(2 + c·t) for c ∈ {0, 1e-5, 1e-3, 1e-2, 0.1, 0.5} at noise
multipliers σ ∈ {1.6, 3.2, 6.4, 12.8}, central DP-SGD (one client, all the training rows).

Each σ is certified for its (q, T) by PLD (δ = 1e-5; printed). Seeds fix the 80/20 split, the
initial weights and the (experiment-only) noise. Prints a table (mean test accuracy over seeds),
writes JSON and a figure.

Usage: python experiments/lr_decay.py [--seeds 0,1,2] [--epochs 20] [--batch 64] [--out docs/figures]
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from pathlib import Path

import torch
from matplotlib.figure import Figure

from fedprivacy.data import central_split, load_dataset
from fedprivacy.models import build_model, evaluate_model
from fedprivacy.privacy.accountants import NoiseEvent, pld_epsilon
from fedprivacy.privacy.plan import Plan
from fedprivacy.training import DPTrainer

SIGMAS = (1.6, 3.2, 6.4, 12.8)
DECAYS = (0.0, 1e-5, 1e-3, 1e-2, 0.1, 0.5)
DELTA = 1e-5


def plan(n: int, sigma: float, q: float, steps: int, decay: float) -> Plan:
    """A one-round plan with a given σ, certified by PLD, and the step size 1/sqrt(2 + c·t)."""
    epsilon = pld_epsilon([NoiseEvent(sigma, q, steps)], DELTA)
    return Plan(
        client_id="central",
        rule="calibrated",
        n=n,
        epsilon=epsilon,
        delta=DELTA,
        clip_norm=1.0,
        sigma=sigma,
        sampling_rate=q,
        steps=steps,
        rounds=1,
        noise_segments=((sigma, steps),),
        epsilon_pld=epsilon,
        epsilon_rdp=epsilon,
        learning_rate=1.0,
        lr_schedule="inverse_sqrt",
        lr_params={"a": 2.0, "c": decay},
    )


def accuracy(seed: int, sigma: float, decay: float, epochs: float, batch: int) -> tuple[float, float]:
    data = central_split(load_dataset("digits", None, images=True), 0.2, seed)
    n = data.num_examples
    q = batch / n
    the_plan = plan(n, sigma, q, round(epochs / q), decay)
    torch.manual_seed(seed)
    model = build_model("cnn", 64, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        DPTrainer(model, the_plan, data.train.features, data.train.labels, seed=f"lr-decay:{seed}").run_steps(
            the_plan.steps
        )
    return evaluate_model(model, data.test)[1], the_plan.epsilon_pld


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=float, default=20.0)
    parser.add_argument("--batch", type=int, default=64, help="expected batch qN")
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for sigma in SIGMAS:
        for decay in DECAYS:
            runs = [accuracy(seed, sigma, decay, args.epochs, args.batch) for seed in seeds]
            accuracies = [a for a, _ in runs]
            rows.append(
                {
                    "sigma": sigma,
                    "c": decay,
                    "epsilon": runs[0][1],
                    "accuracies": accuracies,
                    "mean": statistics.mean(accuracies),
                    "sd": statistics.stdev(accuracies) if len(runs) > 1 else 0.0,
                }
            )
            print(
                f"σ = {sigma:>5}  c = {decay:<7g} ε = {runs[0][1]:7.3f}  "
                f"accuracy {rows[-1]['mean']:.4f} ± {rows[-1]['sd']:.4f}",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    figure = Figure(figsize=(6.5, 4.2))
    axes = figure.subplots()
    for sigma in SIGMAS:
        mine = [r for r in rows if r["sigma"] == sigma]
        positions = range(len(DECAYS))
        axes.errorbar(
            positions,
            [r["mean"] for r in mine],
            yerr=[r["sd"] for r in mine],
            marker="o",
            capsize=3,
            label=f"σ = {sigma:g} (ε = {mine[0]['epsilon']:.2f})",
        )
    axes.set_xticks(range(len(DECAYS)), [f"{c:g}" for c in DECAYS])
    axes.set(
        xlabel="decay c in η_t = 1/sqrt(2 + c·t)",
        ylabel="test accuracy",
        title=f"DP-SGD, digits CNN, {args.epochs:g} epochs, batch {args.batch}, seeds {args.seeds}",
    )
    axes.legend(fontsize=8)
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(args.out / "lr_decay.png", dpi=110)
    (args.out / "lr_decay.json").write_text(
        json.dumps({"epochs": args.epochs, "batch": args.batch, "seeds": seeds, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
