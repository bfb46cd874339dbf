"""The local-only arm of the heterogeneous-budget experiment: each client trains alone, on its own rows.

For every seed of a rotated-budget sweep (experiment 5 of docs/experiments.md) and every (client,
own ε) pair its rotations hold, the client plans exactly as it does in the federation
(`fedprivacy.plans.plan_from_settings`: the same N, ε, δ, k, C, η and rule, so the same σ, q
and T), starts from the same initial model (the seed's), draws the same seeded noise, runs all T
DP-SGD steps with `fedprivacy.training.DPTrainer` and no averaging, and is scored on its own test
rows. The rows are the federation's (`simulation_client`: the same partitions and split). A
client's local-only model depends on its own ε only, not on who else holds what, so each (seed,
client, ε) runs once, whichever rotations give the client that ε.

Writes one row per (seed, client, ε): seed, client, epsilon_budget, epsilon_spent (the plan's
certified PLD ε), steps, test_rows, accuracy. `experiments/heterogeneous_rotated.py --local-only`
sets it beside the federated accuracies.

Usage: python experiments/local_only.py SWEEP_DIR [--out SWEEP_DIR/local_only.csv]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path

import pandas as pd
import torch

from fedprivacy.admission import client_noise_seed
from fedprivacy.identity import simulation_client
from fedprivacy.models import evaluate_model
from fedprivacy.plans import plan_from_settings
from fedprivacy.recipe import new_model
from fedprivacy.runconfig import DEFAULTS, RunSettings, parse_run_config
from fedprivacy.training import DPTrainer

LOCAL_ONLY = "local_only.csv"


def _settings(cell: Path) -> tuple[RunSettings, int]:
    """A completed cell's run settings and number of clients, as it ran."""
    record = json.loads((cell / "cell.json").read_text())
    config = json.loads((cell / record["run_folder"] / "config.json").read_text())["run_config"]
    return parse_run_config({**DEFAULTS, **config}), record["num_clients"]


def train_alone(settings: RunSettings, index: int, num_clients: int, epsilon: float) -> dict[str, object]:
    """Client `index` of the run, at its own budget `epsilon`, trained on its own rows only."""
    client = simulation_client(settings, index, num_clients, Path(os.devnull))  # no ledger: nothing is released
    train, test = client.data.train, client.data.test
    plan = plan_from_settings(
        settings, client.planning_size, epsilon, client.delta, client.client_id, epochs=client.epochs, compare=False
    )
    torch.manual_seed(settings.seed)  # the federation's initial model (sims/fast/engine.py, server/app.py)
    model = new_model(settings, train.features, train.num_classes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # seeded noise is for experiments only: said once by the sweep
        trainer = DPTrainer(model, plan, train.features, train.labels, seed=client_noise_seed(settings, client.account))
        trainer.run_steps(plan.steps)
    return {
        "seed": settings.seed,
        "client": client.client_id,
        "epsilon_budget": epsilon,
        "epsilon_spent": plan.epsilon_pld,
        "steps": plan.steps,
        "test_rows": len(test),
        "accuracy": evaluate_model(model, test)[1],
    }


def local_only(sweep: Path) -> pd.DataFrame:
    """Every (seed, client, own ε) of the sweep's completed cells, trained alone once."""
    table = pd.read_csv(sweep / "sweep.csv")
    done: dict[tuple[int, int, float], dict[str, object]] = {}
    for cell_folder in table.loc[table["status"] == "completed", "cell"]:
        settings, num_clients = _settings(sweep / cell_folder)
        for index in range(num_clients):
            epsilon = settings.client_epsilon(index, num_clients)
            if (settings.seed, index, epsilon) not in done:
                started = time.perf_counter()
                row = done[settings.seed, index, epsilon] = train_alone(settings, index, num_clients, epsilon)
                print(
                    f"seed {row['seed']} client {row['client']} ε = {row['epsilon_budget']:g} (T = {row['steps']}): "
                    f"{row['accuracy']:.4f} in {time.perf_counter() - started:.1f} s",
                    flush=True,
                )
    return pd.DataFrame(done.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, help="a rotated-budget sweep folder (e.g. runs/het-rotated)")
    parser.add_argument("--out", type=Path, help=f"the CSV (default: SWEEP/{LOCAL_ONLY})")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = local_only(args.sweep)
    out = args.out or args.sweep / LOCAL_ONLY
    rows.to_csv(out, index=False)
    print(f"wrote {out}: {len(rows)} local-only runs in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
