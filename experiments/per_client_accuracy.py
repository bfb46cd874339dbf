"""Each client's test accuracy under the final global model of every cell of a sweep: what a
heterogeneous federation gives each of its members, not only the pooled figure.

For every completed cell, the run's own config rebuilds the clients (same partitions and splits),
its model.pt is evaluated on each client's test rows, and the client's budget and ε spent come
from its clients.csv. Prints the mean over seeds per grid setting and client, writes CSV.

Usage: python experiments/per_client_accuracy.py SWEEP_DIR [--out FILE.csv]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import torch

from fedprivacy.data.partition import load_clients
from fedprivacy.models import evaluate_model
from fedprivacy.recipe import new_model, partition_kwargs
from fedprivacy.runconfig import DEFAULTS, parse_run_config


def cell_rows(cell: Path) -> list[dict[str, object]]:
    record = json.loads((cell / "cell.json").read_text())
    if record["status"] != "completed":
        return []
    run = cell / record["run_folder"]
    settings = parse_run_config({**DEFAULTS, **json.loads((run / "config.json").read_text())["run_config"]})
    clients = load_clients(**partition_kwargs(settings, record["num_clients"]))
    model = new_model(settings, clients[0].train.features, clients[0].train.num_classes)
    model.load_state_dict(torch.load(run / "model.pt"))
    spent = pd.read_csv(run / "clients.csv", dtype={"client_id": str}).set_index("client_id")
    rows = []
    for client in clients:
        _, accuracy = evaluate_model(model, client.test)
        rows.append(
            {
                **record["params"],
                "client": client.client_id,
                "epsilon_budget": spent.loc[client.client_id, "epsilon_budget"],
                "epsilon_spent": spent.loc[client.client_id, "epsilon_spent"],
                "test_rows": len(client.test),
                "accuracy": accuracy,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    table = pd.DataFrame([row for cell in sorted((args.sweep / "cells").iterdir()) for row in cell_rows(cell)])
    keys = [
        c
        for c in table.columns
        if c not in ("seed", "client", "epsilon_budget", "epsilon_spent", "test_rows", "accuracy")
    ]
    summary = (
        table.groupby([*keys, "client", "epsilon_budget"], sort=False)
        .agg(accuracy=("accuracy", "mean"), sd=("accuracy", "std"), epsilon_spent=("epsilon_spent", "mean"))
        .reset_index()
    )
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    if args.out:
        table.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
