"""mia's privacy-audit numbers against jax-privacy's ``CanaryScoreAuditor`` (jax-privacy >= 2.0, in the test extras).

Where mia and jax-privacy define a number the same way, the two must be equal: the one-run bounds on a grid of
(m, r, v, delta, alpha) (Steinke et al. and the f-DP form), and Clopper-Pearson at a fixed threshold. Where the
definitions differ (docs/auditing.md, "mia and jax-privacy"), the test states the conversion under which the
numbers agree and shows the difference: which thresholds are searched and paid for, one- or two-sided, and the
Gaussian-DP estimate's reversed tests. Score sets include ties, FPR = 0, a single example per class and no signal.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from mia.privacy.one_run import one_run_epsilon, one_run_fdp_epsilon
from mia.privacy.gdp import gdp_epsilon, gdp_epsilon_estimate, mu_from_rates
from mia.metrics import clopper_pearson_upper, epsilon_bound, roc_hull, threshold_counts

auditing = pytest.importorskip("jax_privacy.auditing")
Auditor, Explicit = auditing.CanaryScoreAuditor, auditing.Explicit

BRENTQ = 2e-6  # jax-privacy finds the one-run epsilons with brentq(xtol=1e-6); mia bisects to 1e-9 / 1e-10
EXACT = 1e-12  # the same closed forms (scipy's beta quantile) on both sides


# ----------------------------------------------------------------------------------------------- (m, r, v) grid
def game_as_scores(m: int, r: int, v: int):
    """(member scores, non-member scores) of m canaries on which the test "score >= 1" makes r guesses "in", v of
    them right (the other m - r canaries score 0, split between the classes); None when no split leaves both
    classes non-empty (jax-privacy needs both)."""
    rest = m - r
    for a in sorted(range(rest + 1), key=lambda a: abs(a - rest // 2)):
        n_in, n_out = v + a, (r - v) + (rest - a)
        if n_in and n_out:
            return np.r_[np.ones(v), np.zeros(a)], np.r_[np.ones(r - v), np.zeros(rest - a)]
    return None


def grid(ms, deltas=(1e-6, 1e-3, 0.1), alphas=(0.05, 0.01)):
    """(m, r, v, delta, alpha): every r in {1, m/10, m/2, m - 1, m}, v in {0, r/2, 3r/4, r - 1, r}, representable."""
    out = []
    for m in ms:
        for r in sorted({1, m // 10, m // 2, m - 1, m} - {0}):
            for v in sorted({0, r // 2, 3 * r // 4, r - 1, r}):
                if game_as_scores(m, r, v) is not None:
                    out += [(m, r, v, d, a) for d in deltas for a in alphas]
    return out


def test_the_grid_covers_the_corners():
    g = grid((10, 100, 1000))
    assert len(g) == 330 and game_as_scores(10, 10, 10) is None  # every guess right and nothing left out
    assert {(r == m, v == r, v == 0) for m, r, v, _, _ in g} >= {(True, False, False), (False, True, False),
                                                                 (False, False, True)}
    ins, outs = game_as_scores(100, 50, 30)
    assert (ins >= 1).sum() == 30 and (outs >= 1).sum() == 20 and len(ins) + len(outs) == 100


def _jax_one_run(m, r, v, delta, alpha, fdp: bool) -> float:
    ins, outs = game_as_scores(m, r, v)
    method = Auditor(ins, outs).epsilon_one_run_fdp if fdp else Auditor(ins, outs).epsilon_one_run
    return method(alpha, delta, threshold_strategy=Explicit(1.0))


@pytest.mark.parametrize("ms, deltas", [((10, 100, 1000), (1e-6, 0.1)),
                                        pytest.param((10, 100, 1000, 10_000), (1e-6, 1e-3, 0.1),
                                                     marks=pytest.mark.slow)])
def test_one_run_epsilon_equals_jax_privacy(ms, deltas):
    for m, r, v, delta, alpha in grid(ms, deltas):
        want = _jax_one_run(m, r, v, delta, alpha, fdp=False)
        assert one_run_epsilon(m, r, v, delta=delta, alpha=alpha) == pytest.approx(want, abs=BRENTQ), (m, r, v)


@pytest.mark.parametrize("ms, deltas, alphas", [((10, 100), (1e-6, 0.1), (0.05,)),
                                                pytest.param((10, 100, 1000, 10_000), (1e-6, 1e-3, 0.1), (0.05, 0.01),
                                                             marks=pytest.mark.slow)])
def test_one_run_fdp_epsilon_equals_jax_privacy(ms, deltas, alphas):
    for m, r, v, delta, alpha in grid(ms, deltas, alphas):
        want = _jax_one_run(m, r, v, delta, alpha, fdp=True)
        assert one_run_fdp_epsilon(m, r, v, delta=delta, alpha=alpha) == pytest.approx(want, abs=BRENTQ), (m, r, v)


# ----------------------------------------------------------------------------------------------- score sets
def _sets() -> dict:
    """Named (member scores, non-member scores)."""
    rng = np.random.default_rng(0)
    return {
        "ties": (np.round(rng.normal(1.0, 1, 40), 1), np.round(rng.normal(0, 1, 50), 1)),
        "coarse ties": (rng.integers(0, 4, 30).astype(float), rng.integers(-1, 3, 30).astype(float)),
        "fpr 0": (rng.uniform(2, 3, 20), rng.uniform(0, 1, 25)),  # perfectly separated
        "one each": (np.array([1.0]), np.array([0.0])),
        "tiny": (np.array([2.0, 1.0]), np.array([1.0, 0.0, -1.0])),
        "all tied": (np.zeros(5), np.zeros(7)),
        "low tail": (rng.uniform(0, 1, 100), np.r_[rng.uniform(0, 1, 50), rng.uniform(-2, -1, 50)]),
        "reversed": (rng.normal(-1, 1, 30), rng.normal(0, 1, 30)),
        "unbalanced": (np.array([3.0]), rng.normal(0, 1, 60)),
        "large": (rng.normal(2.0, 1, 500), rng.normal(0, 1, 500)),
    }


SETS = _sets()


def _pooled(ins, outs):
    return np.r_[ins, outs], np.r_[np.ones(len(ins), int), np.zeros(len(outs), int)]


def _hull(ins, outs):
    """(thresholds, FP, FN) at the corners of the ROC's convex hull, the empty test first (mia's roc_hull)."""
    s, y = _pooled(ins, outs)
    return roc_hull(*threshold_counts(s, y), len(ins))


@pytest.mark.parametrize("name", SETS)
def test_clopper_pearson_at_a_fixed_threshold_equals_jax_privacy(name):
    """Same test "member iff score >= t", same one-sided Clopper-Pearson bounds at alpha / 2 on FPR and FNR, same
    two inequalities (jax-privacy: one_sided=False): equal."""
    ins, outs = SETS[name]
    s, y = _pooled(ins, outs)
    auditor = Auditor(ins, outs)
    for t in np.unique(s)[:40]:
        for delta in (0.0, 1e-5, 0.1):
            want = auditor.epsilon_clopper_pearson(0.05, delta, one_sided=False, threshold_strategy=Explicit(t))
            assert epsilon_bound(s, y, delta=delta, threshold=t).epsilon == pytest.approx(want, abs=EXACT)


@pytest.mark.parametrize("name", SETS)
def test_clopper_pearson_bonferroni_and_hull_against_jax_privacy(name):
    """mia's "bonferroni" pays alpha / K for each of the K distinct scores: it equals the best of jax-privacy's
    fixed-threshold bounds at alpha / K. jax-privacy's default searches the H corners of the ROC hull (the empty test
    counted) at alpha / H: it equals mia's threshold="hull". Its one-sided form keeps only the first inequality."""
    ins, outs = SETS[name]
    s, y = _pooled(ins, outs)
    auditor = Auditor(ins, outs)
    thresholds = np.unique(s)
    for delta in (0.0, 1e-5, 0.1):
        mia_bonferroni = epsilon_bound(s, y, delta=delta).epsilon
        best_fixed = max(auditor.epsilon_clopper_pearson(0.05 / len(thresholds), delta, one_sided=False,
                                                         threshold_strategy=Explicit(t)) for t in thresholds)
        assert mia_bonferroni == pytest.approx(best_fixed, abs=EXACT)
        jax_default = auditor.epsilon_clopper_pearson(0.05, delta, one_sided=False)
        assert epsilon_bound(s, y, delta=delta, threshold="hull").epsilon == pytest.approx(jax_default, abs=EXACT)
        t, fp, fn = _hull(ins, outs)
        a = 0.05 / (2 * len(t))
        fpr, fnr = clopper_pearson_upper(fp, len(outs), a), clopper_pearson_upper(fn, len(ins), a)
        ok = 1 - delta - fnr > 0
        first = max([0.0] + (np.log(1 - delta - fnr[ok]) - np.log(fpr[ok])).tolist())
        assert auditor.epsilon_clopper_pearson(0.05, delta) == pytest.approx(first, abs=EXACT)
    if name == "low tail":  # the second inequality wins: one-sided jax-privacy misses what mia shows
        assert epsilon_bound(s, y, delta=1e-5, threshold="hull").epsilon > auditor.epsilon_clopper_pearson(
            0.05, 1e-5) + 1


def test_hull_pays_for_fewer_tests():
    """500 + 500 continuous scores: jax-privacy's bound (2.58) is larger than mia's (2.12): it pays for the hull's 20
    corners, mia for all 1000 distinct scores."""
    ins, outs = SETS["large"]
    s, y = _pooled(ins, outs)
    b, h = epsilon_bound(s, y, delta=1e-5), epsilon_bound(s, y, delta=1e-5, threshold="hull")
    assert h.n_thresholds < b.n_thresholds / 10 and h.epsilon > b.epsilon > 0


@pytest.mark.parametrize("name", ["ties", "coarse ties", "fpr 0", "tiny", "low tail", "unbalanced"])
def test_one_run_from_scores_is_the_best_hull_corner(name):
    """jax-privacy's one-run audit from scores guesses "in" above each corner of the ROC hull and pays alpha / H:
    the best of mia's one_run_epsilon (and one_run_fdp_epsilon) over those corners at alpha / H. (mia's
    one_run_audit instead tests a grid of guess counts fixed before the scores are seen.)"""
    ins, outs = SETS[name]
    auditor = Auditor(ins, outs)
    m = len(ins) + len(outs)
    t, fp, fn = _hull(ins, outs)
    a = 0.05 / len(t)
    tp = len(ins) - fn
    for delta in (1e-5, 0.1):
        steinke = max(one_run_epsilon(m, int(f + p), int(p), delta=delta, alpha=a) for f, p in zip(fp, tp))
        assert auditor.epsilon_one_run(0.05, delta) == pytest.approx(steinke, abs=BRENTQ)
        fdp = max(one_run_fdp_epsilon(m, int(f + p), int(p), delta=delta, alpha=a) for f, p in zip(fp, tp))
        assert auditor.epsilon_one_run_fdp(0.05, delta) == pytest.approx(fdp, abs=BRENTQ)


# ----------------------------------------------------------------------------------------------- Gaussian DP
def _jax_gdp_conversion(ins, outs, delta, alpha=0.05, tests="both") -> float:
    """jax-privacy's Gaussian-DP estimate from mia's parts: the hull's corners, rates bounded at alpha / (2H),
    corners with a bound >= 1 - delta dropped, the largest |mu| (a negative mu counts: the reversed test, with the
    same upper bounds), its epsilon at delta capped at 100. ``tests="reversed"``: the largest -mu only (0 if none is
    positive), what the reversed tests alone show."""
    t, fp, fn = _hull(ins, outs)
    a = alpha / (2 * len(t))
    fpr, fnr = clopper_pearson_upper(fp, len(outs), a), clopper_pearson_upper(fn, len(ins), a)
    ok = np.maximum(fpr, fnr) < 1 - delta
    mu = mu_from_rates(fpr[ok], fnr[ok])
    shown = np.abs(mu) if tests == "both" else np.maximum(-mu, 0.0)
    return min(gdp_epsilon(float(np.max(shown)) if ok.any() else 0.0, delta), 100.0)


# the score sets whose best hull test for jax-privacy points the right way (members above) at delta 1e-5 and 0.1;
# on the others its largest |mu| is a reversed test's, at least at delta 1e-5
RIGHT_WAY = {"coarse ties", "fpr 0", "all tied", "low tail", "large"}


@pytest.mark.parametrize("name", SETS)
def test_gdp_estimate_against_jax_privacy(name):
    """jax-privacy's number is always the larger of mia's estimate (``gdp_epsilon_estimate``, threshold="hull": the
    tests "member iff score >= t" at the hull's corners) and what the same corners' reversed tests show (a negative
    mu, bounded on the wrong side: ``_jax_gdp_conversion(tests="reversed")``). So it equals mia's where its best test
    points the right way, and is larger where a reversed test wins (mia's estimate ignores those); the whole
    conversion above gives it too."""
    ins, outs = SETS[name]
    s, y = _pooled(ins, outs)
    auditor = Auditor(ins, outs)
    for delta in (1e-5, 0.1):
        want = auditor.epsilon_from_gdp(0.05, delta)
        ours = gdp_epsilon_estimate(s, y, delta=delta, threshold="hull")
        reversed_tests = _jax_gdp_conversion(ins, outs, delta, tests="reversed")
        assert max(ours, reversed_tests) == pytest.approx(want, abs=1e-6), (delta, ours, reversed_tests)
        assert _jax_gdp_conversion(ins, outs, delta) == pytest.approx(want, abs=1e-6)
        if name in RIGHT_WAY:
            assert ours == pytest.approx(want, abs=1e-6) and reversed_tests <= ours, delta
        elif delta == 1e-5:
            assert ours < want - 1 and reversed_tests == pytest.approx(want, abs=1e-6), (ours, want)
    if name in ("fpr 0", "large"):
        assert ours > 1


def test_gdp_estimate_without_signal_differs_from_jax_privacy():
    """Members and non-members from one distribution (no signal: the true mu is 0). mia's estimate is 0 in at least
    95% of cases; jax-privacy's reversed tests, bounded on the wrong side, make its median epsilon large."""
    rng = np.random.default_rng(1)
    ours, theirs = [], []
    for _ in range(40):
        ins, outs = rng.normal(size=100), rng.normal(size=100)
        s, y = _pooled(ins, outs)
        ours.append(gdp_epsilon_estimate(s, y, delta=1e-5, threshold="hull"))
        theirs.append(Auditor(ins, outs).epsilon_from_gdp(0.05, 1e-5))
    assert np.mean(np.array(ours) > 0) <= 0.05 and np.median(theirs) > 3


def test_gdp_mu_is_dp_accountings_gaussian_sigma():
    """jax-privacy's f-DP audit tests the Gaussian curve through (eps, delta), via dp_accounting's noise multiplier:
    mia's gdp_epsilon inverts the same curve."""
    from dp_accounting import get_sigma_gaussian

    for eps in (0.1, 1.0, 4.0, 16.0):
        for delta in (1e-6, 1e-3):
            assert gdp_epsilon(1 / get_sigma_gaussian(eps, delta), delta) == pytest.approx(eps, rel=1e-8)
    assert math.isfinite(gdp_epsilon(40.0, 1e-5))  # no cap at 100 (jax-privacy's GDP estimate caps there)
