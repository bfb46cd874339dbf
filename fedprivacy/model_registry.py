"""Which model factory a name means: a built-in, a `register_model` decoration, or an installed
package's entry point in group `fedprivacy.models`.

The run config is untrusted and only *names* a model: the name is looked up here, never read as an
import path, so a run can use what the node has installed and nothing else. An entry point's
target is imported only when its name is the one asked for; listing and checking names imports
neither torch nor any package's code, which keeps `fedprivacy --help` fast. Decorations live in
the process that imported them: a sweep's Ray workers and a SuperNode see a model only through an
installed entry point.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any, TypeVar

from fedprivacy.catalog import MODEL_NAMES
from fedprivacy.errors import InputError, did_you_mean

GROUP = "fedprivacy.models"
InputShape = tuple[int, ...]  # one example's shape: (d,) for a table row, (C, H, W) for an image
ModelFactory = Callable[[InputShape, int], Any]  # (input_shape, num_classes) -> torch.nn.Module
F = TypeVar("F", bound=Callable[..., Any])

HOW_TO_REGISTER = (
    "register one with an entry point in group 'fedprivacy.models' of an installed package "
    '(my-cnn = "my_pkg.models:my_cnn"; the fedprivacy and flwr commands see only these), or, from Python, '
    "with @fedprivacy.models.register_model('my-cnn') in code this process imports (docs/training.md, "
    "Registering a model)"
)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # fits a run config, a TOML string and a CLI flag unquoted

_decorated: dict[str, ModelFactory] = {}


def factory_target(factory: Callable[..., Any]) -> str:
    """`module:qualname`, the way an entry point names a factory."""
    return f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', repr(factory))}"


def register_model(name: str) -> Callable[[F], F]:
    """Decorator: make `factory(input_shape, num_classes) -> nn.Module` the model called `name` in
    this process. Registering the same function again (a reloaded module) is allowed; taking a
    built-in's name or another function's name is refused."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"model name {name!r}: must start with a letter or digit and hold only letters, digits, '_', '.' or '-'"
        )
    if name in MODEL_NAMES:
        raise ValueError(f"model name {name!r} is a built-in model's ({', '.join(MODEL_NAMES)}); choose another")

    def decorate(factory: F) -> F:
        if not callable(factory):
            raise TypeError(f"register_model({name!r}) decorates a factory function, not {type(factory).__name__}")
        known = _decorated.get(name)
        if known is not None and factory_target(known) != factory_target(factory):
            raise ValueError(f"model name {name!r} is already registered to {factory_target(known)}; choose another")
        _decorated[name] = factory
        return factory

    return decorate


def _installed(name: str | None = None) -> list[EntryPoint]:
    """Installed entry points of the group (those called `name` only, when given), each target once."""
    found = entry_points(group=GROUP) if name is None else entry_points(group=GROUP, name=name)
    return list({(ep.name, ep.value): ep for ep in found}.values())


def model_names() -> tuple[str, ...]:
    """Every model a run may name, built-ins first; no entry point's target is imported."""
    return tuple(dict.fromkeys([*MODEL_NAMES, *_decorated, *(ep.name for ep in _installed())]))


def _unknown(field: str, value: Any) -> InputError:
    names = model_names()
    return InputError(
        field, value, f"unknown model{did_you_mean(value, names)}; known models: {', '.join(names)}; {HOW_TO_REGISTER}"
    )


def check_model_name(field: str, value: Any) -> str:
    """`value` when it names a known model (the run config's `model` key)."""
    if isinstance(value, str) and (value in MODEL_NAMES or value in _decorated or _installed(value)):
        return value
    raise _unknown(field, value)


def model_factory(name: str) -> tuple[ModelFactory, str]:
    """The factory a user's model name means and where it comes from (`module:function`), looked
    up among the decorations, then installed entry points (imported now); the built-ins are
    `fedprivacy.models.MODELS` (`build_model` looks there first)."""
    if name in _decorated:
        return _decorated[name], factory_target(_decorated[name])
    candidates = _installed(name)
    if not candidates:
        raise _unknown("model", name)
    if len(candidates) > 1:
        targets = ", ".join(
            f"{ep.value} ({ep.dist.name if ep.dist else 'unknown package'})"
            for ep in sorted(candidates, key=lambda ep: ep.value)
        )
        raise InputError("model", name, f"installed packages give it different factories: {targets}; uninstall one")
    entry = candidates[0]
    try:
        factory = entry.load()
    except Exception as error:  # any import failure of the package's own code, reported by name
        raise InputError(
            "model", name, f"its entry point {entry.value} cannot be imported: {type(error).__name__}: {error}"
        ) from error
    if not callable(factory):
        raise InputError("model", name, f"its entry point {entry.value} is a {type(factory).__name__}, not a function")
    return factory, entry.value
