"""What one plan spends under each neighbour relation, without recalibrating it.

A plan's σ is calibrated (or, for the proactive rule, checked) for one relation: add/remove with
N public, what every run plans, or replace-one. The same noise (σ, q, T) spends another ε under the
other relation: replacing a record moves the clipped sum by up to 2C, so replace-one costs about
twice add/remove's ε. `fedprivacy plan` prints both, so a user reads "this plan spends X under
add/remove, Y under replace-one" instead of planning twice with two different σ.
"""

from __future__ import annotations

from fedprivacy.privacy import accountants
from fedprivacy.privacy.accountants import NoiseEvent
from fedprivacy.privacy.plan import Plan


def epsilon_by_neighbours(plan: Plan) -> dict[str, float]:
    """The plan's PLD ε under every relation (`accountants.NEIGHBOURS`), from its own noise segments;
    the entry for the plan's own relation is its certificate, `plan.epsilon_pld`."""
    events = [NoiseEvent(sigma, plan.sampling_rate, count) for sigma, count in plan.noise_segments]
    return {
        relation: plan.epsilon_pld
        if relation == plan.neighbours
        else accountants.pld_epsilon(events, plan.delta, neighbours=relation)
        for relation in accountants.NEIGHBOURS
    }
