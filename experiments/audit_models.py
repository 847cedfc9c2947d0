"""The privacy audit's presets, its models and their scores (``python -m experiments.audit``; the run is in
``experiments/audit.py``, the tables, plots and report in ``experiments/audit_report.py``, the statistics in
``mia.privacy.claims``).

Presets: ``PRESETS`` (pretraining: a testbed and its DP-SGD twins) and ``FT_PRESETS`` (fine-tuning a trained base,
full and LoRA, without privacy and at target accountant epsilons), each with its pre-registered primary claims.
Models: ``Model`` (one audited model), built or reused by ``pretrain_models`` / ``finetune_models``; every model has
its own seed (``model_seed``). Scores: ``score_model`` (every attack on every canary and on the natural rows, with
the bounds of each row), ``score_primary`` (a repetition: the primary attack only), ``exposure_rows``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from mia.files.atomic import write_text
from mia.metrics import metric_rows
from mia.privacy.claims import (ANY_LEVEL, NO_BOUNDS, NON_PRIVATE, Primary, bounds_by_reps, lower_bounds)
from mia.privacy.exposure import exposure_by_reps, exposure_sampled, exposure_skewnorm
from mia.testbed import build_testbed, build_twin, dp, preset as testbed_preset
from mia.testbed import finetune as ft
from mia.testbed.canaries import candidate_rows, new_token_contrast, sequence_nll
from mia.testbed.config import canary_kinds

from experiments.harness import ExperimentError, Timings, score_split

AUDIT_KIND = "new"  # the kind the audit pool holds (the strongest: docs/auditing.md)
CONTRAST = "contrast"  # the new-token contrast score's attack label
EXPOSURE_KINDS = ("tokens", "words", "unigram", "bigram")  # kinds whose candidates are cheap fresh draws
UNAVAILABLE = ("ref", "mlm", "prefix", "member_prefix", "calib", "train", "freq")  # canaries have no partitions


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


def kinds_groups(n: int) -> tuple:
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
        kinds=ft.FinetuneConfig(preset="smoke-kinds", n_private=128, canary_groups=kinds_groups(60),
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
        kinds=ft.FinetuneConfig(preset="default-kinds", n_private=512, canary_groups=kinds_groups(1000),
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
        kinds=ft.FinetuneConfig(preset="large-kinds", n_private=2048, canary_groups=kinds_groups(2000),
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


def model_name(epsilon: Optional[float], mode: str = "pretrain") -> str:
    """"non-private", or "eps=<accountant epsilon, 3 significant digits>"; a fine-tune's prefixed by its mode."""
    name = NON_PRIVATE if epsilon is None else f"eps={epsilon:.3g}"
    return name if mode == "pretrain" else f"{mode} {name}"


def canary_examples(tokens: np.ndarray, members: np.ndarray) -> list:
    """Examples (id, tokens, label) of the canary pool: label 1 = included in this model's training."""
    return [{"id": f"canary{i}", "tokens": tokens[i].tolist(), "label": int(members[i])} for i in range(len(tokens))]


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


# ============================================================================================ scoring
def natural_examples(rows: np.ndarray, members: np.ndarray, nonmembers: np.ndarray, n: int, seed: int) -> list:
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


def exposure_rows(name: str, model, c, n_candidates: int, seed: int, source=None) -> list:
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


# ============================================================================================ pretrain models
def pretrain_models(p: Preset, root: Path, noises: Sequence[float], delta: Optional[float], progress: bool,
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


# ============================================================================================ fine-tune models
def finetune_noise(p: FinetunePreset, mode: str, rank: int, epsilon: float, delta: float, cache: dict) -> float:
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
            noise = None if target is None else finetune_noise(p, mode, rank, target, delta, cache)
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


def check_delta(cfgs, delta: float) -> None:
    for c in cfgs:
        try:
            ft.check_delta(c, delta)
        except ft.TestbedError as e:
            raise ExperimentError(f"--delta: {e}") from None
