"""The privacy ledger: a durable record of every noisy step a client has released.

Privacy loss composes across rounds, restarts and runs, so the ledger lives in a SQLite file and
is keyed by an *account* (one client's records), not by the run. Each recorded spend is a group
of Poisson-subsampled Gaussian steps (σ, q, count); the ε spent is the PLD composition of all of
them at the account's δ, never a sum of per-round ε.

The budget belongs to the data owner, so the ledger, not the caller, holds it:
- an account's (ε, δ) is pinned on first use; training under any other value is refused, and
  changing it is a deliberate act of the node operator (`fedprivacy ledger set-budget`);
- a (run, round) is recorded at most once per account: a repeated round would release a second
  update on the same records that nobody planned;
- a spend is written in one IMMEDIATE transaction that re-checks all of this, so two writers (a
  restarted client, two SuperNodes on one file) can never overshoot the budget;
- in a simulation, the partitioning that decides which rows an account holds is pinned per data
  set, so a ledger reused under another seed or scheme cannot move records to a fresh account;
- in a deployment, an account is the node's declared client-id and its data file's digest is
  pinned beside it: a changed file under the account, or the same file under another account,
  is refused until the operator says otherwise (`fedprivacy ledger accept-data`).

The file is created readable by its owner only (0600): it tells how much each data set has spent.
This package never imports flwr: the ClientApp calls it, tests drive it directly.

Modules: `ledger` (the `Ledger` class, which enforces the rules above), `storage` (the file and
this process's connection to it), `schema` (the layout and its migrations), `queries` and `writes`
(reading and writing spends), `pins` (data files and partitionings), `composition` (the ε of a
history, and its caches), `rounds` (the noise events of a plan's round), `accounts` and
`refusals` (what the ledger answers), `sql` (helpers they share).
"""

from fedprivacy.ledger.accounts import AccountSummary, Budget
from fedprivacy.ledger.composition import composed_epsilon
from fedprivacy.ledger.ledger import Ledger, Outcome, RoundDecision
from fedprivacy.ledger.refusals import (
    BudgetExceeded,
    BudgetMismatch,
    DataMismatch,
    PartitioningMismatch,
    RoundRepeated,
)
from fedprivacy.ledger.rounds import NoiseSchedule, noise_schedule, round_events
from fedprivacy.ledger.schema import SCHEMA, SCHEMA_VERSION

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "AccountSummary",
    "Budget",
    "BudgetExceeded",
    "BudgetMismatch",
    "DataMismatch",
    "Ledger",
    "NoiseSchedule",
    "Outcome",
    "PartitioningMismatch",
    "RoundDecision",
    "RoundRepeated",
    "composed_epsilon",
    "noise_schedule",
    "round_events",
]
