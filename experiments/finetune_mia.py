"""Membership inference on fine-tunes with exact ground truth: full-parameter vs LoRA, every attack (issue 35).

    python -m experiments.finetune_mia [--preset smoke|default] [--out DIR] [--attacks SPEC] [--gradient-attacks]

1. Build (or reuse) the base: a testbed (``mia.testbed``), trained on the first rows of its order.
2. Fine-tune it twice on the same member set (``mia.testbed.finetune``): the next ``n_private`` rows of the order,
   held-out text the base never trained on; once every parameter, once LoRA on the attention kernels. The LoRA
   fine-tune is also written as a PEFT adapter directory (``mia.testbed.peft_export``) and scored through it
   (``mia.load(BASE, adapter=DIR)``, as ``mia score --adapter`` does), with the base as the default reference.
3. Non-members: rows after the member set, from the same order (never trained on by base or fine-tune).
   Partitions: ``eval`` (scored), ``train`` (learned combiners), ``calib`` and ``prefix`` (non-members only).
4. Score every attack of the preset on both fine-tunes (``mia.score``; ``ref``, ``ez_mia`` and ``wbc`` against the
   base) and write one table: AUC +- bootstrap SE, TPR at 1% and 0.1% FPR, full vs LoRA.

Outputs in ``--out``: table.md/.csv/.tex/.json, report.md, summary.json, roc_full.png, roc_lora.png,
scores/<mode>.jsonl, examples.jsonl (the evaluated rows: id, tokens, label), adapter/ (the PEFT adapter), models/
(base and fine-tunes), manifest.json, timings.json.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

import mia
from mia.attacks.catalog import select_attacks
from mia.data.splits import assign_partitions
from mia.metrics import metric_rows
from mia.files.atomic import write_text
from mia.report import write_json
from mia.testbed import build_testbed
from mia.testbed import finetune as ft
from mia.testbed.peft_export import write_peft_adapter

from experiments.harness import (ExperimentError, Timings, argv_or_sys, check_paths, default_out, experiment_parser,
                                 fmt, plot_roc, run_and_report, say_fn, score_split, write_manifest, write_tables)

MODULE = "experiments.finetune_mia"
MODES = ("full", "lora")
GRADIENT_ATTACKS = "gradnorm,alora,jl"
# one random-token canary: the fine-tune's pool is never empty (mia.testbed.finetune); it trains only its own row,
# and is never scored here
ONE_CANARY = (("tokens", 1, 1),)


@dataclasses.dataclass(frozen=True)
class Preset:
    """The base (testbed preset and overrides), the member set (``n_private`` rows, all trained every step), the
    partitions per class (``eval``, ``train``; non-members only: ``calib``, ``prefix``), the two fine-tunes'
    recipes, and the attacks (a spec, or "default": every registered attack up to ``max_cost``)."""

    base: str
    base_overrides: tuple
    n_private: int
    eval: int
    train: int
    calib: int
    prefix: int
    full: ft.FinetuneConfig
    lora: ft.FinetuneConfig
    attacks: str
    max_cost: str


PRESETS = {
    # about a minute on 2 cores (the slow test): a 40-step base of 32-token rows, 64 members, 4 epochs each
    "smoke": Preset(
        "smoke", (("max_corpus_bytes", 200_000), ("seq_len", 32), ("train_steps", 40), ("checkpoints", ()),
                  ("warmup_steps", 4)),
        n_private=64, eval=48, train=16, calib=10, prefix=4,
        full=ft.FinetuneConfig(preset="ft-smoke-full", n_private=64, canary_groups=ONE_CANARY, steps=4,
                               optimizer="adam", lr=1e-3),
        lora=ft.FinetuneConfig(preset="ft-smoke-lora", n_private=64, canary_groups=ONE_CANARY, steps=4,
                               optimizer="adam", lr=1e-2, lora_rank=8, lora_alpha=16.0),
        attacks="loss,zlib,mink,minkpp,ref,ez_mia,wbc", max_cost="stats"),
    # the smoke testbed as base (0.17M parameters, 100 steps x 16 rows of 65 tokens), 600 members trained 12 epochs
    # (full batch, Adam): full fine-tuning at lr 1e-3, LoRA rank 8 (alpha 16) on the attention kernels at lr 1e-2
    "default": Preset(
        "smoke", (), n_private=600, eval=500, train=100, calib=30, prefix=12,
        full=ft.FinetuneConfig(preset="ft-default-full", n_private=600, canary_groups=ONE_CANARY, steps=12,
                               optimizer="adam", lr=1e-3),
        lora=ft.FinetuneConfig(preset="ft-default-lora", n_private=600, canary_groups=ONE_CANARY, steps=12,
                               optimizer="adam", lr=1e-2, lora_rank=8, lora_alpha=16.0),
        attacks="default", max_cost="model"),
}
UNAVAILABLE = {"mlm": "needs a masked LM (--mlm), which this experiment does not load",
               "freq": "needs a frequency corpus, which this experiment does not pass",
               "member_prefix": "needs member-prefix examples, which this split does not hold"}
COLUMNS = ["attack", "full_auc", "full_auc_se", "full_tpr_1", "full_tpr_01", "lora_auc", "lora_auc_se",
           "lora_tpr_1", "lora_tpr_01"]


# ============================================================================================ parse
def build_parser():
    p = experiment_parser(f"python -m {MODULE}", __doc__, PRESETS)
    p.add_argument("--attacks", default=None,
                   help="attack spec (default: the preset's; 'default' = every attack up to the preset's cost)")
    p.add_argument("--gradient-attacks", action="store_true",
                   help=f"also run the gradient attacks ({GRADIENT_ATTACKS}; heavy: one backward pass per text)")
    p.add_argument("--models-dir", default=None,
                   help="where the base and fine-tunes are built or reused (default: OUT/models)")
    return p


# ============================================================================================ build
def build_models(p: Preset, root: Path, *, seed: int, progress: bool, timings: Timings, say) -> tuple:
    """(base testbed, {mode: Finetune}) built or reused under ``root``; both fine-tunes share the seed, so they
    train the same member set in the same order."""
    with timings("base"):
        base = build_testbed(p.base, root / "base", progress=progress, **dict(p.base_overrides))
    say(base.summary())
    runs = {}
    for mode in MODES:
        cfg = getattr(p, mode).replace(seed=seed)
        with timings(f"finetune:{mode}"):
            say(f"fine-tuning ({mode}) ...")
            runs[mode] = ft.build_finetune(base, root / mode, cfg, progress=progress)
    return base, runs


def draw_examples(base, run, p: Preset, seed: int) -> list:
    """Members: every natural row of the fine-tune's private set; non-members: the next rows of the order (never
    trained on). Sizes per class: ``eval + train`` members, ``eval + train + calib + prefix`` non-members, drawn at
    random (seeded) from their ranges, then partitioned (``mia.data.splits.assign_partitions``)."""
    start, stop = run.natural_rows()
    n_mem, n_non = p.eval + p.train, p.eval + p.train + p.calib + p.prefix
    if n_mem > stop - start:
        raise ExperimentError(f"{n_mem} members asked, the member set holds {stop - start}")
    if stop + n_non > base.n_rows:
        raise ExperimentError(f"the base's order has {base.n_rows - stop} rows after the member set, "
                              f"{n_non} non-members asked")
    rng = np.random.default_rng([int(seed), 0xF17E])
    members = np.sort(rng.choice(np.arange(start, stop), n_mem, replace=False))
    nonmembers = np.sort(rng.choice(np.arange(stop, base.n_rows), n_non, replace=False))
    idx = np.concatenate([members, nonmembers])
    rows = np.asarray(base.dataset().get_rows(idx), np.int64).reshape(len(idx), -1)
    examples = [{"id": f"row{int(i)}", "index": int(i), "tokens": rows[j].tolist(), "label": int(j < n_mem)}
                for j, i in enumerate(idx)]
    plan = {1: (("train", p.train), ("eval", p.eval)),
            0: (("prefix", p.prefix), ("calib", p.calib), ("train", p.train), ("eval", p.eval))}
    return assign_partitions(examples, plan, seed)


def choose_attacks(p: Preset, spec: Optional[str], gradients: bool, name: str = "") -> tuple:
    """([(label, name, params)], {label: reason skipped}) of the run: the spec's (default: the preset's), plus the
    gradient attacks with ``gradients``."""
    kw = dict(max_cost=p.max_cost, unavailable=tuple(UNAVAILABLE), reasons=UNAVAILABLE, preset=name)
    run, skipped = select_attacks(spec or p.attacks, **kw)
    if gradients:
        more, _ = select_attacks(GRADIENT_ATTACKS, **kw)
        run += [a for a in more if a[0] not in {r[0] for r in run}]
        for a in more:
            skipped.pop(a[0], None)
    return run, skipped


# ============================================================================================ run
def score_mode(mode: str, base, run, adapter: Optional[Path], examples: list, attacks, *, seed: int, progress: bool,
               timings: Timings):
    """``mia.score`` of one fine-tune: the full one as its merged checkpoint with the base as ``ref_model``; the
    LoRA one through its PEFT adapter on the base (the base is then the default reference)."""
    base_dir = base.checkpoint_dir(base.train_steps)
    with timings(f"score:{mode}"):
        if adapter is None:
            model, ref = mia.load(run.model_dir), mia.load(base_dir)
        else:
            model, ref = mia.load(base_dir, adapter=adapter), None
        return score_split(model, examples, attacks, seed=seed, progress=progress, ref_model=ref)


def table_rows(results: dict, bootstrap: int, seed: int) -> tuple:
    """(wide rows: one per attack, full and LoRA side by side; {mode: metric rows})."""
    by_mode = {mode: {r["method"]: r for r in metric_rows(res.scores, res.labels, res.ids, bootstrap, seed)}
               for mode, res in results.items()}
    attacks = list(dict.fromkeys(a for rows in by_mode.values() for a in rows))
    rows = []
    for a in attacks:
        row = {"attack": a}
        for mode in MODES:
            r = by_mode.get(mode, {}).get(a, {})
            row.update({f"{mode}_auc": r.get("auc"), f"{mode}_auc_se": r.get("auc_se"),
                        f"{mode}_tpr_1": r.get("tpr_at_1pct_fpr"), f"{mode}_tpr_01": r.get("tpr_at_0.1pct_fpr")})
        rows.append(row)
    return rows, {m: list(r.values()) for m, r in by_mode.items()}


def run(preset: str = "default", out=None, *, attacks: Optional[str] = None, gradient_attacks: bool = False,
        models_dir=None, seed: int = 0, bootstrap: int = 1000, progress: bool = True, argv=None) -> dict:
    """Build, score and report; returns the summary (also ``out/summary.json``)."""
    if preset not in PRESETS:
        raise ExperimentError(f"--preset {preset!r}: one of {', '.join(PRESETS)}")
    p = PRESETS[preset]
    out = Path(out) if out is not None else default_out("finetune_mia", preset)
    check_paths(out=out, output_dirs=[("--models-dir", models_dir)])
    to_run, skipped = choose_attacks(p, attacks, gradient_attacks, preset)  # a bad --attacks stops before any work
    say, timings, t0 = say_fn(progress), Timings(), time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    base, runs = build_models(p, Path(models_dir) if models_dir else out / "models", seed=seed, progress=progress,
                              timings=timings, say=say)
    with timings("adapter"):
        adapter = write_peft_adapter(runs["lora"], out / "adapter")
    examples = draw_examples(base, runs["full"], p, seed)
    write_text(out / "examples.jsonl", "".join(json.dumps({k: e[k] for k in ("id", "tokens", "label")}) + "\n"
                                               for e in examples if e["partition"] == "eval"))
    results = {}
    for mode in MODES:
        say(f"scoring the {mode} fine-tune ({len(to_run)} attacks) ...")
        results[mode] = score_mode(mode, base, runs[mode], adapter if mode == "lora" else None, examples, to_run,
                                   seed=seed, progress=progress, timings=timings)
        results[mode].write(out / "scores" / f"{mode}.jsonl", {e["id"]: {"index": e["index"]} for e in examples
                                                                if e["partition"] == "eval"})
        plot_roc({k: np.asarray(v, float) for k, v in results[mode].scores.items()},
                 np.asarray(results[mode].labels), out / f"roc_{mode}.png", f"ROC, {mode} fine-tune")
        skipped.update({f"{mode}: {k}": v for k, v in results[mode].skipped.items()})
    rows, metrics = table_rows(results, bootstrap, seed)
    start, stop = runs["full"].natural_rows()
    summary = {"preset": preset, "seed": seed, "bootstrap": bootstrap, "rows": rows, "metrics": metrics,
               "skipped": skipped, "base": {"root": relative_to(base.root, out), "config_hash": base.config.config_hash,
                        "checkpoint": relative_to(base.checkpoint_dir(base.train_steps), out)},
               "finetunes": {m: {"config": r.config.to_dict(), "trained": r.manifest["trained"]}
                             for m, r in runs.items()},
               "split": {"members": [start, stop], "nonmembers_from": stop,
                         "eval_per_class": p.eval, "train_per_class": p.train, "calib": p.calib, "prefix": p.prefix},
               "private_loss": {m: {k: r.private_record()[k] for k in ("first_loss", "final_loss")}
                                for m, r in runs.items()}}
    write_tables(rows, out, "table", COLUMNS, f"Fine-tune MIA ({preset} preset): full vs LoRA")
    write_text(out / "report.md", report_markdown(summary))
    write_json(out / "summary.json", summary)
    timings["total"] = round(time.perf_counter() - t0, 2)
    timings.write(out)
    write_manifest(out, module=MODULE, argv=argv, config={"preset": dataclasses.asdict(p) | {
        "full": p.full.to_dict(), "lora": p.lora.to_dict()}, "attacks": [a[0] for a in to_run]},
        seeds={"seed": seed}, hashes={"base": base.checkpoint_hash()}, paths={"out": str(out)},
        outputs=["table.md", "report.md", "summary.json"])
    summary["out"] = str(out)
    return summary


def relative_to(path, out: Path) -> str:
    """``path`` as written from ``out`` (so that two runs' summaries compare equal wherever they were written)."""
    return os.path.relpath(Path(path).resolve(), Path(out).resolve())


# ============================================================================================ report
def report_markdown(s: dict) -> str:
    """report.md: the table, what was trained, the split and what was skipped (no timings, no paths)."""
    sp = s["split"]
    L = [f"# Membership inference on fine-tunes ({s['preset']} preset)", "",
         f"Members: {sp['eval_per_class']} evaluated of the fine-tunes' member set, rows [{sp['members'][0]}, "
         f"{sp['members'][1]}) of the base's order; non-members: rows from {sp['nonmembers_from']} on (held-out text "
         f"of the same order, never trained on). Seed {s['seed']}, {s['bootstrap']} bootstrap resamples.", ""]
    for m, f in s["finetunes"].items():
        c, loss = f["config"], s["private_loss"][m]
        L.append(f"- {m}: {f['trained']}, {c['steps']} full-batch steps of {c['optimizer']} at lr {c['lr']:g}"
                 + (f", rank {c['lora_rank']} alpha {c['lora_alpha']:g} on {', '.join(c['lora_targets'])}"
                    if c["lora_rank"] else "") + f"; member loss {loss['first_loss']:.3f} -> {loss['final_loss']:.3f}")
    L += ["", "| attack | full AUC | ± SE | TPR@1% | TPR@0.1% | LoRA AUC | ± SE | TPR@1% | TPR@0.1% |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in s["rows"]:
        L.append("| " + " | ".join([r["attack"]] + [fmt(r[c], 4 if c.endswith("_se") else 3) for c in COLUMNS[1:]])
                 + " |")
    if s["skipped"]:
        L += ["", "## Skipped", ""] + [f"- {k}: {v}" for k, v in sorted(s["skipped"].items())]
    return "\n".join(L + [""])


def short_report(s: dict) -> str:
    lines = [f"finetune_mia ({s['preset']}): AUC / TPR@1%FPR, full vs LoRA"]
    for r in s["rows"]:
        lines.append(f"  {r['attack']:<16} full {fmt(r['full_auc'])} / {fmt(r['full_tpr_1'])}   "
                     f"lora {fmt(r['lora_auc'])} / {fmt(r['lora_tpr_1'])}")
    return "\n".join(lines + [f"-> {s['out']}"])


def main(argv=None) -> int:
    argv = argv_or_sys(argv)
    args = build_parser().parse_args(argv)
    return run_and_report(lambda: run(args.preset, args.out, attacks=args.attacks,
                                      gradient_attacks=args.gradient_attacks, models_dir=args.models_dir,
                                      seed=args.seed, bootstrap=args.bootstrap, progress=not args.no_progress,
                                      argv=argv), args, short_report)


if __name__ == "__main__":
    sys.exit(main())
