"""The reply protocol both sides import: what a client's train reply holds besides its trained
parameters (public values only, SECURITY.md), how the metrics are built, and the key under which
the initial model's reply names the entries clients release."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from fedprivacy.privacy.plan import Plan

if TYPE_CHECKING:  # the server reads this module too, and imports nothing of the client's side
    from fedprivacy.identity import LocalClient

PUBLIC_REPLY_KEYS = (
    "num-examples",
    "epsilon-budget",
    "delta",
    "sigma",
    "steps-planned",
    "epsilon-spent",
    "steps-done",
    "budget-exhausted",
    "on-gpu",
)


RELEASED_KEY = "released"  # the initial model's reply names the entries clients release (its trained parameters)
DIAGNOSTIC_KEYS = ("train-loss", "clip-fraction", "nonfinite-examples")  # simulations with diagnostics only


def reply_metrics(
    client: LocalClient,
    plan: Plan,
    epsilon_spent: float,
    steps_done: int,
    *,
    trained: bool,
    on_gpu: bool = False,
) -> dict[str, int | float]:
    """A train reply's metrics (`PUBLIC_REPLY_KEYS`): a client that did not train sends weight zero."""
    return {
        **reply_constants(client, plan, trained=trained, on_gpu=on_gpu),
        "epsilon-spent": float(epsilon_spent),
        "steps-done": int(steps_done),
    }


def reply_constants(client: LocalClient, plan: Plan, *, trained: bool, on_gpu: bool = False) -> dict[str, int | float]:
    """The reply's metrics that stay the same from round to round of a run (all but ε spent and
    steps done): a simulator builds them once per client."""
    return {
        "num-examples": int(client.planning_size) if trained else 0,
        "epsilon-budget": float(client.epsilon),
        "delta": float(client.delta),
        "sigma": float(plan.sigma),
        "steps-planned": int(plan.steps),
        "budget-exhausted": 0 if trained else 1,
        "on-gpu": int(trained and on_gpu),
    }


def diagnostics(mean_loss: float, clip_fraction: float, nonfinite: int) -> dict[str, int | float]:
    """Raw training statistics (`DIAGNOSTIC_KEYS`), for a simulation that asked: never private."""
    return {
        "train-loss": _finite(mean_loss),
        "clip-fraction": _finite(clip_fraction),
        "nonfinite-examples": int(nonfinite),
    }


def _finite(value: float) -> float:
    return float(value) if math.isfinite(value) else 0.0
