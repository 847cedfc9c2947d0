"""The privacy audit's tables, plots and report (``python -m experiments.audit``): the findings and targets as
sentences, the kinds table, the plots against the accountant epsilon, and ``report.md``.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from mia.files.atomic import save_figure
from mia.privacy.claims import ALPHA, NON_PRIVATE, ideal_primary
from mia.report import markdown, pyplot

from experiments.audit_models import Model

TARGETS = {"nonprivate": 4.0, "eps4": 1.0, "eps4_aim": 1.8}


def findings(rows: Sequence[dict], exposure: Sequence[dict], kinds: Sequence[dict] = ()) -> dict:
    """Sentences from the numbers: does every attack's canary AUC fall from the non-private model to the smallest
    epsilon (per mode and canary kind), does the non-private model's mean exposure grow with repetitions, and which
    canary kind the kinds run catches best."""
    out = {}
    falls, flat = [], []
    groups = dict.fromkeys((r.get("mode"), r["attack"], r.get("canary_kind")) for r in rows)
    for mode, attack, kind in groups:
        rs = [r for r in rows if (r.get("mode"), r["attack"], r.get("canary_kind")) == (mode, attack, kind)
              and r["auc"] is not None]
        np_row = next((r for r in rs if r["epsilon"] is None), None)
        dp_rows = sorted((r for r in rs if r["epsilon"] is not None), key=lambda r: r["epsilon"])
        if np_row is None or not dp_rows:
            continue
        label = " ".join(x for x in (mode if mode != "pretrain" else None, attack,
                                     f"[{kind}]" if kind and len({r.get('canary_kind') for r in rows}) > 1 else None)
                         if x)
        (falls if abs(dp_rows[0]["auc"] - 0.5) < abs(np_row["auc"] - 0.5) else flat).append(
            f"{label} ({np_row['auc']:.3f} -> {dp_rows[0]['auc']:.3f})")
    out["auc"] = (f"Canary AUC moves towards 0.5 from the non-private model to epsilon "
                  f"{min(r['epsilon'] for r in rows if r['epsilon'] is not None):.3g} for {len(falls)} of "
                  f"{len(falls) + len(flat)} attacks" + (f": {', '.join(falls)}" if falls else "")
                  + (f"; not for {', '.join(flat)}" if flat else "") + ".") if falls or flat else \
        "No private model to compare with."
    ex = sorted((e for e in exposure if e["model"] == NON_PRIVATE), key=lambda e: e["reps"])
    if len(ex) >= 2:
        means = [e["skewnorm_mean"] for e in ex]
        grows = all(b >= a for a, b in zip(means, means[1:]))
        out["exposure"] = ("Non-private model: mean exposure (skew-normal) by repetitions "
                           + ", ".join(f"r={e['reps']}: {e['skewnorm_mean']:.1f} bits" for e in ex)
                           + (" (grows with repetitions)." if grows else " (does NOT grow monotonically)."))
    if kinds:
        ranked = sorted(kinds, key=lambda k: (-(k["tpr_at_1pct_fpr"] or 0), -(k["auc"] or 0)))
        best, second = ranked[0], ranked[1] if len(ranked) > 1 else None
        out["kinds"] = (f"Kinds run (non-private fine-tune): {best['canary_kind']} canaries are caught best, TPR at 1% "
                        f"FPR {best['tpr_at_1pct_fpr']:.3f} ({best['attack']})"
                        + (f", against {second['tpr_at_1pct_fpr']:.3f} for the next kind, {second['canary_kind']} "
                           f"({second['attack']})" if second else "") + "; by kind: "
                        + ", ".join(f"{k['canary_kind']} {k['tpr_at_1pct_fpr']:.3f}" for k in ranked) + ".")
    return out


def kinds_table(rows: Sequence[dict], model: str) -> list:
    """Per canary kind, the row of ``model`` whose attack catches most (TPR at 1% FPR, then AUC): the kinds table."""
    out = []
    for kind in dict.fromkeys(r["canary_kind"] for r in rows if r["model"] == model):
        rs = [r for r in rows if r["model"] == model and r["canary_kind"] == kind and r["auc"] is not None]
        if rs:
            best = max(rs, key=lambda r: (r["tpr_at_1pct_fpr"] or 0, r["auc"] or 0))
            out.append({k: best.get(k) for k in ("canary_kind", "attack", "n", "auc", "tpr_at_1pct_fpr",
                                                 "tpr_at_0.1pct_fpr", "eps_lower")})
    return out


def targets(primary: Sequence[dict], setting: str) -> dict:
    """The primary claims against the goals: the non-private level's (goal >= 4) and that of the level whose
    accountant epsilon is nearest 4 (within 25%; goal >= 1, aim 1.8), each with the mean and range over the
    repetitions and the gap to the goal (negative: met). Only primary claims: never the best of several rows."""
    out: dict = {"setting": setting}

    def entry(e, goal):
        return {"goal": goal, "epsilon": e["epsilon"], "eps_lower": e["eps_lower"], "model": e["model"],
                "attack": e["attack"], "canary_kind": e["canary_kind"], "k": e["k"], "alpha": e["alpha"],
                "mean": e["mean"], "min": e["min"], "max": e["max"], "sd": e["sd"], "n_reps": e["n_reps"],
                "gap": goal - e["eps_lower"], "met": e["eps_lower"] >= goal}

    np_e = next((e for e in primary if e["level"] == NON_PRIVATE and e["eps_lower"] is not None), None)
    if np_e is not None:
        out["nonprivate"] = entry(np_e, TARGETS["nonprivate"])
    near = [e for e in primary if e["epsilon"] is not None and abs(e["epsilon"] - 4) <= 1
            and e["eps_lower"] is not None]
    if near:
        e = min(near, key=lambda e: abs(e["epsilon"] - 4))
        out["eps4"] = {**entry(e, TARGETS["eps4"]), "aim": TARGETS["eps4_aim"],
                       "gap_to_aim": TARGETS["eps4_aim"] - e["eps_lower"]}
    return out


def add_ideal(goals: dict, primary: Sequence[dict], models: Sequence[Model]) -> None:
    """For a target missed (or, at epsilon 4, an aim not reached): what a perfect attacker's primary claim would
    average on this grid with this many canaries and with four times as many (k scaled alike): ``ideal_primary``,
    on the exactly Gaussian mechanism where one is known (sample rate 1), else not computed."""
    by_name = {m.name: m for m in models}
    for key, t in goals.items():
        if not isinstance(t, dict) or (t["met"] and t.get("gap_to_aim", 0) <= 0):
            continue
        e = next(e for e in primary if e["model"] == t["model"])
        m = by_name[e["model"]]
        if not math.isinf(m.epsilon) and m.mu is None:
            continue
        mu = None if math.isinf(m.epsilon) else m.mu
        t["ideal"] = [ideal_primary(f * e["n"], [f * k for k in e["k"]], m.delta, mu) for f in (1, 4)]


# ============================================================================================ plots
def _x(epsilon: Optional[float], largest: float) -> float:
    return 4 * largest if epsilon is None else epsilon


def _save(plt, fig, path: Path) -> Path:
    """Lay out, save as PNG (no software stamp: same inputs, same bytes) and close."""
    fig.tight_layout()
    save_figure(fig, path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def _series(rows: Sequence[dict]) -> dict:
    """{label: (rows, line style)} of one line per (mode, attack, canary kind); the label says what differs; one
    colour per attack and kind, one dash pattern per mode."""
    keys = list(dict.fromkeys((r.get("mode"), r["attack"], r.get("canary_kind")) for r in rows))
    modes = list(dict.fromkeys(k[0] for k in keys))
    colours = list(dict.fromkeys((k[1], k[2]) for k in keys))
    many_kinds = len({k[2] for k in keys}) > 1
    out = {}
    for mode, attack, kind in keys:
        label = " ".join(x for x in (mode if len(modes) > 1 else None, attack, f"[{kind}]" if many_kinds else None)
                         if x)
        style = {"color": f"C{colours.index((attack, kind)) % 10}", "ls": ("-", "--", ":", "-.")[modes.index(mode) % 4]}
        out[label] = ([r for r in rows if (r.get("mode"), r["attack"], r.get("canary_kind")) == (mode, attack, kind)],
                      style)
    return out


def plot_vs_epsilon(rows: Sequence[dict], path: Path) -> Path:
    """AUC (canaries, natural) and TPR@1%FPR (canaries) against the accountant epsilon, log scale; non-private
    models are drawn at 4x the largest epsilon (marked "inf")."""
    plt = pyplot()
    largest = max((r["epsilon"] for r in rows if r["epsilon"] is not None), default=1.0)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, (key, title) in zip(axes, (("auc", "canaries: AUC"), ("natural_auc", "natural rows: AUC"),
                                       ("tpr_at_1pct_fpr", "canaries: TPR@1%FPR"))):
        for label, (rs, style) in _series(rows).items():
            rs = sorted((r for r in rs if r.get(key) is not None), key=lambda r: _x(r["epsilon"], largest))
            ax.plot([_x(r["epsilon"], largest) for r in rs], [r[key] for r in rs], marker="o", ms=3, label=label,
                    **style)
        if key != "tpr_at_1pct_fpr":
            ax.axhline(0.5, color="k", ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.axvline(2 * largest, color="grey", lw=0.5)
        ax.set(title=title, xlabel="accountant epsilon (rightmost: non-private)")
        ax.legend(fontsize=6)
    return _save(plt, fig, path)


def plot_eps_lower(rows: Sequence[dict], path: Path, primary: Sequence[dict] = ()) -> Path:
    """eps_lower (one run, 95%) against the accountant epsilon of each private model, with the diagonal: every point
    must lie on or below it. The lines are the exploratory rows (each at 95% alone); the primary claims (black
    stars, with their range over the repetitions) are the claims."""
    plt = pyplot()
    priv = [r for r in rows if r["epsilon"] is not None]
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    hi = max([r["epsilon"] for r in priv] + [r["eps_lower"] or 0 for r in priv] + [1.0])
    ax.plot([0, hi], [0, hi], "k", lw=0.8, label="eps_lower = epsilon")
    for label, (rs, style) in _series(priv).items():
        rs = sorted(rs, key=lambda r: r["epsilon"])
        ax.plot([r["epsilon"] for r in rs], [r["eps_lower"] or 0 for r in rs], marker="o", ms=4, label=label, **style)
    pts = [e for e in primary if e.get("epsilon") is not None and e.get("eps_lower") is not None]
    if pts:
        ax.errorbar([e["epsilon"] for e in pts], [e["eps_lower"] for e in pts], fmt="k*", ms=10, capsize=3,
                    yerr=[[e["eps_lower"] - e["min"] for e in pts], [e["max"] - e["eps_lower"] for e in pts]],
                    label="primary claims (range over repetitions)")
    ax.set(xlabel="accountant epsilon (upper bound)", ylabel="eps_lower (one run, 95%)",
           title="primary claims; exploratory rows (lines)", xlim=(0, hi * 1.03), ylim=(-0.02 * hi, hi * 1.03))
    ax.set_aspect("equal")
    ax.legend(fontsize=6)
    return _save(plt, fig, path)


def plot_kinds(kinds: Sequence[dict], path: Path) -> Path:
    """TPR at 1% and 0.1% FPR of each canary kind (its best attack) on the kinds run's non-private model."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    x = np.arange(len(kinds))
    for j, (key, label) in enumerate((("tpr_at_1pct_fpr", "TPR@1%FPR"), ("tpr_at_0.1pct_fpr", "TPR@0.1%FPR"))):
        ax.bar(x + (j - 0.5) * 0.38, [k[key] or 0 for k in kinds], width=0.38, label=label)
    ax.set_xticks(x, [f"{k['canary_kind']}\n({k['attack']})" for k in kinds], fontsize=7)
    ax.set(ylabel="TPR", ylim=(0, 1.05), title="canary kinds, non-private fine-tune")
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_exposure(exposure: Sequence[dict], path: Path) -> Path:
    """Mean exposure (skew-normal) of the included canaries against repetitions, one line per model; the excluded
    canaries' mean is the no-memorization baseline."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.8))
    for name in dict.fromkeys(e["model"] for e in exposure):
        es = sorted((e for e in exposure if e["model"] == name), key=lambda e: e["reps"])
        ax.plot([e["reps"] for e in es], [e["skewnorm_mean"] for e in es], marker="o", ms=3, label=name)
    base = [e["skewnorm_excluded_mean"] for e in exposure if e["skewnorm_excluded_mean"] is not None]
    if base:
        ax.axhline(float(np.mean(base)), color="k", ls="--", lw=0.8, label="excluded canaries")
    ax.set(xscale="log", xlabel="repetitions r", ylabel="mean exposure (bits, skew-normal)",
           title="exposure vs repetitions")
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


# ============================================================================================ report
COLUMNS = ["setting", "model", "epsilon", "attack", "canary_kind", "n", "auc", "tpr_at_1pct_fpr", "tpr_at_0.1pct_fpr",
           "eps_lower", "k", "eps_lower_family", "eps_lower_fdp", "eps_lower_cp", "eps_gdp", "natural_auc",
           "natural_tpr_at_1pct_fpr"]
REPS_COLUMNS = ["model", "attack", "canary_kind", "reps", "n", "n_included", "delta", "eps_upper", "eps_lower",
                "eps_lower_family", "p_accountant"]
PRIMARY_COLUMNS = ["level", "model", "attack", "canary_kind", "k", "alpha", "epsilon", "eps_lower", "k_best", "n",
                   "seed", "n_reps", "mean", "sd", "min", "max"]
EXPOSURE_COLUMNS = ["model", "reps", "n_included", "sampled_mean", "skewnorm_mean", "skewnorm_excluded_mean"]
KINDS_COLUMNS = ["canary_kind", "attack", "n", "auc", "tpr_at_1pct_fpr", "tpr_at_0.1pct_fpr", "eps_lower"]
MODEL_COLUMNS = ["model", "mode", "noise", "epsilon", "epsilon_rdp", "delta", "sampling", "sample_rate", "steps"]


def _spread(e: dict) -> str:
    if not e.get("n_reps") or e["n_reps"] < 2:
        return ""
    return (f"; over {e['n_reps']} independent repetitions: mean {e['mean']:.3f} (SD {e['sd']:.3f}), range "
            f"{e['min']:.3f}-{e['max']:.3f}")


def _ideal(e: dict) -> str:
    ideal = e.get("ideal") or []
    if not ideal:
        return ""
    return ("; a perfect attacker on this grid (k scaled with m) would average " + ", ".join(
        f"{i['mean']:.3f} (SD {i['sd']:.3f}) with m = {i['m']:,}" for i in ideal) + " canaries inserted once")


def targets_lines(t: dict) -> list:
    """The targets as sentences, on the primary claims only (met, or missed by how much; with the spread over
    the repetitions, and for a missed one what a perfect attacker would average with more canaries)."""
    out = []
    if "nonprivate" in t:
        n = t["nonprivate"]
        out.append(f"Non-private: primary claim eps_lower {n['eps_lower']:.3f} ({n['model']}, {n['attack']}, "
                   f"{n['canary_kind']} canaries, k {'+'.join(map(str, n['k']))}, alpha {n['alpha']:g}), goal >= "
                   f"{n['goal']:g}: " + ("met" if n["met"] else f"MISSED by {n['gap']:.3f}") + _spread(n)
                   + ("" if n["met"] else _ideal(n)) + ".")
    if "eps4" in t:
        e = t["eps4"]
        out.append(f"At accountant epsilon {e['epsilon']:.3g}: primary claim eps_lower {e['eps_lower']:.3f} "
                   f"({e['model']}, {e['attack']}, {e['canary_kind']} canaries, k {'+'.join(map(str, e['k']))}, "
                   f"alpha {e['alpha']:g}), goal >= {e['goal']:g}: "
                   + ("met" if e["met"] else f"MISSED by {e['gap']:.3f}")
                   + (f"; aim {e['aim']:g}: " + ("reached" if e["gap_to_aim"] <= 0 else f"{e['gap_to_aim']:.3f} short"))
                   + _spread(e) + ("" if e["met"] and e["gap_to_aim"] <= 0 else _ideal(e)) + ".")
    return out


def report_markdown(s: dict) -> str:
    """The report: setting, models, the main table, kinds, by repetitions, exposure, targets, findings, violations,
    notes."""
    L = ["# Privacy audit", "", s["description"], ""]
    if s.get("primary"):
        L += [markdown([{**e, "k": "+".join(map(str, e["k"]))} for e in s["primary"]], PRIMARY_COLUMNS,
                       title="Primary claims (pre-registered by the preset before training: one per privacy level, "
                             f"each at alpha {ALPHA:g} alone; mean, SD, min, max over the independent repetitions)"),
              ""]
        L += [f"Pre-registered: {s.get('primary_spec', '')}. Every other number below is exploratory: `eps_lower` is "
              "each row's own 95% bound (the best of its grid, Bonferroni inside the grid), not a claim; "
              f"`eps_lower_family` is the same row corrected for the whole family, Bonferroni over the "
              f"{s.get('family_size', 0)} bounds the run reports (alpha / {s.get('family_size', 0)} each).", ""]
    L += ["## Targets (primary claims)", ""] + [f"- {x}" for x in targets_lines(s.get("targets", {}))] + [""]
    L += [markdown(s["models"], [c for c in MODEL_COLUMNS if any(c in m for m in s["models"])],
                   title="Models (accountant epsilon: dp_accounting PLD; RDP alongside)"), ""]
    L += [markdown(s["rows"], COLUMNS, title="Exploratory: canaries inserted once (AUC, TPR, eps_lower: one run at 95% "
                                             "for this row alone, k guesses each way; eps_lower_family: Bonferroni "
                                             "over every bound of the run; eps_lower_fdp: the same guesses in f-DP "
                                             "form, Gaussian curve; eps_lower_cp: Clopper-Pearson heuristic; eps_gdp: "
                                             "Gaussian-DP estimate, not a bound) and natural rows"), ""]
    if s.get("kinds"):
        L += [markdown(s["kinds"], KINDS_COLUMNS, title="Canary kinds (kinds run, non-private; best attack)"), ""]
    L += [markdown(s["by_reps"], REPS_COLUMNS, title="One-run bounds by repetitions (a group of r records)"), ""]
    if s.get("exposure"):
        L += [markdown(s["exposure"], EXPOSURE_COLUMNS, title="Exposure of the included canaries (bits)"), ""]
    L += ["## Findings", ""] + [f"- {v}" for v in s["findings"].values()] + [""]
    check = s.get("violation_check") or {}
    family = (f"{check['n_checks']} claims tested (one run: the accountant's epsilon, and at sample rate 1 the exact "
              f"Gaussian mu), Holm's procedure at family-wise level {check['alpha']:g}; {check['n_above_per_row']} "
              "rejected by its own 95% test alone") if check else ""
    if s["violations"]:
        L += ["## PRIVACY AUDIT VIOLATIONS", "", "A claim the audit rejects: a bug in the attack's labels, the bound, "
              "or the private training/accounting (or a 5% event for the whole family). " + family + ".",
              ""]
        L += [f"- {v}" for v in s["violations"]] + [""]
    else:
        L += [f"No claim is rejected ({family}).", ""]
    if s.get("above_accountant"):
        L += ["## Above the accountant: f-DP bounds (Gaussian curve assumed) and Gaussian-DP estimates (not bounds)",
              ""] + [f"- {v}" for v in s["above_accountant"]] + [""]
    if s["skipped"]:
        L += ["## Skipped", ""] + [f"- {k}: {v}" for k, v in s["skipped"].items()] + [""]
    if s["notes"]:
        L += ["## Notes", ""] + [f"- {n}" for n in s["notes"]] + [""]
    return "\n".join(L)
