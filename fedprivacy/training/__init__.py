"""Local DP-SGD: Poisson sampling, per-example clipping, Gaussian noise, SGD, for one client or a
stack of K (`stack.py`); the trainer (`trainer.py`) is the stack of one."""

from fedprivacy.training.clipping import (
    Clipped,
    ClippedBatch,
    LayerRecord,
    UnsupportedLayerError,
    check_supported,
    clipped_sums,
)
from fedprivacy.training.layers import LayerRule, LayerTerms, PerExampleRule, register_layer_rule, rule_for
from fedprivacy.training.rng import SeededRunWarning, StepDraws, StepRandomness
from fedprivacy.training.schedule import StepSizes
from fedprivacy.training.stack import ClientStack, PerExampleClipper, StepInputs, StepReport, release
from fedprivacy.training.trainer import DPTrainer, NonFiniteModel, PlanExhausted, TrainReport, check_finite

__all__ = [
    "ClientStack",
    "Clipped",
    "ClippedBatch",
    "DPTrainer",
    "LayerRecord",
    "LayerRule",
    "LayerTerms",
    "NonFiniteModel",
    "PerExampleClipper",
    "PerExampleRule",
    "PlanExhausted",
    "SeededRunWarning",
    "StepDraws",
    "StepInputs",
    "StepRandomness",
    "StepReport",
    "StepSizes",
    "TrainReport",
    "UnsupportedLayerError",
    "check_finite",
    "check_supported",
    "clipped_sums",
    "register_layer_rule",
    "release",
    "rule_for",
]
