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

Group privacy: a canary inserted r times is a group of r records; (eps, delta)-DP for one record gives
(r eps, r e^((r - 1) eps) delta)-DP for the group (``group_privacy``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Union

import numpy as np
from scipy.special import expit
from scipy.stats import binom

from .metrics import MetricError


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


# ----------------------------------------------------------------------------------------------- from scores
@dataclasses.dataclass(frozen=True)
class OneRunResult:
    """A one-run audit: ``epsilon`` (lower bound, confidence 1 - ``alpha``), the canaries ``m``, the guesses
    ``k_pos`` "in" and ``k_neg`` "out" (``r`` = their sum), ``v`` correct, at ``delta``; ``alpha_per_test`` is the
    level each (k_pos, k_neg) was tested at (alpha over the number of settings tried)."""

    epsilon: float
    m: int
    r: int
    v: int
    k_pos: int
    k_neg: int
    delta: float
    alpha: float
    alpha_per_test: float


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


def one_run_audit(scores, included, *, delta: float, alpha: float = 0.05,
                  k_pos: Union[int, Sequence[int], None] = None, k_neg: Union[int, Sequence[int]] = 0) -> OneRunResult:
    """One-run epsilon lower bound from membership ``scores`` [m] (higher = member) of ``m`` canaries, each included
    with probability 1/2 (``included`` [m] bool, the truth).

    ``k_pos`` / ``k_neg``: how many top-scoring canaries to guess "in" / bottom-scoring to guess "out". An int is one
    audit at level alpha. A sequence is a grid: every (k_pos, k_neg) pair is tested at alpha / (number of pairs)
    (Bonferroni) and the best bound is returned, so choosing the best setting after seeing the scores stays valid.
    Default: k_pos in {m/20, m/10, m/5, m/2} (at least 1), k_neg = 0.
    """
    m = len(np.asarray(scores))
    if m == 0:
        raise MetricError("one_run_audit needs at least one canary")
    if k_pos is None:
        k_pos = sorted({max(1, m // d) for d in (20, 10, 5, 2)})
    pos = [int(k) for k in (k_pos if isinstance(k_pos, (list, tuple, np.ndarray, range)) else [k_pos])]
    neg = [int(k) for k in (k_neg if isinstance(k_neg, (list, tuple, np.ndarray, range)) else [k_neg])]
    grid = [(p, n) for p in pos for n in neg]
    if not grid:
        raise MetricError("k_pos and k_neg must not be empty")
    a = alpha / len(grid)
    best: Optional[OneRunResult] = None
    for p, n in grid:
        r, v = guess_counts(scores, included, p, n)
        eps = one_run_epsilon(m, r, v, delta=delta, alpha=a)
        res = OneRunResult(eps, m, r, v, p, n, float(delta), float(alpha), a)
        if best is None or res.epsilon > best.epsilon:
            best = res
    return best


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
