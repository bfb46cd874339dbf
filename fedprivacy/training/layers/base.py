"""The registry of per-layer clipping rules: per-example gradient norms and clipped sums of one layer
from its input A and output gradient D.

The capture (`fedprivacy.training.capture`) takes A and D for the trainer's one client and the
fast engine's K alike; everything after that is a rule's: squared-norm
bounds in float64 (`fedprivacy.training.norms`), the rounding slack of forming the sums, and
per-client clipped sums. Rows are examples, client-major: R = K·B rows, rows k·B … k·B + B − 1
belong to client k.

A rule is found by the layer's exact type first, then by a registered base class, but only if the
layer does not override `forward` (a subclass that computes something else needs its own rule).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from fedprivacy.training.norms import Slack, ToFloat64, UnsupportedLayerError

__all__ = [
    "LayerRule",
    "LayerTerms",
    "UnsupportedLayerError",
    "register_layer_rule",
    "registered_layers",
    "rule_for",
    "trainable",
]


@dataclass
class LayerTerms:
    """One layer's share of a batch: what its norms are and what its sums need."""

    sq_norms: Tensor  # [R] float64 upper bounds on ‖g_r‖² of this layer's trained parameters
    slack: Slack  # absolute rounding slack per row (see norms.clip_weights)
    state: Any  # what weighted_sums needs (A, D, materialised per-example gradients…)


class LayerRule(ABC):
    """How one kind of layer is clipped per example. Subclass it and `register_layer_rule` it for a
    layer of your own; `PerExampleRule` does the numerics for a rule that can materialise its
    per-example gradients."""

    # The names of the parameters this rule clips on its layer; None: every trainable parameter the
    # layer holds (a user's `PerExampleRule` forms them all). A layer holding a trained parameter its
    # rule does not clip is refused (`fedprivacy.training.clipping.check_supported`).
    parameters: tuple[str, ...] | None = None

    def check(self, module: nn.Module) -> None:  # noqa: B027 (optional hook: most layers need no check)
        """Refuse settings of `module` this rule cannot clip (raise UnsupportedLayerError naming the
        setting and what to use instead; the caller adds the layer's name). Default: accept all."""

    @abstractmethod
    def terms(self, module: nn.Module, a: Tensor, d: Tensor, to64: ToFloat64) -> LayerTerms:
        """Norm bounds, slack and state from `a`, the layer's first forward input, and `d`, the
        gradient of the summed loss with respect to its output; both with R leading rows."""

    @abstractmethod
    def weighted_sums(self, module: nn.Module, terms: LayerTerms, weights: Tensor) -> list[Tensor]:
        """Σ_b w[k, b]·g_{k,b} as a [K, *param.shape] tensor per trained parameter of `module`
        (named_parameters(recurse=False) order, requires_grad only); `weights` is [K, B] in the
        sums' dtype, row k·B + b of the terms being client k's example b."""

    def without(self, terms: LayerTerms, keep: Tensor) -> LayerTerms:
        """The same terms with the rows not kept (`keep`: [R] bool) zeroed, so that a non-finite
        example contributes exactly 0 (0·inf would be NaN). The default zeroes the rows of a state
        that is a tensor, or a tuple or list of tensors (or None), whose leading dimension is R or
        R·m (m sub-rows per example, example-major); a rule with any other state overrides it."""
        rows = keep.shape[0]

        def zeroed(t: Any) -> Any:
            if t is None:
                return None
            if not isinstance(t, Tensor) or t.dim() == 0 or t.shape[0] % rows:
                raise TypeError(
                    f"{type(self).__name__}.without: cannot zero rows of a state holding {type(t).__name__}"
                    f"{tuple(t.shape) if isinstance(t, Tensor) else ''}; override `without` for it"
                )
            mask = keep if t.shape[0] == rows else keep.repeat_interleave(t.shape[0] // rows)
            return torch.where(mask.view(-1, *(1,) * (t.dim() - 1)), t, t.new_zeros(()))

        state = terms.state
        state = type(state)(zeroed(t) for t in state) if isinstance(state, tuple | list) else zeroed(state)
        return replace(
            terms,
            sq_norms=torch.where(keep, terms.sq_norms, 0.0),
            slack=terms.slack._replace(mass=torch.where(keep, terms.slack.mass, 0.0)),
            state=state,
        )


_RULES: dict[type[nn.Module], LayerRule] = {}


def register_layer_rule(layer_type: type[nn.Module], rule: LayerRule) -> None:
    """Clip layers of `layer_type` (and its subclasses that keep its `forward`) by `rule`; a later
    registration for the same type replaces the earlier one. Code registers rules, never a config."""
    if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
        raise TypeError(f"layer_type={layer_type!r}: must be a torch.nn.Module subclass")
    if not isinstance(rule, LayerRule):
        raise TypeError(f"rule={rule!r}: must be an instance of a fedprivacy.training.layers.LayerRule subclass")
    _RULES[layer_type] = rule


def registered_layers() -> tuple[type[nn.Module], ...]:
    """The layer types that have a rule, by name."""
    return tuple(sorted(_RULES, key=lambda t: t.__name__))


def rule_for(module: nn.Module) -> LayerRule | None:
    """The rule for `module`: its exact type's, else the nearest registered base class's if `module`
    does not override that class's `forward`; None if there is none."""
    kind = type(module)
    rule = _RULES.get(kind)
    if rule is not None:
        return rule
    for base in kind.__mro__[1:]:
        rule = _RULES.get(base)
        if rule is not None:
            return rule if kind.forward is base.forward else None
    return None


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters `module` itself trains, in the order its rule's sums follow."""
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
