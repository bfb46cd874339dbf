"""The fast engine: the ServerApp's rounds and the ClientApp's rules, with a round's clients
trained together by workers instead of one Flower message each.

Everything but the arithmetic is the apps' own code: the clients (`simulation_client`), their
ledger accounts, partitioning pins and seed rules (`open_account`), their plans
(`plan_from_settings`, shared between clients with the same inputs), the cohort's round
(`fedprivacy.cohort`: noise events, affordability, spends, replies), the round's participation rules
(`fedprivacy.participation`: who trains, who evaluates, what a failure costs), the weighted average
(`fedprivacy.aggregation.aggregate`, with Flower's server optimisers from `server.optimizers`),
central and federated evaluation, and the results folder (`RunRecorder`). What differs is how:
plans are made once per run, a round's ledger writes are one transaction (committed while the
clients train and the server aggregates their updates and evaluates the new model, in memory),
and the clients' DP-SGD steps run together (`fedprivacy.training.stack`, the trainer's own step
for K clients). With the same seeds the global model after every round equals the apps' to float
tolerance and every client's ε is identical (tests/test_fast_engine.py).

`run_fast(..., private=False)` is the same run with clipping and noise off: the non-private
baseline (`sims.baseline`). It is a Python argument, never a run-config key, so no run config can
turn privacy off; such a run keeps its ledger in its own folder (it never spends from a ledger
the run config names) and its config.json and summary.json say `"private": false` (a private
run's folder has no such key, as the apps').
"""

from __future__ import annotations

import gc
import random
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from fedprivacy.admission import client_noise_seed, open_accounts
from fedprivacy.aggregation import aggregate, aggregate_client_level, aggregation_weight
from fedprivacy.client_level import ClientLevel
from fedprivacy.cohort import Member, TrainedRows, cohort_round
from fedprivacy.errors import error_summary
from fedprivacy.identity import LocalClient, simulation_client
from fedprivacy.ledger import Ledger
from fedprivacy.models import evaluate_model
from fedprivacy.participation import Participation
from fedprivacy.plans import run_plans
from fedprivacy.privacy.plan import Plan
from fedprivacy.recipe import initial_model, require_data_file, unused_data_keys
from fedprivacy.results import DIAGNOSTICS_NOTE, RunRecorder, largest_class_share, progress_line, resolved_config
from fedprivacy.run_life import finish, recorded_run
from fedprivacy.runconfig import DEFAULTS, RunSettings
from fedprivacy.training.capture import trained_names
from fedprivacy.training.rng import SeededRunWarning
from server.evaluation import central_evaluation, server_test_set
from server.optimizers import ServerOptimizer
from sims.fast.pool import WorkerPool, check_device
from sims.fast.worker import RoundRequest, WorkerClient

RoundCallback = Callable[[dict[str, Any]], None]
T = TypeVar("T")


@dataclass
class Client:
    """What the driver knows of one simulated client across the run."""

    index: int
    local: LocalClient | None = None
    failure: str | None = None  # why it cannot train (it fails when first sampled, as in the apps)
    member: Member | None = None  # once planned: its plan, trainer state and reply constants (`fedprivacy.cohort`)

    @property
    def name(self) -> str:
        return self.local.client_id if self.local is not None else str(self.index)

    @property
    def plan(self) -> Plan | None:
        return None if self.member is None else self.member.plan


@dataclass
class _EngineRound:
    """What the server made of a round's training, and when: its times, for `Timings`."""

    after: Any  # `then`'s result: the new global model and its central metrics
    training_s: float
    working_s: float
    worked_at: float


@dataclass
class Timings:
    """Where a run's time went: accounting (plans, ledger, ε, the clients' replies) and the rest.
    `commit_wait_s` is the part of accounting spent waiting, after the clients trained, the server
    aggregated and evaluated their updates and the replies were built, for the round's ledger
    commit to be durable (the syncs of the ledger's journal, which wait for a core while the
    training threads hold them). The `_by_round` lists hold each round's share of the totals
    (the first round's accounting includes the plans made for its clients)."""

    accounting_s: float = 0.0
    training_s: float = 0.0
    commit_wait_s: float = 0.0
    accounting_by_round: list[float] = field(default_factory=list)
    commit_wait_by_round: list[float] = field(default_factory=list)

    def add_round(self, accounting_s: float, training_s: float, commit_wait_s: float) -> None:
        self.accounting_s += accounting_s
        self.training_s += training_s
        self.commit_wait_s += commit_wait_s
        self.accounting_by_round.append(accounting_s)
        self.commit_wait_by_round.append(commit_wait_s)


def run_fast(
    run_config: dict[str, Any],
    num_clients: int,
    *,
    workers: int = 1,
    device: str = "auto",
    gpus_per_worker: float = 0.0,
    run_id: int = 1,
    on_round: RoundCallback | None = None,
    say: Callable[[str], None] = print,
    private: bool = True,
) -> tuple[Path, Timings]:
    """Run `run_config` on `num_clients` simulated clients; returns (results folder, timings).
    `device` is `cpu`, `cuda` or `auto` (`sims.fast.pool.DEVICES`); `workers` > 1 are Ray actors,
    on `cuda` sharing the GPUs evenly unless `gpus_per_worker` gives each one's share.
    `private=False`: the same run with clipping and noise off (see the module docstring)."""
    check_device(device, gpus_per_worker, workers)
    timings = Timings()
    with recorded_run(run_config, run_id, say, {**_marked(private), "engine": "fast"}) as run:
        settings = run.settings
        if not private:  # its spends are not real: never charge them to a client's own ledger
            settings = replace(settings, ledger_path=None)
        ledger_path = settings.ledger_path or run.folder / "ledger.sqlite"
        run.extra.update(ledger=str(ledger_path), diagnostics=DIAGNOSTICS_NOTE if settings.diagnostics else "off")
        settings.check_clients(num_clients, field="num_clients")
        require_data_file(settings)
        if unused := unused_data_keys(settings):
            say(unused)
        with ExitStack() as open_files:
            client_level = ClientLevel.start(settings, range(num_clients), run.folder)
            if client_level is not None:
                open_files.enter_context(client_level)
                run.extra["federation"] = client_level.describe()
                say(client_level.headline())
            open_files.enter_context(_fewer_collections())
            ledger = open_files.enter_context(Ledger(ledger_path))
            run.recorder.tables_every_s = TABLES_EVERY_S
            _run_rounds(
                settings,
                {**DEFAULTS, **run_config},
                num_clients,
                run_id,
                run.recorder,
                ledger,
                WorkerPoolSpec(workers, device, gpus_per_worker, private),
                timings,
                on_round,
                say,
                client_level,
            )
        run.extra["accounting_s"] = round(timings.accounting_s, 3)
    return run.folder, timings


# The results folder's round tables (rounds.csv, clients.csv, replies.csv) are rewritten at most
# once a second here, and when the run ends: a round takes tens of milliseconds, and rewriting 1,000
# clients' rows after each was 6-15% of a 20- to 60-round run (benchmarks/sim_throughput.py).
TABLES_EVERY_S = 1.0


def _marked(private: bool) -> dict[str, bool]:
    """What config.json and summary.json add: `"private": false` for a run with the mechanism off;
    nothing for a private run, whose folder is then the apps' own format."""
    return {} if private else {"private": False}


@contextmanager
def _fewer_collections(young: int = 100_000) -> Iterator[None]:
    """Python's cyclic garbage collector runs every 700 allocations by default; a 1,000-client
    round allocates hundreds of thousands of small objects (replies, records, events), so it
    would scan the young objects hundreds of times per round. Measured (benchmarks/sim_throughput.py
    scenario, logreg): 11% of a run's wall time. Collections still happen, 140× less often."""
    thresholds = gc.get_threshold()
    gc.set_threshold(young, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


@dataclass(frozen=True)
class WorkerPoolSpec:
    workers: int
    device: str
    gpus_per_worker: float
    private: bool


def _run_rounds(
    settings: RunSettings,
    run_config: dict[str, Any],
    num_clients: int,
    run_id: int,
    recorder: RunRecorder,
    ledger: Ledger,
    spec: WorkerPoolSpec,
    timings: Timings,
    on_round: RoundCallback | None,
    say: Callable[[str], None],
    client_level: ClientLevel | None,
) -> None:
    random.seed(settings.seed)
    test = server_test_set(settings, num_clients)
    assert test is not None  # None only without a data file, refused in run_fast
    recorder.evaluation_rows, recorder.largest_class_share = len(test.labels), largest_class_share(test.labels)
    clients = [_client(settings, index, num_clients, ledger.path) for index in range(num_clients)]
    described = resolved_config(
        settings,
        run_id,
        run_config,
        {
            **_marked(spec.private),
            "results_folder": str(recorder.folder),
            "ledger": str(ledger.path),
            "clients": num_clients,
            "evaluation": central_evaluation(settings),
            "engine": "fast",
            "workers": spec.workers,
            "device": spec.device,
            **({} if client_level is None else {"federation": client_level.describe()}),
        },
    )
    recorder.write_config(described)  # before the workers start: a run they refuse still says what it was
    model = initial_model(settings, test.features, test.num_classes)
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    loss, accuracy = _central_metrics(model, global_state, test)
    recorder.evaluated("", accuracy, loss)
    loaded = [c for c in clients if c.local is not None]
    pool = WorkerPool(
        [
            WorkerClient(
                c.index,
                c.local.data.train.features,
                c.local.data.train.labels,
                c.local.data.test.features,
                c.local.data.test.labels,
                client_noise_seed(settings, c.local.account),
            )
            for c in loaded
        ],
        (settings.model, tuple(test.features.shape[1:]), test.num_classes, dict(settings.model_options)),
        spec.workers,
        spec.device,
        spec.gpus_per_worker,
        private=spec.private,
    )
    say(f"fast engine: {spec.workers} worker{'s' * (spec.workers != 1)} on {pool.device}")
    recorder.write_config({**described, "device": pool.device})  # where it trains, `auto` resolved
    participation = Participation(
        recorder,
        seed=settings.seed,
        fraction_train=settings.fraction_train,
        fraction_evaluate=settings.fraction_evaluate,
        client_level=client_level,
    )  # every client is there from the start: `run_fast` refused fewer than min-clients
    indices = [c.index for c in clients]
    optimizer = ServerOptimizer.from_settings(settings)
    try:
        for server_round in range(1, settings.num_server_rounds + 1):
            sampled = [clients[i] for i in participation.trainers(server_round, indices)]
            aggregate_and_evaluate = partial(
                _aggregate_and_evaluate, global_state, server_round, settings, optimizer, model, test, client_level
            )
            replies, (global_state, (loss, accuracy)) = _train_round(
                sampled,
                global_state,
                settings,
                ledger,
                run_id,
                server_round,
                pool,
                participation,
                timings,
                aggregate_and_evaluate,
                say,
            )
            if client_level is not None:
                recorder.federation_round(client_level.epsilon_spent(), client_level.last_clip)
            for client in sampled:
                if client.index in replies:
                    participation.replied(server_round, client.index, client.name, replies[client.index], client.plan)
            # a client without data is asked in the apps and its evaluation fails: here it is not asked
            evaluated = [clients[i] for i in participation.evaluators(indices) if clients[i].local is not None]
            _evaluate_federated(pool, global_state, evaluated, recorder, server_round)
            recorder.evaluated("", accuracy, loss)
            row = recorder.end_round(server_round)
            say(progress_line(row, settings.num_server_rounds))
            if on_round is not None:
                on_round(row)
    finally:
        pool.close()
    finish(recorder, global_state)


def _client(settings: RunSettings, index: int, num_clients: int, ledger_path: Path) -> Client:
    """A client's data and account, or the error its first train message would have raised."""
    try:
        return Client(index, local=simulation_client(settings, index, num_clients, ledger_path))
    except Exception as exc:  # the apps' client would fail alone, with this message
        return Client(index, failure=_reason(exc))


def _train_round(
    sampled: list[Client],
    global_state: dict[str, torch.Tensor],
    settings: RunSettings,
    ledger: Ledger,
    run_id: int,
    server_round: int,
    pool: WorkerPool,
    participation: Participation,
    timings: Timings,
    then: Callable[[list[tuple[Client, int]], TrainedRows], T],
    say: Callable[[str], None],
) -> tuple[dict[int, dict[str, Any]], T]:
    """The round's sampled clients as one cohort (`fedprivacy.cohort`, the ClientApp's round with
    K clients): accounts and plans of those asked for the first time, then the round's spends in
    one ledger transaction that refuses what a budget cannot afford and commits while the clients
    it recorded train, `then(trained clients with their rows, result)` runs (the server's
    aggregation and central evaluation: in memory, nothing leaves the process) and their replies
    are built; the replies and `then`'s result are returned only once the commit is durable, and a
    failed commit ends the run (a run that crashes mid-round has spent for updates nobody used:
    never less). Returns the replies by client index and `then`'s result."""
    started = time.perf_counter()
    _first_sampling(
        [c for c in sampled if c.member is None and c.failure is None],
        settings,
        ledger,
        run_id,
        server_round,
        pool,
        say,
    )
    by_account: dict[str, Client] = {}
    for client in sampled:
        if client.failure is not None:  # an error reply, in the apps
            participation.dropped(server_round, client.index, client.name, "error", client.failure)
        else:
            assert client.member is not None
            by_account[client.member.account] = client

    work: list[_EngineRound] = []

    def train(ready: list[Member]) -> TrainedRows:
        begun = time.perf_counter()
        clients = [by_account[m.account] for m in ready]
        result = pool.train(
            global_state,
            server_round,
            [RoundRequest(c.index, m.trainer_state) for c, m in zip(clients, ready)],
            settings.diagnostics,
        )
        trained_at = time.perf_counter()
        if result.indices != [c.index for c in clients]:  # the pool returns rows in request order
            raise RuntimeError("the workers returned other clients than were asked to train")
        after = then(list(zip(clients, range(len(clients)))), result)
        ended = time.perf_counter()
        work.append(_EngineRound(after, trained_at - begun, ended - begun, ended))
        return result

    members = [c.member for c in by_account.values() if c.member is not None]
    cohort = cohort_round(
        members, ledger, str(run_id), server_round, train, while_recording=True, diagnostics=settings.diagnostics
    )
    (done,) = work  # the cohort trains once per round, even when nobody can: with while_recording, always
    for account, refusal in cohort.refused.items():  # a round already recorded: the apps' client refuses it
        client = by_account[account]
        participation.dropped(server_round, client.index, client.name, "error", _reason(refusal))
    replies = {by_account[account].index: reply for account, reply in cohort.replies.items()}
    timings.add_round(
        time.perf_counter() - started - done.working_s, done.training_s, time.perf_counter() - done.worked_at
    )
    return replies, done.after


def _first_sampling(
    clients: list[Client],
    settings: RunSettings,
    ledger: Ledger,
    run_id: int,
    server_round: int,
    pool: WorkerPool,
    say: Callable[[str], None],
) -> None:
    """Open the accounts and make the plans of clients asked for the first time, in bulk; when
    every client trains in every round, the ε their rounds will reach is composed now, one fold
    per distinct plan, budget and history (`Ledger.compose_ahead`: with clients sampled at random,
    their histories are not their plans' prefixes, and it would be work for nothing)."""
    if not clients:
        return
    say(
        f"planning {len(clients)} client{'s' * (len(clients) != 1)} sampled for the first time"
        + (" and composing the ε of their rounds" if settings.fraction_train >= 1.0 else "")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededRunWarning)
        refusals = open_accounts([c.local for c in clients], settings, ledger, str(run_id))
    opened = [c for c in clients if refusals[c.local.account] is None]
    for client in clients:
        if refusals[client.local.account] is not None:
            client.failure = _reason(refusals[client.local.account])
    plans = run_plans(
        [c.local for c in opened], settings, ledger, str(run_id), compare=False
    )  # the sheets add the comparison
    for client in opened:
        outcome = plans[client.local.account]
        if isinstance(outcome, Exception):
            client.failure = _reason(outcome)
            continue
        client.member = Member(client.local, outcome)
    planned = [c.member for c in opened if c.member is not None]
    pool.add_plans({c.index: c.member.plan for c in opened if c.member is not None})
    if settings.fraction_train >= 1.0:
        ledger.compose_ahead({m.account: m.plan for m in planned}, server_round)


def _reason(error: Exception) -> str:
    return error_summary(f"{type(error).__name__}: {error}")


def _aggregate_and_evaluate(
    global_state: dict[str, torch.Tensor],
    server_round: int,
    settings: RunSettings,
    optimizer: ServerOptimizer | None,
    model: torch.nn.Module,
    test: Any,
    client_level: ClientLevel | None,
    trained: list[tuple[Client, int]],
    results: TrainedRows,
) -> tuple[dict[str, torch.Tensor], tuple[float, float]]:
    """The round's new global model and its central (loss, accuracy)."""
    new_state = _aggregate(
        global_state, trained, results, server_round, settings, optimizer, trained_names(model), client_level
    )
    return new_state, _central_metrics(model, new_state, test)


def _aggregate(
    global_state: dict[str, torch.Tensor],
    trained: list[tuple[Client, int]],
    results: TrainedRows,
    server_round: int,
    settings: RunSettings,
    optimizer: ServerOptimizer | None,
    released: list[str],
    client_level: ClientLevel | None,
) -> dict[str, torch.Tensor]:
    """As the strategy: each update (the `released` entries, the trained parameters) weighted by its
    client's examples or inverse noise variance (weight factors w/Σw in float32, as Flower's
    aggregation), then the server optimiser's step; the previous model if nobody trained or the
    average is not finite. With client-level DP, the federation's noisy mean instead, released
    whether anybody trained or not."""
    step = None if optimizer is None else optimizer.for_round(server_round)
    if client_level is not None:
        rows = torch.tensor([k for _, k in trained], dtype=torch.long)
        parts = results.weights or [None] * len(released)  # no request, no rows
        stacked = {key: _rows_of(global_state[key], part, rows) for key, part in zip(released, parts, strict=True)}
        new = aggregate_client_level(global_state, stacked, client_level, server_round, step)
        return global_state if new is None else new
    if not trained:
        return global_state
    rows = torch.tensor([k for _, k in trained])
    weights = [
        aggregation_weight(settings.aggregation, c.plan, server_round, c.local.data.num_examples) for c, _ in trained
    ]
    new = aggregate(
        global_state,
        {key: stacked[rows] for key, stacked in zip(released, results.weights, strict=True)},
        weights,
        step,
    )
    return global_state if new is None else new  # as the strategy: a mean that is not finite keeps the model


def _rows_of(current: torch.Tensor, stacked: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """The trained members' rows of a released entry ([0, *shape] when nobody trained)."""
    return current[None][:0] if stacked is None or len(rows) == 0 else stacked[rows]


def _evaluate_federated(
    pool: WorkerPool,
    global_state: dict[str, torch.Tensor],
    clients: list[Client],
    recorder: RunRecorder,
    server_round: int,
) -> None:
    """The sampled clients' test metrics, each recorded and weighted by its test rows (as FedAvg
    aggregates them)."""
    if not clients:
        return
    rows = pool.evaluate(global_state, [c.index for c in clients])
    for client, (n, loss_sum, correct) in zip(clients, rows, strict=True):
        recorder.client_evaluated(server_round, client.name, correct / n, loss_sum / n, n)
    total = sum(n for n, _, _ in rows)
    accuracy = sum(n * (correct / n) for n, _, correct in rows) / total
    loss = sum(n * (loss_sum / n) for n, loss_sum, _ in rows) / total
    recorder.evaluated("federated_", accuracy, loss)


def _central_metrics(model: torch.nn.Module, global_state: dict[str, torch.Tensor], test: Any) -> tuple[float, float]:
    """(loss, accuracy) of `global_state` on the server's test set."""
    model.load_state_dict(global_state)
    return evaluate_model(model, test)
