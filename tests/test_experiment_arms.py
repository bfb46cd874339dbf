"""The experiment scripts' own claims: the local-only arm trains each client on the plan it makes in
the federation and scores it on its own test rows; the CNN step-decay study never tunes on a test
row; two sweeps pair seed by seed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pandas as pd
import pytest

from fedprivacy.data.partition import load_clients
from fedprivacy.recipe import partition_kwargs
from fedprivacy.runconfig import DEFAULTS, parse_run_config
from sims.sweep.driver import run_sweep
from sims.sweep.grid import cells
from sims.sweep.spec import validate

ROOT = Path(__file__).resolve().parents[1]


def script(name: str) -> ModuleType:
    """experiments/<name>.py as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"experiments_{name}", ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def heterogeneous_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two digits clients with budgets 1 and 4, rotated, seeds 0 and 1, seeded noise: a tiny experiment 5."""
    raw = {
        "sweep": {"clients": 2, "engine": "fast", "seeded-noise": True, "baseline": False},
        "run": {"dataset": "digits", "num-server-rounds": 2, "epochs": 2.0, "learning-rate": 1.0},
        "grid": {"seed": [0, 1], "epsilons": ["1,4", "4,1"]},
    }
    out = tmp_path_factory.mktemp("het") / "sweep"
    spec = validate(raw, base_dir=out.parent, default_name="het")
    assert run_sweep(spec, cells(spec), out).failures == []
    return out


def test_the_local_only_arm_runs_each_clients_federated_plan_on_its_own_rows_once(heterogeneous_sweep):
    local = script("local_only").local_only(heterogeneous_sweep)
    assert len(local) == 2 * 2 * 2  # seeds × clients × own ε, although 4 cells × 2 clients held them
    for cell in (heterogeneous_sweep / "cells").iterdir():
        record = json.loads((cell / "cell.json").read_text())
        run = cell / record["run_folder"]
        settings = parse_run_config({**DEFAULTS, **json.loads((run / "config.json").read_text())["run_config"]})
        clients = load_clients(**partition_kwargs(settings, 2))
        for index, client in enumerate(clients):
            plan = json.loads((run / "plans" / f"{client.client_id}.json").read_text())
            (row,) = local[
                (local["seed"] == settings.seed)
                & (local["client"] == client.client_id)
                & (local["epsilon_budget"] == settings.client_epsilon(index, 2))
            ].to_dict("records")
            assert row["steps"] == plan["steps"] and row["epsilon_spent"] == pytest.approx(plan["epsilon_pld"])
            assert row["test_rows"] == len(client.test)  # scored on its own test rows
    again = script("local_only").local_only(heterogeneous_sweep)
    pd.testing.assert_frame_equal(local, again)  # seeded: the same model, so the same accuracy


def test_the_cnn_study_tunes_on_training_rows_and_tests_on_rows_no_tuning_run_reads():
    lr_decay = script("lr_decay")
    fit, validation = lr_decay.rows("validation", 0)
    train, test = lr_decay.rows("test", 0)

    def keys(data) -> set[bytes]:
        return {np.ascontiguousarray(row).tobytes() + bytes([label]) for row, label in zip(data.features, data.labels)}

    assert keys(fit) | keys(validation) <= keys(train)  # validation rows are cut from the training rows
    assert not (keys(fit) | keys(validation)) & keys(test)
    assert len(validation.labels) == round(0.2 * len(train.labels)) and len(test.labels) == round(0.2 * 1797)


def test_two_sweeps_pair_seed_by_seed():
    paired = script("paired_sweeps")
    a = pd.DataFrame({"seed": [0, 1, 2], "epsilon": [1.0] * 3, "final_accuracy": [0.5, 0.6, 0.7]})
    b = a.assign(final_accuracy=[0.6, 0.6, 0.9], **{"tuned.learning-rate": 0.3})
    (line,) = paired.arm_lines(a, b, ["seed", "epsilon"], ("A", "B"))
    differences = np.array([0.1, 0.0, 0.2])
    assert line.startswith("epsilon = 1: A 0.600") and "(untuned)" in line and "(learning-rate = 0.3)" in line
    assert f"B − A +{differences.mean():.3f}" in line and line.endswith("†")  # 3 seeds: the interval holds 0
