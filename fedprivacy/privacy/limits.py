"""The inputs the planner answers within bounded memory and time, and the one check for each.

The certificate composes privacy-loss distributions on a 10⁻⁴ loss grid (accountants.py). Its size
follows the privacy loss itself, so extreme but valid-looking inputs used to end in a traceback
or a multi-terabyte allocation (ε = 10⁹ asked numpy for 1.8·10¹² entries; ε = 10⁻⁹ for a plan of
3·10¹⁰ steps). These limits refuse them in one line instead, and everything inside them gets a
correct certificate on a 2-core, 24 GB machine (docs/privacy.md, "Limits", gives the measurements;
tests/test_bad_input.py plans at the edges):

- ε in [0.01, 100]: below 0.01 the grid's own rounding (10⁻⁴ per step, always pessimistic)
  is too coarse to certify a plan; above 100 the guarantee (a factor e¹⁰⁰ between neighbours)
  protects nothing, and calibrating σ for ε = 10⁴ already needed 75 M grid points and 5.6 GB;
- T ≤ 10⁶ local steps: a calibrated plan of 10⁶ steps took 40 s, one of 10⁷ more than 100 s;
- N ≤ 10⁹ records;
- at most 10⁴ federated rounds.
"""

from __future__ import annotations

import math
from typing import Any

from fedprivacy import errors
from fedprivacy.errors import InputError

EPSILON_MIN, EPSILON_MAX = 0.01, 100.0
STEPS_MAX = 10**6
RECORDS_MAX = 10**9
ROUNDS_MAX = 10**4


def epsilon(field: str, value: Any) -> float:
    """A privacy budget ε in [EPSILON_MIN, EPSILON_MAX]."""
    number = errors.positive(field, value)
    if not EPSILON_MIN <= number <= EPSILON_MAX:
        raise InputError(
            field, value,
            f"must be in [{EPSILON_MIN:g}, {EPSILON_MAX:g}]: below, the certificate's 10⁻⁴ loss grid cannot "
            "certify it; above, the guarantee protects nothing",
        )
    return number


def records(field: str, value: Any) -> int:
    """A data size N in [2, RECORDS_MAX]."""
    number = errors.integer_at_least(field, value, 2)
    if number > RECORDS_MAX:
        raise InputError(field, value, f"must be an integer in [2, {RECORDS_MAX:.0e}]")
    return number


def rounds(field: str, value: Any) -> int:
    """A number of federated rounds in [1, ROUNDS_MAX]."""
    number = errors.integer_at_least(field, value, 1)
    if number > ROUNDS_MAX:
        raise InputError(field, value, f"must be an integer in [1, {ROUNDS_MAX}]")
    return number


def steps(field: str, value: Any, steps_needed: int) -> None:
    """Refuse a schedule of more than STEPS_MAX steps, naming the input that made it that long."""
    if steps_needed > STEPS_MAX:
        raise InputError(
            field, value,
            f"gives T = {steps_needed:.3g} local steps; plans are certified up to T = {STEPS_MAX:.0e} "
            f"(choose fewer epochs, a larger sampling rate or a larger ε)",
        )


def steps_for(epochs: float, sampling_rate: float) -> int:
    """T = ⌈k/q⌉ without building it first (k/q may be astronomically large)."""
    return math.ceil(epochs / sampling_rate - 1e-9) if epochs / sampling_rate < 1e18 else 10**18
