"""What the server accepts from a client: every train and evaluate reply is checked before use.

A federated run meets clients that crash, hang, and send garbage (a bug, a bit flip, a lying
client). The server therefore treats a reply as untrusted input: it must hold exactly the public
keys of `fedprivacy.protocol` (SECURITY.md), finite numbers in their ranges, a plan that parses
and stays the same for the whole run, and weights with the global model's keys, shapes and dtypes,
all finite. Its `num-examples` (the FedAvg weight) may not exceed the N of the client's own plan:
a client cannot inflate its weight mid-run. N itself is self-reported; the server cannot verify it
(robust aggregation is out of scope, see SECURITY.md).

A reply that fails a check raises `InvalidReply` with a one-line reason; the strategy drops it,
names the client and records why. This module never imports flwr: the strategy hands it plain
dicts and numpy arrays.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedprivacy.privacy.plan import Plan
from fedprivacy.protocol import DIAGNOSTIC_KEYS, PUBLIC_REPLY_KEYS, RELEASED_KEY

MAX_CLIENT_ID = 200  # characters: a name, not a payload
FLAGS = ("budget-exhausted", "on-gpu")
COUNTS = ("num-examples", "steps-planned", "steps-done")
EVALUATE_KEYS = ("num-examples", "loss", "accuracy", "evaluation-off")

ModelSpec = dict[str, tuple[tuple[int, ...], str]]  # array key -> (shape, dtype)


class InvalidReply(ValueError):
    """A reply the server must not use; the message says why in one line."""


@dataclass(frozen=True)
class TrainReply:
    """A train reply that passed every check."""

    client_id: str
    plan: Plan
    metrics: dict[str, float]
    arrays: dict[str, np.ndarray] | None  # None: the client could not afford the round

    @property
    def exhausted(self) -> bool:
        return bool(self.metrics["budget-exhausted"])


def model_spec(arrays: Mapping[str, np.ndarray]) -> ModelSpec:
    """The keys, shapes and dtypes every reply's weights must match."""
    return {key: (tuple(value.shape), str(value.dtype)) for key, value in arrays.items()}


def check_released(names: Any, arrays: Mapping[str, Any]) -> list[str]:
    """The names of the entries a client releases, as the initial model's reply gives them: a
    non-empty list of the model's own keys, each once."""
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise InvalidReply(f"{RELEASED_KEY} must list the model's trained entries by name")
    if len(set(names)) != len(names) or not set(names) <= set(arrays):
        raise InvalidReply(f"{RELEASED_KEY} names entries the model lacks, or one twice")
    return list(names)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidReply(f"metric {key}={value!r} is not a finite number")
    return float(value)


def _metrics(metrics: Mapping[str, Any], required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, float]:
    missing = [k for k in required if k not in metrics]
    if missing:
        raise InvalidReply(f"metrics lack {missing[0]!r}")
    unknown = sorted(set(metrics) - set(required) - set(optional))
    if unknown:
        raise InvalidReply(f"metrics hold {unknown[0]!r}, which is not a public reply key")
    return {key: _number(key, value) for key, value in metrics.items()}


def _check_train_metrics(values: dict[str, float]) -> None:
    for key in FLAGS:
        if values[key] not in (0.0, 1.0):
            raise InvalidReply(f"metric {key}={values[key]:g} must be 0 or 1")
    for key in COUNTS:
        if values[key] < 0 or values[key] != int(values[key]):
            raise InvalidReply(f"metric {key}={values[key]:g} must be a whole number >= 0")
    if not 0 < values["delta"] < 1 or values["epsilon-budget"] <= 0 or values["sigma"] <= 0:
        raise InvalidReply("metrics epsilon-budget, delta and sigma must be > 0 (and delta < 1)")
    if not 0 <= values["epsilon-spent"] <= values["epsilon-budget"]:
        raise InvalidReply(
            f"metric epsilon-spent={values['epsilon-spent']:g} is outside [0, its budget {values['epsilon-budget']:g}]"
        )


def _plan(client: Mapping[str, Any]) -> tuple[str, Plan]:
    client_id = client.get("client-id")
    if not isinstance(client_id, str) or not client_id.strip() or len(client_id) > MAX_CLIENT_ID:
        raise InvalidReply(f"client-id must be a name of 1 to {MAX_CLIENT_ID} characters")
    try:
        plan = Plan.from_dict(json.loads(str(client["plan"])))
    except Exception as error:  # any malformed plan is the reply's fault, whatever the parser raised
        raise InvalidReply(f"its plan is not a fedprivacy plan ({type(error).__name__})") from None
    if not isinstance(plan.n, int) or plan.n < 2 or not isinstance(plan.steps, int) or plan.steps < 1:
        raise InvalidReply(f"its plan has N={plan.n!r}, T={plan.steps!r}: both must be whole numbers (N >= 2, T >= 1)")
    return client_id, plan


def _check_plan_matches(values: dict[str, float], plan: Plan, pinned: Plan | None) -> None:
    if pinned is not None and plan.to_dict() != pinned.to_dict():
        raise InvalidReply("its plan differs from the one it sent earlier in this run")
    if (values["epsilon-budget"], values["delta"], values["steps-planned"]) != (
        plan.epsilon,
        plan.delta,
        plan.steps,
    ):
        raise InvalidReply("metrics epsilon-budget, delta and steps-planned disagree with its plan")
    if values["sigma"] != plan.sigma:
        raise InvalidReply(f"metric sigma={values['sigma']:g} disagrees with its plan's σ={plan.sigma:g}")


def _check_arrays(arrays: Mapping[str, np.ndarray] | None, model: ModelSpec) -> dict[str, np.ndarray]:
    if arrays is None:
        raise InvalidReply("it trained but sent no weights")
    if set(arrays) != set(model):
        extra, lacking = sorted(set(arrays) - set(model)), sorted(set(model) - set(arrays))
        raise InvalidReply(f"its weights have keys {extra} the model lacks and lack {lacking}")
    for key, (shape, dtype) in model.items():
        value = arrays[key]
        if tuple(value.shape) != shape or str(value.dtype) != dtype:
            raise InvalidReply(
                f"weights {key!r} are {value.dtype}{list(value.shape)}, the model's are {dtype}{list(shape)}"
            )
        if not np.isfinite(value).all():
            raise InvalidReply(f"weights {key!r} hold NaN or infinite values")
    return dict(arrays)


def check_train_reply(
    metrics: Mapping[str, Any],
    client: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray] | None,
    model: ModelSpec,
    pinned: Plan | None = None,
) -> TrainReply:
    """Validate one train reply against the global model and the plan the client sent before."""
    values = _metrics(metrics, PUBLIC_REPLY_KEYS, DIAGNOSTIC_KEYS)
    _check_train_metrics(values)
    client_id, plan = _plan(client)
    _check_plan_matches(values, plan, pinned)
    if values["budget-exhausted"]:
        if values["num-examples"] != 0:
            raise InvalidReply("a client out of budget must send num-examples=0")
        return TrainReply(client_id, plan, values, None)
    if not 1 <= values["num-examples"] <= plan.n:
        raise InvalidReply(
            f"num-examples={values['num-examples']:g} must be between 1 and its plan's N={plan.n}: "
            "a client cannot weigh more than its own data"
        )
    return TrainReply(client_id, plan, values, _check_arrays(arrays, model))


def check_evaluate_reply(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Validate an evaluate reply: zero weight with evaluation off, else a loss and an accuracy."""
    if metrics.get("evaluation-off") == 1:
        return _metrics(metrics, ("num-examples", "evaluation-off"))
    values = _metrics(metrics, EVALUATE_KEYS)
    if values["num-examples"] < 1 or values["num-examples"] != int(values["num-examples"]):
        raise InvalidReply(f"metric num-examples={values['num-examples']:g} must be a whole number >= 1")
    if values["loss"] < 0 or not 0 <= values["accuracy"] <= 1:
        raise InvalidReply(
            f"loss={values['loss']:g}, accuracy={values['accuracy']:g}: need loss >= 0, accuracy in [0, 1]"
        )
    return values
