"""Whether a model's forward can be trusted to compute each example from that example alone, and
the watch on what a forward may leave behind.

Per-example clipping bounds one record's influence only if no record reaches another example's
activations or gradients. A batch mean in training mode, a statistic taken only at some batch
sizes, a user's hook that centres a layer's output: any of them lets one record move every other
example's gradient, past clipping. The capture (`fedprivacy.training.capture`) therefore runs a
model's forward one example at a time under `torch.func.vmap` (each example alone: a mean over the
batch is a mean over its one row), unless the model is made only of modules whose forward is known
to keep rows apart (`rows_apart_by_construction`): exact PyTorch types with their own forward, no
hooks but the capture's, in `nn.Sequential` containers. Those run as one batched forward, which is
the same arithmetic (the tests check it bitwise) at a lower cost.

Under vmap a value computed from the data is a batched tensor: writing one into a parameter or
buffer in place fails, so no record can persist in the model's registered state. A forward could
still keep such a tensor in a plain attribute and read it at the next step; `AttributeWatch`
refuses that, on every step of a model that is not kept apart by construction.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fedprivacy.training.norms import UnsupportedLayerError

# Modules whose forward computes output row i from input row i alone, whatever the batch size and
# mode. LayerNorm is left out: over a normalized_shape that covers the batch dimension it mixes rows.
_ROWWISE_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Embedding,
    nn.GroupNorm,
    nn.Identity,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Hardtanh,
    nn.Softplus,
    nn.Mish,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.Flatten,
    nn.Unflatten,
    nn.Sequential,
)
_FORWARDS: dict[type[nn.Module], Any] = {t: t.forward for t in _ROWWISE_TYPES}
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOK_TABLES = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def register_rowwise(module_type: type[nn.Module]) -> None:
    """Declare that `module_type.forward` (as it is now) computes each output row from its own
    input row alone, so that models made of it may run as one batched forward. For the project's
    own reshaping modules (`fedprivacy.models.AsImage`); a user's module needs nothing: it runs one
    example at a time, which is always safe."""
    _FORWARDS[module_type] = module_type.forward


def _keeps_rows_apart(module: nn.Module) -> bool:
    kind = type(module)
    if kind not in _FORWARDS or kind.forward is not _FORWARDS[kind] or "forward" in vars(module):
        return False
    if isinstance(module, nn.Flatten):
        return module.start_dim >= 1
    if isinstance(module, nn.Unflatten):
        return module.dim >= 1
    return True


def _own_hook(hook: Any) -> bool:
    """A hook the capture itself registered (a bound method of a capture)."""
    owner = getattr(hook, "__self__", None)
    return owner is not None and getattr(owner, "IS_CAPTURE", False)


def rows_apart_by_construction(model: nn.Module) -> bool:
    """True when every module of `model` is an unmodified allow-listed type with no hooks but the
    capture's and no global module hooks are set: its batched forward computes each example alone."""
    from torch.nn.modules import module as module_globals

    if any(getattr(module_globals, table, None) for table in _GLOBAL_HOOK_TABLES):
        return False
    for module in model.modules():
        if not _keeps_rows_apart(module):
            return False
        for table in _HOOK_TABLES:
            if any(not _own_hook(hook) for hook in getattr(module, table, {}).values()):
                return False
    return True


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Tensors held by an attribute: the value itself, or the items of a list, tuple, set or dict."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item
    elif isinstance(value, dict):
        for item in value.values():
            if isinstance(item, torch.Tensor):
                yield item


_REGISTERED = ("_parameters", "_buffers", "_modules")


def _plain_attributes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every module's plain (not registered) attributes that hold tensors: name -> the tensors' ids."""
    found = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, value in vars(module).items():
            if name in _REGISTERED:
                continue
            ids = tuple(id(t) for t in _tensors_in(value))
            if ids:
                found[f"{prefix}.{name}" if prefix else name] = ids
    return found


class AttributeWatch:
    """Refuses a forward that leaves a tensor in a plain attribute of a module (`self.last = x`,
    `self.seen.append(x)`): read at a later step, a record would reach other examples' gradients
    without clipping. Registered parameters and buffers are not watched here: functional calls
    restore them, and vmap refuses in-place writes of data into them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.before = _plain_attributes(model)

    def check(self) -> None:
        after = _plain_attributes(self.model)
        for name in sorted(set(self.before) | set(after)):
            if self.before.get(name) != after.get(name):
                raise UnsupportedLayerError(
                    f"the model's forward changed the tensors held by attribute {name!r}: a tensor kept from one "
                    "forward to the next would carry records past per-example clipping; compute everything from "
                    "the current input (register constants as buffers in __init__)"
                )
