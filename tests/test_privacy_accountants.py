"""Certified ε and calibrated σ, checked against dp-accounting called directly in the test."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from dp_accounting.pld.privacy_loss_mechanism import AdjacencyType, GaussianPrivacyLoss
from forking import child_exit_code, fork_running
from independent import (
    CERTIFICATE_REL_TOL,
    plan_prefix_events,
    pld_epsilon,
    pld_epsilon_lower_bound,
    rdp_epsilon,
)

from fedprivacy.errors import InputError
from fedprivacy.privacy import accountants, pld_dense
from fedprivacy.privacy import gaussian_pld as gaussian_pld_module
from fedprivacy.privacy.planner import plan_client
from fedprivacy.privacy.pld_dense import compose as compose_plds
from fedprivacy.privacy.pld_dense import epsilon_for_delta


def test_reference_values_from_the_notes():
    events = accountants.constant_events(1.1, 256 / 60000, 14062)
    assert accountants.pld_epsilon(events, 1e-5) == pytest.approx(2.382, abs=2e-3)
    assert accountants.rdp_epsilon(events, 1e-5) == pytest.approx(2.597, abs=2e-3)
    events = accountants.constant_events(10.0, 4096 / 50000, 875)
    assert accountants.rdp_epsilon(events, 1e-5) == pytest.approx(0.988, abs=2e-3)
    assert accountants.pld_epsilon(events, 1e-5) == pytest.approx(0.903, abs=2e-3)


@pytest.mark.parametrize("rule", ["proactive", "calibrated", "calibrated-rdp", "adp"])
@pytest.mark.parametrize("n, eps, delta", [(5736, 1.0, 1e-5), (2983, 0.5, 0.9 / 2983), (1200, 4.0, 1e-6)])
def test_every_certified_epsilon_matches_independent_dp_accounting(rule, n, eps, delta):
    plan = plan_client(n, eps, delta, rule=rule, compare=False)  # every rule is accepted at these inputs
    assert sum(count for _, count in plan.noise_segments) == plan.steps
    runs = [(sigma, plan.sampling_rate, count) for sigma, count in plan.noise_segments]
    assert plan.epsilon_pld == pytest.approx(pld_epsilon(runs, delta), rel=CERTIFICATE_REL_TOL)
    assert plan.epsilon_rdp == pytest.approx(rdp_epsilon(runs, delta), rel=1e-9)
    assert plan.epsilon_pld <= eps
    assert plan.epsilon_rdp >= plan.epsilon_pld * 0.999  # RDP is the looser bound


@pytest.mark.parametrize(
    "eps, delta, q, steps",
    [
        (1.0, 1e-5, 0.1, 50),
        (0.25, 1e-5, 0.03, 128),
        (2.0, 1 / 5736, 0.2, 25),
        (1.0, 1e-5, 0.01, 10_000),
        (8.0, 1e-6, 1.0, 3),
    ],
)
def test_pld_calibration_is_within_one_percent_below_target(eps, delta, q, steps):
    sigma = accountants.calibrate_pld(eps, delta, q, ((1.0, steps),))
    certified = pld_epsilon([(sigma, q, steps)], delta)
    assert 0.99 * eps <= certified <= eps * (1 + CERTIFICATE_REL_TOL)


def test_rdp_calibration_is_within_one_percent_below_target():
    sigma = accountants.calibrate_rdp(1.0, 1e-5, 0.05, ((1.0, 200),))
    assert 0.99 <= rdp_epsilon([(sigma, 0.05, 200)], 1e-5) <= 1.0


def test_calibrated_plan_reclaims_the_budget_the_proactive_plan_leaves():
    proactive = plan_client(5736, 1.0, 1e-5, rule="proactive", compare=False)
    calibrated = plan_client(5736, 1.0, 1e-5, rule="calibrated", compare=False)
    assert (calibrated.sampling_rate, calibrated.steps) == (proactive.sampling_rate, proactive.steps)
    assert proactive.budget_unused > 0.3  # the rule spends about half (notes/privacy.md §2)
    assert calibrated.sigma < proactive.sigma
    assert 0 <= calibrated.budget_unused <= 0.01


def test_adp_plan_certifies_its_schedule_step_by_step():
    plan = plan_client(3000, 2.0, 1e-5, rule="adp", epochs=10, compare=False)
    sigmas = [s for s, _ in plan.noise_segments]
    assert len(plan.noise_segments) > 1 and sigmas == sorted(sigmas)  # α_t = 1/sqrt(η_t) grows as η_t decays
    assert plan.noise_multiplier(0) == pytest.approx(plan.sigma)
    runs = [(sigma, plan.sampling_rate, count) for sigma, count in plan.noise_segments]
    assert 0.99 * 2.0 <= pld_epsilon(runs, 1e-5) <= 2.0 * (1 + CERTIFICATE_REL_TOL)


def test_split_events_compose_like_one_event():
    whole = accountants.pld_epsilon(accountants.constant_events(2.0, 0.05, 300), 1e-5)
    parts = [accountants.NoiseEvent(2.0, 0.05, 100), accountants.NoiseEvent(2.0, 0.05, 200)]
    assert accountants.pld_epsilon(parts, 1e-5) == pytest.approx(whole, rel=1e-3)
    assert accountants.prefix_events(parts, 150) == (
        accountants.NoiseEvent(2.0, 0.05, 100),
        accountants.NoiseEvent(2.0, 0.05, 50),
    )


def test_epsilon_curve_grows_with_steps_and_ends_at_the_certificate():
    events = accountants.constant_events(3.0, 0.1, 64)
    curve = accountants.pld_epsilon_curve(events, 1e-5, [1, 8, 32, 64])
    assert curve == sorted(curve)
    assert curve[-1] == pytest.approx(accountants.pld_epsilon(events, 1e-5), rel=0.01)


@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-12, 1e-30])
def test_noise_mass_left_out_stays_a_small_share_of_delta(delta):
    """All steps of a run of up to 10⁶ steps together leave out at most 1e-3·δ of noise mass (two
    tails per step), or dp-accounting's own e^-50 per step where that would be stricter."""
    bound = accountants.log_truncation_bound(delta)
    assert bound >= accountants.DEFAULT_LOG_TRUNCATION
    steps = accountants.REFERENCE_STEPS
    assert bound == accountants.DEFAULT_LOG_TRUNCATION or 2 * steps * math.exp(bound) <= 1.0001e-3 * delta


def test_a_composition_extended_round_by_round_equals_one_made_at_once():
    """The ledger's history grows one round at a time; extending the cached prefix must give
    exactly what composing the whole history from scratch gives."""
    rounds = [
        accountants.NoiseEvent(2.0, 0.05, 7),
        accountants.NoiseEvent(1.5, 0.05, 3),
        accountants.NoiseEvent(2.0, 0.05, 7),
    ]
    grown = [accountants.pld_epsilon(rounds[: i + 1], 1e-5) for i in range(len(rounds))]
    accountants.clear_caches()
    assert accountants.pld_epsilon(rounds, 1e-5) == grown[-1]  # bit for bit
    assert grown == sorted(grown)
    assert grown[-1] == pytest.approx(
        pld_epsilon([(e.sigma, e.sampling_rate, e.count) for e in rounds], 1e-5), rel=CERTIFICATE_REL_TOL
    )


def test_rounds_of_different_lengths_build_one_step_of_noise_once():
    """A run whose rounds hold 2 steps, then 1, builds the one-step loss grid once; a 2-step
    round's PLD is that step composed twice (bit for bit what a fresh grid gives), a 1-step round's
    is the step's own grid, and the ε is dp-accounting's independent one."""
    accountants.clear_caches()
    rounds = [
        accountants.NoiseEvent(3.0, 0.1, 2),
        accountants.NoiseEvent(3.0, 0.1, 2),
        accountants.NoiseEvent(3.0, 0.1, 1),
    ]
    epsilon = accountants.pld_epsilon(rounds, 1e-5)
    assert accountants._one_step_pld.cache_info().misses == 1
    assert accountants._step_pld.cache_info().misses == 2  # 2 steps, 1 step
    truncation = accountants.log_truncation_bound(1e-5)
    fresh_step = gaussian_pld_module.gaussian_pld(3.0, 0.1, accountants.CERTIFICATE_DISCRETIZATION, truncation)
    for count, fresh in ((1, fresh_step), (2, fresh_step.self_compose(2))):
        shared = accountants._step_pld(
            accountants.NoiseEvent(3.0, 0.1, count), accountants.CERTIFICATE_DISCRETIZATION, truncation
        )
        for a, b in ((shared._pmf_remove, fresh._pmf_remove), (shared._pmf_add, fresh._pmf_add)):
            assert (a._lower_loss, a._infinity_mass) == (b._lower_loss, b._infinity_mass) and np.array_equal(
                a._probs, b._probs
            )
    assert epsilon == pytest.approx(
        pld_epsilon([(e.sigma, e.sampling_rate, e.count) for e in rounds], 1e-5), rel=CERTIFICATE_REL_TOL
    )


@pytest.mark.parametrize(
    "sigma, q, steps, delta", [(0.8, 0.02, 3000, 1e-12), (2.0, 0.1, 200, 1e-30), (5.0, 1.0, 40, 1e-9)]
)
def test_truncated_certificate_stays_an_upper_bound_at_tiny_delta(sigma, q, steps, delta):
    """Where dp-accounting's own composition is noisy (see tests/independent.py), the certificate
    still lies above an optimistic estimate of the true ε and within 1% of PLDAccountant."""
    certified = accountants.pld_epsilon(accountants.constant_events(sigma, q, steps), delta)
    assert (
        pld_epsilon_lower_bound(sigma, q, steps, delta) <= certified <= 1.01 * pld_epsilon([(sigma, q, steps)], delta)
    )


SUBSAMPLED = [(0.5, 1e-4), (0.8, 0.02), (1.0, 0.3), (3.0, 0.5)]


@pytest.mark.parametrize(
    "adjacency, sigma, q",
    [(AdjacencyType.REMOVE, 2.0, 1.0)]  # at q = 1 one PMF serves both adjacencies
    + [
        (adjacency, sigma, q)
        for adjacency in AdjacencyType
        if adjacency != AdjacencyType.REPLACE
        for sigma, q in SUBSAMPLED
    ],
)
def test_vectorised_hockey_stick_equals_dp_accounting_point_by_point(adjacency, sigma, q):
    """gaussian_pld's δ(ε) is dp-accounting's GaussianPrivacyLoss.get_delta_for_epsilon, to rounding,
    over the whole loss range the connect-the-dots grid covers (and past both ends)."""
    ours = gaussian_pld_module._GaussianLoss(sigma, sampling_prob=q, adjacency_type=adjacency)
    reference = GaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=adjacency)
    bounds = reference.connect_dots_bounds()
    span = bounds.epsilon_upper - bounds.epsilon_lower
    epsilons = np.linspace(bounds.epsilon_lower - 0.1 * span, bounds.epsilon_upper + 0.1 * span, 4001)
    np.testing.assert_allclose(
        ours.get_delta_for_epsilon(epsilons), reference.get_delta_for_epsilon(epsilons), rtol=1e-9, atol=1e-15
    )
    assert ours.get_delta_for_epsilon(0.5) == pytest.approx(reference.get_delta_for_epsilon(0.5), rel=1e-12)


@pytest.mark.parametrize(
    "sigma, q, steps, delta, grid",
    [
        (5.0, 0.125, 20, 1e-5, 1e-3),
        (1.1, 0.01, 300, 1e-5, 1e-3),
        (0.6, 0.2, 3, 1e-6, 1e-3),
        (2.0, 1.0, 50, 1e-5, 1e-3),
        (0.02, 1.0, 1, 1e-5, 0.1),  # losses so large that e^-loss underflows: ε is the loss reached
        (60.0, 0.01, 1, 0.5, 1e-3),  # a δ the distribution meets at ε = 0
        (0.3, 0.5, 40, 1e-16, 1e-3),
    ],  # more mass at infinity than δ: no finite ε
)
def test_vectorised_epsilon_for_delta_equals_dp_accounting(sigma, q, steps, delta, grid):
    """The ledger's and the calibrations' ε(δ) is dp-accounting's get_epsilon_for_delta on the same
    composed PLD (dp-accounting's own PLD here, both adjacencies), to rounding."""
    from dp_accounting.pld.privacy_loss_distribution import from_gaussian_mechanism

    distribution = from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=grid).self_compose(
        steps
    )
    reference = distribution.get_epsilon_for_delta(delta)
    ours = epsilon_for_delta(distribution, delta)
    assert ours == reference or ours == pytest.approx(reference, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(
    "sigma, q, steps, delta, grid",
    [
        (5.0, 0.125, 20, 1e-5, 1e-4),
        (1.1, 0.01, 300, 1e-5, 1e-3),
        (2.0, 1.0, 50, 1e-5, 1e-3),
        (0.02, 1.0, 1, 1e-5, 0.1),
        (60.0, 0.01, 5, 0.5, 1e-3),
        (0.3, 0.5, 40, 1e-16, 1e-3),
    ],
)
def test_epsilon_walk_by_chunks_equals_the_walk_over_the_whole_grid(sigma, q, steps, delta, grid):
    """ε(δ) walks the grid a chunk at a time and stops at the chunk holding the answer: exactly the
    ε of one pass over the whole grid, whatever the chunk size, on every path (a finite ε, a loss
    whose e^−loss underflows, ε = 0, no finite ε)."""
    from dp_accounting.pld.privacy_loss_distribution import from_gaussian_mechanism

    from fedprivacy.privacy.pld_dense import _dense_epsilon

    distribution = from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=grid).self_compose(
        steps
    )
    for pmf in (distribution._pmf_remove, distribution._pmf_add):
        whole = _dense_epsilon(pmf, delta, first_chunk=len(pmf._probs))
        assert whole == pmf.get_epsilon_for_delta(delta) or whole == pytest.approx(
            pmf.get_epsilon_for_delta(delta), rel=1e-12, abs=1e-15
        )
        for chunk in (1, 3, 64, 2048):
            assert _dense_epsilon(pmf, delta, first_chunk=chunk) == whole


@pytest.mark.parametrize(
    ("first", "second", "grid", "pessimistic", "tail"),
    [
        ((5.0, 0.125, 11), (5.0, 0.125, 10), 1e-3, True, 1e-15),  # a ledger's history and its next round
        ((1.1, 0.01, 300), (0.9, 0.02, 7), 1e-3, True, 1e-15),  # other σ and q: both adjacencies differ
        ((2.0, 1.0, 50), (3.0, 1.0, 1), 1e-3, True, 1e-15),  # full-batch steps: symmetric PLDs
        ((5.0, 0.125, 11), (2.0, 1.0, 3), 1e-3, True, 1e-15),  # one symmetric, one not
        ((0.6, 0.2, 3), (0.6, 0.2, 3), 1e-2, True, 1e-15),  # a coarse grid: short PMFs
        ((5.0, 0.125, 11), (5.0, 0.125, 10), 1e-3, False, 1e-15),  # optimistic rounding: the right tail stays
        ((5.0, 0.125, 11), (5.0, 0.125, 10), 1e-3, True, 1.5),  # tails that would overlap: one loss is kept
        ((5.0, 0.125, 11), (5.0, 0.125, 10), 1e-3, True, 0.0),
    ],  # no truncation at all
)
def test_vectorised_composition_equals_dp_accounting_bit_for_bit(first, second, grid, pessimistic, tail, monkeypatch):
    """The ledger composes a history with its next round as dp-accounting's compose does: the same
    loss grid, offset, probabilities and infinity mass, exactly (not to rounding), also when the
    round's transform comes from the cache (one forward FFT per adjacency instead of two)."""
    from dp_accounting.pld.privacy_loss_distribution import from_gaussian_mechanism
    from scipy import fft as scipy_fft

    class CountingFFT:
        """SciPy's FFT module, counting forward transforms (from both adjacencies' threads: a
        list's append is atomic, `+= 1` on a counter is not)."""

        def __init__(self) -> None:
            self.calls: list[None] = []

        def __getattr__(self, name: str):
            return getattr(scipy_fft, name)

        @property
        def forward(self) -> int:
            return len(self.calls)

        def rfft(self, *args, **kwargs):
            self.calls.append(None)
            return scipy_fft.rfft(*args, **kwargs)

    counting = CountingFFT()
    monkeypatch.setattr(pld_dense, "fft", counting)

    def distribution(sigma, q, steps):
        return from_gaussian_mechanism(
            sigma, sampling_prob=q, value_discretization_interval=grid, pessimistic_estimate=pessimistic
        ).self_compose(steps)

    a, b = distribution(*first), distribution(*second)
    pld_dense._SPECTRA.clear()
    forward = []
    # b's transforms computed, then taken from the cache, then (a longer history) maybe at another length
    for history in (a, a, a.compose(b, tail)):
        before = counting.forward
        reference, ours = history.compose(b, tail), compose_plds(history, b, tail)
        forward.append(counting.forward - before)
        assert ours._symmetric == reference._symmetric
        for mine, theirs in [(ours._pmf_remove, reference._pmf_remove), (ours._pmf_add, reference._pmf_add)]:
            assert mine._lower_loss == theirs._lower_loss
            assert mine._infinity_mass == theirs._infinity_mass
            assert np.array_equal(mine._probs, theirs._probs)
        assert ours.get_epsilon_for_delta(1e-5) == reference.get_epsilon_for_delta(1e-5)
    # the same round at the same length: only the history's transform is computed, one per adjacency
    # (the first call also transforms the round: once or, for a symmetric round whose two adjacencies
    # share one array and race to it, twice)
    adjacencies = 1 if a._symmetric and b._symmetric else 2
    assert forward[1] == adjacencies < forward[0]


@pytest.mark.parametrize("chunk", [1, 2, 7, 1024])
def test_tail_search_by_chunks_adds_the_values_one_after_another(chunk):
    """The tail search sums a chunk at a time, each from the previous total: the same additions,
    in the same order, as adding the values one by one (dp-accounting's loop)."""
    from fedprivacy.privacy.pld_dense import _prefix_within

    values = np.random.default_rng(3).exponential(1e-17, 5000)
    for threshold in [0.0, 1e-17, 5e-16, 3e-14, values.sum() * 2]:
        total, expected = 0, len(values)
        for k, value in enumerate(values):
            total += value
            if total > threshold:
                expected = k
                break
        assert _prefix_within(values, threshold, first_chunk=chunk) == expected


def test_a_forked_process_composes_as_its_parent_did():
    """Composition hands one adjacency to a worker thread; a forked child inherits the executor but
    not its thread, so it must get its own (else its first composition waits forever)."""
    from dp_accounting.pld.privacy_loss_distribution import from_gaussian_mechanism

    a = from_gaussian_mechanism(2.0, sampling_prob=0.1, value_discretization_interval=1e-3).self_compose(5)
    expected = compose_plds(a, a).get_epsilon_for_delta(1e-5)
    child = fork_running(lambda: compose_plds(a, a).get_epsilon_for_delta(1e-5) == expected)
    assert child_exit_code(child, "its composition") == 0


def test_composing_sparse_distributions_falls_back_to_dp_accounting():
    """PMFs that are not dense (a single step of a coarse mechanism) compose by dp-accounting's own method."""
    from dp_accounting.pld.privacy_loss_distribution import from_randomized_response

    a = from_randomized_response(0.3, 2, value_discretization_interval=1e-2)
    reference, ours = a.compose(a), compose_plds(a, a)
    assert type(ours._pmf_remove) is type(reference._pmf_remove)
    assert ours.get_epsilon_for_delta(1e-5) == reference.get_epsilon_for_delta(1e-5)


@pytest.mark.parametrize("rule", ["calibrated", "adp"])
def test_the_rdp_curve_equals_composing_every_prefix_independently(rule):
    """The figures' RDP curve scales one step's RDP per segment; dp-accounting composes each prefix whole."""
    plan = plan_client(1200, 2.0, 1e-5, rule=rule, rounds=3, compare=False)
    events = [accountants.NoiseEvent(sigma, plan.sampling_rate, count) for sigma, count in plan.noise_segments]
    checkpoints = [0, 1, 2, plan.steps // 3, plan.steps // 2 + 1, plan.steps - 1, plan.steps]
    expected = [0.0] + [rdp_epsilon(plan_prefix_events(plan.to_dict(), stop), plan.delta) for stop in checkpoints[1:]]
    assert accountants.rdp_epsilon_curve(events, plan.delta, checkpoints) == pytest.approx(expected, rel=1e-9)


def test_the_rdp_accountant_leaves_an_unconfigured_root_logger_alone():
    """dp-accounting warns through absl, whose first warning would configure the root logger
    (`logging.basicConfig`): an application's INFO records would print from then on. In a fresh
    interpreter (pytest configures its own root handlers), σ small enough to make some RDP orders
    fail to converge leaves the root logger without handlers, and prints nothing."""
    script = (
        "import logging\n"
        "from fedprivacy.privacy.accountants import NoiseEvent, rdp_epsilon, rdp_epsilon_curve\n"
        "absl = []\n"
        "logging.getLogger('absl').filters.insert(0, lambda record: absl.append(record.msg) or True)\n"
        "rdp_epsilon([NoiseEvent(0.5, 0.5, 10)], 1e-5)\n"
        "rdp_epsilon_curve([NoiseEvent(0.4, 0.5, 10)], 1e-5, [5, 10])\n"
        "assert absl, 'these σ no longer make absl warn: pick smaller ones'\n"
        "logging.getLogger('server').setLevel(logging.INFO)\n"
        "logging.getLogger('server').info('an INFO record of the application')\n"
        "print(len(logging.getLogger().handlers))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0" and "an INFO record" not in result.stderr


@pytest.mark.parametrize("n, eps, delta", [(5736, 1.0, 1e-5), (2572, 0.25, 1e-5), (1200, 8.0, 1e-6)])
def test_the_rdp_calibrated_rule_takes_the_smallest_sigma_that_rdp_certifies(n, eps, delta):
    """Against dp-accounting's RdpAccountant directly: σ meets ε by RDP, 1% less σ does not; the PLD
    certificate of the same plan is below it (RDP is the looser accountant)."""
    plan = plan_client(n, eps, delta, rule="calibrated-rdp", compare=False)
    runs = [(plan.sigma, plan.sampling_rate, plan.steps)]
    assert rdp_epsilon(runs, delta) <= eps * (1 + 1e-9)
    assert rdp_epsilon([(plan.sigma * 0.99, plan.sampling_rate, plan.steps)], delta) > eps
    assert plan.epsilon_pld == pytest.approx(pld_epsilon(runs, delta), rel=CERTIFICATE_REL_TOL)
    assert plan.epsilon_pld < eps
    assert plan.sigma > plan_client(n, eps, delta, rule="calibrated", compare=False).sigma


def test_the_rdp_calibrated_rule_refuses_replace_one_neighbours():
    with pytest.raises(InputError) as refused:
        plan_client(5736, 1.0, 1e-5, rule="calibrated-rdp", neighbours="replace-one", compare=False)
    assert "rule='calibrated-rdp'" in str(refused.value) and "replace-one" in str(refused.value)
