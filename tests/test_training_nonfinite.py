"""Non-finite values never reach a release: an example whose gradient is not finite contributes
exactly zero, and a model that is not finite is refused before any record is touched."""

from __future__ import annotations

import math

import pytest
import torch

from fedprivacy.models import build_model
from fedprivacy.privacy.plan import Plan
from fedprivacy.training import DPTrainer, NonFiniteModel, PerExampleClipper, check_finite
from fedprivacy.training import clipping as clipping_module
from fedprivacy.training import stack as stack_module

pytestmark = pytest.mark.filterwarnings("ignore::fedprivacy.training.SeededRunWarning")

CLIP = 1.0
MODELS = {
    "logreg": (lambda: build_model("logreg", 15, 2), (15,), 2),
    "mlp": (lambda: build_model("mlp", 15, 2), (15,), 2),
    "cnn": (lambda: build_model("cnn", 64, 10), (1, 8, 8), 10),
}


def poisoned_batch(shape, classes, value):
    torch.manual_seed(0)
    x = torch.randn(12, *shape)
    y = torch.randint(0, classes, (12,))
    x_bad = x.clone()
    x_bad[5].view(-1)[3] = value
    return x, y, x_bad


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("name", list(MODELS))
def test_an_example_with_a_non_finite_gradient_contributes_zero(name, value):
    make, shape, classes = MODELS[name]
    torch.manual_seed(1)
    clipper = PerExampleClipper(make())
    x, y, x_bad = poisoned_batch(shape, classes, value)
    keep = [i for i in range(12) if i != 5]
    poisoned = clipper.clipped_sum(x_bad, y, CLIP)
    without = clipper.clipped_sum(x[keep], y[keep], CLIP)
    assert poisoned.nonfinite == 1 and without.nonfinite == 0
    for got, want in zip(poisoned.grad_sums, without.grad_sums, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(poisoned.loss_sum) and poisoned.sq_norms[5] == 0


@pytest.mark.parametrize("name", list(MODELS))
def test_a_huge_but_finite_input_is_clipped_not_dropped(name):
    """A feature of 3e38 gives a finite gradient whose squared norm overflowed float32 (so it used
    to be dropped as non-finite); in float64 it is finite (~1e77), so the example is clipped like
    any other: it adds at most C to the sum, and exactly its own clipped gradient."""
    make, shape, classes = MODELS[name]
    torch.manual_seed(1)
    clipper = PerExampleClipper(make())
    x, y, x_bad = poisoned_batch(shape, classes, 3e38)
    keep = [i for i in range(12) if i != 5]
    poisoned = clipper.clipped_sum(x_bad, y, CLIP)
    without = clipper.clipped_sum(x[keep], y[keep], CLIP)
    alone = clipper.clipped_sum(x_bad[5:6], y[5:6], CLIP)
    assert poisoned.nonfinite == 0 and alone.nonfinite == 0
    assert math.isfinite(float(poisoned.sq_norms[5])) and float(poisoned.sq_norms[5]) > 1e70
    pairs = zip(poisoned.grad_sums, without.grad_sums, strict=True)
    added = torch.sqrt(sum((p.double() - w.double()).square().sum() for p, w in pairs))
    assert float(added) <= CLIP * (1 + 1e-5)
    for got, without_it, its_own in zip(poisoned.grad_sums, without.grad_sums, alone.grad_sums, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, without_it + its_own, atol=1e-5, rtol=1e-5)


def crafted_logreg() -> torch.nn.Module:
    """Finite weights whose product overflows only for a record with features 0 AND 1 set."""
    model = build_model("logreg", 15, 2)
    linear = model[1]
    with torch.no_grad():
        linear.weight.zero_()
        linear.bias.zero_()
        linear.weight[1, 0] = linear.weight[1, 1] = 3e38
    return model


def test_a_crafted_finite_model_cannot_make_one_record_poison_the_sum():
    model = crafted_logreg()
    check_finite(model)  # finite: the server could send it
    clipper = PerExampleClipper(model)
    x = torch.zeros(8, 15)
    x[:, 2] = 1.0
    x[0, 0] = 1.0  # one feature only: a finite logit of 3e38
    canary = x.clone()
    canary[7, 0] = canary[7, 1] = 1.0  # 3e38 + 3e38 overflows to inf
    y = torch.zeros(8, dtype=torch.long)
    with_canary = clipper.clipped_sum(canary, y, CLIP)
    without = clipper.clipped_sum(x[:7], y[:7], CLIP)
    assert with_canary.nonfinite == 1
    for got, want in zip(with_canary.grad_sums, without.grad_sums, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)


def test_sums_that_overflow_after_the_norms_are_redone_example_by_example(monkeypatch):
    """Injected fault: the batched sums come back non-finite (as an overflow among finite per-example
    terms could make them); the one-by-one fallback must give the finite sum of the rest."""
    torch.manual_seed(2)
    clipper = PerExampleClipper(build_model("mlp", 15, 2))
    x, y = torch.randn(6, 15), torch.randint(0, 2, (6,))
    clean = clipper.clipped_sum(x, y, CLIP)
    offender = float(clean.sq_norms[4])
    shared = clipping_module._clipped_rows

    def overflowing(records, clip_norm, clients, *args):
        result = shared(records, clip_norm, clients, *args)
        # the batch, and example 4 alone (its float64 norm alone may differ from the batch's in the last float32 bits)
        if len(result.sq_norms) > 1 or math.isclose(float(result.sq_norms[0]), offender, rel_tol=1e-5):
            sums = [result.grad_sums[0] + math.inf, *result.grad_sums[1:]]
            dropped = torch.zeros(len(result.sq_norms), dtype=torch.bool)  # no norm was the cause
            return result._replace(grad_sums=sums, dropped=dropped, broken=torch.ones(1, dtype=torch.bool))
        return result

    monkeypatch.setattr(clipping_module, "_clipped_rows", overflowing)
    redone = clipper.clipped_sum(x, y, CLIP)
    monkeypatch.undo()
    keep = [0, 1, 2, 3, 5]
    expected = clipper.clipped_sum(x[keep], y[keep], CLIP)
    assert redone.nonfinite == 1
    for got, want, full in zip(redone.grad_sums, expected.grad_sums, clean.grad_sums, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got, full)


def plan(steps: int, lr: float) -> Plan:
    return Plan(
        client_id="c",
        rule="calibrated",
        n=32,
        epsilon=1.0,
        delta=1e-5,
        clip_norm=CLIP,
        sigma=1.0,
        sampling_rate=0.5,
        steps=steps,
        rounds=1,
        noise_segments=((1.0, steps),),
        epsilon_pld=0.9,
        epsilon_rdp=1.0,
        learning_rate=lr,
    )


def test_a_non_finite_global_model_is_refused_before_any_record_is_touched():
    model = build_model("logreg", 15, 2)
    with torch.no_grad():
        model[1].weight[0, 3] = math.nan

    class Untouchable:
        """Features that fail loudly if anything reads them."""

        def __array__(self, *args, **kwargs):
            raise AssertionError("the data was read")

    with pytest.raises(NonFiniteModel, match="'1.weight' is not finite"):
        DPTrainer(model, plan(2, 0.1), Untouchable(), Untouchable(), seed=1)


def test_a_diverging_run_releases_only_finite_gradients(monkeypatch):
    """A learning rate of 1e36 makes the forward pass overflow within a few steps; every released
    (noisy) gradient must stay finite: what becomes of the weights then is post-processing."""
    released = []
    release = stack_module.release

    def spy(sums, step, add_noise=True):
        out = release(sums, step, add_noise)
        released.append([out.clone()])
        return out

    monkeypatch.setattr(stack_module, "release", spy)
    torch.manual_seed(0)
    x, y = torch.randn(32, 15) * 10, torch.randint(0, 2, (32,))
    trainer = DPTrainer(build_model("mlp", 15, 2), plan(12, 1e36), x, y, seed=5)
    report = trainer.run_steps(12)
    assert len(released) == 12 and all(torch.isfinite(g).all() for grads in released for g in grads)
    assert report.nonfinite_examples > 0  # the run did diverge
