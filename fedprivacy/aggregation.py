"""How the server turns the clients' updates into the next global model, one function for the
ServerApp's strategy and the fast engine (`aggregate`): each update weighed by its client's
examples (FedAvg) or by the inverse of the noise variance it carries, averaged, checked finite,
stepped by the server's optimiser if the run has one, and merged into the current model. With
client-level DP (`aggregate_client_level`) the average is instead the federation's noisy mean of
the clipped updates (`fedprivacy.client_level`), stepped and merged the same way.

Clients with different budgets release updates with very different noise. The variance of the
noise in a client's round update follows from its plan alone (σ_t, C, q, N and η_t of the round's
steps), so weighing by its inverse leaks nothing beyond the plan, which the client sends anyway.
Weights are computed from public values only; aggregation is post-processing and costs no privacy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from fedprivacy.catalog import AGGREGATIONS
from fedprivacy.errors import InputError
from fedprivacy.privacy.plan import Plan

if TYPE_CHECKING:  # `fedprivacy --help` loads no torch
    from torch import Tensor

    from fedprivacy.client_level import ClientLevel


def update_noise_variance(plan: Plan, server_round: int) -> float:
    """Per-coordinate variance of the Gaussian noise in the client's update for the round:
    Σ_t (η_t·σ_t·C/(qN))² over the round's steps (each step adds independent noise to the weights;
    for AdaGrad-norm, whose η_t adapts to the released gradients, the plan's base η stands in)."""
    first = plan.first_step_of_round(server_round)
    expected = plan.sampling_rate * plan.n
    return sum(
        (plan.learning_rate_at(t) * plan.noise_multiplier(t) * plan.clip_norm / expected) ** 2
        for t in range(first, first + plan.steps_in_round(server_round))
    )


def aggregation_weight(scheme: str, plan: Plan, server_round: int, num_examples: int) -> float:
    """A trained client's weight in the average: N for `examples`, 1/variance for `inverse-noise`."""
    if scheme == "examples":
        return float(num_examples)
    if scheme == "inverse-noise":  # every certified plan adds noise: the variance is > 0
        return 1.0 / update_noise_variance(plan, server_round)
    raise InputError("aggregation", scheme, f"must be one of: {', '.join(AGGREGATIONS)}")


T = TypeVar("T")


def with_released(current: Mapping[str, T], average: Mapping[str, T]) -> dict[str, T]:
    """The new global model: the average of what the clients released (their trained parameters,
    `fedprivacy.training.capture.trained_names`) over the current model, whose other entries (buffers,
    frozen parameters) stay the server's: no client ever sends them."""
    unknown = sorted(set(average) - set(current))
    if unknown:
        raise KeyError(f"released entries {unknown} are not in the global model")
    return {key: average.get(key, value) for key, value in current.items()}


ServerStep = Callable[[dict[str, "Tensor"], dict[str, "Tensor"]], dict[str, "Tensor"]]  # (current, average) -> new


def aggregate(
    current: Mapping[str, Tensor],
    updates: Mapping[str, Tensor],
    weights: Sequence[float],
    server_step: ServerStep | None = None,
) -> dict[str, Tensor] | None:
    """The next global model from `updates`, each entry the released values of the K clients that
    trained, stacked [K, *shape], with their weights: the weighted mean (factors w/Σw in float32),
    then `server_step` from the current values of those entries, merged into `current`
    (`with_released`). None when the mean is not finite: the model stays as it was."""
    import torch

    total = sum(weights)
    factors = torch.tensor([w / total for w in weights], dtype=torch.float32)
    average = {key: torch.tensordot(factors, stacked, dims=1) for key, stacked in updates.items()}
    return _stepped(current, average, server_step)


def aggregate_client_level(
    current: Mapping[str, Tensor],
    updates: Mapping[str, Tensor],
    client_level: ClientLevel,
    server_round: int,
    server_step: ServerStep | None = None,
) -> dict[str, Tensor] | None:
    """`aggregate` under client-level DP: the average is the federation's release for the round
    (`ClientLevel.release`, which records its spend first) from the trained members' updates
    ([K, *shape] per released entry; K may be 0: the noise is released all the same)."""
    released = {key: current[key] for key in updates}
    return _stepped(current, client_level.release(server_round, released, updates), server_step)


def _stepped(
    current: Mapping[str, Tensor], average: dict[str, Tensor], server_step: ServerStep | None
) -> dict[str, Tensor] | None:
    """The average checked finite (None if not), stepped by the server's optimiser, merged."""
    import torch

    if not all(bool(torch.isfinite(v).all()) for v in average.values()):
        return None
    if server_step is not None:  # steps the released entries only; the others are never sent
        average = server_step({key: current[key] for key in average}, average)
    return with_released(current, average)
