"""Privacy audit as one command: models trained with and without DP-SGD on one private set with canaries, every
attack scored on the canaries and on natural rows, and what the attacks prove about epsilon.

    python -m experiments.audit [--setting finetune|pretrain] [--preset default|smoke|large] [--out DIR] ...

**Settings.** ``finetune`` (the default; ``mia.testbed.finetune``): a trained testbed (the base, preset ``audit``:
1,280 reserved token ids) is fine-tuned on a private set of natural rows the base never saw plus a canary pool,
full-parameter and LoRA, without privacy and with DP-SGD at accountant epsilon about 1, 4 and 16 (Poisson sampling
at the preset's rate, clipping 1, ``dp_accounting`` for what the trainer did). ``pretrain``: a testbed trained from
scratch with the canaries inserted, and its DP-SGD twins (``mia.testbed.build_twin``; they share its canaries).

**The primary claims** (pre-registered). The preset names, before anything is trained, one claim per privacy
level (non-private, and each target epsilon): the fine-tune (full or LoRA), the attack, the canary kind and the
guess counts k (``Primary``; ``--primary`` overrides it, to be given before any result is seen). Default: LoRA,
the new-token ``contrast`` score, new-token canaries inserted once, k = 400 without privacy and 100, 50, 100 at
epsilon 1, 4, 16. Each is the one-run bound at 95% on its own grid alone, and the report leads with them;
``--reps`` repeats the primary models with fresh seeds for the claim's mean and range. Every other number is
exploratory.

1. **The canaries** (``mia.testbed.canaries``). The audit pool: new-token canaries (random corpus tokens, then the
   canary's own reserved token: the secret), 1,000 inserted once and 250 four times, each included with
   probability 1/2. Every model has its own seed (``model_seed``: run seed, repetition and model), so its own
   inclusion, batches and noise. The fine-tune's **kinds run** compares every kind (new, unigram, bigram, sampled,
   and the tokens and words baselines) on one non-private fine-tune that memorizes.
2. **Scores.** Every attack of the preset on every canary under each model, the reference attack with the base as
   its reference (fine-tune), and for new-token canaries ``contrast`` (``new_token_contrast``). Per (model, attack,
   canary kind), on the canaries inserted once: AUC, TPR at 1% and 0.1% FPR, ``eps_lower`` (the one-run bound of
   Steinke, Nasr and Jagielski 2023 at 95% for that row alone, on ``audit_grid``) and ``eps_lower_family`` (the same
   bound, Bonferroni over every bound the run reports: the exploratory rows' family-wise correction);
   ``eps_lower_cp``: Clopper-Pearson (a heuristic).
3. **Natural rows.** The same attacks on natural members and non-members: ``natural_auc``.
4. **By repetitions** (``by_reps``): the bound on the canaries inserted r times against the group epsilon of r.
5. **The checks.** Every private row, group and primary claim tests the accountant's claim with the one-run audit;
   at sample rate 1, where DP-SGD is exactly a Gaussian mechanism (sqrt(T) / sigma-GDP per record, r times that for
   r copies), the same guesses in f-DP form test that exact curve too. The claims Holm's procedure rejects at
   family-wise level 5% are violations: the run writes everything, lists them and exits with status 3
   (``AuditViolation`` from the Python API). ``eps_gdp`` (the Gaussian-DP estimate) is not a bound. ``targets``
   compares the primary claims with the goals (non-private >= 4; at accountant epsilon 4, >= 1, aiming at 1.8).

**What is written beside a model holds no un-noised statistic of the private set**: each fine-tune's training log,
losses, clipped fractions and copies drawn go to its ``private/`` folder, which the audit never reads. delta is at
most 1 / records, every canary copy counted.

Outputs (``--out``, default ``results/audit-<preset>`` or ``results/audit-<preset>-pretrain``): ``report.md``;
``audit.{md,csv,tex,json}`` (one row per model, attack and canary kind); ``kinds.*`` (fine-tune: TPR by kind);
``by_reps.*``; ``exposure.*`` (pretrain); ``eps_lower_vs_epsilon.png``, ``auc_vs_epsilon.png``, ``kinds.png``,
``exposure_vs_reps.png``; ``summary.json``; ``scores/<model>/{canaries,natural}.jsonl``; ``manifest.json``;
``timings.json``. Models go to ``testbeds/audit-<preset>[-pretrain]/`` (``--testbed-dir``), reused. Same seed: the
same tables.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from mia.atomic import save_figure, write_text
from mia.privacy.one_run import (AuditViolation, guess_counts, one_run_audit, one_run_epsilon, one_run_fdp_p_value,
                                 one_run_p_value)
from mia.privacy.exposure import exposure_by_reps, exposure_sampled, exposure_skewnorm
from mia.privacy.gdp import gdp_epsilon_estimate
from mia.metrics import epsilon_lower_bound, holm_significant, metric_rows
from mia.report import markdown, pyplot
from mia.testbed import build_testbed, build_twin, dp, preset as testbed_preset
from mia.testbed import finetune as ft
from mia.testbed.canaries import candidate_rows, canary_source, new_token_contrast, sequence_nll
from mia.testbed.config import canary_kinds

from mia.checkpoints import check_checkpoints, check_testbed_checkpoints
from mia.data.draw import draw_testbed_split, SplitSizes
from experiments.harness import (check_paths, experiment_parser, ExperimentError, run_main, say_fn, score_split,
                                select_attacks, Timings, write_json, write_manifest, write_tables)

NON_PRIVATE = "non-private"
ALPHA = 0.05  # confidence of every lower bound: 95%
SETTINGS = ("finetune", "pretrain")
AUDIT_KIND = "new"  # the kind the audit pool holds (the strongest: docs/auditing.md)
CONTRAST = "contrast"  # the new-token contrast score's attack label
EXPOSURE_KINDS = ("tokens", "words", "unigram", "bigram")  # kinds whose candidates are cheap fresh draws
UNAVAILABLE = ("ref", "mlm", "prefix", "member_prefix", "calib", "train", "freq")  # canaries have no partitions
TARGETS = {"nonprivate": 4.0, "eps4": 1.0, "eps4_aim": 1.8}
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
            raise ExperimentError(f"the primary claim names no k for level {key} (and no {ANY_LEVEL!r})")
        return ks

    @property
    def spec(self) -> str:
        """As ``--primary`` takes it: mode:attack:kind:level=k+k/level=k..."""
        return f"{self.mode}:{self.attack}:{self.kind}:" + "/".join(f"{lv}={'+'.join(map(str, ks))}"
                                                                  for lv, ks in self.k)


def parse_primary(spec: str, default: Primary) -> Primary:
    """``--primary MODE:ATTACK:KIND[:LEVEL=K[+K...]/...]`` (levels: non-private, a target epsilon, or *); without
    the k part, the preset's k."""
    parts = spec.split(":")
    if len(parts) not in (3, 4) or not all(parts[:3]):
        raise ExperimentError(f"--primary {spec!r}: expected MODE:ATTACK:KIND[:LEVEL=K[+K...]/...], e.g. "
                              f"{default.spec}")
    k = default.k
    if len(parts) == 4:
        try:
            k = tuple((lv.strip() if lv.strip() in (NON_PRIVATE, ANY_LEVEL) else f"{float(lv):g}",
                       tuple(int(x) for x in ks.split("+")))
                      for lv, ks in (item.split("=") for item in parts[3].split("/")))
        except ValueError:
            raise ExperimentError(f"--primary {spec!r}: bad k part {parts[3]!r} (LEVEL=K[+K...]/...)") from None
        if any(x < 1 for _, ks in k for x in ks):
            raise ExperimentError(f"--primary {spec!r}: every k must be >= 1")
    return Primary(parts[0], parts[1], parts[2], k)


def model_seed(seed: int, rep: int, name: str) -> int:
    """The seed of one model of the run: sha256 of (run seed, repetition, model name), so that every model has its
    own canary inclusion, batches and noise, and the same run seed gives the same models."""
    digest = hashlib.sha256(f"mia-audit/{int(seed)}/{int(rep)}/{name}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % (2 ** 31 - 1)


@dataclasses.dataclass(frozen=True)
class Preset:
    """A pretraining audit: the testbed (a testbed preset and overrides), the canary pool (``canaries`` rows of
    ``canary_kind``, reps cycled), the DP-SGD noise multipliers of the twins, the attacks (a spec, or "default": every
    registered attack up to ``max_cost`` that needs nothing but the examples), the natural split's size per class,
    and the exposure reference set's size."""

    testbed: str
    overrides: tuple
    canaries: int
    canary_reps: tuple
    noises: tuple  # DP-SGD noise multipliers of the twins (dp.noise_for_epsilon of the target epsilons, precomputed)
    attacks: str
    max_cost: str
    n_natural: int
    n_candidates: int
    canary_kind: str = "tokens"
    primary: Primary = Primary("pretrain", "loss", "tokens", ((NON_PRIVATE, (1,)), (ANY_LEVEL, (1,))))


@dataclasses.dataclass(frozen=True)
class FinetunePreset:
    """A fine-tuning audit: the base (a testbed preset and overrides), the audit recipe (``audit``: its pool and
    training; non-private, full-parameter), the LoRA models' rank, the target accountant epsilons of the DP models
    (noise by ``finetune.noise_for_epsilon``), the kinds run's recipe (non-private; None: no kinds run), the
    attacks and the natural split's size per class."""

    base: str
    base_overrides: tuple
    audit: ft.FinetuneConfig
    lora_rank: int
    epsilons: tuple
    kinds: Optional[ft.FinetuneConfig]
    attacks: str
    max_cost: str
    n_natural: int
    primary: Primary = None
    reps: int = 1  # independent repetitions of the primary models (fresh seeds): the primary claim's spread


ALL_KINDS = ("new", "tokens", "words", "unigram", "bigram", "sampled")


def _kinds_groups(n: int) -> tuple:
    return tuple((k, 1, n) for k in ALL_KINDS)


PRESETS = {
    # about 90 s on 2 CPU cores: a 40-step testbed of 32-token rows, 96 canaries, two private twins
    "smoke": Preset("smoke", (("max_corpus_bytes", 200_000), ("seq_len", 32), ("train_steps", 40),
                              ("checkpoints", ()), ("warmup_steps", 4)),
                    canaries=96, canary_reps=(1, 4, 16), noises=(0.8667, 0.4246), attacks="loss,zlib,mink:k=0.2",
                    max_cost="stats", n_natural=100, n_candidates=200,
                    primary=Primary("pretrain", "loss", "tokens", ((NON_PRIVATE, (12,)), (ANY_LEVEL, (3,))))),
    # the audit testbed (100 steps x 16 rows of 65 tokens), 2,000 canaries (new-token and random tokens, reps 1 and
    # 4: 500 of each pair), three private twins at epsilon 1, 4, 16 (delta 1/6600: 1,600 natural rows and 5,000
    # canary copies at most)
    "default": Preset("audit", (), canaries=2000, canary_reps=(1, 4), noises=(0.7922, 0.5287, 0.3307),
                      attacks="default", max_cost="model", n_natural=300, n_candidates=1000, canary_kind="new,tokens",
                      primary=Primary("pretrain", CONTRAST, "new", ((NON_PRIVATE, (200,)), (ANY_LEVEL, (25,))))),
}
_AUDIT_RECIPE = dict(canary_len=33, steps=8, sample_rate=1.0, optimizer="sgd", lr=1.0, lora_alpha=8.0)
_KINDS_RECIPE = dict(canary_len=33, steps=256, sample_rate=1 / 32, optimizer="adam", lr=1e-3)
FT_PRESETS = {
    # a few minutes on 2 CPU cores (the slow tests): a 40-step base of 32-token rows, 120 + 40 new-token canaries,
    # two private epsilons; a kinds run of 60 canaries per kind
    "smoke": FinetunePreset(
        "audit", (("max_corpus_bytes", 200_000), ("seq_len", 32), ("train_steps", 40), ("checkpoints", ()),
                  ("warmup_steps", 4), ("reserved_tokens", 200)),
        ft.FinetuneConfig(preset="smoke", n_private=128, canary_groups=(("new", 1, 120), ("new", 4, 40)),
                          **{**_AUDIT_RECIPE, "canary_len": 17, "steps": 4}),
        lora_rank=8, epsilons=(1.0, 8.0),
        kinds=ft.FinetuneConfig(preset="smoke-kinds", n_private=128, canary_groups=_kinds_groups(60),
                                **{**_KINDS_RECIPE, "canary_len": 17, "steps": 32, "sample_rate": 1 / 8}),
        attacks="loss,zlib,mink:k=0.2,ref", max_cost="stats", n_natural=100,
        primary=Primary("lora", CONTRAST, "new", ((NON_PRIVATE, (48,)), ("1", (12,)), ("8", (12,)),
                                                  (ANY_LEVEL, (6,))))),
    # the default (docs/auditing.md): the audit testbed as base, 512 private rows, 1,000 + 250 new-token canaries of
    # 33 tokens, 8 full-batch steps (sample rate 1) of SGD; full and LoRA (rank 8 on the attention kernels, and the
    # reserved tokens' rows) at epsilon 1, 4, 16 and without privacy; a kinds run of 1,000 canaries per kind
    "default": FinetunePreset(
        "audit", (),
        ft.FinetuneConfig(preset="default", n_private=512, canary_groups=(("new", 1, 1000), ("new", 4, 250)),
                          **_AUDIT_RECIPE),
        lora_rank=8, epsilons=(1.0, 4.0, 16.0),
        kinds=ft.FinetuneConfig(preset="default-kinds", n_private=512, canary_groups=_kinds_groups(1000),
                                **_KINDS_RECIPE),
        attacks="loss,zlib,mink,minkpp,ref", max_cost="model", n_natural=300,
        primary=Primary("lora", CONTRAST, "new", ((NON_PRIVATE, (400,)), ("1", (100,)), ("4", (50,)), ("16", (100,)),
                                                  (ANY_LEVEL, (50,)))), reps=3),
    # for an accelerator: the default testbed preset as base (docs/testbed.md "default", with 5,120 reserved tokens:
    # 2.2M parameters), 2,048 private rows, 4,000 + 1,000 new-token canaries of 65 tokens (the one-run bound at
    # epsilon 4 grows with m: 1.79 for a perfect attacker), a kinds run of 2,000 per kind
    "large": FinetunePreset(
        "default", (("reserved_tokens", 5120), ("checkpoints", ())),
        ft.FinetuneConfig(preset="large", n_private=2048, canary_groups=(("new", 1, 4000), ("new", 4, 1000)),
                          **{**_AUDIT_RECIPE, "canary_len": 65}),
        lora_rank=8, epsilons=(1.0, 4.0, 16.0),
        kinds=ft.FinetuneConfig(preset="large-kinds", n_private=2048, canary_groups=_kinds_groups(2000),
                                **{**_KINDS_RECIPE, "canary_len": 65, "steps": 512, "sample_rate": 1 / 64}),
        attacks="default", max_cost="model", n_natural=1000,
        primary=Primary("lora", CONTRAST, "new", ((NON_PRIVATE, (1600,)), ("1", (400,)), ("4", (200,)),
                                                  ("16", (400,)), (ANY_LEVEL, (200,)))), reps=3),
}


@dataclasses.dataclass
class Model:
    """One audited model: its name, the testbed or fine-tune it is, accountant epsilon (inf: non-private), noise
    multiplier, delta, mode ("pretrain", "full", "lora") and ``group_epsilon(r) -> (epsilon, delta)`` of a canary
    of r copies (None: no accountant)."""

    name: str
    testbed: object
    epsilon: float
    noise: Optional[float]
    delta: float
    mode: str = "pretrain"
    group_epsilon: Optional[Callable[[int], tuple]] = None
    target: Optional[float] = None  # the preset's target epsilon of a private model (its privacy level)
    seed: Optional[int] = None  # the model's own seed (model_seed): its inclusion, batches and noise
    mu: Optional[float] = None  # exact Gaussian-DP mu of one record (sample rate 1: sqrt(steps) / noise), else None
    rep: int = 0  # the repetition (0: the full audit; 1, 2, ...: the primary models again, fresh seeds)

    @property
    def level(self) -> str:
        """The privacy level: "non-private", or the target epsilon (``:g``)."""
        return NON_PRIVATE if math.isinf(self.epsilon) else f"{self.target if self.target else self.epsilon:g}"


# ============================================================================================ pure parts
def model_name(epsilon: Optional[float], mode: str = "pretrain") -> str:
    """"non-private", or "eps=<accountant epsilon, 3 significant digits>"; a fine-tune's prefixed by its mode."""
    name = NON_PRIVATE if epsilon is None else f"eps={epsilon:.3g}"
    return name if mode == "pretrain" else f"{mode} {name}"


def canary_examples(tokens: np.ndarray, members: np.ndarray) -> list:
    """Examples (id, tokens, label) of the canary pool: label 1 = included in this model's training."""
    return [{"id": f"canary{i}", "tokens": tokens[i].tolist(), "label": int(members[i])} for i in range(len(tokens))]


def audit_grid(m: int) -> list:
    """The guess counts k of the one-run audit (k "in" and k "out" on m canaries), fixed before any score is seen:
    m/80, m/40, m/20, m/10 (where a few confident guesses bind, as under DP) and 2m/5 (where everything is
    guessed right: a non-private model), each at least 1, with 2k <= m."""
    return sorted({k for k in (max(1, m // d) for d in (80, 40, 20, 10)) if 2 * k <= m} | ({2 * m // 5} - {0}))


def _grid(m: int, grid: Optional[Sequence[int]]) -> list:
    """``grid`` (the primary's k) checked against m, or ``audit_grid(m)``."""
    if grid is None:
        return audit_grid(m)
    ks = [int(k) for k in grid]
    if not ks or any(k < 1 or 2 * k > m for k in ks):
        raise ExperimentError(f"guess counts {ks}: each k needs 1 <= k and 2k <= {m} canaries")
    return ks


def audit_bound(scores: np.ndarray, included: np.ndarray, delta: float, alpha: float = ALPHA,
                bound: str = "steinke", grid: Optional[Sequence[int]] = None):
    """The one-run audit (``one_run_audit``) on ``grid`` (default ``audit_grid``): for each k, guesses
    "in" for the k highest scores and "out" for the k lowest, tested at alpha / (grid size) (Bonferroni); the best
    result. ``bound``: "steinke" (an (eps, delta) lower bound) or "fdp" (the same guesses in f-DP form: the epsilon
    at ``delta`` of the strongest Gaussian trade-off curve they rule out, Mahloujifar et al.)."""
    grid = _grid(len(scores), grid)
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
    grid = _grid(len(scores), grid)
    best = min(one_run_p_value(len(scores), *guess_counts(scores, included, k, k), float(epsilon), float(delta))
               for k in grid)
    return min(1.0, best * len(grid))


def gdp_claim_p_value(scores: np.ndarray, included: np.ndarray, mu: float,
                      grid: Optional[Sequence[int]] = None) -> float:
    """P-value of the claim "the training is ``mu``-GDP" from the same guesses, in f-DP form
    (``one_run_fdp_p_value``): the smallest over the grid times its size, capped at 1. At sample rate 1
    DP-SGD is exactly a Gaussian mechanism (T steps of noise sigma: sqrt(T) / sigma-GDP per record, r times that for
    r copies), so there this is a rigorous check of the mechanism, as ``audit_claim_p_value`` is of the accountant."""
    grid = _grid(len(scores), grid)
    m = len(scores)
    return min(1.0, len(grid) * min(one_run_fdp_p_value(m, *guess_counts(scores, included, k, k), float(mu))
                                    for k in grid))


def audit_row(setting: str, model: Model, attack: str, kind: str, canary_row: dict, natural_row: Optional[dict],
              bounds: dict) -> dict:
    """One row of the main table: ``epsilon`` is the accountant's (None for a non-private model); ``bounds``:
    the lower bounds computed on these canaries (eps_lower, eps_lower_cp, k, ...)."""
    row = {"setting": setting, "model": model.name, "mode": model.mode,
           "epsilon": None if math.isinf(model.epsilon) else model.epsilon, "noise": model.noise, "attack": attack,
           "canary_kind": kind, "n": canary_row.get("n")}
    for k in ("auc", "auc_se", "tpr_at_1pct_fpr", "tpr_at_0.1pct_fpr"):
        row[k] = canary_row.get(k)
    row.update(bounds)
    for k in ("auc", "auc_se", "tpr_at_1pct_fpr"):
        row[f"natural_{k}"] = None if natural_row is None else natural_row.get(k)
    return row


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


def bounds_by_reps(scores: np.ndarray, included: np.ndarray, reps: np.ndarray, model: Model, attack: str,
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


def _checks(rows: Sequence[dict], by_reps: Sequence[dict], primary: Sequence[dict] = ()) -> list:
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
    """The family of claims the audit tests (the accountant's; at sample rate 1 the exact Gaussian mu: ``_checks``)
    and which of them it rejects: Holm's procedure over all of them at family-wise level ``alpha``
    (``mia.metrics.holm_significant``), so that a correct training shows no violation with probability
    >= 1 - alpha however many rows are checked. ``n_checks``, ``method``, ``alpha``, ``n_above_per_row`` (claims
    rejected by their own 95% test alone) and the ``violations`` (lines)."""
    checks = _checks(rows, by_reps, primary)
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


def primary_plan(models: Sequence[Model], primary: Primary) -> list:
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
        raise ExperimentError(f"the primary claims need models of mode {primary.mode!r}; this run has "
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


# ============================================================================================ scoring
def _natural_examples(rows: np.ndarray, members: np.ndarray, nonmembers: np.ndarray, n: int, seed: int) -> list:
    """Examples of ``n`` members and ``n`` non-members drawn (seeded) from the order row indices given."""
    rng = np.random.default_rng([int(seed), 0xA0D17])
    pick_m = np.sort(rng.choice(members, min(n, len(members)), replace=False))
    pick_n = np.sort(rng.choice(nonmembers, min(n, len(nonmembers)), replace=False))
    idx = np.concatenate([pick_m, pick_n])
    data = np.asarray(rows.get_rows(idx), np.int64).reshape(len(idx), -1)
    return [{"id": f"row{int(i)}", "index": int(i), "tokens": data[j].tolist(), "label": int(j < len(pick_m))}
            for j, i in enumerate(idx)]


def score_model(setting: str, m: Model, c, members: np.ndarray, natural: list, to_run, *, seed: int, bootstrap: int,
                out: Path, progress: bool, ref_model=None, timings=None, keep: Optional[list] = None,
                store: Optional[dict] = None) -> tuple:
    """(rows, by_reps, skipped, notes) of one model: every attack (and the new-token contrast) on the canaries
    (metrics and bounds per kind, on the canaries inserted once), on the natural rows, and by repetitions.
    ``keep``: gets (row, scores, included, delta) of every bound (for ``family_bounds``); ``store``: gets
    {(attack, kind): (scores, included)} of the canaries inserted once (for the primary claims)."""
    model = m.testbed.load_model()
    with timings(f"score:{m.name}"):
        rc = score_split(model, canary_examples(c.tokens, members), to_run, seed=seed, progress=progress,
                         ref_model=ref_model)
        rn = score_split(model, natural, to_run, seed=seed, progress=progress, ref_model=ref_model)
        extra = {CONTRAST: new_token_contrast(model, c)} if (c.kind_of == "new").any() else {}
    order = {cid: j for j, cid in enumerate(rc.ids)}
    pos = np.array([order[f"canary{i}"] for i in range(c.m)])
    scores = {a: np.asarray(s, np.float64)[pos] for a, s in rc.scores.items()} | extra
    skipped = {f"{m.name}: {k}": v for k, v in {**rc.skipped, **rn.skipped}.items()}
    rc.write(out / "scores" / m.name / "canaries.jsonl",
             {f"canary{i}": {"reps": int(c.reps[i]), "kind": str(c.kind_of[i])} for i in range(c.m)},
             extra_scores={k: v[np.argsort(pos)] for k, v in extra.items()})
    rn.write(out / "scores" / m.name / "natural.jsonl", {e["id"]: {"index": e["index"]} for e in natural})
    nrow = {r["method"]: r for r in metric_rows(rn.scores, rn.labels, rn.ids, bootstrap, seed)}
    rows, by_reps = [], []
    kinds = c.kind_of
    for kind in dict.fromkeys(kinds):
        sel = kinds == kind
        once = sel & (c.reps == 1)
        for attack, s in scores.items():
            if not np.isfinite(s[sel]).all():
                continue
            ids = [f"canary{i}" for i in np.flatnonzero(once)]
            crow = metric_rows({attack: s[once]}, members[once].astype(int), ids, bootstrap, seed)[0]
            crow["n"] = int(once.sum())
            bounds = (lower_bounds(s[once], members[once], m.delta, m.epsilon, m.mu) if once.sum() >= 2
                      else dict(NO_BOUNDS))
            rows.append(audit_row(setting, m, attack, str(kind), crow, nrow.get(attack), bounds))
            if keep is not None and bounds["eps_lower"] is not None:
                keep.append((rows[-1], s[once], members[once], m.delta))
            if store is not None:
                store[(attack, str(kind))] = (s[once], members[once])
            br = bounds_by_reps(s[sel], members[sel], c.reps[sel], m, attack, str(kind), m.delta)
            for b in br:
                if keep is not None and b["eps_lower"] is not None:
                    r_sel = c.reps[sel] == b["reps"]
                    keep.append((b, s[sel][r_sel], members[sel][r_sel], b["delta"]))
            by_reps += br
    return rows, by_reps, skipped, list(rc.notes + rn.notes)


# ============================================================================================ pretrain
def _models(p: Preset, root: Path, noises: Sequence[float], delta: Optional[float], progress: bool,
            timings: Timings, say) -> list:
    """The non-private testbed with the preset's canaries and one DP-SGD twin per noise multiplier (built, or
    reused / resumed from ``root``)."""
    with timings("testbed:non-private"):
        plain = build_testbed(p.testbed, root / NON_PRIVATE, progress=progress, canaries=p.canaries,
                              canary_reps=tuple(p.canary_reps), canary_kind=p.canary_kind, **dict(p.overrides))
    d = dp.default_delta(plain.config) if delta is None else float(delta)
    models = [Model(NON_PRIVATE, plain, math.inf, None, d)]
    for sigma in noises:
        with timings(f"testbed:noise={sigma:g}"):
            tb = build_twin(plain, root / f"noise{sigma:g}", progress=progress, dp_noise=float(sigma))
        eps = tb.dp_epsilon(delta=d)
        say(f"noise multiplier {sigma:g}: accountant epsilon {eps:.3f} at delta {d:.3g}")
        cfg = tb.config
        models.append(Model(model_name(eps), tb, eps, float(sigma), d,
                            group_epsilon=lambda r, cfg=cfg: dp.canary_epsilon(cfg, r, delta=d)))
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
    """The testbed config of a pretraining preset (its canaries included), without building anything."""
    return testbed_preset(p.testbed, canaries=p.canaries, canary_reps=tuple(p.canary_reps), canary_kind=p.canary_kind,
                          **dict(p.overrides))


def _exposure_rows(name: str, model, c, n_candidates: int, seed: int, source=None) -> list:
    """Mean exposure by repetitions of the canaries of the first kind whose candidates are fresh draws."""
    kind = next((k for k in canary_kinds(c.kind) if k in EXPOSURE_KINDS), None)
    if kind is None:
        return []
    sel = c.kind_of == kind
    cand = candidate_rows(c, n_candidates, seed, kind=kind, source=source,
                          tokenizer=None if source is None else source.tokenizer)
    canary_loss, cand_loss = sequence_nll(model, c.tokens[sel]), sequence_nll(model, cand)
    rows = []
    by = {k: exposure_by_reps(f(canary_loss, cand_loss), c.reps[sel], c.included[sel])
          for k, f in (("sampled", exposure_sampled), ("skewnorm", exposure_skewnorm))}
    for a, b in zip(by["sampled"], by["skewnorm"]):
        rows.append({"model": name, "canary_kind": kind, "reps": a["reps"], "n_included": a["n_included"],
                     "sampled_mean": a["mean"], "skewnorm_mean": b["mean"],
                     "skewnorm_excluded_mean": b["excluded_mean"]})
    return rows


def run_pretrain(preset: str, out: Path, root: Path, *, noises, epsilons, attacks, delta, seed, bootstrap, progress,
                 timings: Timings, say, primary: Optional[str] = None, reps: Optional[int] = None) -> tuple:
    """The pretraining audit: (summary parts, the testbed config, its canary file's sha256, the models). The twins
    share the non-private testbed's order, canaries and seed (``build_twin``): its rows are not independent
    replicates, and ``reps`` > 1 is refused."""
    if preset not in PRESETS:
        raise ExperimentError(f"unknown preset {preset!r} for --setting pretrain; presets: {', '.join(PRESETS)}")
    p = PRESETS[preset]
    if reps is not None and int(reps) > 1:
        raise ExperimentError("--reps is for --setting finetune (the pretrain twins share one testbed's canaries)")
    pri = p.primary if primary is None else parse_primary(primary, p.primary)
    if delta is not None and float(delta) > dp.default_delta(preset_config(p)) * (1 + 1e-12):
        raise ExperimentError(f"--delta {delta:g} must be <= 1 / records = {dp.default_delta(preset_config(p)):.3g} "
                              "(natural rows and every canary copy)")
    to_run, skipped = select_attacks(p.attacks if attacks is None else attacks, max_cost=p.max_cost,
                                     unavailable=UNAVAILABLE, preset=preset)
    if not to_run:
        raise ExperimentError(f"no attack to run: {'; '.join(f'{k}: {v}' for k, v in skipped.items())}")
    if epsilons is not None:
        with timings("noise_for_epsilon"):
            noises = noises_for(p, sorted(epsilons, reverse=True), delta, say)
    noises = tuple(sorted(p.noises if noises is None else noises, reverse=True))  # smallest epsilon first
    models = _models(p, root, noises, delta, progress, timings, say)
    plan = primary_plan(models, pri)  # fixed here, before anything is scored
    with timings("check"):  # every checkpoint opened and checked before it is scored (mia.checkpoints)
        records, _ = check_testbed_checkpoints([(m.name, m.testbed, m.testbed.train_steps) for m in models])
    plain = models[0].testbed
    c = plain.canaries()
    header, natural, note = draw_testbed_split(plain, plain.train_steps, SplitSizes(eval=p.n_natural), seed,
                                               allow_fewer=True)
    notes = [note] if note else []
    source = None
    if not c.legacy:
        kinds = [k for k in canary_kinds(c.kind) if k in EXPOSURE_KINDS]
        source = canary_source(plain.tokenizer(), kinds)
    rows, by_reps, exposure, keep, stores = [], [], [], [], {}
    for m in models:
        if m.testbed.natural_membership() != plain.natural_membership():
            raise ExperimentError(f"{m.name}: natural membership differs from the non-private model's")
        stores[m.name] = {}
        r, b, sk, nt = score_model("pretrain", m, c, m.testbed.canary_membership(), natural, to_run, seed=seed,
                                   bootstrap=bootstrap, out=out, progress=progress, timings=timings, keep=keep,
                                   store=stores[m.name])
        rows, by_reps = rows + r, by_reps + b
        skipped.update(sk)
        notes += [n for n in nt if n not in notes]
        with timings(f"exposure:{m.name}"):
            exposure += _exposure_rows(m.name, m.testbed.load_model(), c, p.n_candidates, seed, source)
    by_name = {m.name: m for m in models}
    runs: dict = {}
    for e in plan:
        m = by_name[e["model"]]
        if (e["attack"], e["canary_kind"]) not in stores[m.name]:
            raise ExperimentError(f"the primary claim's attack {e['attack']!r} on {e['canary_kind']} canaries was not "
                                  "scored")
        sc, inc = stores[m.name][(e["attack"], e["canary_kind"])]
        runs.setdefault(e["level"], []).append(_primary_run(m, primary_claim(sc, inc, m.delta, e["k"], m.epsilon)))
    primary_entries = summarize_primary(plan, runs)
    family_size = family_bounds(keep)
    for r in rows + by_reps:
        r.setdefault("eps_lower_family", None)
    cfg = plain.config
    model_rows = [{"model": m.name, "mode": m.mode, "seed": cfg.seed, "noise": m.noise,
                   "epsilon": None if math.isinf(m.epsilon) else m.epsilon,
                   "epsilon_rdp": None if m.noise is None else m.testbed.dp_epsilon(delta=m.delta, accountant="rdp"),
                   "delta": m.delta, "sampling": None if m.noise is None else m.testbed.config.dp_sampling,
                   "sample_rate": None if m.noise is None else dp.sample_rate(cfg), "steps": cfg.train_steps,
                   "testbed": str(m.testbed.root)} for m in models]
    description = (f"Pretraining. Testbed preset {p.testbed} ({cfg.train_steps} steps x batch {cfg.batch_size}, rows "
                   f"of {cfg.row_len} tokens), {len(c.reps)} canaries of kinds {c.kind} (reps "
                   f"{', '.join(map(str, p.canary_reps))}, {int(c.included.sum())} included), DP-SGD twins at noise "
                   f"{', '.join(f'{s:g}' for s in noises)} (Poisson sampling at rate 1/{cfg.train_steps}, clip "
                   f"{cfg.dp_clip}); natural split at step {cfg.train_steps}: "
                   f"{sum(e['label'] == 1 and e['partition'] == 'eval' for e in natural)} members and "
                   f"{sum(e['label'] == 0 and e['partition'] == 'eval' for e in natural)} non-members; "
                   f"delta {models[0].delta:.3g} (1 / {dp.max_records(cfg):,} records: natural rows and every canary "
                   "copy). The twins share the non-private testbed's seed, canaries and order (their noise draws "
                   "differ only by scale): the rows are not independent replicates.")
    parts = {"description": description, "models": model_rows, "rows": rows, "by_reps": by_reps,
             "exposure": exposure, "kinds": [], "attacks_run": [label for label, _, _ in to_run],
             "skipped": skipped, "notes": notes, "delta": models[0].delta, "primary": primary_entries,
             "primary_spec": pri.spec, "family_size": family_size, "reps": 1}
    config = {"settings": dataclasses.asdict(p), "noises": list(noises), "primary": pri.spec}
    hashes = {"config_hash": cfg.config_hash, "canaries_sha256": plain.manifest["canaries"]["sha256"],
              "checkpoints": records}
    return parts, config, hashes, models


# ============================================================================================ fine-tune
def _ft_noise(p: FinetunePreset, mode: str, rank: int, epsilon: float, delta: float, cache: dict) -> float:
    key = (mode, epsilon, delta)
    if key not in cache:
        cfg = p.audit.replace(lora_rank=rank, preset=f"{p.audit.preset}-{mode}", dp_noise=1.0)
        cache[key] = math.ceil(ft.noise_for_epsilon(cfg, epsilon, delta=delta) * 1e4) / 1e4  # rounded up: eps <= target
    return cache[key]


def model_configs(p: FinetunePreset, *, epsilons, delta: float, seed: int, rep: int = 0,
                  modes: Optional[Sequence[str]] = None, noise_cache: Optional[dict] = None) -> list:
    """(mode, target epsilon or None, config) of every fine-tune of repetition ``rep``, without training: full and
    LoRA (or ``modes``), non-private and at each target; the config's seed is ``model_seed(seed, rep, "<mode>
    <level>")``, from which its canary inclusion, batches, LoRA init and noise keys all follow."""
    out, cache = [], {} if noise_cache is None else noise_cache
    for mode, rank in (("full", 0), ("lora", p.lora_rank)):
        if modes is not None and mode not in modes:
            continue
        cfg = p.audit.replace(lora_rank=rank, preset=f"{p.audit.preset}-{mode}")
        for target in [None] + sorted(epsilons):
            noise = None if target is None else _ft_noise(p, mode, rank, target, delta, cache)
            level = NON_PRIVATE if target is None else f"{target:g}"
            out.append((mode, target, cfg.replace(dp_noise=noise, seed=model_seed(seed, rep, f"{mode} {level}"))))
    return out


def finetune_models(p: FinetunePreset, base, root: Path, *, epsilons, delta: float, seed: int, progress: bool,
                    timings: Timings, say, rep: int = 0, modes: Optional[Sequence[str]] = None,
                    noise_cache: Optional[dict] = None) -> list:
    """The audit's fine-tunes of ``base``: full and LoRA (or only ``modes``), each non-private and at every target
    epsilon (built, or reused from ``root``; repetition r > 0 in ``root/rep<r>/``). Every model has its own seed,
    ``model_seed(seed, rep, "<mode> <level>")``: its own canary pool and inclusion, batches, LoRA init and noise, so
    that no two models share an inclusion vector or a noise draw."""
    models = []
    where = root if rep == 0 else root / f"rep{rep}"
    for mode, target, c in model_configs(p, epsilons=epsilons, delta=delta, seed=seed, rep=rep, modes=modes,
                                         noise_cache=noise_cache):
        noise, ms = c.dp_noise, c.seed
        eps = ft.finetune_epsilon(c, delta=delta)[0]
        base_name = model_name(None if noise is None else eps, mode)
        name = base_name if rep == 0 else f"{base_name} rep{rep}"
        with timings(f"finetune:{name}"):
            say(f"fine-tuning {name} (seed {ms}) ...")
            run = ft.build_finetune(base, where / base_name.replace(" ", "-"), c, progress=progress, delta=delta)
        mu = math.sqrt(c.steps) / noise if noise and c.sample_rate == 1 else None
        models.append(Model(name, run, eps, noise, delta, mode,
                            group_epsilon=None if noise is None else
                            (lambda r, c=c: ft.finetune_epsilon(c, delta=delta, group=r)),
                            target=target, seed=ms, mu=mu, rep=rep))
    return models


def build_base(p: FinetunePreset, root: Path, progress: bool):
    """The fine-tunes' base: the preset's testbed (no canaries), built or reused in ``root/base``."""
    return build_testbed(p.base, root / "base", progress=progress, **dict(p.base_overrides))


def score_primary(m: Model, c, attack: str, kind: str, to_run, *, seed: int, progress: bool, out: Path,
                  ref_model=None, timings=None) -> tuple:
    """A repetition's model: only the primary ``attack`` on its canaries (written to
    ``out/scores/<model>/canaries.jsonl``); (scores, included) of those of ``kind`` inserted once."""
    members = c.included.copy()
    model = m.testbed.load_model()
    with timings(f"score:{m.name}"):
        if attack == CONTRAST:
            sc = np.asarray(new_token_contrast(model, c), np.float64)
        else:
            rc = score_split(model, canary_examples(c.tokens, members), [t for t in to_run if t[0] == attack],
                             seed=seed, progress=progress, ref_model=ref_model)
            order = {cid: j for j, cid in enumerate(rc.ids)}
            sc = np.asarray(rc.scores[attack], np.float64)[[order[f"canary{i}"] for i in range(c.m)]]
    lines = [{"id": f"canary{i}", "label": int(members[i]), "reps": int(c.reps[i]), "kind": str(c.kind_of[i]),
              "scores": {attack: None if not np.isfinite(sc[i]) else float(sc[i])}} for i in range(c.m)]
    path = out / "scores" / m.name / "canaries.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, "".join(json.dumps(x) + "\n" for x in lines))
    once = (c.kind_of == kind) & (c.reps == 1)
    return sc[once], members[once]


def _primary_run(m: Model, claim: dict) -> dict:
    return {"rep": m.rep, "model": m.name, "seed": m.seed, "epsilon": None if math.isinf(m.epsilon) else m.epsilon,
            **claim}


def _check_delta(cfgs, delta: float) -> None:
    for c in cfgs:
        try:
            ft.check_delta(c, delta)
        except ft.TestbedError as e:
            raise ExperimentError(f"--delta: {e}") from None


def run_finetune(preset: str, out: Path, root: Path, *, epsilons, attacks, delta, seed, bootstrap, progress,
                 timings: Timings, say, primary: Optional[str] = None, reps: Optional[int] = None) -> tuple:
    """The fine-tuning audit: (summary parts, config, hashes, the models)."""
    if preset not in FT_PRESETS:
        raise ExperimentError(f"unknown preset {preset!r} for --setting finetune; presets: {', '.join(FT_PRESETS)}")
    p = FT_PRESETS[preset]
    to_run, skipped = select_attacks(p.attacks if attacks is None else attacks, max_cost=p.max_cost,
                                     unavailable=tuple(u for u in UNAVAILABLE if u != "ref"), preset=preset)
    if not to_run:
        raise ExperimentError(f"no attack to run: {'; '.join(f'{k}: {v}' for k, v in skipped.items())}")
    pri = p.primary if primary is None else parse_primary(primary, p.primary)
    n_reps = p.reps if reps is None else int(reps)
    labels = [label for label, _, _ in to_run] + [CONTRAST]
    if pri.attack not in labels:
        raise ExperimentError(f"the primary attack {pri.attack!r} is not run; attacks: {', '.join(labels)}")
    if pri.mode not in ("full", "lora") or pri.kind not in {k for k, _, n in p.audit.canary_groups if n}:
        raise ExperimentError(f"the primary claim {pri.spec!r} needs mode full or lora and a kind of the audit pool "
                              f"({p.audit.kind_spec})")
    delta = ft.DEFAULT_DELTA if delta is None else float(delta)
    _check_delta([p.audit] + ([p.kinds] if p.kinds is not None else []), delta)
    epsilons = tuple(p.epsilons if epsilons is None else epsilons)
    with timings("base"):
        base = build_base(p, root, progress)
        base_record, _ = check_testbed_checkpoints([("base", base, base.train_steps)])  # before any fine-tune
    cache: dict = {}
    models = finetune_models(p, base, root, epsilons=epsilons, delta=delta, seed=seed, progress=progress,
                             timings=timings, say=say, noise_cache=cache)
    plan = primary_plan(models, pri)  # fixed here, before anything is scored
    for e in plan:
        m_once = sum(n for k, r, n in p.audit.canary_groups if k == pri.kind and r == 1)
        _grid(m_once, e["k"])
    if p.kinds is not None:
        with timings("finetune:kinds"):
            say("fine-tuning the kinds run ...")
            ks = model_seed(seed, 0, "kinds")
            kinds_run = ft.build_finetune(base, root / "kinds", p.kinds.replace(seed=ks), progress=progress,
                                          delta=delta)
        models.append(Model("kinds", kinds_run, math.inf, None, delta, "kinds", seed=ks))
    with timings("check"):  # every checkpoint opened and checked before it is scored (mia.checkpoints)
        records, _ = check_checkpoints({m.name: m.testbed.model_dir for m in models})
    ref_model = base.load_model()
    start, stop = models[0].testbed.natural_rows()
    natural = _natural_examples(base.dataset(), np.arange(start, stop), np.arange(stop, base.n_rows), p.n_natural,
                                seed)
    rows, by_reps, notes, keep, stores = [], [], [], [], {}
    for m in models:
        c = m.testbed.canaries()
        stores[m.name] = {}
        r, b, sk, nt = score_model("finetune", m, c, m.testbed.canary_membership(), natural, to_run, seed=seed,
                                   bootstrap=bootstrap, out=out, progress=progress, ref_model=ref_model,
                                   timings=timings, keep=keep, store=stores[m.name])
        rows, by_reps = rows + r, by_reps + b
        skipped.update(sk)
        notes += [n for n in nt if n not in notes]
    by_name = {m.name: m for m in models}
    runs: dict = {}
    for e in plan:
        m = by_name[e["model"]]
        sc, inc = stores[m.name][(e["attack"], e["canary_kind"])]
        runs.setdefault(e["level"], []).append(_primary_run(m, primary_claim(sc, inc, m.delta, e["k"], m.epsilon,
                                                                             m.mu)))
    for rep in range(1, n_reps):  # the primary models again, each with a fresh seed: the claim's spread
        more = finetune_models(p, base, root, epsilons=epsilons, delta=delta, seed=seed, progress=progress,
                               timings=timings, say=say, rep=rep, modes=(pri.mode,), noise_cache=cache)
        with timings("check"):
            rec_more, _ = check_checkpoints({m.name: m.testbed.model_dir for m in more})
        records.update(rec_more)
        for m in more:
            sc, inc = score_primary(m, m.testbed.canaries(), pri.attack, pri.kind, to_run, seed=seed,
                                    progress=progress, out=out, ref_model=ref_model, timings=timings)
            grid = pri.grid(m.target)
            runs.setdefault(m.level, []).append(_primary_run(m, primary_claim(sc, inc, m.delta, grid, m.epsilon,
                                                                              m.mu)))
        models += more
    primary_entries = summarize_primary(plan, runs)
    family_size = family_bounds(keep)
    for r in rows + by_reps:
        r.setdefault("eps_lower_family", None)
    audit_rows = [r for r in rows if r["model"] != "kinds"]
    kinds = kinds_table(rows, "kinds")
    model_rows = []
    for m in models:
        pr = m.testbed.manifest["privacy"]
        model_rows.append({"model": m.name, "mode": m.mode, "rep": m.rep, "seed": m.seed, "noise": m.noise,
                           "epsilon": None if math.isinf(m.epsilon) else m.epsilon,
                           "epsilon_rdp": pr["epsilon_rdp"] if m.noise is not None else None, "delta": m.delta,
                           "mu": m.mu, "sampling": "poisson", "sample_rate": m.testbed.config.sample_rate,
                           "steps": m.testbed.config.steps, "trained": m.testbed.manifest["trained"],
                           "canaries_sha256": m.testbed.manifest["canaries"]["sha256"],
                           "testbed": str(m.testbed.root)})
    a = p.audit
    scale = a.replace(lora_rank=p.lora_rank).lora_scale
    k = p.kinds
    c0 = models[0].testbed.canaries()
    description = (f"Fine-tuning. Base: testbed preset {p.base} ({base.train_steps} steps x batch {base.batch_size}, "
                   f"rows of {base.row_len} tokens, {base.n_params:,} parameters). Private set: {a.n_private} natural "
                   f"rows the base never trained and {c0.m} new-token canaries of {c0.row_len} tokens (groups "
                   f"{', '.join(f'{n} x reps {r}' for _, r, n in a.canary_groups)}; each canary included with "
                   f"probability 1/2, every model its own draw: its own seed). Trained {a.steps} steps, Poisson "
                   f"sampling at rate {a.sample_rate:g}, {a.optimizer} lr "
                   f"{a.lr:g}: full-parameter and LoRA (rank {p.lora_rank}, scale {scale:g}, "
                   f"on {', '.join(a.lora_targets)}, and the reserved tokens' rows), without privacy and with DP-SGD "
                   f"at epsilon {', '.join(f'{e:g}' for e in epsilons)} (clip {a.dp_clip}); delta {delta:.3g} "
                   f"(<= 1 / {ft.max_records(a):,} records, every canary copy counted). "
                   + (f"Kinds run: {k.m} canaries ({', '.join(f'{n} {kind}' for kind, _, n in k.canary_groups)}), "
                      f"{k.steps} steps at rate {k.sample_rate:g}, {k.optimizer} lr {k.lr:g}, non-private. "
                      if k is not None else "")
                   + f"Natural rows: {sum(e['label'] == 1 for e in natural)} private-set members and "
                   f"{sum(e['label'] == 0 for e in natural)} non-members. Repetitions of the primary models: "
                   f"{n_reps} (run seed {seed}).")
    parts = {"description": description, "models": model_rows, "rows": rows, "by_reps": by_reps, "exposure": [],
             "kinds": kinds, "attacks_run": labels, "skipped": skipped,
             "notes": notes, "delta": delta, "audit_rows": len(audit_rows), "primary": primary_entries,
             "primary_spec": pri.spec, "family_size": family_size, "reps": n_reps}
    config = {"settings": {**dataclasses.asdict(p), "audit": p.audit.to_dict(),
                           "kinds": None if p.kinds is None else p.kinds.to_dict()}, "epsilons": list(epsilons),
              "primary": pri.spec, "reps": n_reps}
    hashes = {"base_config_hash": base.config.config_hash, "base_sha256": base.checkpoint_hash(),
              "canaries_sha256": {m.name: m.testbed.manifest["canaries"]["sha256"] for m in models},
              "checkpoints": {**base_record, **records}}
    return parts, config, hashes, models


# ============================================================================================ the run
def run(preset: str = "default", out=None, *, setting: str = "finetune", testbed_dir=None,
        noises: Optional[Sequence[float]] = None, epsilons: Optional[Sequence[float]] = None, attacks=None,
        delta: Optional[float] = None, seed: int = 0, bootstrap: int = 1000, progress: bool = True,
        strict: bool = True, argv=None, primary: Optional[str] = None, reps: Optional[int] = None) -> dict:
    """Run the audit; returns the summary (also ``out/summary.json``). ``strict``: raise :class:`AuditViolation`
    after writing every output when a claim the audit tests is rejected (Holm over the family). ``primary``: a
    ``--primary`` spec in place of the preset's pre-registered claims; ``reps``: repetitions of the primary models
    (fine-tune; default the preset's)."""
    if setting not in SETTINGS:
        raise ExperimentError(f"--setting must be one of {', '.join(SETTINGS)}, got {setting!r}")
    presets = FT_PRESETS if setting == "finetune" else PRESETS
    if preset not in presets:
        raise ExperimentError(f"unknown preset {preset!r} for --setting {setting}; presets: {', '.join(presets)}")
    if noises is not None and epsilons is not None:
        raise ExperimentError("give --noises or --epsilons, not both")
    if noises is not None and setting == "finetune":
        raise ExperimentError("--noises is for --setting pretrain; the fine-tune takes --epsilons")
    for flag, values in (("--noises", noises), ("--epsilons", epsilons)):
        if values is not None and (not values or any(not (math.isfinite(v) and v > 0) for v in values)
                                   or len(set(values)) != len(values)):
            raise ExperimentError(f"{flag} must be distinct positive numbers, got {', '.join(map(str, values))}")
    if delta is not None and not 0 < delta < 1:
        raise ExperimentError(f"--delta must be in (0, 1), got {delta}")
    if reps is not None and int(reps) < 1:
        raise ExperimentError(f"--reps must be >= 1, got {reps}")
    tag = "" if setting == "finetune" else "-pretrain"
    out = Path(out) if out is not None else Path("results") / f"audit-{preset}{tag}"
    root = Path(testbed_dir) if testbed_dir is not None else Path("testbeds") / f"audit-{preset}{tag}"
    check_paths(out=out, output_dirs=[("--testbed-dir", root)])
    say = say_fn(progress)
    timings = Timings()
    t0 = time.perf_counter()
    kw = dict(epsilons=epsilons, attacks=attacks, delta=delta, seed=seed, bootstrap=bootstrap, progress=progress,
              timings=timings, say=say, primary=primary, reps=reps)
    if setting == "finetune":
        parts, config, hashes, models = run_finetune(preset, out, root, **kw)
    else:
        parts, config, hashes, models = run_pretrain(preset, out, root, noises=noises, **kw)
    rows, by_reps, exposure = parts["rows"], parts["by_reps"], parts["exposure"]
    check = violation_check(rows, by_reps, primary=parts["primary"])
    bad = check.pop("violations")
    audit_rows = [r for r in rows if r["model"] != "kinds"]
    goals = targets(parts["primary"], setting)
    with timings("ideal"):
        add_ideal(goals, parts["primary"], models)
    summary = {"description": parts["description"], "setting": setting, "preset": preset, "seed": seed,
               "primary": parts["primary"], "primary_spec": parts["primary_spec"], "reps": parts["reps"],
               "family_size": parts["family_size"],
               "family_correction": f"Bonferroni over the {parts['family_size']} exploratory bounds (alpha / "
                                    f"{parts['family_size']} each): eps_lower_family",
               "models": parts["models"],
               "rows": rows, "kinds": parts["kinds"], "by_reps": by_reps, "exposure": exposure,
               "targets": goals,
               "findings": findings(audit_rows, exposure, parts["kinds"]), "violations": bad,
               "violation_check": check, "above_accountant": above_accountant(audit_rows),
               "attacks_run": parts["attacks_run"], "skipped": parts["skipped"], "notes": parts["notes"],
               "alpha": ALPHA, "delta": parts["delta"]}
    write_tables(rows, out, "audit", COLUMNS, title="Privacy audit: canaries and natural rows")
    write_tables(by_reps, out, "by_reps", REPS_COLUMNS, title="One-run bounds by repetitions")
    if parts["kinds"]:
        write_tables(parts["kinds"], out, "kinds", KINDS_COLUMNS, title="Canary kinds (non-private)")
        plot_kinds(parts["kinds"], out / "kinds.png")
    if exposure:
        write_tables(exposure, out, "exposure", EXPOSURE_COLUMNS, title="Exposure by repetitions")
        plot_exposure(exposure, out / "exposure_vs_reps.png")
    plot_vs_epsilon(audit_rows, out / "auc_vs_epsilon.png")
    plot_eps_lower(audit_rows, out / "eps_lower_vs_epsilon.png", parts["primary"])
    write_json(out / "summary.json", summary)
    write_text(out / "report.md", report_markdown(summary))
    write_manifest(out, module="experiments.audit", argv=argv, config={
        "setting": setting, "preset": preset, **config, "delta": delta, "bootstrap": bootstrap,
        "attacks": summary["attacks_run"]},
        seeds={"run": seed, "natural_split": seed, "bootstrap": seed,
               "models": {m["model"]: m["seed"] for m in parts["models"]}}, hashes=hashes,
        paths={"testbeds": [str(m.testbed.root) for m in models]},
        outputs=["report.md", "audit.*", "kinds.*", "by_reps.*", "exposure.*", "*.png", "summary.json", "scores/"])
    timings["total"] = round(time.perf_counter() - t0, 1)
    timings.write(out)
    say(f"wrote {out}/ in {timings['total']:.0f} s")
    if bad and strict:
        raise AuditViolation(f"PRIVACY AUDIT VIOLATION: {len(bad)} claim(s) rejected by the audit "
                             f"({bad[0]}{'; ...' if len(bad) > 1 else ''}); everything is written to {out}/")
    return summary


def build_parser():
    from mia import validate as V

    ap = experiment_parser("python -m experiments.audit", __doc__, sorted(set(PRESETS) | set(FT_PRESETS)))
    ap.add_argument("--setting", default="finetune", choices=SETTINGS,
                    help="finetune (default: a trained testbed fine-tuned on a private set with canaries) or pretrain "
                         "(a testbed trained from scratch with them)")
    ap.add_argument("--testbed-dir", default=None,
                    help="where the models go (default: testbeds/audit-<preset>, -pretrain for --setting pretrain)")
    ap.add_argument("--noises", default=None, help="--setting pretrain: DP-SGD noise multipliers of the private "
                                                   f"twins, comma-separated (default: {preset_defaults('noises')})")
    ap.add_argument("--epsilons", default=None, help="target accountant epsilons of the private models, comma-"
                                                     f"separated (default, fine-tune: {preset_defaults('epsilons')}; "
                                                     "pretrain: instead of --noises, found by bisection over the "
                                                     "accountant: slower)")
    ap.add_argument("--attacks", default=None, help=f"attack spec (default: {preset_defaults('attacks')})")
    ap.add_argument("--delta", type=V.arg_float(0, 1, lo_open=True, hi_open=True), default=None,
                    help=f"delta of every epsilon, at most 1 / records with every canary copy counted (default: "
                         f"fine-tune {ft.DEFAULT_DELTA:g}; pretrain 1 / (train_steps x batch_size + every canary "
                         "copy): mia.testbed.dp.default_delta)")
    ap.add_argument("--primary", default=None,
                    help="the pre-registered primary claims, one per privacy level, as MODE:ATTACK:KIND[:LEVEL=K[+K]"
                         "/...] (levels: non-private, a target epsilon, *), tested at alpha 0.05 alone; give it "
                         f"before any result is seen (default: {preset_defaults('primary')})")
    ap.add_argument("--reps", type=int, default=None,
                    help="independent repetitions of the primary models (fresh seeds), for the primary claim's mean "
                         f"and range; fine-tune only (default: {preset_defaults('reps')})")
    return ap


def preset_defaults(field: str) -> str:
    """The help text's defaults, read from the presets (so that it cannot go stale): the pretrain presets' noise
    multipliers, the fine-tune presets' target epsilons, or both settings' attacks."""
    def attacks(p) -> str:
        return p.attacks if p.attacks != "default" else f"every attack needing only the examples, up to cost " \
                                                        f"{p.max_cost!r}"
    if field == "noises":
        return "; ".join(f"{n}: {','.join(f'{x:g}' for x in p.noises)}" for n, p in PRESETS.items())
    if field == "epsilons":
        return "; ".join(f"{n}: {','.join(f'{x:g}' for x in p.epsilons)}" for n, p in FT_PRESETS.items())
    if field == "primary":
        return ("fine-tune " + "; ".join(f"{n}: {p.primary.spec}" for n, p in FT_PRESETS.items()) + "; pretrain "
                + "; ".join(f"{n}: {p.primary.spec}" for n, p in PRESETS.items()))
    if field == "reps":
        return "; ".join(f"{n}: {p.reps}" for n, p in FT_PRESETS.items())
    return ("fine-tune " + "; ".join(f"{n}: {attacks(p)}" for n, p in FT_PRESETS.items()) + "; pretrain "
            + "; ".join(f"{n}: {attacks(p)}" for n, p in PRESETS.items()))


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
    status, s = run_main(lambda: run(a.preset, a.out, setting=a.setting, testbed_dir=a.testbed_dir,
                                     noises=_floats(a.noises, "--noises"), epsilons=_floats(a.epsilons, "--epsilons"),
                                     attacks=a.attacks, delta=a.delta, seed=a.seed, bootstrap=a.bootstrap,
                                     progress=not a.no_progress, strict=False, argv=argv, primary=a.primary,
                                     reps=a.reps),
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
