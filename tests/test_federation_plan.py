"""The federation's client-level plan (DP-FedAvg, McMahan et al. 2018), planned a priori: its σ
from the proactive rule's closed form, its certificate against dp-accounting's PLD and RDP for the
Poisson-sampled Gaussian over the rounds and against Flower's own RDP accountant, and
`fedprivacy plan --level federation` with its refusals."""

from __future__ import annotations

import json
import math

import pytest
from dp_accounting import dp_event, pld, rdp
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant as FlowerRdpAccountant

from fedprivacy.errors import InputError
from fedprivacy.privacy.federation import FEDERATION_ID, plan_federation

MEMBERS, EPSILON, DELTA, ROUNDS, COHORT = 1000, 2.0, 1e-5, 100, 100


def _rounds_event(sigma: float, rate: float, rounds: int) -> dp_event.DpEvent:
    return dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(rate, dp_event.GaussianDpEvent(sigma)), rounds)


@pytest.mark.parametrize("rule", ["proactive", "calibrated"])
def test_the_federations_certificate_is_dp_accountings_for_its_rounds(rule):
    plan = plan_federation(MEMBERS, EPSILON, DELTA, ROUNDS, rule=rule, expected_cohort=COHORT, compare=False)
    assert (plan.client_id, plan.n, plan.steps, plan.rounds) == (FEDERATION_ID, MEMBERS, ROUNDS, ROUNDS)
    assert plan.sampling_rate == COHORT / MEMBERS and plan.epochs == pytest.approx(COHORT * ROUNDS / MEMBERS)
    event = _rounds_event(plan.sigma, plan.sampling_rate, ROUNDS)
    certificate = pld.PLDAccountant(value_discretization_interval=1e-4)
    certificate.compose(event)
    assert plan.epsilon_pld == pytest.approx(certificate.get_epsilon(DELTA), rel=2e-3)
    renyi = rdp.RdpAccountant()
    renyi.compose(event)
    assert plan.epsilon_rdp == pytest.approx(renyi.get_epsilon(DELTA), rel=1e-9)
    assert plan.epsilon_pld <= EPSILON
    if rule == "proactive":  # σ = sqrt(2(ε + ln(1/δ))/ε), whatever the rounds and cohort
        assert plan.sigma == pytest.approx(math.sqrt(2 * (EPSILON + math.log(1 / DELTA)) / EPSILON), rel=1e-12)
    else:  # the smallest σ PLD certifies: its ε is close to the target
        assert plan.epsilon_pld >= 0.98 * EPSILON


def test_flowers_rdp_accountant_agrees_with_poisson_sampling_and_charges_far_more_without_it():
    """Flower's client-level accounting on the same noise and cohort: with Poisson sampling it is
    our RDP figure; the no-amplification model its fixed-clipping wrapper requires is many times larger."""
    plan = plan_federation(MEMBERS, EPSILON, DELTA, ROUNDS, rule="calibrated", expected_cohort=COHORT, compare=False)
    spent = {}
    for method in (SamplingMethod.POISSON, SamplingMethod.NO_AMPLIFICATION):
        accountant = FlowerRdpAccountant(PrivacyConfig(DELTA, MEMBERS, NeighboringRelation.ADD_OR_REMOVE_ONE, method))
        accountant.compose(GaussianPrivacyEvent(plan.sigma, COHORT, MEMBERS), count=ROUNDS)
        spent[method] = accountant.get_epsilon(DELTA)
    assert spent[SamplingMethod.POISSON] == pytest.approx(plan.epsilon_rdp, rel=1e-6)
    assert spent[SamplingMethod.NO_AMPLIFICATION] > 10 * plan.epsilon_pld


def test_the_default_participation_meets_the_proactive_log_m_condition():
    plan = plan_federation(MEMBERS, EPSILON, DELTA, ROUNDS, compare=False)
    smallest = next(k for k in range(1, 100) if (2 / math.e) ** 2 * k * k - 0.5 >= math.log(MEMBERS))
    assert plan.epochs == pytest.approx(smallest)  # the smallest k with (2/e)²k² − 1/2 ≥ ln M
    assert {c.name: c.met for c in plan.conditions}["epochs_vs_log_n"]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"participations": 5.0, "expected_cohort": 100.0}, "batch-size"),
        ({"participation_rate": 0.1, "participations": 5.0}, "sampling-rate"),
    ],
)
def test_two_ways_of_giving_the_cohort_are_refused_naming_the_second(options, field):
    with pytest.raises(InputError) as caught:
        plan_federation(MEMBERS, EPSILON, DELTA, ROUNDS, compare=False, **options)
    assert caught.value.field == field


PLAN = ("plan", "--n", str(MEMBERS), "--epsilon", "2")


def test_the_plan_command_plans_the_federation(fedprivacy_cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = fedprivacy_cli(*PLAN, "--level", "federation", "--rounds", "100", "--batch-size", "100", "--json")
    printed = json.loads(out)
    expected = plan_federation(MEMBERS, EPSILON, DELTA, ROUNDS, expected_cohort=COHORT, compare=False)
    assert code == 0 and printed["level"] == "federation" and printed["client_id"] == FEDERATION_ID
    assert "McMahan et al. 2018" in printed["released_mechanism"] and "federation-epsilon" in printed["enforced_by"]
    assert "learning_rate" not in printed and "adp" not in printed["sigma_by_rule"]
    assert (printed["sigma"], printed["steps"], printed["epsilon_pld"]) == (
        expected.sigma,
        ROUNDS,
        expected.epsilon_pld,
    )
    code, out, _ = fedprivacy_cli(*PLAN, "--level", "federation", "--rounds", "100", "--batch-size", "100")
    text = " ".join(out.split())
    assert code == 0 and "members M, ε, δ" in text and "expected cohort pM" in text and "McMahan et al. 2018" in text
    assert "federation-epsilon" in text and "σ adp" not in text


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--steps", "5"), "steps='5': a federation runs one noisy aggregation per round"),
        (("--out", "sheets"), "print the federation's plan with --json"),
        (("--rule", "adp"), "rule='adp': ADP-SGD's noise schedule follows a local step size"),
        (("--adjacency", "replace-one"), "add/remove of one member"),
        (("--learning-rate", "5"), "learning-rate='5.0': a federation's plan has no local step size"),
        (("--client-id", "x"), "client-id='x': the federation's plan is named 'federation'"),
        (("--batch-size", "2000"), "batch-size=2000.0: the expected cohort pM must be in [1, M] = [1, 1000]"),
        (("--delta", "0.002"), "must be in (0, 1/M) = (0, 0.001) for M = 1000 members"),
        (("--epochs", "500"), "participations per member k = pR must be in (0, R] = (0, 100]"),
        (("--batch-size", "1000"), "the federation's plan: rule proactive with σ=3.676, q=1, rounds=100 certifies"),
    ],
)
def test_the_federation_plan_refuses_record_level_options(fedprivacy_cli, args, words):
    code, _, err = fedprivacy_cli(*PLAN, "--level", "federation", "--rounds", "100", *args)
    assert code == 2 and words in err and err.startswith("error: ")


def test_the_federation_plan_needs_its_rounds(fedprivacy_cli):
    code, _, err = fedprivacy_cli(*PLAN, "--level", "federation", "--batch-size", "100")
    assert (
        code == 2
        and "rounds=None: --level federation needs --rounds R, the federation's rounds, an integer in [1, 10000]" in err
    )
