"""DP-SGD for many clients at once: a stack of Linear layers (with ReLU between), every client's
weights stacked along a first dimension, every step one batched forward and backward.

It is the trainer's mechanism (`fedprivacy.training`), client by client: Poisson samples and
noise from each client's own stream (`draw_batch`, the same bytes `DPTrainer` reads), per-example
gradients by book-keeping (Bu et al.: the layer inputs A and output gradients D; for a Linear layer
‖gᵢ‖² = ‖dᵢ‖²(‖aᵢ‖² + 1) and the clipped sum is (w⊙D)ᵀA), the norms and clip weights in float64 by
the trainer's own functions (`linear_norms`, `clip_weights`: no norm can underflow to 0 and let an
example in unclipped), clipping at each client's C, noise σ_t·C on the sum (σ_t·C kept in float64
until it multiplies the standard normals, the product then cast to the parameters' dtype:
`release_stacked`), division by the expected batch qN, and each client's learning rate. Clients
whose rounds have fewer steps are masked out of the steps they do not take.

Batching by padding was chosen by measurement against per-client loops (docs/simulator.md, "The
fast engine"): each step gathers every client's sampled rows into a [clients, largest batch,
features] tensor; the padding rows carry zero output gradient, so they contribute nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedprivacy.training.clipping import (
    NORM_DTYPE,
    Float64Scratch,
    PerExampleClipper,
    Slack,
    clip_weights,
    linear_norms,
)
from fedprivacy.training.step import noise_scale
from fedprivacy.training.trainer import UNCLIPPED

_FLOAT64 = Float64Scratch()  # the float64 copies for the norms, reused step after step (one stack at a time)


@dataclass(frozen=True)
class StackShape:
    """The layers of a model the stack can train: Linear sizes, ReLU between them."""

    sizes: tuple[tuple[int, int], ...]  # (in, out) of each Linear, in order

    @classmethod
    def of(cls, model: nn.Module) -> StackShape | None:
        """The shape of `model` if it is Flatten?, Linear, (ReLU, Linear)*; None otherwise."""
        layers = [m for m in model.modules() if m is not model and not isinstance(m, nn.Sequential)]
        if layers and isinstance(layers[0], nn.Flatten):
            layers = layers[1:]
        linears = layers[0::2]
        activations = layers[1::2]
        if not linears or not all(isinstance(m, nn.Linear) and m.bias is not None for m in linears):
            return None
        if len(activations) != len(linears) - 1 or not all(type(m) is nn.ReLU for m in activations):
            return None
        return cls(tuple((m.in_features, m.out_features) for m in linears))


@dataclass
class StepInputs:
    """One step for K clients."""

    features: Tensor  # [K, B, d] sampled rows, padded
    labels: Tensor  # [K, B]
    valid: Tensor  # [K, B] bool: a real sampled row
    normals: Tensor  # [K, P] standard normals in parameter order
    sigma: Tensor  # [K] noise multiplier of this step
    clip: Tensor  # [K]
    expected_batch: Tensor  # [K] q·N
    active: Tensor  # [K] bool: the client takes this step


@dataclass
class StepReport:
    """What a step gives besides the new weights: the released gradients (for AdaGrad-norm) and
    local diagnostics (never sent unless a simulation asks for them)."""

    released: list[Tensor]
    nonfinite: Tensor  # [K] examples dropped for a non-finite gradient
    loss_sum: Tensor  # [K] over kept examples
    clipped: Tensor  # [K] examples whose norm exceeded C
    examples: Tensor  # [K] sampled examples


def _forward(weights: list[Tensor], x: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    """(inputs A of each layer, pre-activations Z of each layer)."""
    inputs, outputs = [], []
    a = x
    for layer in range(len(weights) // 2):
        w, b = weights[2 * layer], weights[2 * layer + 1]
        inputs.append(a)
        z = torch.baddbmm(b.unsqueeze(1), a, w.transpose(1, 2))
        outputs.append(z)
        a = torch.relu(z)
    return inputs, outputs


def _backward(weights: list[Tensor], inputs: list[Tensor], d_logits: Tensor) -> list[Tensor]:
    """Gradients of the summed loss with respect to each layer's output, from the last one back."""
    grads = [d_logits]
    for layer in range(len(inputs) - 1, 0, -1):
        # ReLU's derivative as 1.0/0.0: the sign of its output (a float multiply, not a cast bool mask)
        d = torch.bmm(grads[0], weights[2 * layer]) * torch.sign(inputs[layer])
        grads.insert(0, d)
    return grads


def clipped_sums(
    weights: list[Tensor], step: StepInputs, clip_examples: bool = True
) -> tuple[list[Tensor], Tensor, Tensor, Tensor]:
    """Per client: Σᵢ clip_C(gᵢ) in parameter order (weight, bias per layer), with examples whose
    gradient norm is not finite dropped; also (non-finite count, loss sum, clipped count).
    `clip_examples=False` sums the raw gradients: only for measuring what clipping costs."""
    inputs, outputs = _forward(weights, step.features)
    logits = outputs[-1]
    valid = step.valid
    log_p = torch.log_softmax(logits, dim=-1)
    losses = -log_p.gather(-1, step.labels.unsqueeze(-1)).squeeze(-1)
    d_logits = (log_p.exp() - F.one_hot(step.labels, logits.shape[-1]).to(logits.dtype)) * valid.unsqueeze(-1)
    deltas = _backward(weights, inputs, d_logits)
    # Per-example squared norms and slacks in float64, from the float32 A and D that are summed below.
    sq, slack = linear_norms(inputs[0], deltas[0], _FLOAT64, 0)
    for layer, (a, d) in enumerate(zip(inputs[1:], deltas[1:], strict=True), start=1):
        layer_sq, layer_slack = linear_norms(a, d, _FLOAT64, layer)
        sq, slack = sq + layer_sq, slack.plus(layer_slack)
    finite = torch.isfinite(sq)  # a finite norm implies a finite slack
    if not bool(torch.isfinite(sq.sum())):  # a diverged or crafted model: drop those examples
        keep = finite.unsqueeze(-1)
        inputs = [torch.where(keep, a, 0.0) for a in inputs]
        deltas = [torch.where(keep, d, 0.0) for d in deltas]
        sq, slack = (
            torch.where(finite, sq, 0.0),
            Slack(torch.where(finite, slack.mass, 0.0), slack.coefficient, slack.constant),
        )
    clip = step.clip.to(NORM_DTYPE).unsqueeze(-1)
    # C / max(‖gᵢ‖, C), in float64, cast so that the cast never raises it (see clip_weights)
    w = clip_weights(sq, slack, clip, logits.dtype) if clip_examples else torch.ones_like(losses)
    sums = []
    for a, d in zip(inputs, deltas, strict=True):
        wd = d * w.unsqueeze(-1)
        sums += [torch.bmm(wd.transpose(1, 2), a), wd.sum(1)]
    counted = valid & finite
    return (
        sums,
        (valid & ~finite).sum(1),
        torch.where(counted, losses, 0.0).sum(1),
        (counted & (sq > clip.square())).sum(1),
    )


def release_stacked(sums: list[Tensor], step: StepInputs, add_noise: bool = True) -> list[Tensor]:
    """(Σ clipped + σC·N(0, I)) / (qN) per client, the noise split in parameter order.

    The noise scale σ_t·C is the trainer's (`fedprivacy.training.step.noise_scale`): formed in
    float64 from the plan's σ_t and C, rounded once to the parameters' dtype, upwards, so the
    noise's standard deviation is never below the certified σC (tests/test_fast_engine.py checks it).
    """
    scale = noise_scale(step.sigma, step.clip, sums[0].dtype) * add_noise
    normals = step.normals.split([s[0].numel() for s in sums], dim=1)
    return [
        (s + scale.view(-1, *(1,) * (s.dim() - 1)) * n.view_as(s)) / step.expected_batch.view(-1, *(1,) * (s.dim() - 1))
        for s, n in zip(sums, normals, strict=True)
    ]


def stacked_dp_step(
    weights: list[Tensor],
    step: StepInputs,
    learning_rate: Callable[[list[Tensor]], Tensor],
    repair: SingleClientRepair | None = None,
    private: bool = True,
) -> StepReport:
    """One DP-SGD step for every client, in place on `weights` (inactive clients keep theirs).

    `learning_rate` maps the released gradients to each client's η (AdaGrad-norm reads them).
    `private=False` skips clipping and noise: the same step without the mechanism, for the
    non-private baseline (`run_fast(private=False)`) and for measuring what the mechanism costs
    (benchmarks/sim_throughput.py); no run config can ask for it.
    """
    sums, nonfinite, loss_sum, clipped = clipped_sums(weights, step, clip_examples=private)
    finite = torch.isfinite(torch.stack([s.flatten(1).sum(1) for s in sums]).sum(0))  # NaN and ±inf reach the total
    if repair is not None and not bool(finite.all()):
        repair(weights, step, sums, ~finite, clip=private)
    released = release_stacked(sums, step, add_noise=private)
    rate = (learning_rate(released) * step.active).view(-1, 1)
    for w, g in zip(weights, released, strict=True):
        w.sub_(rate.view(-1, *(1,) * (w.dim() - 1)) * g)
    return StepReport(released, nonfinite, loss_sum, clipped, step.valid.sum(1))


class SingleClientRepair:
    """The rare client whose batched sums overflowed although every norm was finite: its sums are
    redone by the trainer's own clipper (which goes example by example), so it drops exactly the
    examples the trainer would (with `clip=False`, clipping at the trainer's `UNCLIPPED`, as its
    non-private steps do)."""

    def __init__(self, template: nn.Module) -> None:
        self.model = template
        self.clipper = PerExampleClipper(template)

    def __call__(
        self, weights: list[Tensor], step: StepInputs, sums: list[Tensor], broken: Tensor, clip: bool = True
    ) -> None:
        for k in torch.nonzero(broken).flatten().tolist():
            with torch.no_grad():
                for parameter, stacked in zip(self.clipper.parameters, weights, strict=True):
                    parameter.copy_(stacked[k])
            rows = step.valid[k]
            bound = float(step.clip[k]) if clip else UNCLIPPED
            batch = self.clipper.clipped_sum(step.features[k][rows], step.labels[k][rows], bound)
            for s, g in zip(sums, batch.grad_sums, strict=True):
                s[k] = g
