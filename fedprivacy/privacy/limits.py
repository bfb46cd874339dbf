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
- at most 10⁴ federated rounds;
- the clipping norm C in [10⁻⁶, 10⁶] (`clip_norm`): the trainer sums clipped gradients in float32,
  and inside this range that arithmetic is relative to C: see the function;
- a Poisson rate q ≥ 10⁻⁹ and an expected batch q·N ≥ 1 record, hence epochs k in [10⁻⁹, 10⁶]
  (`sampling`, `epochs`): a schedule sampling less used to send the σ calibration towards σ = 0
  (epochs = 10⁻⁹ planned q = 10⁻⁹ and died of a MemoryError after 6.4 GB).
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
SAMPLING_RATE_MIN = 1.0 / RECORDS_MAX  # 10⁻⁹ (see `sampling`)
EXPECTED_BATCH_MIN = 1.0  # records per step, q·N (see `sampling`)
EPOCHS_MIN, EPOCHS_MAX = SAMPLING_RATE_MIN, float(STEPS_MAX)  # k = qT with q in [10⁻⁹, 1], T in [1, 10⁶]
CLIP_NORM_MIN, CLIP_NORM_MAX = 1e-6, 1e6


def epsilon(field: str, value: Any) -> float:
    """A privacy budget ε in [EPSILON_MIN, EPSILON_MAX]."""
    try:
        number = errors.positive(field, value)
    except InputError:
        raise InputError(field, value, f"must be a finite number in [{EPSILON_MIN:g}, {EPSILON_MAX:g}]") from None
    if not EPSILON_MIN <= number <= EPSILON_MAX:
        raise InputError(
            field,
            value,
            f"must be in [{EPSILON_MIN:g}, {EPSILON_MAX:g}]: below, the certificate's 10⁻⁴ loss grid cannot "
            "certify it; above, the guarantee protects nothing",
        )
    return number


def clip_norm(field: str, value: Any) -> float:
    """A per-example clipping norm C in [CLIP_NORM_MIN, CLIP_NORM_MAX].

    Why these bounds: the clipped sum and its noise σC are float32 (fedprivacy/training/clipping.py
    computes the norms in float64, but sums in the model's float32). Rounding is relative (≤ 6·10⁻⁸)
    only above float32's normal range, 1.2·10⁻³⁸; below it a result is off by up to 7·10⁻⁴⁶
    whatever its size. With C ≥ 10⁻⁶ a clipped contribution, and any entry of it that matters, stays
    30 orders of magnitude above that, so each example's contribution is ≤ C to relative rounding
    (tests/test_norm_underflow.py runs at C = 10⁻⁶). With C ≤ 10⁶ the sum of up to RECORDS_MAX = 10⁹
    clipped gradients (≤ 10¹⁵) and its noise σC stay 20 orders of magnitude below float32's largest
    value (3.4·10³⁸), and C² below 10¹². Gradients of models trained in float32 live far inside.
    """
    try:
        number = errors.positive(field, value)
    except InputError:
        raise InputError(field, value, f"must be a finite number in [{CLIP_NORM_MIN:g}, {CLIP_NORM_MAX:g}]") from None
    if not CLIP_NORM_MIN <= number <= CLIP_NORM_MAX:
        raise InputError(
            field,
            value,
            f"must be in [{CLIP_NORM_MIN:g}, {CLIP_NORM_MAX:g}]: below, clipped float32 gradients near "
            "float32's subnormal range lose their relative precision; above, sums of clipped gradients "
            "and their noise approach float32's overflow",
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
            field,
            value,
            f"gives T = {steps_needed:.3g} local steps; plans are certified up to T = {STEPS_MAX:.0e} "
            + (
                "(choose fewer steps)"
                if field == "steps"
                else "(choose fewer epochs, a larger sampling rate or a larger ε)"
            ),
        )


def steps_for(epochs: float, sampling_rate: float) -> int:
    """T = ⌈k/q⌉ without building it first (k/q may be astronomically large)."""
    return math.ceil(epochs / sampling_rate - 1e-9) if epochs / sampling_rate < 1e18 else 10**18


def epochs(field: str, value: Any) -> float:
    """Epochs k in [EPOCHS_MIN, EPOCHS_MAX]. k = qT with q in [SAMPLING_RATE_MIN, 1] and T ≥ 1, so a
    smaller k samples less than SAMPLING_RATE_MIN per step and a larger one takes T ≥ k > STEPS_MAX
    steps, whatever the other inputs (and above 10¹⁵⁴ the proactive T = ⌈2k²/ε⌉ overflows a float)."""
    number = errors.positive(field, value)
    if not EPOCHS_MIN <= number <= EPOCHS_MAX:
        raise InputError(
            field,
            value,
            f"must be in [{EPOCHS_MIN:g}, {EPOCHS_MAX:g}]: k = q·T with q in [{SAMPLING_RATE_MIN:g}, 1] "
            f"and at most T = {STEPS_MAX:.0e} steps",
        )
    return number


def sampling(field: str, value: Any, rate: float, n: int, hint: str) -> None:
    """Refuse a Poisson rate q below SAMPLING_RATE_MIN or an expected batch q·N below
    EXPECTED_BATCH_MIN records, naming the input that set q; checked before any accountant work.

    Why these bounds:

    - q·N ≥ 1: a plan that samples less than one record per step mostly trains on nothing. It is
      also what keeps the σ calibration bounded. The planner refuses δ ≥ 1/N, so q·N ≥ 1 means
      q > δ. Where a record's chance of being sampled at all (about qT) is δ or less, every σ, even
      0, meets (ε, δ): the search then halves σ towards 0 and the loss grid grows as 1/σ². That
      is what `epochs = 1e-9` did (N = 5736, δ = 10⁻⁵, so q = 10⁻⁹ and T = 1): a MemoryError after
      6.4 GB and 35 s under `ulimit -v 8000000`, killed without one; with q = δ = 10⁻⁵ the σ
      calibration took 22 s and 1.1 GB to find σ = 0.076 where any σ would do.
    - q ≥ 10⁻⁹ = 1/RECORDS_MAX, the smallest rate of a q·N ≥ 1 plan, measured there at its worst
      (whole `plan_client` calls, 2-core CPU machine, `ulimit -v 8000000`): N = 10⁹, δ just
      below 1/N = q (σ is smallest when δ/q is nearest 1), ε in {0.01, 1, 100}. At T = 1 (the
      smallest σ), calibrated and adp plans took at most 6 s and 0.9 GB with δ = 0.999999/N, 53 s
      and 1.6 GB with δ one float below 1/N, and at most 5 s and 0.6 GB with δ = 0.5/N or 10⁻¹⁵.
      Over T = 10³ to 10⁶ at ε = 100: calibrated at most 77 s and 2.5 GB; adp at most 162 s and
      5.9 GB. The same adp worst case at q = 10⁻³ (N = 1000, δ = 0.999999/N, T = 10³) took 185 s
      and 5.6 GB: what costs is δ/q near 1 with a large ε, and q·N ≥ 1 > δ·N bounds it.
    """
    low = max(SAMPLING_RATE_MIN, EXPECTED_BATCH_MIN / n)
    # q = batch/N for a batch of exactly one record may round to q·N = 1 - 2⁻⁵³: that is the edge, not below it
    if rate >= SAMPLING_RATE_MIN * (1 - 1e-12) and rate * n >= EXPECTED_BATCH_MIN * (1 - 1e-12):
        return
    raise InputError(
        field,
        value,
        f"gives q = {rate:.3g}, an expected batch q·N = {rate * n:.3g} records per step for N = {n}; "
        f"plans need q in [{low:.3g}, 1] (q·N ≥ {EXPECTED_BATCH_MIN:g}: fewer records per step mostly "
        f"train on nothing, and q ≥ {SAMPLING_RATE_MIN:g}){': ' + hint if hint else ''}",
    )
