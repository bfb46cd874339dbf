"""One client's side of a federated DP-SGD run, without Flower.

The ClientApp (clients/app.py) is glue around these functions. Per train message a client:
1. knows its data and budget (`simulation_client`: a partition and the run config;
   `deployed_client`: its own file and node config);
2. gets the run's plan: the one it made on its first round (kept in the ledger, so a restarted
   client resumes the same plan), or a new a-priori plan from its own N, ε, δ;
3. asks the ledger whether this round's slice of the plan is affordable: PLD of everything it has
   ever released plus these steps ≤ ε. If not, it does not train;
4. runs the slice with the DP trainer, then records the steps in the ledger before returning
   anything, so no update ever leaves unrecorded.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedprivacy.data.loaders import load_dataset
from fedprivacy.data.partition import load_client, load_clients
from fedprivacy.data.splits import split_client
from fedprivacy.data.types import ClientData, Dataset
from fedprivacy.errors import InputError
from fedprivacy.ledger import BudgetExceeded, Ledger, round_events
from fedprivacy.models import build_model
from fedprivacy.privacy.plan import Plan
from fedprivacy.privacy.planner import plan_client
from fedprivacy.runconfig import NodeSettings, RunSettings, default_ledger_path
from fedprivacy.training.trainer import DPTrainer


@dataclass(frozen=True)
class LocalClient:
    """Who a client is, what it holds and what it may spend."""

    client_id: str
    account: str  # the ledger key: one per data set (a deployed file's content, or a simulated partition)
    data: ClientData
    epsilon: float
    delta: float
    ledger_path: Path


def _data_options(settings: RunSettings) -> dict[str, Any]:
    return {"label": settings.label_column} if settings.dataset == "csv" else {}


def _scheme(settings: RunSettings) -> tuple[str, str | None]:
    """(partition scheme, client column): `auto` is natural when partition-by names a column."""
    by = settings.partition_by or None
    if settings.partitioning == "auto":
        return ("natural" if by else "iid"), by
    return settings.partitioning, by


def partition_kwargs(settings: RunSettings, num_clients: int) -> dict[str, Any]:
    scheme, by = _scheme(settings)
    return dict(
        name=settings.dataset,
        path=settings.data_path,
        scheme=scheme,
        num_partitions=num_clients,
        seed=settings.seed,
        by=by,
        alpha=settings.dirichlet_alpha,
        skew=settings.size_skew,
        test_fraction=settings.test_fraction,
        **_data_options(settings),
    )


def _data_file_missing(settings: RunSettings) -> bool:
    """A file-based data set whose run-config data-path is not a file on this machine."""
    return settings.dataset in ("pums", "csv") and (settings.data_path is None or not settings.data_path.is_file())


def simulation_client(settings: RunSettings, partition_id: int, num_partitions: int, ledger_path: Path) -> LocalClient:
    """A simulated client: partition `partition_id` of the run's data set, budget from the run config."""
    if _data_file_missing(settings):
        raise InputError("data-path", "" if settings.data_path is None else str(settings.data_path),
                         f"dataset {settings.dataset!r} needs a CSV file: in a simulation every client reads "
                         "the run config's data-path (an absolute path on this machine)")
    data = load_client(partition_id, **partition_kwargs(settings, num_partitions))
    return LocalClient(
        client_id=data.client_id,
        account=f"{settings.dataset}/{data.client_id}",
        data=data,
        epsilon=settings.budget(partition_id, num_partitions),
        delta=settings.client_delta(partition_id, num_partitions),
        ledger_path=ledger_path,
    )


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def deployed_client(settings: RunSettings, node: NodeSettings) -> LocalClient:
    """A deployed client: its whole file, split into train/test; its ledger account is keyed by
    the file's content alone, so every run on the same data draws on the same budget, whatever
    `client-id` the SuperNode is started with."""
    if settings.dataset not in ("pums", "csv"):
        raise InputError("dataset", settings.dataset, "a deployment reads each client's own file: use 'pums' or 'csv'")
    if not node.data_path.is_file():
        raise InputError("data-path", str(node.data_path), "no such file on this SuperNode")
    options = _data_options(settings)
    if settings.dataset == "pums":
        options["client_column"] = None
    dataset = load_dataset(settings.dataset, node.data_path, **options)
    digest = _file_digest(node.data_path)
    rng = np.random.default_rng([settings.seed, int(digest, 16) % (2**32)])  # same split every run
    data = split_client(node.client_id, dataset, settings.test_fraction, rng)
    return LocalClient(
        client_id=node.client_id,
        account=f"data:{digest}",
        data=data,
        epsilon=node.epsilon,
        delta=settings.delta if node.delta is None else node.delta,
        ledger_path=node.ledger_path or default_ledger_path(),
    )


def server_test_set(settings: RunSettings, num_clients: int) -> Dataset | None:
    """The held-out test set for central evaluation: the union of the clients' test splits.

    None when the server cannot build it (a deployment: the data lives on the clients); the
    server then evaluates through the clients.
    """
    if _data_file_missing(settings):
        return None
    # A client too small to train fails on its own (the run goes on); it has no test rows to give.
    clients = load_clients(**partition_kwargs(settings, num_clients), drop_too_small=True)
    tests = [c.test for c in clients]
    return Dataset(
        features=np.concatenate([t.features for t in tests]),
        labels=np.concatenate([t.labels for t in tests]),
        feature_names=tests[0].feature_names,
        num_classes=tests[0].num_classes,
        name=f"{tests[0].name} (clients' test splits)",
    )


def device() -> torch.device:
    """GPU when one is visible (Ray hides GPUs unless client-resources-num-gpus > 0), else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def new_model(settings: RunSettings, features: np.ndarray, num_classes: int) -> nn.Module:
    return build_model(settings.model, int(np.prod(features.shape[1:])), num_classes)


def plan_from_settings(settings: RunSettings, num_examples: int, epsilon: float, delta: float, client_id: str) -> Plan:
    """The plan a client makes from the run config: one place, so the ClientApp and the baselines agree."""
    return plan_client(
        num_examples,
        epsilon,
        delta,
        rule=settings.rule,
        clip_norm=settings.clip_norm,
        epochs=settings.epochs,
        rounds=settings.num_server_rounds,
        client_id=client_id,
        learning_rate=settings.learning_rate,
    )


def run_plan(client: LocalClient, settings: RunSettings, ledger: Ledger, run_id: str) -> tuple[Plan, bool]:
    """(the client's plan for this run, whether it was made now). Made once, a priori, then kept."""
    plan = ledger.load_plan(client.account, run_id)
    if plan is not None:
        return plan, False
    plan = plan_from_settings(settings, client.data.num_examples, client.epsilon, client.delta, client.client_id)
    if plan.expected_batch_size < 1:
        raise InputError(
            "num-examples",
            client.data.num_examples,
            f"too little data for client {client.client_id}: its plan samples q·N = "
            f"{plan.expected_batch_size:.2f} < 1 record per step, so most steps would train on nothing",
        )
    ledger.save_plan(client.account, run_id, plan)
    # Re-read: if a restarted twin saved its plan first, both must follow that one.
    return ledger.load_plan(client.account, run_id) or plan, True


def client_noise_seed(settings: RunSettings, account: str) -> int | None:
    """Per-client seed (clients must never share noise); None = fresh OS entropy every step."""
    if settings.noise_seed < 0:
        return None
    return int.from_bytes(hashlib.blake2b(f"{settings.noise_seed}:{account}".encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class RoundResult:
    """A train round's outcome: the new weights (None if the client did not train) and metrics."""

    state_dict: dict[str, torch.Tensor] | None
    metrics: dict[str, int | float]
    b_squared: float | None


def train_round(
    client: LocalClient,
    settings: RunSettings,
    plan: Plan,
    ledger: Ledger,
    run_id: str,
    server_round: int,
    global_state: dict[str, torch.Tensor],
    b_squared: float | None = None,
) -> RoundResult:
    """Run round `server_round`'s slice of `plan` if the budget affords it; record it first."""
    events = round_events(plan, server_round)
    affordable = bool(events) and ledger.epsilon_if(client.account, events, client.delta) <= client.epsilon
    base = {
        "epsilon-budget": float(client.epsilon),
        "delta": float(client.delta),
        "sigma": float(plan.sigma),
        "steps-planned": int(plan.steps),
    }
    if not affordable:
        return RoundResult(None, _exhausted(client, ledger, base), b_squared)

    dev = device()
    model = new_model(settings, client.data.train.features, client.data.train.num_classes).to(dev)
    model.load_state_dict(global_state)
    trainer = DPTrainer(
        model,
        plan,
        client.data.train.features,
        client.data.train.labels,
        seed=client_noise_seed(settings, client.account),
        state={"step": plan.first_step_of_round(server_round), "b_squared": b_squared},
    )
    report = trainer.run_round(server_round)
    if report.steps != sum(e.count for e in events):
        raise RuntimeError(f"trainer ran {report.steps} steps, the plan's round has {sum(e.count for e in events)}")
    try:
        spent = ledger.record(client.account, run_id, server_round, events, delta=client.delta, budget=client.epsilon)
    except BudgetExceeded:  # another writer spent the budget meanwhile: this update must not leave
        return RoundResult(None, _exhausted(client, ledger, base), b_squared)
    metrics = {
        **base,
        "num-examples": int(client.data.num_examples),
        "epsilon-spent": float(spent),
        "steps-done": int(ledger.steps_spent(client.account)),
        "sigma": float(report.sigma_mean),
        "clip-fraction": _finite(report.clip_fraction),
        "train-loss": _finite(report.mean_loss),
        "budget-exhausted": 0,
        "on-gpu": int(dev.type == "cuda"),
    }
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return RoundResult(state, metrics, trainer.state_dict()["b_squared"])


def _exhausted(client: LocalClient, ledger: Ledger, base: dict[str, int | float]) -> dict[str, int | float]:
    """The zero-weight reply of a client that cannot afford its next round (same keys as a trained one)."""
    return {
        **base,
        "num-examples": 0,
        "epsilon-spent": float(ledger.epsilon_spent(client.account, client.delta)),
        "steps-done": int(ledger.steps_spent(client.account)),
        "clip-fraction": 0.0,
        "train-loss": 0.0,
        "budget-exhausted": 1,
    }


def _finite(value: float) -> float:
    return float(value) if math.isfinite(value) else 0.0


def evaluate_model(model: nn.Module, dataset: Dataset) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of `model` on `dataset`."""
    dev = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        features = torch.as_tensor(dataset.features, dtype=torch.float32, device=dev)
        labels = torch.as_tensor(dataset.labels, dtype=torch.long, device=dev)
        logits = model(features)
        loss = nn.functional.cross_entropy(logits, labels).item()
        accuracy = (logits.argmax(dim=1) == labels).float().mean().item()
    return float(loss), float(accuracy)


def evaluate_local(client: LocalClient, settings: RunSettings, global_state: dict[str, torch.Tensor]) -> dict[str, int | float]:
    """Local test loss and accuracy of the global model (the test split is never trained on)."""
    test = client.data.test
    model = new_model(settings, test.features, test.num_classes).to(device())
    model.load_state_dict(global_state)
    loss, accuracy = evaluate_model(model, test)
    return {"num-examples": len(test), "loss": loss, "accuracy": accuracy}
