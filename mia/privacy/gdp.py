"""Gaussian differential privacy (Dong, Roth and Su 2019): the Gaussian trade-off curve, its (eps, delta) profile,
and the Gaussian-DP estimate of epsilon from membership scores.

A training is mu-GDP if telling "trained with the record" from "trained without it" is no easier than telling
N(mu, 1) from N(0, 1): every membership test with false positive rate FPR has false negative rate

    FNR >= G_mu(FPR) = Phi(Phi^-1(1 - FPR) - mu),       equivalently   mu >= Phi^-1(1 - FPR) - Phi^-1(FNR).

The Gaussian mechanism with noise multiplier sigma is (1 / sigma)-GDP, and DP-SGD's curve is close to a Gaussian
one (a central limit theorem over its steps). mu-GDP is (eps, delta(eps))-DP for every eps >= 0 with

    delta(eps) = Phi(-eps / mu + mu / 2) - e^eps Phi(-eps / mu - mu / 2)          (``gdp_delta``)

and no smaller delta; ``gdp_epsilon`` inverts it in eps, ``gdp_mu`` in mu (the mu whose curve passes through
(eps, delta), i.e. 1 / the noise multiplier of the Gaussian mechanism that is exactly (eps, delta)-DP).

``gdp_epsilon_estimate``: the largest mu that an attack's tests show, with Clopper-Pearson upper bounds on their
rates, converted to epsilon at delta (the "Gaussian-DP estimate" of Nasr et al. 2023; jax-privacy's
``CanaryScoreAuditor.epsilon_from_gdp``). An estimate, not a bound: it assumes the training's trade-off curve is
Gaussian, and, like ``mia.metrics.epsilon_bound``, that the examples are independent trials.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq
from scipy.special import log_ndtr, ndtr, ndtri

from ..metrics import MetricError, checked_scores, check_privacy_args, threshold_counts, clopper_pearson_upper, roc_hull


# ----------------------------------------------------------------------------------------------- the curve
def gdp_tradeoff(fpr, mu: float):
    """G_mu(FPR) = Phi(Phi^-1(1 - FPR) - mu): the smallest FNR a test with false positive rate ``fpr`` can have
    against a mu-GDP training. Vectorised over ``fpr``."""
    return ndtr(ndtri(1 - np.asarray(fpr, np.float64)) - mu)


def _log_gdp_delta(mu: float, eps: float) -> float:
    """log delta(eps) of mu-GDP (see the module docstring), stable where delta is tiny."""
    if mu <= 0:
        return -math.inf
    a, b = -eps / mu + mu / 2, -eps / mu - mu / 2
    la, lb = float(log_ndtr(a)), float(log_ndtr(b))
    ratio = math.exp(min(eps + lb - la, 0.0))  # e^eps Phi(b) / Phi(a) < 1
    return -math.inf if ratio >= 1 else la + math.log1p(-ratio)


def gdp_delta(mu: float, eps: float) -> float:
    """The smallest delta for which mu-GDP is (eps, delta)-DP (0 for mu = 0)."""
    return math.exp(_log_gdp_delta(float(mu), float(eps)))


def _check_delta(delta: float) -> float:
    d = float(delta)
    if not 0 < d < 1:
        raise MetricError(f"delta must be in (0, 1) for Gaussian DP (mu-GDP is never (eps, 0)-DP), got {delta!r}")
    return d


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest eps >= 0 for which mu-GDP is (eps, ``delta``)-DP (0 when it already is at eps = 0)."""
    mu, log_d = float(mu), math.log(_check_delta(delta))
    if not mu >= 0 or math.isinf(mu):
        raise MetricError(f"mu must be a finite number >= 0, got {mu!r}")
    gap = lambda eps: _log_gdp_delta(mu, eps) - log_d  # noqa: E731  (decreasing in eps)
    if gap(0.0) <= 0:
        return 0.0
    hi = max(1.0, mu * mu)
    while gap(hi) > 0:
        hi *= 2
    return float(brentq(gap, 0.0, hi, xtol=1e-12, rtol=1e-12))


def gdp_mu(eps: float, delta: float) -> float:
    """The mu whose Gaussian curve passes through (``eps``, ``delta``): mu-GDP is (eps, delta)-DP exactly, and any
    larger mu is not. 1 / mu is the noise multiplier of the Gaussian mechanism (sensitivity 1) that is exactly
    (eps, delta)-DP (``dp_accounting.get_sigma_gaussian``)."""
    eps, log_d = float(eps), math.log(_check_delta(delta))
    if not eps >= 0 or math.isinf(eps):
        raise MetricError(f"epsilon must be a finite number >= 0, got {eps!r}")
    gap = lambda mu: _log_gdp_delta(mu, eps) - log_d  # noqa: E731  (increasing in mu)
    lo, hi = 1e-3, 1.0
    while gap(lo) > 0:
        lo /= 2
    while gap(hi) < 0:
        lo, hi = hi, 2 * hi
    return float(brentq(gap, lo, hi, xtol=1e-14, rtol=1e-14))


# ----------------------------------------------------------------------------------------------- from scores
def mu_from_rates(fpr, fnr) -> np.ndarray:
    """Phi^-1(1 - FPR) - Phi^-1(FNR): the smallest mu for which mu-GDP allows a test with these rates (negative
    when the test is worse than chance). Vectorised; a rate of 1 gives -inf."""
    fpr, fnr = np.asarray(fpr, np.float64), np.asarray(fnr, np.float64)
    with np.errstate(invalid="ignore"):
        return ndtri(1 - fpr) - ndtri(fnr)


def gdp_mu_estimate(scores, labels, *, alpha: float = 0.05, threshold: str = "bonferroni", ids=None) -> float:
    """The largest mu that the tests "member iff score >= t" show, each test's FPR and FNR replaced by their
    one-sided Clopper-Pearson upper bounds at alpha / (2K) (``threshold="bonferroni"``: all K distinct scores, as
    ``mia.metrics.epsilon_bound``; ``"hull"``: the K corners of the ROC curve's convex hull, as jax-privacy).
    0 when no test beats chance. ``scores`` [n] (higher = member), ``labels`` [n] (1 = member)."""
    s, y = checked_scores(scores, labels, ids)
    _, alpha = check_privacy_args(0.0, alpha)
    if threshold not in ("bonferroni", "hull"):
        raise MetricError(f"threshold must be 'bonferroni' or 'hull', got {threshold!r}")
    n1, n0 = int(y.sum()), int(len(y) - y.sum())
    t, fp, fn = threshold_counts(s, y)
    if threshold == "hull":
        t, fp, fn = roc_hull(t, fp, fn, n1)
    a = alpha / (2 * len(t))
    mu = mu_from_rates(clopper_pearson_upper(fp, n0, a), clopper_pearson_upper(fn, n1, a))
    return float(max(np.max(mu), 0.0))


def gdp_epsilon_estimate(scores, labels, *, delta: float, alpha: float = 0.05,
                         threshold: str = "bonferroni", ids=None) -> float:
    """The Gaussian-DP estimate of epsilon: ``gdp_epsilon(gdp_mu_estimate(...), delta)`` (see the module
    docstring; an estimate that assumes a Gaussian trade-off curve, not a bound)."""
    d = _check_delta(delta)
    return gdp_epsilon(gdp_mu_estimate(scores, labels, alpha=alpha, threshold=threshold, ids=ids), d)
