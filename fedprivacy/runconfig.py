"""The run configuration of the Flower apps, validated where it enters.

`DEFAULTS` is the single list of run-config keys; `[tool.flwr.app.config]` in pyproject.toml
repeats it (a test keeps the two equal) because Flower only accepts `--run-config` overrides
for keys declared there, and `run_simulation` hands the apps an empty run config.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedprivacy.aggregation import AGGREGATIONS
from fedprivacy.data.loaders import PUMS_AGE_ENCODINGS
from fedprivacy.data.partition import SCHEMES, SIZE_SKEWS
from fedprivacy.errors import InputError, integer_at_least, open_unit, positive, unit_rate
from fedprivacy.models import MODELS
from fedprivacy.privacy import limits
from fedprivacy.privacy.plan import LR_SCHEDULES
from fedprivacy.privacy.rules import RULE_NAMES, find_rule

DATASETS = ("digits", "pums", "csv", "synthetic")
PARTITIONINGS = ("auto", *SCHEMES)  # auto: natural when partition-by names a column, else iid
SERVER_OPTIMIZERS = ("none", "fedavgm", "fedadam")

DEFAULTS: dict[str, bool | int | float | str] = {
    "num-server-rounds": 3,
    "dataset": "digits",
    "data-path": "",
    "synthetic-examples": 2000,
    "synthetic-features": 10,
    "pums-age": "linear",
    "label-column": "",
    "partitioning": "auto",
    "partition-by": "",
    "dirichlet-alpha": 0.5,
    "size-skew": "linear",
    "test-fraction": 0.2,
    "model": "logreg",
    "epsilon": 1.0,
    "epsilons": "",
    "delta": 1e-5,
    "deltas": "",
    "rule": "proactive",
    "clip-norm": 1.0,
    "learning-rate": 1.0,
    "lr-schedule": "",
    "lr-offset": 20.0,
    "lr-decay": 1.0,
    "epochs": 0.0,
    "seed": 0,
    "noise-seed": -1,
    "fraction-train": 1.0,
    "fraction-evaluate": 1.0,
    "min-clients": 2,
    "results-dir": "~/fedprivacy-results",
    "ledger-path": "",
    "round-timeout": 600.0,
    "diagnostics": False,
    "aggregation": "examples",
    "server-optimizer": "none",
    "server-learning-rate": 1.0,
    "server-momentum": 0.0,
    "server-tau": 1e-3,
}

PATH_RULE = (
    "must be an absolute path (~ and $VARS are expanded): Flower runs the apps from its own "
    "copy of the project in another working directory, so a relative path is refused"
)


def resolve_path(field: str, value: Any) -> Path | None:
    """The one way paths are read: '' means unset; ~ and $VARS expand; the result must be absolute."""
    if not isinstance(value, str):
        raise InputError(field, value, "must be a string path")
    if value.strip() == "":
        return None
    path = Path(os.path.expandvars(os.path.expanduser(value.strip())))
    if not path.is_absolute():
        raise InputError(field, value, PATH_RULE)
    return path


def _choice(field: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise InputError(field, value, f"must be one of: {', '.join(allowed)}")
    return str(value)


def _fraction(field: str, value: Any) -> float:
    if value == 0 and not isinstance(value, bool):
        return 0.0
    return unit_rate(field, value)


def per_client_values(field: str, value: Any, check: Callable[[str, Any], float], example: str) -> tuple[float, ...]:
    """'0.5,1,2' (a string: run configs hold no lists) → one value per client, each checked; '' → ().

    The one parser of per-client lists: the run config's `epsilons`/`deltas` and the CLI's `--epsilons`.
    """
    if not isinstance(value, str):
        raise InputError(field, value, f"must be a comma-separated string such as '{example}'")
    if value.strip() == "":
        return ()
    return tuple(check(field, part.strip()) for part in value.split(","))


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
    """The validated run config (key `a-b` becomes field `a_b`).

    `partitioning='auto'` is `natural` when `partition-by` names a column, else `iid`;
    `noise-seed=-1` draws DP noise from OS entropy (a seed makes noise reproducible: experiments only);
    `epochs=0` lets the planner choose k;
    `diagnostics=true` (simulations only) makes clients also return their raw training loss and
    clip fraction, which are NOT private: the results then say so.
    """

    num_server_rounds: int
    dataset: str
    data_path: Path | None
    synthetic_examples: int
    synthetic_features: int
    pums_age: str
    label_column: str
    partitioning: str
    partition_by: str
    dirichlet_alpha: float
    size_skew: str
    test_fraction: float
    model: str
    epsilon: float
    epsilons: tuple[float, ...]
    delta: float
    deltas: tuple[float, ...]
    rule: str
    clip_norm: float
    learning_rate: float
    lr_schedule: str  # '' = the rule's default (constant; inverse_sqrt for adp)
    lr_offset: float
    lr_decay: float
    epochs: float | None
    seed: int
    noise_seed: int
    fraction_train: float
    fraction_evaluate: float
    min_clients: int
    results_dir: Path
    ledger_path: Path | None
    round_timeout: float
    diagnostics: bool
    aggregation: str
    server_optimizer: str
    server_learning_rate: float
    server_momentum: float
    server_tau: float

    def client_epsilon(self, index: int, num_clients: int) -> float:
        """Client `index`'s ε: its entry of `epsilons` when given, else the common `epsilon`."""
        return _client_value("epsilons", self.epsilons, self.epsilon, index, num_clients)

    def client_delta(self, index: int, num_clients: int) -> float:
        """Client `index`'s δ: its entry of `deltas` when given, else the common `delta`."""
        return _client_value("deltas", self.deltas, self.delta, index, num_clients)

    def check_clients(self, num_clients: int, field: str = "clients") -> None:
        """A simulation's `num_clients` against the per-client lists (`epsilons`, `deltas`) and
        min-clients: refused before it starts, not client by client once it runs (`field` names
        where the number came from)."""
        for index in range(num_clients):
            self.client_epsilon(index, num_clients)
            self.client_delta(index, num_clients)
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


def parse_run_config(run_config: Mapping[str, Any]) -> RunSettings:
    """Validate a Flower run config (missing keys take `DEFAULTS`; unknown keys are refused)."""
    unknown = sorted(set(run_config) - set(DEFAULTS))
    if unknown:
        raise InputError(unknown[0], run_config[unknown[0]], f"not a run-config key; known keys: {', '.join(DEFAULTS)}")
    rc = {**DEFAULTS, **run_config}
    dataset = _choice("dataset", rc["dataset"], DATASETS)
    data_path = resolve_path("data-path", rc["data-path"])
    epochs = None if rc["epochs"] == 0 else limits.epochs("epochs", rc["epochs"])
    results_dir = resolve_path("results-dir", rc["results-dir"])
    if results_dir is None:
        raise InputError("results-dir", rc["results-dir"], "must name a folder (an absolute path)")
    for key in ("label-column", "partition-by"):
        if not isinstance(rc[key], str):
            raise InputError(key, rc[key], "must be a string (a column name, or '' for none)")
    settings = RunSettings(
        num_server_rounds=limits.rounds("num-server-rounds", rc["num-server-rounds"]),
        dataset=dataset,
        data_path=data_path,
        synthetic_examples=integer_at_least("synthetic-examples", rc["synthetic-examples"], 2),
        synthetic_features=integer_at_least("synthetic-features", rc["synthetic-features"], 1),
        pums_age=_choice("pums-age", rc["pums-age"], PUMS_AGE_ENCODINGS),
        label_column=rc["label-column"],
        partitioning=_choice("partitioning", rc["partitioning"], PARTITIONINGS),
        partition_by=rc["partition-by"],
        dirichlet_alpha=positive("dirichlet-alpha", rc["dirichlet-alpha"]),
        size_skew=_choice("size-skew", rc["size-skew"], SIZE_SKEWS),
        test_fraction=_test_fraction(rc["test-fraction"]),
        model=_choice("model", rc["model"], tuple(MODELS)),
        epsilon=limits.epsilon("epsilon", rc["epsilon"]),
        epsilons=per_client_values("epsilons", rc["epsilons"], limits.epsilon, "0.5,1,2"),
        delta=open_unit("delta", rc["delta"]),
        deltas=per_client_values("deltas", rc["deltas"], open_unit, "1e-5,1e-6"),
        rule=_choice("rule", rc["rule"], RULE_NAMES),
        clip_norm=limits.clip_norm("clip-norm", rc["clip-norm"]),
        learning_rate=positive("learning-rate", rc["learning-rate"]),
        lr_schedule=_choice("lr-schedule", rc["lr-schedule"], ("", *LR_SCHEDULES)),
        lr_offset=positive("lr-offset", rc["lr-offset"]),
        lr_decay=_non_negative("lr-decay", rc["lr-decay"]),
        epochs=epochs,
        seed=integer_at_least("seed", rc["seed"], 0),
        noise_seed=integer_at_least("noise-seed", rc["noise-seed"], -1),
        fraction_train=unit_rate("fraction-train", rc["fraction-train"]),
        fraction_evaluate=_fraction("fraction-evaluate", rc["fraction-evaluate"]),
        min_clients=integer_at_least("min-clients", rc["min-clients"], 1),
        results_dir=results_dir,
        ledger_path=resolve_path("ledger-path", rc["ledger-path"]),
        round_timeout=positive("round-timeout", rc["round-timeout"]),
        diagnostics=_flag("diagnostics", rc["diagnostics"]),
        aggregation=_choice("aggregation", rc["aggregation"], AGGREGATIONS),
        server_optimizer=_choice("server-optimizer", rc["server-optimizer"], SERVER_OPTIMIZERS),
        server_learning_rate=positive("server-learning-rate", rc["server-learning-rate"]),
        server_momentum=_momentum(rc["server-momentum"]),
        server_tau=positive("server-tau", rc["server-tau"]),
    )
    _inverse_sqrt_keys_need_their_schedule(settings)
    return settings


def _inverse_sqrt_keys_need_their_schedule(settings: RunSettings) -> None:
    """lr-offset and lr-decay shape only the inverse_sqrt schedule: set under another, refuse them
    rather than run a schedule the user did not ask for."""
    schedule = settings.lr_schedule or find_rule(settings.rule).default_schedules(None)[0]
    for key, value in (("lr-offset", settings.lr_offset), ("lr-decay", settings.lr_decay)):
        if schedule != "inverse_sqrt" and value != DEFAULTS[key]:
            raise InputError(key, value, f"shapes only lr-schedule='inverse_sqrt'; this run's schedule is {schedule!r}")


def _non_negative(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
        raise InputError(field, value, "must be a finite number ≥ 0")
    return float(value)


def _momentum(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise InputError("server-momentum", value, "must be a number in [0, 1) (FedAvgM's momentum; 0: none)")
    return float(value)


def _flag(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InputError(field, value, "must be true or false")
    return value


def _test_fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise InputError(
            "test-fraction", value, "must be a number in (0, 1): each client evaluates on its own test split"
        )
    return float(value)


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
NODE_REQUIRED = ("client-id", "data-path", "epsilon", "delta", "public-size")
NODE_DATASETS = ("pums", "csv")
_NO_SPLIT = (
    "a deployed client trains on every row of its file and never evaluates: a held-out split would make "
    "which rows it trains on depend on the whole file; remove it"
)


def parse_node_config(node_config: Mapping[str, Any]) -> NodeSettings | None:
    """`NodeSettings` for a deployed SuperNode; None in a simulation (partition-id is set)."""
    if "partition-id" in node_config:
        return None
    if "test-fraction" in node_config:
        raise InputError("test-fraction", node_config["test-fraction"], _NO_SPLIT)
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
            "a deployed SuperNode needs --node-config \"client-id='…' data-path='/abs/file.csv' epsilon=1 delta=1e-6"
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
    dataset = _choice("dataset", node_config.get("dataset", "pums"), NODE_DATASETS)
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
        pums_age=_choice("pums-age", node_config.get("pums-age", "linear"), PUMS_AGE_ENCODINGS),
    )


def _node_columns(
    node_config: Mapping[str, Any], dataset: str
) -> tuple[str | None, tuple[str, ...] | None, int | None]:
    """(label column, feature columns, number of classes) of a node's file: a csv node names all
    three (nothing is inferred from its records); the pums layout fixes its own columns."""
    num_classes = node_config.get("num-classes")
    num_classes = None if num_classes is None else integer_at_least("num-classes", num_classes, 2)
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
    names = tuple(part.strip() for part in features.split(",")) if isinstance(features, str) else ()
    if not names or "" in names:
        raise InputError(
            "feature-columns", features, "must be a comma-separated list of column names, e.g. 'age,income'"
        )
    if label.strip() in names:
        raise InputError("feature-columns", features, f"must not include the label column {label.strip()!r}")
    return label.strip(), names, num_classes


def default_ledger_path() -> Path:
    """Where a deployed client keeps its ledger unless told: per user, outliving any run."""
    return Path(os.path.expanduser("~/.fedprivacy/ledger.sqlite"))
