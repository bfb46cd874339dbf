"""The fast engine is the same algorithm as the apps: with the same seeds, the same global model
after every round (to float tolerance), the same ε spent by every client, the same results files."""

from __future__ import annotations

import json
import math
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
        # client-level DP: Poisson-sampled members, clipped updates, the federation's noise and ledger
        (  # noise-seed 2 samples nobody in round 2: the noise alone is released
            "logreg",
            {"federation-epsilon": 8.0, "federation-cohort": 2, "federation-rule": "calibrated", "noise-seed": 2},
        ),
        (  # and its clip adapting to the median update norm, with its own noisy count
            "logreg",
            {
                "federation-epsilon": 8.0,
                "federation-cohort": 2,
                "federation-rule": "calibrated",
                "update-clip-quantile": 0.5,
                "clip-count-noise": 2.0,
            },
        ),
    ],
)
def test_fast_engine_equals_the_apps_round_by_round(in_process, tmp_path, monkeypatch, model, overrides):
    config = {**in_process.defaults(), **HETEROGENEOUS, "model": model, **overrides}
    apps, apps_folder = apps_rounds(in_process, {**config, "results-dir": str(tmp_path / "apps")}, 4, monkeypatch)
    fast, fast_folder = fast_rounds({**config, "results-dir": str(tmp_path / "fast")}, 4, monkeypatch)
    assert len(apps) == len(fast) == 3
    # The CNN's sums come from other kernels in the engine (stacked) than in the apps (one model),
    # equal to float rounding; the release rounds them to a grid of σC/2⁸, so the rare coordinate
    # whose two sums straddle a grid boundary is released one grid step apart, and training then
    # amplifies it: its first round is compared, all but those coordinates; the others' every round.
    compared = 1 if model == "cnn" else 3
    for round_apps, round_fast in zip(apps[:compared], fast[:compared], strict=True):
        assert round_apps.keys() == round_fast.keys()
        for key in round_apps:
            if model == "cnn":
                apart = ~torch.isclose(round_fast[key], round_apps[key], rtol=1e-4, atol=1e-5)
                assert float(apart.double().mean()) < 1e-3, key
                round_fast[key], round_apps[key] = round_fast[key][~apart], round_apps[key][~apart]
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
            rounds_fast[column].to_numpy(float)[: compared - (model == "cnn")],
            rounds_apps[column].to_numpy(float)[: compared - (model == "cnn")],
            rtol=1e-4,
            atol=1e-4,
        )
    for column in (
        "clients_trained",
        "clients_exhausted",
        "clients_failed",
        "epsilon_spent_max",
        "epsilon_spent_mean",
        "federation_epsilon_spent",
        "federation_update_clip",
    ):
        assert rounds_fast[column].equals(rounds_apps[column]), column
    if "federation-epsilon" in overrides:  # the federation's ledger spent in every round, in both
        assert rounds_fast["federation_epsilon_spent"].notna().all()
        if overrides.get("noise-seed") == 2:
            assert list(rounds_fast["clients_sampled"])[1] == 0
            assert not all(torch.equal(fast[1][k], fast[0][k]) for k in fast[0])  # noise released all the same
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
def test_a_run_the_apps_could_not_run_is_refused_by_name_and_leaves_a_failed_summary(
    in_process, tmp_path, config, clients, field
):
    """As a ServerApp run refused by its run config: the refusal names the field, and the run's
    folder holds a summary.json that says it failed and why (and no model)."""
    lines: list[str] = []
    with pytest.raises(InputError) as refused:
        run_fast({**in_process.defaults(), **config, "results-dir": str(tmp_path / "fast")}, clients, say=lines.append)
    assert refused.value.field == field
    (folder,) = (tmp_path / "fast").iterdir()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "failed" and f"{field}=" in summary["error"]
    assert not (folder / "model.pt").exists()
    assert any(line.startswith("run failed: InputError: ") for line in lines)


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


@pytest.mark.parametrize("every_s", [0.0, 1e9])
@pytest.mark.parametrize("stops_in_round", [None, 3])
def test_the_round_tables_are_rewritten_when_due_and_always_when_the_run_ends(
    in_process, tmp_path, monkeypatch, every_s, stops_in_round
):
    """rounds.csv, clients.csv and replies.csv are rewritten after a round only once
    `TABLES_EVERY_S` has passed since they last were (after every round at 0); whatever ends the
    run, its folder then holds every round that ended: a completed run's three, and rounds 1 and
    2 of one stopped by an error before round 3 ends."""
    monkeypatch.setattr(fast_engine, "TABLES_EVERY_S", every_s)
    results = tmp_path / "r"
    written: list[bool] = []

    def after_round(row: dict[str, Any]) -> None:
        (folder,) = results.iterdir()
        written.append((folder / "rounds.csv").exists() and len(csv(folder, "rounds.csv")) == row["round"])
        if stops_in_round is not None and row["round"] == stops_in_round - 1:
            raise RuntimeError("stopped")

    config = {**in_process.defaults(), "noise-seed": 3, "num-server-rounds": 3, "results-dir": str(results)}
    if stops_in_round is None:
        run_fast(config, 3, say=lambda _: None, on_round=after_round)
    else:
        with pytest.raises(RuntimeError, match="stopped"):
            run_fast(config, 3, say=lambda _: None, on_round=after_round)
    ended = [1, 2, 3] if stops_in_round is None else list(range(1, stops_in_round))
    assert written == [every_s == 0.0] * len(ended)
    (folder,) = results.iterdir()
    assert csv(folder, "rounds.csv")["round"].tolist() == ended
    assert sorted(set(csv(folder, "replies.csv")["round"])) == ended
    assert (csv(folder, "clients.csv").rounds_trained == len(ended)).all()
    status = json.loads((folder / "summary.json").read_text())["status"]
    assert status == ("completed" if stops_in_round is None else "failed")


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


def test_the_noise_scale_is_sigma_times_c_rounded_up_once(in_process, tmp_path, monkeypatch):
    """The σC each client's release is given is σ·C formed from the plan's σ and C and rounded once
    to float64, upwards (`noise_scale`): the noise's std is never below the certified σC, checked
    in exact rational arithmetic; a float32 σ times a float32 C would be below it here."""
    from fractions import Fraction

    from fedprivacy.privacy.proactive import proactive_sigma
    from fedprivacy.training import stack

    clip, sigma = 1.3, proactive_sigma(1.0, 1e-5)
    two_roundings = float(torch.tensor(sigma, dtype=torch.float32) * torch.tensor(clip, dtype=torch.float32))
    assert two_roundings < sigma * clip
    release, seen = stack.release, []

    def spy(sums, step, add_noise=True):
        seen.append((step.noise_std.clone(), step.active.clone()))
        return release(sums, step, add_noise)

    monkeypatch.setattr(stack, "release", spy)
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
    exact = Fraction(sigma) * Fraction(clip)
    for noise_std, active in seen:
        assert noise_std.dtype == torch.float64
        for value in noise_std[active].tolist():
            assert exact <= Fraction(value) < exact * (1 + Fraction(1, 2**51))


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


def _one_full_step(model: str, x: torch.Tensor, y: torch.Tensor, private: bool) -> dict[str, torch.Tensor]:
    """One client's one round of one step on all its rows (q = 1, q·N = 40, η = 0.5), with a tiny C
    and a large σ that would change the step beyond recognition were they used."""
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
    torch.manual_seed(0)
    start = build_model(model, 64, 10).state_dict()
    client = WorkerClient(0, x.numpy(), y.numpy(), x[:1].numpy(), y[:1].numpy(), "1")
    worker = LocalWorker([client], model, 64, 10, private=private)
    worker.add_plans({0: plan})
    result = worker.train(start, 1, [RoundRequest(0, None)], diagnostics=False)
    return {key: weights[0] for key, weights in zip(start, result.weights, strict=True)}


def _plain_step(model: str, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """What `_one_full_step` without the mechanism should give: η·Σ∇loss_i / (q·N) by autograd."""
    from fedprivacy.models import build_model

    torch.manual_seed(0)
    reference = build_model(model, 64, 10)
    start = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    torch.nn.functional.cross_entropy(reference(x), y, reduction="sum").backward()
    return {name: start[name] - 0.5 * p.grad / 40 for name, p in reference.named_parameters()}


@pytest.mark.parametrize("model", ["logreg", "cnn"])  # the batched stack, and client by client (DPTrainer)
def test_a_step_with_the_mechanism_off_is_the_plain_gradient_sum_over_q_n(model):
    """With `private=False` a step is η·Σ∇loss_i over the sampled rows, unclipped and without noise,
    divided by the plan's q·N (here every row of 30 is sampled, over q·N = 40), as autograd gives
    it; the plan's tiny C and large σ would change it beyond recognition were they used."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.rand(30, 64, generator=generator), torch.randint(0, 10, (30,), generator=generator)
    expected = _plain_step(model, x, y)
    off, on = _one_full_step(model, x, y, False), _one_full_step(model, x, y, True)
    assert off.keys() == expected.keys()
    for key, want in expected.items():
        torch.testing.assert_close(off[key], want, rtol=1e-4, atol=1e-6)
    assert not all(torch.allclose(on[key], want, rtol=1e-2, atol=1e-3) for key, want in expected.items())


@pytest.mark.parametrize("model", ["logreg", "cnn"])
def test_without_the_mechanism_an_example_whose_gradient_is_not_finite_is_dropped(model):
    """The non-private step sums plain gradients; when that sum is not finite (one row of inf
    features) it falls back to the clipped path, which drops that example as the trainer's
    non-private steps do: the step is the plain one over the other 29 rows."""
    generator = torch.Generator().manual_seed(1)
    x, y = torch.rand(30, 64, generator=generator), torch.randint(0, 10, (30,), generator=generator)
    x[7] = math.inf
    keep = torch.arange(30) != 7
    expected = _plain_step(model, x[keep], y[keep])
    off = _one_full_step(model, x, y, False)
    for key, want in expected.items():
        torch.testing.assert_close(off[key], want, rtol=1e-4, atol=1e-6)


def _gn_cnn(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    """A user's CNN for 8×8 images with GroupNorm after each convolution (BatchNorm is refused)."""
    from torch import nn

    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, kernel_size=3, padding=1),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, kernel_size=3, padding=1, groups=2),
        nn.GroupNorm(4, 8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, num_classes),
    )


def _plan(index: int, n: int, steps: int, clip: float, sigma: float) -> Any:
    from fedprivacy.privacy.plan import Plan

    return Plan(
        client_id=f"c{index}",
        rule="calibrated",
        n=n,
        epsilon=1.0,
        delta=1e-5,
        clip_norm=clip,
        sigma=sigma,
        sampling_rate=0.2,
        steps=steps,
        rounds=2,
        noise_segments=((sigma, steps),),
        epsilon_pld=0.9,
        epsilon_rdp=1.0,
        learning_rate=0.5,
    )


@pytest.mark.parametrize("stack_clients", [64, 2])  # a stack per batch width, or also cut into stacks of two
@pytest.mark.parametrize("model", ["cnn", "test-gn-cnn"])
def test_a_batched_round_gives_each_client_the_trainers_weights(model, stack_clients, monkeypatch, compute_device):
    """Clients with their own data sizes, C, σ and round lengths (3 and 2 steps in round 1, 2 and 2
    in round 2) trained together by the engine's stack (on the CPU, and on the GPU when one is
    visible) end with the weights `DPTrainer` gives each alone on the CPU (same seed, same plan,
    same start), for the digits CNN and a user's GroupNorm CNN; the rounds hold Poisson batches of
    different sizes and an empty batch (checked below); also with a width's clients cut into
    stacks of two."""

    from fedprivacy.models import build_model, register_model
    from fedprivacy.training import DPTrainer, stack
    from sims.fast.worker import LocalWorker, RoundRequest, WorkerClient

    register_model("test-gn-cnn")(_gn_cnn)
    generator = torch.Generator().manual_seed(1)
    sizes, steps, clips, sigmas = [14, 4, 20], [5, 4, 5], [0.5, 1.0, 2.0], [0.8, 1.1, 0.6]
    data = [(torch.rand(n, 64, generator=generator), torch.randint(0, 10, (n,), generator=generator)) for n in sizes]
    plans = {k: _plan(k, n, t, c, s) for k, (n, t, c, s) in enumerate(zip(sizes, steps, clips, sigmas, strict=True))}
    seeds = [f"7:{k}" for k in range(len(sizes))]
    torch.manual_seed(0)
    start = {k: v.detach().clone() for k, v in build_model(model, 64, 10).state_dict().items()}

    batches = []  # every active client's batch size at every step of the worker's stack (not the trainers')
    step = stack.ClientStack.step
    monkeypatch.setattr(
        stack.ClientStack,
        "step",
        lambda self, state, inputs, *rest, **options: (
            (self.stacked and batches.extend(inputs.valid.sum(1)[inputs.active].tolist()))
            or step(self, state, inputs, *rest, **options)
        ),
    )
    worker = LocalWorker(
        [
            WorkerClient(k, x.numpy(), y.numpy(), x[:1].numpy(), y[:1].numpy(), seeds[k])
            for k, (x, y) in enumerate(data)
        ],
        model,
        64,
        10,
        device=compute_device.type,
    )
    worker.stack.split, worker.stack.STACK_CLIENTS, worker.stack.SPLIT_PRODUCTS = True, stack_clients, 0
    worker.add_plans(plans)
    states: dict[int, dict[str, Any] | None] = dict.fromkeys(plans)
    expected = {k: dict(start) for k in plans}
    global_state = start
    for server_round in (1, 2):
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # cuDNN's default TF32 has a 10-bit mantissa
            result = worker.train(global_state, server_round, [RoundRequest(k, states[k]) for k in plans], False)
        for k, (x, y) in enumerate(data):
            reference = build_model(model, 64, 10)
            reference.load_state_dict(global_state)
            trainer = DPTrainer(
                reference, plans[k], x, y, seed=seeds[k], state={"step": plans[k].first_step_of_round(server_round)}
            )
            trainer.run_round(server_round)
            expected[k] = reference.state_dict()
            for key, stacked in zip(global_state, result.weights, strict=True):
                torch.testing.assert_close(stacked[k], expected[k][key], rtol=1e-4, atol=1e-6)
            assert result.states[k]["step"] == trainer.step
            states[k] = result.states[k]
        global_state = {key: stacked[0].clone() for key, stacked in zip(global_state, result.weights, strict=True)}
    assert 0 in batches and len(set(batches)) >= 3, batches  # an empty batch, and batches of several sizes
    assert len(batches) == sum(steps)


def test_workers_share_the_gpus_evenly_and_fit_at_once():
    from sims.fast.pool import gpu_share

    assert gpu_share(1, 1) == gpu_share(2, 4) == 1.0  # a whole GPU each while there are enough
    assert gpu_share(4, 1) == 0.25 and gpu_share(3, 2) == 0.5  # several per GPU: three on two, half each
    assert gpu_share(5, 2) == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"device": "gpu"}, "device"),
        ({"device": "cpu", "gpus_per_worker": 0.5}, "worker-gpus"),
        ({"gpus_per_worker": 1.5}, "worker-gpus"),
        pytest.param(
            {"device": "cuda"},
            "device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: cuda is a valid choice"),
        ),
    ],
)
def test_a_device_that_cannot_run_is_refused_by_name_before_anything_is_written(in_process, tmp_path, options, field):
    with pytest.raises(InputError) as refused:
        run_fast({**in_process.defaults(), "results-dir": str(tmp_path / "fast")}, 2, say=lambda _: None, **options)
    assert refused.value.field == field
    assert not (tmp_path / "fast").exists()


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_the_device_is_chosen_by_name_and_recorded(in_process, tmp_path, device):
    """`device="cpu"` trains on the CPU even where a GPU is visible, `auto` on a GPU where one is;
    the run says where it trained and config.json keeps that device."""
    lines: list[str] = []
    folder, _ = run_fast(
        {**in_process.defaults(), "num-server-rounds": 1, "results-dir": str(tmp_path / "r")},
        2,
        device=device,
        say=lines.append,
    )
    used = "cuda" if device == "auto" and torch.cuda.is_available() else "cpu"
    assert f"fast engine: 1 worker on {used}" in lines
    assert json.loads((folder / "config.json").read_text())["device"] == used


def test_the_sweep_takes_the_device_as_a_resource_and_refuses_an_unknown_one(tmp_path):
    from typer.testing import CliRunner

    from fedprivacy.cli import app
    from sims.sweep.spec import validate

    spec = validate(
        {"grid": {"epsilon": [1.0]}, "resources": {"device": "cpu", "workers": 2}}, base_dir=tmp_path, default_name="s"
    )
    assert (spec.resources.device, spec.resources.workers) == ("cpu", 2)
    refused = CliRunner().invoke(
        app, ["sweep", "--out", str(tmp_path / "s"), "--epsilons", "1", "--device", "gpu", "--dry-run"]
    )
    assert refused.exit_code != 0 and "resources.device='gpu'" in refused.output


@pytest.mark.parametrize(("model", "features", "block"), [("cnn", 64, 4), ("mlp", 15, 8), ("logreg", 15, None)])
def test_each_client_runs_at_its_own_batch_width_and_costly_models_in_smaller_stacks(model, features, block):
    """512 clients with Poisson batches: each client in a stack of the clients whose batch rounds up
    to the same width (a lone one as two copies of itself): for the digits CNN (83,200 multiply-adds
    per example) a multiple of 4, and on a CPU a width's clients cut into stacks of about 64; for
    the MLP (1,088) a multiple of 8, one stack per width; for logreg (30) a power of two."""
    from fedprivacy.models import build_model
    from fedprivacy.training import stack

    clients = stack.ClientStack(build_model(model, features, 2))
    sizes = torch.cat([torch.randint(12, 25, (511,), generator=torch.Generator().manual_seed(4)), torch.tensor([77])])
    valid = torch.arange(80) < sizes.unsqueeze(1)  # sampled rows first, as the worker gathers them
    found = clients._stacks(torch.zeros(512, 80, features), valid)
    assert clients.capture.example_products(torch.zeros(features)) == {"cnn": 83_200, "mlp": 1_088, "logreg": 30}[model]
    split = model == "cnn"
    members = torch.cat([part for part, _ in found])
    assert sorted(set(members.tolist())) == list(range(512)) and len(members) == 513  # client 511 twice
    for part, width in found:
        if block is None:
            own = 2 ** torch.log2(sizes[part].clamp(min=8)).ceil()
        else:
            own = torch.clamp(-(-sizes[part] // block), min=1) * block
        assert len(part) >= 2 and (own == width).all()
    widths = [width for _, width in found]
    assert (len(widths) > len(set(widths))) == split  # the CNN's widths of over 64 clients are cut
    assert max(len(part) for part, _ in found) <= (127 if split else 512)


def test_a_client_whose_batched_sums_overflow_is_redone_one_example_at_a_time(monkeypatch):
    """Injected fault: the stack's clipped sums come back non-finite for client 1 (as an overflow
    among finite per-example terms could make them); the step redoes that client one example at a
    time, releases the sum the trainer's clipper gives on its rows, and leaves the others' as they were."""

    from fedprivacy.models import build_model
    from fedprivacy.training import PerExampleClipper, stack

    torch.manual_seed(2)
    model = build_model("mlp", 15, 2)
    clients = stack.ClientStack(model)
    x, y = torch.randn(3, 6, 15), torch.randint(0, 2, (3, 6))
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2, [True] * 5 + [False]])
    step = stack.StepInputs(
        x,
        y,
        valid,
        torch.zeros(3, clients.noise_count + 1, dtype=torch.int64),
        torch.zeros(3, dtype=torch.float64),
        torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64),
        torch.ones(3),
        torch.ones(3, dtype=torch.bool),
    )
    shared = stack.clipped_sums

    def overflowing(*args, **options):
        result = shared(*args, **options)
        if result.grad_sums[0].shape[0] != 3:  # an example redone alone: no fault
            return result
        sums = [s.clone() for s in result.grad_sums]
        sums[0][1] = math.inf
        broken = torch.tensor([False, True, False])
        return result._replace(grad_sums=sums, broken=broken, all_finite=False)  # as the sums report it

    moved = torch.Generator().manual_seed(4)  # each client its own weights: the redo must use client 1's
    own = [v + 0.1 * torch.randn(3, *v.shape, generator=moved) for v in model.state_dict().values()]

    def released(fault: bool) -> list[torch.Tensor]:
        seen: list[list[torch.Tensor]] = []
        state = [v.clone() for v in own]
        with monkeypatch.context() as patch:
            if fault:
                patch.setattr(stack, "clipped_sums", overflowing)
            clients.step(state, step, lambda g: seen.append([t.clone() for t in g]) or torch.zeros(3))
        return seen[0]

    redone, clean = released(True), released(False)
    reference = build_model("mlp", 15, 2)  # the trainer's clipper, on client 1's rows and weights
    reference.load_state_dict(dict(zip(model.state_dict(), (v[1] for v in own), strict=True)))
    alone = PerExampleClipper(reference).clipped_sum(x[1][valid[1]], y[1][valid[1]], 1.0)
    for got, want, before in zip(redone, alone.grad_sums, clean, strict=True):
        torch.testing.assert_close(got[1], want, rtol=1e-5, atol=1e-7)  # qN = 1, no noise: the sum itself
        torch.testing.assert_close(got[[0, 2]], before[[0, 2]])


def test_padding_rows_hold_zeros_never_an_unsampled_record():
    """A step's batch is padded to the largest client's: the padding must not be a record (it was
    record 0), so that not even a model which mixes its batch can read a record that was not sampled."""
    from fedprivacy.training.steps import StackRows, _Batches

    x = torch.arange(1.0, 1.0 + 2 * 4 * 3).view(2, 4, 3)  # two clients, four rows, no row of zeros
    y = torch.arange(1, 9).view(2, 4)  # no label 0 either
    keep = torch.tensor([[False, True, False, True], [False, False, True, False]]).unsqueeze(1)  # one step
    data = StackRows.of(x, y, [4, 4])
    features, labels, valid = _Batches(keep, torch.tensor([0, 1]), data).gather(data, 0)
    assert valid.tolist() == [[True, True], [True, False]]
    assert torch.equal(features[0], x[0, [1, 3]]) and torch.equal(features[1, 0], x[1, 2])
    assert torch.equal(features[1, 1], torch.zeros(3)) and labels[1, 1] == 0
    assert labels[0].tolist() == [2, 4] and labels[1, 0] == 7


def _released_by_worker(model: str, sizes: list[int], gainer: int | None, gained: int = 0) -> torch.Tensor:
    """One round of clients with `sizes` rows (client `gainer` with `gained` records more) trained
    together by the engine's worker: every client's released parameters, flat [K, P]."""
    from sims.fast.worker import LocalWorker, RoundRequest, WorkerClient

    rows = [n + gained * (k == gainer) for k, n in enumerate(sizes)]
    data = []
    for k, n in enumerate(rows):  # each client's rows from its own generator: B's extra rows move no one else's
        generator = torch.Generator().manual_seed(k)
        data.append((torch.rand(n, 64, generator=generator), torch.randint(0, 10, (n,), generator=generator)))
    worker = LocalWorker(
        [
            WorkerClient(k, x.numpy(), y.numpy(), x[:1].numpy(), y[:1].numpy(), f"5:{k}")
            for k, (x, y) in enumerate(data)
        ],
        model,
        64,
        10,
    )
    worker.add_plans({k: _plan(k, n, 3, 1.0, 0.9) for k, n in enumerate(rows)})
    torch.manual_seed(0)
    start = build_model_state(model)
    result = worker.train(start, 1, [RoundRequest(k, None) for k in range(len(sizes))], False)
    return torch.cat([w.flatten(1) for w in result.weights], dim=1)


def build_model_state(model: str) -> dict[str, torch.Tensor]:
    from fedprivacy.models import build_model

    return build_model(model, 64, 10).state_dict()


@pytest.mark.parametrize("stack_clients", [64, 8])  # a stack per batch width; widths cut into stacks (CNN)
@pytest.mark.parametrize("model", ["logreg", "mlp", "cnn"])
def test_no_clients_release_depends_on_another_clients_data(model, stack_clients, monkeypatch):
    """Client B gains one record, or 400 (so its Poisson batches, and the step's largest batch,
    change): every other client's released parameters are the same bits, with one stack per batch
    width and with the CNN's widths cut into stacks of about 8 (B's batches move clients between
    stacks). Each client is computed at a width its own batch sets, so no rounding of another
    client's depends on B's data."""
    from fedprivacy.training import stack

    monkeypatch.setattr(stack.ClientStack, "STACK_CLIENTS", stack_clients)
    clients = 130
    sizes = [100 + 37 * (k % 5) for k in range(clients)]
    before = _released_by_worker(model, sizes, None)
    for gainer, gained in ((0, 1), (clients // 2, 400), (clients - 1, 1), (clients - 1, 400)):
        after = _released_by_worker(model, sizes, gainer, gained)
        others = torch.arange(clients) != gainer
        moved = torch.nonzero((after[others] != before[others]).any(1)).flatten().tolist()
        assert not moved, f"{len(moved)} other clients' releases moved when client {gainer} gained {gained} records"
        assert (after[gainer] != before[gainer]).any()  # B's own release did change
