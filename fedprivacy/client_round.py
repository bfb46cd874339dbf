"""One client's round, without Flower: refuse a global model that is not finite, then the cohort
round (`fedprivacy.cohort`) with the client alone, trained by the DP trainer on its own model (no
update leaves unrecorded; the reply holds public values and the trained parameters only). And a
simulated client's local evaluation (a deployed client releases none)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedprivacy.admission import client_noise_seed
from fedprivacy.cohort import Member, TrainedRows, cohort_round
from fedprivacy.errors import ClientRefusal
from fedprivacy.identity import LocalClient
from fedprivacy.ledger import Ledger
from fedprivacy.models import evaluate_model
from fedprivacy.privacy.plan import Plan
from fedprivacy.protocol import diagnostics
from fedprivacy.recipe import new_model
from fedprivacy.runconfig import RunSettings
from fedprivacy.training.capture import trained_names
from fedprivacy.training.trainer import DPTrainer, check_finite

logger = logging.getLogger(__name__)


def device() -> torch.device:
    """GPU when one is visible (Ray hides GPUs unless client-resources-num-gpus > 0), else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def released_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a client sends of its trained model: the trained parameters, which went through
    clipping and noise, and nothing else (no buffer, no frozen parameter), in the trainer's order."""
    state = model.state_dict()
    return {name: state[name].detach().cpu() for name in trained_names(model)}


@dataclass(frozen=True)
class RoundResult:
    """A train round's outcome: the new weights (None if the client did not train), the reply's
    metrics, and the trainer's state to carry to the client's next round (opaque to callers)."""

    state_dict: dict[str, torch.Tensor] | None
    metrics: dict[str, int | float]
    trainer_state: dict[str, Any] | None


def train_round(
    client: LocalClient,
    settings: RunSettings,
    plan: Plan,
    ledger: Ledger,
    run_id: str,
    server_round: int,
    global_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any] | None = None,
) -> RoundResult:
    """Run round `server_round`'s slice of `plan` if the budget affords it, as a cohort of one
    (`fedprivacy.cohort`): a round already trained is refused, the spend recorded before the
    update is returned."""
    check_finite(global_state)  # before any record is touched
    dev = device()
    model = new_model(settings, client.data.train.features, client.data.train.num_classes).to(dev)
    load_global(model, global_state, settings)  # a model that does not fit is refused before any spend
    member = Member(client, plan, trainer_state)
    names: list[str] = []

    def train(ready: list[Member]) -> TrainedRows:
        trainer = DPTrainer(
            model,
            plan,
            client.data.train.features,
            client.data.train.labels,
            seed=client_noise_seed(settings, client.account),
            state={**(trainer_state or {}), "step": plan.first_step_of_round(server_round)},
        )
        report = trainer.run_round(server_round)
        if report.steps != plan.steps_in_round(server_round):
            raise RuntimeError(
                f"trainer ran {report.steps} steps, the plan's round has {plan.steps_in_round(server_round)}"
            )
        if report.nonfinite_examples:  # local only: it counts records
            logger.warning(
                "client %s, round %d: %d sampled examples had a non-finite gradient and contributed zero",
                client.client_id,
                server_round,
                report.nonfinite_examples,
            )
        notes = diagnostics(report.mean_loss, report.clip_fraction, report.nonfinite_examples)
        released = released_state(model)
        names.extend(released)
        weights = [value.unsqueeze(0) for value in released.values()]
        return TrainedRows(weights, [trainer.state_dict()], [notes], dev.type == "cuda")

    # diagnostics: simulations only (open_account refuses them in a deployment)
    outcome = cohort_round(
        [member], ledger, run_id, server_round, train, while_recording=False, diagnostics=settings.diagnostics
    )
    if client.account in outcome.refused:
        raise outcome.refused[client.account]
    metrics = outcome.replies[client.account]
    if not outcome.trained or outcome.result is None:
        return RoundResult(None, metrics, trainer_state)
    released = dict(zip(names, (weights[0] for weights in outcome.result.weights), strict=True))
    return RoundResult(released, metrics, member.trainer_state)


def load_global(model: nn.Module, global_state: dict[str, torch.Tensor], settings: RunSettings) -> None:
    """The server's model into this client's, refused in words the server may read where the two
    differ in their entries or shapes (the shapes are the model's, which a client's initial model
    already tells the server). The usual cause is a deployment's run config naming a data set the
    server reads itself (the default digits): the server then builds its model for that data."""
    own = model.state_dict()
    misfit = [name for name in own if name in global_state and global_state[name].shape != own[name].shape]
    if misfit or set(own) != set(global_state):
        detail = (
            f"{misfit[0]} is {list(global_state[misfit[0]].shape)} there, {list(own[misfit[0]].shape)} here"
            if misfit
            else f"entries {sorted(set(global_state) ^ set(own))[:3]} are in one model only"
        )
        raise ClientRefusal(
            f"the server's model does not fit this client's data ({detail}; model {settings.model!r}): a "
            f"server whose run config names a data set it can read itself (dataset={settings.dataset!r}) "
            "builds its model for that data; in a deployment, name the nodes' data set (e.g. dataset='csv') "
            "so that the server asks a node for the initial model"
        )
    model.load_state_dict(global_state)


def evaluate_local(
    client: LocalClient, settings: RunSettings, global_state: dict[str, torch.Tensor]
) -> dict[str, int | float]:
    """Local test loss and accuracy of the global model (simulations only).

    A deployed client releases no evaluation: exact loss and accuracy on its test rows, for any
    model the server chooses, as often as it asks, are raw functions of its records. It replies
    with zero weight instead, and the server reports that evaluation is off.
    """
    if client.deployed:
        return {"num-examples": 0, "evaluation-off": 1}
    check_finite(global_state)
    test = client.data.test
    model = new_model(settings, test.features, test.num_classes).to(device())
    load_global(model, global_state, settings)
    loss, accuracy = evaluate_model(model, test)
    return {"num-examples": len(test), "loss": loss, "accuracy": accuracy, "evaluation-off": 0}
