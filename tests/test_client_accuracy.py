"""Each simulated client's accuracy on its own test rows: in clients.csv, a figure and the sweep's
report, from the apps and the fast engine alike; checked against the final model evaluated here."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from fedprivacy.identity import simulation_client
from fedprivacy.models import build_model, evaluate_model
from fedprivacy.runconfig import parse_run_config
from sims.fast.engine import run_fast

CLIENTS = 4


def _check_against_the_final_model(folder: Path, config: dict) -> None:
    """clients.csv's accuracy, loss and test rows per client are the final model's on that client's
    own test rows, evaluated here from model.pt and the client's partition; clients.png is drawn."""
    settings = parse_run_config(config)
    table = pd.read_csv(folder / "clients.csv").set_index("client_id")
    assert len(table) == CLIENTS and (folder / "clients.png").read_bytes()[:4] == b"\x89PNG"
    state = torch.load(folder / "model.pt", weights_only=True)
    for index in range(CLIENTS):
        client = simulation_client(settings, index, CLIENTS, folder / "scratch.sqlite")
        model = build_model(settings.model, client.data.test.features.shape[1:], client.data.test.num_classes)
        model.load_state_dict(state)
        loss, accuracy = evaluate_model(model, client.data.test)
        row = table.loc[int(client.client_id)]
        assert row["test_examples"] == len(client.data.test) and row["evaluated_round"] == settings.num_server_rounds
        assert row["accuracy"] == pytest.approx(accuracy, abs=1e-9) and row["loss"] == pytest.approx(loss, rel=1e-5)
    assert table["accuracy"].nunique() > 1  # clients differ: the column is each one's own


def test_the_fast_engine_records_each_clients_accuracy_on_its_own_test_rows(in_process, tmp_path):
    config = {**in_process.defaults(), "partitioning": "dirichlet", "results-dir": str(tmp_path / "r")}
    folder, _ = run_fast(config, CLIENTS, say=lambda _: None)
    _check_against_the_final_model(folder, config)


def test_the_apps_record_each_clients_accuracy_on_its_own_test_rows(simulate, run_config):
    config = {**run_config, "partitioning": "dirichlet"}
    simulate(config, CLIENTS)
    (folder,) = Path(config["results-dir"]).iterdir()
    _check_against_the_final_model(folder, config)
