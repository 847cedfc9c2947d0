"""The claims a canary audit tests, and what its scores prove: one-run bounds on a fixed grid of guess counts,
p-values of the accountant's (epsilon, delta) and of an exact Gaussian mu, the family of checks corrected by Holm's
procedure, and the pre-registered primary claims. No model: every function takes scores and inclusion vectors.

The guesses. ``m`` canaries, each included in training with probability 1/2, have membership scores (higher =
member). For a guess count k the auditor guesses "in" for the k highest scores and "out" for the k lowest; the grid
of k is fixed before any score is seen (``audit_grid``, or a primary claim's own). ``audit_bound`` is the best
one-run bound over the grid (``one_run.one_run_audit`` at alpha / grid size: Bonferroni); ``audit_claim_p_value``
and ``gdp_claim_p_value`` are the p-values of "the training is (epsilon, delta)-DP" and "mu-GDP" on the same
guesses, so that ``p <= alpha`` exactly when the bound exceeds the claim.

The checks. ``violation_check`` gathers every claim the rows test (the accountant's epsilon per record and per group
of r copies; at sample rate 1, where DP-SGD is exactly a Gaussian mechanism, its mu) and rejects by Holm's procedure
at family-wise level alpha: a correct training shows no violation with probability >= 1 - alpha.

The primary claims (``Primary``): one per privacy level (non-private, and each target epsilon), named before
anything is trained (mode, attack, canary kind, guess counts); each is the one-run bound on its own grid at ``ALPHA``
alone (``primary_claim``), never the best of several rows. ``summarize_primary`` adds the spread over independent
repetitions; ``ideal_primary`` what a perfect attacker would get on the same grid.

A model here is anything with the attributes the functions read (the audit experiment's ``Model``): ``name``,
``mode``, ``rep``, ``seed``, ``epsilon`` (accountant epsilon; inf: non-private), ``target`` (the level's target
epsilon or None), ``level``, ``mu`` (exact GDP mu of one record, or None) and ``group_epsilon(r) -> (epsilon,
delta)`` (None: no accountant).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np

from ..metrics import MetricError, epsilon_lower_bound, holm_significant
from .gdp import gdp_epsilon_estimate
from .one_run import guess_counts, one_run_audit, one_run_epsilon, one_run_fdp_p_value, one_run_p_value

NON_PRIVATE = "non-private"  # the privacy level of a model trained without DP
ALPHA = 0.05  # confidence of every lower bound: 95%
ANY_LEVEL = "*"  # a primary's k for a privacy level it does not name


@dataclasses.dataclass(frozen=True)
class Primary:
    """The pre-registered primary claim of every privacy level (non-private, and each DP model's target epsilon),
    fixed by the preset before anything is trained: the model's ``mode`` (fine-tune: "full" or "lora"; pretrain:
    "pretrain"), the ``attack``, the ``kind`` of canaries (those inserted once) and the guess counts ``k`` per level:
    ((level, (k, ...)), ...), level ``NON_PRIVATE``, a target epsilon, or ``ANY_LEVEL``. Each level's claim is the
    one-run bound on its grid at ``ALPHA`` alone (Bonferroni within the grid: alpha / its size): one claim per
    level, never the best of several rows."""

    mode: str
    attack: str
    kind: str
    k: tuple

    def grid(self, target: Optional[float]) -> tuple:
        """The guess counts of the level whose target epsilon is ``target`` (None: non-private)."""
        table = {str(level): tuple(int(x) for x in ks) for level, ks in self.k}
        key = NON_PRIVATE if target is None else f"{float(target):g}"
        ks = table.get(key, table.get(ANY_LEVEL))
        if not ks:
            raise MetricError(f"the primary claim names no k for level {key} (and no {ANY_LEVEL!r})")
        return ks

    @property
    def spec(self) -> str:
        """As ``--primary`` takes it: mode:attack:kind:level=k+k/level=k..."""
        return f"{self.mode}:{self.attack}:{self.kind}:" + "/".join(f"{lv}={'+'.join(map(str, ks))}"
                                                                  for lv, ks in self.k)


def audit_grid(m: int) -> list:
    """The guess counts k of the one-run audit (k "in" and k "out" on m canaries), fixed before any score is seen:
    m/80, m/40, m/20, m/10 (where a few confident guesses bind, as under DP) and 2m/5 (where everything is
    guessed right: a non-private model), each at least 1, with 2k <= m."""
    return sorted({k for k in (max(1, m // d) for d in (80, 40, 20, 10)) if 2 * k <= m} | ({2 * m // 5} - {0}))


def checked_grid(m: int, grid: Optional[Sequence[int]]) -> list:
    """``grid`` (the primary's k) checked against m, or ``audit_grid(m)``."""
    if grid is None:
        return audit_grid(m)
    ks = [int(k) for k in grid]
    if not ks or any(k < 1 or 2 * k > m for k in ks):
        raise MetricError(f"guess counts {ks}: each k needs 1 <= k and 2k <= {m} canaries")
    return ks


def audit_bound(scores: np.ndarray, included: np.ndarray, delta: float, alpha: float = ALPHA,
                bound: str = "steinke", grid: Optional[Sequence[int]] = None):
    """The one-run audit (``one_run_audit``) on ``grid`` (default ``audit_grid``): for each k, guesses
    "in" for the k highest scores and "out" for the k lowest, tested at alpha / (grid size) (Bonferroni); the best
    result. ``bound``: "steinke" (an (eps, delta) lower bound) or "fdp" (the same guesses in f-DP form: the epsilon
    at ``delta`` of the strongest Gaussian trade-off curve they rule out, Mahloujifar et al.)."""
    grid = checked_grid(len(scores), grid)
    return max((one_run_audit(scores, included, delta=delta, alpha=alpha / len(grid), k_pos=k, k_neg=k, bound=bound)
                for k in grid), key=lambda r: r.epsilon)


def audit_claim_p_value(scores: np.ndarray, included: np.ndarray, epsilon: float, delta: float,
                        grid: Optional[Sequence[int]] = None) -> float:
    """P-value of the claim "the training is (``epsilon``, ``delta``)-DP" from the guesses of ``audit_bound``: the
    smallest one-run p-value over the grid (default ``audit_grid``) times the grid's size (Bonferroni), capped at 1.
    It is <= alpha exactly when ``audit_bound(..., alpha).epsilon`` exceeds ``epsilon``: the test behind a
    violation, in a form a family of checks can correct for (``violation_check``). 1 for an infinite epsilon."""
    if math.isinf(epsilon):
        return 1.0
    grid = checked_grid(len(scores), grid)
    best = min(one_run_p_value(len(scores), *guess_counts(scores, included, k, k), float(epsilon), float(delta))
               for k in grid)
    return min(1.0, best * len(grid))


def gdp_claim_p_value(scores: np.ndarray, included: np.ndarray, mu: float,
                      grid: Optional[Sequence[int]] = None) -> float:
    """P-value of the claim "the training is ``mu``-GDP" from the same guesses, in f-DP form
    (``one_run_fdp_p_value``): the smallest over the grid times its size, capped at 1. At sample rate 1
    DP-SGD is exactly a Gaussian mechanism (T steps of noise sigma: sqrt(T) / sigma-GDP per record, r times that for
    r copies), so there this is a rigorous check of the mechanism, as ``audit_claim_p_value`` is of the accountant."""
    grid = checked_grid(len(scores), grid)
    m = len(scores)
    return min(1.0, len(grid) * min(one_run_fdp_p_value(m, *guess_counts(scores, included, k, k), float(mu))
                                    for k in grid))


NO_BOUNDS = {"eps_lower": None, "k": None, "eps_lower_fdp": None, "eps_lower_cp": None, "eps_gdp": None,
             "p_accountant": None, "mu": None, "p_gdp": None}


def lower_bounds(scores: np.ndarray, included: np.ndarray, delta: float, epsilon: float = math.inf,
                 mu: Optional[float] = None) -> dict:
    """What one attack's scores on canaries inserted once prove: eps_lower (one run, ``audit_bound``) and the guesses
    per side k of its best setting; eps_lower_fdp (the same guesses in f-DP form, Gaussian curve); eps_lower_cp
    (Clopper-Pearson, a heuristic here); eps_gdp (the Gaussian-DP estimate, ``gdp_epsilon_estimate``; not a
    bound); p_accountant, the one-run p-value of the accountant's claim ``epsilon`` (None without one); and, where
    the mechanism is exactly ``mu``-GDP (sample rate 1), p_gdp, the f-DP p-value of that claim (None otherwise)."""
    res = audit_bound(scores, included, delta)
    both = 0 < included.sum() < len(included)  # Clopper-Pearson and GDP need both classes
    labels = included.astype(int)
    return {"eps_lower": res.epsilon, "k": res.k_pos,
            "eps_lower_fdp": audit_bound(scores, included, delta, bound="fdp").epsilon,
            "eps_lower_cp": epsilon_lower_bound(scores, labels, delta=delta, alpha=ALPHA) if both else None,
            "eps_gdp": gdp_epsilon_estimate(scores, labels, delta=delta, alpha=ALPHA) if both else None,
            "p_accountant": None if math.isinf(epsilon) else audit_claim_p_value(scores, included, epsilon, delta),
            "mu": mu, "p_gdp": None if mu is None else gdp_claim_p_value(scores, included, mu)}


def bounds_by_reps(scores: np.ndarray, included: np.ndarray, reps: np.ndarray, model, attack: str,
                   kind: str, delta: float) -> list:
    """Per repetition count r: the one-run lower bound (``audit_bound``) on the canaries inserted r times, at the
    group delta of r copies, beside the group epsilon the accountant gives r copies (``model.group_epsilon``; inf
    for a non-private model) and the one-run p-value of that group claim (``p_accountant``; None without one); at
    sample rate 1, the exact group mu (r x ``model.mu``) and the f-DP p-value of that claim (``p_gdp``)."""
    rows = []
    for r in sorted(set(reps.tolist())):
        sel = reps == r
        if math.isinf(model.epsilon) or model.group_epsilon is None:
            upper, d = math.inf, delta
        else:
            upper, d = model.group_epsilon(int(r))
        ok = d < 1 and np.isfinite(scores[sel]).all() and sel.sum() >= 2
        lower = audit_bound(scores[sel], included[sel], delta=min(d, 1.0)).epsilon if ok else None
        p = audit_claim_p_value(scores[sel], included[sel], upper, d) if ok and math.isfinite(upper) else None
        mu = None if model.mu is None else model.mu * int(r)
        ok_gdp = mu is not None and np.isfinite(scores[sel]).all() and sel.sum() >= 2
        rows.append({"model": model.name, "attack": attack, "canary_kind": kind, "reps": int(r), "n": int(sel.sum()),
                     "n_included": int(included[sel].sum()), "delta": d,
                     "eps_upper": None if math.isinf(upper) else upper, "eps_lower": lower, "p_accountant": p,
                     "mu": mu, "p_gdp": gdp_claim_p_value(scores[sel], included[sel], mu) if ok_gdp else None})
    return rows


def tested_claims(rows: Sequence[dict], by_reps: Sequence[dict], primary: Sequence[dict] = ()) -> list:
    """(line, p-value) of every claim the audit tests: the accountant's, per record (``rows``), per group
    (``by_reps``) and on each primary claim's guesses (``primary``: the entries' ``runs``); and, where the mechanism
    is exactly Gaussian (sample rate 1), its mu, per record and per group (``p_gdp``)."""
    out = []
    for r in rows:
        if r["epsilon"] is not None and r.get("p_accountant") is not None:
            out.append((f"{r['model']} {r['attack']}{_kind(r)}: eps_lower {r['eps_lower']:.4g} vs accountant epsilon "
                        f"{r['epsilon']:.4g}", r["p_accountant"]))
        if r.get("p_gdp") is not None:
            out.append((f"{r['model']} {r['attack']}{_kind(r)}: f-DP guesses vs exact mu {r['mu']:.4g} (sample rate "
                        "1)", r["p_gdp"]))
    for r in by_reps:
        if r["eps_upper"] is not None and r.get("p_accountant") is not None:
            out.append((f"{r['model']} {r['attack']}{_kind(r)} reps {r['reps']}: eps_lower {r['eps_lower']:.4g} vs "
                        f"group epsilon {r['eps_upper']:.4g}", r["p_accountant"]))
        if r.get("p_gdp") is not None:
            out.append((f"{r['model']} {r['attack']}{_kind(r)} reps {r['reps']}: f-DP guesses vs exact group mu "
                        f"{r['mu']:.4g} (sample rate 1)", r["p_gdp"]))
    for e in primary:
        for run in e.get("runs", []):
            if run.get("p_accountant") is not None:
                out.append((f"primary {run['model']} {e['attack']} ({e['canary_kind']} canaries): eps_lower "
                            f"{run['eps_lower']:.4g} vs accountant epsilon {run['epsilon']:.4g}", run["p_accountant"]))
            if run.get("p_gdp") is not None:
                out.append((f"primary {run['model']} {e['attack']} ({e['canary_kind']} canaries): f-DP guesses vs "
                            f"exact mu {run['mu']:.4g} (sample rate 1)", run["p_gdp"]))
    return out


def violation_check(rows: Sequence[dict], by_reps: Sequence[dict], alpha: float = ALPHA,
                    primary: Sequence[dict] = ()) -> dict:
    """The family of claims the audit tests (the accountant's; at sample rate 1 the exact Gaussian mu:
    ``tested_claims``) and which of them it rejects: Holm's procedure over all of them at family-wise level ``alpha``
    (``mia.metrics.holm_significant``), so that a correct training shows no violation with probability
    >= 1 - alpha however many rows are checked. ``n_checks``, ``method``, ``alpha``, ``n_above_per_row`` (claims
    rejected by their own 95% test alone) and the ``violations`` (lines)."""
    checks = tested_claims(rows, by_reps, primary)
    rejected = holm_significant([p for _, p in checks], alpha) if checks else []
    return {"method": "holm", "alpha": alpha, "n_checks": len(checks),
            "n_above_per_row": sum(p <= alpha for _, p in checks),
            "violations": [f"{line} (p = {p:.3g}, Holm at family-wise {alpha:g} over {len(checks)} claims)"
                           for (line, p), bad in zip(checks, rejected) if bad]}


def violations(rows: Sequence[dict], by_reps: Sequence[dict], primary: Sequence[dict] = ()) -> list:
    """Lines naming every claim (per record: ``rows``; per group: ``by_reps``; the primary claims' guesses) that
    the audit rejects, corrected for the family of claims (``violation_check``)."""
    return violation_check(rows, by_reps, primary=primary)["violations"]


def above_accountant(rows: Sequence[dict]) -> list:
    """Lines naming every f-DP bound or Gaussian-DP estimate above the accountant's epsilon. Not violations by
    themselves: the f-DP bound assumes a Gaussian trade-off curve, which the accountant does not claim (at sample
    rate 1 the curve is exact and ``p_gdp`` checks it), and the Gaussian-DP estimate is no bound at all; worth a
    look all the same."""
    out = []
    for r in rows:
        for key in ("eps_lower_fdp", "eps_gdp"):
            if r["epsilon"] is not None and r.get(key) is not None and r[key] > r["epsilon"] * (1 + 1e-9):
                out.append(f"{r['model']} {r['attack']}{_kind(r)}: {key} {r[key]:.4g} > accountant epsilon "
                           f"{r['epsilon']:.4g} (assumes a Gaussian trade-off curve; not a violation by itself)")
    return out


def _kind(r: dict) -> str:
    return f" ({r['canary_kind']} canaries)" if r.get("canary_kind") else ""


def primary_plan(models: Sequence, primary: Primary) -> list:
    """Which row is each privacy level's primary claim: one entry per level (level, model, mode, attack, canary
    kind, k), from the models' names, modes and levels and the preset's ``primary`` alone. No score or result enters
    it, so no result can move the choice (it is made before anything is scored)."""
    out = []
    for m in models:
        if m.mode != primary.mode or m.rep != 0:
            continue
        target = None if math.isinf(m.epsilon) else (m.target if m.target is not None else m.epsilon)
        out.append({"level": m.level, "model": m.name, "mode": m.mode, "attack": primary.attack,
                    "canary_kind": primary.kind, "k": list(primary.grid(target))})
    if not out:
        raise MetricError(f"the primary claims need models of mode {primary.mode!r}; this run has "
                              f"{', '.join(dict.fromkeys(m.mode for m in models))}")
    return out


def primary_claim(scores: np.ndarray, included: np.ndarray, delta: float, grid: Sequence[int],
                  epsilon: float = math.inf, mu: Optional[float] = None) -> dict:
    """One primary claim: the one-run bound on ``grid`` at ``ALPHA`` alone (Bonferroni within the grid only), the
    guesses of its best setting, and the p-values of the accountant's claim and (sample rate 1) of the exact mu on
    the same guesses."""
    res = audit_bound(scores, included, delta, alpha=ALPHA, grid=grid)
    return {"eps_lower": res.epsilon, "k_best": res.k_pos, "guesses": res.r, "correct": res.v, "n": len(scores),
            "p_accountant": None if math.isinf(epsilon) else audit_claim_p_value(scores, included, epsilon, delta,
                                                                                 grid),
            "mu": mu, "p_gdp": None if mu is None else gdp_claim_p_value(scores, included, mu, grid)}


def primary_run(m, claim: dict) -> dict:
    """One repetition's entry of a primary claim: the model's repetition, name, seed and accountant epsilon (None:
    non-private), and the claim (``primary_claim``)."""
    return {"rep": m.rep, "model": m.name, "seed": m.seed, "epsilon": None if math.isinf(m.epsilon) else m.epsilon,
            **claim}


def summarize_primary(plan: Sequence[dict], runs: dict) -> list:
    """The summary's ``primary``: per plan entry, its claim (repetition 0: ``eps_lower`` at ``ALPHA`` alone, the
    accountant's ``epsilon``) and, over every repetition (``runs[level]``: dicts with rep, model, seed, epsilon,
    eps_lower, ...), the mean, SD, minimum and maximum of eps_lower."""
    out = []
    for e in plan:
        rs = sorted(runs.get(e["level"], []), key=lambda r: r["rep"])
        first = next((r for r in rs if r["rep"] == 0), None)
        vals = [r["eps_lower"] for r in rs]
        out.append({**e, "row": {"model": e["model"], "attack": e["attack"], "canary_kind": e["canary_kind"]},
                    "alpha": ALPHA, "epsilon": None if first is None else first["epsilon"],
                    "eps_lower": None if first is None else first["eps_lower"],
                    "k_best": None if first is None else first["k_best"], "n": None if first is None else first["n"],
                    "seed": None if first is None else first["seed"], "n_reps": len(vals),
                    "mean": float(np.mean(vals)) if vals else None,
                    "sd": float(np.std(vals, ddof=1)) if len(vals) > 1 else None,
                    "min": min(vals) if vals else None, "max": max(vals) if vals else None, "runs": rs})
    return out


def family_bounds(items: Sequence[tuple], alpha: float = ALPHA) -> int:
    """The exploratory rows' family-wise correction: ``items`` are (row, scores, included, delta) of every bound the
    run reports beside the primary claims (the main table and by repetitions); each row gets ``eps_lower_family``,
    its bound at alpha / N (Bonferroni over all N, the grid's own correction inside), so that all N hold together
    with probability >= 1 - alpha. Returns N."""
    n = len(items)
    for row, sc, inc, d in items:
        row["eps_lower_family"] = audit_bound(sc, inc, d, alpha=alpha / n).epsilon
    return n


def ideal_primary(m: int, grid: Sequence[int], delta: float, mu: Optional[float], draws: int = 50,
                  seed: int = 0) -> dict:
    """What a perfect attacker's primary claim would be on ``m`` canaries inserted once with guess counts ``grid``:
    without privacy (``mu`` None), every guess right (one number); on an exactly ``mu``-GDP mechanism (scores
    N(mu, 1) for members, N(0, 1) for the others), the mean and SD over ``draws`` draws (numpy default_rng(seed))."""
    if mu is None:
        return {"m": m, "mean": max(one_run_epsilon(m, 2 * k, 2 * k, delta=delta, alpha=ALPHA / len(grid))
                                    for k in grid), "sd": 0.0}
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(draws):
        inc = rng.random(m) < 0.5
        vals.append(audit_bound(inc * mu + rng.normal(size=m), inc, delta, grid=grid).epsilon)
    return {"m": m, "mean": float(np.mean(vals)), "sd": float(np.std(vals, ddof=1)), "draws": draws}
