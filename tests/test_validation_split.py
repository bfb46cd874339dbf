"""Tuning on validation rows cut from each client's training rows (evaluate-on='validation'), and a
data seed (split-seed) that keeps the test rows fixed across run seeds.

Rows are told apart by their features: the synthetic data set's are Gaussian floats, so no two
rows share them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from harness import PUMS

from clients.app import app as client_app
from fedprivacy import client_round
from fedprivacy.data.partition import load_client, load_clients, partition
from fedprivacy.data.splits import held_out_count
from fedprivacy.data.types import ClientData, Dataset
from fedprivacy.errors import InputError
from fedprivacy.identity import deployed_client
from fedprivacy.recipe import partition_kwargs, partitioning_of
from fedprivacy.runconfig import parse_node_config, parse_run_config
from server import app as server_module
from server.app import app as server_app
from server.evaluation import server_test_set
from sims.fast import engine as fast_engine
from sims.fast.engine import run_fast

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SYNTHETIC = {"dataset": "synthetic", "synthetic-examples": 400}


def rows_of(data: Dataset) -> set[bytes]:
    """Each row's identity: its features' bytes."""
    return {row.tobytes() for row in np.ascontiguousarray(data.features)}


def clients(config: dict[str, Any], num_clients: int | None = 3) -> list[ClientData]:
    """The clients every engine builds for `config` (through `partition_kwargs`)."""
    return load_clients(**partition_kwargs(parse_run_config(config), num_clients))


def digest(built: list[ClientData]) -> str:
    hasher = hashlib.sha256()
    for client in built:
        hasher.update(client.client_id.encode())
        for part in (client.train, client.test):
            hasher.update(np.ascontiguousarray(part.features).tobytes())
            hasher.update(np.ascontiguousarray(part.labels).tobytes())
    return hasher.hexdigest()[:16]


# Computed by running this file's `digest` of `load_clients(**partition_kwargs(...))` and of
# `server_test_set` on the tree before evaluate-on, validation-fraction and split-seed existed
# (commit cafcbd8 plus unrelated work in progress): a default run's clients and central set must not move.
BEFORE = [
    ({}, 3, "860849315fc2ef3c", "586d3b7f2ec95704"),
    ({**SYNTHETIC, "partitioning": "dirichlet", "seed": 7}, 4, "eef701424e6648f3", "be9911dc9d651117"),
    ({"partitioning": "size", "seed": 3, "test-fraction": 0.3}, 5, "5b8c4c842d3c88e6", "fe8112c075255cce"),
]


@pytest.mark.parametrize(("config", "num_clients", "clients_digest", "central_digest"), BEFORE)
def test_without_split_seed_the_clients_are_those_of_before(config, num_clients, clients_digest, central_digest):
    settings = parse_run_config(config)
    assert digest(clients(config, num_clients)) == clients_digest
    central = server_test_set(settings, num_clients)
    assert hashlib.sha256(central.features.tobytes() + central.labels.tobytes()).hexdigest()[:16] == central_digest
    pinned = partitioning_of(settings, num_clients)  # the ledger's pin: unchanged keys, the run's seed
    assert "validation_fraction" not in pinned and pinned["seed"] == settings.seed
    # split-seed equal to seed is the same data
    assert digest(clients({**config, "split-seed": settings.seed}, num_clients)) == clients_digest


def test_without_split_seed_the_pums_clients_are_those_of_before():
    if not PUMS.is_file():
        pytest.fail(f"missing test data {PUMS}: the PUMS files live in ../shared/data/pums beside the repo")
    config = {"dataset": "pums", "data-path": str(PUMS.resolve()), "partition-by": "puma"}
    assert digest(clients(config, None)) == "68ddc7b34d65a16f"


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_validation_rows_are_cut_from_the_training_rows_only(scheme):
    config = {**SYNTHETIC, "partitioning": scheme, "seed": 5}
    default = clients(config)
    tuned = clients({**config, "evaluate-on": "validation", "validation-fraction": 0.25})
    assert [c.client_id for c in tuned] == [c.client_id for c in default]
    for before, after in zip(default, tuned, strict=True):
        train, test = rows_of(before.train), rows_of(before.test)
        fit, validation = rows_of(after.train), rows_of(after.test)
        assert len(fit) == len(after.train) and len(validation) == len(after.test)  # no repeated row
        assert validation <= train and fit <= train
        assert not validation & fit and not validation & test and not fit & test
        assert fit | validation == train
        assert len(validation) == held_out_count(len(train), 0.25)
        assert after.num_examples == len(fit)  # its N is the fit rows'


def test_validation_rows_are_stratified():
    """Each class's share of the validation rows is its share of the training rows, to within one
    row, so a class of at least n / (validation rows) training rows is always there (what
    splits.split_indices guarantees)."""
    config = {**SYNTHETIC, "partitioning": "dirichlet", "dirichlet-alpha": 0.3, "seed": 2}
    for before, after in zip(clients(config), clients({**config, "evaluate-on": "validation"}), strict=True):
        n, m = len(before.train), len(after.test)
        training = np.bincount(before.train.labels, minlength=2)
        validation = np.bincount(after.test.labels, minlength=2)
        assert np.all(np.abs(validation - training * m / n) < 1)
        assert all(validation[label] >= 1 for label, count in enumerate(training) if count >= np.ceil(n / m))


def test_a_fixed_split_seed_gives_every_run_seed_the_same_test_and_validation_rows():
    fixed = {**SYNTHETIC, "partitioning": "dirichlet", "split-seed": 11}
    tests = [[rows_of(c.test) for c in clients({**fixed, "seed": seed})] for seed in (0, 1, 2)]
    assert tests[0] == tests[1] == tests[2]
    validated = {**fixed, "evaluate-on": "validation"}
    validations = [[rows_of(c.test) for c in clients({**validated, "seed": seed})] for seed in (0, 1, 2)]
    assert validations[0] == validations[1] == validations[2]
    for test, validation in zip(tests[0], validations[0], strict=True):
        assert not test & validation
    # the key does something: another split seed, other rows; without it, the seed moves them
    assert [rows_of(c.test) for c in clients({**fixed, "split-seed": 12})] != tests[0]
    assert [rows_of(c.test) for c in clients({**SYNTHETIC, "partitioning": "dirichlet", "seed": 1})] != tests[0]
    settings = parse_run_config({**fixed, "seed": 4})
    assert partitioning_of(settings, 3)["seed"] == 11  # the ledger pins the rows' seed, not the run's


def test_a_client_needs_two_training_rows_to_be_validated():
    groups = np.array(["a"] * 10 + ["b"] * 2)
    dataset = Dataset(
        features=np.arange(12, dtype=np.float32).reshape(-1, 1),
        labels=np.arange(12) % 2,
        feature_names=("x",),
        num_classes=2,
        name="rows",
        groups=groups,
        group_name="site",
    )
    assert len(partition(dataset, "natural")) == 2  # 2 rows: one to train, one to test
    with pytest.raises(InputError, match="client b=2: row.*1 training row.*validation-fraction=0.2"):
        partition(dataset, "natural", validation_fraction=0.2)
    kept = partition(dataset, "natural", drop_too_small=True, validation_fraction=0.2)
    assert [c.client_id for c in kept] == ["a"]
    with pytest.raises(InputError, match="validation-fraction=1"):
        partition(dataset, "natural", validation_fraction=1)


def test_load_client_and_load_clients_agree_under_validation():
    options = dict(scheme="dirichlet", num_partitions=4, seed=7, num_examples=400, validation_fraction=0.3)
    every = load_clients("synthetic", **options)
    for i, client in enumerate(every):
        one = load_client(i, "synthetic", **options)
        assert rows_of(one.train) == rows_of(client.train) and rows_of(one.test) == rows_of(client.test)


@pytest.mark.parametrize(
    ("config", "key", "message"),
    [
        ({"validation-fraction": 0.3}, "validation-fraction", "only evaluate-on='validation'.*evaluate-on is 'test'"),
        ({"evaluate-on": "validation", "validation-fraction": 0}, "validation-fraction", r"in \(0, 1\)"),
        ({"evaluate-on": "validation", "validation-fraction": 1.0}, "validation-fraction", r"in \(0, 1\)"),
        ({"evaluate-on": "validation", "validation-fraction": True}, "validation-fraction", r"in \(0, 1\)"),
        ({"evaluate-on": "train"}, "evaluate-on", "must be one of: test, validation"),
        ({"split-seed": -2}, "split-seed", ""),
    ],
)
def test_bad_validation_keys_are_refused_by_name(config, key, message):
    with pytest.raises(InputError, match=message) as info:
        parse_run_config(config)
    assert info.value.field == key


def test_validation_keys_are_taken_together():
    settings = parse_run_config({"evaluate-on": "validation", "validation-fraction": 0.3, "split-seed": 4, "seed": 9})
    assert (settings.evaluate_on, settings.validation_fraction, settings.data_seed) == ("validation", 0.3, 4)
    assert parse_run_config({"seed": 9}).data_seed == 9


@pytest.mark.parametrize(
    ("key", "value"), [("evaluate-on", "validation"), ("validation-fraction", 0.2), ("split-seed", 3)]
)
def test_a_node_config_cannot_ask_a_deployed_client_to_split(tmp_path, key, value):
    node = {"client-id": "a", "data-path": str(tmp_path / "a.csv"), "epsilon": 1, "delta": 1e-6, "public-size": 10}
    with pytest.raises(InputError, match=f"{key}=.*a deployed client trains on every row"):
        parse_node_config({**node, key: value})


def test_a_deployed_client_trains_on_every_row_whatever_the_run_config_says(tmp_path, caplog):
    path = tmp_path / "a.csv"
    table = pd.DataFrame({"f0": np.arange(40.0), "f1": np.arange(40.0) ** 2, "y": np.arange(40) % 2})
    table.to_csv(path, index=False)
    node = parse_node_config(
        {
            "client-id": "a",
            "data-path": str(path),
            "epsilon": 1.0,
            "delta": 1e-6,
            "public-size": 40,
            "dataset": "csv",
            "label-column": "y",
            "feature-columns": "f0,f1",
            "num-classes": 2,
            "ledger-path": str(tmp_path / "ledger.sqlite"),
        }
    )
    run = {"dataset": "csv", "label-column": "y"}
    pushy = {**run, "evaluate-on": "validation", "validation-fraction": 0.5, "split-seed": 3}
    with caplog.at_level(logging.WARNING):
        honest, asked = (deployed_client(parse_run_config(c), node).data for c in (run, pushy))
    assert len(asked.train) == 40 and len(asked.test) == 0
    assert np.array_equal(asked.train.features, honest.train.features)
    assert "evaluate-on=validation validation-fraction=0.5 split-seed=3 ignored" in caplog.text


class EvaluatedRows:
    """Spies on every evaluation an engine makes: the central set's rows, each client's own."""

    def __init__(self) -> None:
        self.central: list[set[bytes]] = []
        self.clients: list[set[bytes]] = []
        self.trained: list[set[bytes]] = []

    def central_spy(self, real):
        def spy(model, data):
            self.central.append(rows_of(data))
            return real(model, data)

        return spy

    def client_spy(self, real):
        def spy(model, data):
            self.clients.append(rows_of(data))
            return real(model, data)

        return spy

    def worker_spy(self, real):
        def spy(index, train_x, train_y, test_x, test_y, seed):
            self.clients.append({row.tobytes() for row in np.ascontiguousarray(test_x)})
            self.trained.append({row.tobytes() for row in np.ascontiguousarray(train_x)})
            return real(index, train_x, train_y, test_x, test_y, seed)

        return spy


def test_both_engines_evaluate_on_the_validation_rows_and_never_on_a_test_row(in_process, tmp_path, monkeypatch):
    tuned = {
        **in_process.defaults(),
        **SYNTHETIC,
        "num-server-rounds": 2,
        "noise-seed": 7,
        "seed": 3,
        "split-seed": 11,
        "evaluate-on": "validation",
        "validation-fraction": 0.25,
    }
    default = clients({**tuned, "evaluate-on": "test", "validation-fraction": 0.2}, 2)
    training = [rows_of(c.train) for c in default]
    tests = set().union(*(rows_of(c.test) for c in default))
    expected = sum(held_out_count(len(t), 0.25) for t in training)

    fast = EvaluatedRows()
    monkeypatch.setattr(fast_engine, "evaluate_model", fast.central_spy(fast_engine.evaluate_model))
    monkeypatch.setattr(fast_engine, "WorkerClient", fast.worker_spy(fast_engine.WorkerClient))
    folder, _ = run_fast({**tuned, "results-dir": str(tmp_path / "fast")}, 2, say=lambda _: None)
    monkeypatch.undo()

    apps = EvaluatedRows()
    monkeypatch.setattr(server_module, "evaluate_model", apps.central_spy(server_module.evaluate_model))
    monkeypatch.setattr(client_round, "evaluate_model", apps.client_spy(client_round.evaluate_model))
    config = {**tuned, "results-dir": str(tmp_path / "apps")}
    in_process.run_server(server_app, in_process.Grid.simulation(client_app, 2, config), config)
    monkeypatch.undo()
    (apps_folder,) = Path(config["results-dir"]).iterdir()

    central = fast.central[0]
    assert len(central) == expected and all(rows == central for rows in fast.central + apps.central)
    assert len(fast.central) == len(apps.central) == 3  # the initial model and each round's
    assert central <= set().union(*training) and not central & tests
    validations = fast.clients  # one per client, in client order
    assert [len(v) for v in validations] == [held_out_count(len(t), 0.25) for t in training]
    assert set().union(*validations) == central
    assert all(rows in validations for rows in apps.clients) and len(apps.clients) == 2 * 2
    for trained, validation, train in zip(fast.trained, validations, training, strict=True):
        assert trained == train - validation  # fits on the rest of its training rows

    recorded = json.loads((folder / "config.json").read_text())
    assert recorded["evaluation"] == "central (union of the clients' validation splits)"
    assert recorded["resolved"]["evaluate_on"] == "validation" and recorded["resolved"]["split_seed"] == 11
    fast_rounds, apps_rounds = pd.read_csv(folder / "rounds.csv"), pd.read_csv(apps_folder / "rounds.csv")
    for column in ("accuracy", "federated_accuracy"):
        np.testing.assert_allclose(fast_rounds[column], apps_rounds[column], rtol=1e-4, atol=1e-4)
