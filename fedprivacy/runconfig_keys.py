"""Every run-config key, declared once: its default (and so its type), its check, its help, its group.

`DEFAULTS`, `parse_run_config` (fedprivacy/runconfig.py) and the table of docs/flower.md
(fedprivacy/runconfig_docs.py) are derived from `RUN_KEYS`, so a key cannot be parsed one way and
documented another. pyproject.toml's `[tool.flwr.app.config]` repeats the defaults, because Flower
only accepts `--run-config` overrides of keys declared there; tests keep it equal.

Each `parse(field, value)` returns the value `RunSettings` holds, or raises `InputError` naming the
key, the value and what is allowed.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedprivacy.catalog import AGGREGATIONS, DATASETS, PATH_DATASETS, RULE_NAMES
from fedprivacy.data.arrays import declared_classes
from fedprivacy.data.loaders import PUMS_AGE_ENCODINGS
from fedprivacy.data.partition import SCHEMES, SIZE_SKEWS
from fedprivacy.errors import InputError, integer_at_least, open_unit, positive, unit_rate
from fedprivacy.model_registry import check_model_name
from fedprivacy.privacy import limits
from fedprivacy.privacy.plan import LR_SCHEDULES

PARTITIONINGS = ("auto", *SCHEMES)  # auto: natural when partition-by names a column, else iid
SERVER_OPTIMIZERS = ("none", "fedavgm", "fedadam")
EVALUATION_SETS = ("test", "validation")  # validation: rows cut from each client's training rows, for tuning
GROUPS = ("data", "model and training", "privacy", "federation", "rounds and aggregation", "randomness", "output")

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


def choice(field: str, value: Any, allowed: tuple[str, ...]) -> str:
    """`value` when it is one of `allowed`."""
    if value not in allowed:
        raise InputError(field, value, f"must be one of: {', '.join(allowed)}")
    return str(value)


def per_client_values(field: str, value: Any, check: Callable[[str, Any], float], example: str) -> tuple[float, ...]:
    """'0.5,1,2' (a string: run configs hold no lists) → one value per client, each checked; '' → ().

    The one parser of per-client lists: the run config's `epsilons`/`deltas` and the CLI's `--epsilons`.
    """
    if not isinstance(value, str):
        raise InputError(field, value, f"must be a comma-separated string such as '{example}'")
    if value.strip() == "":
        return ()
    return tuple(check(field, part.strip()) for part in value.split(","))


def _one_of(allowed: tuple[str, ...]) -> Callable[[str, Any], str]:
    return functools.partial(choice, allowed=allowed)


def _at_least(minimum: int) -> Callable[[str, Any], int]:
    return functools.partial(integer_at_least, minimum=minimum)


def _per_client(check: Callable[[str, Any], float], example: str) -> Callable[[str, Any], tuple[float, ...]]:
    return functools.partial(per_client_values, check=check, example=example)


def _folder(field: str, value: Any) -> Path:
    """A path that must be set: where the run's results go."""
    path = resolve_path(field, value)
    if path is None:
        raise InputError(field, value, "must name a folder (an absolute path)")
    return path


def _column(field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InputError(field, value, "must be a string (a column name, or '' for none)")
    return value


def _classes_or_unset(field: str, value: Any) -> int | None:
    """A declared number of classes, or None (0 in the run config) where the source declares its own."""
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return None
    return declared_classes(field, value)


def column_names(field: str, value: Any) -> tuple[str, ...]:
    """'age,income' as ('age', 'income'), each name once; '' as () (unset)."""
    example = "must be a comma-separated list of distinct column names, e.g. 'age,income'"
    if not isinstance(value, str):
        raise InputError(field, value, example)
    if not value.strip():
        return ()
    names = tuple(part.strip() for part in value.split(","))
    if "" in names or len(set(names)) != len(names):
        raise InputError(field, value, example)
    return names


def _split(field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InputError(field, value, "must be a string (a split name such as 'train', or '' for every split)")
    return value


def _test_fraction(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise InputError(field, value, "must be a number in (0, 1): each client evaluates on its own test split")
    return float(value)


def _validation_fraction(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise InputError(
            field, value, "must be a number in (0, 1): the share of each client's training rows held out for validation"
        )
    return float(value)


def _epsilon_or_off(field: str, value: Any) -> float:
    """A federation's ε (`limits.epsilon`), or 0: no client-level DP."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value == 0:
        return 0.0
    try:
        return limits.epsilon(field, value)
    except InputError as refused:
        raise InputError(
            field, value, f"must be 0 (no client-level DP) or {refused.allowed.removeprefix('must be ')}"
        ) from None


def _update_clip(field: str, value: Any) -> float:
    """An update clip S in `limits.clip_norm`'s range (the grid of the exact sum is made from it)."""
    try:
        return limits.clip_norm(field, value)
    except InputError:
        raise InputError(
            field, value, f"must be a number in [{limits.CLIP_NORM_MIN:g}, {limits.CLIP_NORM_MAX:g}]"
        ) from None


def _delta_or_default(field: str, value: Any) -> float:
    """A federation's δ in (0, 1), or 0: 1/M^1.1 for M members (checked against 1/M when planned)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value == 0:
        return 0.0
    return open_unit(field, value)


def _cohort_or_planner(field: str, value: Any) -> float | None:
    """An expected cohort pM ≥ 1 (checked against M when planned), or 0: the planner chooses."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (value == 0 or 1 <= value < math.inf):
        raise InputError(
            field, value, "must be 0 (the planner chooses the rate) or an expected cohort of at least 1 member"
        )
    return None if value == 0 else float(value)


def _quantile_or_fixed(field: str, value: Any) -> float:
    """A target quantile in (0, 1) for adaptive clipping, or 0: a fixed update clip."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise InputError(field, value, "must be 0 (a fixed update-clip) or a quantile in (0, 1), e.g. 0.5")
    return float(value)


def _fraction_or_off(field: str, value: Any) -> float:
    """A rate in (0, 1], or 0 for none (federated evaluation off)."""
    if value == 0 and not isinstance(value, bool):
        return 0.0
    return unit_rate(field, value)


def _epochs_or_planner(field: str, value: Any) -> float | None:
    """Epochs k, or None (0 in the run config) for the planner to choose."""
    return None if value == 0 else limits.epochs(field, value)


def _non_negative(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
        raise InputError(field, value, "must be a finite number ≥ 0")
    return float(value)


def _momentum(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise InputError(field, value, "must be a number in [0, 1) (FedAvgM's momentum; 0: none)")
    return float(value)


def model_options(field: str, value: Any) -> tuple[tuple[str, bool | int | float | str], ...]:
    """`name=value` pairs separated by commas (`hidden=128,dropout=0.1`), each value read as an
    integer, a number, true/false or else text: keyword arguments for the model's factory, which
    `build_model` checks against the factory's own parameters."""
    if not isinstance(value, str):
        raise InputError(field, value, "must be text: name=value pairs separated by commas, e.g. 'hidden=128'")
    pairs: dict[str, bool | int | float | str] = {}
    for part in filter(None, (piece.strip() for piece in value.split(","))):
        name, equals, text = (piece.strip() for piece in part.partition("="))
        if not equals or not name.isidentifier() or not text:
            raise InputError(field, value, f"{part!r} is not name=value with a Python name, e.g. 'hidden=128'")
        if name in pairs:
            raise InputError(field, value, f"{name} is given twice")
        pairs[name] = _option_value(text)
    return tuple(pairs.items())


def _option_value(text: str) -> bool | int | float | str:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _flag(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InputError(field, value, "must be true or false")
    return value


@dataclass(frozen=True)
class RunKey:
    """One run-config key: `default` also fixes the type pyproject.toml declares it with."""

    name: str
    default: bool | int | float | str
    parse: Callable[[str, Any], Any]
    help: str
    group: str

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"run-config key {self.name}: group={self.group!r} must be one of: {', '.join(GROUPS)}")

    @property
    def field(self) -> str:
        """Its `RunSettings` field: key `a-b` becomes field `a_b`."""
        return self.name.replace("-", "_")


RUN_KEYS = (
    # data
    RunKey(
        "dataset",
        "digits",
        _one_of(DATASETS),
        "`digits` (embedded), `synthetic`, or one read from data-path: "
        + ", ".join(f"`{name}`" for name in PATH_DATASETS)
        + " ([data.md](data.md)); a deployed node reads its file as its node config says, and a deployment "
        "names the nodes' kind here, so that the server, which has no such file, asks a node for the model",
        "data",
    ),
    RunKey(
        "data-path",
        "",
        resolve_path,
        "the data file (or folder: `hf`, `cifar10`), an absolute path (`~` and `$VARS` expand)",
        "data",
    ),
    RunKey(
        "synthetic-examples",
        2000,
        _at_least(2),
        "`synthetic` only: its rows (x ~ N(0, I), logistic labels; scale tests with no download)",
        "data",
    ),
    RunKey("synthetic-features", 10, _at_least(1), "`synthetic` only: its features", "data"),
    RunKey(
        "pums-age",
        "linear",
        _one_of(PUMS_AGE_ENCODINGS),
        "`pums` only: `linear` (one feature, age/100) or `bands` (one 0/1 feature per age band: <25, 25–34, "
        "35–44, 45–54, 55–61, 62–66, 67–74, ≥75; fixed in advance, not fitted to the data)",
        "data",
    ),
    RunKey(
        "label-column",
        "",
        _column,
        "the label's column: `csv` (required) and `hf` (`''`: `label`) (simulations only: a deployed node's "
        "node config names its columns)",
        "data",
    ),
    RunKey(
        "feature-columns",
        "",
        column_names,
        "`csv` only: the feature columns, comma-separated (`''`: every column of the header but the label "
        "and client columns, each of which must then be numeric; chosen by the header, never by the cells) "
        "(simulations only: a deployed node's node config names its columns)",
        "data",
    ),
    RunKey(
        "image-column",
        "",
        _column,
        "`hf` only: the feature column, an Image feature (decoded to [C, H, W] in [0, 1]) or numeric arrays "
        "(`''`: `image`, else `img`)",
        "data",
    ),
    RunKey(
        "data-split",
        "",
        _split,
        "`hf` (a saved DatasetDict) and `cifar10` only: read one split of the files, e.g. `train`; `''` pools "
        "every split (each client then holds out its own test rows, as with any source)",
        "data",
    ),
    RunKey(
        "num-classes",
        0,
        _classes_or_unset,
        "`csv`, `npz` and `hf` (unless its label is a ClassLabel): the number of classes, declared and never "
        "read from the labels (one record would decide the model's output size); labels lie in [0, num-classes). "
        "`0`: unset (refused for those sources; the others fix their own) (simulations only: a deployed node's "
        "node config declares it)",
        "data",
    ),
    RunKey(
        "partitioning",
        "auto",
        _one_of(PARTITIONINGS),
        "`auto` (natural if `partition-by` is set, else iid), `iid`, `dirichlet`, `natural` or `size`",
        "data",
    ),
    RunKey(
        "partition-by",
        "",
        _column,
        "the client column of natural partitions, e.g. `puma` (`npz`: its `client_ids` array)",
        "data",
    ),
    RunKey("dirichlet-alpha", 0.5, positive, "label skew of `dirichlet` (smaller: more skewed)", "data"),
    RunKey(
        "size-skew",
        "linear",
        _one_of(SIZE_SKEWS),
        "`linear`, `square` or `exponential`, for `partitioning='size'`",
        "data",
    ),
    RunKey(
        "test-fraction",
        0.2,
        _test_fraction,
        "each simulated client's held-out test split, in (0, 1) (a deployed client holds none out)",
        "data",
    ),
    RunKey(
        "evaluate-on",
        "test",
        _one_of(EVALUATION_SETS),
        "`test`, or `validation` (for tuning): each simulated client trains on part of its training rows and "
        "every evaluation uses the rest; no test row is read",
        "data",
    ),
    RunKey(
        "validation-fraction",
        0.2,
        _validation_fraction,
        "`evaluate-on='validation'` only: the share of each client's training rows held out for validation, in (0, 1)",
        "data",
    ),
    # model and training
    RunKey(
        "model",
        "logreg",
        check_model_name,
        "`logreg`, `mlp`, `cnn`, or a model installed on the node under its registered name "
        "([Registering a model](training.md#registering-a-model))",
        "model and training",
    ),
    RunKey(
        "model-options",
        "",
        model_options,
        "keyword arguments for the model's factory, `name=value` pairs separated by commas "
        "(e.g. `hidden=128` for the `mlp`); each must be a parameter of the factory",
        "model and training",
    ),
    RunKey("clip-norm", 1.0, limits.clip_norm, "the per-example clipping norm C", "model and training"),
    RunKey("learning-rate", 1.0, positive, "the step size η", "model and training"),
    RunKey(
        "lr-schedule",
        "",
        _one_of(("", *LR_SCHEDULES)),
        '`""` (the rule\'s own: `constant`, `inverse_sqrt` for `adp`), `constant`, `inverse_sqrt` '
        "(η_t = η/sqrt(a + c·t) at each client's step t) or `adagrad_norm`",
        "model and training",
    ),
    RunKey(
        "lr-offset",
        20.0,
        positive,
        "a of `inverse_sqrt` (20 and 1: Wu et al.'s CIFAR-10 schedule); a value other than the default is "
        "refused under any other schedule",
        "model and training",
    ),
    RunKey(
        "lr-decay",
        1.0,
        _non_negative,
        "c of `inverse_sqrt`; a value other than the default is refused under any other schedule",
        "model and training",
    ),
    RunKey("epochs", 0.0, _epochs_or_planner, "epochs k = qT; 0 lets the planner choose", "model and training"),
    RunKey(
        "client-epochs",
        "",
        _per_client(limits.epochs, "4,8,8,16"),
        "simulations only: one epochs k per client, e.g. `'4,8,8,16'` (`''`: every client takes `epochs`; "
        "refused beside a non-zero `epochs`)",
        "model and training",
    ),
    # privacy
    RunKey("epsilon", 1.0, limits.epsilon, "every client's ε, unless `epsilons` is set", "privacy"),
    RunKey(
        "epsilons",
        "",
        _per_client(limits.epsilon, "0.5,1,2"),
        "one ε per client, e.g. `'0.5,1,1,2,2,4,8'`",
        "privacy",
    ),
    RunKey("delta", 1e-5, open_unit, "every client's δ, unless `deltas` is set", "privacy"),
    RunKey("deltas", "", _per_client(open_unit, "1e-5,1e-6"), "one δ per client, e.g. `'1e-5,1e-6'`", "privacy"),
    RunKey(
        "rule",
        "proactive",
        _one_of(RULE_NAMES),
        "`proactive`, `calibrated` (σ by PLD), `calibrated-rdp` (σ by RDP) or `adp` ([privacy.md](privacy.md#rules))",
        "privacy",
    ),
    # federation
    RunKey(
        "federation-epsilon",
        0.0,
        _epsilon_or_off,
        "0: no client-level DP; > 0: the federation's ε, DP-FedAvg planned before the first round "
        "([privacy.md](privacy.md#two-levels-in-one-run))",
        "federation",
    ),
    RunKey(
        "federation-delta",
        0.0,
        _delta_or_default,
        "the federation's δ, below 1/M for M members; 0: min(10⁻⁵, 1/M^1.1)",
        "federation",
    ),
    RunKey(
        "federation-cohort",
        0.0,
        _cohort_or_planner,
        "the expected members per round pM (each member Poisson-sampled at rate p); 0: the planner chooses",
        "federation",
    ),
    RunKey(
        "update-clip",
        1.0,
        _update_clip,
        "S: each member's update (its model change) is clipped to this L2 norm; match it to the updates' "
        "norms (a member's noisy record-level update is larger than its signal), or let "
        "`update-clip-quantile` adapt it",
        "federation",
    ),
    RunKey(
        "update-clip-quantile",
        0.0,
        _quantile_or_fixed,
        "0: S stays `update-clip`; in (0, 1): adaptive clipping (Andrew et al. 2021), S follows this quantile of "
        "the members' update norms, estimated each round with its own noise and counted in the plan, from "
        "`update-clip`",
        "federation",
    ),
    RunKey(
        "update-clip-rate",
        0.2,
        positive,
        "adaptive clipping's step: S ← S·exp(−rate·(share of norms ≤ S − quantile))",
        "federation",
    ),
    RunKey(
        "clip-count-noise",
        0.0,
        _non_negative,
        "adaptive clipping: σ_b of the noisy count of norms ≤ S; 0: pM/20 (Andrew et al. 2021)",
        "federation",
    ),
    RunKey(
        "federation-ledger",
        "",
        resolve_path,
        "the federation's own ledger (its ε_fed across runs); empty: `federation-ledger.sqlite` in the run's folder",
        "federation",
    ),
    RunKey(
        "federation-rule",
        "proactive",
        _one_of(tuple(r for r in RULE_NAMES if r != "adp")),
        "`proactive`, `calibrated` or `calibrated-rdp`: how the federation's σ is chosen",
        "federation",
    ),
    # rounds and aggregation
    RunKey("num-server-rounds", 3, limits.rounds, "federated rounds", "rounds and aggregation"),
    RunKey("fraction-train", 1.0, unit_rate, "fraction of clients trained per round", "rounds and aggregation"),
    RunKey(
        "fraction-evaluate",
        1.0,
        _fraction_or_off,
        "fraction of clients in federated evaluation; 0 turns it off",
        "rounds and aggregation",
    ),
    RunKey("min-clients", 2, _at_least(1), "clients the server waits for before a round", "rounds and aggregation"),
    RunKey(
        "round-timeout", 600.0, positive, "seconds the server waits for a round's replies", "rounds and aggregation"
    ),
    RunKey(
        "aggregation",
        "examples",
        _one_of(AGGREGATIONS),
        "`examples` (FedAvg) or `inverse-noise` (weights ∝ 1/variance of each update's noise, from its plan)",
        "rounds and aggregation",
    ),
    RunKey(
        "server-optimizer",
        "none",
        _one_of(SERVER_OPTIMIZERS),
        "`none`, `fedavgm` or `fedadam`: Flower's own, applied to the privacy-aware average",
        "rounds and aggregation",
    ),
    RunKey(
        "server-learning-rate",
        1.0,
        positive,
        "FedAvgM's server learning rate, FedAdam's η",
        "rounds and aggregation",
    ),
    RunKey("server-momentum", 0.0, _momentum, "FedAvgM's momentum, in [0, 1)", "rounds and aggregation"),
    RunKey("server-tau", 1e-3, positive, "FedAdam's adaptivity τ", "rounds and aggregation"),
    # randomness
    RunKey(
        "seed",
        0,
        _at_least(0),
        "client sampling, initial model; partitions and splits too, unless `split-seed` is set",
        "randomness",
    ),
    RunKey(
        "split-seed",
        -1,
        _at_least(-1),
        "−1: `seed`; ≥ 0: seeds the partitions and the test and validation splits alone, so runs with "
        "different `seed` share their test rows",
        "randomness",
    ),
    RunKey(
        "noise-seed",
        -1,
        _at_least(-1),
        "−1: DP noise from OS entropy; ≥ 0: a reproducible simulation, refused by deployed clients and by a "
        "ledger that another run already spent from",
        "randomness",
    ),
    # output
    RunKey("results-dir", "~/fedprivacy-results", _folder, "where the run's folder goes", "output"),
    RunKey(
        "ledger-path",
        "",
        resolve_path,
        "the simulation's ledger; empty: `ledger.sqlite` in the run's folder",
        "output",
    ),
    RunKey(
        "diagnostics",
        False,
        _flag,
        "simulations only: clients also return raw loss and clip fraction (**not private**), in `rounds.csv`",
        "output",
    ),
)

DEFAULTS: dict[str, bool | int | float | str] = {key.name: key.default for key in RUN_KEYS}
# what shapes client-level DP besides federation-epsilon: refused without it (fedprivacy.runconfig)
FEDERATION_KEYS = tuple(key.name for key in RUN_KEYS if key.group == "federation" and key.name != "federation-epsilon")
