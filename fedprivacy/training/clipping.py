"""Clipped sums of per-example gradients in one backward pass ("book-keeping", Bu et al.).

For every layer with trainable parameters, one forward pass that stores its input A and one
backward pass that returns D, the gradient of the summed loss with respect to its output (autograd
never forms the parameter gradients), are all its rule needs (`fedprivacy.training.layers`): the
per-example squared norms (float64 upper bounds on what is summed, `fedprivacy.training.norms`) and
the clipped sums Σᵢ wᵢ·gᵢ, wᵢ = C / max(‖gᵢ‖, C), each example's gradient clipped over all trained
parameters together. `clipped_sums` is that shared mechanism for K clients at once (rows
client-major), on the capture's A and D (`fedprivacy.training.capture`, every example computed
alone); the stack (`fedprivacy.training.stack`) calls it for the trainer's one client and the fast
engine's K. Refused by name: a trained layer without a rule, BatchNorm, tied weights, a trained
parameter its layer's rule does not clip, a layer that sees other than one row per example.

An example whose gradient norm is not finite (an overflow, a NaN: a diverging run, or a model
crafted so that one record overflows) contributes exactly zero, and its rows are zeroed before the
sums are formed, since 0·inf would otherwise turn the whole clipped sum into NaN. Each example's
contribution is then still a function of that example alone with norm ≤ C, which is all the
accountant assumes. How many were dropped is counted for the client's own diagnostics only. A
gradient that is finite but beyond float32's squared range (a feature of 3e38) is clipped like any
other (tests/test_norm_underflow.py checks each contribution ≤ C·(1 + 10⁻⁵) against per-example
gradients from torch.func, their norms taken in float64).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from fedprivacy.training.capture import LayerRecord
from fedprivacy.training.layers import LayerRule, LayerTerms, registered_layers, rule_for, trainable
from fedprivacy.training.layers.linear import linear_norms
from fedprivacy.training.norms import (
    NORM_DTYPE,
    SUPPORTED_DTYPE,
    Float64Scratch,
    Slack,
    ToFloat64,
    UnsupportedLayerError,
    _fresh_float64,
    clip_weights,
)

__all__ = [
    "NORM_DTYPE",
    "SUPPORTED_DTYPE",
    "Clipped",
    "ClippedBatch",
    "Float64Scratch",
    "LayerRecord",
    "Slack",
    "ToFloat64",
    "UnsupportedLayerError",
    "check_supported",
    "clip_weights",
    "clipped_sums",
    "linear_norms",
]


class Clipped(NamedTuple):
    """K clients' clipped sums of their batches of B examples (on device): the one clipping
    result, K-indexed (the trainer's K is 1). `losses` are the capture's per-example losses, which
    the stack adds (None from `clipped_sums` alone)."""

    grad_sums: list[Tensor]  # [K, *p.shape] per trained parameter, in record order, each module's own order
    sq_norms: Tensor  # [K, B] float64 bounds, 0 where dropped
    dropped: Tensor  # [K, B] bool: non-finite norm, contributed zero
    broken: Tensor  # [K] bool: sums still not finite although every kept norm is finite (redo one by one)
    losses: Tensor | None = None  # [K, B] per-example losses (0 on padding rows)
    all_finite: bool = False  # the one host check found every norm and sum finite: nothing dropped, nothing broken


@dataclass
class ClippedBatch:
    """What one batch gives the DP step: clipped gradient sums and statistics (on device)."""

    grad_sums: list[Tensor]  # Σᵢ clip(gᵢ), in the trained parameters' order (capture.trained_names)
    sq_norms: Tensor  # per-example squared norms before clipping (float64 upper bounds), shape (B,); 0 where dropped
    loss_sum: Tensor  # Σᵢ loss_i over the examples kept (scalar)
    clip_norm: float
    nonfinite: int = 0  # examples dropped because their gradient norm was not finite

    @property
    def clipped(self) -> Tensor:
        """Number of examples whose gradient norm exceeded C (scalar tensor)."""
        return (self.sq_norms > self.clip_norm**2).sum()


def _no_rule(module: nn.Module) -> LayerRule:
    """A record of a layer that check_supported would have refused."""
    raise UnsupportedLayerError(f"{type(module).__name__} has no per-example clipping rule (check_supported)")


def clipped_sums(
    records: Sequence[LayerRecord],
    clip_norm: float | Tensor,
    clients: int,
    to64: ToFloat64 = _fresh_float64,
    clip: bool = True,
    *,
    batch: int,
) -> Clipped:
    """Σ_b clip_C(g_{k,b}) per client k, each example clipped over all the records' parameters together.

    `batch` is the number of examples per client the records were captured from: every record must
    have exactly `clients`·`batch` rows, one per example, so that a model which folds the batch into
    fewer rows (and would have a whole batch clipped as one example) is refused.

    `clip_norm` is one C or a [K] tensor of each client's C. `clip=False` sums the raw gradients (the
    non-private baseline, or measuring what clipping costs); examples whose norm is not finite are
    dropped either way. The common case costs one host synchronisation (are the norms' total and the
    sums finite?); otherwise the rows of the examples with a non-finite norm are zeroed by each rule's
    `without` and the sums formed again, and clients whose sums still overflow are reported `broken`.
    """
    result = _clipped_rows(records, clip_norm, clients, to64, clip, clients * batch)
    sq_norms = result.sq_norms.view(clients, -1)
    if result.broken is None:
        none = torch.zeros(sq_norms.shape, dtype=torch.bool, device=sq_norms.device)
        return Clipped(result.grad_sums, sq_norms, none, none[:, 0], all_finite=True)
    assert result.dropped is not None
    return Clipped(result.grad_sums, sq_norms, result.dropped.view(clients, -1), result.broken)


class _Rows(NamedTuple):
    """`clipped_sums` before its per-client view; None for `dropped` and `broken` means none at all
    (known from the one host check, with no tensor to make: the trainer's step reads no more)."""

    grad_sums: list[Tensor]
    sq_norms: Tensor  # [R]
    dropped: Tensor | None  # [R]
    broken: Tensor | None  # [K]


def _clipped_rows(
    records: Sequence[LayerRecord],
    clip_norm: float | Tensor,
    clients: int,
    to64: ToFloat64,
    clip: bool,
    rows: int,
) -> _Rows:
    """The mechanism behind `clipped_sums` (the trainer's clipper calls it directly, K = 1); `rows`
    is the number of examples captured, K·B: every record must have one row per example."""
    if not records:
        raise UnsupportedLayerError("no trained layers: nothing to clip")
    if clients < 1 or rows % clients:
        raise ValueError(f"clients={clients}: the records' {rows} rows must split into that many equal batches")
    for record in records:
        if len(record.a) != rows or len(record.d) != rows:
            raise UnsupportedLayerError(
                f"layer {type(record.module).__name__} sees {record.a.shape[0]} rows where the batch has {rows} "
                "examples: a model that reshapes or mixes the batch dimension cannot be clipped per example"
            )
    rules = [rule_for(record.module) or _no_rule(record.module) for record in records]
    terms = [rule.terms(record.module, record.a, record.d, to64) for rule, record in zip(rules, records, strict=True)]
    # Squared bounds of the layers' parts add; their absolute errors add by the triangle inequality.
    sq_norms, slack = terms[0].sq_norms, terms[0].slack
    for part in terms[1:]:
        sq_norms, slack = sq_norms + part.sq_norms, slack.plus(part.slack)
    dtype = records[0].d.dtype
    if isinstance(clip_norm, Tensor) and clients > 1:  # each client's C on each of its rows (one: broadcast)
        clip_norm = clip_norm.to(NORM_DTYPE).repeat_interleave(rows // clients)

    def weighted(terms: list[LayerTerms], sq_norms: Tensor, slack: Slack) -> list[Tensor]:
        if clip:
            weights = clip_weights(sq_norms, slack, clip_norm, dtype).view(clients, -1)
        else:
            weights = torch.ones((clients, rows // clients), dtype=dtype, device=sq_norms.device)
        return [
            s
            for rule, record, part in zip(rules, records, terms, strict=True)
            for s in rule.weighted_sums(record.module, part, weights)
        ]

    sums = weighted(terms, sq_norms, slack)
    # NaN and ±inf reach the total (so does one past float32's range: the exact, slower, path then).
    if math.isfinite(float(torch.stack(torch._foreach_norm([sq_norms.sum().float(), *sums])).sum())):
        return _Rows(sums, sq_norms, None, None)
    finite = torch.isfinite(sq_norms) & torch.isfinite(slack.mass)
    if not bool(finite.all()):  # a diverged or crafted model: those examples contribute zero
        terms = [rule.without(part, finite) for rule, part in zip(rules, terms, strict=True)]
        sq_norms = torch.where(finite, sq_norms, 0.0)
        slack = slack._replace(mass=torch.where(finite, slack.mass, 0.0))
        sums = weighted(terms, sq_norms, slack)
    totals = torch.stack([s.reshape(clients, -1).sum(1) for s in sums]).sum(0)
    return _Rows(sums, sq_norms, ~finite, ~torch.isfinite(totals))


def check_supported(model: nn.Module) -> None:
    """Refuse, before training and naming the layer, a batch norm (frozen or not, in training it
    mixes the examples of a batch), a layer with trainable parameters but no rule, a setting its
    rule cannot clip, a trained parameter shared by two layers; and, naming the parameter, trainable
    parameters that are not float32."""
    known = ", ".join(t.__name__ for t in registered_layers())
    owner: dict[int, str] = {}  # a trained parameter's id -> the layer that holds it
    for name, module in model.named_modules(remove_duplicate=False):
        where = f"layer {name or '<root>'!r} ({type(module).__name__})"
        for _, parameter in trainable(module):
            if id(parameter) in owner and owner[id(parameter)] != name:
                raise UnsupportedLayerError(
                    f"{where} shares a trained parameter with layer {owner[id(parameter)]!r} (tied weights): its "
                    "per-example gradient would be clipped, noised and applied once per layer; untie them or "
                    "freeze one (requires_grad=False)"
                )
            owner[id(parameter)] = name
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise UnsupportedLayerError(
                f"{where} normalises with batch statistics, so one example's gradient depends on the "
                "others: DP-SGD cannot clip per example; use GroupNorm or LayerNorm instead"
            )
        params = trainable(module)
        if not params:
            continue
        rule = rule_for(module)
        if rule is None:
            overridden = [t.__name__ for t in registered_layers() if isinstance(module, t)]
            because = f" (it overrides {overridden[0]}.forward)" if overridden else ""
            raise UnsupportedLayerError(
                f"{where} has trainable parameters ({', '.join(n for n, _ in params)}) but no per-example "
                f"clipping rule{because}; rules exist for {known}: freeze it (requires_grad=False), use one of "
                "those, or register a rule for it with fedprivacy.training.layers.register_layer_rule"
            )
        unclipped = [n for n, _ in params if rule.parameters is not None and n not in rule.parameters]
        if unclipped:
            raise UnsupportedLayerError(
                f"{where} holds trained parameter {unclipped[0]!r}, which its rule does not clip (it clips "
                f"{', '.join(rule.parameters or ())}): a parameter attached to a layer is neither clipped nor noised; "
                "freeze it (requires_grad=False) or give it a module of its own with a rule"
            )
        try:
            rule.check(module)
        except UnsupportedLayerError as refused:
            raise UnsupportedLayerError(f"{where}: {refused}") from refused
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and parameter.dtype != SUPPORTED_DTYPE:
            raise UnsupportedLayerError(
                f"parameter {name!r} is {parameter.dtype}: per-example clipping supports "
                f"{SUPPORTED_DTYPE} parameters only (its norms are exact in float64 only for float32 "
                "values: a float64 square can underflow to 0, a float16 sum overflow); convert the "
                "model with model.float()"
            )
