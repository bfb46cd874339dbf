"""Aggregation weights from public plans: by examples, or by the inverse of the update's noise variance."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from fedprivacy.aggregation import aggregation_weight, update_noise_variance
from fedprivacy.errors import InputError
from fedprivacy.privacy.plan import Plan
from fedprivacy.privacy.planner import plan_client


def test_inverse_noise_weights_follow_the_closed_form_of_the_update_variance():
    plan = plan_client(1000, 1.0, 1e-5, rule="calibrated", epochs=4, rounds=3, learning_rate=0.5, compare=False)
    steps = plan.steps_in_round(2)
    per_step = (0.5 * plan.sigma * plan.clip_norm / (plan.sampling_rate * plan.n)) ** 2
    assert update_noise_variance(plan, 2) == pytest.approx(steps * per_step)
    assert aggregation_weight("inverse-noise", plan, 2, plan.n) == pytest.approx(1 / (steps * per_step))
    assert aggregation_weight("examples", plan, 2, 1000) == 1000.0


def test_a_larger_budget_weighs_more_under_inverse_noise():
    small, large = (
        plan_client(1000, eps, 1e-5, rule="calibrated", epochs=4, rounds=2, compare=False) for eps in (0.5, 8.0)
    )
    assert aggregation_weight("inverse-noise", large, 1, 1000) > 10 * aggregation_weight(
        "inverse-noise", small, 1, 1000
    )


def test_adp_schedules_sum_every_step_of_the_round():
    plan = plan_client(1000, 2.0, 1e-5, rule="adp", epochs=8, rounds=2, compare=False)
    first, count = plan.first_step_of_round(2), plan.steps_in_round(2)
    expected = sum(
        (plan.learning_rate_at(t) * plan.noise_multiplier(t) * plan.clip_norm / (plan.sampling_rate * plan.n)) ** 2
        for t in range(first, first + count)
    )
    assert update_noise_variance(plan, 2) == pytest.approx(expected)
    assert len({plan.noise_multiplier(t) for t in range(first, first + count)}) > 1  # σ_t varies within the round


def test_an_unknown_scheme_is_refused_by_name():
    plan = plan_client(1000, 1.0, 1e-5, compare=False)
    with pytest.raises(InputError, match="aggregation='median': must be one of: examples, inverse-noise"):
        aggregation_weight("median", plan, 1, 1000)


@pytest.fixture
def simulate_folder(simulate, run_config):
    """The apps in process on four clients of budgets 0.5, 1, 4 and 8 with `overrides`: the results folder."""

    def run(overrides, nodes=4):
        config = {**run_config, "num-server-rounds": 3, "epsilons": "0.5,1,4,8", **overrides}
        simulate(config, nodes)
        (folder,) = Path(config["results-dir"]).iterdir()
        return folder

    return run


def test_inverse_noise_weighs_clients_by_their_plans_and_changes_the_model(
    simulate_folder, run_config, tmp_path, monkeypatch
):
    """The server's average with inverse-noise weights is Σ wᵢθᵢ/Σ wᵢ with wᵢ = 1/Var(plan, round)."""
    from server import strategy as strategy_module

    seen = []
    aggregate = strategy_module.aggregate
    monkeypatch.setattr(
        strategy_module,
        "aggregate",
        lambda current, updates, weights, step: (seen.append(weights), aggregate(current, updates, weights, step))[1],
    )
    folder = simulate_folder({"aggregation": "inverse-noise", "results-dir": str(tmp_path / "inv")})
    plans = {
        p.stem: Plan.from_dict(json.loads(p.read_text()))
        for p in (folder / "plans").glob("*.json")
        if p.stem != "index"
    }
    for server_round, weights in enumerate(seen, start=1):
        expected = sorted(1 / update_noise_variance(plan, server_round) for plan in plans.values())
        assert sorted(weights) == pytest.approx(expected)
    by_examples = simulate_folder({"aggregation": "examples", "results-dir": str(tmp_path / "ex")})
    assert not torch.equal(
        torch.load(folder / "model.pt")["1.weight"], torch.load(by_examples / "model.pt")["1.weight"]
    )


@pytest.mark.parametrize("optimizer", ["fedavgm", "fedadam"])
def test_a_flower_server_optimizer_steps_from_the_global_model_under_the_same_budgets(
    simulate_folder, tmp_path, optimizer
):
    plain = simulate_folder({"results-dir": str(tmp_path / "plain")})
    stepped = simulate_folder(
        {
            "server-optimizer": optimizer,
            "server-learning-rate": 0.5,
            "server-momentum": 0.9 if optimizer == "fedavgm" else 0.0,
            "results-dir": str(tmp_path / optimizer),
        }
    )
    assert not torch.equal(torch.load(plain / "model.pt")["1.weight"], torch.load(stepped / "model.pt")["1.weight"])
    spent = {f: pd.read_csv(f / "clients.csv").set_index("client_id").epsilon_spent for f in (plain, stepped)}
    assert spent[plain].equals(spent[stepped])  # post-processing: the same privacy spent


def test_one_aggregate_weighs_checks_steps_and_merges():
    """The strategy's and the fast engine's one aggregation: the weighted mean of the released
    entries, the server step from their current values only, the other entries kept; a mean that
    is not finite keeps the model (None)."""
    from fedprivacy.aggregation import aggregate

    current = {"scale": torch.full((2,), 7.0), "w": torch.zeros(2)}
    updates = {"w": torch.tensor([[1.0, 2.0], [3.0, 6.0]])}
    seen = []

    def step(values, average):
        seen.append(sorted(values))
        return {key: average[key] + 1.0 for key in average}

    new = aggregate(current, updates, [1.0, 3.0], step)
    assert seen == [["w"]] and list(new) == ["scale", "w"]
    assert torch.equal(new["scale"], current["scale"])
    torch.testing.assert_close(new["w"], torch.tensor([2.5 + 1.0, 5.0 + 1.0]))
    assert aggregate(current, {"w": torch.tensor([[1.0, float("nan")]])}, [1.0]) is None
