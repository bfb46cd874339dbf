"""The non-private baseline: the private run's rounds with clipping and noise off.

`nonprivate_baseline` is the fast engine's run (`run_fast(..., private=False)`) of the run config
it is compared with, so it takes everything but the mechanism from the private run: the clients
and their partitions, the model and its initial weights, client sampling, each client's plan (its
Poisson rate q, steps T and their split over rounds, made as the ClientApp makes it; the plan's
noise is never used), the step sizes (AdaGrad-norm reads the released, here noiseless and
unclipped, gradient), the division of each step's gradient sum by q·N, the server's test set and
the device. The keys a sweep shares one baseline across are pinned
(`fedprivacy.sweepfiles.BASELINE_IGNORED_KEYS`): the average is FedAvg by examples (inverse-noise
weights mean nothing without noise), there is no server optimiser, no client-level DP (the
baseline of a two-level run trains every member every round, FedAvg without either level), and the
Poisson samples come from the run's `seed` (the noise seed's stream keyed by it), so a baseline is
reproducible.

`private=False` is a Python argument, never a run-config key, so no run config can turn privacy
off. The run's results folder (and its ledger, which holds only this run's would-be spends) lives
in a temporary folder and is deleted; the result returned is marked `private=False` and keeps no
ε figure, so no report can take it for a private run.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
import warnings
from typing import Any

from fedprivacy.runconfig import DEFAULTS, parse_run_config
from fedprivacy.runconfig_keys import FEDERATION_KEYS
from fedprivacy.training.rng import SeededRunWarning
from sims.fast.engine import run_fast
from sims.runner import RunResult, natural_client_count, read_results

# Fields of summary.json, rounds.csv and clients.csv a baseline's result leaves out: those only
# a private run's ledger and mechanism give meaning to (here, the ε its private twin would spend),
# and the paths into the deleted folder.
DROPPED_FIELDS = frozenset(
    {
        "results_dir",
        "ledger",
        "epsilon_spent_max",
        "epsilon_spent_mean",
        "all_within_budget",
        "clip_fraction",
        "epsilon_budget",
        "epsilon_spent",
        "delta",
        "sigma",
        "federation",
        "federation_epsilon_spent",
    }
)


def baseline_run_config(run_config: dict[str, Any]) -> dict[str, Any]:
    """`run_config` with the keys a baseline pins (the module's docstring): FedAvg by examples, no
    server optimiser, no client-level DP, Poisson samples from the run's seed."""
    config = {**DEFAULTS, **run_config}
    return {
        **config,
        **{key: DEFAULTS[key] for key in ("federation-epsilon", *FEDERATION_KEYS)},
        "aggregation": "examples",
        "server-optimizer": "none",
        "noise-seed": parse_run_config(config).seed,
    }


def nonprivate_baseline(
    run_config: dict[str, Any], num_clients: int | None = None, *, name: str = "non-private"
) -> RunResult:
    """`run_config`'s run with clipping and noise off (`num_clients` None: one per natural partition)."""
    config = baseline_run_config(run_config)
    num_clients = natural_client_count(config) if num_clients is None else num_clients
    with tempfile.TemporaryDirectory(prefix="fedprivacy-baseline-") as scratch, warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededRunWarning)  # seeded sampling, and no noise to keep secret
        started = time.perf_counter()
        folder, _ = run_fast({**config, "results-dir": scratch}, num_clients, private=False, say=lambda _: None)
        result = read_results(folder, name, time.perf_counter() - started)
    return dataclasses.replace(
        result,
        folder=None,
        private=False,
        summary=_kept(result.summary),
        rounds=[_kept(row) for row in result.rounds],
        clients=[_kept(row) for row in result.clients],
    )


def _kept(row: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in row.items() if key not in DROPPED_FIELDS}
