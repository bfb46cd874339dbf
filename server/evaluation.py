"""The server's own evaluation: a central test set when the server can read the data.

In a simulation the server builds the same partitions as the clients and evaluates the global
model on the union of their evaluation rows: their test splits, or under evaluate-on='validation'
their validation splits (cut from their training rows; no test row is read). In a deployment the
data lives only on the SuperNodes, so there is no central test set and the server evaluates
through the clients.
"""

from __future__ import annotations

from fedprivacy.data.partition import load_evaluation_union
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
    union = load_evaluation_union(**partition_kwargs(settings, num_clients))
    return Dataset(
        features=union.features,
        labels=union.labels,
        feature_names=union.feature_names,
        num_classes=union.num_classes,
        name=f"{union.name} (clients' {settings.evaluate_on} splits)",
    )
