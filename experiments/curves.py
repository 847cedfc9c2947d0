"""Recency and scale as curves: AUC against steps-since-seen (binned, with bootstrap bands) and AUC against model
size, from per-example scores.

    python -m experiments.curves RESULTS_DIR [--bins 8] [--bootstrap 1000]

recomputes ``recency.*``, ``scale.*``, ``recency.png`` and ``scale.png`` of a ``experiments.checkmiabench`` results
directory from its ``scores/*.jsonl`` files alone (no model is run), e.g. with other bins. ``checkmiabench`` calls
the same functions in its own run.

Why a module of its own: the curves need only per-example scores with each member's training step, so they apply
unchanged to any results directory (testbed suite, real Pythia or OLMo) and can be re-binned without scoring again;
``checkmiabench`` stays about the paper's tables.

Definitions. A member of checkpoint ``c`` trained at step ``s`` was seen ``age = c - s`` steps before the checkpoint
(``1 <= age <= c``). Ages are cut into ``n_bins`` equal-width bins ``(lo, hi]`` over ``[0, c]``; each bin's AUC
compares its members with ALL evaluated non-members, with a pooled bootstrap SE and 95% percentile band
(``mia.metrics.summary_row``). The scale curve is each attack's AUC (with its 95% band) against the parameter count of
the suite's members at one checkpoint.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from mia.results import read_scores

from experiments.harness import ExperimentError, plot_lines, write_tables

RECENCY_COLUMNS = ("model", "step", "method", "bin", "age_lo", "age_hi", "n_members", "auc", "auc_se", "auc_ci_low",
                   "auc_ci_high")
SCALE_COLUMNS = ("step", "method", "model", "params", "auc", "auc_se", "auc_ci_low", "auc_ci_high")


def age_edges(checkpoint: int, n_bins: int) -> np.ndarray:
    """``n + 1`` integer bin edges over ``[0, checkpoint]`` (``n = min(n_bins, checkpoint)``); bin i is
    ``(edges[i], edges[i+1]]``."""
    if checkpoint < 1:
        raise ExperimentError(f"checkpoint {checkpoint} has no members, so no recency curve")
    n = max(1, min(int(n_bins), int(checkpoint)))
    return np.unique(np.round(np.linspace(0, checkpoint, n + 1)).astype(np.int64))


def recency_rows(scores: Mapping[str, np.ndarray], labels: np.ndarray, member_steps: np.ndarray, checkpoint: int,
                 n_bins: int, n_resamples: int, seed: int, **extra) -> list:
    """One row per (method, age bin): AUC of the bin's members against every non-member.

    ``scores``: {method: [N]} (NaN = no score); ``labels`` [N] (1 = member); ``member_steps`` [N] the training
    step of each example (ignored for non-members). ``extra`` fields (model, step) are put first in each row.
    """
    from mia.metrics import MetricError, summary_row

    y = np.asarray(labels)
    age = np.where(y == 1, checkpoint - np.asarray(member_steps, np.int64), -1)
    if ((y == 1) & ((age < 1) | (age > checkpoint))).any():
        raise ExperimentError(f"a member's step is not before checkpoint {checkpoint}; not a split of that checkpoint")
    edges = age_edges(checkpoint, n_bins)
    rows = []
    for method, s in scores.items():
        s = np.asarray(s, np.float64)
        for b in range(len(edges) - 1):
            lo, hi = int(edges[b]), int(edges[b + 1])
            pick = np.isfinite(s) & ((y == 0) | ((age > lo) & (age <= hi)))
            n_mem = int((pick & (y == 1)).sum())
            row = {**extra, "method": method, "bin": b, "age_lo": lo, "age_hi": hi, "n_members": n_mem,
                   "n_nonmembers": int((pick & (y == 0)).sum())}
            if n_mem >= 2 and row["n_nonmembers"] >= 2:
                try:
                    r = summary_row(method, s[pick], y[pick], n_resamples=n_resamples, seed=seed)
                except MetricError:
                    r = None
                if r is not None:
                    row.update({k: r[k] for k in ("auc", "auc_se", "auc_ci_low", "auc_ci_high")})
            rows.append(row)
    return rows


def scale_rows(attack_rows: Sequence[Mapping]) -> list:
    """AUC against parameter count: the attack table's rows ordered by (step, method, params)."""
    keep = [r for r in attack_rows if r.get("auc") is not None and r.get("params")]
    order = {m: i for i, m in enumerate(dict.fromkeys(r["method"] for r in keep))}
    rows = [{k: r.get(k) for k in SCALE_COLUMNS} for r in keep]
    return sorted(rows, key=lambda r: (r["step"], order[r["method"]], r["params"]))


# ------------------------------------------------------------------------------------------------ trends
def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (midranks); NaN with fewer than 3 points or a constant side."""
    from scipy.stats import rankdata

    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3:
        return float("nan")
    rx, ry = rankdata(x), rankdata(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def trend(x: Sequence[float], auc: Sequence[float], se: Sequence[float]) -> dict:
    """How AUC moves along x: Spearman rho, the change from the first to the last point and its z
    (difference over the root sum of the two SEs), and whether it is strictly monotone."""
    x, a, e = (np.asarray(v, float) for v in (x, auc, se))
    d = float(a[-1] - a[0])
    s = float(math.hypot(e[0], e[-1])) if np.isfinite(e[[0, -1]]).all() else float("nan")
    diffs = np.diff(a)
    return {"rho": spearman(x, a), "delta": d, "z": d / s if s > 0 else float("nan"),
            "increasing": bool((diffs > 0).all()), "decreasing": bool((diffs < 0).all()), "n": int(len(a))}


def _series(rows, key_fields, x_field):
    out: dict = {}
    for r in rows:
        if r.get("auc") is None:
            continue
        out.setdefault(tuple(r[k] for k in key_fields), []).append(r)
    return {k: sorted(v, key=lambda r: r[x_field]) for k, v in out.items()}


def scale_trends(rows: Sequence[Mapping]) -> list:
    """Per (step, method) with >= 2 sizes: the trend of AUC from the smallest to the largest model."""
    out = []
    for (step, method), rs in _series(rows, ("step", "method"), "params").items():
        if len(rs) < 2:
            continue
        t = trend([r["params"] for r in rs], [r["auc"] for r in rs], [r.get("auc_se") or float("nan") for r in rs])
        out.append({"step": step, "method": method, "aucs": [r["auc"] for r in rs], "models": [r["model"] for r in rs],
                    **t})
    return out


def recency_trends(rows: Sequence[Mapping]) -> list:
    """Per (model, step, method) with >= 2 filled bins: the trend of AUC from the most recent bin to the oldest."""
    out = []
    for (model, step, method), rs in _series(rows, ("model", "step", "method"), "age_lo").items():
        if len(rs) < 2:
            continue
        t = trend([(r["age_lo"] + r["age_hi"]) / 2 for r in rs], [r["auc"] for r in rs],
                  [r.get("auc_se") or float("nan") for r in rs])
        out.append({"model": model, "step": step, "method": method, "recent_auc": rs[0]["auc"],
                    "old_auc": rs[-1]["auc"], **t})
    return out


def _names(items, limit=8):
    items = list(items)
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def scale_sentence(trends: Sequence[Mapping], model_free: Sequence[str] = ()) -> str:
    """A sentence from the numbers: does every model-based attack's AUC rise with model size?"""
    ts = [t for t in trends if t["method"] not in model_free]
    if not ts:
        return "Scale: fewer than two model sizes were evaluated, so there is no scale trend to report."
    mono = [t for t in ts if t["increasing"]]
    sig = [t for t in ts if t["delta"] > 0 and t["z"] >= 2]
    steps = sorted({t["step"] for t in ts})
    not_up = [f"{t['method']}@step{t['step']}" for t in ts if t["delta"] <= 0]
    verdict = ("as the papers report, AUC is higher on the largest model than on the smallest for every attack"
               if not not_up else
               f"unlike what the papers report, AUC is NOT higher on the largest model for {len(not_up)} of "
               f"{len(ts)} (attack, checkpoint) pairs ({_names(not_up)})")
    return (f"Scale (checkpoints {', '.join(map(str, steps))}; model-based attacks): {verdict}; AUC rises strictly "
            f"with every size step for {len(mono)} of {len(ts)}, and the largest-vs-smallest gain is at least 2 SE for "
            f"{len(sig)} of {len(ts)}.")


def recency_sentence(trends: Sequence[Mapping], model_free: Sequence[str] = ()) -> str:
    """A sentence from the numbers: does AUC fall as steps-since-seen grow?"""
    ts = [t for t in trends if t["method"] not in model_free]
    if not ts:
        return "Recency: no curve has two filled bins."
    falls = [t for t in ts if np.isfinite(t["rho"]) and t["rho"] < 0]
    drop = [t for t in ts if t["delta"] < 0]
    sig = [t for t in ts if t["delta"] < 0 and t["z"] <= -2]
    not_falling = [f"{t['method']}@{t['model']}/step{t['step']}" for t in ts if t not in falls]
    head = ("as the papers report, AUC falls as steps-since-seen grow (Spearman rho < 0 over the age bins) for every "
            "model-based curve" if len(falls) == len(ts) else
            f"AUC falls as steps-since-seen grow (Spearman rho < 0) for {len(falls)} of {len(ts)} model-based curves; "
            f"it does NOT for {_names(not_falling)}")
    return (f"Recency: {head}; the most recent bin is above the oldest for {len(drop)} of {len(ts)}, by at least "
            f"2 SE for {len(sig)} of {len(ts)}.")


# ------------------------------------------------------------------------------------------------ plots
def plot_recency(rows: Sequence[Mapping], path, title: str, methods: Optional[Sequence[str]] = None) -> Path:
    """One panel per (model, checkpoint): AUC per age bin for each method, with its 95% bootstrap band."""
    panels: dict = {}
    for (model, step, method), rs in _series(rows, ("model", "step", "method"), "age_lo").items():
        if methods is not None and method not in methods:
            continue
        x = [(r["age_lo"] + r["age_hi"]) / 2 for r in rs]
        panels.setdefault(f"{model}, step{step}", {})[method] = (
            x, [r["auc"] for r in rs], [r.get("auc_ci_low") for r in rs], [r.get("auc_ci_high") for r in rs])
    if not panels:
        raise ExperimentError("no recency bin has enough members for a curve")
    return plot_lines({}, path, xlabel="steps since the member was seen (bin centre)", ylabel="AUC", title=title,
                      panels=panels, ncols=min(4, len(panels)))


def plot_scale(rows: Sequence[Mapping], path, title: str) -> Path:
    """One panel per checkpoint: AUC (95% band) against parameter count, one line per method."""
    panels: dict = {}
    for (step, method), rs in _series(rows, ("step", "method"), "params").items():
        panels.setdefault(f"step{step}", {})[method] = (
            [r["params"] for r in rs], [r["auc"] for r in rs], [r.get("auc_ci_low") for r in rs],
            [r.get("auc_ci_high") for r in rs])
    if not panels:
        raise ExperimentError("no attack rows to draw a scale curve from")
    return plot_lines({}, path, xlabel="parameters", ylabel="AUC", title=title, xscale="log", panels=panels,
                      ncols=min(4, len(panels)))


def write_curves(out_dir, recency: Sequence[Mapping], scale: Sequence[Mapping], title: str) -> dict:
    """recency.{md,csv,tex,json}, scale.*, recency.png and scale.png (when there is something to draw)."""
    out = Path(out_dir)
    paths = {"recency": write_tables(recency, out, "recency", RECENCY_COLUMNS,
                                     f"AUC by steps since seen ({title})")["md"],
             "scale": write_tables(scale, out, "scale", SCALE_COLUMNS, f"AUC by model size ({title})")["md"]}
    if any(r.get("auc") is not None for r in recency):
        paths["recency_png"] = plot_recency(recency, out / "recency.png", f"AUC by steps since seen ({title})")
    if len({r["params"] for r in scale}) >= 2:
        paths["scale_png"] = plot_scale(scale, out / "scale.png", f"AUC by model size ({title})")
    return paths


# ------------------------------------------------------------------------------------------------ CLI
def curves_from_results(results_dir, n_bins: int, n_resamples: int, seed: int) -> tuple[list, list]:
    """Recompute (recency rows, scale rows) from a checkmiabench results directory's scores and attack table."""
    import json

    root = Path(results_dir)
    summary_path = root / "summary.json"
    if not summary_path.exists():
        raise ExperimentError(f"{root}: not a checkmiabench results directory (no summary.json)")
    summary = json.loads(summary_path.read_text())
    recency = []
    for t in summary["targets"]:
        lines, scores = read_scores(root / t["scores"])
        labels = np.array([l["label"] for l in lines])
        steps = np.array([l["step"] for l in lines])
        recency += recency_rows(scores, labels, steps, t["step"], n_bins, n_resamples, seed, model=t["model"],
                                step=t["step"])
    return recency, scale_rows(summary["attacks"])


def build_parser():
    from mia import validate as V

    from experiments.harness import BOOTSTRAP_TYPE, DEFAULT_BOOTSTRAP, SEED_TYPE

    p = V.OneLineParser(prog="python -m experiments.curves", description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a python -m experiments.checkmiabench results directory")
    p.add_argument("--bins", type=V.arg_int(1), default=None, help="age bins per recency curve (default 8)")
    p.add_argument("--bootstrap", type=BOOTSTRAP_TYPE, default=DEFAULT_BOOTSTRAP,
                   help=f"bootstrap resamples for the bands (default {DEFAULT_BOOTSTRAP})")
    p.add_argument("--seed", type=SEED_TYPE, default=0, help="bootstrap seed (default 0)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p


def main(argv=None) -> int:
    from experiments.harness import check_paths, run_and_report

    args = build_parser().parse_args(argv)
    args.bins = 8 if args.bins is None else args.bins

    def go():
        check_paths(dirs=[("RESULTS_DIR", args.results)])
        rec, sc = curves_from_results(args.results, args.bins, args.bootstrap, args.seed)
        return write_curves(args.results, rec, sc, Path(args.results).name), rec, sc

    def report(res) -> str:
        paths, rec, sc = res
        return "\n".join([recency_sentence(recency_trends(rec)), scale_sentence(scale_trends(sc)),
                          "wrote " + ", ".join(str(v) for v in paths.values())])

    return run_and_report(go, args, report, compile_cache=False)  # no model: nothing compiles


if __name__ == "__main__":
    raise SystemExit(main())
