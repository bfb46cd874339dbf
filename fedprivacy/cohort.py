"""One round of a cohort of clients, without Flower: the ClientApp's one client (K = 1, a
deployed node or a simulated one) and the fast engine's round of K clients run this same code.

For every member: its plan's noise events for the round (none left: out of budget), the ledger's
decision (a round already trained is refused; a round the budget cannot afford is not trained),
training of the members the ledger affords, the spends recorded before any update is returned,
and every member's reply (public values only: `fedprivacy.protocol`). How the training is done is
the caller's: the trainer on one model, or the fast engine's workers.

Two orders, one rule (no update leaves before its spend is durable):
- `while_recording=False` (the ClientApp): the ledger is asked whether the round is affordable,
  the members train, then each one's spend is recorded; a member whose spend is refused then
  (another writer spent the budget meanwhile) is out of budget and its update is dropped. The
  ledger is not locked while training, so the clients of a `flwr run` simulation, which share one
  ledger file, train in parallel.
- `while_recording=True` (the fast engine, whose ledger no one else writes during a round): the
  spends are decided and written in one transaction that commits while the members train
  (`Ledger.record_round_while`); the round's results are returned only once it is durable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedprivacy.identity import LocalClient
from fedprivacy.ledger import BudgetExceeded, Ledger, RoundDecision, RoundRepeated, composed_epsilon, round_events
from fedprivacy.privacy.accountants import NoiseEvent
from fedprivacy.privacy.plan import Plan
from fedprivacy.protocol import reply_constants, reply_metrics

if TYPE_CHECKING:  # the ledger's CLI reads no torch
    from torch import Tensor


@dataclass
class Member:
    """One client of a cohort across a run: who it is, its plan, and what it carries between rounds."""

    local: LocalClient
    plan: Plan
    trainer_state: dict[str, Any] | None = None  # the trainer's state after its last round (opaque here)
    reply: dict[str, Any] | None = field(default=None, repr=False)  # its replies' constant metrics, built once

    @property
    def account(self) -> str:
        return self.local.account


@dataclass
class TrainedRows:
    """What training a cohort's affordable members gives back, one row per member in order: the
    trainer's K-indexed result, from the ClientApp's one client as from the fast engine's workers."""

    weights: list[Tensor]  # [K, *shape] per trained parameter, in the trainer's order: all a member releases
    states: list[dict[str, Any]]  # each member's trainer state for its next round
    diagnostics: list[dict[str, int | float]]  # each member's raw statistics ({} unless asked for)
    on_gpu: bool = False
    indices: list[int] = field(default_factory=list)  # the fast engine's client indices (its workers' rows)


@dataclass
class CohortRound:
    """A cohort's round: the members whose updates may leave (`trained`, with their row in
    `result`), every other member's reply or refusal, and the training's own result."""

    trained: list[tuple[Member, int]]
    replies: dict[str, dict[str, Any]]  # by account: every member that trained or could not afford the round
    refused: dict[str, Exception]  # by account: a round already trained, which the member must not answer
    result: TrainedRows | None


def cohort_round(
    members: Sequence[Member],
    ledger: Ledger,
    run_id: str,
    server_round: int,
    train: Callable[[list[Member]], TrainedRows],
    *,
    while_recording: bool,
    diagnostics: bool = False,
) -> CohortRound:
    """Round `server_round` of run `run_id` for `members` (one ledger account each): `train(those
    the ledger affords)` trains them and returns their rows in that order; see the module's
    docstring for the two orders. A member's trainer state and cached reply are updated in place."""
    spends: dict[str, tuple[NoiseEvent, ...]] = {}
    asked: list[Member] = []
    exhausted: list[Member] = []
    events_of: dict[int, tuple[NoiseEvent, ...]] = {}  # plans are shared by clients with equal inputs
    for member in members:
        events = events_of.get(id(member.plan))
        if events is None:
            events = events_of[id(member.plan)] = round_events(member.plan, server_round)
        if events:
            spends[member.account] = events
            asked.append(member)
        else:  # its plan has no steps left
            exhausted.append(member)
    if while_recording:
        outcomes, ran = ledger.record_round_while(
            run_id, server_round, spends, lambda decision: _train_recorded(asked, decision, train, diagnostics)
        )
        assert ran is not None
        trained, result, replies = ran
    else:
        outcomes, trained, result, replies = _train_then_record(
            asked, spends, ledger, run_id, server_round, train, diagnostics
        )
    refused: dict[str, Exception] = {}
    for member in asked:
        outcome = outcomes[member.account]
        if isinstance(outcome, BudgetExceeded):
            exhausted.append(member)
        elif isinstance(outcome, Exception):
            refused[member.account] = outcome
    replies.update(_exhausted_replies(exhausted, ledger))
    return CohortRound(trained, replies, refused, result)


def _train_recorded(
    asked: list[Member], decision: RoundDecision, train: Callable[[list[Member]], TrainedRows], diagnostics: bool
) -> tuple[list[tuple[Member, int]], TrainedRows, dict[str, dict[str, Any]]]:
    """Inside the round's transaction: train the members whose spends it records, and their replies."""
    ready = [m for m in asked if isinstance(decision.outcomes[m.account], float)]
    trained = [(m, row) for row, m in enumerate(ready)]
    result = train(ready)
    return trained, result, _trained_replies(trained, result, decision.outcomes, decision.steps, diagnostics)


def _train_then_record(
    asked: list[Member],
    spends: dict[str, tuple[NoiseEvent, ...]],
    ledger: Ledger,
    run_id: str,
    server_round: int,
    train: Callable[[list[Member]], TrainedRows],
    diagnostics: bool,
) -> tuple[dict[str, Any], list[tuple[Member, int]], TrainedRows | None, dict[str, dict[str, Any]]]:
    """Ask the ledger, train the affordable members, then record each one's spend."""
    outcomes: dict[str, Any] = {}
    ready: list[Member] = []
    for member in asked:
        account = member.account
        if ledger.trained(account, run_id, server_round):
            outcomes[account] = RoundRepeated(
                f"round {server_round} of run {run_id} was already trained by client {member.local.client_id}"
            )
        elif ledger.epsilon_if(account, spends[account]) <= member.local.epsilon:
            ready.append(member)
        else:
            outcomes[account] = BudgetExceeded(f"client {member.local.client_id} cannot afford round {server_round}")
    if not ready:
        return outcomes, [], None, {}
    result = train(ready)
    trained: list[tuple[Member, int]] = []
    steps: dict[str, int] = {}
    for row, member in enumerate(ready):  # the ClientApp's one member: one transaction
        try:
            outcomes[member.account], steps[member.account] = ledger.record_with_steps(
                member.account, run_id, server_round, spends[member.account]
            )
        except (BudgetExceeded, RoundRepeated) as refusal:  # another writer spent or trained meanwhile
            outcomes[member.account] = refusal
        else:
            trained.append((member, row))
    return outcomes, trained, result, _trained_replies(trained, result, outcomes, steps, diagnostics)


def _trained_replies(
    trained: list[tuple[Member, int]],
    result: TrainedRows,
    spent: dict[str, Any],
    steps: dict[str, int],
    diagnostics: bool,
) -> dict[str, dict[str, Any]]:
    """The trained members' replies (ε spent and steps done as the ledger recorded them), their
    trainer states kept for their next round."""
    replies = {}
    for member, row in trained:
        member.trainer_state = result.states[row]
        if member.reply is None or member.reply["on-gpu"] != int(result.on_gpu):
            member.reply = reply_constants(member.local, member.plan, trained=True, on_gpu=result.on_gpu)
        replies[member.account] = {
            **member.reply,
            "epsilon-spent": spent[member.account],
            "steps-done": steps[member.account],
        }
        if diagnostics:
            replies[member.account].update(result.diagnostics[row])
    return replies


def _exhausted_replies(members: list[Member], ledger: Ledger) -> dict[str, dict[str, Any]]:
    """Replies of members that cannot afford the round: weight zero, with the ε their account has
    spent and its steps, read from the ledger (other runs' and writers' spends included)."""
    if not members:
        return {}
    histories = ledger.histories([m.account for m in members])
    replies = {}
    for member in members:
        history = histories.get(member.account, [])
        spent = composed_epsilon(history, member.local.delta)
        replies[member.account] = reply_metrics(
            member.local, member.plan, spent, sum(e.count for e in history), trained=False
        )
    return replies
