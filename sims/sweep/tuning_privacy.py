"""What a private tuning costs each client: the RDP curve of the plan each client makes in every
candidate's tuning run and cell run, planned as the engines plan (the run config's partition, each
client's own N, ε, δ and epochs), composed by fedprivacy.privacy.random_search."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from fedprivacy.data.partition import load_client, load_clients
from fedprivacy.data.types import ClientData
from fedprivacy.errors import ClientRefusal, InputError, PlanRefused
from fedprivacy.plans import plan_from_settings
from fedprivacy.privacy.accountants import NoiseEvent
from fedprivacy.privacy.random_search import ORDERS, TrialCount, TuningCost, run_curve, tuning_cost
from fedprivacy.recipe import partition_kwargs, require_data_file
from fedprivacy.runconfig import RunSettings, parse_run_config
from sims.sweep.grid import PLACEHOLDER_RESULTS_DIR
from sims.sweep.tune_spec import PrivateSearch

RECIPES_KEPT = 16  # data recipes whose clients' sizes are kept (a sweep's arms share a few)
_ROWS: dict[str, list[tuple[str, int] | None]] = {}  # a data recipe's clients: (id, rows) or None


def _client_rows(settings: RunSettings, num_clients: int) -> list[tuple[str, int] | None]:
    """Each client's (id, training rows) under the run's data recipe, None for one whose rows cannot
    be cut (it never trains); one partitioning per recipe, however many candidates share it."""
    recipe = partition_kwargs(settings, num_clients)
    key = json.dumps(recipe, sort_keys=True, default=str)
    if key not in _ROWS:
        try:
            found: list[ClientData | None] = list(load_clients(**recipe))
        except (InputError, ValueError):  # some client cannot be cut: each alone, as the engines do
            found = []
            for index in range(num_clients):
                try:
                    found.append(load_client(index, **recipe))
                except (InputError, ValueError):
                    found.append(None)
        if len(_ROWS) >= RECIPES_KEPT:
            _ROWS.clear()
        _ROWS[key] = [None if data is None else (data.client_id, data.num_examples) for data in found]
    return _ROWS[key]


def client_curves(run_config: dict[str, Any], num_clients: int) -> dict[str, tuple[float, np.ndarray]]:
    """Each client's (δ, RDP curve of its plan) for a run with `run_config`; a client that would
    refuse to plan (too little data, an unplannable budget) trains on nothing: a zero curve."""
    settings = parse_run_config({**run_config, "results-dir": PLACEHOLDER_RESULTS_DIR})
    require_data_file(settings)
    curves = {}
    for index, found in enumerate(_client_rows(settings, num_clients)):
        if found is None:
            continue
        client_id, size = found
        delta = settings.client_delta(index, num_clients)
        try:
            plan = plan_from_settings(
                settings,
                size,
                settings.client_epsilon(index, num_clients),
                delta,
                client_id,
                epochs=settings.client_epochs_for(index, num_clients),
                compare=False,
            )
        except (ClientRefusal, InputError, PlanRefused):
            curves[client_id] = (delta, np.zeros(len(ORDERS)))
            continue
        if plan.expected_batch_size < 1:
            curves[client_id] = (delta, np.zeros(len(ORDERS)))
            continue
        events = tuple(NoiseEvent(sigma, plan.sampling_rate, count) for sigma, count in plan.noise_segments)
        curves[client_id] = (delta, _curve(events))
    return curves


@lru_cache(maxsize=4096)
def _curve(events: tuple[NoiseEvent, ...]) -> np.ndarray:
    """`run_curve`, once per distinct schedule (a run's clients share a handful)."""
    return run_curve(events)


def arm_costs(
    trial_configs: list[dict[str, Any]],
    cell_configs: list[dict[str, Any]],
    num_clients: int,
    search: PrivateSearch,
    ran: Sequence[int] = (),
) -> dict[str, Any]:
    """Each client's `TuningCost` (candidates in order: their tuning-run and cell run configs, which
    cut the same rows and give each client the same δ: `sims.sweep.tuning` checks), the largest over
    clients of each, and the mean of `tuned`."""
    trials = [client_curves(config, num_clients) for config in trial_configs]
    finals = [client_curves(config, num_clients) for config in cell_configs]
    count = TrialCount(search.trials_mean, search.trials_shape)
    zero = np.zeros(len(ORDERS))
    costs: dict[str, TuningCost] = {}
    for client_id in sorted({client for found in (*trials, *finals) for client in found}):
        delta = next(found[client_id][0] for found in (*trials, *finals) if client_id in found)
        costs[client_id] = tuning_cost(
            [found[client_id][1] if client_id in found else zero for found in trials],
            [found[client_id][1] if client_id in found else zero for found in finals],
            search.score_noise,
            count,
            delta,
            ran=ran,
        )
    tuned = [cost.tuned for cost in costs.values()]
    return {
        "tuned_max": max(tuned, default=math.nan),
        "tuned_mean": float(np.mean(tuned)) if tuned else math.nan,
        "one_run_max": max((cost.one_run for cost in costs.values()), default=math.nan),
        "all_trials_max": max((cost.all_trials for cost in costs.values()), default=math.nan),
        "gamma": count.gamma,
        "clients": {
            client_id: {"one_run": cost.one_run, "tuned": cost.tuned, "all_trials": cost.all_trials}
            for client_id, cost in costs.items()
        },
    }
