"""A user's own model cannot carry a record past clipping: every example is computed alone, so one
record moves the clipped, pre-noise sum by at most C whatever the model does with its batch; a model
whose forward changes its own state is refused when built, naming what changed; only the trained
parameters leave a client, in the apps and in the fast engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedprivacy.model_registry import _decorated, register_model
from fedprivacy.models import build_model
from fedprivacy.training import PerExampleClipper, UnsupportedLayerError, check_supported
from fedprivacy.training.capture import BatchedCapture, trained_names
from fedprivacy.training.clipping import clipped_sums
from fedprivacy.training.isolation import rows_apart_by_construction

FEATURES, CLASSES, C = 6, 3, 1.0
SLACK = 1 + 1e-5  # the norm bounds' rounding margin (tests/test_norm_underflow.py)


@pytest.fixture
def registered():
    """Register factories for one test, by name, and forget them afterwards."""
    names = []

    def register(name, factory):
        register_model(name)(factory)
        names.append(name)
        return name

    yield register
    for name in names:
        _decorated.pop(name, None)


# ----- models a user could write that mix the examples of a batch -----
class CentredInTraining(nn.Module):
    """Subtracts the batch mean, in training mode only (so a probe in eval mode sees nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x - x.mean(0, keepdim=True) if self.training else x)


class FunctionalBatchNorm(nn.Module):
    """`F.batch_norm` with batch statistics in training mode: no BatchNorm module to refuse by name."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(F.batch_norm(x, None, None, training=True) if self.training else x)


class MixesAboveThreeRows(nn.Module):
    """Centres on the batch mean only when the batch has more than 3 rows, in every mode: a probe on
    batches of 2 or 3 examples sees an honest model."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x - x.mean(0, keepdim=True) if x.shape[0] > 3 else x)


def centring_hook() -> nn.Module:
    """The model's own forward hook centres its first layer's output over the batch."""
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, CLASSES))
    model[0].register_forward_hook(lambda module, inputs, output: output - output.mean(0, keepdim=True))
    return model


MIXERS = {
    "centred-in-training": CentredInTraining,
    "functional-batch-norm": FunctionalBatchNorm,
    "mixes-above-three-rows": MixesAboveThreeRows,
    "centring-hook": centring_hook,
}


def _sum(clipper: PerExampleClipper, x: Tensor, y: Tensor) -> Tensor:
    """The clipped, pre-noise sum of the batch, flattened."""
    return torch.cat([g.flatten() for g in clipper.clipped_sum(x, y, C).grad_sums]).double()


def _with_and_without_a_record(model: nn.Module) -> float:
    """‖S(D + record) − S(D)‖ through the trainer's clipper, D 65 rows, the record far from them."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(66, FEATURES, generator=generator), torch.randint(0, CLASSES, (66,), generator=generator)
    x[-1] = 1e3
    clipper = PerExampleClipper(model)
    model.train()
    return float((_sum(clipper, x, y) - _sum(clipper, x[:-1], y[:-1])).norm())


@pytest.mark.parametrize("name", ["centred-in-training", "mixes-above-three-rows", "centring-hook"])
def test_one_record_moves_the_clipped_sum_by_at_most_c_whatever_the_model_mixes(name):
    """Measured with the batch-mean models the sum moved by 127·C; computed one example at a time it
    moves by at most C (and by more than C/2 here: the record is clipped to norm C)."""
    torch.manual_seed(0)
    model = MIXERS[name]()
    assert not rows_apart_by_construction(model)
    moved = _with_and_without_a_record(model)
    assert C / 2 < moved <= C * SLACK


def test_batch_statistics_of_one_example_are_refused_by_the_trainer_with_pytorchs_reason():
    """A batch norm of one row has no statistics: the trainer says the model cannot run one example
    at a time, and why."""
    with pytest.raises(UnsupportedLayerError, match="one example at a time.*more than 1 value per channel"):
        _with_and_without_a_record(FunctionalBatchNorm())


@pytest.mark.parametrize(
    "name,needle",
    [
        ("centred-in-training", "in training mode, changing one example of a batch changed the logits"),
        ("centring-hook", "in evaluation mode, changing one example of a batch changed the logits"),
        ("functional-batch-norm", "cannot run one example at a time"),
    ],
)
def test_a_model_seen_to_mix_its_batch_is_refused_when_built_saying_what_was_seen(name, needle, registered):
    """Training computes each example alone, so such a model would silently train another model than
    the one written (or cannot train at all): it is refused when built, saying what was seen."""
    registered(name, lambda shape, classes, name=name: MIXERS[name]())
    with pytest.raises(UnsupportedLayerError, match=f"model='{name}'") as refused:
        build_model(name, (FEATURES,), CLASSES)
    assert needle in str(refused.value)


def test_a_model_mixing_only_at_sizes_no_probe_tries_is_built_and_still_bounded(registered):
    name = registered("mixes-above-three-rows", lambda shape, classes: MixesAboveThreeRows())
    model = build_model(name, (FEATURES,), CLASSES)
    assert C / 2 < _with_and_without_a_record(model) <= C * SLACK


def test_the_fast_engines_capture_computes_each_example_alone_too():
    """Two clients of a batch-mean model stacked: one record of client 1 moves its clipped sum by at
    most C and client 0's not at all."""
    torch.manual_seed(0)
    model = CentredInTraining()
    capture = BatchedCapture(model)
    state = [v.expand(2, *v.shape).clone() for v in model.state_dict().values()]
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 66, FEATURES, generator=generator), torch.randint(0, CLASSES, (2, 66), generator=generator)
    x[1, -1] = 1e3
    valid = torch.ones(2, 66, dtype=torch.bool)

    def sums(valid: Tensor) -> list[Tensor]:
        captured = capture(state, x, y, valid)
        out = clipped_sums(captured.records, torch.full((2,), C, dtype=torch.float64), 2, batch=66)
        return [torch.cat([g[k].flatten() for g in out.grad_sums]).double() for k in range(2)]

    without = valid.clone()
    without[1, -1] = False
    (a0, a1), (b0, b1) = sums(valid), sums(without)
    assert torch.equal(a0, b0)
    assert C / 2 < float((a1 - b1).norm()) <= C * SLACK


# ----- models whose forward changes their state -----
class RunningBatchMax(nn.Module):
    """Keeps the largest value seen in a buffer, written in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, CLASSES)
        self.register_buffer("seen_max", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        self.seen_max = torch.maximum(self.seen_max, x.max().detach())
        return self.lin(x / (1 + self.seen_max))


class NudgesItsBias(nn.Module):
    """Moves a parameter under torch.no_grad() in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.lin.bias += 0.01 * x.mean()
        return self.lin(x)


class MaxNormInForward(nn.Module):
    """Switches Embedding.max_norm on inside forward, where the check of its settings cannot see it:
    the embedding then renormalises the rows it looks up, in place."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4 * FEATURES, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        self.emb.max_norm = 1.0
        return self.lin(self.emb((9 * x).long().clamp(0, 9)).flatten(1))


class RemembersTheLastBatch(nn.Module):
    """Keeps a tensor computed from the batch in a plain attribute and reads it at the next call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, CLASSES)
        self.last: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        shift = 0.0 if self.last is None else self.last
        self.last = x.mean().detach()
        return self.lin(x + shift)


def running_instance_norm() -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (2, FEATURES // 2)),
        nn.InstanceNorm1d(2, track_running_stats=True),
        nn.Flatten(),
        nn.Linear(FEATURES, CLASSES),
    )


WRITERS = {
    "instance-norm-running": (running_instance_norm, "buffer '1.running_mean' changed"),
    "running-batch-max": (RunningBatchMax, "buffer 'seen_max' changed"),
    "nudges-its-bias": (NudgesItsBias, "parameter 'lin.bias' changed"),
    "max-norm-in-forward": (MaxNormInForward, "parameter 'emb.weight' changed"),
    "remembers-the-last-batch": (RemembersTheLastBatch, "attribute 'last'"),
}


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_model_whose_forward_changes_its_state_is_refused_when_built_naming_what_changed(name, registered):
    factory, needle = WRITERS[name]
    registered(name, lambda shape, classes: factory())
    with pytest.raises(UnsupportedLayerError, match=f"model='{name}'") as refused:
        build_model(name, (FEATURES,), CLASSES)
    assert needle in str(refused.value)


@pytest.mark.parametrize("name", ["running-batch-max", "nudges-its-bias", "max-norm-in-forward"])
def test_a_record_cannot_persist_in_the_state_of_a_model_trained_without_the_build_check(name):
    """Built by hand and handed to the trainer: a forward that writes data into a registered
    parameter or buffer cannot, one example at a time (the write fails, or is undone when the
    functional call returns): the step is refused, or the state is as it was."""
    torch.manual_seed(0)
    model = WRITERS[name][0]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.rand(8, FEATURES) * 5, torch.randint(0, CLASSES, (8,))
    try:
        PerExampleClipper(model).clipped_sum(x, y, C)
    except UnsupportedLayerError as refused:
        assert "one example at a time" in str(refused)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_tensor_kept_in_an_attribute_stops_the_trainer_at_the_step_that_kept_it():
    model = RemembersTheLastBatch()
    with pytest.raises(UnsupportedLayerError, match="attribute 'last'"):
        PerExampleClipper(model).clipped_sum(torch.rand(4, FEATURES), torch.randint(0, CLASSES, (4,)), C)


# ----- a parameter its layer's rule does not know -----
def test_a_bare_parameter_on_a_registered_layer_is_refused_by_name(registered):
    def factory(shape, classes):
        model = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, classes))
        model[2].scale = nn.Parameter(torch.ones(classes))
        return model

    with pytest.raises(UnsupportedLayerError, match=r"layer '2' \(Linear\) holds trained parameter 'scale'"):
        check_supported(factory((FEATURES,), CLASSES))
    name = registered("bare-scale", factory)
    with pytest.raises(UnsupportedLayerError, match="model='bare-scale'.*'scale'.*freeze it"):
        build_model(name, (FEATURES,), CLASSES)


# ----- the two forwards are one arithmetic -----
@pytest.mark.parametrize("name,shape", [("logreg", (15,)), ("mlp", (15,)), ("cnn", (1, 8, 8))])
def test_the_batched_forward_of_a_model_kept_apart_gives_bitwise_what_one_example_at_a_time_gives(name, shape):
    """The built-ins run as one batched forward (`rows_apart_by_construction`); forced to run one
    example at a time they give the same bits, for one client and for a stack of three."""
    torch.manual_seed(0)
    model = build_model(name, shape, 4)
    x, y = torch.rand(3, 9, *shape), torch.randint(0, 4, (3, 9))
    batched, alone = BatchedCapture(model), BatchedCapture(model)
    assert batched.rows_apart
    alone.rows_apart = False
    batched.chain = alone.chain = None  # the hooked capture's two forwards (the closed form: test_linear_chain.py)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    state = [v.expand(3, *v.shape).clone() for v in weights.values()]
    valid = torch.ones(3, 9, dtype=torch.bool)
    for a, b in [
        (batched.single(weights, x[0], y[0]), alone.single(weights, x[0], y[0])),
        (batched(state, x, y, valid), alone(state, x, y, valid)),
    ]:
        assert torch.equal(a.losses, b.losses)
        for ra, rb in zip(a.records, b.records, strict=True):
            assert torch.equal(ra.a, rb.a) and torch.equal(ra.d, rb.d)


# ----- only noised parameters leave a client -----
class WithBufferAndFrozen(nn.Module):
    """A constant buffer (a feature scale) and a frozen layer beside the trained ones."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((FEATURES,), 0.5))
        self.frozen = nn.Linear(FEATURES, FEATURES).requires_grad_(False)
        self.head = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.frozen(x * self.scale)))


def test_what_a_client_releases_is_its_trained_parameters_only():
    from fedprivacy.client_round import released_state

    model = WithBufferAndFrozen()
    assert trained_names(model) == ["head.weight", "head.bias"]
    assert list(released_state(model)) == ["head.weight", "head.bias"]
    assert set(model.state_dict()) - set(released_state(model)) == {"scale", "frozen.weight", "frozen.bias"}


def test_the_new_global_model_keeps_the_servers_own_buffers():
    from fedprivacy.aggregation import with_released

    current = {"scale": np.ones(2), "head.weight": np.zeros(2)}
    merged = with_released(current, {"head.weight": np.full(2, 3.0)})
    assert list(merged) == ["scale", "head.weight"] and merged["scale"] is current["scale"]
    with pytest.raises(KeyError, match="not in the global model"):
        with_released(current, {"other": np.zeros(1)})
    assert math.isclose(float(merged["head.weight"][0]), 3.0)
