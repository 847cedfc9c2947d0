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
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from mia.files.atomic import write_text
from mia.checkpoints import check_checkpoints, check_testbed_checkpoints
from mia.data.draw import draw_testbed_split, SplitSizes
from mia.privacy.claims import (ALPHA, ANY_LEVEL, NON_PRIVATE, Primary, above_accountant, checked_grid, family_bounds,
                                primary_claim, primary_plan, primary_run, summarize_primary, violation_check)
from mia.privacy.one_run import AuditViolation
from mia.testbed import dp
from mia.testbed import finetune as ft
from mia.testbed.canaries import canary_source
from mia.testbed.config import canary_kinds

from experiments.audit_models import (CONTRAST, EXPOSURE_KINDS, FT_PRESETS, PRESETS, UNAVAILABLE, Model, build_base,
                                      check_delta, exposure_rows, finetune_models, model_seed, natural_examples,
                                      noises_for, preset_config, pretrain_models, score_model, score_primary)
from experiments.audit_report import (add_ideal, findings, kinds_table, plot_eps_lower, plot_exposure, plot_kinds,
                                      plot_vs_epsilon, report_markdown, targets, COLUMNS, EXPOSURE_COLUMNS,
                                      KINDS_COLUMNS, REPS_COLUMNS)
from mia.attacks.catalog import select_attacks
from experiments.harness import (check_paths, experiment_parser, ExperimentError, run_and_report, say_fn, Timings,
                                 write_json, write_manifest, write_tables)

SETTINGS = ("finetune", "pretrain")


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


# ============================================================================================ pretrain
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
    models = pretrain_models(p, root, noises, delta, progress, timings, say)
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
            exposure += exposure_rows(m.name, m.testbed.load_model(), c, p.n_candidates, seed, source)
    by_name = {m.name: m for m in models}
    runs: dict = {}
    for e in plan:
        m = by_name[e["model"]]
        if (e["attack"], e["canary_kind"]) not in stores[m.name]:
            raise ExperimentError(f"the primary claim's attack {e['attack']!r} on {e['canary_kind']} canaries was not "
                                  "scored")
        sc, inc = stores[m.name][(e["attack"], e["canary_kind"])]
        runs.setdefault(e["level"], []).append(primary_run(m, primary_claim(sc, inc, m.delta, e["k"], m.epsilon)))
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
    check_delta([p.audit] + ([p.kinds] if p.kinds is not None else []), delta)
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
        checked_grid(m_once, e["k"])
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
    natural = natural_examples(base.dataset(), np.arange(start, stop), np.arange(stop, base.n_rows), p.n_natural,
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
        runs.setdefault(e["level"], []).append(primary_run(m, primary_claim(sc, inc, m.delta, e["k"], m.epsilon,
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
            runs.setdefault(m.level, []).append(primary_run(m, primary_claim(sc, inc, m.delta, grid, m.epsilon,
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


# ============================================================================================ CLI
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
    return run_and_report(lambda: run(a.preset, a.out, setting=a.setting, testbed_dir=a.testbed_dir,
                                      noises=_floats(a.noises, "--noises"), epsilons=_floats(a.epsilons, "--epsilons"),
                                      attacks=a.attacks, delta=a.delta, seed=a.seed, bootstrap=a.bootstrap,
                                      progress=not a.no_progress, strict=False, argv=argv, primary=a.primary,
                                      reps=a.reps),
                          a, report_markdown, exit_status=violations_status)


def violations_status(s: dict) -> int:
    """3 when the audit rejected a claim (each violation one line on stderr), else 0."""
    for v in s["violations"]:
        print(f"PRIVACY AUDIT VIOLATION: {v}", file=sys.stderr)
    return 3 if s["violations"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
