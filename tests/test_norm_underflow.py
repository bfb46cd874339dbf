"""No record's contribution exceeds C however its gradient's norm is computed (security audit).

A crafted MLP can give one record a gradient whose float32 squared norm underflows to exactly 0
(a hidden unit firing at 1.8e19 for that record only, an output confidently right so that the loss
gradient is ~2e-23): a clip weight of C/max(0, C) = 1 then let a gradient of ~400·C into the sum.
The norms are now float64 bounds on what is actually summed (fedprivacy/training/norms.py and each
layer's rule), in the trainer, the DP step and the fast engine alike; these tests drive all three at
the smallest C a run accepts, the crafted record through a Linear and a Conv1d output layer, plus a
Conv2d whose Gram ("ghost") norm cancels, a record whose weighted factors round into float32's
subnormal range, and the clip-norm limits.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from fedprivacy import cli
from fedprivacy.errors import InputError
from fedprivacy.models import build_model
from fedprivacy.privacy import limits
from fedprivacy.privacy.plan import Plan
from fedprivacy.runconfig import parse_run_config
from fedprivacy.training import DPTrainer, PerExampleClipper, stack

pytestmark = pytest.mark.filterwarnings("ignore::fedprivacy.training.SeededRunWarning")

C = limits.CLIP_NORM_MIN  # the smallest clip norm a run accepts: 1e-6
FEATURES, HIDDEN = 15, 64
TOLERANCE = 1 + 1e-5


def norm64(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of a list of tensors, in float64 (no square can underflow)."""
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def crafted_mlp() -> nn.Module:
    """The audit's model: hidden unit 0 fires at 1.8e19 only for a record with feature 0 set, and the
    output is confidently right on it (logit margin 52.2), so that record's loss gradient is
    d = (0, 2.2e-23) (float32 rounds p₀ − 1 to 0): ‖d‖² = 4.8e-46 underflows to 0 in float32, while
    its true gradient norm ‖d‖·‖(a, 1)‖ = 3.8e-4 is ~400·C."""
    model = build_model("mlp", FEATURES, 2)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model[1].weight[0, 0] = 1.8e19
        model[3].weight[0, 0] = 52.2 / 1.8e19
    return model


def subnormal_mlp() -> nn.Module:
    """Sixteen hidden units fire at 3.245e38 for the target (‖a‖ = 1.3e39, finite per entry; its
    float32 squared norm overflows, its float64 one does not) and the output is confidently right.
    With a norm computed in float64 and w = C/‖g‖, the weighted factor w·d₁ ≈ C/‖a‖ is 0.55 of
    float32's smallest subnormal and rounds up to 1 of it: 1.8·C would be summed. The clip weights
    leave room for that rounding (clipping.clip_weights), so it is not."""
    model = build_model("mlp", FEATURES, 2)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model[1].weight[:16, 0] = 3.245e38
        model[3].weight[0, 0] = 25.0 / 3.245e38
    return model


def crafted_conv1d() -> nn.Module:
    """The audit's model with its output layer as a 1-wide Conv1d over one position: the same
    underflowing ‖d‖² through the convolution rule."""
    mlp = crafted_mlp()
    head = nn.Conv1d(HIDDEN, 2, kernel_size=1)
    with torch.no_grad():
        head.weight.copy_(mlp[3].weight.unsqueeze(-1))
        head.bias.copy_(mlp[3].bias)
    return nn.Sequential(*mlp[:3], nn.Unflatten(1, (HIDDEN, 1)), head, nn.Flatten())


CRAFTED = {"underflow": crafted_mlp, "subnormal-weighting": subnormal_mlp, "underflow-conv1d": crafted_conv1d}


def target(rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(rows, FEATURES)
    x[:, 0] = 1.0
    return x, torch.zeros(rows, dtype=torch.long)


def benign(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=g)
    x[:, 0] = -x[:, 0].abs()  # feature 0 never positive: the crafted units stay off
    return x, torch.randint(0, 2, (rows,), generator=g)


def test_the_crafted_record_squared_norm_underflows_in_float32_but_not_its_gradient():
    """The attack's premise, checked on the model itself: the book-keeping closed form
    ‖d‖²(‖a‖² + 1) of the output layer is exactly 0 in float32, the gradient's norm ~400·C."""
    model = crafted_mlp()
    x, y = target()
    hidden = torch.relu(model[1](x))
    loss = F.cross_entropy(model[3](hidden), y, reduction="sum")
    grads = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():
        d = torch.softmax(model[3](hidden), -1) - F.one_hot(y, 2)  # the loss gradient w.r.t. the logits
        hidden = hidden.detach()
    assert float(torch.linalg.vecdot(d, d) * (torch.linalg.vecdot(hidden, hidden) + 1)) == 0.0  # float32
    assert norm64(list(grads)) > 100 * C  # ~400·C


@pytest.mark.parametrize("craft", list(CRAFTED))
def test_the_crafted_record_adds_at_most_c_to_the_clipped_sum(craft):
    clipper = PerExampleClipper(CRAFTED[craft]())
    x, y = target()
    alone = clipper.clipped_sum(x, y, C)
    assert alone.nonfinite == 0
    assert norm64(alone.grad_sums) <= C * TOLERANCE
    # Among benign records: the sum with it differs from the sum without it by at most C.
    xb, yb = benign(7)
    with_it = clipper.clipped_sum(torch.cat([xb, x]), torch.cat([yb, y]), C)
    without = clipper.clipped_sum(xb, yb, C)
    assert norm64([a - b for a, b in zip(with_it.grad_sums, without.grad_sums, strict=True)]) <= C * TOLERANCE


def test_the_crafted_record_moves_a_dp_trainer_step_by_at_most_lr_c_over_qn():
    """Through DPTrainer and a plan at C = 1e-6, noise off (σ = 0) to see the clipped sum alone:
    two copies of the record, q = 1, so the update is η·(Σ clipped)/(qN) with ‖Σ clipped‖ ≤ 2C."""
    plan = Plan(
        client_id="c",
        rule="calibrated",
        n=2,
        epsilon=1.0,
        delta=1e-5,
        clip_norm=C,
        sigma=0.0,
        sampling_rate=1.0,
        steps=1,
        rounds=1,
        noise_segments=((0.0, 1),),
        epsilon_pld=0.9,
        epsilon_rdp=1.0,
        learning_rate=1.0,
    )
    model = crafted_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = target(2)
    report = DPTrainer(model, plan, x, y, seed=1).run_steps(1)
    step = norm64([b.double() - p.detach().double() for b, p in zip(before, model.parameters(), strict=True)])
    assert report.examples == 2 and report.clip_fraction == 1.0  # both were clipped (the old norms said 0)
    assert step <= plan.learning_rate * 2 * C / (plan.sampling_rate * plan.n) * TOLERANCE


def stack_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float) -> stack.StepInputs:
    """One client's step for the fast engine's stacked functions, as sims/fast/worker.py builds it."""
    parameters = sum(p.numel() for p in model.parameters())
    return stack.StepInputs(
        features=x.unsqueeze(0),
        labels=y.unsqueeze(0),
        valid=torch.ones(1, len(x), dtype=torch.bool),
        noise_words=torch.zeros(1, parameters + 1, dtype=torch.int64),
        noise_std=torch.zeros(1, dtype=torch.float64),
        clip=torch.tensor([clip]),
        expected_batch=torch.tensor([float(len(x))]),
        active=torch.ones(1, dtype=torch.bool),
    )


@pytest.mark.parametrize("craft", list(CRAFTED))
def test_the_fast_engine_clips_the_crafted_record_too(craft):
    """The engine's step with σ = 0 and qN = 1 releases exactly the clipped sum (read by its learning
    rate; the weights themselves, 1.8e19 beside 1e-6, would lose it to rounding)."""
    model = CRAFTED[craft]()
    state = [t.detach().clone().unsqueeze(0) for t in model.state_dict().values()]
    released: list[list[torch.Tensor]] = []

    def rate(gradients: list[torch.Tensor]) -> torch.Tensor:
        released.append([g[0].clone() for g in gradients])
        return torch.zeros(1)

    x, y = target()
    report = stack.ClientStack(model).step(state, stack_step(model, x, y, C), rate)
    assert int(report.nonfinite[0]) == 0
    assert norm64(released[0]) <= C * TOLERANCE
    # and the trainer's clipper gives the same sum
    alone = PerExampleClipper(model).clipped_sum(x, y, C)
    for got, want in zip(released[0], alone.grad_sums, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=C * 1e-6)


def per_example_norms(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """‖∇loss_i‖ by torch.func (vmap of grad: independent of the clipper's book-keeping), each
    per-example gradient as the model computes it (float32) and its norm in float64. (A float64 copy
    of the model would compute another gradient: float32 rounds a confident p_y − 1 to exactly 0.)"""
    trained = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    frozen = {name: p.detach() for name, p in model.named_parameters() if not p.requires_grad}

    def loss(params, xi, yi):
        return F.cross_entropy(functional_call(model, {**frozen, **params}, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(trained, x, y)
    return torch.stack([g.double().flatten(1).square().sum(1) for g in grads.values()]).sum(0).sqrt()


def random_case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    if name == "cnn":
        model, x, classes = build_model("cnn", 64, 10), torch.randn(10, 64), 10
    else:
        model, x, classes = build_model(name, FEATURES, 2), torch.randn(10, FEATURES), 2
    x = x * torch.logspace(-2, 2, len(x)).unsqueeze(1)  # norms over four orders of magnitude
    return model, x, torch.randint(0, classes, (len(x),))


@pytest.mark.parametrize("case", ["logreg", "mlp", "cnn", "crafted"])
def test_every_weighted_contribution_is_at_most_c(case):
    """For each example: the clip weight the clipper used times the norm of its per-example gradient
    (torch.func, norm in float64) is ≤ C(1 + 1e-5), and so is the norm of what it adds alone; the
    norm used never underestimates the per-example gradient's. Random inputs: regression guards;
    the crafted record: the audit's case (its used norm was 0)."""
    if case == "crafted":
        model = crafted_mlp()
        (xt, yt), (xb, yb) = target(), benign(5)
        x, y, clip = torch.cat([xt, xb]), torch.cat([yt, yb]), C
    else:
        model, x, y = random_case(case)
        clip = None
    true_norms = per_example_norms(model, x, y)
    if clip is None:
        clip = float(true_norms.median())  # half the examples are clipped
    clipper = PerExampleClipper(model)
    batch = clipper.clipped_sum(x, y, clip)
    used = batch.sq_norms.double().sqrt()
    assert (used >= true_norms * (1 - 1e-5)).all()
    weights = torch.clamp(clip / used, max=1.0)
    assert (weights * true_norms <= clip * TOLERANCE).all(), (weights * true_norms / clip).max()
    for i in range(len(x)):
        assert norm64(clipper.clipped_sum(x[i : i + 1], y[i : i + 1], clip).grad_sums) <= clip * TOLERANCE


def cancelling_conv() -> nn.Module:
    """A 1×1 Conv2d over two pixels, then a frozen head whose weights for pixel 2 are minus those
    for pixel 1: d₂ = −d₁ exactly, and with a₂ = a₁(1 + 2⁻²³) the per-example gradient d₁(a₁ − a₂)
    nearly cancels. Two positions, one input channel, four outputs: the Gram form is used."""
    conv = nn.Conv2d(1, 4, kernel_size=1, bias=False)
    head = nn.Linear(8, 2)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([1.0, -0.5, 0.25, 2.0]).view(4, 1, 1, 1) * 1e-3)
        w = torch.tensor([[0.3, -0.7, 1.1, 0.2], [-0.4, 0.9, 0.1, -1.3]])
        head.weight.copy_(torch.stack([w, -w], dim=2).reshape(2, 8))  # (channel, pixel) flattened
        head.bias.zero_()
    head.requires_grad_(False)
    return nn.Sequential(conv, nn.Flatten(), head)


def two_pixels(first: float) -> torch.Tensor:
    x1 = torch.tensor(first)
    return torch.stack([x1, torch.nextafter(x1, torch.tensor(math.inf))]).view(1, 1, 1, 2)


@pytest.mark.parametrize("first", [1000.0, 1000.2, 1000.3, 3.0e6])
def test_a_cancelling_gram_norm_never_underestimates_what_is_summed(first):
    """Unclipped (w = 1), the clipped sum of a batch of one IS the float32-materialised per-example
    gradient: the norm used for it must be at least its norm. The float32 Gram form gave 0 (or a
    negative number) here, while the materialised gradient is not 0; clipped at a C between the
    two, that record then added its whole gradient."""
    clipper = PerExampleClipper(cancelling_conv())
    x, y = two_pixels(first), torch.zeros(1, dtype=torch.long)
    unclipped = clipper.clipped_sum(x, y, limits.CLIP_NORM_MAX)
    summed = norm64(unclipped.grad_sums)
    assert summed > 0
    assert float(unclipped.sq_norms[0]) >= summed**2
    clip = max(summed / 4, C)
    clipped = clipper.clipped_sum(x, y, clip)
    assert norm64(clipped.grad_sums) <= clip * TOLERANCE


def test_the_gram_bound_holds_for_random_near_cancellations():
    """Random layer inputs A and output gradients D of two positions that nearly cancel, straight into
    the norm function: the bound is never below the norm of the float32 DᵢᵀAᵢ."""
    from fedprivacy.training.layers.linear import positional_norms

    g = torch.Generator().manual_seed(4)
    layer = nn.Linear(6, 5, bias=True)  # 6·5 ≥ 2·2: the Gram form
    for _ in range(200):
        scale = 10 ** float(torch.empty(()).uniform_(-20, 20, generator=g))
        a1, d1 = torch.randn(1, 1, 6, generator=g) * scale, torch.randn(1, 1, 5, generator=g)
        a = torch.cat([a1, a1 * (1 + 2**-22 * torch.randn(1, 1, 6, generator=g))], dim=1)
        d = torch.cat([d1, -d1 * (1 + 2**-22 * torch.randn(1, 1, 5, generator=g))], dim=1)
        sq, _, per_example, _ = positional_norms(layer, a, d)
        assert per_example is None
        materialised = torch.bmm(d.transpose(1, 2), a).double().square().sum() + d.sum(1).double().square().sum()
        assert float(sq[0]) >= float(materialised)


def test_a_float64_model_is_refused_by_name():
    model = build_model("mlp", FEATURES, 2).double()
    with pytest.raises(TypeError, match=r"'1.weight' is torch.float64"):
        PerExampleClipper(model)


# ----- the clip-norm limits -----
@pytest.mark.parametrize("value", [limits.CLIP_NORM_MIN, 1.0, limits.CLIP_NORM_MAX])
def test_clip_norms_at_and_inside_the_limits_are_accepted(value, tmp_path):
    assert limits.clip_norm("clip-norm", value) == value
    assert parse_run_config({"clip-norm": value, "results-dir": str(tmp_path)}).clip_norm == value


@pytest.mark.parametrize("value", [1e-7, 9.99e-7, 1.01e6, 1e9, 0.0, -1.0, math.inf, math.nan])
def test_clip_norms_outside_the_limits_are_refused_naming_field_value_and_range(value, tmp_path):
    with pytest.raises(InputError) as refused:
        limits.clip_norm("clip-norm", value)
    assert refused.value.field == "clip-norm"
    with pytest.raises(InputError) as refused:
        parse_run_config({"clip-norm": value, "results-dir": str(tmp_path)})
    message = str(refused.value)
    assert refused.value.field == "clip-norm" and message.startswith(f"clip-norm={value!r}: ")
    if value > 0 and math.isfinite(value):
        assert "[1e-06, 1e+06]" in message


@pytest.mark.parametrize(("command", "value"), [("plan", "1e-7"), ("plan", "2e6"), ("calculator", "1e-7")])
def test_the_cli_refuses_a_clip_norm_outside_the_limits(command, value, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fedprivacy", command, "--n", "5736", "--epsilon", "1", "--clip-norm", value])
    with pytest.raises(SystemExit) as ended:
        cli.main()
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: clip-norm={float(value)!r}: must be in [1e-06, 1e+06]"), err


def test_the_cli_plans_at_the_smallest_clip_norm(monkeypatch, capsys):
    monkeypatch.setattr(
        sys, "argv", ["fedprivacy", "plan", "--n", "5736", "--epsilon", "1", "--clip-norm", "1e-6", "--json"]
    )
    with pytest.raises(SystemExit) as ended:
        cli.main()
    assert ended.value.code in (0, None)
    assert '"clip_norm": 1e-06' in capsys.readouterr().out
