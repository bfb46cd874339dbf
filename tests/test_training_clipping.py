"""Per-example clipping equals the definition: one example at a time, autograd, clip, sum."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedprivacy.models import build_model
from fedprivacy.training import PerExampleClipper, UnsupportedLayerError

ATOL = 1e-5


def reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float):
    """Per-example gradients by a plain loop; returns (clipped per-example grads, norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads, norms = [], []
    for i in range(len(x)):
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum")
        g = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum(t.square().sum() for t in g))
        factor = min(1.0, clip / float(norm))
        grads.append([factor * t for t in g])
        norms.append(norm)
    return grads, torch.stack(norms)


class TwoLayerSequence(nn.Module):
    """A Linear applied over a sequence dimension (3-D input), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(5, 7)
        self.head = nn.Linear(21, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inner(x.view(-1, 3, 5))).flatten(1))


def odd_convs() -> nn.Module:
    """Strided, grouped, dilated, reflect- and 'same'-padded convs, one without bias."""
    return nn.Sequential(
        nn.Conv2d(4, 6, 3, stride=2, groups=2, padding=1, padding_mode="reflect"),
        nn.Tanh(),
        nn.Conv2d(6, 4, 2, dilation=2, padding="same", bias=False),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 3),
    )


CASES = {
    "logreg": (lambda: build_model("logreg", 15, 2), (15,), 2),
    "mlp": (lambda: build_model("mlp", 15, 2), (15,), 2),
    "cnn": (lambda: build_model("cnn", 64, 10), (1, 8, 8), 10),
    "sequence-linear": (TwoLayerSequence, (15,), 3),
    "odd-convs": (odd_convs, (4, 9, 9), 3),
}


def full_float32(device: torch.device) -> contextlib.AbstractContextManager:
    """cuDNN convolutions default to TF32 (10-bit mantissa) on GPUs; compare the maths in float32."""
    if device.type == "cuda":
        return torch.backends.cudnn.flags(enabled=True, allow_tf32=False)
    return contextlib.nullcontext()


@pytest.mark.parametrize("case", list(CASES))
def test_clipped_gradients_match_a_per_example_loop(case: str, compute_device: torch.device) -> None:
    with full_float32(compute_device):
        check_clipped_gradients(case, compute_device)


def check_clipped_gradients(case: str, device: torch.device) -> None:
    make, shape, classes = CASES[case]
    torch.manual_seed(1)
    model = make().to(device)
    x = torch.randn(12, *shape) * torch.linspace(0.1, 3.0, 12).view(-1, *(1,) * len(shape))
    y = torch.randint(0, classes, (12,))
    x, y = x.to(device), y.to(device)
    _, norms = reference(model, x, y, float("inf"))
    middle = norms.sort().values[5:7]
    clip = float(middle.mean())  # between the middle two norms: half above C, half below
    ref_grads, ref_norms = reference(model, x, y, clip)
    assert (ref_norms > clip).any() and (ref_norms < clip).any()

    clipper = PerExampleClipper(model)
    batch = clipper.clipped_sum(x, y, clip)
    torch.testing.assert_close(batch.sq_norms.sqrt(), ref_norms.double(), atol=ATOL, rtol=1e-5)  # norms are float64
    assert int(batch.clipped) == int((ref_norms > clip).sum())
    expected_sum = [sum(g[k] for g in ref_grads) for k in range(len(ref_grads[0]))]
    assert len(batch.grad_sums) == len(expected_sum)
    for got, want in zip(batch.grad_sums, expected_sum):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)

    # Each example alone: the clipped sum of a batch of one is that example's clipped gradient.
    for i in (int(ref_norms.argmin()), int(ref_norms.argmax())):
        alone = clipper.clipped_sum(x[i : i + 1], y[i : i + 1], clip)
        for got, want in zip(alone.grad_sums, ref_grads[i]):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
        total = torch.sqrt(sum(g.square().sum() for g in alone.grad_sums))
        assert float(total) <= clip * (1 + 1e-5)


def test_frozen_parameters_are_left_out_of_the_norm() -> None:
    torch.manual_seed(2)
    model = build_model("mlp", 15, 2)
    model[1].bias.requires_grad_(False)
    x, y = torch.randn(6, 15), torch.randint(0, 2, (6,))
    ref_grads, ref_norms = reference(model, x, y, 0.5)
    batch = PerExampleClipper(model).clipped_sum(x, y, 0.5)
    torch.testing.assert_close(batch.sq_norms.sqrt(), ref_norms.double(), atol=ATOL, rtol=1e-5)  # norms are float64
    for got, want in zip(batch.grad_sums, [sum(g[k] for g in ref_grads) for k in range(3)]):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)


def test_hooks_do_not_change_normal_use() -> None:
    model = build_model("mlp", 15, 2)
    PerExampleClipper(model)
    model(torch.randn(4, 15)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    "model,needle",
    [
        (nn.Sequential(nn.Linear(15, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)), "BatchNorm1d"),
        (nn.Sequential(nn.Linear(15, 8), nn.PReLU(), nn.Linear(8, 2)), "PReLU"),
        (nn.Sequential(nn.ConvTranspose1d(1, 2, 3), nn.Flatten(), nn.Linear(34, 2)), "ConvTranspose1d"),
    ],
)
def test_unsupported_layers_are_refused_by_name(model: nn.Module, needle: str) -> None:
    with pytest.raises(UnsupportedLayerError, match=needle) as err:
        PerExampleClipper(model)
    assert "'1'" in str(err.value) or "'0'" in str(err.value)  # names the layer's position


def test_frozen_batch_norm_is_still_refused() -> None:
    model = nn.Sequential(nn.Linear(15, 8), nn.BatchNorm1d(8, affine=False), nn.Linear(8, 2))
    with pytest.raises(UnsupportedLayerError, match="batch"):
        PerExampleClipper(model)


class Residual(nn.Module):
    """Adds a block's output to the block's own input, in place (`h += block(h)`, after the block
    read h) or not: ordinary autograd cannot train the in-place form, whose weight gradients need
    the input it overwrote; the capture keeps what each layer saw."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.first = nn.Linear(15, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = 2.0 * self.first(x)
        if self.in_place:
            h += torch.relu(self.block(h))
        else:
            h = h + torch.relu(self.block(h))
        return self.head(h)


@pytest.mark.parametrize(
    "in_place,out_of_place",
    [
        (  # kept apart by construction: one batched forward
            lambda: nn.Sequential(nn.Linear(15, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)),
            lambda: nn.Sequential(nn.Linear(15, 8), nn.ReLU(), nn.Linear(8, 2)),
        ),
        (lambda: Residual(in_place=True), lambda: Residual(in_place=False)),  # one example at a time
    ],
)
def test_in_place_operations_give_the_per_example_gradients(in_place, out_of_place) -> None:
    """A layer's output or input written in place after the layer ran changes neither A nor D: the
    capture adds its probe to a new tensor and keeps what each layer saw."""
    torch.manual_seed(0)
    model, reference = in_place(), out_of_place()
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(6, 15), torch.randint(0, 2, (6,))
    got = PerExampleClipper(model).clipped_sum(x, y, 0.1)
    want = PerExampleClipper(reference).clipped_sum(x, y, 0.1)
    assert torch.equal(got.sq_norms, want.sq_norms)
    for g, w in zip(got.grad_sums, want.grad_sums, strict=True):
        assert torch.equal(g, w)


class CallsItsLayerTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.tanh(self.layer(x)))


def test_shared_layer_is_refused() -> None:
    """A layer placed twice is refused when the clipper is made (it holds a parameter twice); one
    called twice by its module's forward, when the forward runs."""
    layer = nn.Linear(4, 4)
    with pytest.raises(UnsupportedLayerError, match="layer '2' \\(Linear\\) shares a trained parameter with layer '0'"):
        PerExampleClipper(nn.Sequential(layer, nn.Tanh(), layer))
    clipper = PerExampleClipper(CallsItsLayerTwice())
    with pytest.raises(UnsupportedLayerError, match="more than once"):
        clipper.clipped_sum(torch.randn(3, 4), torch.randint(0, 4, (3,)), 1.0)
