"""Privacy maths, with no training or I/O: plan a client's DP-SGD and certify it.

Start with `plan_client(n, epsilon, delta, rule=...)`, which returns a `Plan` (σ, q, T, step
sizes, the certified ε by PLD and RDP, the conditions checked). The noise rules (the proactive
rule, σ calibrated by the accountant, Wu et al.'s ADP-SGD) are found by name with `find_rule`;
the classical rules of Abadi et al. 2016 and Dwork & Roth are in `classical`, and
`feasible_plans` is the DP calculator.
"""

from fedprivacy.privacy.accountants import NoiseEvent, pld_epsilon, rdp_epsilon
from fedprivacy.privacy.calculator import feasible_plans
from fedprivacy.privacy.plan import Condition, Plan
from fedprivacy.privacy.planner import compare_rules, plan_client
from fedprivacy.privacy.proactive import proactive_sigma
from fedprivacy.privacy.rules import RULE_NAMES, NoiseRule, find_rule

__all__ = [
    "RULE_NAMES",
    "Condition",
    "NoiseEvent",
    "NoiseRule",
    "Plan",
    "compare_rules",
    "feasible_plans",
    "find_rule",
    "pld_epsilon",
    "plan_client",
    "proactive_sigma",
    "rdp_epsilon",
]
