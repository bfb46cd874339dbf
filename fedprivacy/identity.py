"""Who a client is and what it holds: a simulated partition of the run's data set, or a deployed
node's own file read as its node config says, with its budget and its ledger account's name."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedprivacy.data.loaders import load_dataset
from fedprivacy.data.partition import load_client
from fedprivacy.data.types import ClientData
from fedprivacy.errors import InputError
from fedprivacy.recipe import (
    asked_for,
    dataset_identity,
    file_digest,
    partition_kwargs,
    partitioning_of,
    require_data_file,
    run_value,
)
from fedprivacy.runconfig import NodeSettings, RunSettings, default_ledger_path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalClient:
    """Who a client is, what it holds and what it may spend."""

    client_id: str
    account: str  # the ledger key: a deployed node's declared client-id, or a simulated data set's partition
    data: ClientData
    epsilon: float
    delta: float
    epochs: float | None  # its epochs k (a simulated client's entry of client-epochs); None: the planner's
    ledger_path: Path
    deployed: bool = False
    dataset_id: str = ""  # simulations: the data set's identity, whose partitioning the ledger pins
    partitioning: dict[str, Any] | None = None
    data_digest: str = ""  # deployments: the data file's digest, pinned beside the account in the ledger
    public_size: int | None = None  # deployments: the size the node declares public (node config)

    @property
    def planning_size(self) -> int:
        """The N a plan is made from and a reply carries: a deployed node's declared public size
        (never its real N, which would tell neighbours apart), a simulated partition's size."""
        return self.public_size if self.public_size is not None else self.data.num_examples


def simulated_account(dataset_id: str, client_id: str) -> str:
    """A simulated client's ledger account: its data set's identity and its partition."""
    return f"{dataset_id}/{client_id}"


def simulation_client(settings: RunSettings, partition_id: int, num_partitions: int, ledger_path: Path) -> LocalClient:
    """A simulated client: partition `partition_id` of the run's data set, budget from the run config.

    Its account is the data set's identity plus its partition; the ledger pins the partitioning
    per data set (see `open_account`), so an account always names the same rows.
    """
    require_data_file(settings)
    data = load_client(partition_id, **partition_kwargs(settings, num_partitions))
    dataset_id = dataset_identity(settings)
    return LocalClient(
        client_id=data.client_id,
        account=simulated_account(dataset_id, data.client_id),
        data=data,
        epsilon=settings.client_epsilon(partition_id, num_partitions),
        delta=settings.client_delta(partition_id, num_partitions),
        epochs=settings.client_epochs_for(partition_id, num_partitions),
        ledger_path=ledger_path,
        dataset_id=dataset_id,
        partitioning=partitioning_of(settings, num_partitions),
    )


def deployed_client(settings: RunSettings, node: NodeSettings) -> LocalClient:
    """A deployed client: every row of its own file, read as its node config says; budget from
    the node config.

    The run config is untrusted: its ε and δ are ignored (with a warning when they differ), and so
    is everything about how records are read (data set kind, label and feature columns, classes:
    the node config's). The client trains on all of its rows: it never evaluates, so it holds
    none out, and two files that differ in one record give training sets that differ in that
    record only. Its ledger account is its declared `client-id`; the ledger records the file's
    digest beside it and refuses a changed file under the same account (`open_accounts`).
    """
    if not node.data_path.is_file():
        raise InputError("data-path", str(node.data_path), "no such file on this SuperNode")
    for key, asked, node_value in (
        ("epsilon", settings.epsilon, node.epsilon),
        ("delta", settings.delta, node.delta),
        ("dataset", settings.dataset, node.dataset),
        ("pums-age", settings.pums_age, node.pums_age),
    ):
        if asked != node_value:
            shown = [f"{v:g}" if isinstance(v, float) else v for v in (asked, node_value)]
            logger.warning(
                "run config %s=%s ignored: a deployed client's %s is its node config's (%s)",
                key,
                shown[0],
                key,
                shown[1],
            )
    _warn_about_ignored_keys(settings)
    if node.dataset == "pums":
        options: dict[str, Any] = {"client_column": None, "age": node.pums_age, "per_row": True}
    else:
        options = {
            "label": node.label_column,
            "features": list(node.feature_columns or ()),
            "num_classes": node.num_classes,
            "per_row": True,
        }
    dataset = load_dataset(node.dataset, node.data_path, **options)  # a bad row is dropped alone, never a failure
    rows = ClientData(
        client_id=node.client_id,
        train=dataset.subset(np.arange(len(dataset))),
        test=dataset.subset(np.arange(0)),
    )
    _warn_locally_about_the_real_size(node, len(dataset))
    return LocalClient(
        client_id=node.client_id,
        account=deployed_account(node.client_id),
        data=rows,
        epsilon=node.epsilon,
        delta=node.delta,
        epochs=settings.epochs,
        ledger_path=node.ledger_path or default_ledger_path(),
        deployed=True,
        data_digest=file_digest(node.data_path),
        public_size=node.public_size,
    )


_IGNORED_WHEN_DEPLOYED = {
    "a deployed client trains on every row of its file": ("evaluate-on", "validation-fraction", "split-seed"),
    "a deployed client reads its file as its node config says": ("label-column", "feature-columns", "num-classes"),
}


def _warn_about_ignored_keys(settings: RunSettings) -> None:
    """A run config's split and column keys are for simulated clients: a deployed one trains on
    every row of its file, read as its node config says, whatever they say (the run config is
    untrusted; rows held out or columns read at its word would let the server decide which
    records are trained on, or turn one record into a failure), so they are only logged as ignored."""
    for reason, keys in _IGNORED_WHEN_DEPLOYED.items():
        asked = {key: run_value(settings, key) for key in keys if asked_for(settings, key)}
        if asked:
            shown = " ".join(f"{key}={value}" for key, value in asked.items())
            logger.warning("run config %s ignored: %s", shown, reason)


def _warn_locally_about_the_real_size(node: NodeSettings, rows: int) -> None:
    """Advice for the operator, in the SuperNode's log only: nothing about the real row count may
    reach the server (a refusal would tell neighbours apart by N), so none of this refuses."""
    if node.delta * rows >= 1.0:
        logger.warning(
            "client %s: delta=%g is not below 1/N for the %d rows of its file: a delta that large allows "
            "releasing a record outright; choose a smaller delta",
            node.client_id,
            node.delta,
            rows,
        )
    if not 0.5 <= rows / node.public_size <= 2.0:
        logger.warning(
            "client %s: its file holds %d rows, its public-size is %d: its updates are scaled by "
            "q·public-size, so a size far from the real one slows or destabilises training",
            node.client_id,
            rows,
            node.public_size,
        )


def deployed_account(client_id: str) -> str:
    """A deployed client's ledger account: the name its operator declares in the node config."""
    return f"node:{client_id}"
