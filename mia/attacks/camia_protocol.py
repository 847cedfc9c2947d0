"""CAMIA's evaluation protocol (Chang et al. 2024; the official ``run_ours_*.py``): calibration draws, the metrics
of one draw, and their mean and spread. docs/algorithms.md#camia.

For draw i (``numpy.random.default_rng([seed, i])``):

    calib  = alpha of the non-members: CAMIA's empirical p-values (the only data CAMIA learns from);
    remove = alpha of the members: only ``camia_lr`` trains on calib + remove (with their labels);
    target = the rest of each class: every method is evaluated here.

``draw_results`` scores every baseline and CAMIA with each combiner on every draw; ``aggregate`` gives the mean and
the standard deviation (ddof = 1) over the draws.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..metrics import roc
from . import camia

COMBINERS = camia.METHODS  # the p-value combiners: edgington, fisher, pearson, george


def calibration_draw(labels: np.ndarray, alpha: float, seed: int, i: int) -> tuple:
    """(calib, remove, target) index arrays of draw ``i``: ``alpha`` of the non-members (calib), ``alpha`` of the
    members (remove), the rest of both (target); ``numpy.random.default_rng([seed, i])`` permutations."""
    rng = np.random.default_rng([int(seed), int(i)])
    y = np.asarray(labels)
    non, mem = rng.permutation(np.flatnonzero(y == 0)), rng.permutation(np.flatnonzero(y == 1))
    k0, k1 = int(alpha * len(non)), int(alpha * len(mem))
    return np.sort(non[:k0]), np.sort(mem[:k1]), np.sort(np.concatenate([non[k0:], mem[k1:]]))


def _metrics(s: np.ndarray, y: np.ndarray) -> tuple:
    """(AUC, TPR@1%FPR) over the finite scores, from one ROC curve (``mia.metrics.roc``): the area under it, and
    the largest TPR among its points with FPR <= 1% (``mia.metrics.tpr_at_fpr``'s rule); NaN with one class."""
    from sklearn.metrics import auc as area

    ok = np.isfinite(s)
    if len(set(y[ok].tolist())) < 2:
        return float("nan"), float("nan")
    f, t = roc(s[ok], y[ok])
    return float(area(f, t)), float(t[f <= 0.01 + 1e-12].max())


def draw_results(scores: dict, signals: Optional[np.ndarray], labels: np.ndarray, *, draws: int, alpha: float,
                 seed: int, subset: Optional[np.ndarray] = None, components: int = 2, diversity: str = "low",
                 lr: bool = True) -> tuple:
    """({method: {"auc": [draws], "tpr": [draws]}}, {method: reason skipped}) over ``draws`` calibration draws on
    the examples ``subset`` (default: all). ``scores``: baseline scores [N] (higher = member); ``signals``: the 75
    raw CAMIA signals [N, 75] (None: no CAMIA rows); ``lr``: also ``camia_lr`` (trained on calib + remove)."""
    idx = np.arange(len(labels)) if subset is None else np.asarray(subset)
    y_all = np.asarray(labels)
    out: dict = {}
    skipped: dict = {}
    oriented = None if signals is None else np.asarray(signals, np.float64) * camia.orientation(diversity)
    for i in range(draws):
        cal, rem, tgt = (idx[j] for j in calibration_draw(y_all[idx], alpha, seed, i))
        y = y_all[tgt]
        per = {m: s[tgt] for m, s in scores.items()}
        if oriented is not None:
            n_cal = int(np.isfinite(oriented[cal]).all(1).sum())
            if n_cal < camia.MIN_CALIB_FLOOR:
                skipped["camia"] = (f"only {n_cal} calibration non-members with all 75 signals; CAMIA needs at "
                                    f"least {camia.MIN_CALIB_FLOOR}")
            else:
                for c in COMBINERS:
                    per[f"camia:{c}"] = camia.pvalue_scores(oriented[tgt], oriented[cal], c)
            train = np.concatenate([cal, rem])
            try:
                if lr:
                    per["camia_lr"] = camia.group_pca_lr_scores(oriented[train], y_all[train], oriented[tgt],
                                                                components)
            except camia.AttackError as e:
                skipped["camia_lr"] = str(e)
        for m, s in per.items():
            a, t = _metrics(np.asarray(s, np.float64), y)
            r = out.setdefault(m, {"auc": [], "tpr": []})
            r["auc"].append(a)
            r["tpr"].append(t)
    return out, skipped


def aggregate(per_draw: dict) -> dict:
    """{"auc", "auc_sd", "tpr", "tpr_sd", "n_draws"}: mean and standard deviation (ddof = 1) over the draws."""
    out = {}
    for k in ("auc", "tpr"):
        v = np.asarray(per_draw[k], np.float64)
        v = v[np.isfinite(v)]
        out[k] = float(v.mean()) if v.size else None
        out[f"{k}_sd"] = float(v.std(ddof=1)) if v.size > 1 else None
    out["n_draws"] = int(np.isfinite(np.asarray(per_draw["auc"], np.float64)).sum())
    return out

