"""Every per-layer clipping rule against an independent computation: per-example gradients from
torch.func (vmap of grad through functional_call), their norms in float64, clipped and summed per
client; the registry, the refusals, and a user's own rule."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from fedprivacy.training import PerExampleClipper, PerExampleRule, UnsupportedLayerError, check_supported
from fedprivacy.training.clipping import LayerRecord, clipped_sums
from fedprivacy.training.layers import base, register_layer_rule, rule_for
from fedprivacy.training.norms import clip_weights

ROWS = 12  # K·B: one client of 12, or three clients of 4


def per_example(module: nn.Module, a: Tensor, d: Tensor) -> list[Tensor]:
    """Each trained parameter's per-example gradients of ⟨module(aᵢ), dᵢ⟩, whose gradient with
    respect to the output is dᵢ: the gradient the rule must bound and sum, computed independently."""
    trained = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in module.named_parameters() if not p.requires_grad}

    def inner(params: dict[str, Tensor], ai: Tensor, di: Tensor) -> Tensor:
        return (functional_call(module, {**frozen, **params}, (ai.unsqueeze(0),)) * di.unsqueeze(0)).sum()

    grads = vmap(grad(inner), in_dims=(None, 0, 0))(trained, a, d)
    return [grads[n] for n in trained]


def norms64(grads: list[Tensor]) -> Tensor:
    return torch.stack([g.double().flatten(1).square().sum(1) for g in grads]).sum(0).sqrt()


def scaled(shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """Random rows whose sizes span two orders of magnitude, so that some are clipped and some not."""
    return torch.randn(shape, generator=generator) * torch.logspace(-1, 1, shape[0]).view(-1, *(1,) * (len(shape) - 1))


def tokens(shape: tuple[int, ...], vocabulary: int, generator: torch.Generator) -> Tensor:
    """Indices with repeats within a row (the Gram form's [idxₜ = idxₛ]) and some 0s (padding)."""
    return torch.randint(0, vocabulary, shape, generator=generator)


def linear_without_bias() -> nn.Module:
    return nn.Linear(5, 4, bias=False)


def linear_bias_only() -> nn.Module:
    layer = nn.Linear(5, 4)
    layer.weight.requires_grad_(False)
    return layer


# name: (layer, its input for ROWS examples); input shapes pick the Gram form (T² ≤ K·O,
# `gram_is_cheaper`), the materialised one (T² > K·O) and one position in turn.
LAYERS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], Tensor]]] = {
    "linear": (lambda: nn.Linear(5, 4), lambda g: scaled((ROWS, 5), g)),
    "linear-no-bias": (linear_without_bias, lambda g: scaled((ROWS, 5), g)),
    "linear-bias-only": (linear_bias_only, lambda g: scaled((ROWS, 5), g)),
    "linear-positions-gram": (lambda: nn.Linear(5, 4), lambda g: scaled((ROWS, 3, 5), g)),
    "linear-positions-materialised": (lambda: nn.Linear(2, 3), lambda g: scaled((ROWS, 5, 2), g)),
    "conv1d-one-position": (lambda: nn.Conv1d(4, 6, 3), lambda g: scaled((ROWS, 4, 3), g)),
    "conv1d-grouped-gram": (lambda: nn.Conv1d(4, 6, 3, groups=2), lambda g: scaled((ROWS, 4, 4), g)),
    "conv1d-grouped-materialised": (
        lambda: nn.Conv1d(4, 6, 3, groups=2, padding=2, padding_mode="reflect", dilation=2, stride=2),
        lambda g: scaled((ROWS, 4, 9), g),
    ),
    "conv1d-no-bias": (lambda: nn.Conv1d(2, 3, 3, bias=False, padding="same"), lambda g: scaled((ROWS, 2, 6), g)),
    "conv2d-gram": (lambda: nn.Conv2d(3, 4, 2, stride=2), lambda g: scaled((ROWS, 3, 4, 4), g)),
    "conv2d-one-channel-materialised": (  # patches laid out by kernel offset (`conv.offset_patches`)
        lambda: nn.Conv2d(1, 4, 3, padding=2, dilation=2, padding_mode="reflect"),
        lambda g: scaled((ROWS, 1, 6, 7), g),
    ),
    "conv2d-grouped": (
        lambda: nn.Conv2d(4, 6, 3, groups=2, padding=1, padding_mode="circular"),
        lambda g: scaled((ROWS, 4, 5, 5), g),
    ),
    "embedding": (lambda: nn.Embedding(7, 3), lambda g: tokens((ROWS, 6), 7, g)),
    "embedding-padding": (lambda: nn.Embedding(7, 3, padding_idx=0), lambda g: tokens((ROWS, 6), 4, g)),
    "embedding-one-index": (lambda: nn.Embedding(7, 3, padding_idx=2), lambda g: tokens((ROWS,), 7, g)),
    "layernorm": (lambda: nn.LayerNorm(6), lambda g: scaled((ROWS, 6), g) + 3.0),
    "layernorm-positions-2d": (lambda: nn.LayerNorm((3, 4)), lambda g: scaled((ROWS, 2, 3, 4), g)),
    "layernorm-no-bias": (lambda: nn.LayerNorm(5, bias=False), lambda g: scaled((ROWS, 3, 5), g)),
    "groupnorm": (lambda: nn.GroupNorm(3, 6), lambda g: scaled((ROWS, 6, 5), g)),
    "groupnorm-2d": (lambda: nn.GroupNorm(2, 4), lambda g: scaled((ROWS, 4, 3, 3), g)),
}


def layer_case(name: str, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    """The layer with random (not default) weights, its input and a random output gradient."""
    make, inputs = LAYERS[name]
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    module = make()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    a = inputs(g)
    d = scaled(tuple(module(a).shape), g)
    return module, a, d


def expected_sums(
    grads: list[Tensor], norms: Tensor, clip: Tensor | float, clients: int = 1
) -> list[tuple[Tensor, Tensor]]:
    """(Σ_b w_kb·g_kb, Σ_b |w_kb·g_kb|) per client in float64, w = min(1, C_k/‖g_kb‖): the sum, and
    the scale of float32's rounding error in forming it."""
    rows = norms.shape[0]
    clip = torch.as_tensor(clip, dtype=torch.float64).reshape(-1).repeat_interleave(rows // clients)
    weights = torch.clamp(clip / norms, max=1.0)
    sums = []
    for g in grads:
        weighted = (g.double() * weights.view(-1, *(1,) * (g.dim() - 1))).view(clients, rows // clients, *g.shape[1:])
        sums.append((weighted.sum(1), weighted.abs().sum(1)))
    return sums


def assert_sums_close(got: Tensor, want: tuple[Tensor, Tensor]) -> None:
    """Equal up to float32 rounding: |got − Σ| ≤ 10⁻⁵·Σ|terms| entry by entry."""
    total, scale = want
    assert got.shape == total.shape
    error = (got.double() - total).abs()
    assert (error <= 1e-5 * scale + 1e-30).all(), float((error / scale).nan_to_num().max())


@pytest.mark.parametrize("name", list(LAYERS))
def test_each_rule_bounds_the_per_example_norms_from_above(name: str) -> None:
    module, a, d = layer_case(name)
    true = norms64(per_example(module, a, d))
    terms = rule_for(module).terms(module, a, d, lambda x, slot: x.double())
    bound = terms.sq_norms.sqrt()
    assert terms.sq_norms.dtype == torch.float64 and bound.shape == (ROWS,)
    assert (bound >= true * (1 - 1e-6)).all(), (bound / true).min()
    assert (bound <= true * (1 + 1e-5)).all(), (bound / true).max()


@pytest.mark.parametrize("clients", [1, 3])
@pytest.mark.parametrize("name", list(LAYERS))
def test_each_rule_sums_the_clipped_gradients_per_client(name: str, clients: int) -> None:
    module, a, d = layer_case(name, seed=1)
    grads = per_example(module, a, d)
    true = norms64(grads)
    # Each client's C between its examples' norms: some clipped, some not.
    clip = true.view(clients, -1).median(dim=1).values.float()
    result = clipped_sums(
        [LayerRecord(module, a, d)], clip if clients > 1 else float(clip), clients, batch=len(a) // clients
    )
    assert result.all_finite and not result.dropped.any() and not result.broken.any()
    torch.testing.assert_close(result.sq_norms.sqrt(), true.view(clients, -1), rtol=1e-5, atol=0.0)
    want = expected_sums(grads, true, clip, clients)
    assert len(result.grad_sums) == len(want)
    for got, expected, (_, p) in zip(result.grad_sums, want, base.trainable(module), strict=True):
        assert got.shape == (clients, *p.shape) and got.dtype == torch.float32
        assert_sums_close(got, expected)


@pytest.mark.parametrize("name", [name for name in LAYERS if name.endswith(("-gram", "-materialised"))])
def test_each_case_takes_the_form_its_name_says(name: str) -> None:
    """The cases above exercise both forms of the positional norms: the Gram form forms no
    per-example gradients, the materialised one does."""
    module, a, d = layer_case(name)
    per_example = rule_for(module).terms(module, a, d, lambda x, slot: x.double()).state[2]
    assert (per_example is None) == name.endswith("-gram")


@pytest.mark.parametrize("name", list(LAYERS))
def test_each_example_alone_adds_at_most_c(name: str) -> None:
    """What one example adds to the sums (its weight, all others 0) has norm ≤ C, in float64."""
    module, a, d = layer_case(name, seed=2)
    rule = rule_for(module)
    terms = rule.terms(module, a, d, lambda x, slot: x.double())
    clip = float(norms64(per_example(module, a, d)).median())
    weights = clip_weights(terms.sq_norms, terms.slack, clip, torch.float32)
    for i in range(ROWS):
        alone = torch.where(torch.arange(ROWS) == i, weights, 0.0).view(1, ROWS)
        added = norms64(rule.weighted_sums(module, terms, alone))
        assert float(added) <= clip * (1 + 1e-6)


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_non_finite_example_is_dropped_and_the_others_summed(name: str) -> None:
    module, a, d = layer_case(name, seed=3)
    grads = per_example(module, a, d)
    true = norms64(grads)
    clip = torch.full((3,), float(true.median()))
    poisoned = d.clone()
    poisoned[5] = math.nan
    result = clipped_sums([LayerRecord(module, a, poisoned)], clip, 3, batch=len(a) // 3)
    dropped = torch.zeros(ROWS, dtype=torch.bool)
    dropped[5] = True
    assert torch.equal(result.dropped.view(-1), dropped) and float(result.sq_norms.view(-1)[5]) == 0.0
    assert not result.broken.any() and not result.all_finite
    kept = [torch.where(dropped.view(-1, *(1,) * (g.dim() - 1)), 0.0, g) for g in grads]
    for got, want in zip(result.grad_sums, expected_sums(kept, true, clip, 3), strict=True):
        assert_sums_close(got, want)


def test_unclipped_sums_that_overflow_are_reported_broken_for_their_client_only() -> None:
    """Finite norms (float64), finite per-example gradients, a float32 sum that overflows: the
    client is flagged for the example-by-example path, the other is not."""
    layer = nn.Linear(1, 1)
    a = torch.tensor([[2e38], [2e38], [1.0], [2.0]])
    d = torch.ones(4, 1)
    result = clipped_sums([LayerRecord(layer, a, d)], 1.0, 2, clip=False, batch=2)
    assert result.broken.tolist() == [True, False] and not result.dropped.any()
    assert torch.isfinite(result.sq_norms).all()
    assert result.grad_sums[0][1].item() == 3.0 and result.grad_sums[1][1].item() == 2.0
    assert not clipped_sums([LayerRecord(layer, a, d)], 1.0, 2, batch=2).broken.any()  # clipped, nothing overflows


class Mixed(nn.Module):
    """Every built-in rule in one model: tokens → Embedding → Conv1d (grouped) → GroupNorm → Conv2d
    → LayerNorm → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4, padding_idx=0)
        self.conv1 = nn.Conv1d(4, 6, 3, padding=1, groups=2)
        self.group = nn.GroupNorm(3, 6)
        self.conv2 = nn.Conv2d(1, 2, 3)
        self.layer = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.group(self.conv1(self.embed(x).transpose(1, 2))))  # (B, 6, 5)
        h = torch.relu(self.conv2(h.unsqueeze(1)))  # (B, 2, 4, 3)
        h = self.layer(h.flatten(2).transpose(1, 2).flatten(1)[:, :16])
        return self.head(h)


def model_per_example(model: nn.Module, x: Tensor, y: Tensor) -> list[Tensor]:
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return [grads[n] for n in params]


def test_a_model_of_every_layer_is_clipped_end_to_end_by_the_trainer() -> None:
    torch.manual_seed(4)
    model = Mixed()
    x, y = torch.randint(0, 11, (10, 5)), torch.randint(0, 3, (10,))
    x[:3, :2] = 0  # padding
    grads = model_per_example(model, x, y)
    true = norms64(grads)
    clip = float(true.sort().values[4:6].mean())  # between the middle two norms: half above C, half below
    clipper = PerExampleClipper(model)
    assert clipper.parameters == list(model.parameters())
    batch = clipper.clipped_sum(x, y, clip)
    torch.testing.assert_close(batch.sq_norms.sqrt(), true, rtol=1e-5, atol=0.0)
    assert int(batch.clipped) == int((true > clip).sum()) > 0
    for got, want in zip(batch.grad_sums, expected_sums(grads, true, clip), strict=True):
        assert_sums_close(got.unsqueeze(0), want)


# ----- refusals -----
class OwnLinear(nn.Linear):
    """A Linear that computes something else: the Linear rule would be wrong for it."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) ** 2


@pytest.mark.parametrize(
    "model,needles",
    [
        (
            nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
            ["'1' (BatchNorm1d)", "use GroupNorm or LayerNorm instead"],
        ),
        (nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2, affine=False)), ["'1' (BatchNorm2d)", "batch statistics"]),
        (nn.Sequential(nn.Linear(4, 4), nn.PReLU()), ["'1' (PReLU)", "(weight)", "register_layer_rule"]),
        (nn.Sequential(OwnLinear(4, 4)), ["'0' (OwnLinear)", "overrides Linear.forward", "register_layer_rule"]),
        (nn.Sequential(nn.Embedding(5, 2, max_norm=1.0)), ["'0' (Embedding)", "max_norm=1.0", "max_norm=None"]),
        (
            nn.Sequential(nn.Embedding(5, 2, scale_grad_by_freq=True)),
            ["'0' (Embedding)", "depends on the others", "scale_grad_by_freq=False"],
        ),
    ],
)
def test_unsupported_layers_and_settings_are_refused_by_name_before_training(model, needles) -> None:
    with pytest.raises(UnsupportedLayerError) as refused:
        check_supported(model)
    for needle in needles:
        assert needle in str(refused.value)


def test_a_subclass_that_keeps_forward_uses_its_base_rule() -> None:
    class Tagged(nn.Linear):
        pass

    assert rule_for(Tagged(2, 2)) is rule_for(nn.Linear(2, 2))
    assert rule_for(OwnLinear(2, 2)) is None and rule_for(nn.PReLU()) is None


def test_a_layer_norm_over_the_batch_dimension_is_refused() -> None:
    clipper = PerExampleClipper(nn.Sequential(nn.LayerNorm((4, 3)), nn.Linear(3, 2)))
    with pytest.raises(UnsupportedLayerError, match="cannot run one example at a time.*normalized_shape=\\[4, 3\\]"):
        clipper.clipped_sum(torch.randn(4, 3), torch.randint(0, 2, (4,)), 1.0)


def test_a_model_that_mixes_rows_of_the_batch_is_refused() -> None:
    """Examples folded together into other rows: each example, computed alone, has no such rows."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Flatten(0), nn.Unflatten(0, (2, 8)), nn.Linear(8, 2))
    with pytest.raises(UnsupportedLayerError, match="cannot run one example at a time"):
        PerExampleClipper(model).clipped_sum(torch.randn(4, 3), torch.randint(0, 2, (2,)), 1.0)


# ----- a user's own layer and rule -----
class Scale(nn.Module):
    """A learned per-feature scale, y = x ⊙ γ: a layer the registry does not know."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(features))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class ScaleRule(PerExampleRule):
    """Example i's gradient of γ is Σ over positions of dᵢ ⊙ aᵢ."""

    def per_example(self, module: nn.Module, a: Tensor, d: Tensor) -> list[Tensor]:
        return [(d * a).reshape(a.shape[0], -1, a.shape[-1]).sum(1)]


def test_a_registered_user_rule_clips_its_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "_RULES", dict(base._RULES))  # the registration ends with the test
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), Scale(5), nn.Linear(5, 2))
    with torch.no_grad():
        model[2].gamma.uniform_(0.5, 2.0)
    with pytest.raises(UnsupportedLayerError, match=r"'2' \(Scale\) has trainable parameters \(gamma\)"):
        PerExampleClipper(model)
    register_layer_rule(Scale, ScaleRule())
    x, y = torch.randn(8, 6) * torch.logspace(-1, 1, 8).unsqueeze(1), torch.randint(0, 2, (8,))
    grads = model_per_example(model, x, y)
    true = norms64(grads)
    clip = float(true.median())
    batch = PerExampleClipper(model).clipped_sum(x, y, clip)
    torch.testing.assert_close(batch.sq_norms.sqrt(), true, rtol=1e-5, atol=0.0)
    for got, want in zip(batch.grad_sums, expected_sums(grads, true, clip), strict=True):
        assert_sums_close(got.unsqueeze(0), want)


def test_only_rules_are_registered_for_module_types() -> None:
    with pytest.raises(TypeError, match="rule="):
        register_layer_rule(Scale, lambda module, a, d: None)
    with pytest.raises(TypeError, match="layer_type="):
        register_layer_rule("Scale", ScaleRule())


class FoldsTheBatch(nn.Module):
    """A model whose only layer sees the whole batch as one row (x.unsqueeze(0)): its layers agree on
    their row count, but that count is not the number of examples."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.unsqueeze(0)).squeeze(0)


def test_a_model_that_folds_the_batch_into_one_row_is_still_clipped_per_example() -> None:
    """Clipped as one row, the whole batch would get one clip weight: one record could then move the
    sum by up to 2C. Computed one example at a time, the fold is a fold of one example, and each
    example is clipped on its own (checked against torch.func's per-example gradients). The shared
    function still counts rows against examples."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 4) * 10, torch.randint(0, 3, (8,))
    model = FoldsTheBatch()
    batch = PerExampleClipper(model).clipped_sum(x, y, 1.0)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(weights, xi, yi):
        return F.cross_entropy(functional_call(model, weights, (xi[None],)), yi[None])

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.sqrt(sum(g.flatten(1).double().square().sum(1) for g in per_example.values()))
    weights = (1.0 / norms).clamp(max=1.0)
    for (name, _), summed in zip(model.named_parameters(), batch.grad_sums, strict=True):
        g = per_example[name].double()
        assert torch.allclose(summed.double(), (weights.view(-1, *[1] * (g.dim() - 1)) * g).sum(0), atol=1e-6)
    layer = nn.Linear(4, 3)
    with pytest.raises(UnsupportedLayerError, match="sees 2 rows where the batch has 8 examples"):
        clipped_sums([LayerRecord(layer, torch.randn(2, 4), torch.randn(2, 3))], 1.0, 2, batch=4)


def test_tied_weights_are_refused_naming_both_layers() -> None:
    """One parameter in two layers would be clipped, noised and stepped once per layer."""
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    with pytest.raises(UnsupportedLayerError, match=r"layer '2' \(Linear\) shares a trained parameter with layer '0'"):
        check_supported(nn.Sequential(first, nn.ReLU(), second))
    second.weight = nn.Parameter(first.weight.detach().clone())  # untied: accepted
    check_supported(nn.Sequential(first, nn.ReLU(), second))


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(1, 4, 3, padding=1),
        nn.Conv2d(2, 3, (2, 3), padding=(2, 1), dilation=(2, 1), padding_mode="circular"),
        nn.Conv1d(3, 2, 4, padding="same", padding_mode="replicate"),
        nn.Conv1d(1, 5, 2, dilation=3),
    ],
    ids=["2d-one-channel", "2d-dilated-circular", "1d-same-replicate", "1d-dilated"],
)
def test_patches_by_kernel_offset_are_the_patches_laid_out_otherwise(conv: nn.Module) -> None:
    from fedprivacy.training.layers.conv import offset_patches, patches

    x = torch.randn(5, conv.in_channels, *([9] * len(conv.kernel_size)))
    by_offset = offset_patches(conv, x)
    assert torch.equal(by_offset, patches(conv, x))
    assert by_offset.transpose(1, 2).is_contiguous()  # the runs copied are output rows


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(16, 32, 3, padding=1),
        nn.Conv2d(4, 6, 3, groups=2, padding=(2, 1), stride=2, dilation=(1, 2)),
        nn.Conv2d(3, 4, 2, padding=1, padding_mode="reflect"),
        nn.Conv1d(4, 6, 3, groups=2, padding=2),
    ],
    ids=["2d-zeros", "2d-grouped-strided-dilated", "2d-reflect", "1d-grouped-zeros"],
)
@pytest.mark.parametrize("channels_last", [False, True])
def test_patches_are_the_unfolded_input_in_patch_order(conv: nn.Module, channels_last: bool) -> None:
    """`patches` against F.unfold (its own padding where the layer pads with zeros), reordered to
    a group's kernel offsets then its channels, for either memory layout of the input."""
    from fedprivacy.training.layers.conv import _padded, patches

    one_d = conv.weight.dim() == 3
    x = torch.randn(5, conv.in_channels, *((9,) if one_d else (7, 9)))
    if channels_last and not one_d:
        x = x.contiguous(memory_format=torch.channels_last)
    zeros = conv.padding_mode == "zeros"
    source = x if zeros else _padded(conv, x)
    kernel, stride, dilation = (
        ((1, *conv.kernel_size), (1, *conv.stride), (1, *conv.dilation))
        if one_d
        else (conv.kernel_size, conv.stride, conv.dilation)
    )
    padding = ((0, *conv.padding) if one_d else conv.padding) if zeros else 0
    unfolded = F.unfold(source.unsqueeze(2) if one_d else source, kernel, dilation, padding, stride)
    groups, offsets = conv.groups, math.prod(conv.kernel_size)
    by_group = unfolded.unflatten(1, (groups, conv.in_channels // groups, offsets))  # (R, G, C/G, k, L)
    expected = by_group.permute(0, 4, 1, 3, 2).flatten(2)  # (R, L, G·k·C/G)
    assert torch.equal(patches(conv, x), expected)


@pytest.mark.parametrize(("rows", "positions", "width"), [(6400, 16, 144), (115, 16, 144), (113, 16, 144), (300, 8, 5)])
def test_gram_products_in_blocks_of_rows_are_bit_for_bit_the_whole_product(rows: int, positions: int, width: int):
    """`norms.gram64` copies blocks of rows to float64 (in the cache) and multiplies each: every
    example's Gram matrix is the one a single product gives, strided input and a remainder of one
    row (folded into the block before) included."""
    from fedprivacy.training.norms import GRAM_BLOCK, Float64Scratch, _fresh_float64, gram64

    x = torch.randn(rows, width, positions).transpose(1, 2)  # strided, as a convolution's D
    whole = torch.bmm(x.double(), x.double().transpose(1, 2))
    if rows == 6400:
        assert rows > 2 * GRAM_BLOCK // (positions * width)  # several blocks
    if rows in (115, 113):  # 56 rows a block: a last block of 3, and of one row (joined to the one before)
        assert GRAM_BLOCK // (positions * width) == 56
    for to64 in (_fresh_float64, Float64Scratch()):
        assert torch.equal(gram64(x, to64, "x"), whole)
