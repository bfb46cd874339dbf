"""Local DP-SGD: Poisson sampling, per-example clipping, Gaussian noise, SGD; see trainer.py."""

from fedprivacy.training.clipping import (
    SUPPORTED_LAYERS,
    ClippedBatch,
    PerExampleClipper,
    UnsupportedLayerError,
    check_supported,
)
from fedprivacy.training.rng import SeededRunWarning, StepDraws, StepRandomness
from fedprivacy.training.schedule import StepSize
from fedprivacy.training.step import dp_step, release, sgd_update
from fedprivacy.training.trainer import DPTrainer, NonFiniteModel, PlanExhausted, TrainReport, check_finite

__all__ = [
    "SUPPORTED_LAYERS",
    "ClippedBatch",
    "DPTrainer",
    "NonFiniteModel",
    "PerExampleClipper",
    "PlanExhausted",
    "SeededRunWarning",
    "StepRandomness",
    "StepDraws",
    "StepSize",
    "TrainReport",
    "UnsupportedLayerError",
    "check_finite",
    "check_supported",
    "dp_step",
    "release",
    "sgd_update",
]
