"""The non-private baseline (FedAvg of plain local SGD), and a fast private twin for tuning.

`nonprivate_baseline` takes everything except the privacy mechanism from the private run it is
compared with:

- the same clients: `fedprivacy.data.load_clients` with the run config's partitioning;
- the same model and initial weights: `fedprivacy.models.build_model`, seeded as the ServerApp does;
- the same local schedule: each client's Poisson sampling rate q, total steps T and their split
  over rounds come from the plan its private twin makes (`plan_from_settings` with the run config's ε,
  rule, epochs and rounds, exactly as the ClientApp calls it); that plan's noise is never used;
- the same step sizes (the plan's schedule, η_t at each client's step t; AdaGrad-norm, which adapts
  to the released noisy gradients, falls back to its base η) and the same FedAvg weighting (by
  local training size N);
- the same test set: `server.evaluation.server_test_set` (the union of the clients' test splits);
- the same device: local training runs where a ClientApp would (`fedprivacy.participant.device`),
  since a seeded generator draws different noise on a GPU than on the CPU.

Each step takes the plain mean cross-entropy gradient of the Poisson-sampled batch, unclipped and
without noise (an empty batch is a step without an update). It is a separate function, not a
run-config rule, so no results folder of the private apps can ever hold a non-private run.

`private_proxy` runs the same loop with the library's DP trainer (`DPTrainer`, the plan's σ, q, C,
T and the ClientApp's per-client noise seeds) but without the Flower apps and their ledger, whose
per-round PLD accounting dominates a real run's time. It exists only to make a hyperparameter
search affordable; reported private results come from the real apps (`sims.runner`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from fedprivacy.data.partition import load_clients
from fedprivacy.data.types import ClientData
from fedprivacy.models import evaluate_model
from fedprivacy.participant import (
    client_noise_seed,
    dataset_identity,
    device,
    new_model,
    partition_kwargs,
    plan_from_settings,
    simulated_account,
)
from fedprivacy.privacy.plan import Plan
from fedprivacy.runconfig import DEFAULTS, RunSettings, parse_run_config
from fedprivacy.training.trainer import DPTrainer
from server.evaluation import server_test_set
from sims.runner import RunResult, natural_client_count

State = dict[str, torch.Tensor]
LocalTrain = Callable[[int, ClientData, Plan, nn.Module, int], None]  # (index, client, plan, model, round)


def _plans(settings: RunSettings, clients: list[ClientData]) -> list[Plan]:
    """Each client's plan, made as the ClientApp makes it."""
    return [
        plan_from_settings(
            settings,
            c.num_examples,
            settings.client_epsilon(i, len(clients)),
            settings.client_delta(i, len(clients)),
            c.client_id,
            compare=False,
        )
        for i, c in enumerate(clients)
    ]


def _fedavg(
    run_config: dict[str, Any],
    num_clients: int | None,
    name: str,
    private: bool,
    make_local: Callable[[RunSettings, list[ClientData], list[Plan]], LocalTrain],
) -> RunResult:
    """FedAvg over every client every round, weighted by N, evaluated on the server's test set."""
    config = {**DEFAULTS, **run_config}
    settings = parse_run_config(config)
    if settings.fraction_train != 1.0:
        raise ValueError(f"fraction-train={settings.fraction_train}: this loop trains every client every round (1.0)")
    num_clients = num_clients or natural_client_count(config)
    clients = load_clients(**partition_kwargs(settings, num_clients))
    test = server_test_set(settings, num_clients)
    if test is None:
        raise ValueError("needs the server's test set: a simulation data set the server can read")
    plans = _plans(settings, clients)
    local_train = make_local(settings, clients, plans)

    torch.manual_seed(settings.seed)  # the ServerApp's initial model
    model = new_model(settings, test.features, test.num_classes)
    local_device = device()
    global_state: State = {k: v.detach().clone() for k, v in model.state_dict().items()}
    started = time.perf_counter()
    rounds: list[dict[str, Any]] = []
    for server_round in range(1, settings.num_server_rounds + 1):
        states, weights = [], []
        for index, (client, plan) in enumerate(zip(clients, plans, strict=True)):
            if plan.steps_in_round(server_round) == 0:  # a private client would be out of budget
                continue
            local = new_model(settings, client.train.features, client.train.num_classes).to(local_device)
            local.load_state_dict(global_state)
            local_train(index, client, plan, local, server_round)
            states.append({k: v.detach().cpu().clone() for k, v in local.state_dict().items()})
            weights.append(float(client.num_examples))
        if states:
            total = sum(weights)
            global_state = {
                k: sum(w * s[k] for w, s in zip(weights, states, strict=True)) / total for k in global_state
            }
        model.load_state_dict(global_state)
        loss, accuracy = evaluate_model(model, test)
        rounds.append(
            {
                "round": server_round,
                "accuracy": accuracy,
                "loss": loss,
                "clients_trained": len(states),
                "elapsed_s": round(time.perf_counter() - started, 3),
            }
        )
    wall = time.perf_counter() - started
    summary = {
        "rounds": len(rounds),
        "final_accuracy": rounds[-1]["accuracy"],
        "clients": num_clients,
        "steps": {p.client_id: p.steps for p in plans},
        "sampling_rate": {p.client_id: p.sampling_rate for p in plans},
        "learning_rate": settings.learning_rate,
        "wall_time_s": round(wall, 3),
    }
    clients_rows = (
        [
            {
                "client_id": p.client_id,
                "epsilon_budget": p.epsilon,
                "epsilon_spent": p.epsilon_pld,
                "sigma": p.sigma,
                "steps_this_run": p.steps,
                "steps_all_runs": p.steps,
            }
            for p in plans
        ]
        if private
        else []
    )
    if private:
        summary["all_within_budget"] = all(p.epsilon_pld <= p.epsilon for p in plans)
    return RunResult(
        name=name,
        folder=None,
        summary=summary,
        rounds=rounds,
        clients=clients_rows,
        wall_s=wall,
        private=private,
    )


def _plain_sgd(settings: RunSettings, clients: list[ClientData], plans: list[Plan]) -> LocalTrain:
    local_device = device()  # where `_fedavg` puts the local models: the data moves there once
    tensors = [
        (
            torch.as_tensor(c.train.features, dtype=torch.float32).to(local_device),
            torch.as_tensor(c.train.labels, dtype=torch.long).to(local_device),
        )
        for c in clients
    ]
    seeds = np.random.SeedSequence([settings.seed, 0x5EED]).spawn(len(clients))
    generators = [torch.Generator().manual_seed(int(s.generate_state(1)[0])) for s in seeds]

    def train(index: int, client: ClientData, plan: Plan, model: nn.Module, server_round: int) -> None:
        x, y = tensors[index]
        optimizer = torch.optim.SGD(model.parameters(), lr=settings.learning_rate)
        model.train()
        first = plan.first_step_of_round(server_round)
        for step in range(first, first + plan.steps_in_round(server_round)):
            batch = torch.nonzero(torch.rand(plan.n, generator=generators[index]) < plan.sampling_rate).flatten()
            if batch.numel() == 0:
                continue
            optimizer.param_groups[0]["lr"] = plan.learning_rate_at(step)
            optimizer.zero_grad()
            batch = batch.to(x.device)
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()

    return train


def nonprivate_baseline(
    run_config: dict[str, Any], num_clients: int | None = None, *, name: str = "non-private"
) -> RunResult:
    """FedAvg of plain local SGD under `run_config`'s partitions, model, schedule and test set."""
    return _fedavg(run_config, num_clients, name, False, _plain_sgd)


def _dp_sgd(settings: RunSettings, clients: list[ClientData], plans: list[Plan]) -> LocalTrain:
    states: dict[int, dict[str, Any]] = {}
    dataset_id = dataset_identity(settings)

    def account(client_id: str) -> str:  # the ClientApp's, so the noise seeds match
        return simulated_account(dataset_id, client_id)

    def train(index: int, client: ClientData, plan: Plan, model: nn.Module, server_round: int) -> None:
        trainer = DPTrainer(
            model,
            plan,
            client.train.features,
            client.train.labels,
            seed=client_noise_seed(settings, account(client.client_id)),
            state={**states.get(index, {}), "step": plan.first_step_of_round(server_round)},
        )
        trainer.run_round(server_round)
        states[index] = trainer.state_dict()

    return train


def private_proxy(
    run_config: dict[str, Any], num_clients: int | None = None, *, name: str = "private proxy"
) -> RunResult:
    """The private run's training without Flower and the ledger: for hyperparameter search only."""
    return _fedavg(run_config, num_clients, name, True, _dp_sgd)
