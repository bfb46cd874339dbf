"""One client's side of a federated DP-SGD run, without Flower.

The ClientApp (clients/app.py) is glue around these functions. Per train message a client:
1. knows its data and budget (`simulation_client`: a partition and the run config;
   `deployed_client`: its own file and node config, never the run config);
2. opens its ledger account (`open_account`): the budget is pinned there on first use, and the
   run's policy is checked (no noise seed in a deployment, no seeded run on a reused ledger);
3. gets the run's plan: the one it made on its first round (kept in the ledger, so a restarted
   client resumes the same plan), or a new a-priori plan from its own N, ε, δ;
4. refuses a global model that is not finite and a (run, round) it already trained, then asks
   the ledger whether this round's slice of the plan is affordable;
5. runs the slice with the DP trainer, then records the steps in the ledger before returning
   anything, so no update ever leaves unrecorded.

What a reply may hold (SECURITY.md): public values (N, the budget, the plan, steps, ε spent) and
the noised weights. Raw training statistics are returned only by a simulation with diagnostics on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from types import EllipsisType
from typing import Any

import numpy as np
import torch
from torch import nn

from fedprivacy.data.loaders import load_dataset
from fedprivacy.data.partition import load_client
from fedprivacy.data.registry import find_source, sources
from fedprivacy.data.types import ClientData, Dataset
from fedprivacy.errors import ClientRefusal, InputError, PlanRefused
from fedprivacy.ledger import Budget, BudgetExceeded, DataMismatch, Ledger, RoundRepeated, round_events
from fedprivacy.models import build_model, evaluate_model
from fedprivacy.privacy.plan import Plan
from fedprivacy.privacy.planner import plan_client, with_rule_comparison
from fedprivacy.privacy.rules import find_rule
from fedprivacy.runconfig import DEFAULTS, NodeSettings, RunSettings, default_ledger_path
from fedprivacy.runconfig_keys import RUN_KEYS
from fedprivacy.training.capture import trained_names
from fedprivacy.training.trainer import DPTrainer, check_finite

logger = logging.getLogger(__name__)

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
DIAGNOSTIC_KEYS = ("train-loss", "clip-fraction", "nonfinite-examples")  # simulations with diagnostics only


@dataclass(frozen=True)
class LocalClient:
    """Who a client is, what it holds and what it may spend."""

    client_id: str
    account: str  # the ledger key: a deployed node's declared client-id, or a simulated data set's partition
    data: ClientData
    epsilon: float
    delta: float
    epochs: float | None  # its epochs k (a simulated client's entry of client-epochs); None: the planner's
    ledger_path: Path
    deployed: bool = False
    dataset_id: str = ""  # simulations: the data set's identity, whose partitioning the ledger pins
    partitioning: dict[str, Any] | None = None
    data_digest: str = ""  # deployments: the data file's digest, pinned beside the account in the ledger
    public_size: int | None = None  # deployments: the size the node declares public (node config)

    @property
    def planning_size(self) -> int:
        """The N a plan is made from and a reply carries: a deployed node's declared public size
        (never its real N, which would tell neighbours apart), a simulated partition's size."""
        return self.public_size if self.public_size is not None else self.data.num_examples


_FIELDS = {key.name: key.field for key in RUN_KEYS}


def _run_value(settings: RunSettings, key: str) -> Any:
    """The parsed value of run-config key `key` (e.g. `num-classes`)."""
    return getattr(settings, _FIELDS[key])


def _asked_for(settings: RunSettings, key: str) -> bool:
    """Whether the run config sets `key` away from its default (unset '' , () and None included)."""
    return _run_value(settings, key) not in (DEFAULTS[key], (), None)


def _data_options(settings: RunSettings) -> dict[str, Any]:
    """The loader options the run config sets for its source (fedprivacy/data/registry.py maps each
    option to its key); a key left unset ('', () or None) keeps the loader's own default."""
    values = {option: _run_value(settings, key) for option, key in find_source(settings.dataset).run_keys.items()}
    return {option: value for option, value in values.items() if value not in ("", None, ())}


def unused_data_keys(settings: RunSettings) -> str | None:
    """The loader keys the run config sets (away from their defaults) that its data set does not
    read, e.g. num-classes for digits, which fixes its own 10, as one line to say at the start of
    a simulation (None when there are none), so that a setting that changes nothing is noticed."""
    read_somewhere = {key for source in sources().values() for key in source.run_keys.values()}
    read_here = set(find_source(settings.dataset).run_keys.values())
    unused = [
        f"{key}={_run_value(settings, key)}" for key in sorted(read_somewhere - read_here) if _asked_for(settings, key)
    ]
    return f"run config {' '.join(unused)} ignored: dataset {settings.dataset} does not read it" if unused else None


def _scheme(settings: RunSettings) -> tuple[str, str | None]:
    """(partition scheme, client column): `auto` is natural when partition-by names a column."""
    by = settings.partition_by or None
    if settings.partitioning == "auto":
        return ("natural" if by else "iid"), by
    return settings.partitioning, by


def partition_kwargs(settings: RunSettings, num_clients: int) -> dict[str, Any]:
    """`load_clients`/`load_client`'s arguments: the one recipe the simulated clients, the server's
    central set and the fast engine all build their rows from, so they agree on every row.

    `seed` is the data seed (`split-seed`, or `seed`). `validation_fraction` is present only under
    evaluate-on='validation' (the clients are then (fit, validation) rows): without it the
    arguments, and so the partitioning a ledger pins, are those of runs made before it existed."""
    scheme, by = _scheme(settings)
    validation = {"validation_fraction": settings.validation_fraction} if settings.evaluate_on == "validation" else {}
    return dict(
        name=settings.dataset,
        path=settings.data_path,
        scheme=scheme,
        num_partitions=num_clients,
        seed=settings.data_seed,
        by=by,
        alpha=settings.dirichlet_alpha,
        skew=settings.size_skew,
        test_fraction=settings.test_fraction,
        **validation,
        **_data_options(settings),
    )


def data_file_missing(settings: RunSettings) -> bool:
    """A data set read from data-path (a file or a folder) whose data-path is not one on this machine."""
    return not find_source(settings.dataset).path_present(settings.data_path)


def require_data_file(settings: RunSettings) -> None:
    """Refuse a simulation whose data file (or folder) is not on this machine: each simulated client
    checks before it reads, and the simulators before anything runs."""
    if data_file_missing(settings):
        raise InputError(
            "data-path",
            "" if settings.data_path is None else str(settings.data_path),
            f"dataset {settings.dataset!r} needs {find_source(settings.dataset).path_help}: in a simulation "
            "every client reads the run config's data-path (an absolute path on this machine)",
        )


_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(path: Path) -> str:
    """The first 16 hex digits of the file's SHA-256 (cached per path, size and mtime)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()[:16]
    return _DIGESTS[key]


def folder_digest(path: Path) -> str:
    """The first 16 hex digits of a SHA-256 over a folder's files: each one's path inside it and digest."""
    files = sorted(f for f in path.rglob("*") if f.is_file())
    listing = "\n".join(f"{f.relative_to(path).as_posix()} {file_digest(f)}" for f in files)
    return hashlib.sha256(listing.encode()).hexdigest()[:16]


def dataset_identity(settings: RunSettings) -> str:
    """What the records are: a file's or a folder's content, or a built-in data set's arrays."""
    if find_source(settings.dataset).reads is not None and settings.data_path is not None:
        if settings.data_path.is_dir():
            return f"folder:{folder_digest(settings.data_path)}"
        return f"file:{file_digest(settings.data_path)}"
    return f"{settings.dataset}:{_arrays_digest(load_dataset(settings.dataset, None, **_data_options(settings)))}"


@functools.lru_cache(maxsize=16)
def _arrays_digest(dataset: Dataset) -> str:
    """Hashed once per loaded data set (loaded data sets are cached and never change)."""
    return hashlib.sha256(dataset.features.tobytes() + dataset.labels.tobytes()).hexdigest()[:16]


def simulated_account(dataset_id: str, client_id: str) -> str:
    """A simulated client's ledger account: its data set's identity and its partition."""
    return f"{dataset_id}/{client_id}"


# Loader options that change how a row is encoded or checked (num_classes: the labels' range;
# features: which cells are read), not which rows a client holds or trains on.
_ENCODING_ONLY = ("age", "image_column", "num_classes", "features")


def partitioning_of(settings: RunSettings, num_clients: int) -> dict[str, Any]:
    """Everything that decides which rows each simulated client holds, and which it trains on
    (not how a row is encoded: the same records under another encoding are the same accounts)."""
    options = partition_kwargs(settings, num_clients)
    for key in ("path", *_ENCODING_ONLY):
        options.pop(key, None)
    return options


def simulation_client(settings: RunSettings, partition_id: int, num_partitions: int, ledger_path: Path) -> LocalClient:
    """A simulated client: partition `partition_id` of the run's data set, budget from the run config.

    Its account is the data set's identity plus its partition; the ledger pins the partitioning
    per data set (see `open_account`), so an account always names the same rows.
    """
    require_data_file(settings)
    data = load_client(partition_id, **partition_kwargs(settings, num_partitions))
    dataset_id = dataset_identity(settings)
    return LocalClient(
        client_id=data.client_id,
        account=simulated_account(dataset_id, data.client_id),
        data=data,
        epsilon=settings.client_epsilon(partition_id, num_partitions),
        delta=settings.client_delta(partition_id, num_partitions),
        epochs=settings.client_epochs_for(partition_id, num_partitions),
        ledger_path=ledger_path,
        dataset_id=dataset_id,
        partitioning=partitioning_of(settings, num_partitions),
    )


def deployed_client(settings: RunSettings, node: NodeSettings) -> LocalClient:
    """A deployed client: every row of its own file, read as its node config says; budget from
    the node config.

    The run config is untrusted: its ε and δ are ignored (with a warning when they differ), and so
    is everything about how records are read (data set kind, label and feature columns, classes:
    the node config's). The client trains on all of its rows: it never evaluates, so it holds
    none out, and two files that differ in one record give training sets that differ in that
    record only. Its ledger account is its declared `client-id`; the ledger records the file's
    digest beside it and refuses a changed file under the same account (`open_accounts`).
    """
    if not node.data_path.is_file():
        raise InputError("data-path", str(node.data_path), "no such file on this SuperNode")
    for key, run_value, node_value in (
        ("epsilon", settings.epsilon, node.epsilon),
        ("delta", settings.delta, node.delta),
        ("dataset", settings.dataset, node.dataset),
        ("pums-age", settings.pums_age, node.pums_age),
    ):
        if run_value != node_value:
            shown = [f"{v:g}" if isinstance(v, float) else v for v in (run_value, node_value)]
            logger.warning(
                "run config %s=%s ignored: a deployed client's %s is its node config's (%s)",
                key,
                shown[0],
                key,
                shown[1],
            )
    _warn_about_ignored_keys(settings)
    if node.dataset == "pums":
        options: dict[str, Any] = {"client_column": None, "age": node.pums_age, "per_row": True}
    else:
        options = {
            "label": node.label_column,
            "features": list(node.feature_columns or ()),
            "num_classes": node.num_classes,
            "per_row": True,
        }
    dataset = load_dataset(node.dataset, node.data_path, **options)  # a bad row is dropped alone, never a failure
    rows = ClientData(
        client_id=node.client_id,
        train=dataset.subset(np.arange(len(dataset))),
        test=dataset.subset(np.arange(0)),
    )
    _warn_locally_about_the_real_size(node, len(dataset))
    return LocalClient(
        client_id=node.client_id,
        account=deployed_account(node.client_id),
        data=rows,
        epsilon=node.epsilon,
        delta=node.delta,
        epochs=settings.epochs,
        ledger_path=node.ledger_path or default_ledger_path(),
        deployed=True,
        data_digest=file_digest(node.data_path),
        public_size=node.public_size,
    )


_IGNORED_WHEN_DEPLOYED = {
    "a deployed client trains on every row of its file": ("evaluate-on", "validation-fraction", "split-seed"),
    "a deployed client reads its file as its node config says": ("label-column", "feature-columns", "num-classes"),
}


def _warn_about_ignored_keys(settings: RunSettings) -> None:
    """A run config's split and column keys are for simulated clients: a deployed one trains on
    every row of its file, read as its node config says, whatever they say (the run config is
    untrusted; rows held out or columns read at its word would let the server decide which
    records are trained on, or turn one record into a failure), so they are only logged as ignored."""
    for reason, keys in _IGNORED_WHEN_DEPLOYED.items():
        asked = {key: _run_value(settings, key) for key in keys if _asked_for(settings, key)}
        if asked:
            shown = " ".join(f"{key}={value}" for key, value in asked.items())
            logger.warning("run config %s ignored: %s", shown, reason)


def _warn_locally_about_the_real_size(node: NodeSettings, rows: int) -> None:
    """Advice for the operator, in the SuperNode's log only: nothing about the real row count may
    reach the server (a refusal would tell neighbours apart by N), so none of this refuses."""
    if node.delta * rows >= 1.0:
        logger.warning(
            "client %s: delta=%g is not below 1/N for the %d rows of its file: a delta that large allows "
            "releasing a record outright; choose a smaller delta",
            node.client_id,
            node.delta,
            rows,
        )
    if not 0.5 <= rows / node.public_size <= 2.0:
        logger.warning(
            "client %s: its file holds %d rows, its public-size is %d: its updates are scaled by "
            "q·public-size, so a size far from the real one slows or destabilises training",
            node.client_id,
            rows,
            node.public_size,
        )


def deployed_account(client_id: str) -> str:
    """A deployed client's ledger account: the name its operator declares in the node config."""
    return f"node:{client_id}"


def open_account(client: LocalClient, settings: RunSettings, ledger: Ledger, run_id: str) -> None:
    """Pin or check the client's budget in its ledger, and refuse runs that could reuse noise.

    - A deployed client refuses a noise seed and raw diagnostics (the run config is untrusted).
    - A simulation's partitioning is pinned per data set (accounts follow records).
    - A seeded simulation refuses a ledger account that other runs spent from: the same seed
      would draw the same noise again, and the difference of two releases would cancel it.
    """
    refusal = open_accounts([client], settings, ledger, run_id)[client.account]
    if refusal is not None:
        raise refusal


def open_accounts(
    clients: list[LocalClient], settings: RunSettings, ledger: Ledger, run_id: str
) -> dict[str, ClientRefusal | None]:
    """`open_account` for many clients of one ledger at once (a batched engine's round): each
    account gets its refusal, or None."""
    refusals: dict[str, ClientRefusal | None] = {c.account: _policy_refusal(c, settings) for c in clients}
    for client in clients:
        if refusals[client.account] is None and client.data_digest:  # before the budget: it may adopt an old account
            try:
                ledger.pin_data(client.account, client.data_digest, legacy_account=f"data:{client.data_digest}")
            except DataMismatch as mismatch:  # what changed is a function of the records: it stays here
                logger.warning("client %s: %s", client.client_id, mismatch)
                refusals[client.account] = ClientRefusal(
                    f"client {client.client_id}: its ledger refused its data file for account {client.account}; "
                    "the reason and the operator's remedy are in the SuperNode's log"
                )
    opening = [c for c in clients if refusals[c.account] is None]
    pinned = ledger.open_accounts({c.account: Budget(c.epsilon, c.delta) for c in opening})
    for client in opening:
        if isinstance(pinned[client.account], ClientRefusal):
            refusals[client.account] = pinned[client.account]
    for dataset_id, partitioning in {
        (c.dataset_id, json.dumps(c.partitioning, sort_keys=True)) for c in opening if c.partitioning
    }:
        try:
            ledger.pin_partitioning(dataset_id, json.loads(partitioning))
        except ClientRefusal as refusal:
            for client in opening:
                if client.dataset_id == dataset_id:
                    refusals[client.account] = refusal
    if settings.noise_seed >= 0:
        runs = ledger.runs_of([c.account for c in opening])
        for client in opening:
            if refusals[client.account] is None and runs.get(client.account, set()) - {run_id}:
                refusals[client.account] = ClientRefusal(
                    f"noise-seed={settings.noise_seed} on ledger {client.ledger_path}, where client {client.client_id} "
                    "already spent in another run: a fixed seed would repeat that run's noise. Use a fresh ledger-path "
                    "or noise-seed=-1"
                )
    return refusals


def _policy_refusal(client: LocalClient, settings: RunSettings) -> ClientRefusal | None:
    if client.deployed and settings.noise_seed >= 0:
        return ClientRefusal(
            f"noise-seed={settings.noise_seed}: a deployed client draws its noise from OS entropy "
            "and never accepts a seed (seeds are for simulations)"
        )
    if client.deployed and settings.client_epochs:
        return ClientRefusal(
            f"client-epochs={','.join(f'{k:g}' for k in settings.client_epochs)}: a deployed client has no "
            "place in a list of simulated clients; give every client the same epochs instead"
        )
    if client.deployed and settings.diagnostics:
        return ClientRefusal(
            "diagnostics=true: raw training statistics are not private; a deployed client never returns them"
        )
    return None


def device() -> torch.device:
    """GPU when one is visible (Ray hides GPUs unless client-resources-num-gpus > 0), else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def new_model(settings: RunSettings, features: np.ndarray, num_classes: int) -> nn.Module:
    return build_model(settings.model, features.shape[1:], num_classes)  # one example's shape: (d,) or (C, H, W)


def released_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a client sends of its trained model: the trained parameters, which went through
    clipping and noise, and nothing else (no buffer, no frozen parameter), in the trainer's order."""
    state = model.state_dict()
    return {name: state[name].detach().cpu() for name in trained_names(model)}


def plan_from_settings(
    settings: RunSettings,
    num_examples: int,
    epsilon: float,
    delta: float,
    client_id: str,
    *,
    epochs: float | None | EllipsisType = ...,
    compare: bool = True,
) -> Plan:
    """The plan a client makes from the run config: one place, so the ClientApp, the engines and
    the baselines agree. Clients with the same inputs share one planning (and certification).

    `compare=False` leaves out the rule comparison (sheet content, about 0.25 s per distinct
    plan): the ClientApp computes it for its own plan, so that a deployment's clients share the
    work; one process simulating them all (the fast engine) or training without noise (the
    baselines) leaves it to the sheets. `epochs`: the client's own k, like `epsilon` and `delta`
    (`RunSettings.client_epochs_for`); omitted, the run config's `epochs`."""
    inputs = (
        num_examples,
        epsilon,
        delta,
        settings.rule,
        settings.clip_norm,
        settings.epochs if epochs is ... else epochs,
        settings.num_server_rounds,
        settings.learning_rate,
        settings.lr_schedule or None,
        (settings.lr_offset, settings.lr_decay),
    )
    try:
        return replace((_shared_compared_plan if compare else _shared_plan)(*inputs), client_id=client_id)
    except PlanRefused:
        return _plan(*inputs, client_id=client_id)  # raises again, naming this client


def _plan(
    n: int,
    epsilon: float,
    delta: float,
    rule: str,
    clip_norm: float,
    epochs: float | None,
    rounds: int,
    learning_rate: float,
    lr_schedule: str | None,
    inverse_sqrt: tuple[float, float],
    client_id: str = "",
) -> Plan:
    """`inverse_sqrt` = (a, c) of η_t = η/sqrt(a + c·t), used when the schedule is inverse_sqrt.
    Without the rule comparison (`plan_from_settings` adds it)."""
    schedule = lr_schedule or find_rule(rule).default_schedules(None)[0]
    lr_params = {"a": inverse_sqrt[0], "c": inverse_sqrt[1]} if schedule == "inverse_sqrt" else None
    return plan_client(
        n,
        epsilon,
        delta,
        rule=rule,
        clip_norm=clip_norm,
        epochs=epochs,
        rounds=rounds,
        client_id=client_id,
        learning_rate=learning_rate,
        lr_schedule=lr_schedule,
        lr_params=lr_params,
        compare=False,
    )


_shared_plan = functools.lru_cache(maxsize=4096)(_plan)


@functools.lru_cache(maxsize=4096)
def _shared_compared_plan(*inputs: Any) -> Plan:
    return with_rule_comparison(_shared_plan(*inputs))


def run_plan(client: LocalClient, settings: RunSettings, ledger: Ledger, run_id: str) -> tuple[Plan, bool]:
    """(the client's plan for this run, whether it was made now). Made once, a priori, then kept."""
    saved = ledger.load_plan(client.account, run_id)
    if saved is not None:
        return saved, False
    outcome = run_plans([client], settings, ledger, run_id)[client.account]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome, True


def run_plans(
    clients: list[LocalClient], settings: RunSettings, ledger: Ledger, run_id: str, *, compare: bool = True
) -> dict[str, Plan | Exception]:
    """Each client's plan for this run: the one saved in the ledger, or a new a-priori plan saved
    now (all in one transaction); a client that cannot plan gets its error instead. `compare`: as
    in `plan_from_settings`."""
    outcomes: dict[str, Plan | Exception] = dict(ledger.load_plans([c.account for c in clients], run_id))
    fresh: dict[str, Plan] = {}
    for client in clients:
        if client.account in outcomes:
            continue
        try:
            fresh[client.account] = _new_plan(client, settings, compare)
        except (ClientRefusal, InputError, PlanRefused) as error:
            outcomes[client.account] = error
    if fresh:  # if a restarted twin saved its plan first, both follow that one
        outcomes.update(ledger.save_plans(run_id, fresh))
    return outcomes


def _new_plan(client: LocalClient, settings: RunSettings, compare: bool) -> Plan:
    """A new plan. A deployed client's planning inputs are public (its declared size, its budget,
    the run config), so the planner's refusal leaves it with its text, as a `ClientRefusal`."""
    try:
        plan = plan_from_settings(
            settings,
            client.planning_size,
            client.epsilon,
            client.delta,
            client.client_id,
            epochs=client.epochs,
            compare=compare,
        )
    except InputError as error:
        if not client.deployed:
            raise
        raise ClientRefusal(f"client {client.client_id}: {error}") from None
    if plan.expected_batch_size < 1:
        raise ClientRefusal(
            f"num-examples={client.planning_size}: too little data for client {client.client_id}: its plan "
            f"samples q·N = {plan.expected_batch_size:.2f} < 1 record per step, so most steps would train on nothing"
        )
    return plan


def client_noise_seed(settings: RunSettings, account: str) -> str | None:
    """A simulated client's seed material (clients never share noise); None = OS entropy every step."""
    if settings.noise_seed < 0:
        return None
    return f"{settings.noise_seed}:{account}"


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
    """Run round `server_round`'s slice of `plan` if the budget affords it; record it first."""
    check_finite(global_state)  # before any record is touched
    if ledger.trained(client.account, run_id, server_round):
        raise RoundRepeated(f"round {server_round} of run {run_id} was already trained by client {client.client_id}")
    events = round_events(plan, server_round)
    affordable = bool(events) and ledger.epsilon_if(client.account, events) <= client.epsilon
    if not affordable:
        return RoundResult(None, _exhausted(client, plan, ledger), trainer_state)

    dev = device()
    model = new_model(settings, client.data.train.features, client.data.train.num_classes).to(dev)
    model.load_state_dict(global_state)
    trainer = DPTrainer(
        model,
        plan,
        client.data.train.features,
        client.data.train.labels,
        seed=client_noise_seed(settings, client.account),
        state={**(trainer_state or {}), "step": plan.first_step_of_round(server_round)},
    )
    report = trainer.run_round(server_round)
    if report.steps != sum(e.count for e in events):
        raise RuntimeError(f"trainer ran {report.steps} steps, the plan's round has {sum(e.count for e in events)}")
    if report.nonfinite_examples:  # local only: it counts records
        logger.warning(
            "client %s, round %d: %d sampled examples had a non-finite gradient and contributed zero",
            client.client_id,
            server_round,
            report.nonfinite_examples,
        )
    try:
        spent, steps = ledger.record_with_steps(client.account, run_id, server_round, events)
    except BudgetExceeded:  # another writer spent the budget meanwhile: this update must not leave
        return RoundResult(None, _exhausted(client, plan, ledger), trainer_state)
    metrics = reply_metrics(client, plan, spent, steps, trained=True, on_gpu=dev.type == "cuda")
    if settings.diagnostics:  # simulations only (open_account refuses it in a deployment)
        metrics.update(diagnostics(report.mean_loss, report.clip_fraction, report.nonfinite_examples))
    return RoundResult(released_state(model), metrics, trainer.state_dict())


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


def _exhausted(client: LocalClient, plan: Plan, ledger: Ledger) -> dict[str, int | float]:
    return reply_metrics(
        client, plan, ledger.epsilon_spent(client.account), ledger.steps_spent(client.account), trained=False
    )


def _finite(value: float) -> float:
    return float(value) if math.isfinite(value) else 0.0


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
    model.load_state_dict(global_state)
    loss, accuracy = evaluate_model(model, test)
    return {"num-examples": len(test), "loss": loss, "accuracy": accuracy, "evaluation-off": 0}
