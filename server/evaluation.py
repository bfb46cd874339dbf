"""The server's own evaluation: a central test set when the server can read the data.

In a simulation the server builds the same partitions as the clients and evaluates the global
model on the union of their evaluation rows: their test splits, or under evaluate-on='validation'
their validation splits (cut from their training rows; no test row is read). In a deployment the
data lives only on the SuperNodes, so there is no central test set and the server evaluates
through the clients.
"""

from __future__ import annotations

import numpy as np

from fedprivacy.data.partition import load_clients
from fedprivacy.data.types import Dataset
from fedprivacy.recipe import data_file_missing, partition_kwargs
from fedprivacy.runconfig import RunSettings


def central_evaluation(settings: RunSettings) -> str:
    """How a simulation's central evaluation is described in config.json."""
    return f"central (union of the clients' {settings.evaluate_on} splits)"


def server_test_set(settings: RunSettings, num_clients: int) -> Dataset | None:
    """The held-out set for central evaluation: the union of the clients' evaluation rows (built by
    `partition_kwargs`, as each client builds its own, so the two agree row for row).

    None when the server cannot build it (a deployment: the data lives on the clients); the
    server then evaluates through the clients.
    """
    if data_file_missing(settings):
        return None
    # A client too small to train fails on its own (the run goes on); it has no test rows to give.
    clients = load_clients(**partition_kwargs(settings, num_clients), drop_too_small=True)
    tests = [c.test for c in clients]
    return Dataset(
        features=np.concatenate([t.features for t in tests]),
        labels=np.concatenate([t.labels for t in tests]),
        feature_names=tests[0].feature_names,
        num_classes=tests[0].num_classes,
        name=f"{tests[0].name} (clients' {settings.evaluate_on} splits)",
    )
