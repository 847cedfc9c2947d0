"""Membership metrics. Every function takes ``scores`` with HIGHER = MORE LIKELY MEMBER and ``labels`` with 1 = member.

- ``roc``: sklearn ``roc_curve`` (ties count 1/2 in the trapezoid AUC).
- ``tpr_at_fpr``: the largest TPR whose FPR is at most ``fpr`` (no interpolation), as CheckMIABench ``plot_ROC``.
- ``bootstrap_auc_se``: seeded bootstrap standard error of the AUC (std with ddof=1 over resamples).
"""
from __future__ import annotations

import numpy as np
from sklearn.metrics import roc_auc_score, roc_curve


class MetricError(ValueError):
    pass


def _check(scores, labels) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels)
    if s.shape != y.shape or s.ndim != 1:
        raise MetricError(f"scores {s.shape} and labels {y.shape} must be 1-D of equal length")
    if not np.isin(y, (0, 1)).all():
        raise MetricError("labels must be 0 (non-member) or 1 (member)")
    if len(np.unique(y)) < 2:
        raise MetricError("need both members (1) and non-members (0) to compute ROC metrics")
    if not np.isfinite(s).all():
        raise MetricError(f"{int((~np.isfinite(s)).sum())} non-finite score(s) at positions {np.flatnonzero(~np.isfinite(s))[:10].tolist()}")
    return s, y.astype(int)


def roc(scores, labels) -> tuple[np.ndarray, np.ndarray]:
    """(fpr, tpr) arrays of the ROC curve."""
    s, y = _check(scores, labels)
    fpr, tpr, _ = roc_curve(y, s)
    return fpr, tpr


def auc(scores, labels) -> float:
    s, y = _check(scores, labels)
    return float(roc_auc_score(y, s))


def tpr_at_fpr(scores, labels, fpr: float = 0.01) -> float:
    """Largest TPR among ROC points whose FPR <= ``fpr``."""
    f, t = roc(scores, labels)
    ok = f <= fpr + 1e-12
    return float(t[ok].max()) if ok.any() else 0.0


def bootstrap_auc_se(scores, labels, n_resamples: int = 1000, seed: int = 0, stratified: bool = False) -> float:
    """Standard error of the AUC from ``n_resamples`` seeded bootstrap resamples (pooled, or per-class if stratified)."""
    s, y = _check(scores, labels)
    rng = np.random.default_rng(seed)
    n = len(s)
    aucs = []
    pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
    for _ in range(n_resamples):
        if stratified:
            idx = np.concatenate([rng.choice(pos, len(pos)), rng.choice(neg, len(neg))])
        else:
            idx = rng.integers(0, n, n)
        yy = y[idx]
        if yy.min() == yy.max():
            continue
        aucs.append(roc_auc_score(yy, s[idx]))
    return float(np.std(aucs, ddof=1))


def summary_row(method: str, scores, labels, n_resamples: int = 1000, seed: int = 0) -> dict:
    """{"method", "auc", "auc_se", "tpr_at_1pct_fpr", "n"}."""
    return {
        "method": method,
        "auc": auc(scores, labels),
        "auc_se": bootstrap_auc_se(scores, labels, n_resamples=n_resamples, seed=seed),
        "tpr_at_1pct_fpr": tpr_at_fpr(scores, labels, 0.01),
        "n": int(len(labels)),
    }
