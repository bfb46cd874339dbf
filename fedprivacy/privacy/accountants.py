"""Tight accountants (PLD, RDP) for Poisson-subsampled Gaussian steps, through dp-accounting.

The mechanism (the DP-SGD of Abadi et al. 2016 with Poisson sampling): each step Poisson-samples records with
probability q and adds N(0, σ²C²) to the sum of clipped gradients. A run is a sequence of
`NoiseEvent`s (σ, q, count), so a plan with a constant σ is one event and an ADP-SGD plan is one
event per noise segment.

Neighbouring data sets differ by adding or removing one record (`ADD_REMOVE`, with N public: what
every run certifies), or by replacing one (`REPLACE_ONE`, for `fedprivacy plan --adjacency
replace-one`: a release whose N is the real size). Replace-one is certified by dp-accounting's
own PLD accountant (`NeighboringRelation.REPLACE_ONE`); its RDP accountant has no replace-one
analysis of Poisson sampling, so a replace-one RDP ε exists for full-batch steps only (the Gaussian
at twice the sensitivity) and is NaN otherwise.

PLD with a 1e-4 loss discretisation (pessimistic, connect-the-dots) is the certificate. Each
step's PLD is dp-accounting's, built by `gaussian_pld` (δ(ε) vectorised) with a noise-mass
truncation that follows δ (`log_truncation_bound`); steps compose with dp-accounting's FFT, and a
composition is extended from its longest known prefix (a ledger's history grows one round at a
time). Calibration searches on a coarser 1e-3 grid (ten times faster, never optimistic) and then
certifies on the fine grid.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import NamedTuple

import dp_accounting
import numpy as np
from dp_accounting import dp_event, pld, rdp
from dp_accounting.rdp import rdp_privacy_accountant

from fedprivacy.privacy.gaussian_pld import gaussian_pld
from fedprivacy.privacy.pld_dense import compose, epsilon_for_delta

ADJACENCY = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
ADD_REMOVE, REPLACE_ONE = "add-remove", "replace-one"
NEIGHBOURS = (ADD_REMOVE, REPLACE_ONE)
CERTIFICATE_DISCRETIZATION = 1e-4
SEARCH_DISCRETIZATION = 1e-3
CALIBRATION_TOLERANCE = 0.005  # bisection tolerance; a calibrated σ's certified ε lands in [(1 - 2·tol)·target, target]
DEFAULT_LOG_TRUNCATION = -50.0  # dp-accounting's default noise-mass truncation (ln)
TRUNCATION_SHARE_OF_DELTA = 1e-3  # all steps together leave out at most this share of δ ...
REFERENCE_STEPS = 10**6  # ... in runs of up to this many steps (longer runs: slightly more, still pessimistic)


class _UnconvergedOrders(logging.Filter):
    """Drops dp-accounting's note that an RDP order failed to converge and was excluded.

    Excluding an order can only make the RDP ε larger (conservative), and the note repeats for
    every composition at small σ; its other warnings (negative divergences) stay visible.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in str(record.msg)


logging.getLogger("absl").addFilter(_UnconvergedOrders())


@contextmanager
def _root_logger_left_alone() -> Iterator[None]:
    """absl's logging functions, through which the RDP accountant warns, call `logging.basicConfig()`
    when the root logger has no handler, and from then on every INFO record of the application's
    loggers prints (a sweep's progress bars were interleaved with the server's round lines). While
    the accountant runs, Python's last-resort handler stands in: warnings reach stderr, as with no
    handler at all, and the root logger is as it was after."""
    root = logging.getLogger()
    if root.handlers or logging.lastResort is None:
        yield
        return
    root.addHandler(logging.lastResort)
    try:
        yield
    finally:
        root.removeHandler(logging.lastResort)


class NoiseEvent(NamedTuple):
    """`count` consecutive steps with noise multiplier `sigma` and sampling rate `sampling_rate`.

    A named tuple, not a dataclass: histories of them are hashed on every ε query (cache keys),
    and a tuple hashes in C.
    """

    sigma: float
    sampling_rate: float
    count: int


def dp_event_of(events: Sequence[NoiseEvent]) -> dp_event.DpEvent:
    """The events as dp-accounting's `DpEvent` (each a self-composed, Poisson-sampled Gaussian)."""
    parts: list[dp_event.DpEvent] = []
    for event in events:
        if event.count <= 0:
            continue
        step: dp_event.DpEvent = dp_event.GaussianDpEvent(event.sigma)
        if event.sampling_rate < 1.0:
            step = dp_event.PoissonSampledDpEvent(event.sampling_rate, step)
        parts.append(dp_event.SelfComposedDpEvent(step, event.count))
    return dp_event.ComposedDpEvent(parts)


def log_truncation_bound(delta: float) -> float:
    """ln of the noise mass one step's PLD may leave out of its loss grid.

    dp-accounting counts the left-out mass as infinite loss, so it only ever makes ε larger (never
    optimistic). Its default, e^-50, is far smaller than any δ needs and makes the loss grid (one
    Python call per point) 1.7× longer than it must be. Here all steps of a run of up to
    REFERENCE_STEPS steps together leave out at most TRUNCATION_SHARE_OF_DELTA·δ: ε moves by less
    than the grid's own rounding. It depends on δ alone, not on the run's length, so a run's
    composition can be extended step by step (`_composed_pld`) instead of redone from the start.
    """
    return max(DEFAULT_LOG_TRUNCATION, math.log(TRUNCATION_SHARE_OF_DELTA * delta / (2 * REFERENCE_STEPS)))


@lru_cache(maxsize=256)
def _step_pld(
    event: NoiseEvent, discretization: float, log_truncation: float
) -> pld.privacy_loss_distribution.PrivacyLossDistribution:
    """The PLD of `event.count` steps, built as dp-accounting's PLDAccountant builds it, except that
    one step is its own PLD: dp-accounting's `self_compose(1)` returns the same loss grid (its
    probabilities through an FFT round trip, within 4e-18) with 1e-15 more infinity mass, a bound on
    a truncation it does not make, after computing that bound (6 ms, more than a whole round's
    accounting, when a plan's rounds drop from 2 steps to 1)."""
    if event.sampling_rate >= 1.0:  # full-batch Gaussian steps compose exactly into one Gaussian
        return gaussian_pld(event.sigma / math.sqrt(event.count), 1.0, discretization, log_truncation)
    one_step = _one_step_pld(event.sigma, event.sampling_rate, discretization, log_truncation)
    return one_step if event.count == 1 else one_step.self_compose(event.count)


@lru_cache(maxsize=16)  # up to ~2 MB each at small σ
def _one_step_pld(
    sigma: float, sampling_rate: float, discretization: float, log_truncation: float
) -> pld.privacy_loss_distribution.PrivacyLossDistribution:
    """One subsampled Gaussian step's PLD (its loss grid: ~4 ms on the 2-core CI machine), shared
    by every step count of the same noise: a run whose rounds hold 2 steps, then 1, builds it once."""
    return gaussian_pld(sigma, sampling_rate, discretization, log_truncation)


_Composed = pld.privacy_loss_distribution.PrivacyLossDistribution
_COMPOSED: OrderedDict[tuple[tuple[NoiseEvent, ...], float, float], _Composed] = OrderedDict()
COMPOSED_CACHE_SIZE = 128


def _composed_pld(events: tuple[NoiseEvent, ...], delta: float, discretization: float) -> _Composed:
    """The left-fold composition of `events`, extending the longest prefix composed before.

    A ledger asks for history + one round, then history + two rounds, and clients with the same
    plan ask for the same histories: each round then costs one composition, not one per event of
    the whole history. The fold is the same as composing from scratch, so the result is too.
    """
    truncation = log_truncation_bound(delta)
    start, composed = 0, None
    for length in range(len(events), 0, -1):
        key = (events[:length], delta, discretization)
        if key in _COMPOSED:
            _COMPOSED.move_to_end(key)
            start, composed = length, _COMPOSED[key]
            break
    for length in range(start + 1, len(events) + 1):
        step = _step_pld(events[length - 1], discretization, truncation)
        composed = step if composed is None else compose(composed, step)
        _COMPOSED[(events[:length], delta, discretization)] = composed
        if len(_COMPOSED) > COMPOSED_CACHE_SIZE:
            _COMPOSED.popitem(last=False)
    assert composed is not None
    return composed


@lru_cache(maxsize=4096)
def _pld_epsilon_cached(events: tuple[NoiseEvent, ...], delta: float, discretization: float) -> float:
    active = tuple(e for e in events if e.count > 0)
    if not active:
        return 0.0
    if any(e.sigma <= 0 for e in active):
        return math.inf
    return epsilon_for_delta(_composed_pld(active, delta, discretization), delta)


def clear_caches() -> None:
    """Forget every cached composition and calibration (benchmarks time cold computations)."""
    for cached in (
        _pld_epsilon_cached,
        _rdp_epsilon_cached,
        _calibrate_pld_cached,
        _calibrate_rdp_cached,
        _step_pld,
        _one_step_pld,
        _replace_one_pld_epsilon,
    ):
        cached.cache_clear()
    _COMPOSED.clear()


@lru_cache(maxsize=4096)
@_root_logger_left_alone()
def _rdp_epsilon_cached(events: tuple[NoiseEvent, ...], delta: float) -> float:
    if not any(e.count > 0 for e in events):
        return 0.0
    accountant = rdp.RdpAccountant(neighboring_relation=ADJACENCY)
    accountant.compose(dp_event_of(events))
    return float(accountant.get_epsilon(delta))


def pld_epsilon(
    events: Sequence[NoiseEvent],
    delta: float,
    discretization: float = CERTIFICATE_DISCRETIZATION,
    neighbours: str = ADD_REMOVE,
) -> float:
    """ε of the composed events under the privacy-loss-distribution accountant."""
    if neighbours == REPLACE_ONE:
        return _replace_one_pld_epsilon(tuple(events), float(delta), float(discretization))
    return _pld_epsilon_cached(tuple(events), float(delta), float(discretization))


def rdp_epsilon(events: Sequence[NoiseEvent], delta: float, neighbours: str = ADD_REMOVE) -> float:
    """ε of the composed events under the Rényi-DP accountant (a looser cross-check)."""
    if neighbours == REPLACE_ONE:
        if any(e.sampling_rate < 1.0 for e in events if e.count > 0):
            return math.nan  # dp-accounting's RDP has no replace-one analysis of Poisson sampling
        events = [NoiseEvent(e.sigma / 2.0, e.sampling_rate, e.count) for e in events]  # sensitivity 2C
    return _rdp_epsilon_cached(tuple(events), float(delta))


@lru_cache(maxsize=1024)
def _replace_one_pld_epsilon(events: tuple[NoiseEvent, ...], delta: float, discretization: float) -> float:
    """dp-accounting's PLD accountant under replace-one neighbours (pessimistic, as the certificate)."""
    active = [e for e in events if e.count > 0]
    if not active:
        return 0.0
    if any(e.sigma <= 0 for e in active):
        return math.inf
    accountant = pld.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE,
        value_discretization_interval=discretization,
    )
    accountant.compose(dp_event_of(active))
    return float(accountant.get_epsilon(delta))


def constant_events(sigma: float, sampling_rate: float, steps: int) -> tuple[NoiseEvent, ...]:
    return (NoiseEvent(float(sigma), float(sampling_rate), int(steps)),)


def scaled_events(
    scale: float, sampling_rate: float, relative_segments: Sequence[tuple[float, int]]
) -> tuple[NoiseEvent, ...]:
    """Events for σ_t = scale·α_t, with α given as (α, count) segments."""
    return tuple(NoiseEvent(scale * alpha, sampling_rate, count) for alpha, count in relative_segments)


def _bisect_scale(
    epsilon_of: Callable[[float], float], target: float, low: float, high: float, tolerance: float
) -> float:
    """Smallest scale (to `tolerance` in ε) with epsilon_of(scale) ≤ target; ε decreases in scale."""
    while epsilon_of(high) > target:
        low, high = high, high * 2.0
    while epsilon_of(low) <= target:
        if low < 1e-6:
            return low
        high, low = low, low / 2.0
    for _ in range(200):
        if epsilon_of(high) >= (1.0 - tolerance) * target or high / low < 1.0 + 1e-9:
            break
        middle = math.sqrt(low * high)
        if epsilon_of(middle) <= target:
            high = middle
        else:
            low = middle
    return high


def calibrate_rdp(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    relative_segments: Sequence[tuple[float, int]],
) -> float:
    """Smallest scale whose RDP ε ≤ target (σ itself when the segments are ((1, T),))."""
    return _calibrate_rdp_cached(float(target_epsilon), float(delta), float(sampling_rate), tuple(relative_segments))


@lru_cache(maxsize=1024)
def _calibrate_rdp_cached(target, delta, rate, segments) -> float:
    return _bisect_scale(
        lambda s: rdp_epsilon(scaled_events(s, rate, segments), delta),
        target,
        0.5,
        2.0,
        CALIBRATION_TOLERANCE,
    )


def calibrate_pld(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    relative_segments: Sequence[tuple[float, int]],
    neighbours: str = ADD_REMOVE,
) -> float:
    """Smallest scale whose certified (fine-grid PLD) ε is ≤ target and within 1% of it."""
    return _calibrate_pld_cached(
        float(target_epsilon), float(delta), float(sampling_rate), tuple(relative_segments), neighbours
    )


@lru_cache(maxsize=1024)
def _calibrate_pld_cached(target, delta, rate, segments, neighbours=ADD_REMOVE) -> float:
    def coarse(scale: float) -> float:
        return pld_epsilon(scaled_events(scale, rate, segments), delta, SEARCH_DISCRETIZATION, neighbours)

    def fine(scale: float) -> float:
        return pld_epsilon(scaled_events(scale, rate, segments), delta, CERTIFICATE_DISCRETIZATION, neighbours)

    # RDP ≥ PLD: a good upper start (replace-one needs up to twice the noise: the search widens itself)
    start = _calibrate_rdp_cached(target, delta, rate, segments) * (2.0 if neighbours == REPLACE_ONE else 1.0)
    scale = _bisect_scale(coarse, target, start / 2.0, start, CALIBRATION_TOLERANCE / 2.0)
    if fine(scale) > target or fine(scale) < (1.0 - 2 * CALIBRATION_TOLERANCE) * target:
        scale = _bisect_scale(fine, target, scale / 1.05, scale * 1.05, CALIBRATION_TOLERANCE)
    return scale


def prefix_events(events: Sequence[NoiseEvent], steps: int) -> tuple[NoiseEvent, ...]:
    """The first `steps` steps of a run, as events (what a client has spent after them)."""
    prefix, remaining = [], int(steps)
    for event in events:
        take = min(event.count, remaining)
        if take > 0:
            prefix.append(NoiseEvent(event.sigma, event.sampling_rate, take))
        remaining -= take
    return tuple(prefix)


def pld_epsilon_curve(events: Sequence[NoiseEvent], delta: float, checkpoints: Sequence[int]) -> list[float]:
    """PLD ε after each of the given step counts (for ε-versus-steps figures).

    Uses the search grid: a figure needs shape, not a certificate.
    """
    return [pld_epsilon(prefix_events(events, stop), delta, SEARCH_DISCRETIZATION) for stop in checkpoints]


@_root_logger_left_alone()
def rdp_epsilon_curve(events: Sequence[NoiseEvent], delta: float, checkpoints: Sequence[int]) -> list[float]:
    """RDP ε after each of the given step counts.

    Rényi DP composes by adding its per-order values, so each segment's one-step RDP is computed
    once and scaled by the segment's steps in every prefix: the same ε as composing each prefix
    afresh (as `rdp_epsilon` does), with one subsampled-Gaussian computation per segment instead
    of one per checkpoint.
    """
    one_step = []
    for event in events:
        accountant = rdp.RdpAccountant(neighboring_relation=ADJACENCY)
        accountant.compose(dp_event_of([NoiseEvent(event.sigma, event.sampling_rate, 1)]))
        one_step.append(np.asarray(accountant.rdp, dtype=float))
    curve = []
    for stop in checkpoints:
        counts, remaining = [], int(stop)
        for event in events:  # each segment's steps among the first `stop`
            counts.append(max(0, min(event.count, remaining)))
            remaining -= counts[-1]
        if not any(counts):
            curve.append(0.0)
            continue
        # segments not reached add nothing (0·∞ would be NaN at orders where one step's RDP is ∞)
        total = sum(count * values for count, values in zip(counts, one_step, strict=True) if count)
        curve.append(float(rdp_privacy_accountant.compute_epsilon(accountant.orders, total, delta)[0]))
    return curve
