"""The fast engine's batched capture gives, for every client of a stack, the A and D that the
trainer's forward hooks give on that client alone (its own weights, its own rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedprivacy.models import build_model
from fedprivacy.training.capture import BatchedCapture, convolution_as_product, trained_layers
from fedprivacy.training.layers.base import UnsupportedLayerError


class Mixed(nn.Module):
    """Embedding, grouped Conv1d, GroupNorm, LayerNorm and Linear: tokens (as floats) to classes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8, padding_idx=0)
        self.conv = nn.Conv1d(8, 12, kernel_size=3, padding=1, groups=2)
        self.group = nn.GroupNorm(3, 12)
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x.long()).transpose(1, 2)  # [B, 8, T]
        h = torch.relu(self.group(self.conv(h)))
        return self.head(self.norm(h.transpose(1, 2)).mean(1))


def _gn_cnn() -> nn.Module:
    """Image-shaped outputs into GroupNorm, which refuses channels-last inputs under vmap."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64, 3),
    )


class ViewCNN(nn.Module):
    """The tutorial pattern `x.view(len(x), -1)`, which needs contiguous input."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(64, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = F.max_pool2d(torch.relu(self.conv(x.view(len(x), 1, 8, 8))), 2)
        return self.head(h.view(h.size(0), -1))


def _case(name: str) -> tuple[nn.Module, Tensor, int]:
    """(model, features [K, B, ...], classes) with three clients of five rows."""
    generator = torch.Generator().manual_seed(3)
    if name == "cnn":
        return build_model("cnn", 64, 10), torch.rand(3, 5, 64, generator=generator), 10
    if name == "gn-cnn":
        torch.manual_seed(3)
        return _gn_cnn(), torch.rand(3, 5, 64, generator=generator), 3
    if name == "view-cnn":
        torch.manual_seed(3)
        return ViewCNN(), torch.rand(3, 5, 64, generator=generator), 3
    if name == "mlp":
        return build_model("mlp", 15, 2), torch.randn(3, 5, 15, generator=generator), 2
    return Mixed(), torch.randint(0, 20, (3, 5, 7), generator=generator).float(), 3


def _client_states(model: nn.Module, clients: int) -> list[dict[str, Tensor]]:
    """Each client's own weights: the model's, moved apart by a different amount per client."""
    base = model.state_dict()
    generator = torch.Generator().manual_seed(11)
    return [
        {key: value + 0.1 * k * torch.randn(value.shape, generator=generator) for key, value in base.items()}
        for k in range(clients)
    ]


def _hooked(model: nn.Module, state: dict[str, Tensor], x: Tensor, y: Tensor) -> list[tuple[Tensor, Tensor]]:
    """(A, D) per trained layer as the trainer takes them: forward hooks on the plain model, one
    client, its rows only, D = ∂(Σ losses)/∂(layer output)."""
    model.load_state_dict(state)
    seen: dict[nn.Module, tuple[Tensor, Tensor]] = {}
    handles = [
        module.register_forward_hook(lambda m, i, o: seen.__setitem__(m, (i[0].detach(), o)))
        for _, module, _ in trained_layers(model)
    ]
    try:
        losses = F.cross_entropy(model(x), y, reduction="none")
    finally:
        for handle in handles:
            handle.remove()
    layers = [module for _, module, _ in trained_layers(model)]
    deltas = torch.autograd.grad(losses.sum(), [seen[m][1] for m in layers])
    return [(seen[m][0], d) for m, d in zip(layers, deltas, strict=True)]


# convolutions grouped, outputs as the model makes them; grouped, outputs channels-last (CPUs); as products (GPUs)
LAYOUTS = {
    "grouped": {},
    "channels-last": {"channels_last": True},
    "product": {"conv_as_matmul": True},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["cnn", "gn-cnn", "view-cnn", "mlp", "mixed"])
def test_each_clients_a_and_d_are_the_trainers_hooks_on_that_client_alone(name, layout):
    model, x, classes = _case(name)
    clients, batch = x.shape[:2]
    y = torch.randint(0, classes, (clients, batch), generator=torch.Generator().manual_seed(5))
    valid = torch.tensor(
        [[True, True, True, True, True], [True, False, True, True, False], [False, False, False, False, False]]
    )  # a full batch, padding between rows, an empty batch
    states = _client_states(model, clients)
    keys = list(model.state_dict())
    stacked = [torch.stack([s[key] for s in states]) for key in keys]
    capture = BatchedCapture(model, keys, **LAYOUTS[layout])
    captured = capture(stacked, x, y, valid)
    # GroupNorm cannot take channels-last under vmap, nor `.view` at all: those captures go on without
    assert capture.channels_last == (layout == "channels-last" and name not in ("gn-cnn", "view-cnn"))

    assert [r.module for r in captured.records] == [m for _, m, _ in trained_layers(model)]
    assert captured.losses.shape == (clients, batch)
    plain = _case(name)[0]  # the same architecture without the capture's hooks, loaded with each client's weights
    for k in range(clients):
        rows = valid[k]
        rows_of_k = slice(k * batch, (k + 1) * batch)
        if rows.any():
            expected = _hooked(plain, states[k], x[k][rows], y[k][rows])
            for record, (a, d) in zip(captured.records, expected, strict=True):
                torch.testing.assert_close(record.a[rows_of_k][rows], a, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(record.d[rows_of_k][rows], d, rtol=1e-5, atol=1e-6)
            want = F.cross_entropy(plain(x[k][rows]), y[k][rows], reduction="none")
            torch.testing.assert_close(captured.losses[k][rows], want.detach(), rtol=1e-5, atol=1e-6)
        for record in captured.records:  # padding rows: no loss, no output gradient
            assert torch.equal(record.d[rows_of_k][~rows], torch.zeros_like(record.d[rows_of_k][~rows]))
        assert torch.equal(captured.losses[k][~rows], torch.zeros(int((~rows).sum())))


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(torch.relu(self.layer(x)))


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.used(x)


@pytest.mark.parametrize(
    ("model", "message"),
    [(Shared(), "'layer' .*called more than once"), (Unused(), "'spare' was not called in the forward pass")],
)
@pytest.mark.parametrize("private", [True, False])  # the capture of A and D, and the plain gradient sums
def test_a_layer_called_twice_or_never_is_refused_by_name(model, message, private):
    keys = list(model.state_dict())
    stacked = [v.unsqueeze(0) for v in model.state_dict().values()]
    capture = BatchedCapture(model, keys, channels_last=True)
    run = capture if private else capture.gradient_sums
    with pytest.raises(UnsupportedLayerError, match=message):
        run(stacked, torch.randn(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool))


def test_a_capture_that_gives_up_channels_last_redoes_the_call_from_the_same_random_state():
    """Dropout before GroupNorm: the first capture fails with channels-last outputs after drawing
    its dropout masks; it is redone from the random state it started from, so it equals a capture
    that never tried (and the next one draws fresh masks)."""
    model = nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 4, 3, padding=1),
        nn.Dropout(0.5),
        nn.GroupNorm(2, 4),
        nn.Flatten(),
        nn.Linear(256, 3),
    )
    keys = list(model.state_dict())
    stacked = [torch.stack([v, v]) for v in model.state_dict().values()]
    x = torch.rand(2, 4, 64, generator=torch.Generator().manual_seed(0))
    y, valid = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool)
    runs = {}
    for laid_out in (True, False):
        torch.manual_seed(7)
        capture = BatchedCapture(model, keys, channels_last=laid_out)
        runs[laid_out] = [capture(stacked, x, y, valid) for _ in range(2)]
        assert not capture.channels_last
    for tried, plain in zip(runs[True], runs[False], strict=True):
        assert torch.equal(tried.losses, plain.losses)
        for a, b in zip(tried.records, plain.records, strict=True):
            assert torch.equal(a.a, b.a) and torch.equal(a.d, b.d)
    assert not torch.equal(runs[True][0].losses, runs[True][1].losses)  # fresh masks on the next call


@pytest.mark.parametrize(
    ("layer", "shape"),
    [
        (nn.Conv2d(4, 6, 3, padding=1), (5, 4, 8, 8)),
        (nn.Conv2d(4, 6, (3, 2), stride=2, dilation=(1, 2), groups=2), (5, 4, 9, 11)),
        (nn.Conv2d(4, 8, 3, padding="same", groups=4, bias=False, padding_mode="reflect"), (3, 4, 7, 7)),
        (nn.Conv1d(6, 9, 4, stride=2, padding=3, groups=3), (5, 6, 20)),
    ],
)
def test_a_convolution_as_a_product_of_patches_is_the_convolution(layer, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(convolution_as_product(layer, x), layer(x), rtol=1e-5, atol=1e-6)
