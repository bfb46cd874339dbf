"""Each client's plan for a run: made once, a priori, from its own N, ε and δ and the run's public
settings, kept in its ledger (a restarted client resumes the same plan), and shared between clients
with the same inputs (one planning and certification)."""

from __future__ import annotations

import functools
from dataclasses import replace
from types import EllipsisType
from typing import Any

from fedprivacy.errors import ClientRefusal, InputError, PlanRefused
from fedprivacy.identity import LocalClient
from fedprivacy.ledger import Ledger
from fedprivacy.privacy.plan import Plan
from fedprivacy.privacy.planner import plan_client, with_rule_comparison
from fedprivacy.privacy.rules import find_rule
from fedprivacy.runconfig import RunSettings


def plan_from_settings(
    settings: RunSettings,
    num_examples: int,
    epsilon: float,
    delta: float,
    client_id: str,
    *,
    epochs: float | None | EllipsisType = ...,
    compare: bool = True,
) -> Plan:
    """The plan a client makes from the run config: one place, so the ClientApp, the engines and
    the baselines agree. Clients with the same inputs share one planning (and certification).

    `compare=False` leaves out the rule comparison (sheet content, about 0.25 s per distinct
    plan): the ClientApp computes it for its own plan, so that a deployment's clients share the
    work; one process simulating them all (the fast engine) or training without noise (the
    baselines) leaves it to the sheets. `epochs`: the client's own k, like `epsilon` and `delta`
    (`RunSettings.client_epochs_for`); omitted, the run config's `epochs`."""
    inputs = (
        num_examples,
        epsilon,
        delta,
        settings.rule,
        settings.clip_norm,
        settings.epochs if epochs is ... else epochs,
        settings.num_server_rounds,
        settings.learning_rate,
        settings.lr_schedule or None,
        (settings.lr_offset, settings.lr_decay),
    )
    try:
        return replace((_shared_compared_plan if compare else _shared_plan)(*inputs), client_id=client_id)
    except PlanRefused:
        return _plan(*inputs, client_id=client_id)  # raises again, naming this client


def _plan(
    n: int,
    epsilon: float,
    delta: float,
    rule: str,
    clip_norm: float,
    epochs: float | None,
    rounds: int,
    learning_rate: float,
    lr_schedule: str | None,
    inverse_sqrt: tuple[float, float],
    client_id: str = "",
) -> Plan:
    """`inverse_sqrt` = (a, c) of η_t = η/sqrt(a + c·t), used when the schedule is inverse_sqrt.
    Without the rule comparison (`plan_from_settings` adds it)."""
    schedule = lr_schedule or find_rule(rule).default_schedules(None)[0]
    lr_params = {"a": inverse_sqrt[0], "c": inverse_sqrt[1]} if schedule == "inverse_sqrt" else None
    return plan_client(
        n,
        epsilon,
        delta,
        rule=rule,
        clip_norm=clip_norm,
        epochs=epochs,
        rounds=rounds,
        client_id=client_id,
        learning_rate=learning_rate,
        lr_schedule=lr_schedule,
        lr_params=lr_params,
        compare=False,
    )


_shared_plan = functools.lru_cache(maxsize=4096)(_plan)


@functools.lru_cache(maxsize=4096)
def _shared_compared_plan(*inputs: Any) -> Plan:
    return with_rule_comparison(_shared_plan(*inputs))


def run_plan(client: LocalClient, settings: RunSettings, ledger: Ledger, run_id: str) -> tuple[Plan, bool]:
    """(the client's plan for this run, whether it was made now). Made once, a priori, then kept."""
    saved = ledger.load_plan(client.account, run_id)
    if saved is not None:
        return saved, False
    outcome = run_plans([client], settings, ledger, run_id)[client.account]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome, True


def run_plans(
    clients: list[LocalClient], settings: RunSettings, ledger: Ledger, run_id: str, *, compare: bool = True
) -> dict[str, Plan | Exception]:
    """Each client's plan for this run: the one saved in the ledger, or a new a-priori plan saved
    now (all in one transaction); a client that cannot plan gets its error instead. `compare`: as
    in `plan_from_settings`."""
    outcomes: dict[str, Plan | Exception] = dict(ledger.load_plans([c.account for c in clients], run_id))
    fresh: dict[str, Plan] = {}
    for client in clients:
        if client.account in outcomes:
            continue
        try:
            fresh[client.account] = _new_plan(client, settings, compare)
        except (ClientRefusal, InputError, PlanRefused) as error:
            outcomes[client.account] = error
    if fresh:  # if a restarted twin saved its plan first, both follow that one
        outcomes.update(ledger.save_plans(run_id, fresh))
    return outcomes


def _new_plan(client: LocalClient, settings: RunSettings, compare: bool) -> Plan:
    """A new plan. A deployed client's planning inputs are public (its declared size, its budget,
    the run config), so the planner's refusal leaves it with its text, as a `ClientRefusal`."""
    try:
        plan = plan_from_settings(
            settings,
            client.planning_size,
            client.epsilon,
            client.delta,
            client.client_id,
            epochs=client.epochs,
            compare=compare,
        )
    except InputError as error:
        if not client.deployed:
            raise
        raise ClientRefusal(f"client {client.client_id}: {error}") from None
    if plan.expected_batch_size < 1:
        raise ClientRefusal(
            f"num-examples={client.planning_size}: too little data for client {client.client_id}: its plan "
            f"samples q·N = {plan.expected_batch_size:.2f} < 1 record per step, so most steps would train on nothing"
        )
    return plan
