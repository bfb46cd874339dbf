"""The DP trainer follows the plan: exactly T steps, Poisson sampling at q, noise σC on the sum."""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from fedprivacy.models import build_model
from fedprivacy.privacy.plan import Plan
from fedprivacy.training import (
    DPTrainer,
    PlanExhausted,
    SeededRunWarning,
    StepInputs,
    StepRandomness,
    release,
)
from fedprivacy.training.stack import noise_scale

pytestmark = pytest.mark.filterwarnings("ignore::fedprivacy.training.SeededRunWarning")


def make_plan(
    *,
    n: int = 40,
    q: float = 0.25,
    steps: int = 20,
    rounds: int = 1,
    sigma: float = 1.0,
    clip: float = 1.0,
    lr: float = 0.1,
    segments: tuple[tuple[float, int], ...] | None = None,
    **extra: object,
) -> Plan:
    return Plan(
        client_id="c0",
        rule="calibrated",
        n=n,
        epsilon=1.0,
        delta=1e-5,
        clip_norm=clip,
        sigma=sigma,
        sampling_rate=q,
        steps=steps,
        rounds=rounds,
        noise_segments=segments or ((sigma, steps),),
        epsilon_pld=0.9,
        epsilon_rdp=1.0,
        learning_rate=lr,
        **extra,
    )


def data(n: int = 40, features: int = 15, classes: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def trainer(
    plan: Plan, seed: int | None = 3, model_seed: int = 0, device: str | torch.device = "cpu", **kwargs
) -> DPTrainer:
    """An MLP trainer on `device` (the trainer follows the model's device, data included)."""
    torch.manual_seed(model_seed)
    x, y = data(plan.n)
    return DPTrainer(build_model("mlp", 15, 2).to(device), plan, x, y, seed=seed, **kwargs)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# ----- steps: exactly T, in any split, never more -----
@pytest.mark.parametrize("rounds", [1, 3, 7])
def test_runs_exactly_the_plan_steps_across_rounds(rounds: int, compute_device: torch.device) -> None:
    plan = make_plan(steps=20, rounds=rounds)  # 20 is not divisible by 3 or 7
    t = trainer(plan, device=compute_device)
    reports = [t.run_round(r) for r in range(1, rounds + 1)]
    assert sum(r.steps for r in reports) == 20 == t.step
    assert [r.first_step for r in reports] == [plan.first_step_of_round(r) for r in range(1, rounds + 1)]
    before = flat(t.model)
    with pytest.raises(PlanExhausted, match="20 steps"):
        t.run_steps(1)
    with pytest.raises(PlanExhausted, match="round"):
        t.run_round(rounds + 1)
    assert t.step == 20 and torch.equal(flat(t.model), before)


def test_refuses_before_taking_any_step_past_t() -> None:
    t = trainer(make_plan(steps=10))
    t.run_steps(7)
    before = flat(t.model)
    with pytest.raises(PlanExhausted, match="3 left"):
        t.run_steps(4)
    assert t.step == 7 and torch.equal(flat(t.model), before)
    assert t.run_steps(3).steps == 3


def test_rounds_must_run_in_order() -> None:
    t = trainer(make_plan(steps=9, rounds=3))
    with pytest.raises(ValueError, match="starts at step 3"):
        t.run_round(2)


def test_every_real_row_is_sampled_and_the_sum_divided_by_the_plans_public_size() -> None:
    """A deployed node plans from the size it declares public, not its real N (add/remove is then
    coherent): the trainer samples each of its real rows at q and divides by q·N_public."""
    x, y = data(30)
    with pytest.raises(ValueError, match="30/29 rows"):
        DPTrainer(build_model("mlp", 15, 2), make_plan(n=40), x, y[:29])
    plan = make_plan(n=40, q=1.0, steps=1, sigma=1e-9, clip=1e3, lr=1.0)  # noise std σC = 1e-6
    model = build_model("logreg", 15, 2)
    before = [p.detach().clone() for p in model.parameters()]
    DPTrainer(model, plan, x, y, seed=1).run_steps(1)
    step = [b - a.detach() for a, b in zip(model.parameters(), before, strict=True)]
    reference = build_model("logreg", 15, 2)
    reference.load_state_dict(dict(zip(dict(reference.named_parameters()), before, strict=True)))
    torch.nn.functional.cross_entropy(reference(x), y, reduction="sum").backward()
    expected = [p.grad / 40 for p in reference.parameters()]  # all 30 rows, unclipped, over q·N_public = 40
    for got, want in zip(step, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# ----- empty batches still spend a step and add noise -----
def test_empty_batches_are_noisy_steps(compute_device: torch.device) -> None:
    plan = make_plan(n=10, q=1e-6, steps=5, lr=1e-5)  # noise on the mean: σC/(qN) = 1e5
    t = trainer(plan, device=compute_device)
    states = [flat(t.model)]
    for _ in range(5):
        report = t.run_steps(1)
        assert report.empty_steps == 1 and report.examples == 0
        assert math.isnan(report.mean_loss)
        states.append(flat(t.model))
    for a, b in zip(states, states[1:]):
        moved = (b - a) / (plan.learning_rate * plan.noise_std_on_mean)  # ~ N(0, 1) each
        # the release is on a grid of σC/2⁸ or finer: a coordinate stays put with probability < 1/640
        assert float((moved == 0).double().mean()) < 1 / 300
        assert 0.8 < float(moved.std()) < 1.2


# ----- the noise and the sampling have the planned distributions -----
def test_release_adds_noise_of_std_sigma_c_to_the_sum(compute_device: torch.device) -> None:
    sigma, clip, coords = 1.3, 0.7, 40_000
    clean = torch.randn(coords, generator=torch.Generator().manual_seed(5)).to(compute_device)
    words = StepRandomness(11).draws(0, 1, 0, 0.5, coords, device=compute_device).noise[0]
    one = {"dtype": torch.float64, "device": compute_device}
    std = noise_scale(torch.tensor([sigma], **one), torch.tensor([clip], **one))
    active = torch.ones(1, dtype=torch.bool, device=compute_device)
    step = StepInputs(None, None, None, words[None], std, None, torch.ones(1, device=compute_device), active)
    released = release([clean[None].clone()], step)[0]
    assert released.device.type == compute_device.type
    noise = released - clean
    # Sample std of n normals has relative s.e. 1/sqrt(2n) = 0.35%; allow 5 s.e.
    assert abs(float(noise.std()) / (sigma * clip) - 1) < 5 / math.sqrt(2 * coords)
    assert abs(float(noise.mean())) < 5 * sigma * clip / math.sqrt(coords)


def test_trainer_noise_on_the_sum_is_sigma_c(compute_device: torch.device) -> None:
    """End to end, q = 1 (every record sampled): N·released − clean clipped sum ~ N(0, σ²C²)."""
    n, sigma, clip = 16, 2.0, 0.5
    plan = make_plan(n=n, q=1.0, steps=1, sigma=sigma, clip=clip, lr=1.0)
    noises = []
    for seed in range(4):
        t = trainer(plan, seed=seed, device=compute_device)
        x, y = t.features, t.labels
        clean = torch.zeros_like(flat(t.model))
        for i in range(n):
            loss = F.cross_entropy(t.model(x[i : i + 1]), y[i : i + 1], reduction="sum")
            grad = torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(t.model.parameters()))])
            clean += grad * min(1.0, clip / float(grad.norm()))
        before = flat(t.model)
        report = t.run_steps(1)
        assert report.examples == n
        released = (before - flat(t.model)) / plan.learning_rate
        noises.append(released * n - clean)
    noise = torch.cat(noises)  # 4 × 1154 coordinates
    assert abs(float(noise.std()) / (sigma * clip) - 1) < 5 / math.sqrt(2 * len(noise))
    assert abs(float(noise.mean())) < 5 * sigma * clip / math.sqrt(len(noise))
    assert report.noise_std_on_mean == pytest.approx(sigma * clip / n)


def test_average_divides_by_the_expected_batch_not_the_realised_one(compute_device: torch.device) -> None:
    """σ = 0: the released gradient is exactly the clipped sum of the sampled records / (qN)."""
    plan = make_plan(n=40, q=0.3, steps=1, sigma=0.0, clip=0.5, lr=1.0)
    t = trainer(plan, seed=21, device=compute_device)
    index = StepRandomness(21).draws(0, 1, 40, 0.3, 1154, device=compute_device).sample(0)
    assert 0 < len(index) != 12  # realised size differs from qN = 12
    clean = torch.zeros_like(flat(t.model))
    for i in index.tolist():
        loss = F.cross_entropy(t.model(t.features[i : i + 1]), t.labels[i : i + 1], reduction="sum")
        grad = torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(t.model.parameters()))])
        clean += grad * min(1.0, 0.5 / float(grad.norm()))
    before = flat(t.model)
    assert t.run_steps(1).examples == len(index)
    torch.testing.assert_close(before - flat(t.model), clean / 12, atol=1e-6, rtol=1e-5)


def test_poisson_sampling_rate_matches_q(compute_device: torch.device) -> None:
    n, q, reps = 10_000, 0.03, 20
    draws = StepRandomness(4).draws(0, reps, n, q, 1, device=compute_device)
    sizes = [len(draws.sample(step)) for step in range(reps)]
    total, trials = sum(sizes), n * reps
    assert abs(total - q * trials) < 5 * math.sqrt(trials * q * (1 - q))  # binomial, 5 s.d.
    assert len(set(sizes)) > 1  # variable batch sizes


def test_trainer_samples_q_n_per_step_on_average() -> None:
    plan = make_plan(n=200, q=0.1, steps=60)
    report = trainer(plan).run_steps(60)
    trials = plan.n * plan.steps
    assert abs(report.examples - 0.1 * trials) < 5 * math.sqrt(trials * 0.1 * 0.9)
    assert 0 <= report.clip_fraction <= 1 and report.mean_loss > 0


def test_sigma_follows_the_plan_segments() -> None:
    plan = make_plan(steps=10, segments=((2.0, 4), (1.0, 6)))
    t = trainer(plan)
    assert t.run_steps(4).sigma_mean == pytest.approx(2.0)
    assert t.run_steps(6).sigma_mean == pytest.approx(1.0)


# ----- randomness: secure by default, reproducible only with a seed -----
def test_seeded_runs_are_reproducible_and_split_invariant(compute_device: torch.device) -> None:
    plan = make_plan(steps=12, rounds=3)
    a, b = trainer(plan, seed=9, device=compute_device), trainer(plan, seed=9, device=compute_device)
    a.run_steps(12)
    for r in range(1, 4):
        b.run_round(r)
    assert torch.equal(flat(a.model), flat(b.model))
    c = trainer(plan, seed=10, device=compute_device)
    c.run_steps(12)
    assert not torch.equal(flat(a.model), flat(c.model))


def test_unseeded_runs_differ_and_say_so() -> None:
    plan = make_plan(steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no SeededRunWarning without a seed
        a, b = trainer(plan, seed=None), trainer(plan, seed=None)
    ra, rb = a.run_steps(3), b.run_steps(3)
    assert not ra.seeded and not rb.seeded
    assert not torch.equal(flat(a.model), flat(b.model))


def test_seeded_run_warns_and_reports_it() -> None:
    with pytest.warns(SeededRunWarning, match="not production"):
        t = trainer(make_plan(steps=2), seed=1)
    assert t.run_steps(2).seeded


# ----- resuming and learning-rate schedules -----
def test_resume_from_state_matches_an_uninterrupted_run() -> None:
    plan = make_plan(steps=10, rounds=2, lr_schedule="adagrad_norm", lr_params={"b0": 0.5})
    whole = trainer(plan)
    whole.run_steps(10)

    first = trainer(plan)
    first.run_round(1)
    state = json.loads(json.dumps(first.state_dict()))
    x, y = data(plan.n)
    second = DPTrainer(copy.deepcopy(first.model), plan, x, y, seed=3, state=state)
    assert second.step == 5
    second.run_round(2)
    assert torch.allclose(flat(whole.model), flat(second.model))
    assert second.state_dict() == pytest.approx(whole.state_dict())


def test_adagrad_norm_uses_the_released_gradient() -> None:
    plan = make_plan(steps=1, lr=0.3, lr_schedule="adagrad_norm", lr_params={"b0": 2.0, "nu": 1e-3})
    t = trainer(plan)
    before = flat(t.model)
    report = t.run_steps(1)
    b_sq = t.state_dict()["b_squared"]
    eta = report.last_learning_rate
    assert eta == pytest.approx(0.3 / math.sqrt(b_sq))
    step_sq = float((before - flat(t.model)).square().sum())  # ‖η g‖²
    assert b_sq - 4.0 == pytest.approx(step_sq / eta**2, rel=1e-4)  # b² = b0² + ‖g‖²


def test_inverse_sqrt_schedule_comes_from_the_plan() -> None:
    plan = make_plan(steps=5, lr=1.0, lr_schedule="inverse_sqrt", lr_params={"a": 4.0, "c": 1.0})
    report = trainer(plan).run_steps(5)
    assert report.last_learning_rate == pytest.approx(1.0 / math.sqrt(4.0 + 4))


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"lr_schedule": "inverse_sqrt", "lr_params": {"a": 7.0, "c": 0.3}},
        {"lr_schedule": "adagrad_norm", "lr_params": {"b0": 0.5}},
        {"segments": ((3.0, 5), (1.7, 9), (0.9, 6))},
    ],
)
def test_the_loop_of_steps_reads_each_steps_sigma_and_rate_as_the_plan_gives_them(extra):
    """The loop's schedule (`steps.schedule`: every step's σ_t and η_t at once, cached per distinct
    schedule) equals the plan's per-step `noise_multiplier` and the schedule's formula η/sqrt(a + ct)
    (η for constant and AdaGrad-norm, which adapts it in the step), bit for bit."""
    from fedprivacy.training.steps import schedule

    plan = make_plan(**extra)
    sigmas, rates = schedule(plan)
    assert sigmas.tolist() == [plan.noise_multiplier(t) for t in range(plan.steps)]
    a, c = plan.lr_params.get("a", 20.0), plan.lr_params.get("c", 1.0)
    decays = plan.lr_schedule == "inverse_sqrt"
    want = [plan.learning_rate / math.sqrt(a + c * t) if decays else plan.learning_rate for t in range(plan.steps)]
    assert rates.tolist() == want == [plan.learning_rate_at(t) for t in range(plan.steps)]
    assert schedule(make_plan(**extra)) is schedule(plan)  # an equal plan shares it


def test_a_plan_s_remembered_schedule_is_never_another_plan_s() -> None:
    """`schedule` remembers each plan object's arrays by id: plans made and dropped one after
    another (CPython hands a freed object's id to the next) each get their own schedule."""
    from fedprivacy.training.steps import schedule

    for t in range(1, 60):
        plan = make_plan(steps=20, segments=((1.0 + t, 7), (0.5, 13)))
        sigmas, _ = schedule(plan)
        assert sigmas.tolist() == [1.0 + t] * 7 + [0.5] * 13
        assert schedule(plan) is schedule(plan)
        del plan


# ----- the loop's CPU threads and its diagnostics -----
class _ThreadsSeen(torch.nn.Module):
    """A Linear model that notes PyTorch's intra-op thread count at each forward."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(features, classes)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        return self.linear(x)


@pytest.mark.parametrize(("features", "classes"), [(15, 2), (2000, 20)])
def test_small_steps_run_on_one_thread_and_the_count_is_restored(features: int, classes: int, monkeypatch) -> None:
    """A step of fewer expected multiply-adds than `SERIAL_STEP_PRODUCTS` runs on one thread (a
    15 × 2 Linear at q·N = 10: 300); a larger one (2,000 × 20: 40,000 per row × 10 rows, above
    2¹⁸) keeps the process's threads; the count is restored after the steps, and after a step
    that raises."""
    from fedprivacy.training import steps as steps_module

    torch.set_num_threads(2)
    plan = make_plan(n=40, q=0.25, steps=4)
    model = _ThreadsSeen(features, classes)
    x, y = data(40, features=features, classes=classes)
    run = DPTrainer(model, plan, x, y, seed=3)
    run.run_steps(1)
    model.seen.clear()  # the trainer's forwards that find the model's shapes, once
    run.run_steps(3)
    small = 10 * features * classes < steps_module.SERIAL_STEP_PRODUCTS
    assert small == (features == 15)
    assert set(model.seen) == ({1} if small else {2})
    assert torch.get_num_threads() == 2

    def fail(*args, **kwargs):
        assert torch.get_num_threads() == (1 if small else 2)
        raise RuntimeError("a step that fails")

    monkeypatch.setattr(steps_module, "_take_steps", fail)
    with pytest.raises(RuntimeError, match="a step that fails"):
        DPTrainer(_ThreadsSeen(features, classes), plan, x, y, seed=3).run_steps(2)
    assert torch.get_num_threads() == 2


def test_one_thread_or_two_release_the_same_bits(monkeypatch) -> None:
    """The thread count is not part of the mechanism: a seeded trainer's weights and report are
    the same whether its small steps run on one thread or on two."""
    from fedprivacy.training import steps as steps_module

    torch.set_num_threads(2)
    plan = make_plan(n=200, q=0.2, steps=12, segments=((1.3, 5), (0.9, 7)))
    serial = trainer(plan)
    serial_report = serial.run_steps(12)
    monkeypatch.setattr(steps_module, "SERIAL_STEP_PRODUCTS", 0)
    threaded = trainer(plan)
    threaded_report = threaded.run_steps(12)
    assert torch.equal(flat(serial.model), flat(threaded.model))
    assert serial_report == threaded_report


def test_round_totals_equal_each_steps_own_sums() -> None:
    """`RoundTotals`, which reduces steps several at a time, equals the sum over steps of each
    step's own `StepReport` counts (loss, clipped, non-finite, examples), over more steps than it
    keeps at once, widths that differ from step to step, padding, and non-finite drops."""
    from fedprivacy.training.clipping import Clipped
    from fedprivacy.training.stack import RoundTotals, StepReport

    g = torch.Generator().manual_seed(5)
    clients, clip = 3, torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    totals = RoundTotals()
    loss, clipped, nonfinite, examples = (torch.zeros(clients, dtype=torch.float64) for _ in range(4))
    for step in range(2 * RoundTotals.STEPS_AT_ONCE + 3):
        width = 1 + step % 7
        valid = torch.rand(clients, width, generator=g) < 0.7
        sq_norms = torch.rand(clients, width, generator=g, dtype=torch.float64) * 4 * valid
        losses = torch.rand(clients, width, generator=g) * valid
        finite = step % 5 != 2
        dropped = torch.zeros_like(valid) if finite else valid & (torch.rand(clients, width, generator=g) < 0.3)
        if not finite:
            losses = torch.where(dropped, torch.tensor(float("nan")), losses)
        sums = Clipped([], sq_norms, dropped, torch.zeros(clients, dtype=torch.bool), losses, finite)
        report = StepReport([], sums, valid, clip, private=True)
        totals.add(report)
        loss += report.loss_sum.double()
        clipped += report.clipped
        nonfinite += report.nonfinite
        examples += report.examples
    for k, (mean_loss, clip_fraction, bad) in enumerate(totals.per_client()):
        n = float(examples[k])
        assert mean_loss == pytest.approx(float(loss[k]) / n, rel=1e-6)
        assert clip_fraction == float(clipped[k]) / n
        assert bad == int(nonfinite[k]) > 0
