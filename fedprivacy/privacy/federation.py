"""The federation's plan: client-level DP planned a priori, as DP-FedAvg (McMahan et al. 2018,
"Learning differentially private recurrent language models").

Each round the server samples every member with probability p (Poisson), clips each sampled
member's update to norm S, adds N(0, σ²S²) to the sum and divides by the expected cohort pM. Read
with members in place of records and rounds in place of steps, this is the mechanism a client's
DP-SGD plan certifies (one step per round, q = p, N = M, C = S), so the same planner, rules,
conditions and certificate (PLD, RDP beside it) plan it: the proactive rule gives σ from ε_fed and
δ_fed alone, its conditions are checked on M, the rounds and the participations per member k = pR.
The guarantee is about whether a member took part at all, against whoever sees the aggregated
models; the server that adds the noise sees the updates (a member's records stay protected from it
by the member's own record-level plan).
"""

from __future__ import annotations

from fedprivacy import errors
from fedprivacy.errors import InputError, PlanRefused
from fedprivacy.privacy import limits
from fedprivacy.privacy.accountants import ADD_REMOVE
from fedprivacy.privacy.plan import Plan
from fedprivacy.privacy.planner import plan_client

FEDERATION_ID = "federation"
RELEASED_AGGREGATE = (
    "each round: members Poisson-sampled with rate p, updates clipped to S, summed, Gaussian noise σS "
    "added, divided by the expected cohort pM (DP-FedAvg, McMahan et al. 2018)"
)


def plan_federation(
    members: int,
    epsilon: float,
    delta: float,
    rounds: int,
    *,
    rule: str = "proactive",
    update_clip: float = 1.0,
    participations: float | None = None,
    participation_rate: float | None = None,
    expected_cohort: float | None = None,
    compare: bool = True,
) -> Plan:
    """The federation's certified plan for `rounds` rounds over `members` members: one noisy
    aggregation per round. Give at most one of the participations per member k = pR, the rate p,
    or the expected cohort pM; with none, k is the smallest the proactive ln M condition allows.
    Neighbouring federations differ in one member's contribution being there or not, the roster of
    M public (zero-out; for the Poisson-sampled Gaussian its accounting is add/remove's)."""
    if rule == "adp":
        raise InputError(
            "rule", rule, "ADP-SGD's noise schedule follows a local step size; plan the federation with another rule"
        )
    options = {"epochs": participations, "sampling-rate": participation_rate, "batch-size": expected_cohort}
    given = [(name, v) for name, v in options.items() if v is not None]
    if len(given) > 1:
        raise InputError(
            given[1][0],
            given[1][1],
            f"give one of epochs (participations per member), sampling-rate or batch-size (expected cohort), "
            f"not also {given[0][0]}",
        )
    members = limits.records("n", members)
    rounds = errors.integer_at_least("rounds", rounds, 1)
    if not 0 < delta < 1 / members:
        raise InputError(
            "delta",
            delta,
            f"must be in (0, 1/M) = (0, {1 / members:.3g}) for M = {members} members: a δ ≥ 1/M allows "
            "releasing one member's update outright",
        )
    if expected_cohort is not None and not 1 <= expected_cohort <= members:
        raise InputError(
            "batch-size",
            expected_cohort,
            f"the expected cohort pM must be in [1, M] = [1, {members}] members per round",
        )
    if participations is not None and not 0 < participations <= rounds:
        raise InputError(
            "epochs",
            participations,
            f"participations per member k = pR must be in (0, R] = (0, {rounds}]: a member takes part at most "
            "once a round",
        )
    try:
        return plan_client(
            members,
            epsilon,
            delta,
            rule=rule,
            clip_norm=update_clip,
            epochs=participations,
            sampling_rate=participation_rate,
            expected_batch_size=expected_cohort,
            steps=rounds,
            rounds=rounds,
            client_id=FEDERATION_ID,
            compare=compare,
            neighbours=ADD_REMOVE,
        )
    except PlanRefused as refused:
        raise PlanRefused(
            f"the federation's plan: {str(refused).removeprefix(f'client {FEDERATION_ID}: ')}".replace(
                "T=", "rounds="
            ).replace("change the epochs", "choose a smaller cohort or fewer rounds")
        ) from None
