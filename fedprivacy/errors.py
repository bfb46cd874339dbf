"""One error type for bad user input, and the checks every entry point shares.

Every user-facing value (CLI flag, run config, node config, CSV column) is checked where it
enters, and a failure names the field, the value and what is allowed, in one line.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable
from typing import Any

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"^(?:[\w]+\.)*(\w+(?:Error|Exception)): (.*\S.*)$")
# A deployed SuperNode's form (Flower's `run_clientapp`): "<class 'pkg.Name'>:<'message'>"
_SUPERNODE_REASON = re.compile(r"^<class '(?:\w+\.)*(\w+)'>:<'(.*)'>$", re.DOTALL)


class InputError(ValueError):
    """A user input outside its allowed range."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={value!r}: {allowed}")


class PlanRefused(RuntimeError):
    """A plan whose certified ε exceeds its target: it must never run."""


class ClientRefusal(RuntimeError):
    """A client declines a request for a reason built from public values only (its budget, its
    plan, round numbers, config keys), so the message may leave the client as it is.

    Anything else a deployed client raises is reported to the server without its text (which
    may quote a record, e.g. a bad cell of the data file); see clients/app.py.
    """


def _as_float(field: str, value: Any, allowed: str) -> float:
    if isinstance(value, bool):
        raise InputError(field, value, allowed)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(field, value, allowed) from None
    if not math.isfinite(number):
        raise InputError(field, value, allowed)
    return number


def positive(field: str, value: Any) -> float:
    """A finite number > 0 (ε, C, learning rates)."""
    allowed = "must be a finite number > 0"
    number = _as_float(field, value, allowed)
    if number <= 0:
        raise InputError(field, value, allowed)
    return number


def open_unit(field: str, value: Any) -> float:
    """A number in (0, 1) (δ)."""
    allowed = "must be a number in the open interval (0, 1)"
    number = _as_float(field, value, allowed)
    if not 0 < number < 1:
        raise InputError(field, value, allowed)
    return number


def unit_rate(field: str, value: Any) -> float:
    """A probability in (0, 1] (the Poisson sampling rate q)."""
    allowed = "must be a number in (0, 1]"
    number = _as_float(field, value, allowed)
    if not 0 < number <= 1:
        raise InputError(field, value, allowed)
    return number


def integer_at_least(field: str, value: Any, minimum: int) -> int:
    """An integer ≥ minimum (N, steps, rounds, batch sizes)."""
    allowed = f"must be an integer >= {minimum}"
    number = _as_float(field, value, allowed)
    if number != int(number) or number < minimum:
        raise InputError(field, value, allowed)
    return int(number)


def error_summary(reason: str) -> str:
    """The one line of a remote error that says what went wrong.

    A ClientApp's exception reaches the server as a whole traceback (under Ray: two chained
    tracebacks with colour codes, ending in a wrapper exception). Users need its cause, e.g.
    "InputError: data-path='/x.csv': no such file", so this keeps the last `Name: message` line
    with a non-empty message (the innermost exception Python printed), else the last line. A
    deployed SuperNode sends `<class 'pkg.Name'>:<'message'>`, given as `Name: message`.
    """
    deployed = _SUPERNODE_REASON.match(reason.strip())
    if deployed:
        return f"{deployed.group(1)}: {deployed.group(2)}"
    lines = [line.strip() for line in _ANSI_ESCAPE.sub("", reason).splitlines() if line.strip()]
    for line in reversed(lines):
        match = _EXCEPTION_LINE.match(line)
        if match and match.group(1) != "ClientAppException":  # Flower's wrapper, not the cause
            return f"{match.group(1)}: {match.group(2)}"
    return lines[-1] if lines else "unknown error"


def did_you_mean(value: Any, choices: Iterable[str]) -> str:
    """ " (did you mean 'mlp'?)" for a name close to one of `choices` (difflib's ratio ≥ 0.6), else ""."""
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
