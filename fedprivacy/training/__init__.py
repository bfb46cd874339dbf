"""Local DP-SGD: Poisson sampling, per-example clipping, Gaussian noise, SGD; see trainer.py."""

from fedprivacy.training.clipping import (
    ClippedBatch,
    ClippedSums,
    LayerRecord,
    PerExampleClipper,
    UnsupportedLayerError,
    check_supported,
    clipped_sums,
)
from fedprivacy.training.layers import LayerRule, LayerTerms, PerExampleRule, register_layer_rule, rule_for
from fedprivacy.training.rng import SeededRunWarning, StepDraws, StepRandomness
from fedprivacy.training.schedule import StepSize
from fedprivacy.training.step import dp_step, release, sgd_update
from fedprivacy.training.trainer import DPTrainer, NonFiniteModel, PlanExhausted, TrainReport, check_finite

__all__ = [
    "ClippedBatch",
    "ClippedSums",
    "DPTrainer",
    "LayerRecord",
    "LayerRule",
    "LayerTerms",
    "NonFiniteModel",
    "PerExampleClipper",
    "PerExampleRule",
    "PlanExhausted",
    "SeededRunWarning",
    "StepRandomness",
    "StepDraws",
    "StepSize",
    "TrainReport",
    "UnsupportedLayerError",
    "check_finite",
    "check_supported",
    "clipped_sums",
    "dp_step",
    "register_layer_rule",
    "release",
    "rule_for",
    "sgd_update",
]
