"""K clients' consecutive DP-SGD steps on one `ClientStack`: the one loop of the mechanism.

The trainer (`fedprivacy.training.trainer`) runs it for its one client on the client's own model
(K = 1), the fast engine's worker for a round's clients (K = n). Steps are taken in passes: each
pass draws every client's Poisson samples and noise words from the client's own stream at once
(`rng.draw_batch`), makes the Box–Muller of small steps ahead (`noise.noise_ahead`) and finds the
sampled rows of all its steps; then each step gathers its batches (padded with zero rows to the
step's largest batch), takes the stack's step and sets each client's learning rate (its plan's
schedule, or AdaGrad-norm on the released gradients). A client whose slice is shorter sits out
the steps it does not take.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedprivacy.privacy.plan import Plan
from fedprivacy.training.noise import Refiner, noise_ahead
from fedprivacy.training.rng import DrawRequest, StepRandomness, draw_batch, keystream_device
from fedprivacy.training.schedule import StepSizes
from fedprivacy.training.stack import ClientStack, RoundTotals, StepInputs, noise_scale

# Steps of at most this many noise coordinates (clients × trained parameters) have their Box–Muller
# made ahead, a pass at a time, and each step only rounds: the cost of small steps is their calls,
# not their arithmetic. Passes then hold at most AHEAD_PASS_COORDINATES, so their float64 rows stay
# within tens of MiB. Larger steps compute it block by block inside the step, their temporaries in cache.
AHEAD_STEP_COORDINATES = 1 << 17
AHEAD_PASS_COORDINATES = 1 << 21

# Steps of fewer expected multiply-adds than this (the clients' expected rows × the model's
# products per example) run on one CPU thread: their tensors are too small for intra-op threads
# to help, and some small operations (nll_loss, log_softmax, exp, log) still open a parallel
# region, which pays for waking PyTorch's idle OpenMP threads each time (benchmarks/step_overhead.py
# and docs/benchmarks.md: the trainer's round of logreg and the MLP). The CNN's one client and
# the fast engine's rounds of many clients stay above it.
SERIAL_STEP_PRODUCTS = 1 << 18


@dataclass(frozen=True)
class ClientSteps:
    """One client's share of a run of steps: `steps` steps of its plan from `first_step`, drawn
    from its own stream, on the rows at `position` of the stack's data."""

    plan: Plan
    first_step: int
    steps: int
    randomness: StepRandomness
    position: int = 0


@dataclass(frozen=True)
class StackRows:
    """Every client's rows in one table: client c's records are rows c·`width` onwards (`rows[c]`
    of them, then padding that is never sampled), and the last row is zeros with label 0, which
    every padding slot of a batch reads (`of` makes it)."""

    features: Tensor  # [C·width + 1, ...]
    labels: Tensor  # [C·width + 1]
    width: int
    rows: Sequence[int]

    @classmethod
    def of(cls, features: Tensor, labels: Tensor, rows: Sequence[int]) -> StackRows:
        """The table of `features` [C, R, ...] and `labels` [C, R] (each client's records first)."""
        zeros = features.new_zeros(1, *features.shape[2:])
        table = torch.cat([features.flatten(0, 1), zeros])
        return cls(table, torch.cat([labels.flatten(), labels.new_zeros(1)]), features.shape[1], list(rows))

    def client(self, position: int) -> tuple[Tensor, Tensor]:
        """The records of the client at `position`: (features, labels), views of the table."""
        first = position * self.width
        end = first + self.rows[position]
        return self.features[first:end], self.labels[first:end]


@dataclass(frozen=True)
class TrainReport:
    """What one client's steps did: data seen, clipping and the noise they added."""

    first_step: int
    steps: int
    examples: int
    empty_steps: int
    mean_loss: float  # mean cross-entropy of sampled examples, before each step's update; nan if none
    clip_fraction: float  # sampled examples whose gradient norm exceeded C; nan if none
    nonfinite_examples: int  # sampled examples dropped for a non-finite gradient (contributed zero)
    sigma_mean: float  # mean noise multiplier σ_t over the steps
    noise_std_on_mean: float  # mean σ_t·C/(qN): noise std per coordinate of the averaged gradient
    last_learning_rate: float
    seeded: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StepsReport:
    """What K clients' steps did, one entry per client in `clients`' order; `client(k)` is client
    k's `TrainReport`. `diagnostics` (mean loss, clip fraction, non-finite examples) per client,
    when they were formed."""

    clients: Sequence[ClientSteps]
    examples: np.ndarray
    empty_steps: np.ndarray
    sigma_mean: np.ndarray
    last_learning_rate: list[float]  # each client's η at its last step
    diagnostics: list[tuple[float, float, int]] | None

    def client(self, k: int) -> TrainReport:
        steps = self.clients[k]
        plan, nan = steps.plan, float("nan")
        mean_loss, clip_fraction, nonfinite = self.diagnostics[k] if self.diagnostics is not None else (nan, nan, 0)
        sigma_mean = float(self.sigma_mean[k]) if steps.steps else nan
        return TrainReport(
            first_step=steps.first_step,
            steps=steps.steps,
            examples=int(self.examples[k]),
            empty_steps=int(self.empty_steps[k]),
            mean_loss=mean_loss,
            clip_fraction=clip_fraction,
            nonfinite_examples=nonfinite,
            sigma_mean=sigma_mean,
            noise_std_on_mean=sigma_mean * plan.clip_norm / plan.expected_batch_size,
            last_learning_rate=self.last_learning_rate[k] if steps.steps else nan,
            seeded=steps.randomness.seeded,
        )


_SCHEDULES: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] = {}
KEPT_SCHEDULES = 256
# Each plan object's schedule, by id, with a weak reference that tells a reused id from its plan:
# a client keeps its plan across rounds, and forming the shared key costs 2-3 µs a client-round.
_BY_PLAN: dict[int, tuple[weakref.ref[Plan], tuple[np.ndarray, np.ndarray]]] = {}
KEPT_PLANS = 1 << 16


def schedule(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """(σ_t, η_t) of every step of `plan` (`Plan.noise_multipliers`, `Plan.learning_rates`), made
    once per distinct schedule: the clients of a run mostly share a few."""
    known = _BY_PLAN.get(id(plan))
    if known is not None and known[0]() is plan:
        return known[1]
    found = _shared_schedule(plan)
    if len(_BY_PLAN) >= KEPT_PLANS:
        _BY_PLAN.clear()
    _BY_PLAN[id(plan)] = (weakref.ref(plan), found)
    return found


def _shared_schedule(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """`schedule` by the schedule's content, shared by the plans that have it."""
    key = (
        plan.steps,
        tuple(tuple(segment) for segment in plan.noise_segments),
        plan.learning_rate,
        plan.lr_schedule,
        tuple(sorted(plan.lr_params.items())),
    )
    found = _SCHEDULES.get(key)
    if found is None:
        if len(_SCHEDULES) >= KEPT_SCHEDULES:
            _SCHEDULES.clear()
        found = _SCHEDULES[key] = (plan.noise_multipliers(), plan.learning_rates(np.arange(plan.steps)))
    return found


class _Refiners(Sequence[Refiner]):
    """Each client's refinement words for one step, made only for the rare client that asks."""

    def __init__(self, streams: Sequence[StepRandomness], steps: Sequence[int]) -> None:
        self.streams, self.steps = streams, steps

    def __len__(self) -> int:
        return len(self.streams)

    def __getitem__(self, k: int) -> Refiner:  # type: ignore[override]
        return self.streams[k].refiner(self.steps[k])


def take_steps(
    stack: ClientStack,
    state: list[Tensor],
    data: StackRows,
    clients: Sequence[ClientSteps],
    step_sizes: StepSizes,
    *,
    private: bool = True,
    diagnostics: bool = True,
) -> StepsReport:
    """Every client's steps, in place on `state` (the stack's [K, ...] tensors, one row per
    client in `clients`' order); `step_sizes` holds their AdaGrad-norm state and is updated.
    `private=False` takes the same steps with the mechanism off (σ = 0, nothing clipped).
    Without `diagnostics` the loss, clip fraction and non-finite count are not formed. Small steps
    run on one CPU thread (`SERIAL_STEP_PRODUCTS`)."""
    with _one_thread_if(_small_steps(stack, data, clients)):
        return _take_steps(stack, state, data, clients, step_sizes, private, diagnostics)


def _small_steps(stack: ClientStack, data: StackRows, clients: Sequence[ClientSteps]) -> bool:
    """Whether a step's expected multiply-adds (the clients' expected rows × the model's Linear and
    convolution products per example) stay below `SERIAL_STEP_PRODUCTS`, on a CPU."""
    if data.features.device.type != "cpu" or not clients:
        return False
    rows = sum(c.plan.expected_batch_size for c in clients)
    return rows * stack.capture.example_products(data.features[0]) < SERIAL_STEP_PRODUCTS


@contextmanager
def _one_thread_if(serial: bool) -> Iterator[None]:
    """PyTorch's intra-op threads set to one inside, when `serial` (process-wide: restored after)."""
    threads = torch.get_num_threads()
    if not serial or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _take_steps(
    stack: ClientStack,
    state: list[Tensor],
    data: StackRows,
    clients: Sequence[ClientSteps],
    step_sizes: StepSizes,
    private: bool,
    diagnostics: bool,
) -> StepsReport:
    """`take_steps`' work."""
    device = data.features.device
    one = {"device": device}
    counts = [c.steps for c in clients]
    most = max(counts, default=0)
    plans = [c.plan for c in clients]
    sigma, rate = np.zeros((len(clients), most)), np.zeros((len(clients), most))
    # clients mostly share a few schedules and the same slice of them: filled a group at a time
    alike: dict[tuple[int, int, int], tuple[tuple[np.ndarray, np.ndarray], list[int]]] = {}
    for k, client in enumerate(clients):
        arrays = schedule(client.plan)
        alike.setdefault((id(arrays), client.first_step, client.steps), (arrays, []))[1].append(k)
    for (_, first, steps), ((sigmas, rates), rows) in alike.items():
        sigma[rows, :steps], rate[rows, :steps] = sigmas[first : first + steps], rates[first : first + steps]
    if not private:
        sigma[:] = 0.0
    clip = torch.tensor([p.clip_norm for p in plans], dtype=torch.float64, **one)
    # σ_t stays float64, as the plan has it, until its σ_t·C is rounded once (`stack.noise_scale`)
    noise_std = noise_scale(torch.from_numpy(sigma).to(device), clip.unsqueeze(1))  # [K, steps]
    scheduled = torch.from_numpy(rate).to(device, data.features.dtype)
    expected = torch.tensor([p.expected_batch_size for p in plans], dtype=data.features.dtype, **one)
    taking = torch.tensor(counts, **one)
    positions = torch.tensor([c.position for c in clients], **one)
    streams = [c.randomness for c in clients]
    totals = RoundTotals()
    examples, empty = np.zeros(len(clients), dtype=np.int64), np.zeros(len(clients), dtype=np.int64)
    made_ahead = private and len(clients) * stack.noise_count <= AHEAD_STEP_COORDINATES
    rows = max((data.rows[c.position] for c in clients), default=0)
    for start, stop in _passes(counts, rows, stack.noise_count, made_ahead):
        keep, noise = _draws(clients, start, stop, data, stack.noise_count, device)
        batches = _Batches(keep, positions, data)
        examples += batches.sizes.sum(1)
        empty += ((batches.sizes == 0) & (np.arange(start, stop) < np.array(counts)[:, None])).sum(1)
        ahead = noise_ahead(noise.flatten(0, 1), noise_std[:, start:stop].flatten()) if made_ahead else None
        for s in range(start, stop):
            features, labels, valid = batches.gather(data, s - start)
            inputs = StepInputs(
                features,
                labels,
                valid,
                noise[:, s - start],
                noise_std[:, s],
                clip,
                expected,
                taking > s,
                _Refiners(streams, [c.first_step + s for c in clients]),
                None if ahead is None else ahead.rows(slice(s - start, None, stop - start)),  # rows k·steps + s
            )
            report = stack.step(
                state,
                inputs,
                lambda released, s=s, active=inputs.active: step_sizes.rate(released, active, scheduled[:, s]),
                private=private,
            )
            if diagnostics:
                totals.add(report)
    last = step_sizes.current(scheduled[torch.arange(len(clients), **one), (taking - 1).clamp(min=0)])
    with np.errstate(invalid="ignore", divide="ignore"):  # a client of no steps has no mean σ
        sigma_mean = sigma.sum(1) / np.array(counts)
    formed = totals.per_client() if diagnostics and most else None
    return StepsReport(clients, examples, empty, sigma_mean, last.tolist(), formed)


def _passes(counts: Sequence[int], rows: int, noise_count: int, made_ahead: bool) -> list[tuple[int, int]]:
    """The steps drawn together, as [start, stop) ranges of the slices' step indices: at most
    `StepRandomness.chunk_steps` words per client and, where the Box–Muller is made ahead, at most
    AHEAD_PASS_COORDINATES noise coordinates."""
    most = max(counts, default=0)
    per_pass = StepRandomness.chunk_steps(rows, noise_count)
    if made_ahead:
        per_pass = min(per_pass, max(1, AHEAD_PASS_COORDINATES // max(len(counts) * noise_count, 1)))
    return [(start, min(most, start + per_pass)) for start in range(0, most, per_pass)]


def _draws(
    clients: Sequence[ClientSteps], start: int, stop: int, data: StackRows, noise_count: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Every client's Poisson masks [K, stop − start, R] and noise words [K, stop − start, 2m] for
    steps start..stop of their slices (`rng.draw_batch`; a client whose slice ends earlier has
    zeros there, never read)."""
    takes = [max(0, min(c.steps, stop) - start) for c in clients]
    batch = [
        DrawRequest(c.randomness, c.first_step + start, take, int(data.rows[c.position]), c.plan.sampling_rate)
        for c, take in zip(clients, takes, strict=True)
        if take
    ]
    keep_rows, noise_rows = draw_batch(batch, noise_count, keystream_device(device))
    rows, width, steps = data.width, noise_rows.shape[1], stop - start
    if min(takes) == steps and keep_rows.shape[1] == rows:  # rows already in [client, step] order
        return keep_rows.reshape(len(clients), steps, rows).to(device), noise_rows.reshape(
            len(clients), steps, width
        ).to(device)
    made = keep_rows.device  # the CPU, or the device that made the keystream
    owner = torch.from_numpy(np.repeat(np.arange(len(takes)), takes)).to(made)
    step = torch.from_numpy(np.concatenate([np.arange(t) for t in takes])).to(made)
    keep = torch.zeros(len(clients), steps, rows, dtype=torch.bool, device=made)
    noise = torch.zeros(len(clients), steps, width, dtype=torch.int64, device=made)
    keep[owner, step, : keep_rows.shape[1]] = keep_rows
    noise[owner, step] = noise_rows
    return keep.to(device), noise.to(device)


class _Batches:
    """The sampled rows of a pass's steps, found at once: for step s, client k's batch is its
    records in row order, padded to the step's largest batch (at least one row) with the table's
    zero row. Padding holds zeros, never a record: no record that was not sampled enters a step,
    even through a model that (wrongly) mixes its batch."""

    def __init__(self, keep: Tensor, positions: Tensor, data: StackRows) -> None:
        clients, steps, rows = keep.shape
        sizes = keep.view(torch.uint8).sum(2)  # [K, steps] (a byte sum: several times faster than a bool one)
        self.sizes = sizes.cpu().numpy()
        self.widths = np.maximum(self.sizes.max(0, initial=0), 1).tolist()
        width = max(self.widths, default=1)
        step, k, row = keep.transpose(0, 1).nonzero(as_tuple=True)  # ordered by step, client, row
        line = step * clients + k
        counts = sizes.t().reshape(-1)
        slot = torch.arange(len(line), device=keep.device) - (counts.cumsum(0) - counts)[line]
        source = torch.full((steps * clients * width,), len(data.labels) - 1, dtype=torch.long, device=keep.device)
        source[line * width + slot] = positions[k] * data.width + row
        self.source = source.view(steps, clients, width)
        self.valid = torch.arange(width, device=keep.device) < sizes.t().unsqueeze(2)  # [steps, K, width]

    def gather(self, data: StackRows, s: int) -> tuple[Tensor, Tensor, Tensor]:
        """Step s's (features [K, B, ...], labels [K, B], valid [K, B]), read from the table."""
        width = self.widths[s]
        clients = self.source.shape[1]
        source = self.source[s, :, :width].reshape(-1)
        features = data.features.index_select(0, source).view(clients, width, *data.features.shape[1:])
        labels = data.labels.index_select(0, source).view(clients, width)
        return features, labels, self.valid[s, :, :width].contiguous()  # a view's strides slowed the CNN's steps
