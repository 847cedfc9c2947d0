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

from mia.privacy.one_run import (AuditViolation, check_lower_bound, group_privacy, guess_counts, one_run_audit,
                       one_run_claim_p_value, one_run_epsilon, one_run_fdp_epsilon, one_run_fdp_mu,
                       one_run_fdp_rejects, one_run_p_value)
from mia.privacy.exposure import exposure_by_reps, exposure_sampled, exposure_skewnorm
from mia.privacy.gdp import (gdp_delta, gdp_epsilon, gdp_epsilon_estimate, gdp_mu, gdp_mu_estimate, gdp_tradeoff,
                     mu_from_rates)
from mia.metrics import (MetricError, clopper_pearson, clopper_pearson_upper, epsilon_bound, epsilon_from_rates,
                         epsilon_lower_bound, holm_significant)


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


def _fdp_rejects_reference(m, r, v, mu, alpha):
    """Mahloujifar et al.'s recursion with every r_i, h_i kept in arrays (scipy.stats.norm, no shortcut, no cap)."""
    right, wrong = [0.0] * (v + 1), [0.0] * (v + 1)
    right[v], wrong[v] = alpha * v / m, alpha * (r - v) / m
    for i in range(v - 1, -1, -1):
        wrong[i] = max(wrong[i + 1], norm.cdf(norm.ppf(min(right[i + 1], 1.0)) - mu))
        right[i] = right[i + 1] + i / (r - i) * (wrong[i] - wrong[i + 1])
    return right[0] + wrong[0] > r / m


def _hull_vertices_reference(fp, tp, n0):
    """Indices of the ROC points on the upper convex hull (corners only), by scipy's Qhull: the points and the
    corner (n0, 0) below them; every hull vertex but that corner is a corner of the ROC's upper hull."""
    from scipy.spatial import ConvexHull

    pts = np.column_stack([np.r_[fp, n0], np.r_[tp, 0]]).astype(float)
    return sorted(int(i) for i in ConvexHull(pts).vertices if i < len(fp))


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


@pytest.mark.parametrize("seed", range(6))
def test_hull_threshold_is_the_bound_over_the_roc_hull_corners(seed):
    """threshold="hull": only the tests at the corners of the ROC's convex hull (the empty test included, by Qhull
    here), each rate bounded at alpha / (2H)."""
    rng = np.random.default_rng(seed)
    n1, n0 = rng.integers(2, 40, 2)
    s = np.round(np.r_[rng.normal(1.5, 1, n1), rng.normal(0, 1, n0)], seed % 3)  # rounding: ties
    y = np.r_[np.ones(n1, int), np.zeros(n0, int)]
    ts = [np.inf] + sorted(set(s.tolist()), reverse=True)
    fp = np.array([int(((s >= t) & (y == 0)).sum()) for t in ts])
    tp = np.array([int(((s >= t) & (y == 1)).sum()) for t in ts])
    corners = _hull_vertices_reference(fp, tp, n0)
    a = 0.05 / (2 * len(corners))
    best = 0.0
    for i in corners:
        fpr, fnr = _cp_upper_bisect(fp[i], n0, a), _cp_upper_bisect(n1 - tp[i], n1, a)
        for num, den in ((1 - 1e-5 - fpr, fnr), (1 - 1e-5 - fnr, fpr)):
            if num > 0:
                best = max(best, math.log(num / den))
    b = epsilon_bound(s, y, delta=1e-5, threshold="hull")
    assert b.n_thresholds == len(corners) and b.method == "hull"
    assert b.epsilon == pytest.approx(best, rel=1e-7, abs=1e-9)


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


def test_one_run_claim_p_value_is_the_test_behind_the_bound():
    """p <= alpha exactly when the audit's bound exceeds the claimed epsilon (same grid, Bonferroni inside)."""
    rng = np.random.default_rng(2)
    inc = rng.random(300) < 0.5
    s = inc * 1.5 + rng.normal(size=300)
    grid = [15, 30, 60]
    lower = one_run_audit(s, inc, delta=1e-5, k_pos=grid).epsilon
    assert lower > 0.3
    for eps in (0.0, 0.5 * lower, lower - 1e-6, lower + 1e-6, 2 * lower):
        p = one_run_claim_p_value(s, inc, epsilon=eps, delta=1e-5, k_pos=grid)
        expected = min(1.0, 3 * min(one_run_p_value(300, *guess_counts(s, inc, k), eps, 1e-5) for k in grid))
        assert p == pytest.approx(expected, rel=1e-12) and (p <= 0.05) == (eps < lower)
    assert one_run_claim_p_value(s, inc, epsilon=math.inf, delta=1e-5) == 1.0


# ----------------------------------------------------------------------------------------------- f-DP, GDP
@pytest.mark.parametrize("m,r,v", [(10, 10, 10), (100, 20, 18), (100, 60, 45), (1000, 50, 50), (1000, 300, 200),
                                   (7, 5, 0), (50, 1, 1)])
def test_one_run_fdp_matches_the_written_out_recursion(m, r, v):
    for mu in (0.0, 0.3, 1.0, 2.5, 6.0):
        for alpha in (0.05, 0.2):
            assert one_run_fdp_rejects(m, r, v, mu, alpha) == _fdp_rejects_reference(m, r, v, mu, alpha)
    edge = one_run_fdp_mu(m, r, v, alpha=0.05)
    if edge > 0:  # the returned mu is the edge of rejection
        assert one_run_fdp_rejects(m, r, v, edge, 0.05) and not one_run_fdp_rejects(m, r, v, edge + 1e-8, 0.05)
        assert one_run_fdp_epsilon(m, r, v, delta=1e-5) == pytest.approx(gdp_epsilon(edge, 1e-5), abs=1e-7)
    else:
        assert one_run_fdp_epsilon(m, r, v, delta=1e-5) == 0.0


def test_one_run_fdp_audit_and_its_edges():
    rng = np.random.default_rng(4)
    inc = rng.random(400) < 0.5
    s = inc * 2.0 + rng.normal(size=400)
    grid = [20, 40, 100]
    res = one_run_audit(s, inc, delta=1e-5, k_pos=grid, bound="fdp")
    expected = max(one_run_fdp_epsilon(400, *guess_counts(s, inc, k), delta=1e-5, alpha=0.05 / 3) for k in grid)
    assert res.bound == "fdp" and res.epsilon == pytest.approx(expected)
    # the Gaussian curve makes the same guesses prove more than (eps, delta)-DP does
    assert res.epsilon > one_run_audit(s, inc, delta=1e-5, k_pos=grid).epsilon > 0
    assert one_run_fdp_mu(100, 50, 25) == 0.0  # chance accuracy rules nothing out
    bounds = [one_run_fdp_mu(1000, 100, v) for v in range(50, 101, 10)]
    assert all(b2 >= b1 for b1, b2 in zip(bounds, bounds[1:])) and bounds[-1] > 0
    with pytest.raises(MetricError, match="delta"):
        one_run_fdp_epsilon(100, 10, 10, delta=0.0)
    with pytest.raises(MetricError, match="bound"):
        one_run_audit(s, inc, delta=1e-5, bound="best")


def test_one_run_fdp_holds_for_a_gaussian_mechanism():
    """Canary scores inclusion * mu0 + N(0, 1): the output is mu0-GDP in each canary's inclusion, so the f-DP
    audit's mu exceeds mu0 at most alpha of the time (never here; a wrong level, alpha = 0.9, exceeds it in more
    than half the runs)."""
    mu0, alpha, m = 1.0, 0.1, 1000
    rng = np.random.default_rng(7)
    grid = [25, 50, 100]
    got = []
    for _ in range(100):
        inc = rng.random(m) < 0.5
        s = inc * mu0 + rng.normal(size=m)
        got.append(max(one_run_fdp_mu(m, *guess_counts(s, inc, k), alpha=alpha / 3) for k in grid))
    got = np.array(got)
    assert np.mean(got > mu0) <= alpha and np.median(got) > 0.2


def test_gdp_conversions():
    from dp_accounting import get_sigma_gaussian

    for mu in (0.1, 0.5, 1.0, 3.0, 8.0):
        for eps in (0.0, 0.5, 2.0, 10.0):
            direct = norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
            assert gdp_delta(mu, eps) == pytest.approx(direct, rel=1e-9, abs=1e-300)
    for eps in (0.0, 0.5, 2.0, 8.0, 30.0):
        for delta in (1e-8, 1e-5, 1e-2):
            mu = gdp_mu(eps, delta)
            assert gdp_delta(mu, eps) == pytest.approx(delta, rel=1e-9)
            assert 1 / mu == pytest.approx(get_sigma_gaussian(eps, delta), rel=1e-7)
            assert gdp_epsilon(mu, delta) == pytest.approx(eps, abs=1e-8)
    assert gdp_epsilon(0.0, 1e-5) == 0.0 and gdp_epsilon(gdp_mu(0.0, 1e-5) / 2, 1e-5) == 0.0
    fpr = np.array([1e-4, 0.01, 0.3, 0.9])
    np.testing.assert_allclose(mu_from_rates(fpr, gdp_tradeoff(fpr, 1.7)), 1.7, rtol=1e-9)
    with pytest.raises(MetricError, match="delta"):
        gdp_epsilon(1.0, 0.0)


def test_gdp_estimate_matches_a_threshold_loop_and_is_valid():
    rng = np.random.default_rng(3)
    s = np.round(np.r_[rng.normal(1.2, 1, 40), rng.normal(0, 1, 50)], 1)
    y = np.r_[np.ones(40, int), np.zeros(50, int)]
    ts = sorted(set(s.tolist()), reverse=True)
    a = 0.05 / (2 * len(ts))
    best = 0.0
    for t in ts:
        fpr = _cp_upper_bisect(int(((s >= t) & (y == 0)).sum()), 50, a)
        fnr = _cp_upper_bisect(int(((s < t) & (y == 1)).sum()), 40, a)
        best = max(best, norm.ppf(1 - fpr) - norm.ppf(fnr))
    assert gdp_mu_estimate(s, y) == pytest.approx(best, rel=1e-7)
    assert gdp_epsilon_estimate(s, y, delta=1e-5) == pytest.approx(gdp_epsilon(best, 1e-5), rel=1e-7)
    # a Gaussian mechanism's scores: below its mu, not far off with many examples
    for mu in (0.5, 2.0):
        sg = np.r_[_deterministic_normal(mu, 4000), _deterministic_normal(0.0, 4000)]
        yg = np.r_[np.ones(4000, int), np.zeros(4000, int)]
        assert 0.6 * mu < gdp_mu_estimate(sg, yg) < mu
    # no signal: nothing shown, except in about alpha of the cases
    shown = [gdp_mu_estimate(rng.normal(size=60), np.r_[np.ones(30, int), np.zeros(30, int)]) > 0
             for _ in range(100)]
    assert np.mean(shown) <= 0.05


def test_holm_is_the_step_down_procedure_and_holds_the_family():
    def reference(p, alpha):  # Holm-adjusted p-values: running max of (m - j) p_(j), j = 0, 1, ...
        order = np.argsort(p, kind="stable")
        adj = np.maximum.accumulate((len(p) - np.arange(len(p))) * np.asarray(p)[order])
        out = np.zeros(len(p), bool)
        out[order] = adj <= alpha
        return out.tolist()

    rng = np.random.default_rng(0)
    for _ in range(200):
        p = np.round(rng.random(rng.integers(1, 12)) ** 3, 3)  # small values and ties
        assert holm_significant(p, 0.05) == reference(p, 0.05)
    assert holm_significant([0.01, 0.03, 0.2]) == [True, False, False]  # 0.03 > 0.05 / 2
    assert holm_significant([0.01, 0.02, 0.04]) == [True, True, True]  # Bonferroni (0.05 / 3) rejects one only
    assert holm_significant([]) == []
    # 20 true hypotheses with uniform p-values: any single 5% test errs in 64% of families; Holm in <= 5%
    p = rng.random((4000, 20))
    assert np.mean((p <= 0.05).any(axis=1)) > 0.6
    assert np.mean([any(holm_significant(row)) for row in p[:1000]]) <= 0.05 + 0.02


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


def test_exposure_sampled_expectation_is_what_the_docstring_says():
    """Over every draw of n candidates from a space R (enumerated: exact), 2^-exposure = (1 + count) / (n + 1) has
    expectation (1 + n p) / (n + 1), p the canary's rank fraction in R: biased upwards, never below 1 / (n + 1),
    so exposure stops at log2(n + 1) bits."""
    import itertools

    import mia.privacy.exposure

    space = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])  # losses of the 6 sequences of R
    n = 3
    draws = np.array(list(itertools.product(space, repeat=n)))  # 216 equally likely draws (with replacement)
    for loss in space:
        p = np.mean(space <= loss)
        est = np.array([2.0 ** -exposure_sampled([loss], d)[0] for d in draws])
        assert est.mean() == pytest.approx((1 + n * p) / (n + 1), abs=1e-12)
        assert est.mean() - p == pytest.approx((1 - p) / (n + 1), abs=1e-12)  # the bias
    assert exposure_sampled([0.0], space[:n])[0] == pytest.approx(math.log2(n + 1))  # the cap
    doc = " ".join(mia.privacy.exposure.__doc__.split())
    assert "(1 + n p) / (n + 1)" in doc and "nbiased" not in doc


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
