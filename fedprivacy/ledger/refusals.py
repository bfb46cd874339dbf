"""What the ledger refuses, as the exceptions its callers catch (most reach the server as a refusal)."""

from __future__ import annotations

from fedprivacy.errors import ClientRefusal


class BudgetExceeded(RuntimeError):
    """Recording these steps would push the account's ε above its budget."""


class BudgetMismatch(ClientRefusal):
    """A request to train under another (ε, δ) than the one pinned for the account."""


class RoundRepeated(ClientRefusal):
    """A (run, round) that the account has already released an update for."""


class DataMismatch(ClientRefusal):
    """A deployed account's data file is not the one it was opened on, or its data is another account's."""


class PartitioningMismatch(ClientRefusal):
    """A simulation asks for accounts of a data set that this ledger knows under another partitioning."""
