"""Privacy auditing in one training run (Steinke, Nasr and Jagielski 2023), group privacy, and the consistency check
between an audited lower bound and an accountant's upper bound.

One-run audit. ``m`` canaries are each included in the training data independently with probability 1/2. After
training, the auditor guesses "in" for some canaries and "out" for others and abstains on the rest; of its ``r``
guesses, ``v`` are correct. If the training is (eps, delta)-DP with respect to each canary, the number of correct
guesses W is stochastically dominated as follows (their main theorem, with its delta term):

    P[W >= v] <= P[W' >= v] + 2 m delta * max_{i = 1..v} P[v - i <= W' < v] / i,   W' ~ Binomial(r, e^eps / (1 + e^eps))

(at delta = 0 the second term vanishes: each guess is at most as good as eps-randomized response). The right-hand
side is a p-value for the hypothesis "(eps, delta)-DP"; ``one_run_epsilon`` returns the largest eps it rejects at
level ``alpha``, i.e. a lower bound on eps with confidence 1 - alpha. Guesses come from membership scores: the
``k_pos`` highest-scoring canaries are guessed "in", the ``k_neg`` lowest "out" (``one_run_audit``).

One-run audit in f-DP form (Mahloujifar, Melis and Chaudhuri, "Auditing f-differential privacy in one run",
ICML 2025). The same game and the same guesses, tested against a trade-off curve instead of (eps, delta): here the
Gaussian curve of mu-GDP (``mia.privacy.gdp``). A guessing rule that is right with probability x must, against a mu-GDP
training, be wrong with probability at least Phi(Phi^-1(x) - mu). Their recursion turns this into a test: with

    right_v = alpha v / m,   wrong_v = alpha (r - v) / m,   and for i = v - 1, ..., 0:
        wrong_i = max(wrong_{i+1}, Phi(Phi^-1(right_{i+1}) - mu)),
        right_i = right_{i+1} + i / (r - i) (wrong_i - wrong_{i+1}),

"mu-GDP" is rejected at level alpha when right_0 + wrong_0 > r / m (the guessing mass the rule would need exceeds
the r / m it has). ``one_run_fdp_mu`` is the largest mu so rejected; ``one_run_fdp_epsilon`` its epsilon at delta
(``gdp.gdp_epsilon``): the epsilon of the strongest Gaussian curve the guesses rule out. It is tighter than the
bound above, and a lower bound on epsilon for a training whose trade-off curve is Gaussian (DP-SGD's nearly is);
the bound above holds for every (eps, delta)-DP training.

Group privacy: a canary inserted r times is a group of r records; (eps, delta)-DP for one record gives
(r eps, r e^((r - 1) eps) delta)-DP for the group (``group_privacy``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Union

import numpy as np
from scipy.special import expit, ndtr, ndtri
from scipy.stats import binom

from .gdp import gdp_epsilon
from ..metrics import MetricError

BOUNDS = ("steinke", "fdp")  # one-run analyses: (eps, delta)-DP (Steinke et al.); Gaussian f-DP (Mahloujifar et al.)


class AuditViolation(RuntimeError):
    """An audited lower bound on epsilon exceeds the upper bound that the training claims: a bug in the attack's
    labels, in the bound, or in the private training or its accounting."""


# ----------------------------------------------------------------------------------------------- one-run p-value
def _check_counts(m: int, r: int, v: int) -> tuple:
    for name, x in (("m", m), ("r", r), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise MetricError(f"{name} must be an integer, got {x!r}")
    m, r, v = int(m), int(r), int(v)
    if not 0 <= v <= r <= m:
        raise MetricError(f"need 0 <= v (correct) <= r (guesses) <= m (canaries), got v={v}, r={r}, m={m}")
    return m, r, v


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P-value of "the training is (epsilon, delta)-DP" after ``v`` correct of ``r`` guesses on ``m`` canaries (the
    bound in the module docstring; capped at 1)."""
    m, r, v = _check_counts(m, r, v)
    if v == 0:
        return 1.0
    q = float(expit(epsilon))  # e^eps / (1 + e^eps): the accuracy of eps-randomized response
    tail = float(binom.sf(v - 1, r, q))  # P[W' >= v]
    if delta == 0:
        return min(tail, 1.0)
    i = np.arange(1, v + 1)
    below_v = binom.cdf(v - 1, r, q)
    window = below_v - binom.cdf(v - 1 - i, r, q)  # P[v - i <= W' <= v - 1]
    return float(min(tail + 2 * m * delta * float(np.max(window / i)), 1.0))


def one_run_epsilon(m: int, r: int, v: int, *, delta: float, alpha: float = 0.05, tol: float = 1e-9) -> float:
    """The largest epsilon whose (epsilon, delta)-DP hypothesis ``one_run_p_value`` rejects at level ``alpha``: a lower
    bound on epsilon with confidence 1 - alpha (0 when even epsilon = 0 is not rejected). Bisection to ``tol``."""
    m, r, v = _check_counts(m, r, v)
    if not (0 <= delta < 1):
        raise MetricError(f"delta must be in [0, 1), got {delta!r}")
    if not (0 < alpha < 1):
        raise MetricError(f"alpha (1 - confidence) must be in (0, 1), got {alpha!r}")

    def rejected(eps: float) -> bool:
        return one_run_p_value(m, r, v, eps, delta) <= alpha

    if not rejected(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while rejected(hi):
        lo, hi = hi, 2 * hi
        if hi > 1e4:  # every guess right and delta = 0 with huge r: p-value underflows; report the search's edge
            return lo
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rejected(mid) else (lo, mid)
    return lo


# ----------------------------------------------------------------------------------------------- f-DP form
def one_run_fdp_rejects(m: int, r: int, v: int, mu: float, alpha: float) -> bool:
    """Whether ``v`` correct of ``r`` guesses on ``m`` canaries reject "the training is mu-GDP" at level ``alpha``
    (the recursion in the module docstring)."""
    m, r, v = _check_counts(m, r, v)
    right, wrong = alpha * v / m, alpha * (r - v) / m
    for i in range(v - 1, -1, -1):
        forced = float(ndtr(ndtri(right) - mu))  # the least wrong mass a rule right with mass `right` must have
        if forced <= wrong:
            break  # wrong (and so right) stays as it is for every smaller i
        right = min(right + i / (r - i) * (forced - wrong), 1.0)
        wrong = forced
    return right + wrong > r / m


def one_run_fdp_mu(m: int, r: int, v: int, *, alpha: float = 0.05, tol: float = 1e-10) -> float:
    """The largest mu whose "mu-GDP" ``one_run_fdp_rejects`` rejects at level ``alpha``: a lower bound on the
    training's GDP parameter with confidence 1 - alpha (0 when even mu = 0 is not rejected). Bisection to ``tol``;
    rejection only gets harder as mu grows."""
    m, r, v = _check_counts(m, r, v)
    if not (0 < alpha < 1):
        raise MetricError(f"alpha (1 - confidence) must be in (0, 1), got {alpha!r}")
    if not one_run_fdp_rejects(m, r, v, 0.0, alpha):
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_fdp_rejects(m, r, v, hi, alpha):
        lo, hi = hi, 2 * hi
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if one_run_fdp_rejects(m, r, v, mid, alpha) else (lo, mid)
    return lo


def one_run_fdp_p_value(m: int, r: int, v: int, mu: float, *, rtol: float = 1e-3) -> float:
    """P-value of "the training is ``mu``-GDP" after ``v`` correct of ``r`` guesses on ``m`` canaries: the smallest
    level alpha at which ``one_run_fdp_rejects`` rejects it (bisection on log alpha to ``rtol``, rounded up; 1 when
    not even alpha = 1 rejects). Rejection only gets easier as alpha grows (every mass of the recursion scales with
    it), so ``p <= alpha`` exactly when ``one_run_fdp_rejects(m, r, v, mu, alpha)``, up to ``rtol``."""
    m, r, v = _check_counts(m, r, v)
    if not mu >= 0:
        raise MetricError(f"mu must be >= 0, got {mu!r}")
    if v == 0 or not one_run_fdp_rejects(m, r, v, mu, 1.0 - 1e-12):
        return 1.0
    lo, hi = math.log(1e-300), math.log(1.0 - 1e-12)
    if one_run_fdp_rejects(m, r, v, mu, 1e-300):
        return 1e-300
    while hi - lo > rtol:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if one_run_fdp_rejects(m, r, v, mu, math.exp(mid)) else (mid, hi)
    return float(min(1.0, math.exp(hi)))


def one_run_fdp_epsilon(m: int, r: int, v: int, *, delta: float, alpha: float = 0.05) -> float:
    """The epsilon at ``delta`` of the strongest Gaussian curve that ``v`` correct of ``r`` guesses on ``m`` canaries
    rule out at level ``alpha``: ``gdp_epsilon(one_run_fdp_mu(...), delta)`` (0 when nothing is ruled out).
    ``delta`` in (0, 1): a Gaussian curve is never (eps, 0)-DP."""
    if not (0 < delta < 1):
        raise MetricError(f"delta must be in (0, 1) for the f-DP bound, got {delta!r}")
    return gdp_epsilon(one_run_fdp_mu(m, r, v, alpha=alpha), delta)


# ----------------------------------------------------------------------------------------------- from scores
@dataclasses.dataclass(frozen=True)
class OneRunResult:
    """A one-run audit: ``epsilon`` (lower bound, confidence 1 - ``alpha``), the canaries ``m``, the guesses
    ``k_pos`` "in" and ``k_neg`` "out" (``r`` = their sum), ``v`` correct, at ``delta``; ``alpha_per_test`` is the
    level each (k_pos, k_neg) was tested at (alpha over the number of settings tried); ``bound``: the analysis,
    "steinke" (``one_run_epsilon``) or "fdp" (``one_run_fdp_epsilon``)."""

    epsilon: float
    m: int
    r: int
    v: int
    k_pos: int
    k_neg: int
    delta: float
    alpha: float
    alpha_per_test: float
    bound: str = "steinke"


def guess_counts(scores, included, k_pos: int, k_neg: int = 0) -> tuple:
    """(r, v): guesses and correct guesses when the ``k_pos`` highest ``scores`` are guessed included and the
    ``k_neg`` lowest excluded (ties broken by position, deterministically). ``included`` [m] bool."""
    s = np.asarray(scores, np.float64)
    inc = np.asarray(included).astype(bool)
    if s.ndim != 1 or inc.shape != s.shape:
        raise MetricError(f"scores {s.shape} and included {inc.shape} must be 1-D of equal length")
    if not np.isfinite(s).all():
        raise MetricError(f"{int((~np.isfinite(s)).sum())} non-finite score(s) at positions "
                          f"{np.flatnonzero(~np.isfinite(s))[:10].tolist()}")
    k_pos, k_neg = int(k_pos), int(k_neg)
    if k_pos < 0 or k_neg < 0 or k_pos + k_neg > len(s):
        raise MetricError(f"need k_pos, k_neg >= 0 and k_pos + k_neg <= {len(s)} canaries, got {k_pos}, {k_neg}")
    order = np.argsort(-s, kind="stable")  # highest first
    top, bottom = order[:k_pos], order[len(s) - k_neg:]
    return k_pos + k_neg, int(inc[top].sum() + (~inc[bottom]).sum())


def _guess_grid(m: int, k_pos, k_neg) -> list:
    """The (k_pos, k_neg) settings of an audit (see ``one_run_audit``)."""
    if m == 0:
        raise MetricError("a one-run audit needs at least one canary")
    if k_pos is None:
        k_pos = sorted({max(1, m // d) for d in (20, 10, 5, 2)})
    pos = [int(k) for k in (k_pos if isinstance(k_pos, (list, tuple, np.ndarray, range)) else [k_pos])]
    neg = [int(k) for k in (k_neg if isinstance(k_neg, (list, tuple, np.ndarray, range)) else [k_neg])]
    grid = [(p, n) for p in pos for n in neg]
    if not grid:
        raise MetricError("k_pos and k_neg must not be empty")
    return grid


def one_run_audit(scores, included, *, delta: float, alpha: float = 0.05,
                  k_pos: Union[int, Sequence[int], None] = None, k_neg: Union[int, Sequence[int]] = 0,
                  bound: str = "steinke") -> OneRunResult:
    """One-run epsilon lower bound from membership ``scores`` [m] (higher = member) of ``m`` canaries, each included
    with probability 1/2 (``included`` [m] bool, the truth).

    ``k_pos`` / ``k_neg``: how many top-scoring canaries to guess "in" / bottom-scoring to guess "out". An int is one
    audit at level alpha. A sequence is a grid: every (k_pos, k_neg) pair is tested at alpha / (number of pairs)
    (Bonferroni) and the best bound is returned, so choosing the best setting after seeing the scores stays valid.
    Default: k_pos in {m/20, m/10, m/5, m/2} (at least 1), k_neg = 0. ``bound``: "steinke" (``one_run_epsilon``,
    any (eps, delta)-DP training) or "fdp" (``one_run_fdp_epsilon``: the Gaussian curve; needs delta > 0).
    """
    if bound not in BOUNDS:
        raise MetricError(f"bound must be one of {', '.join(BOUNDS)}, got {bound!r}")
    m = len(np.asarray(scores))
    grid = _guess_grid(m, k_pos, k_neg)
    a = alpha / len(grid)
    best: Optional[OneRunResult] = None
    for p, n in grid:
        r, v = guess_counts(scores, included, p, n)
        eps = (one_run_epsilon(m, r, v, delta=delta, alpha=a) if bound == "steinke"
               else one_run_fdp_epsilon(m, r, v, delta=delta, alpha=a))
        res = OneRunResult(eps, m, r, v, p, n, float(delta), float(alpha), a, bound)
        if best is None or res.epsilon > best.epsilon:
            best = res
    return best


def one_run_claim_p_value(scores, included, *, epsilon: float, delta: float,
                          k_pos: Union[int, Sequence[int], None] = None, k_neg: Union[int, Sequence[int]] = 0) -> float:
    """P-value of the claim "the training is (``epsilon``, ``delta``)-DP" from the guesses of ``one_run_audit``
    (same arguments): the smallest ``one_run_p_value`` over the (k_pos, k_neg) grid times the grid's size
    (Bonferroni), capped at 1; 1 for an infinite epsilon. It is <= alpha exactly when ``one_run_audit(...,
    alpha=alpha).epsilon`` exceeds ``epsilon`` (up to the bisection's tolerance): the test behind a violation, in
    a form that a family of checks can correct for (``mia.metrics.holm_significant``)."""
    if math.isinf(epsilon):
        return 1.0
    m = len(np.asarray(scores))
    grid = _guess_grid(m, k_pos, k_neg)
    best = min(one_run_p_value(m, *guess_counts(scores, included, p, n), float(epsilon), float(delta))
               for p, n in grid)
    return min(1.0, best * len(grid))


# ----------------------------------------------------------------------------------------------- upper vs lower
def group_privacy(epsilon: float, delta: float, k: int) -> tuple:
    """(k eps, k e^((k - 1) eps) delta): the guarantee that (eps, delta)-DP per record gives a group of ``k``
    records (such as a canary inserted k times). Infinite epsilon stays infinite."""
    k = int(k)
    if k < 1:
        raise MetricError(f"group size must be >= 1, got {k}")
    if not math.isfinite(epsilon):
        return math.inf, float(delta)
    return k * epsilon, min(1.0, k * math.exp((k - 1) * epsilon) * delta)


def check_lower_bound(eps_lower: float, eps_upper: float, *, what: str = "") -> None:
    """Raise :class:`AuditViolation` when an audited lower bound exceeds the claimed upper bound (accountant epsilon).

    The audit holds with confidence 1 - alpha, so a violation is either that rare event or a bug; either way it must
    be looked at, never averaged away.
    """
    if eps_lower > eps_upper * (1 + 1e-9) + 1e-12:
        raise AuditViolation(f"PRIVACY AUDIT VIOLATION{' (' + what + ')' if what else ''}: the attack proves "
                             f"epsilon >= {eps_lower:.4g}, but the training's accountant claims epsilon <= "
                             f"{eps_upper:.4g}; the attack's labels, the bound, or the private training/accounting "
                             "is wrong (or a 1 - confidence event happened)")
