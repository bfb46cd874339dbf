"""DP-SGD for many clients at once: every client's weights stacked along a first dimension, every
step one batched forward and backward for the whole stack, for any model the trainer accepts.

It is the trainer's mechanism (`fedprivacy.training`), client by client: Poisson samples and
noise from each client's own stream (`draw_batch`, the same bytes `DPTrainer` reads); each trained
layer's inputs A and output gradients D captured for all clients in one pass (`BatchedCapture`);
per-example norm bounds, clip weights and per-client clipped sums by the trainer's own layer rules
(`fedprivacy.training.clipping.clipped_sums`: the one implementation of the clipping, float64
norms that cannot underflow and let an example in unclipped); clipping at each client's C; noise
σ_t·C on the sum (σ_t·C kept in float64 until it multiplies the standard normals, the product then
cast to the parameters' dtype: `release_stacked`); division by the expected batch qN; each
client's learning rate. Clients whose rounds have fewer steps are masked out of the steps they do
not take.

Batching by padding was chosen by measurement against per-client loops (docs/simulator.md, "The
fast engine"): each step gathers every client's sampled rows into a [clients, largest batch, ...]
tensor; the padding rows have zero loss, hence zero output gradient, so they contribute nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from fedprivacy.training.capture import BatchedCapture
from fedprivacy.training.clipping import PerExampleClipper, clipped_sums
from fedprivacy.training.norms import NORM_DTYPE, Float64Scratch
from fedprivacy.training.step import noise_scale
from fedprivacy.training.trainer import UNCLIPPED


@dataclass
class StepInputs:
    """One step for K clients."""

    features: Tensor  # [K, B, ...] sampled rows, padded
    labels: Tensor  # [K, B]
    valid: Tensor  # [K, B] bool: a real sampled row
    normals: Tensor  # [K, P] standard normals in the trained parameters' order
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


def release_stacked(sums: list[Tensor], step: StepInputs, add_noise: bool = True) -> list[Tensor]:
    """(Σ clipped + σC·N(0, I)) / (qN) per client, the noise split in the trained parameters' order.

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


class _Clipped(NamedTuple):
    """A step's clipped sums (`clipped_sums`' fields, [K, …]) and per-example losses [K, B]."""

    grad_sums: list[Tensor]
    sq_norms: Tensor
    dropped: Tensor
    broken: Tensor
    losses: Tensor


class ClientStack:
    """The DP step for a stack of clients of one model (`template`), whose state is held as one
    [K, *shape] tensor per entry of `template.state_dict()` (in that order, `keys`).

    The trained parameters, the order of their noise and of their sums are the trainer's
    (`PerExampleClipper.parameters`); a model the trainer refuses is refused here, by the trainer's
    own check, when the stack is made. On a GPU the convolutions run as batched products
    (`capture.convolution_as_product`: one kernel where cuDNN ran one per client and group); on
    a CPU as grouped convolutions, which measured faster there.

    A step pads every client's sampled rows to the largest batch. Poisson batches of mean 20 have a
    largest of about 33 among 1,000 clients, so on a CPU, for a model whose arithmetic is the cost
    (at least `BUCKET_PRODUCTS` multiply-adds per example, `BatchedCapture.example_products`), the
    clients are split by batch size into up to `CPU_BUCKETS` stacks of at least `BUCKET_CLIENTS`
    each, padded to their own largest batch. Smaller stacks also keep each step's tensors in the
    cache and the allocator's reuse. Measured on 2 cores: the digits CNN (83,200) 27% faster per
    round at 256 clients with 4 stacks than 1, and at 1,000 clients 0.74 s per round with 15 stacks
    against 0.90 s with 4 (8 stacks of 125: 0.76 s; 32 of 31: 0.80 s); the MLP (1,088) 40% slower
    at 1,000 in 4 stacks, each extra stack's fixed cost outweighing its rows. On a GPU, one stack:
    its round's time goes elsewhere (drawing the noise)."""

    CPU_BUCKETS = 16
    BUCKET_CLIENTS = 64
    BUCKET_PRODUCTS = 10_000

    def __init__(self, template: nn.Module) -> None:
        self.keys = list(template.state_dict())
        self.repair = SingleClientRepair(copy.deepcopy(template))
        on_gpu = next(template.parameters()).device.type == "cuda"
        self.buckets = 1 if on_gpu else self.CPU_BUCKETS
        self.capture = BatchedCapture(template, self.keys, conv_as_matmul=on_gpu, channels_last=not on_gpu)
        names = self.capture.trained_names
        if names != self.repair.names:
            raise RuntimeError(f"trained parameters {names} are not in the trainer's order {self.repair.names}")
        self.trained = [self.keys.index(name) for name in names]  # positions in the state, trained order
        self.noise_count = sum(template.state_dict()[name].numel() for name in names)
        self._float64 = Float64Scratch()  # float64 copies for the norms, reused step after step

    def step(
        self,
        state: list[Tensor],
        step: StepInputs,
        learning_rate: Callable[[list[Tensor]], Tensor],
        private: bool = True,
    ) -> StepReport:
        """One DP-SGD step for every client, in place on `state` (inactive clients keep theirs).

        `learning_rate` maps the released gradients to each client's η (AdaGrad-norm reads them).
        `private=False` skips the norms, clipping and noise: plain gradient sums from an ordinary
        backward, the step a non-private engine takes, for the non-private baseline
        (`run_fast(private=False)`) and for measuring what the mechanism costs
        (benchmarks/sim_throughput.py); no run config can ask for it.
        """
        sums = self._clipped_sums(state, step, private)
        grad_sums = sums.grad_sums
        if bool(sums.broken.any()):
            self.repair(state, step, grad_sums, sums.broken, clip=private)
        released = release_stacked(grad_sums, step, add_noise=private)
        rate = learning_rate(released) * step.active
        for position, g in zip(self.trained, released, strict=True):
            weights = state[position]
            weights.sub_(rate.view(-1, *(1,) * (weights.dim() - 1)) * g)
        counted = step.valid & ~sums.dropped
        above = sums.sq_norms > step.clip.to(NORM_DTYPE).square().unsqueeze(1)  # nothing is clipped when not private
        return StepReport(
            released,
            (step.valid & sums.dropped).sum(1),
            torch.where(counted, sums.losses, 0.0).sum(1),
            (counted & above).sum(1) if private else torch.zeros_like(counted).sum(1),
            step.valid.sum(1),
        )

    def _clipped_sums(self, state: list[Tensor], step: StepInputs, private: bool) -> _Clipped:
        """The clients' clipped sums (`clipped_sums`) and per-example losses, formed bucket by
        bucket (`_buckets`) and put back in client order."""
        buckets = self._buckets(step)
        if not buckets:
            return self._stack_sums(state, step.features, step.labels, step.valid, step.clip, private)
        shape = step.valid.shape
        sq_norms = torch.zeros(shape, dtype=NORM_DTYPE, device=step.valid.device)
        dropped = torch.zeros_like(step.valid)
        losses = torch.zeros(shape, dtype=step.features.dtype, device=step.valid.device)
        broken = torch.zeros_like(step.valid[:, 0])
        grad_sums: list[Tensor] = []
        for clients, width in buckets:
            part = self._stack_sums(
                [s[clients] for s in state],
                step.features[clients, :width],
                step.labels[clients, :width],
                step.valid[clients, :width],
                step.clip[clients],
                private,
            )
            if not grad_sums:
                grad_sums = [g.new_zeros(shape[0], *g.shape[1:]) for g in part.grad_sums]
            for whole, g in zip(grad_sums, part.grad_sums, strict=True):
                whole[clients] = g
            sq_norms[clients, :width], dropped[clients, :width] = part.sq_norms, part.dropped
            losses[clients, :width], broken[clients] = part.losses, part.broken
        return _Clipped(grad_sums, sq_norms, dropped, broken, losses)

    def _stack_sums(
        self, state: list[Tensor], features: Tensor, labels: Tensor, valid: Tensor, clip: Tensor, private: bool
    ) -> _Clipped:
        """One stack's sums: the shared clipping on the batched capture; without the mechanism the
        plain gradient sums (`BatchedCapture.gradient_sums`, no norms), unless one is not finite."""
        clients, batch = labels.shape
        if not private:
            plain = self.capture.gradient_sums(state, features, labels, valid)
            if plain is not None:
                sums, losses = plain
                none = torch.zeros_like(valid)
                norms = torch.zeros(valid.shape, dtype=NORM_DTYPE, device=valid.device)  # not computed
                return _Clipped(sums, norms, none, none[:, 0], losses)
        captured = self.capture(state, features, labels, valid)
        sums = clipped_sums(captured.records, clip, clients, self._float64, clip=private, batch=batch)
        return _Clipped(sums.grad_sums, sums.sq_norms, sums.dropped, sums.broken, captured.losses)

    def _buckets(self, step: StepInputs) -> list[tuple[Tensor, int]]:
        """(clients, their largest batch) per bucket: the clients sorted by batch size and cut into
        up to `buckets` runs of equal count (sampled rows are packed at the front of each row);
        none where one padded stack is the faster (see the class docstring)."""
        sizes = step.valid.sum(1)
        count = min(self.buckets, len(sizes) // self.BUCKET_CLIENTS)
        if count <= 1 or self.capture.example_products(step.features[0, 0]) < self.BUCKET_PRODUCTS:
            return []
        order = torch.argsort(sizes, stable=True)
        parts = order.tensor_split(count)
        widths = torch.stack([sizes[part[-1]] for part in parts]).clamp(min=1).tolist()
        return list(zip(parts, widths, strict=True))


class SingleClientRepair:
    """The rare client whose batched sums overflowed although every norm was finite: its sums are
    redone by the trainer's own clipper (which goes example by example), so it drops exactly the
    examples the trainer would (with `clip=False`, clipping at the trainer's `UNCLIPPED`, as its
    non-private steps do)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.clipper = PerExampleClipper(model)
        name_of = {id(p): name for name, p in model.named_parameters()}
        self.names = [name_of[id(p)] for p in self.clipper.parameters]  # the trainer's order

    def __call__(
        self, state: list[Tensor], step: StepInputs, sums: list[Tensor], broken: Tensor, clip: bool = True
    ) -> None:
        keys = list(self.model.state_dict())
        for k in torch.nonzero(broken).flatten().tolist():
            self.model.load_state_dict({key: stacked[k] for key, stacked in zip(keys, state, strict=True)})
            rows = step.valid[k]
            bound = float(step.clip[k]) if clip else UNCLIPPED
            batch = self.clipper.clipped_sum(step.features[k][rows], step.labels[k][rows], bound)
            for s, g in zip(sums, batch.grad_sums, strict=True):
                s[k] = g
