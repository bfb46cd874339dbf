"""The run configuration of the Flower apps, validated where it enters.

Each run-config key is declared once, in fedprivacy/runconfig_keys.py (`RUN_KEYS`: default,
check, help); `DEFAULTS`, `RunSettings` and `parse_run_config` follow it (a test keeps the fields
equal to the keys). `[tool.flwr.app.config]` in pyproject.toml repeats the defaults (a test keeps
the two equal) because Flower only accepts `--run-config` overrides for keys declared there, and
`run_simulation` hands the apps an empty run config.

Paths. Flower runs the apps from its own installed copy of the project, in a working directory
of its choosing, so a relative path would silently point somewhere else. Every path here is
therefore resolved one way: `~` and `$VARS` are expanded, and the result must be absolute;
a relative path is refused with a message that says why.

Trust. The run config comes from whoever submits the run: in a deployment it is untrusted, like
every server message. A deployed SuperNode's budget, data and split come from its own
`--node-config "client-id=… data-path=… epsilon=… delta=…"` (validated by `NodeSettings`); in a
simulation the node config only holds `partition-id` and `num-partitions`, and budgets come from
the run config of the researcher who runs it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedprivacy.catalog import FILE_DATASETS
from fedprivacy.data.arrays import declared_classes
from fedprivacy.data.loaders import PUMS_AGE_ENCODINGS
from fedprivacy.errors import InputError, did_you_mean, open_unit
from fedprivacy.privacy import limits
from fedprivacy.privacy.rules import find_rule
from fedprivacy.runconfig_keys import DEFAULTS, FEDERATION_KEYS, RUN_KEYS, choice, column_names, resolve_path


def one_per_client(field: str, values: tuple[float, ...], num_clients: int) -> tuple[float, ...]:
    """`values` when they are exactly one per client; an error naming both counts otherwise."""
    if len(values) != num_clients:
        raise InputError(
            field,
            ",".join(f"{v:g}" for v in values),
            f"needs one value per client: {num_clients} clients, {len(values)} values",
        )
    return values


@dataclass(frozen=True)
class RunSettings:
    """The validated run config: one field per declaration of `RUN_KEYS`, in its order (key `a-b`
    becomes field `a_b`; each key's meaning is its declaration's help, rendered in docs/flower.md).
    Fields hold what the key's check returns: paths resolved, per-client lists as tuples,
    `epochs=0` as None (the planner chooses k)."""

    # data
    dataset: str
    data_path: Path | None
    synthetic_examples: int
    synthetic_features: int
    pums_age: str
    label_column: str
    feature_columns: tuple[str, ...]  # (): every other column of the header
    image_column: str
    data_split: str
    num_classes: int | None  # None: unset (0 in the run config)
    partitioning: str
    partition_by: str
    dirichlet_alpha: float
    size_skew: str
    test_fraction: float
    evaluate_on: str  # 'test', or 'validation': rows cut from each client's training rows (tuning)
    validation_fraction: float
    # model and training
    model: str
    model_options: tuple[tuple[str, bool | int | float | str], ...]  # keyword arguments for its factory
    clip_norm: float
    learning_rate: float
    lr_schedule: str  # '' = the rule's default (constant; inverse_sqrt for adp)
    lr_offset: float
    lr_decay: float
    epochs: float | None
    client_epochs: tuple[float, ...]
    # privacy
    epsilon: float
    epsilons: tuple[float, ...]
    delta: float
    deltas: tuple[float, ...]
    rule: str
    # federation (client-level DP)
    federation_epsilon: float  # 0: off
    federation_delta: float  # 0: 1/M^1.1
    federation_cohort: float | None  # None: the planner chooses
    update_clip: float
    update_clip_quantile: float  # 0: fixed
    update_clip_rate: float
    clip_count_noise: float  # 0: pM/20
    federation_ledger: Path | None  # None: in the run's folder
    federation_rule: str
    # rounds and aggregation
    num_server_rounds: int
    fraction_train: float
    fraction_evaluate: float
    min_clients: int
    round_timeout: float
    aggregation: str
    server_optimizer: str
    server_learning_rate: float
    server_momentum: float
    server_tau: float
    # randomness
    seed: int
    split_seed: int  # -1: `seed`
    noise_seed: int
    # output
    results_dir: Path
    ledger_path: Path | None
    diagnostics: bool

    @property
    def client_level(self) -> bool:
        """Whether the run adds client-level DP on the server (`federation-epsilon` > 0)."""
        return self.federation_epsilon > 0

    @property
    def data_seed(self) -> int:
        """The seed of the partitions and the clients' splits: `split-seed`, or `seed` when it is -1."""
        return self.seed if self.split_seed == -1 else self.split_seed

    def client_epsilon(self, index: int, num_clients: int) -> float:
        """Client `index`'s ε: its entry of `epsilons` when given, else the common `epsilon`."""
        return _client_value("epsilons", self.epsilons, self.epsilon, index, num_clients)

    def client_delta(self, index: int, num_clients: int) -> float:
        """Client `index`'s δ: its entry of `deltas` when given, else the common `delta`."""
        return _client_value("deltas", self.deltas, self.delta, index, num_clients)

    def client_epochs_for(self, index: int, num_clients: int) -> float | None:
        """Client `index`'s epochs k: its entry of `client-epochs` when given, else the common
        `epochs` (None: the planner chooses)."""
        if not self.client_epochs:
            return self.epochs
        return one_per_client("client-epochs", self.client_epochs, num_clients)[index]

    def check_clients(self, num_clients: int, field: str = "clients") -> None:
        """A simulation's `num_clients` against the per-client lists (`epsilons`, `deltas`,
        `client-epochs`) and min-clients: refused before it starts, not client by client once it
        runs (`field` names where the number came from)."""
        for index in range(num_clients):
            self.client_epsilon(index, num_clients)
            self.client_delta(index, num_clients)
            self.client_epochs_for(index, num_clients)
        if self.federation_cohort is not None and self.federation_cohort > num_clients:
            raise InputError(
                "federation-cohort",
                self.federation_cohort,
                f"the expected cohort pM must be at most the {num_clients} members ({field})",
            )
        if num_clients < self.min_clients:
            raise InputError(
                field,
                num_clients,
                f"must be at least min-clients={self.min_clients}: the server waits for that many before a round",
            )


def _client_value(field: str, values: tuple[float, ...], common: float, index: int, num_clients: int) -> float:
    """Client `index`'s entry of a per-client list (`epsilons`, `deltas`), or the common value."""
    if not values:
        return common
    return one_per_client(field, values, num_clients)[index]


def first_difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """The first key (sorted) whose value differs between two run configs, or None when they agree.

    A key missing from one side counts as its default: a results folder written before a key was
    added ran with that key's default, so resuming it must not be refused for the new key alone."""
    for key in sorted({*old, *new}):
        if old.get(key, DEFAULTS.get(key)) != new.get(key, DEFAULTS.get(key)):
            return key
    return None


def parse_run_config(run_config: Mapping[str, Any]) -> RunSettings:
    """Validate a Flower run config (missing keys take `DEFAULTS`; unknown keys are refused): each
    key by its own check, then the checks that involve several keys."""
    unknown = sorted(set(run_config) - set(DEFAULTS))
    if unknown:
        raise InputError(
            unknown[0],
            run_config[unknown[0]],
            f"not a run-config key{did_you_mean(unknown[0], DEFAULTS)}; known keys: {', '.join(DEFAULTS)}",
        )
    rc = {**DEFAULTS, **run_config}
    settings = RunSettings(**{key.field: key.parse(key.name, rc[key.name]) for key in RUN_KEYS})
    _check_across_keys(settings)
    return settings


def _check_across_keys(settings: RunSettings) -> None:
    """The checks no single key can make: lr-offset and lr-decay shape only the inverse_sqrt
    schedule, so a value other than their default under another schedule is refused rather than
    run a schedule the user did not ask for (a default value cannot be told from an unset one:
    Flower hands the apps every key of pyproject.toml); so is a validation-fraction other than its
    default without evaluate-on='validation'. A non-zero `epochs` beside `client-epochs`
    is refused: the list sets every client's k, so the common value would label a run none of its
    clients ran (0, the default, is "unset": the planner would choose)."""
    if settings.client_epochs and settings.epochs is not None:
        raise InputError(
            "epochs",
            settings.epochs,
            "client-epochs is also given and sets every client's epochs, so this would be ignored: "
            "give one or the other (epochs = 0 with client-epochs)",
        )
    if settings.evaluate_on != "validation" and settings.validation_fraction != DEFAULTS["validation-fraction"]:
        raise InputError(
            "validation-fraction",
            settings.validation_fraction,
            f"sizes only evaluate-on='validation'; this run's evaluate-on is {settings.evaluate_on!r}",
        )
    _check_federation_keys(settings)
    schedule = settings.lr_schedule or find_rule(settings.rule).default_schedules(None)[0]
    for key, value in (("lr-offset", settings.lr_offset), ("lr-decay", settings.lr_decay)):
        if schedule != "inverse_sqrt" and value != DEFAULTS[key]:
            raise InputError(key, value, f"shapes only lr-schedule='inverse_sqrt'; this run's schedule is {schedule!r}")


ADAPTIVE_CLIP_KEYS = ("update-clip-rate", "clip-count-noise")


def _check_federation_keys(settings: RunSettings) -> None:
    """Without client-level DP the federation's other keys would be ignored: refused unless at
    their default. With it, the server's Poisson sampling at the plan's rate takes the place of
    `fraction-train`, and the noisy sum divided by the expected cohort that of the weighted mean,
    so a `fraction-train` or an `aggregation` other than the default is refused."""
    if not settings.client_level:
        for key in (k for k in RUN_KEYS if k.name in FEDERATION_KEYS):
            value = getattr(settings, key.field)
            if value != key.parse(key.name, key.default):
                raise InputError(
                    key.name,
                    value,
                    "shapes client-level DP only: set federation-epsilon > 0, or leave it at its default",
                )
        return
    if not settings.update_clip_quantile:
        for key in ADAPTIVE_CLIP_KEYS:
            value = getattr(settings, key.replace("-", "_"))
            if value != DEFAULTS[key]:
                raise InputError(
                    key, value, "shapes adaptive clipping only: set update-clip-quantile, or leave it at its default"
                )
    if settings.fraction_train != DEFAULTS["fraction-train"]:
        raise InputError(
            "fraction-train",
            settings.fraction_train,
            "with federation-epsilon the server samples each member at the federation plan's rate "
            "(federation-cohort sets the expected cohort): leave fraction-train at 1",
        )
    if settings.aggregation != DEFAULTS["aggregation"]:
        raise InputError(
            "aggregation",
            settings.aggregation,
            "with federation-epsilon the clipped updates are summed, noised and divided by the expected "
            "cohort: no other weighting keeps the federation's sensitivity; leave aggregation at 'examples'",
        )


@dataclass(frozen=True)
class NodeSettings:
    """A deployed SuperNode's own identity, data, budget and how it reads its records (from
    `--node-config`): the values a client trusts. The run config cannot change any of them.

    Everything that decides which rows and columns a client trains on is here, not in the run
    config: a run config that named the label column (or picked feature columns by their content)
    could make one record fail the client, a free membership oracle. A deployed client trains on
    every row of its file (it never evaluates), so a record's membership depends on that record
    alone."""

    client_id: str
    data_path: Path
    epsilon: float
    delta: float
    public_size: int
    ledger_path: Path | None
    dataset: str
    label_column: str | None
    feature_columns: tuple[str, ...] | None
    num_classes: int | None
    pums_age: str = "linear"


NODE_KEYS = (
    "client-id",
    "data-path",
    "epsilon",
    "delta",
    "public-size",
    "ledger-path",
    "dataset",
    "label-column",
    "feature-columns",
    "num-classes",
    "pums-age",
)
SPLIT_KEYS = ("test-fraction", "evaluate-on", "validation-fraction", "split-seed")  # simulations only
NODE_REQUIRED = ("client-id", "data-path", "epsilon", "delta", "public-size")
_NO_SPLIT = (
    "a deployed client trains on every row of its file and never evaluates: a held-out split would make "
    "which rows it trains on depend on the whole file; remove it"
)


def parse_node_config(node_config: Mapping[str, Any]) -> NodeSettings | None:
    """`NodeSettings` for a deployed SuperNode; None in a simulation (partition-id is set)."""
    if "partition-id" in node_config:
        return None
    for key in SPLIT_KEYS:
        if key in node_config:
            raise InputError(key, node_config[key], _NO_SPLIT)
    unknown = sorted(set(node_config) - set(NODE_KEYS))
    if unknown:
        raise InputError(
            unknown[0], node_config[unknown[0]], f"not a node-config key; known keys: {', '.join(NODE_KEYS)}"
        )
    missing = [k for k in NODE_REQUIRED if k not in node_config]
    if missing:
        raise InputError(
            missing[0],
            None,
            f"missing from the node config ({', '.join(missing)} not given): a deployed SuperNode needs "
            "--node-config \"client-id='…' data-path='/abs/file.csv' epsilon=1 delta=1e-5"
            ' public-size=5000" (its own budget, and the size it declares public: the run config cannot set it;'
            " its plan is made from that size and only that size is sent; ledger-path, dataset, label-column,"
            " feature-columns and num-classes optional)",
        )
    client_id = node_config["client-id"]
    if not isinstance(client_id, str) or not client_id.strip():
        raise InputError("client-id", client_id, "must be a non-empty string")
    data_path = resolve_path("data-path", node_config["data-path"])
    if data_path is None:
        raise InputError("data-path", node_config["data-path"], "must name the client's data file")
    dataset = choice("dataset", node_config.get("dataset", "pums"), FILE_DATASETS)
    label, features, num_classes = _node_columns(node_config, dataset)
    return NodeSettings(
        client_id=client_id.strip(),
        data_path=data_path,
        epsilon=limits.epsilon("epsilon", node_config["epsilon"]),
        delta=open_unit("delta", node_config["delta"]),
        public_size=limits.records("public-size", node_config["public-size"]),
        ledger_path=resolve_path("ledger-path", node_config.get("ledger-path", "")),
        dataset=dataset,
        label_column=label,
        feature_columns=features,
        num_classes=num_classes,
        pums_age=choice("pums-age", node_config.get("pums-age", "linear"), PUMS_AGE_ENCODINGS),
    )


def _node_columns(
    node_config: Mapping[str, Any], dataset: str
) -> tuple[str | None, tuple[str, ...] | None, int | None]:
    """(label column, feature columns, number of classes) of a node's file: a csv node names all
    three (nothing is inferred from its records); the pums layout fixes its own columns."""
    num_classes = node_config.get("num-classes")
    num_classes = None if num_classes is None else declared_classes("num-classes", num_classes)
    if dataset == "pums":
        for key in ("label-column", "feature-columns", "num-classes"):
            if key in node_config:
                raise InputError(
                    key,
                    node_config[key],
                    "the pums layout fixes its columns and classes; this key is for dataset='csv'",
                )
        return None, None, 2
    if "pums-age" in node_config:
        raise InputError(
            "pums-age",
            node_config["pums-age"],
            "encodes the pums layout's age; this node reads dataset='csv'",
        )
    for key in ("label-column", "feature-columns", "num-classes"):
        if key not in node_config:
            raise InputError(
                key,
                None,
                "a deployed csv client needs label-column, feature-columns and num-classes in its "
                "node config: how it reads its records must not depend on the records or on the run config",
            )
    label = node_config["label-column"]
    if not isinstance(label, str) or not label.strip():
        raise InputError("label-column", label, "must name the label column")
    features = node_config["feature-columns"]
    names = column_names("feature-columns", features)
    if not names:
        raise InputError("feature-columns", features, "must name the feature columns, e.g. 'age,income'")
    if label.strip() in names:
        raise InputError("feature-columns", features, f"must not include the label column {label.strip()!r}")
    return label.strip(), names, num_classes


def default_ledger_path() -> Path:
    """Where a deployed client keeps its ledger unless told: per user, outliving any run."""
    return Path(os.path.expanduser("~/.fedprivacy/ledger.sqlite"))
