"""What `fedprivacy.models.build_model` checks on a model before any record reaches it, once per
factory, input shape and class count in a process (engines rebuild a model per client).

- It gives one logit per class for a batch of the declared input shape (a factory that ignores its
  arguments fails here, naming itself, rather than inside a client's round).
- Its forward leaves the model as it found it: no parameter or buffer changes value (a running
  statistic, a counter, an `Embedding.max_norm` renormalisation, a write under `torch.no_grad()`)
  and no module keeps a tensor in a plain attribute, in training mode or in evaluation mode. Only
  the trained parameters, through clipping and noise, may carry anything from a record, and only
  the step may move them. Refused naming what changed.
- It trains as the trainer runs it: one step's capture on a probe batch, each example computed
  alone (`fedprivacy.training.capture`), which fails for a model that cannot run one example at a
  time (data-dependent Python control flow, `.item()`, an autograd Function without a vmap rule).
- An example's logits do not change with another example of its batch, in evaluation mode and in
  training mode (dropout's masks drawn alike). Training computes each example alone whatever the
  model, so this is not what keeps records apart: it keeps a model that was written to mix its
  batch (a batch mean, a batch statistic) from training, silently, as something else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor, nn

from fedprivacy.errors import InputError
from fedprivacy.model_registry import InputShape
from fedprivacy.training import UnsupportedLayerError
from fedprivacy.training.capture import BatchedCapture
from fedprivacy.training.isolation import AttributeWatch

PROBE_ROWS = 3


def check_model(name: str, target: str, model: nn.Module, shape: InputShape, num_classes: int) -> None:
    """Every check above on a freshly built `model`; its mode is restored afterwards."""
    training = model.training
    parameter = next(model.parameters(), None)
    device = None if parameter is None else parameter.device
    try:
        _check_logits(name, target, model, shape, num_classes, device)
        _check_forward_keeps_state(name, target, model, shape, num_classes, device)
        _check_rows_apart(name, target, model, shape, device)
    finally:
        model.train(training)


def _refused(name: str, target: str, why: str) -> UnsupportedLayerError:
    return UnsupportedLayerError(f"model={name!r} (factory {target}): {why}")


def _check_logits(
    name: str, target: str, model: nn.Module, shape: InputShape, num_classes: int, device: torch.device | None
) -> None:
    """Two zero examples must give two rows of `num_classes` logits."""
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros((2, *shape), device=device))
    except Exception as error:
        raise InputError(
            "model",
            name,
            f"the model from {target} cannot take a batch of input_shape={shape}: {type(error).__name__}: {error}",
        ) from error
    if not isinstance(out, Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise InputError(
            "model",
            name,
            f"the model from {target} gives {got} for 2 examples; need (2, {num_classes}): one logit per class",
        )


def _state(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer by name, copied."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {key: value.detach().clone() for key, value in named}


def _same(old: Tensor, new: Tensor) -> bool:
    """Equal shapes, dtypes and values (NaN where NaN was)."""
    if old.shape != new.shape or old.dtype != new.dtype:
        return False
    if torch.equal(old, new):
        return True
    return (
        old.is_floating_point()
        and torch.equal(old.isnan(), new.isnan())
        and torch.equal(old.nan_to_num(nan=0.0), new.nan_to_num(nan=0.0))
    )


def _changed(before: dict[str, Tensor], after: dict[str, Tensor], model: nn.Module) -> str | None:
    """What the forward changed, in words, or None."""
    buffers = {key for key, _ in model.named_buffers(remove_duplicate=False)}
    for key in sorted(set(before) | set(after)):
        kind = "buffer" if key in buffers else "parameter"
        if key not in after:
            return f"{kind} {key!r} disappeared"
        if key not in before:
            return f"{kind} {key!r} appeared"
        if not _same(before[key], after[key]):
            return f"{kind} {key!r} changed"
    return None


def _forked(device: torch.device | None) -> contextlib.AbstractContextManager:
    """The random state forked (CPU, and the model's GPU if it has one): a check draws no caller's numbers."""
    return torch.random.fork_rng(devices=[device] if device is not None and device.type == "cuda" else [])


def _check_forward_keeps_state(
    name: str, target: str, model: nn.Module, shape: InputShape, num_classes: int, device: torch.device | None
) -> None:
    """A plain forward in training and in evaluation mode, then the trainer's own capture of one
    step, must leave every parameter, buffer and plain attribute as it was."""
    generator = torch.Generator().manual_seed(0)
    batch = torch.rand((PROBE_ROWS, *shape), generator=generator).to(device)
    labels = torch.randint(0, num_classes, (PROBE_ROWS,), generator=generator).to(device)
    before, watch = _state(model), AttributeWatch(model)

    def refuse_if_changed(when: str) -> None:
        change = _changed(before, _state(model), model)
        if change is not None:
            raise _refused(
                name,
                target,
                f"its forward in {when} changed the model: {change}. Only the trained parameters may carry "
                "anything from a record (through clipping and noise), and only the DP step may move them: "
                "compute statistics from each example alone (GroupNorm or LayerNorm, not running statistics; "
                "InstanceNorm without track_running_stats) and keep no state between calls",
            )
        try:
            watch.check()
        except UnsupportedLayerError as error:
            raise _refused(name, target, f"in {when}, {error}") from None

    for mode, label in ((True, "training mode"), (False, "evaluation mode")):
        model.train(mode)
        with torch.no_grad(), _forked(device):
            model(batch)
        refuse_if_changed(label)
    model.train()
    capture = BatchedCapture(model)
    try:
        with _forked(device):
            capture.single(None, batch, labels)  # the model's own weights
    except UnsupportedLayerError as error:
        raise _refused(name, target, str(error)) from None
    except Exception as error:  # the model cannot run one example at a time: say so, with PyTorch's reason
        raise _refused(
            name,
            target,
            "it cannot be trained one example at a time (each example computed alone under torch.func.vmap, so "
            f"that no record reaches another example's gradient): {type(error).__name__}: {error}",
        ) from error
    finally:
        capture.remove_hooks()
    refuse_if_changed("a training step")


def _check_rows_apart(name: str, target: str, model: nn.Module, shape: InputShape, device: torch.device | None) -> None:
    """Refuse a model whose logits for one example change when another example of the batch changes,
    in evaluation mode and in training mode: a seeded batch of three examples whose first is then
    replaced by large values, from the same random state (dropout's masks alike)."""
    generator = torch.Generator().manual_seed(0)
    batch = torch.rand((PROBE_ROWS, *shape), generator=generator).to(device)
    changed = batch.clone()
    changed[0] = 1e3 * torch.rand(shape, generator=generator).to(device) + 7.0
    for mode, label in ((False, "evaluation mode"), (True, "training mode")):
        model.train(mode)
        before, after = (_seeded(lambda x=x: model(x), device) for x in (batch, changed))
        if not torch.equal(before[1:], after[1:]):
            raise _refused(
                name,
                target,
                f"in {label}, changing one example of a batch changed the logits of the others, so the model mixes "
                "the examples of a batch (a batch mean or statistic). DP-SGD computes and clips each example "
                "alone, so it would train another model than the one written; compute every example from itself "
                "alone (GroupNorm or LayerNorm instead of BatchNorm)",
            )


def _seeded(forward: Callable[[], Tensor], device: torch.device | None) -> Tensor:
    """`forward()` without gradients from a fixed random state, leaving the caller's state as it was."""
    with torch.no_grad(), _forked(device):
        torch.manual_seed(0)
        return forward()
