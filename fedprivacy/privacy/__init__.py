"""Privacy maths, with no training or I/O: plan a client's DP-SGD and certify it.

Start with `plan_client(n, epsilon, delta, rule=...)`, which returns a `Plan` (σ, q, T, step
sizes, the certified ε by PLD and RDP, the conditions checked). The noise rules (the proactive
rule, σ calibrated by the accountant, Wu et al.'s ADP-SGD) are found by name with `find_rule`;
the classical rules of Abadi et al. 2016 and Dwork & Roth are in `classical`, and
`feasible_plans` is the DP calculator.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it. Loaded on first use (PEP 562), so that importing one module
# of this package (the plan, the limits) does not load dp-accounting and scipy: `fedprivacy --help`
# and the run config's parser need only names.
_EXPORTS = {
    "NoiseEvent": "accountants",
    "pld_epsilon": "accountants",
    "rdp_epsilon": "accountants",
    "feasible_plans": "calculator",
    "Condition": "plan",
    "Plan": "plan",
    "compare_rules": "planner",
    "plan_client": "planner",
    "proactive_sigma": "proactive",
    "RULE_NAMES": "rules",
    "NoiseRule": "rules",
    "find_rule": "rules",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
