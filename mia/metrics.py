"""Membership metrics. Every function takes ``scores`` with HIGHER = MORE LIKELY MEMBER and ``labels`` with 1 = member.

- ``roc``: sklearn ``roc_curve`` (ties count 1/2 in the trapezoid AUC).
- ``tpr_at_fpr``: the largest TPR whose FPR is at most ``fpr`` (no interpolation), as CheckMIABench ``plot_ROC``.
- ``bootstrap_auc_se``: seeded bootstrap standard error of the AUC (std with ddof=1 over resamples).
- ``bootstrap``: seeded bootstrap (stratified by default) of AUC and TPR@FPR: SEs and percentile confidence intervals.
- ``paired_bootstrap_test``: is method A better than method B on the same examples? (paired bootstrap p-value)
- ``auc_vs_chance``: one-sided Mann-Whitney test of AUC > 0.5 (normal approximation with tie and continuity correction).
- ``bonferroni_significant`` / ``holm_significant``: which of a family of tests hold at a family-wise level.
- ``clopper_pearson_upper`` / ``clopper_pearson``: exact binomial confidence bounds.
- ``epsilon_bound`` / ``epsilon_lower_bound``: the differential-privacy epsilon that the attack's (FPR, FNR) rules out,
  with Clopper-Pearson confidence (see the section "Epsilon lower bounds" below and docs/auditing.md).

All bootstraps are vectorised: each resample's AUC is the rank-sum (Mann-Whitney) statistic computed with midranks
over a [R, n] matrix, which equals sklearn's trapezoid AUC exactly (ties count 1/2); TPR@FPR of a resample is the
fraction of its members scoring strictly above its (k+1)-th highest non-member, k = floor(FPR * n_nonmembers), which
equals the ROC-point definition above.
"""
from __future__ import annotations

# scipy.stats and sklearn.metrics are imported by the functions that use them: `mia`'s CLI starts about 1 s
# sooner without them (`mia score` needs neither unless it reports metrics)

import dataclasses
import math
from typing import Optional, Sequence, Union

import numpy as np


class MetricError(ValueError):
    pass


N_RESAMPLES = 1000  # the bootstrap resamples every SE and CI uses unless told otherwise (``--bootstrap``)
_EPS = 1e-12  # FPR slack so that e.g. 10/1000 counts as <= 0.01


def checked_scores(scores, labels, ids: Optional[Sequence] = None) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels)
    if s.shape != y.shape or s.ndim != 1:
        raise MetricError(f"scores {s.shape} and labels {y.shape} must be 1-D of equal length")
    if not np.isin(y, (0, 1)).all():
        raise MetricError("labels must be 0 (non-member) or 1 (member)")
    if len(np.unique(y)) < 2:
        raise MetricError("need both members (1) and non-members (0) to compute ROC metrics")
    bad = np.flatnonzero(~np.isfinite(s))
    if len(bad):
        if ids is not None:
            names = [str(ids[i]) for i in bad[:10]]
            where = f"for id(s) {', '.join(names)}"
        else:
            where = f"at positions {bad[:10].tolist()}"
        raise MetricError(f"{len(bad)} non-finite score(s) {where}" + (" ..." if len(bad) > 10 else ""))
    return s, y.astype(int)


def roc(scores, labels, ids=None) -> tuple[np.ndarray, np.ndarray]:
    """(fpr, tpr) arrays of the ROC curve."""
    from sklearn.metrics import roc_curve

    s, y = checked_scores(scores, labels, ids)
    fpr, tpr, _ = roc_curve(y, s)
    return fpr, tpr


def auc(scores, labels, ids=None) -> float:
    """ROC AUC: the rank-sum (Mann-Whitney) statistic with midranks, equal to sklearn's ``roc_auc_score`` (ties count
    1/2) without its input validation, which cost several ms per call (the experiments compute hundreds)."""
    s, y = checked_scores(scores, labels, ids)
    return float(_auc_rows(s[None], y[None])[0])


def tpr_at_fpr(scores, labels, fpr: float = 0.01, ids=None) -> float:
    """Largest TPR among ROC points whose FPR <= ``fpr``: the fraction of members scoring strictly above the (k+1)-th
    highest non-member score, k = floor(FPR x non-members) (the module docstring), without building the curve."""
    s, y = checked_scores(scores, labels, ids)
    return float(_tpr_rows(s[None], y[None], fpr)[0])


# ----------------------------------------------------------------------------------------------- vectorised core
def _auc_rows(s_rn: np.ndarray, y_rn: np.ndarray) -> np.ndarray:
    """AUC of each row: (sum of member midranks - n1(n1+1)/2) / (n1 n0). NaN for a row with one class only."""
    from scipy.stats import rankdata

    ranks = rankdata(s_rn, axis=1)  # 'average' = midranks, so ties count 1/2
    n1 = y_rn.sum(1).astype(np.float64)
    n0 = y_rn.shape[1] - n1
    with np.errstate(invalid="ignore", divide="ignore"):
        return ((ranks * y_rn).sum(1) - n1 * (n1 + 1) / 2) / (n1 * n0)


def _tpr_rows(s_rn: np.ndarray, y_rn: np.ndarray, fpr: float) -> np.ndarray:
    """TPR@FPR of each row (largest TPR over ROC points with FPR <= fpr). NaN for a row with one class only."""
    pos = y_rn.astype(bool)
    n1 = pos.sum(1)
    n0 = (~pos).sum(1)
    neg_desc = -np.sort(-np.where(pos, -np.inf, s_rn), axis=1)  # non-member scores, descending, -inf padded
    k = np.floor(n0 * (fpr + _EPS)).astype(int)  # how many non-members may score at or above the threshold
    full = k >= n0
    v = np.take_along_axis(neg_desc, np.minimum(k, s_rn.shape[1] - 1)[:, None], axis=1)[:, 0]
    above = (pos & (s_rn > v[:, None])).sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(full, 1.0, above / n1)
    return np.where((n1 == 0) | (n0 == 0), np.nan, out)


def _resample_idx(y: np.ndarray, n_resamples: int, rng: np.random.Generator, stratified: bool) -> np.ndarray:
    """[R, n] indices into the data: per class (stratified) or over the pooled set."""
    if stratified:
        pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
        return np.concatenate([pos[rng.integers(0, len(pos), (n_resamples, len(pos)))],
                               neg[rng.integers(0, len(neg), (n_resamples, len(neg)))]], axis=1)
    return rng.integers(0, len(y), (n_resamples, len(y)))


def _chunks(n_resamples: int, n: int, budget: int = 4_000_000):
    step = max(1, budget // max(n, 1))
    for lo in range(0, n_resamples, step):
        yield min(step, n_resamples - lo)


def _metric_key(fpr: float) -> str:
    """0.01 -> 'tpr_at_1pct_fpr', 0.001 -> 'tpr_at_0.1pct_fpr'."""
    pct = fpr * 100
    return f"tpr_at_{pct:g}pct_fpr"


def bootstrap(scores, labels, *, n_resamples: int = N_RESAMPLES, seed: int = 0, stratified: bool = True,
              fprs: Sequence[float] = (0.01, 0.001), confidence: float = 0.95, ids=None) -> dict:
    """Point estimates, bootstrap SEs (std, ddof=1) and percentile CIs of AUC and TPR@each FPR.

    Returns a flat dict: ``auc, auc_se, auc_ci_low, auc_ci_high`` and the same four for each ``tpr_at_{x}pct_fpr``,
    plus ``n, n_members, n_nonmembers, n_resamples``. ``stratified`` resamples members and non-members separately
    (class counts fixed); ``stratified=False`` resamples the pooled set as CheckMIABench does (scipy.stats.bootstrap),
    dropping resamples that contain a single class. ``n_resamples=0``: point estimates only, every SE and CI None.
    """
    if isinstance(n_resamples, bool) or not isinstance(n_resamples, (int, np.integer)) or n_resamples < 0:
        raise ValueError(f"n_resamples must be an integer >= 0, got {n_resamples!r}")
    s, y = checked_scores(scores, labels, ids)
    rng = np.random.default_rng(seed)
    boot = {"auc": []} | {_metric_key(f): [] for f in fprs}
    for r in _chunks(n_resamples, len(s)):
        idx = _resample_idx(y, r, rng, stratified)
        s_rn, y_rn = s[idx], y[idx]
        boot["auc"].append(_auc_rows(s_rn, y_rn))
        for f in fprs:
            boot[_metric_key(f)].append(_tpr_rows(s_rn, y_rn, f))
    point = {"auc": auc(s, y)} | {_metric_key(f): tpr_at_fpr(s, y, f) for f in fprs}
    a = (1 - confidence) / 2
    out: dict = {}
    for name, parts in boot.items():
        out[name] = point[name]
        if not n_resamples:  # no bootstrap asked for: no SE or CI (absent, not NaN)
            out[f"{name}_se"] = out[f"{name}_ci_low"] = out[f"{name}_ci_high"] = None
            continue
        vals = np.concatenate(parts)
        vals = vals[np.isfinite(vals)]
        out[f"{name}_se"] = float(np.std(vals, ddof=1)) if len(vals) > 1 else float("nan")
        lo, hi = np.quantile(vals, [a, 1 - a]) if len(vals) else (np.nan, np.nan)
        out[f"{name}_ci_low"], out[f"{name}_ci_high"] = float(lo), float(hi)
    out.update(n=int(len(s)), n_members=int(y.sum()), n_nonmembers=int(len(y) - y.sum()), n_resamples=int(n_resamples))
    return out


def bootstrap_auc_se(scores, labels, n_resamples: int = N_RESAMPLES, seed: int = 0, stratified: bool = False) -> float:
    """Standard error of the AUC from ``n_resamples`` seeded bootstrap resamples (pooled, or per-class if
    stratified)."""
    return bootstrap(scores, labels, n_resamples=n_resamples, seed=seed, stratified=stratified, fprs=())["auc_se"]


def paired_bootstrap_test(scores_a, scores_b, labels, *, metric: str = "auc", n_resamples: int = N_RESAMPLES,
                          seed: int = 0, stratified: bool = True, alternative: str = "two-sided", ids=None) -> dict:
    """Paired bootstrap test of metric(A) vs metric(B) on the SAME examples (each resample is shared by A and B).

    ``metric``: "auc" or an FPR such as 0.01 for TPR@FPR. With Δ = m(A) − m(B) and Δ*_r its bootstrap replicates,
    the null distribution is the centred one, Δ*_r − Δ (Hall & Wilson 1991), and
      two-sided: p = (1 + #{|Δ*_r − Δ| >= |Δ|}) / (R + 1);  "greater" (A better): p = (1 + #{Δ*_r − Δ >= Δ}) / (R + 1).
    Returns ``{"delta", "se", "ci_low", "ci_high", "p_value", "metric", "alternative", "n_resamples"}`` (95% percentile
    CI).
    """
    if alternative not in ("two-sided", "greater", "less"):
        raise MetricError(f"alternative must be 'two-sided', 'greater' or 'less', got {alternative!r}")
    sa, y = checked_scores(scores_a, labels, ids)
    sb, _ = checked_scores(scores_b, labels, ids)
    if metric == "auc":
        stat = _auc_rows
        delta = auc(sa, y) - auc(sb, y)
    else:
        f = float(metric)
        stat = lambda s_rn, y_rn: _tpr_rows(s_rn, y_rn, f)  # noqa: E731
        delta = tpr_at_fpr(sa, y, f) - tpr_at_fpr(sb, y, f)
    rng = np.random.default_rng(seed)
    reps = []
    for r in _chunks(n_resamples, 2 * len(y)):
        idx = _resample_idx(y, r, rng, stratified)
        reps.append(stat(sa[idx], y[idx]) - stat(sb[idx], y[idx]))
    d = np.concatenate(reps)
    d = d[np.isfinite(d)]
    c = d - delta
    if alternative == "two-sided":
        extreme = np.abs(c) >= abs(delta) - 1e-15
    elif alternative == "greater":
        extreme = c >= delta - 1e-15
    else:
        extreme = c <= delta + 1e-15
    p = (1 + int(extreme.sum())) / (len(d) + 1)
    lo, hi = np.quantile(d, [0.025, 0.975])
    return {"delta": float(delta), "se": float(np.std(d, ddof=1)), "ci_low": float(lo), "ci_high": float(hi),
            "p_value": float(p), "metric": metric, "alternative": alternative, "n_resamples": int(n_resamples)}


def auc_vs_chance(scores, labels, ids=None) -> dict:
    """One-sided test of H0: AUC = 0.5 against H1: AUC > 0.5 (members score higher).

    Mann-Whitney U = AUC·n1·n0 with the normal approximation, tie-corrected variance
    n1·n0/12·((n+1) − Σ(t³−t)/(n(n−1))) and a 0.5 continuity correction: the same p-value as
    ``scipy.stats.mannwhitneyu(members, nonmembers, alternative="greater", method="asymptotic")``.
    Returns ``{"auc", "z", "p_value"}``.
    """
    from scipy.stats import norm, rankdata

    s, y = checked_scores(scores, labels, ids)
    n1, n0 = int(y.sum()), int(len(y) - y.sum())
    n = n1 + n0
    ranks = rankdata(s)
    u = ranks[y == 1].sum() - n1 * (n1 + 1) / 2
    _, counts = np.unique(s, return_counts=True)
    tie = float((counts.astype(np.float64) ** 3 - counts).sum())
    var = n1 * n0 / 12 * ((n + 1) - tie / (n * (n - 1)))
    if var <= 0:  # every score equal
        return {"auc": 0.5, "z": 0.0, "p_value": 1.0}
    z = (u - n1 * n0 / 2 - 0.5) / math.sqrt(var)
    return {"auc": float(u / (n1 * n0)), "z": float(z), "p_value": float(norm.sf(z))}


def summary_row(method: str, scores, labels, n_resamples: int = N_RESAMPLES, seed: int = 0, *, ids=None,
                stratified: bool = False) -> dict:
    """{"method", "auc", "auc_se", "tpr_at_1pct_fpr", "n", ...} plus CIs, TPR@0.1%FPR and the p-value vs chance.

    ``auc_se`` uses the pooled bootstrap by default, as CheckMIABench reports it.
    """
    b = bootstrap(scores, labels, n_resamples=n_resamples, seed=seed, stratified=stratified, ids=ids)
    row = {"method": method}
    row.update({k: b[k] for k in ("auc", "auc_se", "auc_ci_low", "auc_ci_high", "tpr_at_1pct_fpr", "tpr_at_1pct_fpr_se",
                                  "tpr_at_0.1pct_fpr", "tpr_at_0.1pct_fpr_se")})
    row["p_auc_gt_half"] = auc_vs_chance(scores, labels, ids=ids)["p_value"]
    row["n"] = b["n"]
    return row


def metric_rows(scores, labels, ids=None, n_resamples: int = N_RESAMPLES, seed: int = 0, kind: str = "attack",
                *, delta: Optional[float] = None, alpha: float = 0.05, **extra) -> list[dict]:
    """One ``summary_row`` per method of ``scores`` ({method: [N]}), on its finite scores; ``n_nonfinite`` counts
    the NaN/inf ones dropped (present only when some were). A method whose finite scores lack members or
    non-members gets a row with ``note`` saying why and no metrics. ``kind`` and ``extra`` go into every row.
    ``delta``: also ``eps_lower``, :func:`epsilon_lower_bound` of the scores at (``delta``, confidence 1 - ``alpha``,
    Bonferroni over thresholds), with ``delta`` and ``alpha`` recorded in the row."""
    if delta is not None and not 0 <= float(delta) < 1:
        raise MetricError(f"delta must be in [0, 1), got {delta!r}")
    labels = np.asarray(labels)
    rows = []
    for name, s in scores.items():
        s = np.asarray(s, np.float64)
        ok = np.isfinite(s)
        base = {"method": name, "kind": kind, **extra}
        if not ok.any():
            rows.append({**base, "n_nonfinite": int(len(s)), "note": f"all {len(s)} scores are non-finite (NaN/inf)"})
            continue
        present = set(labels[ok].tolist())
        if len(present) < 2:
            which = "members" if present == {1} else "non-members"
            rows.append({**base, "n_nonfinite": int((~ok).sum()), "note": f"the finite scores are all of {which}"})
            continue
        r = summary_row(name, s[ok], labels[ok], n_resamples=n_resamples, seed=seed,
                        ids=None if ids is None else [i for i, k in zip(ids, ok) if k])
        r.update({"kind": kind, **extra})
        if delta is not None:
            r.update(eps_lower=epsilon_lower_bound(s[ok], labels[ok], delta=float(delta), alpha=alpha),
                     delta=float(delta), alpha=float(alpha))
        if (~ok).any():
            r["n_nonfinite"] = int((~ok).sum())
        rows.append(r)
    return rows


def bonferroni_significant(p_values: Sequence[float], alpha: float = 0.05) -> list[bool]:
    """Which of m tests are significant at family-wise level ``alpha`` (p < alpha / m)."""
    m = max(len(p_values), 1)
    return [p < alpha / m for p in p_values]


def holm_significant(p_values: Sequence[float], alpha: float = 0.05) -> list[bool]:
    """Which of m hypotheses Holm's step-down procedure rejects at family-wise level ``alpha``: with the p-values
    sorted ascending, p_(1) <= alpha / m, p_(2) <= alpha / (m - 1), ... up to the first that fails. The chance of
    rejecting any true hypothesis is at most ``alpha`` whatever their dependence; it rejects everything Bonferroni
    (p <= alpha / m) rejects, and more."""
    p = np.asarray(p_values, np.float64)
    if p.ndim != 1 or np.isnan(p).any():
        raise MetricError(f"p-values must be a 1-D list of numbers, got {p_values!r}")
    out = np.zeros(len(p), bool)
    for rank, i in enumerate(np.argsort(p, kind="stable")):
        if p[i] > alpha / (len(p) - rank):
            break
        out[i] = True
    return out.tolist()


# ----------------------------------------------------------------------------------------------- epsilon lower bounds
# An (epsilon, delta)-DP training algorithm limits every membership test on one example: with the test's false
# positive rate FPR (non-member called member) and false negative rate FNR (member called non-member),
#     FPR + e^eps * FNR >= 1 - delta    and    FNR + e^eps * FPR >= 1 - delta
# (the hypothesis-testing view of DP; Kairouz et al. 2015; used for audits by Jagielski et al. 2020, Nasr et al. 2021).
# An attack whose rates, even at their upper confidence bounds, break these for some eps shows that the training
# cannot be (eps, delta)-DP for that eps: with confidence 1 - alpha,
#     eps >= max(log((1 - delta - FPR_hi) / FNR_hi), log((1 - delta - FNR_hi) / FPR_hi)).
# The test is "member iff score >= threshold". Choosing the best threshold on the same data is a multiple
# comparison: ``threshold="bonferroni"`` pays for every candidate threshold, ``"split"`` chooses it on one half of
# the data and bounds on the other, a number fixes it in advance.
# Clopper-Pearson treats the examples as independent trials of the training on neighbouring datasets (one target
# example per training run, as in those audits). Many canaries scored in ONE run are not independent trials: there
# the bound is the common heuristic, and ``mia.privacy.one_run.one_run_audit`` is the bound with a proof.

def clopper_pearson_upper(k, n, alpha: float) -> np.ndarray:
    """One-sided upper (1 - alpha) Clopper-Pearson bound on a binomial rate from ``k`` successes in ``n`` trials:
    the p with P[Binomial(n, p) <= k] = alpha (1 when k = n). Vectorised over ``k`` (and ``n``)."""
    from scipy.stats import beta as beta_dist

    k, n = np.asarray(k, np.float64), np.asarray(n, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        hi = beta_dist.ppf(1 - alpha, k + 1, np.maximum(n - k, 1e-300))
    return np.where(k >= n, 1.0, hi)


def clopper_pearson(k, n, alpha: float = 0.05) -> tuple:
    """Two-sided (1 - alpha) Clopper-Pearson interval (lo, hi) of a binomial rate (alpha / 2 in each tail)."""
    from scipy.stats import beta as beta_dist

    k, n = np.asarray(k, np.float64), np.asarray(n, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        lo = np.where(k <= 0, 0.0, beta_dist.ppf(alpha / 2, np.maximum(k, 1e-300), n - k + 1))
    return lo, clopper_pearson_upper(k, n, alpha / 2)


def epsilon_from_rates(fpr, fnr, delta: float) -> np.ndarray:
    """The largest eps that (FPR, FNR) rules out for (eps, delta)-DP: max over the two inequalities above, >= 0.
    Vectorised; rates of 0 give inf where the other side leaves room (1 - delta - other > 0)."""
    fpr, fnr = np.asarray(fpr, np.float64), np.asarray(fnr, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(1 - delta - fpr > 0, np.log(np.maximum(1 - delta - fpr, 1e-300)) - np.log(fnr), 0.0)
        b = np.where(1 - delta - fnr > 0, np.log(np.maximum(1 - delta - fnr, 1e-300)) - np.log(fpr), 0.0)
    return np.maximum(np.maximum(a, b), 0.0)


@dataclasses.dataclass(frozen=True)
class EpsilonBound:
    """An epsilon lower bound and the test that gave it.

    ``epsilon``: with confidence 1 - ``alpha``, the scored training is not (eps, ``delta``)-DP for any eps below it
    (0: nothing ruled out). ``threshold``: the test "member iff score >= threshold" (None when nothing was ruled
    out); ``fpr``/``fnr``: its observed rates on the data it was evaluated on; ``fpr_upper``/``fnr_upper``: their
    one-sided Clopper-Pearson bounds used in the inequalities, each at confidence 1 - ``alpha_per_bound``.
    ``method``: "bonferroni", "hull", "split" or "fixed"; ``n_thresholds``: candidate thresholds paid for;
    ``n_members``/``n_nonmembers``: the examples the bound was computed on (half of them for "split").
    """

    epsilon: float
    threshold: Optional[float]
    fpr: float
    fnr: float
    fpr_upper: float
    fnr_upper: float
    delta: float
    alpha: float
    alpha_per_bound: float
    method: str
    n_thresholds: int
    n_members: int
    n_nonmembers: int


def threshold_counts(s: np.ndarray, y: np.ndarray) -> tuple:
    """(thresholds [K] descending distinct scores, FP [K], FN [K]) of the tests "member iff score >= t"."""
    t = np.unique(s)[::-1]
    pos, neg = np.sort(s[y == 1]), np.sort(s[y == 0])
    fp = len(neg) - np.searchsorted(neg, t, side="left")  # non-members scoring >= t
    fn = np.searchsorted(pos, t, side="left")  # members scoring < t
    return t, fp, fn


def roc_hull(t: np.ndarray, fp: np.ndarray, fn: np.ndarray, n1: int) -> tuple:
    """The tests at the vertices of the ROC curve's upper convex hull: (thresholds [H], FP [H], FN [H]).

    ``t``, ``fp``, ``fn`` as ``threshold_counts`` gives them (descending thresholds). The empty test
    (threshold +inf: nobody called a member) is added in front; points on a hull edge but not at a corner are
    dropped. This is the set of thresholds jax-privacy's ``CanaryScoreAuditor`` searches (docs/auditing.md)."""
    t = np.concatenate([[np.inf], t])
    x = np.concatenate([[0], fp]).astype(np.float64)  # ROC points (FP, TP), both non-decreasing
    y = n1 - np.concatenate([[n1], fn]).astype(np.float64)
    keep: list = []
    for i in range(len(t)):
        # drop the last kept point while it is not strictly above the segment from its predecessor to point i
        while len(keep) >= 2:
            a, b = keep[-2], keep[-1]
            if (x[b] - x[a]) * (y[i] - y[a]) - (y[b] - y[a]) * (x[i] - x[a]) < 0:
                break
            keep.pop()
        keep.append(i)
    k = np.asarray(keep)
    return t[k], x[k].astype(int), (n1 - y[k]).astype(int)


def _bound_at(fp, fn, n0: int, n1: int, delta: float, a: float) -> tuple:
    """(eps [K], FPR_hi [K], FNR_hi [K]) from counts, each rate bounded at one-sided level ``a``."""
    fpr_hi = clopper_pearson_upper(fp, n0, a)
    fnr_hi = clopper_pearson_upper(fn, n1, a)
    return epsilon_from_rates(fpr_hi, fnr_hi, delta), fpr_hi, fnr_hi


def _bound_result(eps, t, fp, fn, fpr_hi, fnr_hi, n0, n1, *, delta, alpha, a, method, n_thr) -> EpsilonBound:
    i = int(np.argmax(eps))
    e = float(eps[i])
    return EpsilonBound(epsilon=e, threshold=float(t[i]) if e > 0 else None, fpr=float(fp[i] / n0),
                        fnr=float(fn[i] / n1), fpr_upper=float(fpr_hi[i]), fnr_upper=float(fnr_hi[i]), delta=delta,
                        alpha=alpha, alpha_per_bound=a, method=method, n_thresholds=n_thr, n_members=n1,
                        n_nonmembers=n0)


def check_privacy_args(delta: float, alpha: float) -> tuple:
    d, a = float(delta), float(alpha)
    if not (0 <= d < 1) or not math.isfinite(d):
        raise MetricError(f"delta must be in [0, 1), got {delta!r}")
    if not (0 < a < 1):
        raise MetricError(f"alpha (1 - confidence) must be in (0, 1), got {alpha!r}")
    return d, a


def epsilon_bound(scores, labels, *, delta: float, alpha: float = 0.05,
                  threshold: Union[str, float] = "bonferroni", split_seed: int = 0, ids=None) -> EpsilonBound:
    """Lower bound on the DP epsilon of the training that the attack's scores rule out, with confidence 1 - alpha.

    ``scores`` [n] (higher = member), ``labels`` [n] (1 = member). Every test is "member iff score >= t"; its
    FPR and FNR are bounded above with one-sided Clopper-Pearson intervals, each at level alpha / 2 (so that both
    hold together with probability >= 1 - alpha), and put into the two hypothesis-testing inequalities of DP.
    ``threshold``:
      "bonferroni" (default)  the best of all K distinct score values as thresholds, each bound at alpha / (2K)
                              (valid for the maximum over thresholds; deterministic; uses all examples);
      "hull"                  jax-privacy's choice: only the H corners of the ROC curve's convex hull (the empty
                              test included, ``roc_hull``), each bound at alpha / (2H); H is chosen after seeing the
                              data, so this pays for fewer tests than it searches (docs/auditing.md);
      "split"                 members and non-members each split in half (seeded by ``split_seed``); the threshold
                              with the best bound on the first halves is evaluated on the second halves, at alpha / 2;
      a number                that threshold, fixed in advance, on all examples, at alpha / 2.
    The bound is 0 when no test rules anything out. It assumes the examples are independent trials (see the comment
    above); for canaries of one training run prefer ``mia.privacy.one_run.one_run_audit``.
    """
    s, y = checked_scores(scores, labels, ids)
    delta, alpha = check_privacy_args(delta, alpha)
    n1, n0 = int(y.sum()), int(len(y) - y.sum())
    if isinstance(threshold, str) and threshold in ("bonferroni", "hull"):
        t, fp, fn = threshold_counts(s, y)
        if threshold == "hull":
            t, fp, fn = roc_hull(t, fp, fn, n1)
        a = alpha / (2 * len(t))
        eps, fpr_hi, fnr_hi = _bound_at(fp, fn, n0, n1, delta, a)
        return _bound_result(eps, t, fp, fn, fpr_hi, fnr_hi, n0, n1, delta=delta, alpha=alpha, a=a,
                             method=threshold, n_thr=len(t))
    if isinstance(threshold, str) and threshold == "split":
        return _split_bound(s, y, delta, alpha, split_seed)
    if isinstance(threshold, str) or isinstance(threshold, bool):
        raise MetricError(f"threshold must be 'bonferroni', 'hull', 'split' or a number, got {threshold!r}")
    t = np.array([float(threshold)])
    if not np.isfinite(t).all():
        raise MetricError(f"threshold must be finite, got {threshold!r}")
    fp = np.array([int((s[y == 0] >= t[0]).sum())])
    fn = np.array([int((s[y == 1] < t[0]).sum())])
    eps, fpr_hi, fnr_hi = _bound_at(fp, fn, n0, n1, delta, alpha / 2)
    out = _bound_result(eps, t, fp, fn, fpr_hi, fnr_hi, n0, n1, delta=delta, alpha=alpha, a=alpha / 2,
                        method="fixed", n_thr=1)
    return dataclasses.replace(out, threshold=float(t[0]))


def _split_bound(s: np.ndarray, y: np.ndarray, delta: float, alpha: float, seed: int) -> EpsilonBound:
    """Choose the threshold on one half of each class, bound on the other half (see ``epsilon_bound``)."""
    rng = np.random.default_rng([int(seed), 0xE95])
    pos, neg = rng.permutation(np.flatnonzero(y == 1)), rng.permutation(np.flatnonzero(y == 0))
    if min(len(pos), len(neg)) < 2:
        raise MetricError("threshold='split' needs at least 2 members and 2 non-members")
    choose = np.concatenate([pos[: len(pos) // 2], neg[: len(neg) // 2]])
    test = np.concatenate([pos[len(pos) // 2:], neg[len(neg) // 2:]])
    t, fp, fn = threshold_counts(s[choose], y[choose])
    n1c, n0c = int(y[choose].sum()), int(len(choose) - y[choose].sum())
    eps_c, _, _ = _bound_at(fp, fn, n0c, n1c, delta, alpha / 2)
    best = float(t[int(np.argmax(eps_c))])
    st, yt = s[test], y[test]
    n1, n0 = int(yt.sum()), int(len(yt) - yt.sum())
    fp_t = np.array([int((st[yt == 0] >= best).sum())])
    fn_t = np.array([int((st[yt == 1] < best).sum())])
    eps, fpr_hi, fnr_hi = _bound_at(fp_t, fn_t, n0, n1, delta, alpha / 2)
    out = _bound_result(eps, np.array([best]), fp_t, fn_t, fpr_hi, fnr_hi, n0, n1, delta=delta, alpha=alpha,
                        a=alpha / 2, method="split", n_thr=1)
    return dataclasses.replace(out, threshold=best)


def epsilon_lower_bound(scores, labels, *, delta: float, alpha: float = 0.05,
                        threshold: Union[str, float] = "bonferroni", split_seed: int = 0, ids=None) -> float:
    """The epsilon of :func:`epsilon_bound` alone: with confidence 1 - alpha the training is not (eps, delta)-DP for
    any eps below it (0: nothing ruled out)."""
    return epsilon_bound(scores, labels, delta=delta, alpha=alpha, threshold=threshold, split_seed=split_seed,
                         ids=ids).epsilon
