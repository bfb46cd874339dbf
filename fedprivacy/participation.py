"""Who takes part in a round: the participation rules of every engine, written once.

The ServerApp's strategy (clients are node ids) and the fast engine (clients are partition
indices) both hold a `Participation` and ask it, every round, who trains and who evaluates, and
tell it what became of each train reply. With the same seed they therefore ask the same clients in
the same order.

The rules:
- a client trains unless it said it cannot afford a round (its budget is spent) or it is excluded:
  its replies were dropped in `MAX_CONSECUTIVE_FAILURES` rounds in a row (of the rounds it was
  asked in), or it gave no reply at all (a SuperNode that is gone comes back under a new node id).
  One dropped round alone is retried; a reply that passes the server's checks resets the count;
- of those, a seeded fraction is asked (`sample_clients`); one `random.Random(seed)` draws every
  round's train sample and then its evaluation sample, so the draws stay in step across engines;
  with client-level DP (`fedprivacy.client_level`) every member of the federation's roster (the
  clients of the first round) is instead Poisson-sampled at its plan's rate, and those of the
  sampled that are connected and may still train are asked; a client not on the roster is never
  asked to train (it is said once);
- every client may be asked to evaluate, out-of-budget ones included, except the excluded, those
  whose reply was dropped in this round, and those that release no evaluation (deployed clients);
- a round waits for `min_clients` connected clients.

Each outcome is recorded in the results folder (`RunRecorder`) and, where the caller passes a
logger, logged with the client's name: the strategy passes its own, which the ServerApp's console
prints; the fast engine reports through the results folder alone.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, Literal

from fedprivacy.privacy.plan import Plan
from fedprivacy.results import RunRecorder

if TYPE_CHECKING:  # torch is loaded by the engines that pass one
    from fedprivacy.client_level import ClientLevel

MAX_CONSECUTIVE_FAILURES = 3  # rounds in a row with a dropped reply before a client is not asked again

DropKind = Literal["error", "invalid", "no reply"]  # why a train reply was dropped


def sample_clients(rng: random.Random, eligible: Sequence[int], fraction: float) -> list[int]:
    """⌊fraction·len⌋ of `eligible` (at least one), sorted; none when there are none or fraction is 0."""
    if not eligible or fraction == 0.0:
        return []
    return sorted(rng.sample(list(eligible), max(1, int(len(eligible) * fraction))))


class Participation:
    """Which clients a run may still ask, and the seeded choice of each round's clients."""

    def __init__(
        self,
        recorder: RunRecorder,
        *,
        seed: int,
        fraction_train: float,
        fraction_evaluate: float,
        min_clients: int = 1,
        logger: logging.Logger | None = None,
        client_level: ClientLevel | None = None,
    ) -> None:
        self.recorder = recorder
        self.rng = random.Random(seed)
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.min_clients = min_clients
        self.logger = logger
        self.client_level = client_level
        self.exhausted: set[int] = set()  # said they cannot afford a round: never asked to train again
        self.excluded: set[int] = set()  # not asked again in this run
        self.failures: dict[int, int] = {}  # consecutive rounds with a dropped reply
        self.dropped_now: set[int] = set()  # dropped in the current round: not asked to evaluate
        self.evaluation_off: set[int] = set()  # release no evaluation: not asked to evaluate again
        self.off_roster: set[int] = set()  # joined after the federation's roster was fixed (said once)

    def enough(self, connected: Collection[int]) -> bool:
        """Whether `connected` clients are enough to start a round."""
        return len(connected) >= self.min_clients

    def eligible(self, clients: Sequence[int]) -> list[int]:
        """Those of `clients` that may still be asked to train, in their order."""
        gone = self.exhausted | self.excluded
        return [client for client in clients if client not in gone]

    def trainers(self, server_round: int, clients: Sequence[int]) -> list[int]:
        """Start `server_round`: the seeded sample of eligible `clients` asked to train (recorded)."""
        self.dropped_now = set()
        eligible = self.eligible(clients)
        if not eligible:
            self._log(
                logging.WARNING, "round %d: no client can still train (budgets spent or clients failed)", server_round
            )
        if self.client_level is None:
            chosen = sample_clients(self.rng, eligible, self.fraction_train)
        else:  # every member is drawn, so its chance depends on nothing else
            can = set(eligible)
            chosen = [client for client in self.client_level.sampled(server_round) if client in can]
            self._say_off_roster(clients)
        self._log(
            logging.INFO, "configure_train: sampled %d of %d clients that can still train", len(chosen), len(eligible)
        )
        if server_round == 1 and chosen:  # the wait a first run is silent in otherwise
            self._log(
                logging.INFO,
                "first round: each client plans its DP-SGD before it trains (and in a simulation its process "
                "starts now): the first round takes longer than the next",
            )
        self.recorder.sampled(server_round, len(chosen))
        return chosen

    def _say_off_roster(self, clients: Sequence[int]) -> None:
        """Log, once each, the clients that joined after the federation's roster was fixed."""
        assert self.client_level is not None
        late = set(clients) - set(self.client_level.roster) - self.off_roster
        if late:
            self.off_roster |= late
            self._log(
                logging.WARNING,
                "%d client(s) joined after the federation's plan was made for %d members: never asked to train",
                len(late),
                self.client_level.members,
            )

    def evaluators(self, clients: Sequence[int]) -> list[int]:
        """The seeded sample of `clients` asked to evaluate the round's model (after `trainers`)."""
        left_out = self.excluded | self.evaluation_off | self.dropped_now
        return sample_clients(self.rng, [c for c in clients if c not in left_out], self.fraction_evaluate)

    def replied(self, server_round: int, client: int, name: str, metrics: dict[str, Any], plan: Plan | None) -> None:
        """A train reply that passed the server's checks (it trained, or cannot afford the round):
        the client's failures start again from zero; one out of budget is not asked to train again."""
        self.failures[client] = 0
        self.recorder.trained(server_round, name, metrics, plan)
        if metrics["budget-exhausted"]:
            self.exhausted.add(client)
            self._log(
                logging.INFO, "client %s cannot afford round %d: budget spent, not sampled again", name, server_round
            )

    def dropped(self, server_round: int, client: int, name: str, outcome: DropKind, reason: str) -> None:
        """A train reply left out of the round (`reason` says why): the client is not asked to
        evaluate this round, and is excluded from the run if it gave no reply or failed too often."""
        self.dropped_now.add(client)
        self.failures[client] = self.failures.get(client, 0) + 1
        gone = outcome == "no reply" or self.failures[client] >= MAX_CONSECUTIVE_FAILURES
        if gone:
            self.excluded.add(client)
        self.recorder.dropped(server_round, name, outcome, reason, excluded=gone)
        self._log(
            logging.WARNING,
            "round %d: reply of client %s dropped (%s): %s%s",
            server_round,
            name,
            outcome,
            reason,
            "; not sampled again in this run" if gone else "",
        )

    def releases_no_evaluation(self, client: int) -> None:
        """The client keeps its test rows private (a deployed client): it is not asked to evaluate again."""
        self.evaluation_off.add(client)

    def _log(self, level: int, message: str, *args: Any) -> None:
        if self.logger is not None:
            self.logger.log(level, message, *args)
