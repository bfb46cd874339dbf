"""`model-options`: keyword arguments for a model's factory from the run config (or a sweep's
grid), checked against the factory's own parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fedprivacy import model_registry
from fedprivacy.errors import InputError
from fedprivacy.models import build_model
from fedprivacy.runconfig import parse_run_config
from sims.fast.engine import run_fast


def test_options_parse_to_typed_pairs_and_bad_ones_are_refused_by_name():
    settings = parse_run_config({"model-options": "hidden=128, scale=0.5, bias=false, act=relu"})
    assert settings.model_options == (("hidden", 128), ("scale", 0.5), ("bias", False), ("act", "relu"))
    assert parse_run_config({}).model_options == ()
    for bad in ("hidden", "=3", "2x=3", "hidden=", "hidden=1,hidden=2"):
        with pytest.raises(InputError) as refused:
            parse_run_config({"model-options": bad})
        assert refused.value.field == "model-options"


def test_the_factory_gets_the_options_and_an_unknown_one_is_refused_naming_what_it_takes(monkeypatch):
    assert build_model("mlp", 64, 10, {"hidden": 16})[1].out_features == 16
    with pytest.raises(InputError) as refused:
        build_model("mlp", 64, 10, {"hiden": 16})
    assert refused.value.field == "model-options"
    assert "takes hidden, not hiden (did you mean 'hidden'?)" in str(refused.value)
    with pytest.raises(InputError, match="takes no options, not hidden"):
        build_model("logreg", 64, 10, {"hidden": 16})
    monkeypatch.setattr(model_registry, "_decorated", {})

    @model_registry.register_model("wide")
    def wide(input_shape: tuple[int, ...], num_classes: int, *, width: int = 8) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], width), nn.ReLU(), nn.Linear(width, num_classes))

    assert build_model("wide", 64, 10, {"width": 32})[1].out_features == 32


def test_a_run_trains_the_model_its_options_build(in_process, simulate, tmp_path):
    """The fast engine and the apps build the mlp with hidden=16: model.pt's hidden layer has 16 units."""
    config = {**in_process.defaults(), "model": "mlp", "model-options": "hidden=16", "num-server-rounds": 1}
    folder, _ = run_fast({**config, "results-dir": str(tmp_path / "fast")}, 2, say=lambda _: None)
    assert torch.load(folder / "model.pt", weights_only=True)["1.weight"].shape == (16, 64)
    apps = {**config, "results-dir": str(tmp_path / "apps")}
    simulate(apps, 2)
    (run,) = Path(apps["results-dir"]).iterdir()
    assert torch.load(run / "model.pt", weights_only=True)["1.weight"].shape == (16, 64)
