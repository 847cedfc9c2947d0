"""Metrics against slow plain references: loop bootstrap, brute-force threshold scan, scipy's Mann-Whitney."""
import numpy as np
import pytest
from scipy.stats import mannwhitneyu, rankdata
from sklearn.metrics import roc_auc_score, roc_curve

from mia import metrics as M


def _data(n1=150, n0=170, shift=0.5, seed=0, ties=False):
    rng = np.random.default_rng(seed)
    s = np.concatenate([rng.normal(shift, 1, n1), rng.normal(0, 1, n0)])
    if ties:
        s = np.round(s, 1)
    y = np.concatenate([np.ones(n1, int), np.zeros(n0, int)])
    return s, y


def _brute_tpr(s, y, fpr):
    """Scan every threshold t (predict member iff s >= t), keep the best TPR with FPR <= fpr."""
    best = 0.0
    for t in np.concatenate([np.unique(s), [np.inf]]):
        f = ((s >= t) & (y == 0)).sum() / (y == 0).sum()
        if f <= fpr + 1e-12:
            best = max(best, ((s >= t) & (y == 1)).sum() / (y == 1).sum())
    return best


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("fpr", [0.0, 0.01, 0.001, 0.05, 0.3])
def test_tpr_at_fpr_equals_brute_force(ties, fpr):
    s, y = _data(ties=ties, seed=3)
    want = _brute_tpr(s, y, fpr)
    assert M.tpr_at_fpr(s, y, fpr) == pytest.approx(want)
    assert M._tpr_rows(s[None], y[None], fpr)[0] == pytest.approx(want)


@pytest.mark.parametrize("ties", [False, True])
def test_rank_auc_equals_sklearn(ties):
    rng = np.random.default_rng(1)
    s_rn = np.round(rng.normal(size=(20, 60)), 1 if ties else 8)
    y_rn = (rng.random((20, 60)) < 0.5).astype(int)
    want = [roc_auc_score(y, s) for s, y in zip(s_rn, y_rn)]
    np.testing.assert_allclose(M._auc_rows(s_rn, y_rn), want, atol=1e-12)


def _ranksum_auc(s, y):
    """AUC = Mann-Whitney U / (n1 n0) from mid-ranks (ties count 1/2); sklearn's roc_auc_score, 50x faster."""
    r = rankdata(s)
    n1, n0 = int(y.sum()), int(len(y) - y.sum())
    return (r[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0)


def _roc_curve_tpr(s, y, fpr):
    """TPR@FPR read off sklearn's ROC curve: the largest TPR among its points with FPR <= fpr."""
    f, t, _ = roc_curve(y, s)
    return t[f <= fpr + 1e-12].max()


def _loop_bootstrap(s, y, n_resamples, seed, stratified, fpr=0.05):
    """Plain loop over the same resamples ``M.bootstrap`` draws: ``default_rng(seed)`` gives one [R, n] index matrix
    (pooled), or one [R, n1] matrix of member positions then one [R, n0] of non-member positions (stratified);
    each resample is scored with the rank-sum AUC and the scalar TPR, a single-class resample is dropped.
    Returns (auc_se, tpr_se, auc_ci) with SEs as std(ddof=1) and the 95% percentile CI of the AUC."""
    rng = np.random.default_rng(seed)
    pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
    if stratified:
        draw_pos = rng.integers(0, len(pos), (n_resamples, len(pos)))
        draw_neg = rng.integers(0, len(neg), (n_resamples, len(neg)))
        rows = [np.concatenate([pos[draw_pos[r]], neg[draw_neg[r]]]) for r in range(n_resamples)]
    else:
        rows = list(rng.integers(0, len(y), (n_resamples, len(y))))
    aucs, tprs = [], []
    for idx in rows:
        if y[idx].min() == y[idx].max():
            continue
        aucs.append(_ranksum_auc(s[idx], y[idx]))
        tprs.append(_roc_curve_tpr(s[idx], y[idx], fpr))
    return np.std(aucs, ddof=1), np.std(tprs, ddof=1), tuple(np.quantile(aucs, [0.025, 0.975]))


@pytest.mark.parametrize("stratified", [True, False])
def test_bootstrap_se_matches_plain_loop(stratified):
    # imbalanced classes, so the pooled resamples (class counts vary) and the stratified ones (fixed) differ
    s, y = _data(n1=60, n0=300)
    b = M.bootstrap(s, y, n_resamples=600, seed=3, stratified=stratified, fprs=(0.05,))
    auc_se, tpr_se, (ci_lo, ci_hi) = _loop_bootstrap(s, y, 600, 3, stratified)
    assert b["auc_se"] == pytest.approx(auc_se, rel=1e-9)
    assert b["tpr_at_5pct_fpr_se"] == pytest.approx(tpr_se, rel=1e-9)
    assert (b["auc_ci_low"], b["auc_ci_high"]) == pytest.approx((ci_lo, ci_hi), rel=1e-9)
    assert b["auc_ci_low"] < b["auc"] < b["auc_ci_high"]
    assert b["auc"] == pytest.approx(roc_auc_score(y, s))
    assert (b["n"], b["n_members"], b["n_nonmembers"], b["n_resamples"]) == (360, 60, 300, 600)
    if not stratified:  # the legacy function is this pooled AUC SE by default, and is seeded
        assert M.bootstrap_auc_se(s, y, n_resamples=600, seed=3) == pytest.approx(auc_se, rel=1e-9)
        assert M.bootstrap_auc_se(s, y, n_resamples=300, seed=4) == M.bootstrap_auc_se(s, y, n_resamples=300, seed=4)


def test_zero_bootstrap_resamples_give_point_estimates_and_no_se():
    """n_resamples=0 (``--bootstrap 0``): AUC and TPRs as usual, every SE and CI None; the table leaves SE blank."""
    from mia.report import metrics_table

    s, y = _data(n1=30, n0=30)
    b = M.bootstrap(s, y, n_resamples=0)
    assert b["auc"] == pytest.approx(roc_auc_score(y, s)) and b["n_resamples"] == 0
    assert b["auc_se"] is None and b["auc_ci_low"] is None and b["tpr_at_1pct_fpr_se"] is None
    rows = M.metric_rows({"a": s}, y, n_resamples=0)
    assert rows[0]["auc_se"] is None and rows[0]["auc"] == pytest.approx(b["auc"])
    assert len(metrics_table(rows).splitlines()[-1].split()) == 4  # name, AUC, TPR@1%, TPR@0.1%: no SE
    with pytest.raises(ValueError, match="n_resamples"):
        M.bootstrap(s, y, n_resamples=-1)


def test_bootstrap_is_seeded_and_fast():
    import time

    s, y = _data(n1=1000, n0=1000)
    t0 = time.perf_counter()
    a = M.bootstrap(s, y, n_resamples=1000, seed=7)
    assert time.perf_counter() - t0 < 10
    assert a == M.bootstrap(s, y, n_resamples=1000, seed=7)
    assert set(a) >= {"auc", "auc_se", "tpr_at_1pct_fpr", "tpr_at_0.1pct_fpr", "tpr_at_1pct_fpr_ci_high"}


def test_auc_vs_chance_matches_scipy():
    for ties in (False, True):
        s, y = _data(shift=0.2, ties=ties, seed=5)
        want = mannwhitneyu(s[y == 1], s[y == 0], alternative="greater", method="asymptotic").pvalue
        assert M.auc_vs_chance(s, y)["p_value"] == pytest.approx(want, rel=1e-9)


def test_auc_vs_chance_null_rate():
    rng = np.random.default_rng(0)
    p = [M.auc_vs_chance(rng.normal(size=100), np.r_[np.ones(50), np.zeros(50)])["p_value"] for _ in range(400)]
    assert 0.02 <= np.mean(np.array(p) < 0.05) <= 0.09


def test_paired_test_detects_better_method():
    rng = np.random.default_rng(0)
    y = np.r_[np.ones(200, int), np.zeros(200, int)]
    signal = y * 1.0
    good = signal + rng.normal(0, 0.7, 400)
    bad = signal + rng.normal(0, 2.0, 400)
    r = M.paired_bootstrap_test(good, bad, y, n_resamples=500, seed=1)
    assert r["delta"] > 0 and r["p_value"] < 0.01
    assert M.paired_bootstrap_test(good, bad, y, n_resamples=500, seed=1, alternative="greater")["p_value"] < 0.01
    assert M.paired_bootstrap_test(good, bad, y, n_resamples=500, seed=1, alternative="less")["p_value"] > 0.5


def test_paired_test_nominal_rate_for_equal_methods():
    """Two equally good methods (independent noise): the 5% test rejects about 5% of the time."""
    rng = np.random.default_rng(42)
    y = np.r_[np.ones(60, int), np.zeros(60, int)]
    p = []
    for i in range(150):
        a = y * 0.8 + rng.normal(size=120)
        b = y * 0.8 + rng.normal(size=120)
        p.append(M.paired_bootstrap_test(a, b, y, n_resamples=300, seed=i)["p_value"])
    p = np.array(p)
    # under the null p is ~uniform: rejection rates within ~2.5 binomial SDs (150 draws) of the level, both sides
    # (a test that never rejects, e.g. uncentred replicates, fails the lower bound)
    assert 0.015 <= np.mean(p < 0.05) <= 0.10
    assert 0.05 <= np.mean(p < 0.10) <= 0.17
    assert 0.40 <= np.mean(p < 0.50) <= 0.60


def test_errors_name_ids():
    s = np.array([0.1, np.nan, 0.3, np.inf])
    y = np.array([1, 0, 1, 0])
    with pytest.raises(M.MetricError, match="id.*b, d"):
        M.bootstrap(s, y, ids=["a", "b", "c", "d"])
    with pytest.raises(M.MetricError, match="positions"):
        M.auc(s, y)
    with pytest.raises(M.MetricError, match="both"):
        M.auc([0.1, 0.2], [1, 1])


def test_summary_row_keys():
    s, y = _data()
    row = M.summary_row("x", s, y, n_resamples=200)
    assert {"method", "auc", "auc_se", "tpr_at_1pct_fpr", "n", "p_auc_gt_half"} <= set(row)
    # values from independent references: sklearn AUC, the brute-force threshold scan, scipy's Mann-Whitney, and
    # the plain-loop pooled bootstrap (CheckMIABench's SE) on the same seed
    auc_se, _, (ci_lo, ci_hi) = _loop_bootstrap(s, y, 200, 0, stratified=False)
    assert row["method"] == "x" and row["n"] == 320
    assert row["auc"] == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert row["auc_se"] == pytest.approx(auc_se, rel=1e-9)
    assert (row["auc_ci_low"], row["auc_ci_high"]) == pytest.approx((ci_lo, ci_hi), rel=1e-9)
    assert row["tpr_at_1pct_fpr"] == pytest.approx(_brute_tpr(s, y, 0.01))
    assert row["tpr_at_0.1pct_fpr"] == pytest.approx(_brute_tpr(s, y, 0.001))
    want_p = mannwhitneyu(s[y == 1], s[y == 0], alternative="greater", method="asymptotic").pvalue
    assert row["p_auc_gt_half"] == pytest.approx(want_p, rel=1e-9) and row["p_auc_gt_half"] < 1e-3
    assert M.bonferroni_significant([0.01, 0.02, 0.3], alpha=0.05) == [True, False, False]


def test_metric_rows_with_delta_add_the_epsilon_bound():
    from mia.metrics import epsilon_lower_bound, metric_rows

    rng = np.random.default_rng(3)
    y = np.r_[np.ones(200), np.zeros(200)].astype(int)
    s = {"strong": y * 3.0 + rng.normal(size=400), "none": rng.normal(size=400)}
    rows = {r["method"]: r for r in metric_rows(s, y, n_resamples=10, delta=1e-5, alpha=0.1)}
    for k in s:
        assert rows[k]["eps_lower"] == epsilon_lower_bound(s[k], y, delta=1e-5, alpha=0.1)
        assert (rows[k]["delta"], rows[k]["alpha"]) == (1e-5, 0.1)
    assert rows["strong"]["eps_lower"] > 1 and rows["none"]["eps_lower"] < rows["strong"]["eps_lower"]
    assert all("eps_lower" not in r for r in metric_rows(s, y, n_resamples=10))
    with pytest.raises(M.MetricError, match="delta"):
        metric_rows(s, y, delta=1.5)
