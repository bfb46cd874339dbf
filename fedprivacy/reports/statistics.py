"""The statistics behind a sweep report's claims: means with t-intervals, paired differences, binomial s.e.

A sweep has few seeds per setting (often 3 to 10), so an interval for a mean over seeds uses
Student's t with n − 1 degrees of freedom: the normal's 1.96 would be too narrow. Two settings run
on the same seeds share each seed's partition, initial weights and client sampling; the differences
taken seed by seed remove that shared part, so a paired interval can resolve a difference that two
overlapping per-setting intervals cannot. The binomial standard error sqrt(p(1 − p)/m) is the spread
a single run's accuracy p has from its m test rows alone: differences well inside it are differences
the test set cannot tell apart, however many rounds or clients the run had.

A report that reads a verdict off every pair makes many tests at once; `holm_adjusted` adjusts their
p-values by Holm's step-down (Holm 1979), which keeps the chance of any false verdict among them
at most the level, whatever the dependence between the tests.

A sweep whose grid varies `split-seed` has seeds nested in splits: each split cuts other rows into
the clients' training and test sets. `two_stage_interval` takes each split's mean over its seeds,
then the t-interval over those split means (splits − 1 degrees of freedom), so the interval covers
the variation between splits as well as between seeds; with one split it is the interval over seeds.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    """A mean over n values and its two-sided t-interval; `sd`, `low`, `high` are None when n < 2."""

    n: int
    mean: float
    sd: float | None
    low: float | None
    high: float | None

    @property
    def excludes_zero(self) -> bool:
        """True when there is an interval and 0 lies outside it (an end at exactly 0 counts as inside)."""
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """mean ± t_{(1+confidence)/2, n−1} · s / √n over `values` (s: the sample s.d., n − 1 in its divisor)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("an interval needs at least one value")
    mean = float(x.mean())
    if x.size < 2:
        return Interval(1, mean, None, None, None)
    sd = float(x.std(ddof=1))
    half = float(stats.t.ppf(0.5 + confidence / 2, x.size - 1)) * sd / math.sqrt(x.size)
    return Interval(int(x.size), mean, sd, mean - half, mean + half)


def two_stage_interval(
    values: Sequence[float], splits: Sequence[Hashable] | None = None, confidence: float = CONFIDENCE
) -> Interval:
    """Seeds nested in splits: with 2 or more distinct `splits` (each value's split), the t-interval over
    the split means (each split's mean over its values, n = splits); else `t_interval(values)`."""
    x = np.asarray(values, dtype=float)
    if splits is None or len(set(splits)) < 2:
        return t_interval(x, confidence)
    if len(splits) != x.size:
        raise ValueError("every value needs its split")
    means: dict[Hashable, list[float]] = {}
    for split, value in zip(splits, x):
        means.setdefault(split, []).append(float(value))
    return t_interval([float(np.mean(found)) for found in means.values()], confidence)


@dataclass(frozen=True)
class PairedDifference:
    """b − a over the units both ran (seeds, or (split, seed) pairs), unit by unit, and the interval
    of their mean (`two_stage_interval`'s: over split means when 2 or more splits are shared)."""

    seeds: tuple[Hashable, ...]
    interval: Interval
    splits: int | None = None  # the shared splits, when units are (split, seed) pairs

    @property
    def resolved(self) -> bool:
        """The interval excludes 0: with fewer than 2 shared seeds there is none, so never resolved."""
        return self.interval.excludes_zero

    @property
    def p_value(self) -> float | None:
        """The two-sided paired t-test's p-value of a mean difference of 0 (n − 1 degrees of freedom,
        the interval's own t): None with fewer than 2 shared seeds; a zero sd gives 0 for a non-zero
        mean and 1 for a zero one."""
        interval = self.interval
        if interval.sd is None:
            return None
        if interval.sd == 0:
            return 0.0 if interval.mean != 0 else 1.0
        t = interval.mean / (interval.sd / math.sqrt(interval.n))
        return float(2 * stats.t.sf(abs(t), interval.n - 1))


def paired_difference(
    a: Mapping[Hashable, float], b: Mapping[Hashable, float], nested: bool = False
) -> PairedDifference | None:
    """The per-seed differences b[s] − a[s] over the seeds in both (in a's order); None when none is shared.
    `nested`: the keys are (split, seed) pairs, and the interval is `two_stage_interval`'s over splits."""
    seeds = tuple(seed for seed in a if seed in b)
    if not seeds:
        return None
    differences = [b[seed] - a[seed] for seed in seeds]
    if not nested:
        return PairedDifference(seeds, t_interval(differences))
    splits = [split for split, _ in seeds]
    return PairedDifference(seeds, two_stage_interval(differences, splits), len(set(splits)))


def holm_adjusted(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's (1979) step-down adjustment over the p-values given (None: out of the family, and None
    back): with the m of them sorted ascending, the i-th becomes max over j ≤ i of min(1, (m − j + 1)·p_j)."""
    family = sorted((p, index) for index, p in enumerate(p_values) if p is not None)
    adjusted: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, index) in enumerate(family):
        running = max(running, min(1.0, (len(family) - rank) * p))
        adjusted[index] = running
    return adjusted


def binomial_se(accuracy: float, evaluation_rows: float | None) -> float | None:
    """sqrt(p(1 − p)/m): the standard error of an accuracy p measured on m test rows; None without m."""
    if evaluation_rows is None or not evaluation_rows > 0 or accuracy is None or math.isnan(accuracy):
        return None
    return math.sqrt(accuracy * (1 - accuracy) / evaluation_rows)
