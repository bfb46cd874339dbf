"""An empirical privacy audit of the DP-SGD release: what an attacker could measure, with bounds.

Three measurements, on the real trainer (`DPTrainer`) and on the fast engine's batched worker,
both with production noise (fresh OS keys):

- **noise per parameter**: with every record sampled (q = 1), N·released − (clean clipped sum) is
  the noise; its standard deviation on every coordinate must be σC.
- **canary membership** (in the style of Jagielski et al. 2020 and Nasr et al. 2021): one step is
  trained on a data set with or without a canary record whose clipped gradient points in a known
  direction (add/remove neighbours), or on two data sets of the same size whose last record is
  the canary or its mirror image (replace-one neighbours: sensitivity 2C, judged against the
  replace-one certificate, `replace_one_epsilon`); the attacker scores each release by its
  projection on that direction and guesses "canary in" above a threshold. The threshold is
  chosen on one half of the trials and judged on
  the other (picked by its bound at a stricter confidence, `PICK_CONFIDENCE`); Clopper–Pearson
  bounds on its false-positive and false-negative rates, each at 1 − (1 − c)/2 so that both hold
  together with confidence c (the union bound), turn into a lower bound on ε that holds with
  confidence c: ε_lb = ln((1 − δ − FNR⁺)/FPR⁺), the best of both directions. A correct mechanism
  keeps ε_lb ≤ the certified ε; a broken one (noise ÷ 3) must be caught.
- **non-finite releases**: a crafted finite global model that overflows only on the canary must not
  make the release non-finite more often with the canary than without.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import dp_accounting
import numpy as np
import torch
from scipy import stats
from torch import nn

from fedprivacy.models import build_model
from fedprivacy.privacy.plan import Plan
from fedprivacy.privacy.planner import plan_client
from fedprivacy.training import DPTrainer

NUM_FEATURES = 4
CLIP = 1.0


@dataclass(frozen=True)
class AuditBound:
    """ε_lb with the rates it came from (upper bounds that hold together with `confidence`)."""

    epsilon_lower_bound: float
    threshold: float
    false_positive_upper: float
    false_negative_upper: float
    trials_per_side: int
    confidence: float


def one_step_plan(epsilon: float, delta: float, n: int) -> Plan:
    """A certified one-step, full-batch plan (q = 1, T = 1): the Gaussian mechanism on the clipped sum."""
    return plan_client(
        n,
        epsilon,
        delta,
        rule="calibrated",
        sampling_rate=1.0,
        steps=1,
        clip_norm=CLIP,
        learning_rate=1.0,
        compare=False,
    )


def weakened(plan: Plan, factor: float) -> Plan:
    """The negative control: the same plan and certificate, with the trainer's noise divided by `factor`."""
    return dataclasses.replace(plan, noise_segments=tuple((s / factor, c) for s, c in plan.noise_segments))


def audit_data(n: int, canary: bool, neighbours: str = "add-remove") -> tuple[torch.Tensor, torch.Tensor]:
    """n − 1 ordinary records (zero features) and, last, the canary or, without it, one more
    ordinary record (add/remove: the mechanism cannot tell an absent record from a zero one) or
    the canary's mirror image (replace-one: feature 0 at −100 instead of +100, the same N).

    From a zero model every ordinary record's weight gradient is zero, so the canary's clipped
    gradient (norm C, on the weights of feature 0) is the only signal in that direction.
    """
    x = torch.zeros(n, NUM_FEATURES)
    y = torch.zeros(n, dtype=torch.long)
    if canary:
        x[-1, 0] = 100.0
    elif neighbours == "replace-one":
        x[-1, 0] = -100.0
    return x, y


def replace_one_epsilon(plan: Plan) -> float:
    """The plan's ε under replace-one neighbours (dp-accounting's PLD accountant, REPLACE_ONE): what
    a release certifies when N is not public. The plans here are certified for add/remove."""
    accountant = dp_accounting.pld.PLDAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    for sigma, count in plan.noise_segments:
        step: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(sigma)
        if plan.sampling_rate < 1.0:
            step = dp_accounting.PoissonSampledDpEvent(plan.sampling_rate, step)
        accountant.compose(dp_accounting.SelfComposedDpEvent(step, count))
    return float(accountant.get_epsilon(plan.delta))


def zero_logreg() -> nn.Module:
    model = build_model("logreg", NUM_FEATURES, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def canary_direction() -> torch.Tensor:
    """The canary's gradient direction on (weight, bias), flattened: feature 0 of both classes."""
    direction = torch.zeros(2, NUM_FEATURES + 1)
    direction[0, 0], direction[1, 0] = -1.0, 1.0  # softmax − one-hot for label 0 at zero logits
    return direction[:, :NUM_FEATURES].flatten() / math.sqrt(2)


@contextmanager
def one_thread() -> Iterator[None]:
    """Tiny one-step trials: torch's thread pool only adds synchronisation (20× slower on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@one_thread()
def released_updates(
    plan: Plan,
    x: torch.Tensor,
    y: torch.Tensor,
    trials: int,
    model: Callable[[], nn.Module] = zero_logreg,
    engine: str = "trainer",
) -> torch.Tensor:
    """`trials` independent one-step releases (θ_before − θ_after)/η, as rows (weights then bias),
    by the trainer (`DPTrainer`, one trial after another) or by the fast engine's worker (all trials
    at once, as that many clients holding the same data, each with its own fresh noise)."""
    initial = model()
    start = {k: v.clone() for k, v in initial.state_dict().items()}
    before = torch.cat([p.flatten() for p in start.values()])
    if engine == "fast":
        return (before - _fast_releases(plan, x, y, trials, start)) / plan.learning_rate
    trainer = DPTrainer(initial, plan, x, y)
    rows = []
    for _ in range(trials):
        initial.load_state_dict(start)
        trainer.load_state_dict({"step": 0})
        trainer.run_steps(1)
        rows.append((before - torch.cat([p.detach().flatten() for p in initial.parameters()])) / plan.learning_rate)
    return torch.stack(rows)


def _fast_releases(
    plan: Plan, x: torch.Tensor, y: torch.Tensor, trials: int, start: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The weights after one round of `trials` fast-engine clients, flattened per client."""
    from sims.fast.worker import LocalWorker, RoundRequest, WorkerClient

    clients = [WorkerClient(i, x.numpy(), y.numpy(), x[:1].numpy(), y[:1].numpy(), None) for i in range(trials)]
    worker = LocalWorker(clients, "logreg", NUM_FEATURES, 2)
    worker.add_plans(dict.fromkeys(range(trials), plan))
    result = worker.train(start, 1, [RoundRequest(i, None) for i in range(trials)], diagnostics=False)
    return torch.cat([w.flatten(1) for w in result.weights], dim=1)


def canary_scores(
    plan: Plan, trials: int, canary: bool, engine: str = "trainer", neighbours: str = "add-remove"
) -> np.ndarray:
    """The attacker's score of each release: its projection on the canary's direction."""
    x, y = audit_data(plan.n, canary, neighbours)
    updates = released_updates(plan, x, y, trials, engine=engine)[:, : 2 * NUM_FEATURES]
    return (updates @ canary_direction()).numpy() * plan.expected_batch_size


def _upper(successes: int, trials: int, confidence: float) -> float:
    """One-sided Clopper–Pearson upper bound on a rate (scipy's exact binomial interval)."""
    return stats.binomtest(successes, trials).proportion_ci(2 * confidence - 1, method="exact").high


def _epsilon(fpr: float, fnr: float, delta: float) -> float:
    """ln((1 − δ − FNR)/FPR) and the mirrored test, the larger; −inf when neither is informative."""
    best = -math.inf
    for a, b in ((fpr, fnr), (fnr, fpr)):
        if a > 0 and 1 - delta - b > 0:
            best = max(best, math.log((1 - delta - b) / a))
    return best


# The threshold is picked on the first halves by its bound at this stricter confidence. Picked at
# the judging confidence, the best of the 197 candidates was often one whose few tail counts were
# lucky on the first half and not on the second (a winner's curse): over 100 audits of one ε = 3
# plan (fast engine, 4,000 releases per side, each rate judged at 95%), 3 lower bounds were ≤ 0.5
# around a median of 1.11; picked at 0.999, the smallest was 0.78 (median 1.12), and with each rate
# judged at 97.5% as now, 0.69 (median 1.05). The attack kept its teeth: over 100 audits of that
# plan with its noise divided by 3, the smallest bound was 3.17 picked at 0.999 against 3.20 picked
# at 95%, and over another 100, 3.14 as now (the certificate: 3.00). The bound stays valid at
# `confidence`: the second halves, which it is computed from, play no part in the pick.
PICK_CONFIDENCE = 0.999


def epsilon_lower_bound(
    scores_out: np.ndarray, scores_in: np.ndarray, delta: float, confidence: float = 0.95
) -> AuditBound:
    """ε_lb from scores without and with the canary: threshold from the first halves, rates from the
    second, each bounded at 1 − (1 − confidence)/2: ε_lb needs both bounds to hold at once."""
    half_out, half_in = len(scores_out) // 2, len(scores_in) // 2
    pick_out, judge_out = scores_out[:half_out], scores_out[half_out:]
    pick_in, judge_in = scores_in[:half_in], scores_in[half_in:]
    candidates = np.quantile(np.concatenate([pick_out, pick_in]), np.linspace(0.01, 0.99, 197))

    def bounded(threshold: float) -> float:  # as the second halves will be, more strictly (`PICK_CONFIDENCE`)
        fpr = _upper(int(np.sum(pick_out > threshold)), half_out, PICK_CONFIDENCE)
        fnr = _upper(int(np.sum(pick_in <= threshold)), half_in, PICK_CONFIDENCE)
        return _epsilon(fpr, fnr, delta)

    threshold = float(max(candidates, key=bounded))
    each = 1 - (1 - confidence) / 2
    fpr_up = _upper(int(np.sum(judge_out > threshold)), len(judge_out), each)
    fnr_up = _upper(int(np.sum(judge_in <= threshold)), len(judge_in), each)
    return AuditBound(max(0.0, _epsilon(fpr_up, fnr_up, delta)), threshold, fpr_up, fnr_up, len(judge_out), confidence)


def audit_canary(
    plan: Plan, trials: int, confidence: float = 0.95, engine: str = "trainer", neighbours: str = "add-remove"
) -> AuditBound:
    """Run the canary membership test on `plan` (trials per side) against `engine`, between
    add/remove or replace-one neighbours."""
    scores = [canary_scores(plan, trials, canary, engine, neighbours) for canary in (False, True)]
    return epsilon_lower_bound(*scores, plan.delta, confidence)


def noise_per_coordinate(plan: Plan, trials: int, engine: str = "trainer") -> np.ndarray:
    """N·release − clean clipped sum, per trial (rows) and coordinate (columns), on random data."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(plan.n, NUM_FEATURES, generator=generator)
    y = torch.randint(0, 2, (plan.n,), generator=generator)

    def random_logreg() -> nn.Module:
        torch.manual_seed(1)
        return build_model("logreg", NUM_FEATURES, 2)

    clean = released_updates(dataclasses.replace(plan, noise_segments=((0.0, 1),)), x, y, 1, random_logreg, engine)[0]
    noisy = released_updates(plan, x, y, trials, random_logreg, engine)
    return ((noisy - clean) * plan.expected_batch_size).numpy()


def crafted_overflow_model() -> nn.Module:
    """Finite weights (3·10³⁸ on features 0 and 1 of class 1) whose logit overflows only for a
    record holding both features."""
    model = zero_logreg()
    with torch.no_grad():
        model[1].weight[1, 0] = model[1].weight[1, 1] = 3e38
    return model


def nonfinite_release_rates(plan: Plan, trials: int, engine: str = "trainer") -> tuple[float, float]:
    """(rate without, rate with the overflow canary) of releases holding a NaN or an infinity."""
    rates = []
    for canary in (False, True):
        x, y = audit_data(plan.n, False)
        x[:, 2] = 1.0
        if canary:
            x[-1, 0] = x[-1, 1] = 1.0
        updates = released_updates(plan, x, y, trials, crafted_overflow_model, engine)
        rates.append(float((~torch.isfinite(updates)).any(dim=1).float().mean()))
    return rates[0], rates[1]
