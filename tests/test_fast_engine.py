"""The fast engine is the same algorithm as the apps: with the same seeds, the same global model
after every round (to float tolerance), the same ε spent by every client, the same results files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from clients.app import app as client_app
from fedprivacy.errors import InputError
from server import strategy as strategy_module
from server.app import app as server_app
from sims.fast import engine as fast_engine
from sims.fast.engine import run_fast

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

HETEROGENEOUS = {
    "num-server-rounds": 3,
    "noise-seed": 7,
    "epsilons": "0.5,1,2,4",
    "deltas": "1e-5,1e-6,1e-5,1e-7",
}


def apps_rounds(
    in_process, config: dict[str, Any], clients: int, monkeypatch
) -> tuple[list[dict[str, torch.Tensor]], Path]:
    """The real apps in process: the global model after each round, and the results folder."""
    models: list[dict[str, torch.Tensor]] = []
    aggregate = strategy_module.PrivacyFedAvg.aggregate_train

    def spy(self, server_round, replies):
        arrays, metrics = aggregate(self, server_round, replies)
        models.append(arrays.to_torch_state_dict() if arrays is not None else (models[-1] if models else None))
        return arrays, metrics

    monkeypatch.setattr(strategy_module.PrivacyFedAvg, "aggregate_train", spy)
    in_process.run_server(server_app, in_process.Grid.simulation(client_app, clients, config), config)
    monkeypatch.undo()
    (folder,) = Path(config["results-dir"]).iterdir()
    return models, folder


def fast_rounds(
    config: dict[str, Any], clients: int, monkeypatch, **options: Any
) -> tuple[list[dict[str, torch.Tensor]], Path]:
    models: list[dict[str, torch.Tensor]] = []
    aggregate = fast_engine._aggregate

    def spy(global_state, trained, results, *rest):
        out = aggregate(global_state, trained, results, *rest)
        models.append({k: v.clone() for k, v in out.items()})
        return out

    monkeypatch.setattr(fast_engine, "_aggregate", spy)
    folder, _ = run_fast(config, clients, say=lambda _: None, **options)
    monkeypatch.undo()
    return models, folder


def csv(folder: Path, name: str) -> pd.DataFrame:
    return pd.read_csv(folder / name)


@pytest.mark.parametrize(
    ("model", "overrides"),
    [
        ("logreg", {}),
        ("mlp", {"rule": "adp"}),  # ADP-SGD: σ_t segments and the η/sqrt(20 + t) schedule
        ("mlp", {"fraction-train": 0.75, "fraction-evaluate": 0.5}),  # seeded sampling, federated evaluation
        (
            "logreg",
            {"aggregation": "inverse-noise", "server-optimizer": "fedadam", "server-learning-rate": 0.3},
        ),
        ("logreg", {"server-optimizer": "fedavgm", "server-momentum": 0.9}),
        (
            "logreg",
            {"rule": "calibrated", "lr-schedule": "inverse_sqrt", "lr-offset": 1.0, "lr-decay": 0.5},
        ),  # η_t = η/sqrt(1 + t/2)
        ("cnn", {"rule": "calibrated"}),  # not a Linear stack: trained client by client
    ],
)
def test_fast_engine_equals_the_apps_round_by_round(in_process, tmp_path, monkeypatch, model, overrides):
    config = {**in_process.defaults(), **HETEROGENEOUS, "model": model, **overrides}
    apps, apps_folder = apps_rounds(in_process, {**config, "results-dir": str(tmp_path / "apps")}, 4, monkeypatch)
    fast, fast_folder = fast_rounds({**config, "results-dir": str(tmp_path / "fast")}, 4, monkeypatch)
    assert len(apps) == len(fast) == 3
    for round_apps, round_fast in zip(apps, fast, strict=True):
        assert round_apps.keys() == round_fast.keys()
        for key in round_apps:
            torch.testing.assert_close(round_fast[key], round_apps[key], rtol=1e-4, atol=1e-5)

    clients_apps, clients_fast = csv(apps_folder, "clients.csv"), csv(fast_folder, "clients.csv")
    assert list(clients_apps.columns) == list(clients_fast.columns)
    columns = [
        "client_id",
        "epsilon_budget",
        "epsilon_spent",
        "delta",
        "steps_this_run",
        "steps_all_runs",
        "rounds_trained",
        "rounds_dropped",
        "status",
    ]
    pd.testing.assert_frame_equal(clients_apps[columns], clients_fast[columns])  # ε spent: identical, not close
    rounds_apps, rounds_fast = csv(apps_folder, "rounds.csv"), csv(fast_folder, "rounds.csv")
    assert list(rounds_apps.columns) == list(rounds_fast.columns)
    for column in ("accuracy", "loss", "federated_accuracy", "federated_loss"):
        np.testing.assert_allclose(
            rounds_fast[column].to_numpy(float), rounds_apps[column].to_numpy(float), rtol=1e-4, atol=1e-4
        )
    for column in (
        "clients_trained",
        "clients_exhausted",
        "clients_failed",
        "epsilon_spent_max",
        "epsilon_spent_mean",
    ):
        assert list(rounds_fast[column]) == list(rounds_apps[column])
    for name in (
        "summary.json",
        "config.json",
        "model.pt",
        "progress.png",
        "ledger.sqlite",
        "plans/index.csv",
    ):
        assert (fast_folder / name).is_file(), name
    summary = json.loads((fast_folder / "summary.json").read_text())
    assert summary["engine"] == "fast" and json.loads((apps_folder / "summary.json").read_text())["engine"] == "flower"
    assert set(summary) == set(json.loads((apps_folder / "summary.json").read_text())) | {"accounting_s"}


def test_two_ray_workers_give_the_same_run_as_one(in_process, tmp_path, monkeypatch):
    config = {**in_process.defaults(), **HETEROGENEOUS, "model": "mlp", "num-server-rounds": 2}
    one, one_folder = fast_rounds({**config, "results-dir": str(tmp_path / "one")}, 4, monkeypatch)
    two, two_folder = fast_rounds({**config, "results-dir": str(tmp_path / "two")}, 4, monkeypatch, workers=2)
    for a, b in zip(one, two, strict=True):
        for key in a:
            torch.testing.assert_close(a[key], b[key])
    pd.testing.assert_frame_equal(csv(one_folder, "clients.csv"), csv(two_folder, "clients.csv"))
    assert json.loads((two_folder / "config.json").read_text())["workers"] == 2


def test_a_client_too_small_to_train_fails_alone(in_process, tmp_path):
    """Tiny partitions (an exponential size skew) fail by name; the others train."""
    config = {
        **in_process.defaults(),
        "noise-seed": -1,
        "num-server-rounds": 2,
        "partitioning": "size",
        "size-skew": "exponential",
        "results-dir": str(tmp_path / "r"),
    }
    folder, timings = run_fast(config, 8, say=lambda _: None)
    clients = csv(folder, "clients.csv")
    failed = clients[clients.status.str.startswith("failed")]
    assert (
        len(failed) >= 1
        and failed.status.str.contains("too little data|row\\(s\\) in its partition|n=1: must be an integer >= 2").all()
    )
    assert (clients[~clients.status.str.startswith("failed")].epsilon_spent <= 1.0).all()
    assert timings.accounting_s > 0 and 0 < timings.commit_wait_s <= timings.accounting_s
    assert len(timings.accounting_by_round) == len(timings.commit_wait_by_round) == 2  # one per round
    assert sum(timings.accounting_by_round) == pytest.approx(timings.accounting_s)
    assert all(0 < wait <= spent for wait, spent in zip(timings.commit_wait_by_round, timings.accounting_by_round))


def test_a_run_in_which_every_client_fails_ends_as_the_apps_run_does(in_process, tmp_path, monkeypatch):
    """Every client's data fails to load (an injected fault): each fails by name, no worker has
    anyone to train, and the run fails as the apps' run does, with the same clients.csv."""
    config = {**in_process.defaults(), "num-server-rounds": 2}

    def unreadable(*_):
        raise OSError("injected: the data disk is gone")

    monkeypatch.setattr("clients.app.simulation_client", unreadable)  # undone by apps_rounds
    with pytest.raises(RuntimeError, match="no client trained"):
        apps_rounds(in_process, {**config, "results-dir": str(tmp_path / "apps")}, 4, monkeypatch)
    monkeypatch.setattr(fast_engine, "simulation_client", unreadable)
    with pytest.raises(RuntimeError, match="no client trained"):
        run_fast({**config, "results-dir": str(tmp_path / "fast")}, 4, say=lambda _: None)
    ((apps_folder,), (fast_folder,)) = ((tmp_path / "apps").iterdir(), (tmp_path / "fast").iterdir())
    clients = csv(fast_folder, "clients.csv")
    assert clients.status.str.contains("OSError: injected: the data disk is gone").all() and len(clients) == 4
    apps_clients = csv(apps_folder, "clients.csv")  # the apps name a client without data by its node
    assert list(apps_clients.columns) == list(clients.columns)
    pd.testing.assert_frame_equal(apps_clients.drop(columns="client_id"), clients.drop(columns="client_id"))
    assert json.loads((fast_folder / "summary.json").read_text())["status"].startswith("failed")
    assert not (fast_folder / "model.pt").exists()


@pytest.mark.parametrize(
    ("config", "clients", "field"),
    [
        ({"epsilons": "1,2,3"}, 4, "epsilons"),  # one ε per client: 4 clients, 3 values
        ({"min-clients": 3}, 2, "num_clients"),  # the apps' server would wait for a third client for ever
        ({"dataset": "pums", "data-path": "/nowhere/pums.csv"}, 2, "data-path"),
        ({"private": False}, 2, "private"),  # no run config turns privacy off: only run_fast(private=False)
    ],
)
def test_a_run_the_apps_could_not_run_is_refused_before_anything_is_written(
    in_process, tmp_path, config, clients, field
):
    with pytest.raises(InputError) as refused:
        run_fast(
            {**in_process.defaults(), **config, "results-dir": str(tmp_path / "fast")},
            clients,
            say=lambda _: None,
        )
    assert refused.value.field == field
    assert not (tmp_path / "fast").exists()


def test_a_second_run_on_the_same_ledger_stops_clients_at_their_budget(in_process, tmp_path):
    """As with the apps: run 2 starts from run 1's spend and each client stops before the round it
    cannot afford, never over budget."""
    ledger = tmp_path / "ledger.sqlite"
    base = {**in_process.defaults(), "noise-seed": -1, "ledger-path": str(ledger)}
    first, _ = run_fast({**base, "rule": "proactive", "results-dir": str(tmp_path / "r1")}, 2, say=lambda _: None)
    second, _ = run_fast(
        {**base, "rule": "calibrated", "num-server-rounds": 4, "results-dir": str(tmp_path / "r2")},
        2,
        run_id=2,
        say=lambda _: None,
    )
    before, after = (
        csv(first, "clients.csv").set_index("client_id"),
        csv(second, "clients.csv").set_index("client_id"),
    )
    assert (after.exhausted_round > 1).all() and (after.epsilon_spent <= after.epsilon_budget).all()
    assert (after.steps_all_runs > before.steps_all_runs).all()  # the ledger carried run 1's steps
    assert csv(second, "rounds.csv").clients_exhausted.iloc[-1] == 2


@pytest.mark.parametrize("optimizer", [{}, {"server-optimizer": "fedavgm", "server-momentum": 0.9}])
def test_a_round_whose_commit_fails_leaves_nothing_derived_from_its_updates(
    in_process, tmp_path, monkeypatch, optimizer
):
    """The server aggregates (its optimiser steps) and evaluates while the round's spends commit;
    if the commit fails (an I/O error injected into round 2's write), the run fails with it, the
    round is not in the ledger, and nothing derived from its updates got out: no row, no progress
    line, no round callback, no federated evaluation (the new model sent to the workers), no model."""
    import sqlite3

    from fedprivacy.ledger import writes

    write, aggregated, evaluated = writes.write_and_commit, [], []

    def failing_in_round_2(db, rows):
        if rows and rows[0][1] == 2:  # the row's server_round
            raise sqlite3.OperationalError("disk I/O error")
        return write(db, rows)

    monkeypatch.setattr(writes, "write_and_commit", failing_in_round_2)
    aggregate, evaluate = fast_engine._aggregate, fast_engine._evaluate_federated
    monkeypatch.setattr(fast_engine, "_aggregate", lambda *args: aggregated.append(args[3]) or aggregate(*args))
    monkeypatch.setattr(fast_engine, "_evaluate_federated", lambda *args: evaluated.append(args[2]) or evaluate(*args))
    ledger = tmp_path / "ledger.sqlite"
    config = {
        **in_process.defaults(),
        "noise-seed": 7,
        "num-server-rounds": 3,
        "ledger-path": str(ledger),
        "fraction-evaluate": 1.0,
        "results-dir": str(tmp_path / "r"),
        **optimizer,
    }
    lines, rows = [], []
    with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
        run_fast(config, 2, say=lines.append, on_round=rows.append)
    (folder,) = (tmp_path / "r").iterdir()
    assert aggregated == [1, 2]  # round 2 was aggregated while its commit ran ...
    assert [row["round"] for row in rows] == [1] and len(evaluated) == 1  # ... and nothing of it got out
    progress = [line for line in lines if line.startswith("round ")]
    assert len(progress) == 1 and progress[0].startswith("round 1/3")
    assert csv(folder, "rounds.csv")["round"].tolist() == [1]
    assert not (folder / "model.pt").exists()
    assert json.loads((folder / "summary.json").read_text())["status"] == "failed"
    with sqlite3.connect(ledger) as db:
        assert db.execute("SELECT DISTINCT server_round FROM spends").fetchall() == [(1,)]


@pytest.mark.parametrize(("fraction", "composed_ahead"), [(1.0, True), (0.75, False)])
def test_clients_in_every_round_have_their_rounds_composed_when_first_sampled(
    in_process, tmp_path, monkeypatch, fraction, composed_ahead
):
    """With every client in every round, the ε their plans' rounds will reach is composed when they
    are first sampled (`Ledger.compose_ahead`) and the later rounds' decisions compose nothing;
    with clients sampled at random their histories are not their plans' prefixes, and nothing is
    composed ahead."""
    from fedprivacy.ledger import composition

    compose = composition.composed_epsilon
    rounds_done, composed_in_round = [], []
    monkeypatch.setattr(
        composition,
        "composed_epsilon",
        lambda *args: composed_in_round.append(len(rounds_done) + 1) or compose(*args),
    )
    config = {
        **in_process.defaults(),
        **HETEROGENEOUS,
        "fraction-train": fraction,
        "results-dir": str(tmp_path / "r"),
    }
    lines: list[str] = []
    run_fast(config, 4, say=lines.append, on_round=rounds_done.append)
    assert len(rounds_done) == 3
    planning = [line for line in lines if line.startswith("planning ")]
    if composed_ahead:
        assert set(composed_in_round) == {1}  # four budgets, three rounds each: all before round 1 trains
        assert len(composed_in_round) == 4 * 3
        assert planning == ["planning 4 clients sampled for the first time and composing the ε of their rounds"]
    else:
        assert set(composed_in_round) > {1}
        assert planning and all("composing" not in line for line in planning)


def test_the_noise_scale_is_sigma_times_c_in_float64_rounded_up_once(in_process, tmp_path, monkeypatch):
    """Each noise coordinate the fast engine adds is s·z with s = σ·C formed in float64 from the
    plan's σ and C and rounded once to float32, upwards (the trainer's `noise_scale`): the noise's
    std is never below the certified σC. A float32 σ times a float32 C is below it at C = 1.3
    for the proactive σ(ε = 1, δ = 1e-5), which the old engine used."""
    import dataclasses

    from fedprivacy.privacy.proactive import proactive_sigma
    from fedprivacy.training.step import noise_scale
    from sims.fast import stack

    clip, sigma = 1.3, proactive_sigma(1.0, 1e-5)
    scale = float(noise_scale(sigma, clip))
    assert scale >= sigma * clip and scale - sigma * clip <= 2**-23 * sigma * clip
    two_roundings = float(torch.tensor(sigma, dtype=torch.float32) * torch.tensor(clip, dtype=torch.float32))
    assert two_roundings < sigma * clip  # what the check below tells apart
    release, seen = stack.release_stacked, []

    def spy(sums, step, add_noise=True):
        unit = dataclasses.replace(step, expected_batch=torch.ones_like(step.expected_batch))
        noise = release([torch.zeros_like(s) for s in sums], unit, add_noise)  # the noise alone, undivided
        seen.append((torch.cat([n.flatten(1) for n in noise], dim=1), step.normals.clone(), step.active.clone()))
        return release(sums, step, add_noise)

    monkeypatch.setattr(stack, "release_stacked", spy)
    config = {
        **in_process.defaults(),
        "rule": "proactive",
        "epsilon": 1.0,
        "delta": 1e-5,
        "clip-norm": clip,
        "num-server-rounds": 1,
        "noise-seed": 7,
        "results-dir": str(tmp_path / "r"),
    }
    run_fast(config, 2, say=lambda _: None)
    assert seen
    for noise, normals, active in seen:
        assert noise.dtype == torch.float32
        assert torch.equal(noise[active], torch.tensor(scale, dtype=torch.float32) * normals[active])


def test_a_run_with_the_mechanism_off_trains_the_same_rounds_and_spends_no_named_ledger(in_process, tmp_path):
    """`run_fast(private=False)` (the non-private baseline) samples the same clients and runs
    each the same steps as the private run, keeps its would-be spends in a ledger of its own (never
    the one the run config names: a client's real budget) and says it is not private."""
    named = tmp_path / "client-ledger.sqlite"
    config = {**in_process.defaults(), "fraction-train": 0.5, "num-server-rounds": 3, "ledger-path": str(named)}

    def run(private: bool) -> Path:
        folder, _ = run_fast(
            {**config, "results-dir": str(tmp_path / str(private))}, 4, private=private, say=lambda _: None
        )
        for name in ("config.json", "summary.json"):  # a private run's have no such key, as the apps'
            assert json.loads((folder / name).read_text()).get("private", "absent") == ("absent" if private else False)
        return folder

    off = run(False)
    assert not named.exists() and (off / "ledger.sqlite").is_file()
    on = run(True)
    assert named.is_file()
    trained = ["round", "clients_sampled", "clients_trained"]
    pd.testing.assert_frame_equal(csv(off, "rounds.csv")[trained], csv(on, "rounds.csv")[trained])
    assert csv(on, "rounds.csv").clients_trained.tolist() == [2, 2, 2]  # half the clients, sampled each round
    steps = ["client_id", "steps_planned", "steps_this_run", "rounds_trained"]
    pd.testing.assert_frame_equal(csv(off, "clients.csv")[steps], csv(on, "clients.csv")[steps])


@pytest.mark.parametrize("model", ["logreg", "cnn"])  # the batched stack, and client by client (DPTrainer)
def test_a_step_with_the_mechanism_off_is_the_plain_gradient_sum_over_q_n(model):
    """With `private=False` a step is η·Σ∇loss_i over the sampled rows, unclipped and without noise,
    divided by the plan's q·N (here every row of 30 is sampled, over q·N = 40), as autograd gives
    it; the plan's tiny C and large σ would change it beyond recognition were they used."""
    from fedprivacy.models import build_model
    from fedprivacy.privacy.plan import Plan
    from sims.fast.worker import LocalWorker, RoundRequest, WorkerClient

    plan = Plan(
        client_id="c0",
        rule="calibrated",
        n=40,
        epsilon=1.0,
        delta=1e-5,
        clip_norm=1e-3,
        sigma=1e3,
        sampling_rate=1.0,
        steps=1,
        rounds=1,
        noise_segments=((1e3, 1),),
        epsilon_pld=0.9,
        epsilon_rdp=1.0,
        learning_rate=0.5,
    )
    generator = torch.Generator().manual_seed(0)
    x, y = torch.rand(30, 64, generator=generator), torch.randint(0, 10, (30,), generator=generator)
    torch.manual_seed(0)
    reference = build_model(model, 64, 10)
    start = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    torch.nn.functional.cross_entropy(reference(x), y, reduction="sum").backward()
    expected = {name: start[name] - plan.learning_rate * p.grad / 40 for name, p in reference.named_parameters()}

    def one_round(private: bool) -> dict[str, torch.Tensor]:
        client = WorkerClient(0, x.numpy(), y.numpy(), x[:1].numpy(), y[:1].numpy(), "1")
        worker = LocalWorker([client], model, 64, 10, private=private)
        worker.add_plans({0: plan})
        result = worker.train(start, 1, [RoundRequest(0, None)], diagnostics=False)
        return {key: weights[0] for key, weights in zip(start, result.weights, strict=True)}

    off, on = one_round(False), one_round(True)
    assert off.keys() == expected.keys()
    for key, want in expected.items():
        torch.testing.assert_close(off[key], want, rtol=1e-4, atol=1e-6)
    assert not all(torch.allclose(on[key], want, rtol=1e-2, atol=1e-3) for key, want in expected.items())
