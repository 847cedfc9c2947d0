"""Privacy audit as one command: testbeds trained at several DP epsilons on one data order with canaries, every
attack scored on the canaries and on the natural checkpoint split, and what the attacks prove about epsilon.

    python -m experiments.audit [--preset default|smoke] [--out DIR] [--epsilons 1,4,16] [--attacks ...]

1. **The models.** A testbed with a canary pool (``canaries`` random-token rows, each included with probability
   1/2 and inserted r times, r cycled over ``canary_reps``; docs/auditing.md) trained without privacy, and its
   twins (``mia.testbed.build_twin``: the same tokenizer, order and canaries) trained with DP-SGD (Poisson
   sampling, clipping 1.0) at the noise multiplier whose accountant epsilon (``dp_accounting`` PLD, at
   delta = 1 / (train_steps x batch_size), the natural records: canary copies are not counted) is each target in
   ``epsilons``. Runs differ only by privacy.
2. **The canaries.** Every attack scores all m canaries under each model's last checkpoint (membership: included or
   not, exact). Per (model, attack): AUC, TPR at 1% and 0.1% FPR, and ``eps_lower``, the one-run audit's lower bound
   (``mia.audit.one_run_audit``, Steinke, Nasr and Jagielski 2023) at 95% confidence on the canaries inserted once,
   whose per-record guarantee is the accountant's epsilon (canaries inserted r > 1 times are groups of r records:
   ``by_reps`` compares their bounds with the group epsilon, ``mia.testbed.dp.canary_epsilon``). Beside it, on the
   same canaries: ``eps_lower_fdp`` (the same guesses analysed in f-DP form, Mahloujifar et al.: the epsilon of the
   strongest Gaussian curve they rule out, ``one_run_audit(bound="fdp")``), ``eps_lower_cp`` (Clopper-Pearson, a
   heuristic here) and ``eps_gdp`` (the Gaussian-DP estimate, ``mia.gdp.gdp_epsilon_estimate``; not a bound).
3. **The natural split.** The same attacks on a checkpoint split of the order's natural rows at the last checkpoint
   (members: rows trained on, [0, T B); non-members: the rest of the first epoch): ``natural_auc``, and so on. The
   natural members are not randomly included, so no one-run bound is computed on them.
4. **Exposure** (Carlini et al. 2019) of every canary against ``n_candidates`` fresh random rows, "sampled" (rank,
   capped at log2(n + 1) bits) and "skewnorm" (extrapolated), by repetitions.
5. **The checks.** Each private row (per record, and per group of r) tests the accountant's claim with the one-run
   audit (``mia.audit.one_run_claim_p_value``); the claims rejected by Holm's procedure at family-wise level 5%
   over all of them are violations: a bug in the attack's labels, the bound or the private training (or a 5% event
   for the whole family). The run writes everything, lists the violations in the report and ``summary.json`` and
   exits with status 3 (``AuditViolation`` from the Python API). The findings say whether AUC falls towards 0.5 as
   epsilon shrinks and whether exposure grows with repetitions.

Outputs (``--out``, default ``results/audit-<preset>``): ``report.md``; ``audit.{md,csv,tex,json}`` (one row per
(model, attack)); ``by_reps.*``; ``exposure.*``; ``auc_vs_epsilon.png``, ``eps_lower_vs_epsilon.png``,
``exposure_vs_reps.png``; ``summary.json``; ``scores/<model>/{canaries,natural}.jsonl``; ``manifest.json``;
``timings.json``. Testbeds go to ``testbeds/audit-<preset>/`` (``--testbed-dir``), reused and resumed. Same seed:
the same tables, byte for byte.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from mia.atomic import save_figure, write_text
from mia.audit import AuditViolation, one_run_audit, one_run_claim_p_value
from mia.exposure import exposure_by_reps, exposure_sampled, exposure_skewnorm
from mia.gdp import gdp_epsilon_estimate
from mia.metrics import epsilon_lower_bound, holm_significant, metric_rows
from mia.report import markdown, pyplot
from mia.testbed import build_testbed, build_twin, dp, preset as testbed_preset
from mia.testbed.canaries import candidate_rows, sequence_nll

from mia.data.draw import draw_testbed_split, SplitSizes
from experiments.common import (check_paths, experiment_parser, ExperimentError, run_main, say_fn, score_split,
                                select_attacks, Timings, write_json, write_manifest, write_tables)

NON_PRIVATE = "non-private"
ALPHA = 0.05  # confidence of every lower bound: 95%
UNAVAILABLE = ("ref", "mlm", "prefix", "member_prefix", "calib", "train", "freq")  # canaries have no partitions


@dataclasses.dataclass(frozen=True)
class Preset:
    """One preset: the testbed (a testbed preset and overrides), the canary pool, the target epsilons, the attacks
    (a spec, or "default": every registered attack up to ``max_cost`` that needs nothing but the examples), the
    natural split's size per class, and the exposure reference set's size."""

    testbed: str
    overrides: tuple
    canaries: int
    canary_reps: tuple
    noises: tuple  # DP-SGD noise multipliers of the twins (dp.noise_for_epsilon of the target epsilons, precomputed)
    attacks: str
    max_cost: str
    n_natural: int
    n_candidates: int


PRESETS = {
    # about 90 s on 2 CPU cores: a 40-step testbed of 32-token rows, 96 canaries, two private twins
    "smoke": Preset("smoke", (("max_corpus_bytes", 200_000), ("seq_len", 32), ("train_steps", 40),
                              ("checkpoints", ()), ("warmup_steps", 4)),
                    canaries=96, canary_reps=(1, 4, 16), noises=(0.8189, 0.4078), attacks="loss,zlib,mink:k=0.2",
                    max_cost="stats", n_natural=100, n_candidates=200),
    # the smoke testbed preset (100 steps, 64-token rows), 256 canaries, three private twins (docs/auditing.md)
    "default": Preset("smoke", (), canaries=256, canary_reps=(1, 4, 16), noises=(0.7281, 0.4927, 0.3116),
                      attacks="default", max_cost="model", n_natural=300, n_candidates=1000),
}


@dataclasses.dataclass
class Model:
    """One audited model: its name, testbed, accountant epsilon (inf: non-private), noise multiplier and delta."""

    name: str
    testbed: object
    epsilon: float
    noise: Optional[float]
    delta: float


# ============================================================================================ pure parts
def model_name(epsilon: Optional[float]) -> str:
    """"non-private", or "eps=<accountant epsilon, 3 significant digits>"."""
    return NON_PRIVATE if epsilon is None else f"eps={epsilon:.3g}"


def canary_examples(tokens: np.ndarray, members: np.ndarray) -> list:
    """Examples (id, tokens, label, reps) of the canary pool: label 1 = included in this model's training."""
    return [{"id": f"canary{i}", "tokens": tokens[i].tolist(), "label": int(members[i])} for i in range(len(tokens))]


def audit_row(model: Model, attack: str, canary_row: dict, natural_row: Optional[dict], eps_lower: float,
              eps_lower_cp: float, *, eps_lower_fdp: Optional[float] = None, eps_gdp: Optional[float] = None,
              p_accountant: Optional[float] = None) -> dict:
    """One row of the main table: ``epsilon`` is the accountant's (None for the non-private model);
    ``p_accountant``: the one-run p-value of the accountant's claim (None for the non-private model)."""
    row = {"model": model.name, "epsilon": None if math.isinf(model.epsilon) else model.epsilon,
           "noise": model.noise, "attack": attack}
    for k in ("auc", "auc_se", "tpr_at_1pct_fpr", "tpr_at_0.1pct_fpr"):
        row[k] = canary_row.get(k)
    row["eps_lower"] = eps_lower
    row["eps_lower_fdp"] = eps_lower_fdp
    row["eps_lower_cp"] = eps_lower_cp
    row["eps_gdp"] = eps_gdp
    row["p_accountant"] = p_accountant
    for k in ("auc", "auc_se", "tpr_at_1pct_fpr"):
        row[f"natural_{k}"] = None if natural_row is None else natural_row.get(k)
    return row


def bounds_by_reps(scores: np.ndarray, included: np.ndarray, reps: np.ndarray, model: Model, cfg, attack: str,
                   delta: float) -> list:
    """Per repetition count r: the one-run lower bound on the canaries inserted r times, at the group delta of r
    copies, beside the group epsilon the accountant gives r copies (inf for the non-private model) and the one-run
    p-value of that group claim (``p_accountant``; None without a claim)."""
    rows = []
    for r in sorted(set(reps.tolist())):
        sel = reps == r
        if math.isinf(model.epsilon):
            upper, d = math.inf, delta
        else:
            upper, d = dp.canary_epsilon(cfg, int(r), delta=delta)
        ok = d < 1 and np.isfinite(scores[sel]).all()
        lower = one_run_audit(scores[sel], included[sel], delta=min(d, 1.0), alpha=ALPHA).epsilon if ok else None
        p = (one_run_claim_p_value(scores[sel], included[sel], epsilon=upper, delta=d)
             if ok and math.isfinite(upper) else None)
        rows.append({"model": model.name, "attack": attack, "reps": int(r), "n": int(sel.sum()),
                     "n_included": int(included[sel].sum()), "delta": d,
                     "eps_upper": None if math.isinf(upper) else upper, "eps_lower": lower, "p_accountant": p})
    return rows


def _checks(rows: Sequence[dict], by_reps: Sequence[dict]) -> list:
    """(line, p-value) of every accountant claim the audit tests: per record (``rows``) and per group (``by_reps``)."""
    out = []
    for r in rows:
        if r["epsilon"] is not None and r.get("p_accountant") is not None:
            out.append((f"{r['model']} {r['attack']}: eps_lower {r['eps_lower']:.4g} vs accountant epsilon "
                        f"{r['epsilon']:.4g}", r["p_accountant"]))
    for r in by_reps:
        if r["eps_upper"] is not None and r.get("p_accountant") is not None:
            out.append((f"{r['model']} {r['attack']} reps {r['reps']}: eps_lower {r['eps_lower']:.4g} vs group "
                        f"epsilon {r['eps_upper']:.4g}", r["p_accountant"]))
    return out


def violation_check(rows: Sequence[dict], by_reps: Sequence[dict], alpha: float = ALPHA) -> dict:
    """The family of accountant claims the audit tests and which of them it rejects: Holm's procedure over all of
    them at family-wise level ``alpha`` (``mia.metrics.holm_significant``), so that a correct training shows no
    violation with probability >= 1 - alpha however many rows are checked. ``n_checks``, ``method``, ``alpha``,
    ``n_above_per_row`` (claims rejected by their own 95% test alone) and the ``violations`` (lines)."""
    checks = _checks(rows, by_reps)
    rejected = holm_significant([p for _, p in checks], alpha) if checks else []
    return {"method": "holm", "alpha": alpha, "n_checks": len(checks),
            "n_above_per_row": sum(p <= alpha for _, p in checks),
            "violations": [f"{line} (p = {p:.3g}, Holm at family-wise {alpha:g} over {len(checks)} claims)"
                           for (line, p), bad in zip(checks, rejected) if bad]}


def violations(rows: Sequence[dict], by_reps: Sequence[dict]) -> list:
    """Lines naming every accountant claim (per record: ``rows``; per group: ``by_reps``) that the audit rejects,
    corrected for the family of claims (``violation_check``)."""
    return violation_check(rows, by_reps)["violations"]


def above_accountant(rows: Sequence[dict]) -> list:
    """Lines naming every f-DP bound or Gaussian-DP estimate above the accountant's epsilon. Not violations: both
    assume a Gaussian trade-off curve, which the accountant does not claim; worth a look all the same."""
    out = []
    for r in rows:
        for key in ("eps_lower_fdp", "eps_gdp"):
            if r["epsilon"] is not None and r.get(key) is not None and r[key] > r["epsilon"] * (1 + 1e-9):
                out.append(f"{r['model']} {r['attack']}: {key} {r[key]:.4g} > accountant epsilon {r['epsilon']:.4g} "
                           "(assumes a Gaussian trade-off curve; not a violation by itself)")
    return out


def findings(rows: Sequence[dict], exposure: Sequence[dict]) -> dict:
    """Sentences from the numbers: does every attack's canary AUC fall from the non-private model to the smallest
    epsilon, and does the non-private model's mean exposure grow with repetitions?"""
    out = {}
    falls, flat = [], []
    for attack in dict.fromkeys(r["attack"] for r in rows):
        rs = [r for r in rows if r["attack"] == attack and r["auc"] is not None]
        np_row = next((r for r in rs if r["epsilon"] is None), None)
        dp_rows = sorted((r for r in rs if r["epsilon"] is not None), key=lambda r: r["epsilon"])
        if np_row is None or not dp_rows:
            continue
        (falls if abs(dp_rows[0]["auc"] - 0.5) < abs(np_row["auc"] - 0.5) else flat).append(
            f"{attack} ({np_row['auc']:.3f} -> {dp_rows[0]['auc']:.3f})")
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
    return out


# ============================================================================================ plots
def _x(epsilon: Optional[float], largest: float) -> float:
    return 4 * largest if epsilon is None else epsilon


def _save(plt, fig, path: Path) -> Path:
    """Lay out, save as PNG (no software stamp: same inputs, same bytes) and close."""
    fig.tight_layout()
    save_figure(fig, path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def plot_vs_epsilon(rows: Sequence[dict], path: Path) -> Path:
    """AUC (canaries, natural) and TPR@1%FPR (canaries) against the accountant epsilon, log scale; the non-private
    model is drawn at 4x the largest epsilon (marked "inf")."""
    plt = pyplot()
    largest = max((r["epsilon"] for r in rows if r["epsilon"] is not None), default=1.0)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, (key, title) in zip(axes, (("auc", "canaries: AUC"), ("natural_auc", "natural split: AUC"),
                                       ("tpr_at_1pct_fpr", "canaries: TPR@1%FPR"))):
        for attack in dict.fromkeys(r["attack"] for r in rows):
            rs = sorted((r for r in rows if r["attack"] == attack and r.get(key) is not None),
                        key=lambda r: _x(r["epsilon"], largest))
            ax.plot([_x(r["epsilon"], largest) for r in rs], [r[key] for r in rs], marker="o", ms=3, label=attack)
        if key != "tpr_at_1pct_fpr":
            ax.axhline(0.5, color="k", ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.axvline(2 * largest, color="grey", lw=0.5)
        ax.set(title=title, xlabel="accountant epsilon (rightmost: non-private)")
        ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_eps_lower(rows: Sequence[dict], path: Path) -> Path:
    """eps_lower (one run, 95%) against the accountant epsilon of each private model, with the diagonal: every point
    must lie on or below it."""
    plt = pyplot()
    priv = [r for r in rows if r["epsilon"] is not None]
    fig, ax = plt.subplots(figsize=(4.6, 4))
    hi = max([r["epsilon"] for r in priv] + [r["eps_lower"] or 0 for r in priv] + [1.0])
    ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="eps_lower = epsilon")
    for attack in dict.fromkeys(r["attack"] for r in priv):
        rs = sorted((r for r in priv if r["attack"] == attack), key=lambda r: r["epsilon"])
        ax.plot([r["epsilon"] for r in rs], [r["eps_lower"] or 0 for r in rs], marker="o", ms=4, label=attack)
    ax.set(xlabel="accountant epsilon (upper bound)", ylabel="eps_lower (one run, 95%)",
           title="what the attacks prove")
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
COLUMNS = ["model", "epsilon", "attack", "auc", "tpr_at_1pct_fpr", "tpr_at_0.1pct_fpr", "eps_lower", "eps_lower_fdp",
           "eps_lower_cp", "eps_gdp", "natural_auc", "natural_tpr_at_1pct_fpr"]
REPS_COLUMNS = ["model", "attack", "reps", "n", "n_included", "delta", "eps_upper", "eps_lower", "p_accountant"]
EXPOSURE_COLUMNS = ["model", "reps", "n_included", "sampled_mean", "skewnorm_mean", "skewnorm_excluded_mean"]


def report_markdown(s: dict) -> str:
    """The report: setting, models, the main table, by repetitions, exposure, findings, violations, notes."""
    L = ["# Privacy audit", "", s["description"], ""]
    L += [markdown(s["models"], ["model", "noise", "epsilon", "epsilon_rdp", "delta", "sampling"],
                   title="Models (accountant epsilon: dp_accounting PLD; RDP alongside)"), ""]
    L += [markdown(s["rows"], COLUMNS, title="Canaries (AUC, TPR, eps_lower: one run at 95% on the canaries "
                                             "inserted once; eps_lower_fdp: the same guesses in f-DP form, "
                                             "Gaussian curve; eps_lower_cp: Clopper-Pearson heuristic; eps_gdp: "
                                             "Gaussian-DP estimate) and the natural split"), ""]
    L += [markdown(s["by_reps"], REPS_COLUMNS, title="One-run bounds by repetitions (a group of r records)"), ""]
    L += [markdown(s["exposure"], EXPOSURE_COLUMNS, title="Exposure of the included canaries (bits)"), ""]
    L += ["## Findings", ""] + [f"- {v}" for v in s["findings"].values()] + [""]
    check = s.get("violation_check") or {}
    family = (f"{check['n_checks']} accountant claims tested (one run), Holm's procedure at family-wise level "
              f"{check['alpha']:g}; {check['n_above_per_row']} rejected by its own 95% test alone") if check else ""
    if s["violations"]:
        L += ["## PRIVACY AUDIT VIOLATIONS", "", "An accountant claim the audit rejects: a bug in the attack's labels, "
              "the bound, or the private training/accounting (or a 5% event for the whole family). " + family + ".",
              ""]
        L += [f"- {v}" for v in s["violations"]] + [""]
    else:
        L += [f"No accountant claim is rejected ({family}).", ""]
    if s.get("above_accountant"):
        L += ["## Above the accountant (Gaussian-curve bounds)", ""] + [f"- {v}" for v in s["above_accountant"]] + [""]
    if s["skipped"]:
        L += ["## Skipped", ""] + [f"- {k}: {v}" for k, v in s["skipped"].items()] + [""]
    if s["notes"]:
        L += ["## Notes", ""] + [f"- {n}" for n in s["notes"]] + [""]
    return "\n".join(L)


# ============================================================================================ the run
def _models(p: Preset, root: Path, noises: Sequence[float], delta: Optional[float], progress: bool,
            timings: Timings, say) -> list:
    """The non-private testbed with the preset's canaries and one DP-SGD twin per noise multiplier (built, or
    reused / resumed from ``root``)."""
    with timings("testbed:non-private"):
        plain = build_testbed(p.testbed, root / NON_PRIVATE, progress=progress, canaries=p.canaries,
                              canary_reps=tuple(p.canary_reps), **dict(p.overrides))
    d = dp.default_delta(plain.config) if delta is None else float(delta)
    models = [Model(NON_PRIVATE, plain, math.inf, None, d)]
    for sigma in noises:
        with timings(f"testbed:noise={sigma:g}"):
            tb = build_twin(plain, root / f"noise{sigma:g}", progress=progress, dp_noise=float(sigma))
        eps = tb.dp_epsilon(delta=d)
        say(f"noise multiplier {sigma:g}: accountant epsilon {eps:.3f} at delta {d:.3g}")
        models.append(Model(model_name(eps), tb, eps, float(sigma), d))
    return models


def noises_for(p: Preset, epsilons: Sequence[float], delta: Optional[float], say) -> tuple:
    """The noise multipliers whose accountant epsilon (PLD) is each target (``dp.noise_for_epsilon``; a bisection
    over the accountant: up to a minute per target at small noise)."""
    cfg = preset_config(p).replace(dp_noise=1.0)
    out = []
    for e in epsilons:
        say(f"finding the noise multiplier of epsilon {e:g} ...")
        out.append(math.ceil(dp.noise_for_epsilon(cfg, e, delta=delta) * 1e4) / 1e4)  # rounded up: eps <= target
    return tuple(out)


def preset_config(p: Preset):
    """The testbed config of a preset (its canaries included), without building anything."""
    return testbed_preset(p.testbed, canaries=p.canaries, canary_reps=tuple(p.canary_reps), **dict(p.overrides))


def _exposure_rows(name: str, model, c, n_candidates: int, seed: int) -> list:
    cand = candidate_rows(c, n_candidates, seed)
    canary_loss, cand_loss = sequence_nll(model, c.tokens), sequence_nll(model, cand)
    rows = []
    by = {k: exposure_by_reps(f(canary_loss, cand_loss), c.reps, c.included)
          for k, f in (("sampled", exposure_sampled), ("skewnorm", exposure_skewnorm))}
    for a, b in zip(by["sampled"], by["skewnorm"]):
        rows.append({"model": name, "reps": a["reps"], "n_included": a["n_included"], "sampled_mean": a["mean"],
                     "skewnorm_mean": b["mean"], "skewnorm_excluded_mean": b["excluded_mean"]})
    return rows


def run(preset: str = "default", out=None, *, testbed_dir=None, noises: Optional[Sequence[float]] = None,
        epsilons: Optional[Sequence[float]] = None, attacks=None, delta: Optional[float] = None, seed: int = 0,
        bootstrap: int = 1000, progress: bool = True, strict: bool = True, argv=None) -> dict:
    """Run the audit; returns the summary (also ``out/summary.json``). ``strict``: raise :class:`AuditViolation`
    after writing every output when a lower bound exceeds its accountant epsilon."""
    if preset not in PRESETS:
        raise ExperimentError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    p = PRESETS[preset]
    if noises is not None and epsilons is not None:
        raise ExperimentError("give --noises or --epsilons, not both")
    for flag, values in (("--noises", noises), ("--epsilons", epsilons)):
        if values is not None and (not values or any(not (math.isfinite(v) and v > 0) for v in values)
                                   or len(set(values)) != len(values)):
            raise ExperimentError(f"{flag} must be distinct positive numbers, got {', '.join(map(str, values))}")
    if delta is not None and not 0 < delta < 1:
        raise ExperimentError(f"--delta must be in (0, 1), got {delta}")
    out = Path(out) if out is not None else Path("results") / f"audit-{preset}"
    root = Path(testbed_dir) if testbed_dir is not None else Path("testbeds") / f"audit-{preset}"
    check_paths(out=out, output_dirs=[("--testbed-dir", root)])
    to_run, skipped = select_attacks(p.attacks if attacks is None else attacks, max_cost=p.max_cost,
                                     unavailable=UNAVAILABLE, preset=preset)
    if not to_run:
        raise ExperimentError(f"no attack to run: {'; '.join(f'{k}: {v}' for k, v in skipped.items())}")
    say = say_fn(progress)
    timings = Timings()
    t0 = time.perf_counter()
    if epsilons is not None:
        with timings("noise_for_epsilon"):
            noises = noises_for(p, sorted(epsilons, reverse=True), delta, say)
    noises = tuple(sorted(p.noises if noises is None else noises, reverse=True))  # smallest epsilon first
    models = _models(p, root, noises, delta, progress, timings, say)
    plain = models[0].testbed
    c = plain.canaries()
    header, natural, note = draw_testbed_split(plain, plain.train_steps, SplitSizes(eval=p.n_natural), seed,
                                               allow_fewer=True)
    notes = [note] if note else []
    rows, by_reps, exposure = [], [], []
    once = c.reps == 1
    for m in models:
        if m.testbed.natural_membership() != plain.natural_membership():
            raise ExperimentError(f"{m.name}: natural membership differs from the non-private model's")
        members = m.testbed.canary_membership()
        model = m.testbed.load_model()
        with timings(f"score:{m.name}"):
            rc = score_split(model, canary_examples(c.tokens, members), to_run, seed=seed, progress=progress)
            rn = score_split(model, natural, to_run, seed=seed, progress=progress)
        skipped.update({f"{m.name}: {k}": v for k, v in {**rc.skipped, **rn.skipped}.items()})
        notes += [n for n in rc.notes + rn.notes if n not in notes]
        rc.write(out / "scores" / m.name / "canaries.jsonl", {f"canary{i}": {"reps": int(c.reps[i])}
                                                             for i in range(len(c.reps))})
        rn.write(out / "scores" / m.name / "natural.jsonl", {e["id"]: {"index": e["index"]} for e in natural})
        crow = {r["method"]: r for r in metric_rows(rc.scores, rc.labels, rc.ids, bootstrap, seed)}
        nrow = {r["method"]: r for r in metric_rows(rn.scores, rn.labels, rn.ids, bootstrap, seed)}
        for attack, s in rc.scores.items():
            s = np.asarray(s, np.float64)
            s1, in1 = s[once], members[once]  # the canaries inserted once: the per-record claim applies
            ok = np.isfinite(s1).all()
            lo = one_run_audit(s1, in1, delta=m.delta, alpha=ALPHA).epsilon if ok else None
            lo_fdp = one_run_audit(s1, in1, delta=m.delta, alpha=ALPHA, bound="fdp").epsilon if ok else None
            both = ok and 0 < in1.sum() < len(in1)  # Clopper-Pearson and GDP need both classes
            lo_cp = epsilon_lower_bound(s1, in1.astype(int), delta=m.delta, alpha=ALPHA) if both else None
            gdp = gdp_epsilon_estimate(s1, in1.astype(int), delta=m.delta, alpha=ALPHA) if both else None
            p_claim = (one_run_claim_p_value(s1, in1, epsilon=m.epsilon, delta=m.delta)
                       if ok and math.isfinite(m.epsilon) else None)
            rows.append(audit_row(m, attack, crow.get(attack, {}), nrow.get(attack), lo, lo_cp, eps_lower_fdp=lo_fdp,
                                  eps_gdp=gdp, p_accountant=p_claim))
            by_reps += bounds_by_reps(s, members, c.reps, m, m.testbed.config, attack, m.delta)
        with timings(f"exposure:{m.name}"):
            exposure += _exposure_rows(m.name, model, c, p.n_candidates, seed)
    check = violation_check(rows, by_reps)
    bad = check.pop("violations")
    model_rows = [{"model": m.name, "noise": m.noise, "epsilon": None if math.isinf(m.epsilon) else m.epsilon,
                   "epsilon_rdp": None if m.noise is None else m.testbed.dp_epsilon(delta=m.delta, accountant="rdp"),
                   "delta": m.delta, "sampling": None if m.noise is None else m.testbed.config.dp_sampling,
                   "testbed": str(m.testbed.root)} for m in models]
    cfg = plain.config
    reps = ", ".join(map(str, p.canary_reps))
    description = (f"Testbed preset {p.testbed} ({cfg.train_steps} steps x batch {cfg.batch_size}, rows of "
                   f"{cfg.row_len} tokens), {len(c.reps)} random-token canaries (reps {reps}, "
                   f"{int(c.included.sum())} included), DP-SGD twins at noise "
                   f"{', '.join(f'{s:g}' for s in noises)} (Poisson sampling, clip {cfg.dp_clip}); natural split "
                   f"at step {cfg.train_steps}: {sum(e['label'] == 1 and e['partition'] == 'eval' for e in natural)} "
                   f"members and {sum(e['label'] == 0 and e['partition'] == 'eval' for e in natural)} non-members; "
                   f"delta {models[0].delta:.3g}.")
    summary = {"description": description, "preset": preset, "models": model_rows, "rows": rows,
               "by_reps": by_reps, "exposure": exposure, "findings": findings(rows, exposure), "violations": bad,
               "violation_check": check, "above_accountant": above_accountant(rows),
               "attacks_run": [label for label, _, _ in to_run], "skipped": skipped, "notes": notes,
               "alpha": ALPHA}
    write_tables(rows, out, "audit", COLUMNS, title="Privacy audit: canaries and the natural split")
    write_tables(by_reps, out, "by_reps", REPS_COLUMNS, title="One-run bounds by repetitions")
    write_tables(exposure, out, "exposure", EXPOSURE_COLUMNS, title="Exposure by repetitions")
    plot_vs_epsilon(rows, out / "auc_vs_epsilon.png")
    plot_eps_lower(rows, out / "eps_lower_vs_epsilon.png")
    plot_exposure(exposure, out / "exposure_vs_reps.png")
    write_json(out / "summary.json", summary)
    write_text(out / "report.md", report_markdown(summary))
    write_manifest(out, module="experiments.audit", argv=argv, config={
        "preset": preset, "settings": dataclasses.asdict(p), "noises": list(noises), "delta": delta,
        "bootstrap": bootstrap, "attacks": summary["attacks_run"]},
        seeds={"natural_split": seed, "bootstrap": seed, "exposure_candidates": seed, "testbed": cfg.seed},
        hashes={"config_hash": cfg.config_hash, "canaries_sha256": plain.manifest["canaries"]["sha256"]},
        paths={"testbeds": [str(m.testbed.root) for m in models]},
        outputs=["report.md", "audit.*", "by_reps.*", "exposure.*", "*.png", "summary.json", "scores/"])
    timings["total"] = round(time.perf_counter() - t0, 1)
    timings.write(out)
    say(f"wrote {out}/ in {timings['total']:.0f} s")
    if bad and strict:
        raise AuditViolation(f"PRIVACY AUDIT VIOLATION: {len(bad)} accountant claim(s) rejected by the audit "
                             f"({bad[0]}{'; ...' if len(bad) > 1 else ''}); everything is written to {out}/")
    return summary


def build_parser():
    from mia import validate as V

    ap = experiment_parser("python -m experiments.audit", __doc__, PRESETS)
    ap.add_argument("--testbed-dir", default=None, help="where the testbeds go (default: testbeds/audit-<preset>)")
    ap.add_argument("--noises", default=None, help="DP-SGD noise multipliers of the private twins, comma-separated "
                                                   f"(default: {preset_defaults('noises')})")
    ap.add_argument("--epsilons", default=None, help="target accountant epsilons instead of --noises (the noise is "
                                                     "found by bisection over the accountant: slower)")
    ap.add_argument("--attacks", default=None, help=f"attack spec (default: {preset_defaults('attacks')})")
    ap.add_argument("--delta", type=V.arg_float(0, 1, lo_open=True, hi_open=True), default=None,
                    help="delta of every epsilon (default: 1 / (train_steps x batch_size), the testbed's natural "
                         "records; canary copies are not counted: mia.testbed.dp.default_delta)")
    return ap


def preset_defaults(field: str) -> str:
    """The help text's defaults, read from ``PRESETS`` (so that it cannot go stale): each preset's noise
    multipliers or attacks."""
    def one(p: Preset) -> str:
        if field == "noises":
            return ",".join(f"{x:g}" for x in p.noises)
        return (p.attacks if p.attacks != "default"
                else f"every attack that needs only the examples, up to cost {p.max_cost!r}")
    return "; ".join(f"{name}: {one(p)}" for name, p in PRESETS.items())


def _floats(v, flag: str) -> Optional[list]:
    if v is None or isinstance(v, (list, tuple)):
        return v
    try:
        return [float(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise ExperimentError(f"{flag} {v!r}: not a comma-separated list of numbers") from None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    status, s = run_main(lambda: run(a.preset, a.out, testbed_dir=a.testbed_dir,
                                     noises=_floats(a.noises, "--noises"), epsilons=_floats(a.epsilons, "--epsilons"),
                                     attacks=a.attacks, delta=a.delta, seed=a.seed, bootstrap=a.bootstrap,
                                     progress=not a.no_progress, strict=False, argv=argv),
                         debug=a.debug, compile_cache=not a.no_compile_cache)
    if status:
        return status
    print(report_markdown(s))
    if s["violations"]:
        for v in s["violations"]:
            print(f"PRIVACY AUDIT VIOLATION: {v}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
