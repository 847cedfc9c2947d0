"""The main job: CheckMIABench's checkpoint method (Tables 1 and 2) on the testbed.

    python -m experiments.checkmia [--preset default] [--out results/<run>] [--steps c] [--memorize-epochs E]

1. Build (or reuse) the testbed of ``--preset`` (``mia.testbed``): a Pythia-architecture model trained on a
   recorded order of rows with checkpoints.
2. Draw a checkpoint split for checkpoint ``c`` (default: the last): members are rows trained before ``c``
   (row index < c*B), non-members are rows the same run would see after ``c`` within the first epoch
   (index in [c*B, epoch_end*B)), so both come from the same distribution. Partitions: ``eval`` (scored),
   ``train`` (blind classifiers, learned combiners), and non-members only in ``calib`` (CAMIA) and ``prefix`` (ReCaLL).
3. Score every registered attack the split supports on the eval partition (attacks needing a reference model or
   an MLM are skipped, and so are the O(N^2) pairwise attacks unless asked for), run the blind baselines
   (``mia.blind``) and their distribution-shift verdict, and LOSS AUC by recency (how long before ``c`` a member
   was seen).
4. Write ``results/<run>/``: report.md, summary.json, scores.jsonl, split.jsonl, roc.png, manifest.json.

``--memorize-epochs E`` turns on the memorization dial: checkpoint ``c`` is trained E more epochs on the split's
members only (non-members stay unseen) and that checkpoint is evaluated; LOSS on the clean checkpoint is
reported alongside as a reference.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

import mia
from mia.files.atomic import write_text
from mia.data.splits import write_split
from mia.metrics import metric_rows, summary_row
from mia.testbed import build_testbed

from mia.checkpoints import check_testbed_checkpoints, memorized_checkpoint
from mia.data.draw import draw_testbed_split, SplitSizes
from mia.attacks.catalog import select_attacks as catalog_select
from experiments.harness import (BLIND_FEATURES, DEFAULT_BOOTSTRAP, add_model_flags, check_paths, experiment_parser,
                                 ExperimentError, fmt, one_step, plot_roc, run_blind_baselines, run_and_report, say_fn,
                                 score_split, sha_file, Timings, TRAIN_STEPS_MAX, TRAIN_STEPS_TYPE, versions,
                                 write_json)

# Examples per class in each partition, per preset (non-members only in calib / prefix).
SIZES = {
    "smoke": {"eval": 100, "train": 100, "calib": 30, "prefix": 12},
    "default": {"eval": 500, "train": 500, "calib": 100, "prefix": 12},  # sized for < 15 min on 2 CPU cores
    "large": {"eval": 1000, "train": 1000, "calib": 200, "prefix": 12},
}
# The costliest attacks a preset runs unless named (``mia.attacks.COSTS``): on 2 CPU cores the default split's
# CAMIA signals take ~0.2 s per example, so camia + camia_lr alone would take ~7 minutes.
MAX_COST = {"smoke": "heavy", "default": "model", "large": "heavy"}
RECENCY_GROUPS = (("last 5% of steps", 0.0, 0.05), ("5-25% of steps", 0.05, 0.25), ("older (>25%)", 0.25, 1.0))

JobError = ExperimentError  # a bad request for the main job (one line)


# ---------------------------------------------------------------------------------------------- the split
def draw_split(tb, step: int, n_eval_members: int, n_eval_nonmembers: int, n_train: int, n_calib: int,
               n_prefix: int, seed: int, end_step: Optional[int] = None):
    """(header, examples) of the checkpoint split of testbed ``tb`` at checkpoint ``step``
    (``mia.data.draw.draw_testbed_split``): members rows [0, step*B), non-members rows [step*B, end_step*B)
    with end_step = the first epoch's end; partitions members -> train, eval; non-members -> prefix, calib,
    train, eval."""
    sizes = SplitSizes(n_eval_members, n_train, n_calib, n_prefix, n_eval_nonmembers)
    return draw_testbed_split(tb, step, sizes, seed, end_step)[:2]


# ---------------------------------------------------------------------------------------------- attacks
def select_attacks(spec: Optional[str], preset: str = "default"):
    """[(label, name, params)] to run and {name: reason} skipped."""
    return catalog_select(spec, max_cost=MAX_COST.get(preset, "heavy"), preset=preset)


def recency_rows(loss: np.ndarray, evaluated: list, steps: dict, c: int, n_resamples: int, seed: int) -> list:
    """LOSS AUC of members grouped by how long before checkpoint c they were trained on, vs all non-members."""
    y = np.array([e.label for e in evaluated])
    age = np.array([(c - steps[e.id]) / c if e.label == 1 else np.nan for e in evaluated])
    rows = []
    for name, lo, hi in RECENCY_GROUPS:
        pick = (y == 0) | ((y == 1) & (age > lo) & (age <= hi))
        n_mem = int(((y == 1) & pick).sum())
        lo_s, hi_s = c - int(math.floor(hi * c)), c - int(math.floor(lo * c))
        row = {"method": f"loss, members {name}", "group": name, "steps": [max(lo_s, 0), hi_s],
               "n_members": n_mem, "n_nonmembers": int((y == 0).sum())}
        if n_mem >= 2 and np.isfinite(loss[pick]).all():
            r = summary_row(row["method"], loss[pick], y[pick], n_resamples=n_resamples, seed=seed)
            row.update(auc=r["auc"], auc_se=r["auc_se"], tpr_at_1pct_fpr=r["tpr_at_1pct_fpr"],
                       p_auc_gt_half=r["p_auc_gt_half"])
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- outputs
_fmt = fmt


def report_markdown(s: dict) -> str:
    L = [f"# CheckMIA on the testbed ({s['testbed']['preset']} preset)", ""]
    sp = s["split"]
    L += [
        f"Model: checkpoint `step{sp['step']}`"
        + (
            f" + memorization dial ({s['memorize']['epochs']} epochs over the "
            f"split's {s['memorize']['n_rows']} members)"
            if s.get("memorize")
            else ""
        )
        + f" of testbed `{s['testbed']['root']}` (config {s['testbed']['config_hash']}).",
        f"Split: {sp['counts']['members']} members from steps [0, {sp['step']}) and {sp['counts']['nonmembers']} "
        f"non-members from steps [{sp['step']}, {sp['epoch_end_step']}) of the first epoch (batch "
        f"{sp['batch_size']}, "
        f"rows of {sp['row_len']} tokens, seed {sp['seed']}); evaluated on {sp['n_eval_members']} + "
        f"{sp['n_eval_nonmembers']} (partition eval).",
        "",
    ]
    L += ["| Method | AUC | AUC SE | TPR@1%FPR |", "|---|---:|---:|---:|"]
    blind = [r for r in s["rows"] if r.get("kind") == "blind"]
    for r in blind:
        L.append(f"| {r['method']} (blind, {r['classifier']} chosen by CV on train) | {_fmt(r['auc'])} | "
                 f"{_fmt(r['auc_se'], 4)} | {_fmt(r['tpr_at_1pct_fpr'])} |")
    for r in s["rows"]:
        if r.get("kind") in ("attack", "reference"):
            L.append(f"| {r['method']} | {_fmt(r['auc'])} | {_fmt(r['auc_se'], 4)} | {_fmt(r['tpr_at_1pct_fpr'])} |")
    L.append("")
    if s.get("blind_verdict"):
        L += [f"**Blind baselines:** {s['blind_verdict']['text']}", ""]
    L += [
        "## Recency",
        "",
        "LOSS AUC of members grouped by how many steps before the checkpoint they were trained on, "
        "against the same non-members.",
        "",
        "| Members | steps | n members | AUC | AUC SE |",
        "|---|---|---:|---:|---:|",
    ]
    for r in s["recency"]:
        L.append(f"| {r['group']} | [{r['steps'][0]}, {r['steps'][1]}) | {r['n_members']} | {_fmt(r.get('auc'))} | "
                 f"{_fmt(r.get('auc_se'), 4)} |")
    L.append("")
    if s.get("skipped"):
        L += ["## Skipped", ""] + [f"- {k}: {v}" for k, v in s["skipped"].items()] + [""]
    if s.get("notes"):
        L += ["## Notes", ""] + [f"- {n}" for n in s["notes"]] + [""]
    L += ["Timings: `timings.json`; inputs, seeds and hashes: `manifest.json`.", ""]
    return "\n".join(L)


# ---------------------------------------------------------------------------------------------- the job
def run(preset: str = "default", out=None, *, testbed_dir=None, step: Optional[int] = None,
        n_members: Optional[int] = None, n_nonmembers: Optional[int] = None, n_train: Optional[int] = None,
        n_calib: Optional[int] = None, n_prefix: Optional[int] = None, memorize_epochs: int = 0,
        attacks: Optional[str] = None, blind: bool = True, blind_features=BLIND_FEATURES, seed: int = 0,
        bootstrap: int = DEFAULT_BOOTSTRAP,
        progress: bool = True, testbed_overrides: Optional[dict] = None, argv=None) -> dict:
    """Run the whole job; returns the summary dict (also written to ``out/summary.json``)."""
    say = say_fn(progress)
    timings = Timings()
    t_start = time.perf_counter()
    base = SIZES.get(preset, SIZES["default"])
    for k, v in (("members", n_members), ("train", n_train), ("calib", n_calib), ("prefix", n_prefix),
                 ("nonmembers", n_nonmembers)):
        if v is not None and v < 0:
            raise JobError(f"--n-{k} must be >= 0, got {v}")
    sizes = SplitSizes(base["eval"], base["train"], base["calib"], base["prefix"]).replace(
        eval=n_members, train=n_train, calib=n_calib, prefix=n_prefix, eval_nonmembers=n_nonmembers)
    out = Path(out) if out is not None else Path("results") / f"checkmia-{preset}" \
        f"{'-mem' + str(memorize_epochs) if memorize_epochs else ''}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)

    # 1. testbed
    with timings("testbed"):
        tb = build_testbed(preset, testbed_dir, progress=progress, **(testbed_overrides or {}))
    say(tb.summary())
    c = tb.train_steps if step is None else int(step)
    if c > tb.train_steps or c < 0:
        raise JobError(f"checkpoint step {c} is beyond the run: the testbed trained {tb.train_steps} steps "
                       f"(checkpoints: {', '.join(map(str, tb.steps))})")

    # 2. the checkpoint opened and checked before any split work (check_testbed_checkpoints)
    with timings("check"):
        ckpt_records, _ = check_testbed_checkpoints([(f"step{c}", tb, c)])

    # 3. split
    with timings("split"):
        header, examples, _ = draw_testbed_split(tb, c, sizes, seed)
        split_path = write_split(out / "split.jsonl", header, examples)
    say(f"split: {header['counts']['members']} members, {header['counts']['nonmembers']} non-members -> {split_path}")

    # 4. model (clean checkpoint, or the memorization dial on the split's members)
    clean_dir = tb.checkpoint_dir(c)
    model_dir, mem_info = clean_dir, None
    if memorize_epochs and memorize_epochs > 0:
        with timings("memorize"):
            rows = [e["index"] for e in examples if e["label"] == 1]
            model_dir = memorized_checkpoint(tb, rows, memorize_epochs, step=c, seed=seed, progress=progress)
        mem_info = json.loads((model_dir / "memorize.json").read_text())
        mem_info = {k: v for k, v in mem_info.items() if k != "rows"} | {"path": str(model_dir)}
    model = mia.load(model_dir)
    cache_dir = str(tb.root / "cache")

    # 5. attacks
    with timings("attacks"):
        to_run, skipped = select_attacks(attacks, preset)
        res = score_split(model, examples, to_run, seed=seed, progress=progress, cache_dir=cache_dir)
    skipped.update(res.skipped)
    timings.update({f"attack:{k}": round(v, 2) for k, v in res.seconds.items()})
    evaluated, scores, notes, labels, ids = res.examples, res.scores, res.notes, res.labels, res.ids
    rows = metric_rows(scores, labels, ids, bootstrap, seed)
    scores_ref = None
    if mem_info is not None:  # the same split on the clean checkpoint, as a reference
        clean = score_split(mia.load(clean_dir), examples, "loss", seed=seed, progress=False, cache_dir=cache_dir)
        scores_ref = clean.scores["loss"]
        rows += metric_rows({f"loss (clean step{c}, no dial)": scores_ref}, labels, ids, bootstrap, seed, "reference")
    meta = {e["id"]: {"index": e["index"], "step": e["step"], "batch_pos": e["batch_pos"]} for e in examples}

    # 5. recency
    loss_for_recency = scores.get("loss")
    if loss_for_recency is None:
        loss_for_recency = score_split(model, examples, "loss", seed=seed, progress=False,
                                       cache_dir=cache_dir).scores["loss"]
    recency = recency_rows(loss_for_recency, evaluated, {k: v["step"] for k, v in meta.items()}, c, bootstrap, seed)

    # 6. blind baselines
    blind_rows, verdict = None, None
    if blind:
        say("blind baselines ...")
        with timings("blind"):
            blind_rows, verdict, bskip = run_blind_baselines(split_path, seed, bootstrap, blind_features,
                                                             progress=progress)
        skipped.update({f"blind {k}": v for k, v in bskip.items()})
    best_blind = [dict(r, kind="blind") for r in (blind_rows or []) if r.get("kind") == "chosen"]

    # 7. outputs (timings go to timings.json only, so report.md and summary.json are deterministic)
    res.write(out / "scores.jsonl", meta, {f"loss@step{c}": scores_ref} if scores_ref is not None else None)
    plot_roc(scores, labels, out / "roc.png",
             f"testbed {preset}, step{c}" + (f" + dial E={memorize_epochs}" if mem_info else ""))
    keep = ("method", "kind", "auc", "auc_se", "tpr_at_1pct_fpr", "auc_ci_low", "auc_ci_high", "tpr_at_0.1pct_fpr",
            "p_auc_gt_half", "n", "n_nonfinite", "feature", "classifier", "n_train", "n_eval")
    summary = {
        "rows": [{k: r[k] for k in keep if k in r} for r in best_blind + rows],
        "split": {"path": split_path.name, "step": c, "epoch_end_step": tb.epoch_steps, "batch_size": tb.batch_size,
                  "row_len": tb.row_len, "seed": seed, "member_rows": header["params"]["member_rows"],
                  "nonmember_rows": header["params"]["nonmember_rows"], "counts": header["counts"],
                  "partitions": header["partitions"], "n_eval_members": int((labels == 1).sum()),
                  "n_eval_nonmembers": int((labels == 0).sum())},
        "testbed": {"root": str(tb.root), "preset": tb.config.preset, "config_hash": tb.config.config_hash,
                    "train_steps": tb.train_steps, "checkpoints": tb.steps,
                    "final_train_loss": tb.manifest.get("train", {}).get("final_loss")},
        "memorize": mem_info,
        "recency": recency,
        "blind": [{k: r[k] for k in keep if k in r} for r in (blind_rows or []) if r.get("kind") == "run"],
        "blind_verdict": verdict,
        "skipped": skipped,
        "notes": notes,
    }
    write_json(out / "summary.json", summary)
    write_text(out / "report.md", report_markdown(summary))
    outputs = ["report.md", "summary.json", "scores.jsonl", "split.jsonl", "roc.png", "manifest.json", "timings.json"]
    manifest = {
        "command": ["python", "-m", "experiments.checkmia", *(argv or [])],
        "config": {"preset": preset, "step": c, "sizes": dataclasses.asdict(sizes),
                   "memorize_epochs": memorize_epochs, "attacks": attacks or "default",
                   "blind": list(blind_features) if blind else [],
                   "bootstrap": bootstrap, "testbed": tb.config.to_dict()},
        "seeds": {"split": seed, "partitions": [seed, 0x5B1], "bootstrap": seed, "testbed": tb.config.seed},
        "hashes": {"corpus_sha256": tb.manifest["corpus"]["sha256"],
                   "tokenizer_sha256": tb.manifest["tokenizer"]["sha256"],
                   "order_bin_sha256": tb.manifest["data"]["bin"]["sha256"],
                   "order_perm_sha256": tb.manifest["data"]["perm_sha256"],
                   "checkpoint_sha256": sha_file(clean_dir / "model.safetensors"), "checkpoints": ckpt_records,
                   "evaluated_model_sha256": sha_file(Path(model_dir) / "model.safetensors"),
                   "split_sha256": sha_file(split_path), "testbed_config_hash": tb.config.config_hash},
        "paths": {"testbed": str(tb.root.resolve()), "checkpoint": str(Path(model_dir).resolve()),
                  "split": str(split_path.resolve())},
        "versions": versions(),
        "outputs": outputs,
    }
    write_json(out / "manifest.json", manifest)
    timings["total"] = round(time.perf_counter() - t_start, 1)
    timings.write(out)
    say(f"wrote {out}/ ({', '.join(outputs)}) in {timings['total']:.0f} s")
    return summary


def build_parser() -> argparse.ArgumentParser:
    from mia import validate as V
    from mia.testbed.config import PRESETS

    p = experiment_parser("python -m experiments.checkmia", __doc__, sorted(PRESETS), preset_help=(
        "testbed preset: smoke, default, large (default: default)"))
    add_model_flags(p, which=("testbed", "steps", "memorize"),
                    testbed="testbed directory (default: testbeds/<preset>, or testbeds/<preset>-<hash> with "
                            "overrides; built if missing)",
                    steps="the checkpoint c to evaluate, one step (default: the last)")
    p.add_argument("--n-members", type=V.arg_int(1), default=None,
                   help="members in the eval partition (default per preset)")
    p.add_argument("--n-nonmembers", type=V.arg_int(1), default=None,
                   help="non-members in the eval partition (default = --n-members)")
    p.add_argument("--n-train", type=V.arg_int(0), default=None,
                   help="per class, partition train (blind classifiers, camia_lr)")
    p.add_argument("--n-calib", type=V.arg_int(0), default=None, help="non-members in partition calib (CAMIA)")
    p.add_argument("--n-prefix", type=V.arg_int(0), default=None, help="non-members in partition prefix (ReCaLL)")
    p.add_argument("--attacks", default=None, help="'all', or NAME[:k=v,...] list (default: every registered attack "
                                                   "except ref/mlm ones, the O(N^2) em_mia, recall_avg, and with "
                                                   "--preset default the slow camia, camia_lr, samia, samia_zlib)")
    p.add_argument("--no-blind", action="store_true", help="skip the blind baselines")
    p.add_argument("--corpus", default=None,
                   help="corpus for a new testbed: directory or .jsonl/.parquet (default: stdlib)")
    p.add_argument("--train-steps", type=TRAIN_STEPS_TYPE, default=None,
                   help=f"testbed override: steps to train (at most {TRAIN_STEPS_MAX:,})")
    p.add_argument("--batch-size", type=V.arg_int(1), default=None, help="testbed override: rows per step")
    return p


def one_testbed(parser, testbeds) -> Optional[str]:
    """checkmia's single testbed directory (``--testbed`` given at most once)."""
    if testbeds and len(testbeds) > 1:
        parser.error(f"--testbed given {len(testbeds)} times: checkmia evaluates one testbed (built there if "
                     "missing); give it once")
    return testbeds[0] if testbeds else None


def check_args(args) -> bool:
    """Options checked before the testbed is built or loaded: preset, paths, the attack list."""
    from mia.testbed.config import PRESETS

    if args.preset not in PRESETS:
        raise JobError(f"--preset {args.preset!r}: unknown; presets: {', '.join(sorted(PRESETS))}")
    corpus_file = args.corpus is not None and not Path(args.corpus).is_dir()  # a corpus is a directory or a file
    check_paths(out=args.out if args.out is not None else Path("results") / f"checkmia-{args.preset}",
                files=[("--corpus", args.corpus if corpus_file else None)], output_dirs=[("--testbed", args.testbed)])
    if args.attacks is not None:
        select_attacks(args.attacks, args.preset)  # a bad name or parameter stops here, not after training
    return True


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    args.testbed = one_testbed(ap, args.testbed)
    step = one_step(ap, args.steps, "checkmia")
    overrides = {k: v for k, v in (("corpus", args.corpus), ("train_steps", args.train_steps),
                                   ("batch_size", args.batch_size)) if v is not None}
    return run_and_report(
        lambda: (
            check_args(args)
            and run(
                args.preset,
                args.out,
                testbed_dir=args.testbed,
                step=step,
                n_members=args.n_members,
                n_nonmembers=args.n_nonmembers,
                n_train=args.n_train,
                n_calib=args.n_calib,
                n_prefix=args.n_prefix,
                memorize_epochs=args.memorize_epochs,
                attacks=args.attacks,
                blind=not args.no_blind,
                seed=args.seed,
                bootstrap=args.bootstrap,
                progress=not args.no_progress,
                testbed_overrides=overrides,
                argv=argv,
            )
        ),
        args,
        report_markdown,
        on_interrupt="interrupted; rerun the same command: the testbed resumes and finished scoring batches are cached",
    )


if __name__ == "__main__":
    raise SystemExit(main())
