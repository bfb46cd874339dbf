"""The Gram ("ghost") norm from float32 Gram matrices (`norms.float32_gram_bound`): an upper bound on
what is summed whatever the inputs' scale (underflowing products, subnormals, cancellation), checked
against the per-example gradient formed in float64 from the same float32 values; tight for ordinary
inputs; not used where matrix products are not IEEE single precision, nor for a row whose entries
overflow (that row alone is bounded in float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedprivacy.training.layers.linear import positional_norms
from fedprivacy.training.norms import exact_float32_products, float32_gram_bound


def exact_squared_norms(a: torch.Tensor, d: torch.Tensor, bias: bool) -> torch.Tensor:
    """‖Σₜ dₜ(aₜ, b)ᵀ‖² per example, formed in float64 from the float32 values (products of float32
    numbers are exact in float64; the sums add a relative 10⁻¹⁶)."""
    a64, d64 = a.double(), d.double()
    if bias:
        a64 = torch.cat([a64, torch.ones(*a64.shape[:2], 1, dtype=torch.float64)], dim=2)
    return torch.bmm(d64.transpose(1, 2), a64).flatten(1).square().sum(1)


def scaled(shape: tuple[int, ...], scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).float()


def cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    rows, t, k, o = 40, 6, 20, 8
    alternating = torch.tensor([(-1.0) ** i for i in range(t)]).view(1, t, 1)
    base_a = scaled((rows, 1, k), 1.0, 1).expand(rows, t, k).contiguous()
    return {
        "ordinary": (scaled((rows, t, k), 1.0, 2), scaled((rows, t, o), 1.0, 3)),
        # dₜ·dₛ underflows to 0 in float32 (2e-23² = 4e-46) while ‖G‖ is ~1e-4
        "underflowing-d": (scaled((rows, t, k), 1e18, 4), scaled((rows, t, o), 2e-23, 5)),
        "underflowing-a": (scaled((rows, t, k), 1e-24, 6), scaled((rows, t, o), 1e17, 7)),
        "subnormal-entries": (scaled((rows, t, k), 1e-40, 8), scaled((rows, t, o), 1e-39, 9)),
        # the same aₜ at every position, dₜ alternating in sign: G cancels to (nearly) 0
        "cancelling": (base_a, alternating * scaled((rows, 1, o), 1.0, 10)),
        "mixed": (scaled((rows, t, k), 1e15, 11) * (torch.rand(rows, t, k) < 0.3), scaled((rows, t, o), 1e-20, 12)),
    }


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", list(cases()))
def test_the_float32_gram_bound_is_never_below_the_exact_norm(case, bias):
    a, d = cases()[case]
    squared, s, n_a, finite = float32_gram_bound(a, d, bias)
    assert finite.all()
    exact = exact_squared_norms(a, d, bias)
    assert (squared >= exact).all(), (case, (exact - squared).max())
    a64 = a.double()
    norms_a = (a64.square().sum(2) + float(bias)).sqrt()
    assert (n_a >= norms_a).all() and (s >= (norms_a * d.double().square().sum(2).sqrt()).sum(1)).all()


def test_the_float32_gram_bound_is_tight_for_ordinary_inputs():
    a, d = cases()["ordinary"]
    squared, _, _, _ = float32_gram_bound(a, d, True)
    exact = exact_squared_norms(a, d, True)
    assert (squared <= exact * (1 + 1e-4)).all()


def test_a_row_whose_float32_gram_overflows_is_bounded_alone_in_float64():
    """That row's bound comes from its own A and D in float64; every other row's bound is the one
    it has without that row in the batch (no row's bound depends on another's values)."""
    a, d = cases()["ordinary"]
    module = nn.Linear(a.shape[2], d.shape[2])
    a_bad = a.clone()
    a_bad[3, 2, 0] = 3e19  # its square overflows float32
    assert not float32_gram_bound(a_bad, d, True)[3][3]
    formed = positional_norms(module, a_bad, d)
    assert torch.isfinite(formed.sq_norms).all() and (formed.sq_norms >= exact_squared_norms(a_bad, d, True)).all()
    others = [i for i in range(len(a)) if i != 3]
    alone = positional_norms(module, a[others], d[others])
    assert torch.equal(formed.sq_norms[others], alone.sq_norms)
    assert torch.equal(formed.slack.mass[others], alone.slack.mass)


def test_reduced_precision_matrix_products_turn_the_float32_form_off():
    assert exact_float32_products(torch.device("cpu"))
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")  # may use bfloat16 products on CPU
        assert not exact_float32_products(torch.device("cpu"))
        a, d = cases()["underflowing-d"]
        formed = positional_norms(nn.Linear(a.shape[2], d.shape[2]), a, d)
        assert (formed.sq_norms >= exact_squared_norms(a, d, True)).all()
    finally:
        torch.set_float32_matmul_precision(previous)
    assert exact_float32_products(torch.device("cpu"))
