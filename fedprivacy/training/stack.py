"""The DP-SGD step for K clients at once, every client's weights stacked along a first
dimension: the one mechanism. The trainer (`fedprivacy.training.trainer`) runs it with K = 1 on a
client's own model; the fast engine with a round's clients.

Per step and client: Poisson-sampled rows (drawn by the caller from the client's own stream,
`fedprivacy.training.rng`), each trained layer's inputs A and output gradients D captured with
every example computed alone (`capture.BatchedCapture`), per-example norm bounds, clip weights
and clipped sums by the layer rules (`clipping.clipped_sums`), Gaussian noise σ_t·C on the sum,
released exactly rounded to a power-of-two grid (`noise.rounded_gaussian`, σ_t·C in float64:
`release`), division by the expected batch qN, and the client's learning rate. Clients whose
rounds have fewer steps are masked out of the steps they do not take.

Each client's batch is padded with zeros to a width its own batch sets (`ClientStack`, and
docs/simulator.md, "The fast engine"): padding rows have zero loss, hence zero output gradient,
and contribute nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedprivacy.training.capture import BatchedCapture
from fedprivacy.training.clipping import Clipped, ClippedBatch, check_supported, clipped_sums
from fedprivacy.training.noise import NoiseAhead, Refiner, rounded_gaussian
from fedprivacy.training.norms import NORM_DTYPE, Float64Scratch

# The clip norm of a step with the mechanism off: above every gradient norm (a squared norm of
# float32 gradients stays below 1e200 in float64, see clipping.py), so every clip weight is exactly
# 1, and σ·C with σ = 0 is exactly 0 (C = inf would make it NaN); its square is still a float.
UNCLIPPED = 1e150


def noise_scale(sigma: float | Tensor, clip_norm: float | Tensor) -> Tensor:
    """σ·C in float64, rounded upwards: the product rounded to nearest, then one ulp up, so that the
    noise's standard deviation is never below the certified σC (at most 1.5 ulp above it); σ = 0 stays 0."""
    device = sigma.device if isinstance(sigma, Tensor) else None
    product = torch.as_tensor(sigma, dtype=torch.float64, device=device) * torch.as_tensor(
        clip_norm, dtype=torch.float64, device=device
    )
    return torch.where(product > 0, torch.nextafter(product, torch.full_like(product, math.inf)), product)


@dataclass
class StepInputs:
    """One step for K clients."""

    features: Tensor  # [K, B, ...] sampled rows, padded
    labels: Tensor  # [K, B]
    valid: Tensor  # [K, B] bool: a real sampled row
    noise_words: Tensor  # [K, 2m] int64 keystream words of the noise (`rng.noise_width`), P ≤ 2m
    noise_std: Tensor  # [K] σ_t·C of this step (`noise_scale`, formed once per round), float64
    clip: Tensor  # [K]
    expected_batch: Tensor  # [K] q·N
    active: Tensor  # [K] bool: the client takes this step
    refiners: Sequence[Refiner] = ()  # [K] each client's refinement words for this step (`rng.StepRandomness.refiner`)
    noise_ahead: NoiseAhead | None = None  # the words' `noise.noise_ahead`, if made before the step


@dataclass
class StepReport:
    """What a step gives besides the new weights: the released gradients (for AdaGrad-norm) and,
    formed only when read, local diagnostics (never sent unless a simulation asks for them)."""

    released: list[Tensor]
    sums: Clipped
    valid: Tensor  # [K, B]
    clip: Tensor  # [K]
    private: bool

    @property
    def nonfinite(self) -> Tensor:
        """[K] examples dropped for a non-finite gradient."""
        if self.sums.all_finite:
            return torch.zeros(self.valid.shape[0], dtype=torch.long, device=self.valid.device)
        return (self.valid & self.sums.dropped).sum(1)

    def _counted(self) -> Tensor:
        return self.valid if self.sums.all_finite else self.valid & ~self.sums.dropped

    @property
    def loss_sum(self) -> Tensor:
        """[K] cross-entropy summed over the kept examples (padding rows' losses are 0)."""
        if self.sums.all_finite:
            return self.sums.losses.sum(1)
        return torch.where(self._counted(), self.sums.losses, 0.0).sum(1)

    @property
    def clipped(self) -> Tensor:
        """[K] kept examples whose norm exceeded C (none when not private: nothing is clipped)."""
        if not self.private:
            return torch.zeros(self.valid.shape[0], dtype=torch.long, device=self.valid.device)
        return (self._counted() & (self.sums.sq_norms > self.clip.square().unsqueeze(1))).sum(1)

    @property
    def examples(self) -> Tensor:
        """[K] sampled examples."""
        return self.valid.sum(1)


class RoundTotals:
    """A round's local diagnostics summed over its steps, per client [K]: what the trainer's report
    and the fast engine's diagnostics read (local only: sent only when a simulation asks). A step's
    rows are kept and reduced `STEPS_AT_ONCE` steps at a time: reducing each step on its own costs
    more calls than arithmetic."""

    STEPS_AT_ONCE = 16

    def __init__(self) -> None:
        self.loss: Tensor | int = 0  # float64
        self.clipped: Tensor | int = 0
        self.nonfinite: Tensor | int = 0
        self.examples: Tensor | int = 0
        self._rows: list[tuple[Tensor, Tensor, Tensor, Tensor | None]] = []  # (valid, losses, sq_norms, dropped)
        self._clip_squared: Tensor | None = None  # [K, 1], a round's C² (one per client); None: not private

    def add(self, report: StepReport) -> None:
        sums = report.sums
        self._rows.append((report.valid, sums.losses, sums.sq_norms, None if sums.all_finite else sums.dropped))
        if report.private and self._clip_squared is None:
            self._clip_squared = report.clip.square().unsqueeze(1)
        if len(self._rows) >= self.STEPS_AT_ONCE:
            self._reduce()

    def _reduce(self) -> None:
        """The kept steps' sums, as `StepReport`'s properties define them, added to the totals."""
        if not self._rows:
            return
        valid, losses, sq_norms, dropped = zip(*self._rows, strict=True)
        self._rows = []
        valid_rows = torch.cat(valid, 1)
        counted = valid_rows
        if any(d is not None for d in dropped):
            marks = [torch.zeros_like(v) if d is None else d for v, d in zip(valid, dropped, strict=True)]
            dropped_rows = torch.cat(marks, 1)
            self.nonfinite = self.nonfinite + (valid_rows & dropped_rows).sum(1)
            counted = valid_rows & ~dropped_rows
        # padding rows' losses are 0; a dropped example's may be non-finite
        loss_rows = torch.cat(losses, 1)
        kept = loss_rows if counted is valid_rows else torch.where(counted, loss_rows, 0.0)
        self.loss = self.loss + kept.sum(1, dtype=torch.float64)
        if self._clip_squared is not None:
            self.clipped = self.clipped + (counted & (torch.cat(sq_norms, 1) > self._clip_squared)).sum(1)
        self.examples = self.examples + valid_rows.sum(1)

    def per_client(self) -> list[tuple[float, float, int]]:
        """(mean loss, clip fraction, examples dropped as non-finite) per client; NaN means for a
        client that sampled no example."""
        self._reduce()
        examples = torch.as_tensor(self.examples).tolist()
        nonfinite = torch.as_tensor(self.nonfinite).expand(len(examples)).tolist()
        clipped = torch.as_tensor(self.clipped).expand(len(examples)).tolist()
        return [
            (loss / n if n else math.nan, clipped / n if n else math.nan, int(bad))
            for loss, clipped, bad, n in zip(
                torch.as_tensor(self.loss).tolist(),
                clipped,
                nonfinite,
                examples,
                strict=True,
            )
        ]


def release(sums: list[Tensor], step: StepInputs, add_noise: bool = True) -> Tensor:
    """γ·⌊(Σ clipped)/γ + (σC/γ)·Z⌉ / (qN) per client (`noise.rounded_gaussian`), as one [K, P]
    tensor in the trained parameters' order (the noise words' order), σC the step's `noise_std`
    (`noise_scale`: never below the certified σC). `parts` cuts it per parameter."""
    flat = torch.cat([s.reshape(s.shape[0], -1) for s in sums], dim=1) if len(sums) > 1 else sums[0].flatten(1)
    if add_noise:
        flat = rounded_gaussian(flat, step.noise_words, step.noise_std, step.refiners, step.noise_ahead)
    return flat / step.expected_batch.unsqueeze(1)


def parts(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    """A [K, P] tensor cut into one [K, *shape] per parameter of `like` ([K, *shape] each)."""
    pieces = flat.split([t[0].numel() for t in like], dim=1)
    return [piece.reshape(t.shape) for piece, t in zip(pieces, like, strict=True)]


class ClientStack:
    """The DP step for a stack of clients of one model (`template`), whose state is held as one
    [K, *shape] tensor per entry of `template.state_dict()` (in that order, `keys`).

    The trained parameters, the order of their noise and of their sums are
    `capture.trained_names`; a model `clipping.check_supported` refuses is refused when the stack is
    made. `stacked=False` is the trainer's stack of one client on its own model: one plain
    forward, no layout change. Stacked, on a GPU the convolutions run as batched products
    (`capture.convolution_as_product`: one kernel where cuDNN ran one per client and group); on
    a CPU as grouped convolutions, which measured faster there.

    A step computes each client at a batch width its own batch sets: a product's rounding depends
    on its shapes, so a width another client's batch set would make a client's release depend,
    below float32's resolution, on that client's data. How far a client's sampled rows are padded
    weighs the arithmetic of padding rows against the calls of more stacks, by what a row costs
    (`BatchedCapture.example_products`, multiply-adds): from `SPLIT_PRODUCTS` on, to the next
    multiple of `ROW_BLOCK` (the digits CNNs' 1,000-client rounds, batches of about 20 rows:
    multiples of 4 computed 8% more rows than sampled, of 8 17%, and took 5-10% less time); from
    `PAD_PRODUCTS` on, to the next multiple of `FEWEST_ROWS` (the MLP's DP round 2-9% faster than
    with powers of two, its 1,000-client run 1-2%); below, where a step costs in calls, not
    arithmetic, to the next power of two of at least `FEWEST_ROWS`, which makes the fewest stacks
    (logreg's round 4% faster than with multiples of 8). Clients of one width run as one stack; a
    width held by one client runs as a stack of two copies of it, since a stack of one takes other
    kernels, while among two or more a client's bits depend neither on how many share its stack nor
    on what they hold (measured on the CPU kernels; tests/test_fast_engine.py checks the whole
    step). On a CPU, a costly model has each width's clients cut into stacks of about
    `STACK_CLIENTS`, which keep each step's tensors in the cache and the allocator's reuse.
    """

    ROW_BLOCK = 4
    FEWEST_ROWS = 8
    STACK_CLIENTS = 64
    SPLIT_PRODUCTS = 10_000
    PAD_PRODUCTS = 1_000

    def __init__(self, template: nn.Module, stacked: bool = True) -> None:
        check_supported(template)
        state = template.state_dict()
        self.keys = list(state)
        self.stacked = stacked
        on_gpu = next(template.parameters()).device.type == "cuda"
        self.split = not on_gpu  # cut a width's clients into stacks of about STACK_CLIENTS (see above)
        self.capture = BatchedCapture(
            template, self.keys, conv_as_matmul=stacked and on_gpu, channels_last=stacked and not on_gpu
        )
        names = self.capture.trained_names
        self.trained = [self.keys.index(name) for name in names]  # positions in the state, trained order
        self.noise_count = sum(state[name].numel() for name in names)
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
        sums = self.clipped(state, step.features, step.labels, step.valid, step.clip, private)
        flat = release(sums.grad_sums, step, add_noise=private)
        released = parts(flat, sums.grad_sums)
        rate = learning_rate(released) * step.active
        trained = [state[position] for position in self.trained]
        torch._foreach_sub_(trained, parts(rate.unsqueeze(1) * flat, trained))  # one call for every parameter
        return StepReport(released, sums, step.valid, step.clip, private)

    def clipped(
        self, state: list[Tensor], features: Tensor, labels: Tensor, valid: Tensor, clip: Tensor, private: bool = True
    ) -> Clipped:
        """The clients' clipped sums (`clipped_sums`) and per-example losses for sampled rows
        `features` [K, B, ...] (padding where `valid` is False), clipped at each client's C (`clip`,
        [K] float64): formed stack by stack, each client at its own width (`_stacks`), then, for a
        client whose sums overflowed although its norms are finite, one example at a time."""
        if self.stacked:
            sums = self._sums_by_width(state, features, labels, valid, clip, private)
        else:
            sums = self._stack_sums(state, features, labels, valid, clip, private)
        if not sums.all_finite and bool(sums.broken.any()):
            self._one_example_at_a_time(state, features, labels, valid, clip, sums, private)
        return sums

    def _sums_by_width(
        self, state: list[Tensor], features: Tensor, labels: Tensor, valid: Tensor, clip: Tensor, private: bool
    ) -> Clipped:
        """`_stack_sums` stack by stack (`_stacks`), put back in client order. Only a stack wider
        than the step's largest batch gets zero rows added (never a record); its results for those
        rows, padding, are left out."""
        shape = valid.shape
        sq_norms = torch.zeros(shape, dtype=NORM_DTYPE, device=valid.device)
        dropped = torch.zeros_like(valid)
        losses = torch.zeros(shape, dtype=features.dtype, device=valid.device)
        broken = torch.zeros_like(valid[:, 0])
        grad_sums: list[Tensor] = []
        all_finite = True
        for clients, width in self._stacks(features, valid):
            x, y, v = features[clients, :width], labels[clients, :width], valid[clients, :width]
            if width > shape[1]:
                x, y, v = (_widened(t, width) for t in (x, y, v))
            part = self._stack_sums([s[clients] for s in state], x, y, v, clip[clients], private)
            if not grad_sums:
                grad_sums = [g.new_zeros(shape[0], *g.shape[1:]) for g in part.grad_sums]
            for whole, g in zip(grad_sums, part.grad_sums, strict=True):
                whole[clients] = g
            kept = min(width, shape[1])
            sq_norms[clients, :kept], dropped[clients, :kept] = part.sq_norms[:, :kept], part.dropped[:, :kept]
            losses[clients, :kept], broken[clients] = part.losses[:, :kept], part.broken
            all_finite = all_finite and part.all_finite
        return Clipped(grad_sums, sq_norms, dropped, broken, losses, all_finite)

    def _stack_sums(
        self, state: list[Tensor], features: Tensor, labels: Tensor, valid: Tensor, clip: Tensor, private: bool
    ) -> Clipped:
        """One stack's sums: the shared clipping on the batched capture; without the mechanism the
        plain gradient sums (`BatchedCapture.gradient_sums`, no norms), unless one is not finite."""
        clients, batch = labels.shape
        if not private:
            plain = self.capture.gradient_sums(state, features, labels, valid)
            if plain is not None:
                sums, losses = plain
                none = torch.zeros_like(valid)
                norms = torch.zeros(valid.shape, dtype=NORM_DTYPE, device=valid.device)  # not computed
                return Clipped(sums, norms, none, none[:, 0], losses, all_finite=True)
        if self.stacked:
            captured = self.capture(state, features, labels, valid)
        else:  # the trainer's one client, on the template's own weights (the state holds views of them)
            captured = self.capture.single(None, features[0], labels[0], valid[0])
        sums = clipped_sums(captured.records, clip, clients, self._float64, clip=private, batch=batch)
        return sums._replace(losses=captured.losses)

    def _one_example_at_a_time(
        self,
        state: list[Tensor],
        features: Tensor,
        labels: Tensor,
        valid: Tensor,
        clip: Tensor,
        clipped: Clipped,
        private: bool,
    ) -> None:
        """The rare client whose sums overflowed although every norm was finite: its sums are formed
        again one example at a time, so that only the examples whose own sums overflow are dropped
        (in place on `clipped`'s sums and dropped rows)."""
        for k in torch.nonzero(clipped.broken).flatten().tolist():
            weights = dict(zip(self.keys, (s[k] for s in state))) if self.stacked else None
            bound = clip[k] if private else torch.tensor(UNCLIPPED, dtype=NORM_DTYPE, device=clip.device)
            total = [torch.zeros_like(s[k]) for s in clipped.grad_sums]
            for row in torch.nonzero(valid[k]).flatten().tolist():
                x, y = features[k, row : row + 1], labels[k, row : row + 1]
                captured = self.capture.single(weights, x, y)
                alone = clipped_sums(captured.records, bound.view(1), 1, self._float64, batch=1)
                if not alone.all_finite and bool(alone.broken[0] or alone.dropped[0, 0]):
                    clipped.dropped[k, row] = True
                    continue
                total = [t + g[0] for t, g in zip(total, alone.grad_sums, strict=True)]
            for s, t in zip(clipped.grad_sums, total, strict=True):
                s[k] = t

    def _stacks(self, features: Tensor, valid: Tensor) -> list[tuple[Tensor, int]]:
        """(clients, width) per stack: each client at its own batch rounded up as the class
        docstring says (sampled rows are packed at the front of each row), a width of one client
        given as two copies of it, a width's clients cut into stacks of about `STACK_CLIENTS` where
        `split` is on and the model's rows cost at least `SPLIT_PRODUCTS`."""
        sizes = valid.sum(1)
        products = self.capture.example_products(features[0, 0])
        costly = products >= self.SPLIT_PRODUCTS
        if costly or products >= self.PAD_PRODUCTS:  # the arithmetic counts: pad little
            block = self.ROW_BLOCK if costly else self.FEWEST_ROWS
            widths = (sizes + block - 1).div(block, rounding_mode="floor").clamp(min=1) * block
        else:  # each stack's calls are the cost: few widths
            widths = torch.exp2(torch.log2(sizes.clamp(min=self.FEWEST_ROWS).double()).ceil()).long()
        split = self.split and costly
        stacks = []
        for width in torch.unique(widths).tolist():
            clients = torch.nonzero(widths == width).flatten()
            if len(clients) == 1:
                clients = clients.repeat(2)
            count = max(1, min(len(clients) // self.STACK_CLIENTS, len(clients) // 2)) if split else 1
            pieces = clients.tensor_split(count)  # two clients or more each
            stacks.extend((piece, width) for piece in pieces)
        return stacks


def _widened(rows: Tensor, width: int) -> Tensor:
    """`rows` [K, B, ...] with zero rows appended up to `width` along its second dimension."""
    extra = rows.new_zeros(rows.shape[0], width - rows.shape[1], *rows.shape[2:])
    return torch.cat([rows, extra], dim=1)


class PerExampleClipper:
    """Clipped sums of one client's batches on its own model, without noise or a step: the stack's
    clipping with K = 1, for what measures clipping alone (tests, benchmarks)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stack = ClientStack(model, stacked=False)
        self.state = [t.unsqueeze(0) for t in model.state_dict().values()]  # views of the model's own tensors
        named = dict(model.named_parameters())
        self.parameters: list[nn.Parameter] = [named[name] for name in self.stack.capture.trained_names]

    def clipped_sum(self, inputs: Tensor, targets: Tensor, clip_norm: float) -> ClippedBatch:
        """Σᵢ clip_C(∇loss_i) over the batch, each example's gradient clipped over all trained
        parameters together (cross-entropy on the model's logits); examples whose gradient is not
        finite contribute zero."""
        valid = torch.ones((1, inputs.shape[0]), dtype=torch.bool, device=inputs.device)
        clip = torch.tensor([clip_norm], dtype=NORM_DTYPE, device=inputs.device)
        sums = self.stack.clipped(self.state, inputs.unsqueeze(0), targets.unsqueeze(0), valid, clip)
        kept = ~sums.dropped[0]
        return ClippedBatch(
            [g[0] for g in sums.grad_sums],
            torch.where(kept, sums.sq_norms[0], 0.0),
            torch.where(kept, sums.losses[0], 0.0).sum(),
            clip_norm,
            int(sums.dropped[0].sum()),
        )
