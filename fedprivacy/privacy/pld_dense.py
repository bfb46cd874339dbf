"""Two of dp-accounting's operations on dense privacy-loss distributions, each as numpy passes
instead of Python loops over the loss grid: ε for a target δ, and composition. A ledger asks for
one composition and one ε per round and history; every calibration step asks for ε.

ε(δ). dp-accounting's `get_epsilon_for_delta` walks the grid from the largest loss down (two
walks, one per adjacency), about 2.4 ms for a 20,000-point PMF. The walk accumulates the mass
above each loss and that mass discounted by e^−loss, and stops at the first loss below
ln((upper − δ)/lower). Here the same sums are prefix sums (sequential, in the same order, from
the same starting values), taken a chunk of the grid at a time, and the stopping point is found
by one comparison per chunk; the result equals dp-accounting's to rounding.

Composition. dp-accounting convolves the two PMFs (`scipy.signal.fftconvolve`) and then drops
each tail whose mass stays within half the truncation bound, finding where by adding the grid's
values one by one in Python (about 1.4 ms per PMF of a 60,000-point result, two PMFs per
composition). Here the same convolution, and the same running sums as cumulative sums taken a
chunk at a time: the result is dp-accounting's, bit for bit. The convolution calls SciPy's real
transforms directly (without `fftconvolve`'s argument handling) and keeps the second PMF's
transform, reused when the same round's PLD is composed again at the same padded length (a
growing history changes the length most rounds: 6 hits in the 38 compositions of a steady
20-round logreg run). Against `fftconvolve`, a steady 1,000-client logreg round's compositions
took 0.85–0.98 instead of 0.97–1.21 ms (docs/benchmarks.md). Both operations handle the two
adjacencies on two threads (SciPy's FFT and numpy release the GIL).

tests/test_privacy_accountants.py compares both with dp-accounting. They read the PMFs' fields,
which dp-accounting does not publish; this module is the only place that does, and falls back to
dp-accounting's own methods for any PMF it does not recognise.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np
from dp_accounting.pld import pld_pmf, privacy_loss_distribution
from scipy import fft

TAIL_MASS_TRUNCATION = 1e-15  # dp-accounting's default for composing two PLDs
SPECTRA_KEPT = 16  # transforms of recent second operands (~0.3 MB each for a 10,000-point round PMF)


def epsilon_for_delta(distribution: privacy_loss_distribution.PrivacyLossDistribution, delta: float) -> float:
    """The smallest ε ≥ 0 whose hockey-stick divergence is ≤ δ, over both adjacencies."""
    pmfs = [distribution._pmf_remove] if distribution._symmetric else [distribution._pmf_remove, distribution._pmf_add]
    if not all(isinstance(pmf, pld_pmf.DensePLDPmf) for pmf in pmfs):
        return max(pmf.get_epsilon_for_delta(delta) for pmf in pmfs)
    if len(pmfs) == 1:
        return _dense_epsilon(pmfs[0], delta)
    add = _adjacency_worker(os.getpid()).submit(_dense_epsilon, pmfs[1], delta)  # numpy releases the GIL too
    return max(_dense_epsilon(pmfs[0], delta), add.result())


def _dense_epsilon(pmf: pld_pmf.DensePLDPmf, delta: float, first_chunk: int = 8192) -> float:
    """The walk from the largest loss down, a chunk of the grid at a time (each chunk's sums
    starting from the previous chunk's totals: the same additions in the same order). The walk
    stops about a third of the way down a ledger's PMF, so the rest of the grid is never read."""
    infinity_mass = float(pmf._infinity_mass)
    if infinity_mass > delta:
        return math.inf
    probs = np.flip(np.asarray(pmf._probs, dtype=np.float64))  # largest loss first
    # the losses as dp-accounting counts them: the top loss, then one discretisation step less each time
    step = -float(pmf._discretization)
    loss, upper, lower = 0.0, infinity_mass, 0.0  # before the first loss is added
    start, size = 0, first_chunk
    while start < len(probs):
        chunk = probs[start : start + size]
        steps = np.full(len(chunk), step)
        if start == 0:
            steps[0] = (pmf._lower_loss + len(probs) - 1) * pmf._discretization
        losses = np.cumsum(np.concatenate(([loss], steps)))[1:]
        # masses before each loss of the chunk is added (index k) and after its last one
        # (past the stopping point the walk never goes, e^−loss may overflow: those entries are not read)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            uppers = np.cumsum(np.concatenate(([upper], chunk)))
            lowers = np.cumsum(np.concatenate(([lower], np.exp(-losses) * chunk)))
            reached = (
                (uppers[:-1] > delta) & (lowers[:-1] > 0) & (np.log((uppers[:-1] - delta) / lowers[:-1]) >= losses)
            )
        # a loss so large that e^−loss is 0 leaves the lower mass 0 while the upper one passes δ
        only_upper = (uppers[1:] >= delta) & (lowers[1:] == 0)
        stops = np.flatnonzero(reached | only_upper)
        if stops.size:
            k = int(stops[0])
            if not reached[k]:
                return max(0.0, float(losses[k]))
            upper, lower = float(uppers[k]), float(lowers[k])
            break
        loss, upper, lower = float(losses[-1]), float(uppers[-1]), float(lowers[-1])
        start, size = start + size, 2 * size
    if upper <= lower + delta:
        return 0.0
    return math.log((upper - delta) / lower)


def compose(
    first: privacy_loss_distribution.PrivacyLossDistribution,
    second: privacy_loss_distribution.PrivacyLossDistribution,
    tail_mass_truncation: float = TAIL_MASS_TRUNCATION,
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """`first.compose(second, tail_mass_truncation)`, with each tail found by one cumulative sum."""
    symmetric = first._symmetric and second._symmetric
    pairs = [(first._pmf_remove, second._pmf_remove)] + ([] if symmetric else [(first._pmf_add, second._pmf_add)])
    if not all(isinstance(pmf, pld_pmf.DensePLDPmf) for pair in pairs for pmf in pair):
        return first.compose(second, tail_mass_truncation)
    if len(pairs) == 1:
        return privacy_loss_distribution.PrivacyLossDistribution(_compose_dense(*pairs[0], tail_mass_truncation))
    # the two adjacencies' convolutions side by side: SciPy's FFT releases the GIL (2.3 → 1.5 ms on 2 cores)
    add = _adjacency_worker(os.getpid()).submit(_compose_dense, *pairs[1], tail_mass_truncation)
    remove = _compose_dense(*pairs[0], tail_mass_truncation)
    return privacy_loss_distribution.PrivacyLossDistribution(remove, add.result())


@lru_cache(maxsize=1)
def _adjacency_worker(pid: int) -> ThreadPoolExecutor:
    """One thread per process (a forked child inherits its parent's executor, not its thread)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="pld-compose")


def _compose_dense(a: pld_pmf.DensePLDPmf, b: pld_pmf.DensePLDPmf, tail_mass_truncation: float) -> pld_pmf.DensePLDPmf:
    a.validate_composable(b)
    probs = _convolve(a._probs, b._probs)
    infinity_mass = a._infinity_mass + b._infinity_mass - a._infinity_mass * b._infinity_mass
    offset, probs, right_tail = _truncate_tails(probs, tail_mass_truncation, a._pessimistic_estimate)
    return pld_pmf.DensePLDPmf(
        a._discretization,
        a._lower_loss + b._lower_loss + offset,
        probs,
        infinity_mass + right_tail,
        a._pessimistic_estimate,
    )


def _convolve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`scipy.signal.fftconvolve(a, b)`, bit for bit: the same padded length and the same real
    transforms, multiplied in the same order, with `b`'s transform taken from `_SPECTRA` when the
    same array was a second operand at this length before. Like SciPy, a one-point operand is a
    plain product."""
    if len(a) == 1 or len(b) == 1:
        return a * b
    size = len(a) + len(b) - 1
    length = fft.next_fast_len(size, real=True)
    return fft.irfft(fft.rfft(a, length) * _spectrum(b, length), length)[:size]


_SPECTRA: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()
_SPECTRA_LOCK = threading.Lock()  # the two adjacencies compose on two threads


def _new_lock_in_child() -> None:
    """A forked child gets a lock of its own (a copy taken while another thread held it would never open)."""
    global _SPECTRA_LOCK
    _SPECTRA_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def _spectrum(values: np.ndarray, length: int) -> np.ndarray:
    """`fft.rfft(values, length)`, kept by the array's identity (the entry holds the array, so its
    id cannot be reused while the entry lives). PMF arrays are never written after they are built."""
    key = (id(values), length)
    with _SPECTRA_LOCK:
        hit = _SPECTRA.get(key)
        if hit is not None and hit[0] is values:
            _SPECTRA.move_to_end(key)
            return hit[1]
    spectrum = fft.rfft(values, length)
    with _SPECTRA_LOCK:
        _SPECTRA[key] = (values, spectrum)
        if len(_SPECTRA) > SPECTRA_KEPT:
            _SPECTRA.popitem(last=False)
    return spectrum


def _truncate_tails(probs: np.ndarray, tail_mass_truncation: float, pessimistic: bool) -> tuple[int, np.ndarray, float]:
    """The longest prefix and suffix each holding at most half the truncation bound are cut; their
    mass moves to the first kept loss (left, pessimistic) and to infinity (right), or, optimistic,
    the right tail's mass to the last kept loss. Returns (prefix length, kept PMF, mass to infinity)."""
    if tail_mass_truncation == 0:
        return 0, probs, 0
    left = _prefix_within(probs, tail_mass_truncation / 2)
    right = max(len(probs) - _prefix_within(np.flip(probs), tail_mass_truncation / 2), left + 1)
    left_mass, right_mass = np.sum(probs[:left]), np.sum(probs[right:])
    kept = probs[left:right]
    if pessimistic:
        kept[0] += left_mass
        return left, kept, right_mass
    kept[-1] += right_mass
    return left, kept, 0


def _prefix_within(values: np.ndarray, threshold: float, first_chunk: int = 1024) -> int:
    """How many leading values add up to at most `threshold`, summed one after another. Tails are
    short next to the grid, so the running sum is taken a chunk at a time, each chunk's cumulative
    sum starting from the previous total (the same additions in the same order)."""
    total, start, size = 0.0, 0, first_chunk
    while start < len(values):
        sums = np.cumsum(np.concatenate(([total], values[start : start + size])))[1:]
        over = np.flatnonzero(sums > threshold)
        if over.size:
            return start + int(over[0])
        total, start, size = sums[-1], start + size, 2 * size
    return len(values)
