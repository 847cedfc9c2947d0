"""Privacy auditing: epsilon lower bounds from scores (Clopper-Pearson), the one-run audit, exposure, group privacy.

References are independent and obviously correct: binomial sums written out with math.comb, bisection on the
binomial CDF for Clopper-Pearson, loops over thresholds, and mechanisms whose true epsilon is known exactly
(randomized response; the Gaussian mechanism through dp_accounting).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom, norm

from mia.audit import (AuditViolation, check_lower_bound, group_privacy, guess_counts, one_run_audit,
                       one_run_epsilon, one_run_p_value)
from mia.exposure import exposure_by_reps, exposure_sampled, exposure_skewnorm
from mia.metrics import (MetricError, clopper_pearson, clopper_pearson_upper, epsilon_bound, epsilon_from_rates,
                         epsilon_lower_bound)


# ----------------------------------------------------------------------------------------------- references
def _cp_upper_bisect(k: int, n: int, a: float) -> float:
    """p with P[Binomial(n, p) <= k] = a, by bisection on the binomial CDF (1 when k = n)."""
    if k >= n:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if binom.cdf(k, n, mid) > a else (lo, mid)
    return (lo + hi) / 2


def _eps_bonferroni_reference(s, y, delta, alpha):
    """Loop over every distinct score as threshold; bisection Clopper-Pearson at alpha / (2K); max of both sides."""
    ts = sorted(set(s.tolist()), reverse=True)
    a = alpha / (2 * len(ts))
    n1, n0 = int(sum(y)), int(len(y) - sum(y))
    best = 0.0
    for t in ts:
        fp = sum(1 for si, yi in zip(s, y) if yi == 0 and si >= t)
        fn = sum(1 for si, yi in zip(s, y) if yi == 1 and si < t)
        fpr, fnr = _cp_upper_bisect(fp, n0, a), _cp_upper_bisect(fn, n1, a)
        for num, den in ((1 - delta - fpr, fnr), (1 - delta - fnr, fpr)):
            if num > 0:
                best = max(best, math.log(num / den))
    return best


def _one_run_p_reference(m, r, v, eps, delta):
    """The one-run p-value with binomial probabilities written out (math.comb), i running over 1..v."""
    q = math.exp(eps) / (1 + math.exp(eps))
    pmf = [math.comb(r, j) * q ** j * (1 - q) ** (r - j) for j in range(r + 1)]
    tail = sum(pmf[v:])
    worst = max((sum(pmf[max(v - i, 0):v]) / i for i in range(1, v + 1)), default=0.0)
    return min(1.0, tail + 2 * m * delta * worst)


def _deterministic_normal(mu: float, n: int) -> np.ndarray:
    """n quantiles of N(mu, 1) at (i + 1/2) / n: a sample without sampling noise."""
    return norm.ppf((np.arange(n) + 0.5) / n) + mu


# ----------------------------------------------------------------------------------------------- Clopper-Pearson
@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (10, 10), (7, 50), (0, 1), (199, 200)])
def test_clopper_pearson_upper_matches_bisection(k, n):
    for a in (0.05, 0.001):
        assert clopper_pearson_upper(k, n, a) == pytest.approx(_cp_upper_bisect(k, n, a), abs=1e-10)
    lo, hi = clopper_pearson(k, n, 0.1)
    assert hi == pytest.approx(_cp_upper_bisect(k, n, 0.05), abs=1e-10)
    # the lower bound is the upper bound of the complementary count, reflected
    assert lo == pytest.approx(1 - _cp_upper_bisect(n - k, n, 0.05), abs=1e-10)


def test_epsilon_from_rates_both_inequalities():
    d = 1e-3
    assert epsilon_from_rates(0.1, 0.2, d) == pytest.approx(max(math.log((1 - d - 0.1) / 0.2),
                                                                math.log((1 - d - 0.2) / 0.1)))
    assert epsilon_from_rates(0.5, 0.5, 0.0) == 0.0  # chance
    assert epsilon_from_rates(0.9, 0.9, 0.0) == 0.0  # worse than chance rules nothing out
    assert epsilon_from_rates(0.0, 0.3, 0.0) == math.inf


# ----------------------------------------------------------------------------------------------- epsilon bound
def test_epsilon_bound_matches_threshold_loop():
    rng = np.random.default_rng(3)
    for mu, n1, n0 in ((1.5, 30, 25), (0.0, 20, 20), (3.0, 15, 40)):
        s = np.r_[rng.normal(mu, 1, n1), rng.normal(0, 1, n0)].round(1)  # rounded: ties across classes
        y = np.r_[np.ones(n1, int), np.zeros(n0, int)]
        for delta in (0.0, 1e-2):
            got = epsilon_bound(s, y, delta=delta, alpha=0.1)
            assert got.epsilon == pytest.approx(_eps_bonferroni_reference(s, y, delta, 0.1), abs=1e-8)
            k = len(np.unique(s))
            assert got.n_thresholds == k and got.alpha_per_bound == pytest.approx(0.1 / (2 * k))
            if got.epsilon > 0:  # the reported test reproduces the reported rates
                assert got.fpr == pytest.approx(np.mean(s[y == 0] >= got.threshold))
                assert got.fnr == pytest.approx(np.mean(s[y == 1] < got.threshold))


def test_fixed_and_split_thresholds():
    s = np.r_[_deterministic_normal(2.0, 400), _deterministic_normal(0.0, 400)]
    y = np.r_[np.ones(400, int), np.zeros(400, int)]
    fixed = epsilon_bound(s, y, delta=1e-5, threshold=1.0)
    fp, fn = int((s[y == 0] >= 1.0).sum()), int((s[y == 1] < 1.0).sum())
    want = epsilon_from_rates(_cp_upper_bisect(fp, 400, 0.025), _cp_upper_bisect(fn, 400, 0.025), 1e-5)
    assert fixed.epsilon == pytest.approx(float(want), abs=1e-8) and fixed.method == "fixed"
    a, b = (epsilon_bound(s, y, delta=1e-5, threshold="split", split_seed=7) for _ in range(2))
    assert a == b and a.n_members == 200 and a.n_nonmembers == 200 and a.epsilon > 0  # seeded; half the data
    assert epsilon_lower_bound(s, y, delta=1e-5) == epsilon_bound(s, y, delta=1e-5).epsilon


@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0])
def test_gaussian_mechanism_bound_is_valid_and_close(mu):
    """Scores N(mu, 1) vs N(0, 1) are exactly the Gaussian mechanism with sensitivity 1 and sigma 1/mu: the bound
    must stay below its true epsilon and, with many examples, come within 40% of it."""
    from dp_accounting import get_epsilon_gaussian

    n, delta = 40_000, 1e-2
    s = np.r_[_deterministic_normal(mu, n), _deterministic_normal(0.0, n)]
    y = np.r_[np.ones(n, int), np.zeros(n, int)]
    true = get_epsilon_gaussian(1 / mu, delta)
    for method in ("bonferroni", "split"):
        eps = epsilon_lower_bound(s, y, delta=delta, alpha=0.05, threshold=method)
        assert eps < true and eps > 0.6 * true, (method, eps, true)


def test_randomized_response_bound_holds_with_confidence():
    """eps0-randomized response is exactly eps0-DP: over many audits the bound exceeds eps0 at most alpha of the
    time, and the largest bounds come near eps0."""
    eps0, alpha, n = 1.0, 0.1, 300
    keep = math.exp(eps0) / (1 + math.exp(eps0))
    rng = np.random.default_rng(11)
    bounds = []
    for _ in range(200):
        y = rng.integers(0, 2, n)
        s = np.where(rng.random(n) < keep, y, 1 - y).astype(float)
        bounds.append(epsilon_lower_bound(s, y, delta=0.0, alpha=alpha))
    bounds = np.array(bounds)
    assert np.mean(bounds > eps0) <= alpha
    assert bounds.max() > 0.4 * eps0 and np.median(bounds) > 0


def test_epsilon_bound_refuses_bad_input():
    with pytest.raises(MetricError, match="delta"):
        epsilon_bound([0.1, 0.2], [0, 1], delta=1.0)
    with pytest.raises(MetricError, match="alpha"):
        epsilon_bound([0.1, 0.2], [0, 1], delta=0.0, alpha=0.0)
    with pytest.raises(MetricError, match="both members"):
        epsilon_bound([0.1, 0.2], [1, 1], delta=0.0)
    with pytest.raises(MetricError, match="non-finite"):
        epsilon_bound([0.1, np.nan], [0, 1], delta=0.0)
    with pytest.raises(MetricError, match="threshold must be"):
        epsilon_bound([0.1, 0.2], [0, 1], delta=0.0, threshold="best")


# ----------------------------------------------------------------------------------------------- one-run audit
@pytest.mark.parametrize("m,r,v", [(10, 10, 10), (50, 20, 15), (100, 40, 31), (1000, 30, 2), (7, 5, 0)])
def test_one_run_p_value_matches_written_out_sums(m, r, v):
    for eps in (0.0, 0.3, 1.0, 2.5):
        for delta in (0.0, 1e-5, 1e-2):
            assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(_one_run_p_reference(m, r, v, eps, delta),
                                                                         rel=1e-9, abs=1e-12)


def test_one_run_epsilon_closed_form_and_definition():
    # every guess right, delta = 0: P[W' = r] = q^r <= alpha  <=>  eps >= logit(alpha^(1/r))
    for r in (10, 100, 1000):
        q = 0.05 ** (1 / r)
        assert one_run_epsilon(1000, r, r, delta=0.0, alpha=0.05) == pytest.approx(math.log(q / (1 - q)), abs=1e-7)
    # the returned eps is the edge of rejection
    m, r, v, d = 1000, 200, 170, 1e-5
    e = one_run_epsilon(m, r, v, delta=d, alpha=0.05)
    assert one_run_p_value(m, r, v, e, d) <= 0.05 < one_run_p_value(m, r, v, e + 1e-6, d)
    # no evidence: chance accuracy rules nothing out; more correct guesses never lower the bound; delta costs
    assert one_run_epsilon(m, 100, 50, delta=d) == 0.0
    bounds = [one_run_epsilon(m, 100, v, delta=d) for v in range(50, 101, 5)]
    assert all(b2 >= b1 for b1, b2 in zip(bounds, bounds[1:]))
    assert one_run_epsilon(10 ** 6, 1000, 1000, delta=1e-5) < one_run_epsilon(10 ** 6, 1000, 1000, delta=0.0)


def test_one_run_audit_guesses_and_grid():
    scores = np.array([9.0, 8.0, 7.0, 1.0, 0.5, 0.0, 6.0, 5.0])
    inc = np.array([1, 1, 0, 0, 0, 1, 1, 0], bool)
    assert guess_counts(scores, inc, 3) == (3, 2)  # top 3: 9, 8, 7 -> two included
    assert guess_counts(scores, inc, 2, 2) == (4, 3)  # bottom 2: 0.0 (included: wrong), 0.5 (right)
    rng = np.random.default_rng(0)
    inc = rng.random(400) < 0.5
    s = inc * 2.0 + rng.normal(0, 1, 400)
    grid = [10, 40, 100]
    res = one_run_audit(s, inc, delta=1e-5, alpha=0.05, k_pos=grid)
    expected = max(one_run_epsilon(400, *guess_counts(s, inc, k), delta=1e-5, alpha=0.05 / 3) for k in grid)
    assert res.epsilon == pytest.approx(expected) and res.alpha_per_test == pytest.approx(0.05 / 3)
    single = one_run_audit(s, inc, delta=1e-5, k_pos=40)
    assert single.epsilon == pytest.approx(one_run_epsilon(400, *guess_counts(s, inc, 40), delta=1e-5))
    with pytest.raises(MetricError, match="k_pos"):
        one_run_audit(s, inc, delta=1e-5, k_pos=401)


def test_one_run_audit_holds_for_randomized_response():
    """Canaries scored by eps0-randomized response of their inclusion bit: the audit exceeds eps0 at most alpha
    of the time (each canary's guess is eps0-DP, the setting of the theorem)."""
    eps0, alpha, m = 1.0, 0.1, 400
    keep = math.exp(eps0) / (1 + math.exp(eps0))
    rng = np.random.default_rng(5)
    bounds = []
    for _ in range(200):
        inc = rng.random(m) < 0.5
        s = np.where(rng.random(m) < keep, inc, ~inc) + rng.random(m) * 1e-3  # tiny jitter: a strict order
        bounds.append(one_run_audit(s, inc, delta=0.0, alpha=alpha, k_pos=100, k_neg=100).epsilon)
    bounds = np.array(bounds)
    assert np.mean(bounds > eps0) <= alpha and np.median(bounds) > 0.3


def test_group_privacy_and_violation_check():
    assert group_privacy(0.5, 1e-6, 1) == (0.5, 1e-6)
    e, d = group_privacy(0.5, 1e-6, 4)
    assert e == 2.0 and d == pytest.approx(4 * math.exp(1.5) * 1e-6)
    assert group_privacy(math.inf, 1e-6, 3)[0] == math.inf
    check_lower_bound(1.0, 2.0)
    check_lower_bound(0.0, 0.0)
    with pytest.raises(AuditViolation, match="PRIVACY AUDIT VIOLATION.*3.*2"):
        check_lower_bound(3.0, 2.0, what="test")


# ----------------------------------------------------------------------------------------------- exposure
def test_exposure_sampled_is_rank_based():
    cand = np.arange(1.0, 8.0)  # 7 candidates: losses 1..7
    got = exposure_sampled([0.5, 1.0, 4.5, 9.0], cand)
    # (1 + #{candidates <= loss}) / 8: 1/8, 2/8, 5/8, 8/8
    np.testing.assert_allclose(got, [3.0, 2.0, 3 - math.log2(5), 0.0])


def test_exposure_skewnorm_matches_the_fitted_cdf():
    from scipy.stats import skewnorm

    rng = np.random.default_rng(1)
    cand = skewnorm.rvs(3.0, loc=100, scale=5, size=4000, random_state=rng)
    a, loc, scale = skewnorm.fit(cand)
    got = exposure_skewnorm([90.0, 100.0, 110.0], cand)
    np.testing.assert_allclose(got, -np.log2(skewnorm.cdf([90.0, 100.0, 110.0], a, loc, scale)), rtol=1e-6)
    assert got[0] > got[1] > got[2] >= 0
    # where the sample resolves the rank, both estimators agree roughly
    s = exposure_sampled([102.0], cand)[0]
    assert abs(s - exposure_skewnorm([102.0], cand)[0]) < 0.3


def test_exposure_by_reps_groups():
    e = np.array([1.0, 3.0, 5.0, 7.0, 2.0, 0.5])
    reps = np.array([1, 1, 4, 4, 4, 1])
    inc = np.array([1, 1, 1, 1, 0, 0], bool)
    rows = exposure_by_reps(e, reps, inc)
    assert [r["reps"] for r in rows] == [1, 4]
    assert rows[0]["mean"] == 2.0 and rows[0]["excluded_mean"] == 0.5 and rows[0]["n_included"] == 2
    assert rows[1]["median"] == 6.0 and rows[1]["excluded_mean"] == 2.0
