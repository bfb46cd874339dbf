"""Private tuning ([sweep] tune-private = true): each arm's setting chosen by private random search
(Papernot & Steinke 2022, "Hyperparameter tuning with Renyi differential privacy"); its cost per
client is `sims.sweep.tuning_privacy`'s.

Per arm: K trials, K drawn from a truncated negative binomial (mean tune-trials-mean, shape
tune-trials-shape); trial j runs a candidate drawn uniformly from [tune]'s space (with
replacement) with a seed drawn at random (never a cell's), on fit rows, and is scored by its count
of correct validation rows plus Gaussian noise of std tune-score-noise, released exactly rounded to
a power-of-two grid (`rounded_gaussian`, as every noisy sum a client releases), over the
validation rows. The trial with the highest noisy score wins (the first on a tie); a failed trial
cannot, and is never run again (a retry would be one more run on the same rows).

K, the candidates and the seeds are drawn once, before any trial runs, from a key (a fresh OS key,
or with seeded-noise one derived from the arm's name), and kept in `<out>/tuning/<arm>/trials.json`
with the key, the options and the candidates they were drawn for: a rerun runs the same trials and
draws the same score noise, and refuses other options or candidates. That file, like the trials'
own folders and the scores in choice.json, is the analyst's: the guarantee covers what the tuning
releases, the choice and its noisy score, and one cell run with it.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedprivacy.errors import InputError
from fedprivacy.privacy.random_search import TrialCount
from fedprivacy.sweepfiles import CHOICE_JSON, TUNING_PRIVATE_NOTE, read_json, write_json
from fedprivacy.training.noise import rounded_gaussian
from fedprivacy.training.rng import SeededRunWarning, StepRandomness
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


SEED_RANGE = 1 << 31  # trial seeds are drawn in [0, 2³¹)


def trial_seeds(key: bytes, count: int, used: set[int]) -> list[int]:
    """`count` distinct seeds drawn from the arm's key, none of them a cell's (`used`)."""
    seeds: list[int] = []
    taken, position = set(used), 0
    while len(seeds) < count:
        seed = _index(key, "seed", position, SEED_RANGE)
        position += 1
        if seed not in taken:
            seeds.append(seed)
            taken.add(seed)
    return seeds


def draw_trials(names: list[str], search: PrivateSearch, arm: str, used: set[int]) -> dict[str, Any]:
    """trials.json of an arm: its key, the options and candidates (`names`) the draws are for, K,
    and each trial's candidate and seed."""
    key = arm_key(arm, search.seeded)
    count = TrialCount(search.trials_mean, search.trials_shape).draw((_word(key, "count", 0) >> 11) * 2.0**-53)
    seeds = trial_seeds(key, count, used)
    return {
        "key": key.hex(),
        "options": search.to_dict(),
        "candidates": names,
        "count": count,
        "trials": [
            {"candidate": names[_index(key, "candidate", j, len(names))], "seed": seeds[j]} for j in range(count)
        ],
    }


OPTION_NAMES = {  # trials.json's options, as the scenario names them
    "trials_mean": "tune-trials-mean",
    "trials_shape": "tune-trials-shape",
    "score_noise": "tune-score-noise",
    "seeded": "seeded-noise",
}


def other_draws(drawn: dict[str, Any], search: PrivateSearch, names: list[str]) -> str | None:
    """What differs between the draws in a trials.json and this scenario's (None: nothing)."""
    before, now = drawn.get("options", {}), search.to_dict()
    changed = [
        f"{OPTION_NAMES[key]} {before.get(key)!r} there, {value!r} now"
        for key, value in now.items()
        if before.get(key) != value
    ]
    if changed:
        return "other private tuning options: " + "; ".join(changed)
    if drawn.get("candidates") != names:
        return "other candidates"
    return None


def noisy_count(correct: int, noise_std: float, key: bytes, trial: int) -> float:
    """correct + N(0, noise_std²), exactly rounded to its power-of-two grid (trial `trial`'s noise)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededRunWarning)  # the arm's key, kept in trials.json
        randomness = StepRandomness(key)
    words = torch.from_numpy(randomness.stream_words(trial, 1, 2).view(np.int64).copy())
    count = torch.tensor([[float(correct)]], dtype=torch.float64)
    noisy = rounded_gaussian(count, words, torch.tensor([noise_std], dtype=torch.float64), [randomness.refiner(trial)])
    return float(noisy.item())


TrialOutcome = Callable[[str, int], tuple[float | None, int | None, str | None]]  # a trial's accuracy, rows, error


def choice_record(
    inputs: dict[str, Any],
    candidates: list[tuple[str, dict[str, Any]]],
    drawn: dict[str, Any],
    search: PrivateSearch,
    outcome: TrialOutcome,
    costs: Callable[[list[int]], dict[str, Any]],
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
            "epsilon": costs(ran),
        },
        "privacy": TUNING_PRIVATE_NOTE,
    }


def read_trials(folder: Path) -> dict[str, Any] | None:
    """An arm's trials.json, None before its draws."""
    path = folder / TRIALS_JSON
    return read_json(path) if path.is_file() else None


def tune_arm_private(
    folder: Path,
    inputs: dict[str, Any],
    candidates: list[tuple[str, dict[str, Any]]],
    search: PrivateSearch,
    ensure: Callable[[str, int], None],
    outcome: TrialOutcome,
    costs: Callable[[list[int]], dict[str, Any]],
    used: set[int],
) -> dict[str, Any]:
    """Draw the arm's trials (once: trials.json), run those not run yet (`ensure(candidate, seed)`),
    write choice.json."""
    names = [name for name, _ in candidates]
    drawn = read_trials(folder)
    if drawn is None:
        drawn = draw_trials(names, search, folder.name, used)
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / TRIALS_JSON, drawn)
    elif (difference := other_draws(drawn, search, names)) is not None:
        raise InputError("out", str(folder), f"its {TRIALS_JSON} was drawn for {difference}: use another --out")
    for trial in drawn["trials"]:
        ensure(trial["candidate"], trial["seed"])
    record = choice_record(inputs, candidates, drawn, search, outcome, costs)
    write_json(folder / CHOICE_JSON, record)
    return record
