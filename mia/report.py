"""Tables and plots from metric rows and per-example scores.

A row is a dict such as ``{"method", "auc", "auc_se", "tpr_at_1pct_fpr", ...}`` (see ``mia.metrics.summary_row``).
``markdown``, ``csv_text`` and ``latex`` render a list of rows; ``write_tables`` writes all three plus JSON.
``plot_roc`` draws every method of a run on log-log axes (``draw_roc`` on axes of your own); ``plot_histograms``
draws per-class score histograms.
Plots use matplotlib's Agg backend (no display needed).
"""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from .files.atomic import save_figure, write_text
from .metrics import auc as _auc, roc

# column key -> header; unknown keys are shown under their own name
HEADERS = {
    "method": "Method", "feature": "Feature", "classifier": "Classifier",
    "auc": "AUC", "auc_se": "AUC SE", "auc_ci_low": "AUC CI low", "auc_ci_high": "AUC CI high",
    "tpr_at_1pct_fpr": "TPR@1%FPR", "tpr_at_0.1pct_fpr": "TPR@0.1%FPR",
    "tpr_at_1pct_fpr_se": "TPR@1% SE", "tpr_at_0.1pct_fpr_se": "TPR@0.1% SE",
    "p_auc_gt_half": "p (AUC>0.5)", "n": "n", "n_train": "n train", "n_eval": "n eval",
}
DEFAULT_COLUMNS = ("method", "auc", "auc_se", "tpr_at_1pct_fpr")
_DIGITS = {"auc": 3, "auc_se": 4, "auc_ci_low": 3, "auc_ci_high": 3, "p_auc_gt_half": 3}


def _columns(rows: Sequence[Mapping], columns: Optional[Sequence[str]]) -> list[str]:
    if columns is not None:
        return list(columns)
    cols = [c for c in DEFAULT_COLUMNS if any(c in r for r in rows)]
    return cols or sorted({k for r in rows for k in r})


def fmt(key: str, value) -> str:
    """Human formatting: AUC 3 decimals, SE 4, TPR 3, p-values in 2 significant digits, ints as ints."""
    if value is None:
        return ""
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if not math.isfinite(v):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        if key.startswith("p_"):
            return f"{v:.2g}"
        if key == "delta":  # 1/records: fixed decimals would print 0.000625 as 0.001
            return f"{v:.3g}"
        if key.endswith("_se"):
            return f"{v:.4f}"
        return f"{v:.{_DIGITS.get(key, 3)}f}"
    return str(value)


def markdown(rows: Sequence[Mapping], columns: Optional[Sequence[str]] = None, title: Optional[str] = None) -> str:
    cols = _columns(rows, columns)
    out = [f"### {title}", ""] if title else []
    out.append("| " + " | ".join(HEADERS.get(c, c) for c in cols) + " |")
    out.append("|" + "|".join("---" if c in ("method", "feature", "classifier") else "---:" for c in cols) + "|")
    for r in rows:
        out.append("| " + " | ".join(fmt(c, r.get(c)).replace("|", "\\|") for c in cols) + " |")
    return "\n".join(out) + "\n"


def csv_text(rows: Sequence[Mapping], columns: Optional[Sequence[str]] = None) -> str:
    """CSV with full precision (every key of the rows unless ``columns`` is given)."""
    cols = list(columns) if columns is not None else list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({c: r.get(c, "") for c in cols})
    return buf.getvalue()


def _tex_escape(s: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("$", r"\$"), ("#", r"\#"),
                 ("_", r"\_"), ("{", r"\{"), ("}", r"\}"), ("~", r"\textasciitilde{}"), ("^", r"\textasciicircum{}")):
        s = s.replace(a, b)
    return s.replace(r"\textbackslash\{\}", r"\textbackslash{}")


def latex(rows: Sequence[Mapping], columns: Optional[Sequence[str]] = None, caption: Optional[str] = None,
          label: Optional[str] = None) -> str:
    """A booktabs ``table`` environment."""
    cols = _columns(rows, columns)
    align = "".join("l" if c in ("method", "feature", "classifier") else "r" for c in cols)
    out = [r"\begin{table}[t]", r"\centering"]
    if caption:
        out.append(rf"\caption{{{_tex_escape(caption)}}}")
    if label:
        out.append(rf"\label{{{label}}}")
    out += [rf"\begin{{tabular}}{{{align}}}", r"\toprule",
            " & ".join(_tex_escape(HEADERS.get(c, c)) for c in cols) + r" \\", r"\midrule"]
    for r in rows:
        out.append(" & ".join(_tex_escape(fmt(c, r.get(c))) for c in cols) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(out) + "\n"


def json_safe(obj):
    """``obj`` with NumPy scalars/arrays as Python values and NaN/inf as None (JSON has no NaN), recursively."""
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return json_safe(obj.tolist())
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj


def write_json(path, obj) -> Path:
    """Atomic, deterministic JSON (keys in insertion order, 2-space indent, NaN as null, other objects as str)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(json_safe(obj), indent=2, default=str) + "\n")
    return path


def metrics_table(rows: Sequence[Mapping]) -> str:
    """``mia.metrics.metric_rows`` as a plain-text table: AUC, its bootstrap SE, TPR at 1% and 0.1% FPR; a method
    without metrics gets its reason, and dropped non-finite scores are counted on their own line."""
    eps = any("eps_lower" in r for r in rows)
    head = f"{'attack':<28} {'AUC':>7} {'AUC SE':>7} {'TPR@1%FPR':>10} {'TPR@0.1%FPR':>12}" + (
        f" {'eps_lower':>10}" if eps else "")
    lines = [head, "-" * len(head)]
    for r in rows:
        name = str(r["method"])
        if "auc" not in r:
            lines.append(f"{name:<28} no metrics: {r.get('note', 'no scores')}")
            continue
        if r.get("n_nonfinite"):
            lines.append(f"{name:<28} {r['n_nonfinite']} non-finite score(s); metrics on the rest")
        se = "" if r.get("auc_se") is None else f"{r['auc_se']:7.4f}"
        lines.append(f"{name:<28} {r['auc']:7.4f} {se:>7} {r['tpr_at_1pct_fpr']:10.4f} {r['tpr_at_0.1pct_fpr']:12.4f}"
                     + (f" {r['eps_lower']:10.4f}" if eps and "eps_lower" in r else ""))
    if eps:
        r = next(r for r in rows if "eps_lower" in r)
        lines.append(f"eps_lower: the (eps, delta={r['delta']:.3g})-DP epsilon each attack rules out with "
                     f"{1 - r['alpha']:.0%} confidence (Clopper-Pearson, Bonferroni over thresholds)")
    return "\n".join(lines)


def write_tables(rows: Sequence[Mapping], out_dir, stem: str = "results", columns: Optional[Sequence[str]] = None,
                 title: Optional[str] = None, extra_markdown: str = "", extra_json: Optional[dict] = None) -> dict:
    """Write ``stem``.md / .csv / .tex / .json into ``out_dir``; return {kind: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {k: out / f"{stem}.{k}" for k in ("md", "csv", "tex", "json")}
    write_text(paths["md"], markdown(rows, columns, title) + (("\n" + extra_markdown) if extra_markdown else ""))
    write_text(paths["csv"], csv_text(rows))
    write_text(paths["tex"], latex(rows, columns, caption=title))
    write_text(paths["json"], json.dumps(json_safe({"rows": list(rows), **(extra_json or {})}), indent=2, default=str))
    return paths


# ----------------------------------------------------------------------------------------------- plots
def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no screen)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_roc(curves: Mapping[str, tuple], labels=None, path=None, title: str = "ROC", min_rate: Optional[float] = None):
    """ROC of every method on log-log axes (low-FPR regime), with the chance diagonal.

    ``curves``: {method: scores} with a shared ``labels`` array, or {method: (scores, labels)}.
    Returns the matplotlib Figure; saves it when ``path`` is given.
    """

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    draw_roc(ax, curves, labels, title=title, min_rate=min_rate)
    return finished(plt, fig, path, dpi=150)


def finished(plt, fig, path=None, *, dpi: int = 120):
    """``fig`` laid out and, when ``path`` is given, saved there (directories made) and closed; returns ``fig``."""
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_figure(fig, path, dpi=dpi)
        plt.close(fig)
    return fig


def draw_roc(ax, curves: Mapping[str, tuple], labels=None, *, log: bool = True, title: Optional[str] = "ROC",
             min_rate: Optional[float] = None):
    """Draw the ROC of every method on the matplotlib axes ``ax``, AUC in the legend, with the chance diagonal;
    ``log``: log-log axes from ``min_rate`` (default: half of 1 / the largest non-member count), so that the
    low-FPR region shows. ``curves`` as in ``plot_roc``. Returns ``ax``."""
    floor = min_rate
    for name, v in curves.items():
        s, y = (v if labels is None else (v, labels))
        fpr, tpr = roc(s, y)
        n0 = int((np.asarray(y) == 0).sum())
        floor = min(floor or 1.0, 0.5 / max(n0, 1))
        ax.plot(fpr, tpr, label=f"{name} (AUC {_auc(s, y):.3f})", lw=1.2, drawstyle="steps-post")
    floor = (floor or 1e-3) if log else 0.0
    ax.plot([floor, 1], [floor, 1], "k--", lw=0.8, label="chance")
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlim(floor, 1)
    ax.set_ylim(floor, 1)
    ax.set_xlabel("False positive rate")
    ax.set_ylabel("True positive rate")
    if title:
        ax.set_title(title)
    ax.legend(fontsize=7, loc="lower right")
    return ax


def plot_histograms(scores: Mapping[str, Iterable[float]], labels, path=None, bins: int = 40):
    """One panel per method: score histograms of members and non-members (density)."""
    plt = pyplot()
    names = list(scores)
    cols = min(3, len(names))
    rows_ = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(4 * cols, 3 * rows_), squeeze=False)
    y = np.asarray(labels)
    for ax, name in zip(axes.ravel(), names):
        s = np.asarray(list(scores[name]), dtype=np.float64)
        ok = np.isfinite(s)
        edges = np.histogram_bin_edges(s[ok], bins=bins) if ok.any() else bins
        ax.hist(s[ok & (y == 1)], bins=edges, alpha=0.55, density=True, label="member")
        ax.hist(s[ok & (y == 0)], bins=edges, alpha=0.55, density=True, label="non-member")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    for ax in axes.ravel()[len(names):]:
        ax.axis("off")
    return finished(plt, fig, path, dpi=120)
