"""What the ledger states about an account: its pinned budget, and its summary for the operator."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    """An account's pinned privacy budget (ε, δ): the data owner's, held by the ledger."""

    epsilon: float
    delta: float


@dataclass(frozen=True)
class AccountSummary:
    """One account as a node operator sees it."""

    account: str
    epsilon: float
    delta: float
    steps: int
    epsilon_spent: float
    runs: int
    last_spend: str | None

    @property
    def epsilon_left(self) -> float:
        return max(0.0, self.epsilon - self.epsilon_spent)
