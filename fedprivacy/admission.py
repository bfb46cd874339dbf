"""Whether a client may take part in a run: its ledger account opened (its budget pinned, a
deployed node's data file pinned beside it, a simulation's partitioning pinned per data set) and
the run's policy checked (no noise seed, list of epochs or raw diagnostics for a deployed client;
no seeded run on an account another run spent from)."""

from __future__ import annotations

import json
import logging

from fedprivacy.errors import ClientRefusal
from fedprivacy.identity import LocalClient
from fedprivacy.ledger import Budget, DataMismatch, Ledger
from fedprivacy.runconfig import RunSettings

logger = logging.getLogger(__name__)


def open_account(client: LocalClient, settings: RunSettings, ledger: Ledger, run_id: str) -> None:
    """Pin or check the client's budget in its ledger, and refuse runs that could reuse noise.

    - A deployed client refuses a noise seed and raw diagnostics (the run config is untrusted).
    - A simulation's partitioning is pinned per data set (accounts follow records).
    - A seeded simulation refuses a ledger account that other runs spent from: the same seed
      would draw the same noise again, and the difference of two releases would cancel it.
    """
    refusal = open_accounts([client], settings, ledger, run_id)[client.account]
    if refusal is not None:
        raise refusal


def open_accounts(
    clients: list[LocalClient], settings: RunSettings, ledger: Ledger, run_id: str
) -> dict[str, ClientRefusal | None]:
    """`open_account` for many clients of one ledger at once (a batched engine's round): each
    account gets its refusal, or None."""
    refusals: dict[str, ClientRefusal | None] = {c.account: _policy_refusal(c, settings) for c in clients}
    for client in clients:
        if refusals[client.account] is None and client.data_digest:  # before the budget: it may adopt an old account
            try:
                ledger.pin_data(client.account, client.data_digest, legacy_account=f"data:{client.data_digest}")
            except DataMismatch as mismatch:  # what changed is a function of the records: it stays here
                logger.warning("client %s: %s", client.client_id, mismatch)
                refusals[client.account] = ClientRefusal(
                    f"client {client.client_id}: its ledger refused its data file for account {client.account}; "
                    "the reason and the operator's remedy are in the SuperNode's log"
                )
    opening = [c for c in clients if refusals[c.account] is None]
    pinned = ledger.open_accounts({c.account: Budget(c.epsilon, c.delta) for c in opening})
    for client in opening:
        if isinstance(pinned[client.account], ClientRefusal):
            refusals[client.account] = pinned[client.account]
    for dataset_id, partitioning in {
        (c.dataset_id, json.dumps(c.partitioning, sort_keys=True)) for c in opening if c.partitioning
    }:
        try:
            ledger.pin_partitioning(dataset_id, json.loads(partitioning))
        except ClientRefusal as refusal:
            for client in opening:
                if client.dataset_id == dataset_id:
                    refusals[client.account] = refusal
    if settings.noise_seed >= 0:
        runs = ledger.runs_of([c.account for c in opening])
        for client in opening:
            if refusals[client.account] is None and runs.get(client.account, set()) - {run_id}:
                refusals[client.account] = ClientRefusal(
                    f"noise-seed={settings.noise_seed} on ledger {client.ledger_path}, where client {client.client_id} "
                    "already spent in another run: a fixed seed would repeat that run's noise. Use a fresh ledger-path "
                    "or noise-seed=-1"
                )
    return refusals


def _policy_refusal(client: LocalClient, settings: RunSettings) -> ClientRefusal | None:
    if client.deployed and settings.noise_seed >= 0:
        return ClientRefusal(
            f"noise-seed={settings.noise_seed}: a deployed client draws its noise from OS entropy "
            "and never accepts a seed (seeds are for simulations)"
        )
    if client.deployed and settings.client_epochs:
        return ClientRefusal(
            f"client-epochs={','.join(f'{k:g}' for k in settings.client_epochs)}: a deployed client has no "
            "place in a list of simulated clients; give every client the same epochs instead"
        )
    if client.deployed and settings.diagnostics:
        return ClientRefusal(
            "diagnostics=true: raw training statistics are not private; a deployed client never returns them"
        )
    return None


def client_noise_seed(settings: RunSettings, account: str) -> str | None:
    """A simulated client's seed material (clients never share noise); None = OS entropy every step."""
    if settings.noise_seed < 0:
        return None
    return f"{settings.noise_seed}:{account}"
