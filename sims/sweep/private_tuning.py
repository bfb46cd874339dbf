"""Private tuning ([sweep] tune-private = true): each arm's setting chosen by private random search,
its cost per client counted (Papernot & Steinke 2022, "Hyperparameter tuning with Renyi
differential privacy"; the bound in fedprivacy.privacy.random_search).

Per arm: K trials, K drawn from a truncated negative binomial (mean tune-trials-mean, shape
tune-trials-shape); trial j runs a candidate drawn uniformly from [tune]'s space (with
replacement) with its own seed, the j-th from the first tune seed on that no cell uses, on fit
rows, and is scored by its count of correct validation rows plus Gaussian noise of std
tune-score-noise, released exactly rounded to a power-of-two grid (`rounded_gaussian`, as every
noisy sum a client releases), over the validation rows. The trial with the highest noisy score
wins (the first on a tie); a failed trial cannot.

K, the candidates and the seeds are drawn once, before any trial runs, from a key (a fresh OS key,
or with seeded-noise one derived from the arm's name), and kept in `<out>/tuning/<arm>/trials.json`
with the key: a rerun runs the same trials and draws the same score noise. That file, like the
trials' own folders, is the analyst's: the guarantee covers what the tuning releases, the choice
and its noisy score, and the cells run with it.

The cost, per client at its own δ (choice.json `private.epsilon`): the selection's RDP, from the
largest RDP curve over the candidates of the client's tuning-run plan plus the score's, composed
with one cell run with the choice (the largest curve over candidates, since the choice depends on
the data); beside it one cell run alone under the same accountant, and every trial that ran
composed with the choice's run (a party that sees every trial's updates, like the server, is not
covered by the selection's theorem).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedprivacy.data.partition import load_client, load_clients
from fedprivacy.data.types import ClientData
from fedprivacy.errors import ClientRefusal, InputError, PlanRefused
from fedprivacy.plans import plan_from_settings
from fedprivacy.privacy.accountants import NoiseEvent
from fedprivacy.privacy.random_search import TrialCount, TuningCost, run_curve, tuning_cost
from fedprivacy.recipe import partition_kwargs, require_data_file
from fedprivacy.runconfig import RunSettings, parse_run_config
from fedprivacy.sweepfiles import CHOICE_JSON, TUNING_PRIVATE_NOTE, read_json, write_json
from fedprivacy.training.noise import rounded_gaussian
from fedprivacy.training.rng import SeededRunWarning, StepRandomness
from sims.sweep.grid import PLACEHOLDER_RESULTS_DIR
from sims.sweep.tune_spec import PrivateSearch

TRIALS_JSON = "trials.json"
RULE = "private random search: the trial with the highest noisy validation score (the first on a tie)"


def _word(key: bytes, label: str, index: int, attempt: int = 0) -> int:
    """A 64-bit word of the arm's draws (BLAKE2b keyed by the arm's key, at a position)."""
    position = f"{label}/{index}/{attempt}".encode()
    return int.from_bytes(hashlib.blake2b(position, key=key, digest_size=8, person=b"fedprivacy-tune").digest(), "big")


def _index(key: bytes, label: str, index: int, size: int) -> int:
    """A uniform integer in [0, size) (rejection sampling: no modulo bias)."""
    limit = (1 << 64) - (1 << 64) % size
    for attempt in range(1 << 16):
        word = _word(key, label, index, attempt)
        if word < limit:
            return word % size
    raise RuntimeError("no accepted word in 65,536 draws")  # probability below 2^-65536


def arm_key(arm: str, seeded: bool) -> bytes:
    """The key of an arm's draws: fresh from the OS, or (seeded-noise) from the arm's name."""
    if seeded:
        return hashlib.blake2b(arm.encode(), digest_size=32, person=b"fedprivacy-tkey").digest()
    return os.urandom(32)


def trial_seeds(first: int, count: int, used: set[int]) -> list[int]:
    """`count` seeds from `first` on, skipping the cells' seeds."""
    seeds, seed = [], first
    while len(seeds) < count:
        if seed not in used:
            seeds.append(seed)
        seed += 1
    return seeds


def draw_trials(names: list[str], search: PrivateSearch, arm: str, first_seed: int, used: set[int]) -> dict[str, Any]:
    """trials.json of an arm: its key, K and each trial's candidate (of `names`) and seed."""
    key = arm_key(arm, search.seeded)
    count = TrialCount(search.trials_mean, search.trials_shape).draw(_word(key, "count", 0) / 2.0**64)
    seeds = trial_seeds(first_seed, count, used)
    return {
        "key": key.hex(),
        "seeded": search.seeded,
        "count": count,
        "trials": [
            {"candidate": names[_index(key, "candidate", j, len(names))], "seed": seeds[j]} for j in range(count)
        ],
    }


def noisy_count(correct: int, noise_std: float, key: bytes, trial: int) -> float:
    """correct + N(0, noise_std²), exactly rounded to its power-of-two grid (trial `trial`'s noise)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededRunWarning)  # the arm's key, kept in trials.json
        randomness = StepRandomness(key)
    words = torch.from_numpy(randomness.stream_words(trial, 1, 2).view(np.int64).copy())
    count = torch.tensor([[float(correct)]], dtype=torch.float64)
    noisy = rounded_gaussian(count, words, torch.tensor([noise_std], dtype=torch.float64), [randomness.refiner(trial)])
    return float(noisy.item())


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
            curves[client_id] = (delta, np.zeros(1))
            continue
        if plan.expected_batch_size < 1:
            curves[client_id] = (delta, np.zeros(1))
            continue
        events = tuple(NoiseEvent(sigma, plan.sampling_rate, count) for sigma, count in plan.noise_segments)
        curves[client_id] = (delta, _curve(events))
    return curves


@lru_cache(maxsize=4096)
def _curve(events: tuple[NoiseEvent, ...]) -> np.ndarray:
    return run_curve(events)


def _full(curve: np.ndarray, length: int) -> np.ndarray:
    return curve if len(curve) == length else np.zeros(length)


def arm_costs(
    trial_configs: list[dict[str, Any]],
    cell_configs: list[dict[str, Any]],
    num_clients: int,
    search: PrivateSearch,
    ran: list[int],
    chosen: int | None,
) -> dict[str, Any]:
    """Each client's `TuningCost` (candidates in order: their tuning-run and cell run configs), and
    the largest and mean over clients."""
    trials = [client_curves(config, num_clients) for config in trial_configs]
    finals = [client_curves(config, num_clients) for config in cell_configs]
    count = TrialCount(search.trials_mean, search.trials_shape)
    length = len(next((curve for found in finals for _, curve in found.values() if len(curve) > 1), np.zeros(1)))
    costs: dict[str, TuningCost] = {}
    for client_id in sorted({client for found in (*trials, *finals) for client in found}):
        delta = next(found[client_id][0] for found in (*trials, *finals) if client_id in found)

        def curves(found: list[dict[str, tuple[float, np.ndarray]]], client: str = client_id) -> list[np.ndarray]:
            return [_full(part[client][1], length) if client in part else np.zeros(length) for part in found]

        costs[client_id] = tuning_cost(
            curves(trials), curves(finals), search.score_noise, count, delta, ran=ran, chosen=chosen
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


Outcome = Callable[[str, int], tuple[float | None, int | None, str | None]]  # (accuracy, rows, error) of a trial


def choice_record(
    inputs: dict[str, Any],
    candidates: list[tuple[str, dict[str, Any]]],
    drawn: dict[str, Any],
    search: PrivateSearch,
    outcome: Outcome,
    costs: Callable[[list[int], int | None], dict[str, Any]],
) -> dict[str, Any]:
    """choice.json of a private arm: every trial's noisy score, the winning trial, the cost."""
    key = bytes.fromhex(drawn["key"])
    position = {name: index for index, (name, _) in enumerate(candidates)}
    trials = []
    for j, trial in enumerate(drawn["trials"]):
        accuracy, rows, error = outcome(trial["candidate"], trial["seed"])
        if error is None and not rows:
            error = "no validation rows recorded (private tuning needs central evaluation)"
        score = None
        if error is None:
            score = noisy_count(round(accuracy * rows), search.score_noise, key, j) / rows
        trials.append({**trial, "noisy_score": score, "validation_rows": rows, "error": error})
    scored = [(t["noisy_score"], -j) for j, t in enumerate(trials) if t["noisy_score"] is not None]
    winner = trials[-max(scored)[1]] if scored else None
    entries = []
    for name, values in candidates:
        own = [t for t in trials if t["candidate"] == name]
        scores = [t["noisy_score"] for t in own if t["noisy_score"] is not None]
        entries.append(
            {
                "name": name,
                "values": values,
                "seeds": [t["seed"] for t in own],
                "scores": {str(t["seed"]): t["noisy_score"] for t in own},
                "errors": {str(t["seed"]): t["error"] for t in own if t["error"] is not None},
                "score": max(scores) if scores else None,
            }
        )
    chosen = None
    if winner is not None:
        chosen = {"name": winner["candidate"], "values": candidates[position[winner["candidate"]]][1]}
        chosen["score"] = winner["noisy_score"]
    ran = [position[t["candidate"]] for t in trials]
    return {
        **inputs,
        "rule": RULE,
        "close_rule": "off (private tuning)",
        "extra_seeds": False,
        "candidates": entries,
        "chosen": chosen,
        "private": {
            **search.to_dict(),
            "count": drawn["count"],
            "trials": trials,
            "epsilon": costs(ran, None if chosen is None else position[chosen["name"]]),
        },
        "privacy": TUNING_PRIVATE_NOTE,
    }


def read_trials(folder: Path) -> dict[str, Any] | None:
    path = folder / TRIALS_JSON
    return read_json(path) if path.is_file() else None


def tune_arm_private(
    folder: Path,
    inputs: dict[str, Any],
    candidates: list[tuple[str, dict[str, Any]]],
    search: PrivateSearch,
    ensure: Callable[[str, int], None],
    outcome: Outcome,
    costs: Callable[[list[int], int | None], dict[str, Any]],
    first_seed: int,
    used: set[int],
) -> dict[str, Any]:
    """Draw the arm's trials (once: trials.json), run those not done (`ensure(candidate, seed)`),
    write choice.json."""
    drawn = read_trials(folder)
    if drawn is None:
        drawn = draw_trials([name for name, _ in candidates], search, folder.name, first_seed, used)
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / TRIALS_JSON, drawn)
    for trial in drawn["trials"]:
        ensure(trial["candidate"], trial["seed"])
    record = choice_record(inputs, candidates, drawn, search, outcome, costs)
    write_json(folder / CHOICE_JSON, record)
    return record
