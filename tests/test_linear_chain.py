"""The closed-form capture of chains of Linear layers and ReLUs (`training.chain`): recognised only
where it is the same computation, and giving the hooked capture's A, D and losses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedprivacy.models import build_model
from fedprivacy.training.capture import BatchedCapture
from fedprivacy.training.chain import LinearChain
from fedprivacy.training.clipping import clipped_sums


def _pair(model: nn.Module) -> tuple[BatchedCapture, BatchedCapture]:
    """A capture that takes the closed form, and one of the same model forced onto the hooks."""
    closed, hooked = BatchedCapture(model), BatchedCapture(model)
    assert closed.chain is not None
    hooked.chain = None
    return closed, hooked


@pytest.mark.parametrize(
    "make,shape",
    [
        (lambda: build_model("logreg", (1, 4, 4), 3), (1, 4, 4)),
        (lambda: build_model("mlp", (16,), 3), (16,)),
        (
            lambda: nn.Sequential(
                nn.Linear(16, 8), nn.ReLU(), nn.Identity(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)
            ),
            (16,),
        ),
    ],
)
def test_the_closed_form_gives_the_hooked_capture_s_inputs_losses_and_output_gradients(make, shape):
    """One client: A and the losses bit for bit, D to float32 rounding (0 on padding rows either way);
    a stack of three clients with their own weights: the same to float32 rounding. The clipped
    sums formed from them agree too, and so do the plain gradient sums of the engine without the
    mechanism."""
    torch.manual_seed(0)
    model = make()
    closed, hooked = _pair(model)
    x, y = torch.randn(3, 9, *shape) * 3, torch.randint(0, 3, (3, 9))
    valid = torch.rand(3, 9) < 0.7
    valid[:, 0] = True
    a, b = closed.single(None, x[0], y[0], valid[0]), hooked.single(None, x[0], y[0], valid[0])
    assert torch.equal(a.losses, b.losses)
    for ra, rb in zip(a.records, b.records, strict=True):
        assert ra.module is rb.module and torch.equal(ra.a, rb.a)
        torch.testing.assert_close(ra.d, rb.d, rtol=1e-5, atol=1e-7)
        assert not ra.d[~valid[0]].any()
    sums = [clipped_sums(c.records, 0.5, 1, batch=9) for c in (a, b)]
    torch.testing.assert_close(sums[0].sq_norms, sums[1].sq_norms, rtol=1e-5, atol=1e-9)
    for g, h in zip(sums[0].grad_sums, sums[1].grad_sums, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-7)

    state = [v.expand(3, *v.shape) + 0.1 * torch.randn(3, *v.shape) for v in model.state_dict().values()]
    a, b = closed(state, x, y, valid), hooked(state, x, y, valid)
    torch.testing.assert_close(a.losses, b.losses)
    for ra, rb in zip(a.records, b.records, strict=True):
        assert ra.a.shape == rb.a.shape and ra.d.shape == rb.d.shape
        torch.testing.assert_close(ra.a, rb.a)
        torch.testing.assert_close(ra.d, rb.d, rtol=1e-5, atol=1e-7)
    (plain_a, losses_a), (plain_b, losses_b) = (c.gradient_sums(state, x, y, valid) for c in (closed, hooked))
    torch.testing.assert_close(losses_a, losses_b)
    for g, h in zip(plain_a, plain_b, strict=True):  # the engine without the mechanism: autograd's sums
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-6)


def test_a_chain_is_recognised_only_where_the_closed_form_is_the_model_s_computation():
    """Other activations, a frozen or missing bias, a ReLU last, a partial Flatten, a subclass that
    overrides a forward, a user's hook, a model that is not a Sequential: all take the hooked capture."""
    assert LinearChain.of(build_model("logreg", (8,), 2)) is not None
    assert LinearChain.of(build_model("mlp", (8,), 2)) is not None
    assert LinearChain.of(build_model("cnn", (1, 8, 8), 2)) is None

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    frozen = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    frozen[0].bias.requires_grad_(False)
    hooked = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    hooked[1].register_forward_hook(lambda module, inputs, output: output * 0.5)
    for model in [
        nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 2)),
        nn.Sequential(nn.Linear(8, 4), nn.Dropout(0.5), nn.Linear(4, 2)),
        nn.Sequential(nn.Linear(8, 4, bias=False), nn.ReLU(), nn.Linear(4, 2)),
        nn.Sequential(nn.Linear(8, 4), nn.ReLU()),
        nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.ReLU(), nn.Linear(4, 2)),
        nn.Sequential(nn.Flatten(2), nn.Linear(8, 2)),
        nn.Sequential(Scaled(8, 2)),
        nn.Sequential(nn.Sequential(nn.Linear(8, 2))),
        frozen,
        hooked,
    ]:
        assert LinearChain.of(model) is None, model


def test_rows_of_more_than_one_dimension_without_a_flatten_take_the_hooked_capture():
    """A Linear applied at every position of a sequence is not a matrix of rows: the chain leaves
    such rows to the hooked capture and its positional rule."""
    chain = LinearChain.of(nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3)))
    x = torch.randn(5, 2, 6)
    assert not chain.takes(x, 1) and chain.takes(x[:, 0], 1) and not chain.takes(x.unsqueeze(0), 2)
    assert LinearChain.of(nn.Sequential(nn.Flatten(), nn.Linear(12, 3))).takes(x, 1)
