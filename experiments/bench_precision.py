"""What bf16 costs in scores: every attack in float32 and in bfloat16 on a testbed checkpoint split, side by side.

    python -m experiments.bench_precision [--suite default --member largest] [--memorize-epochs 4]
    python -m experiments.bench_precision --testbed DIR [--steps 100] [--attacks loss,zlib] [--out DIR]

The split is the checkpoint split of the member's last (or ``--steps``) checkpoint, as ``experiments.checkmiabench``
draws it (default suite: 500 + 500 evaluated, 500 + 500 train, 100 calibration and 12 prefix non-members; seeded);
``--memorize-epochs E`` scores the memorization dial's checkpoint (E more epochs on the evaluated members) instead.
The same examples are scored once per ``--dtypes`` mode, without the on-disk cache.
Printed (and written to ``--out`` as tables and ``summary.json``):

- per token: |log p(bf16) - log p(float32)| over every scored target token (max, mean, 99th percentile), from the
  loss attack's per-token statistics;
- per attack: AUC in each mode, their difference, Spearman's rank correlation of the two score vectors, and the
  largest score change as a fraction of the float32 scores' spread (max - min). For the randomized attacks (noise,
  sampling, augmentation: ``RANDOMIZED``) the same columns compare float32 under seed and seed + 1 (``seed+1``):
  a bf16 change within that is within the attack's own randomness.

Run it on the accelerator users will score on: XLA:CPU computes bf16 elementwise work in float32, so a CPU run
measures the bf16 rounding of weights and matmul inputs but not every rounding a GPU/TPU makes.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional, Sequence

import jax
import numpy as np
from scipy.stats import spearmanr

import mia
from mia.engine.batching import ScoringSettings
from mia.engine.loop import compute_token_stats
from mia.metrics import auc as roc_auc

from mia.checkpoints import memorized_checkpoint, open_members, pick_members
from mia.data.draw import draw_testbed_split, SplitSizes
from mia.attacks.catalog import select_attacks
from .harness import (flags_named, experiment_parser, ExperimentError, fmt, MEMORIZE_EPOCHS_MAX, MEMORIZE_TYPE,
                      run_main, write_tables)

# attacks whose scores depend on the seed (random noise, sampling, augmentation): their float32 scores under another
# seed are the yardstick for the bf16 change
RANDOMIZED = ("mope", "samia", "samia_zlib", "pac", "neighbor")
SPLITS = {"default": SplitSizes(500, 500, 100, 12), "smoke": SplitSizes(60, 60, 20, 12)}  # per suite


def per_token_logprobs(model, examples: Sequence[dict]) -> list:
    """[n_i - 1] float64 log p of each target token of each example (the engine's batched token statistics)."""
    tokens = [np.asarray(e["tokens"], np.int32) for e in examples]
    stats = compute_token_stats(model, tokens, ScoringSettings(progress=False, cache_dir=None), desc="log-probs")
    return [np.asarray(s["logprob"], np.float64) for s in stats]


def token_error(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> dict:
    """max / mean / p99 of |a - b| over every token of every row (rows of equal lengths pairwise)."""
    d = np.abs(np.concatenate([x - y for x, y in zip(a, b)]))
    return {"tokens": int(d.size), "max": float(d.max()), "mean": float(d.mean()),
            "p99": float(np.quantile(d, 0.99))}


def attack_rows(runs: dict, labels: np.ndarray, base: str) -> list:
    """One row per attack: AUC per mode, ΔAUC against ``base``, Spearman rho and the largest score change relative
    to the ``base`` scores' spread. Non-finite scores (in either mode) are left out of that attack's comparison."""
    rows = []
    for label in runs[base]:
        ref = runs[base][label]
        row = {"attack": label}
        for mode, scores in runs.items():
            s = scores[label]
            ok = np.isfinite(s) & np.isfinite(ref)
            if not ok.any():
                continue
            row[f"auc_{mode}"] = roc_auc(s[ok], labels[ok])
            if mode != base:
                row[f"dauc_{mode}"] = row[f"auc_{mode}"] - roc_auc(ref[ok], labels[ok])
                row[f"rho_{mode}"] = float(spearmanr(ref[ok], s[ok]).statistic)
                spread = float(np.ptp(ref[ok])) or 1.0
                row[f"max_change_{mode}"] = float(np.max(np.abs(s[ok] - ref[ok]))) / spread
                row[f"nonfinite_{mode}"] = int((~ok).sum())
        rows.append(row)
    return rows


def run(suite: str = "default", member: str = "largest", *, testbeds: Sequence = (), suite_dir=None,
        steps: Optional[Sequence[int]] = None, memorize_epochs: int = 0, attacks=None,
        dtypes: Sequence[str] = ("float32", "bfloat16"), seed: int = 0, out=None, progress: bool = True) -> dict:
    """The comparison as a dict (also ``out/summary.json`` when ``out`` is given); see the module docstring."""
    if len(dtypes) < 2:
        raise ExperimentError("--dtypes: give at least two modes to compare, e.g. float32,bfloat16")
    with flags_named(testbeds="--testbed", member="--member"):
        members, desc, _ = open_members(suite, testbeds=testbeds, suite_dir=suite_dir, progress=progress)
        target = pick_members(members, member)[-1]
    tb = target.testbed
    step = int(steps[-1]) if steps else tb.train_steps
    header, examples, note = draw_testbed_split(tb, step, SPLITS.get(suite, SPLITS['default']), seed)
    evaluated = [e for e in examples if e.get("partition", "eval") == "eval"]
    model_dir = tb.checkpoint_dir(step)
    if memorize_epochs:
        model_dir = memorized_checkpoint(tb, [e["index"] for e in evaluated if e["label"] == 1], memorize_epochs,
                                         step=step, seed=seed, progress=progress)
    to_run, skipped = select_attacks(attacks, tolerant=attacks is None)
    runs, logprobs, seconds = {}, {}, {}
    for mode in dtypes:
        model = mia.load(model_dir, dtype=mode)
        t0 = time.perf_counter()
        logprobs[mode] = per_token_logprobs(model, evaluated)
        run_ = mia.score(model, examples, to_run, seed=seed, progress=progress, cache=False, on_error="skip")
        seconds[mode] = time.perf_counter() - t0
        runs[mode] = run_.scores
        skipped.update(run_.skipped)
    base = dtypes[0]
    randomized = [a for a in to_run if a[1] in RANDOMIZED and a[0] in runs[base]]
    if randomized:
        model = mia.load(model_dir, dtype=base)
        again = mia.score(model, examples, randomized, seed=seed + 1, progress=progress, cache=False, on_error="skip")
        runs["seed+1"] = {label: again.scores.get(label, np.full(len(evaluated), np.nan)) for label in runs[base]}
    labels = np.asarray([e["label"] for e in evaluated], np.int64)
    summary = {
        "model": f"{target.name} ({target.n_params:,} parameters) step{step}"
                 + (f", memorization dial E={memorize_epochs}" if memorize_epochs else ""),
        "source": desc, "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
        "examples": len(evaluated), "dtypes": list(dtypes), "modes": list(runs), "seconds": seconds,
        "token_error": {m: token_error(logprobs[m], logprobs[base]) for m in dtypes[1:]},
        "attacks": attack_rows(runs, labels, base), "skipped": skipped, "notes": [n for n in [note] if n],
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
        others = [m for m in runs if m != base]
        cols = ["attack"] + [f"auc_{m}" for m in runs] + [f"{k}_{m}" for m in others
                                                          for k in ("dauc", "rho", "max_change", "nonfinite")]
        write_tables(summary["attacks"], out, "precision", cols, f"bf16 vs float32: {summary['model']}")
    return summary


def print_summary(s: dict) -> None:
    print(f"{s['model']} on {s['device']} ({s['platform']}), {s['examples']} examples; {s['source']}")
    for mode, e in s["token_error"].items():
        print(f"per-token |log p({mode}) - log p({s['dtypes'][0]})| over {e['tokens']:,} tokens: max {e['max']:.4g}, "
              f"mean {e['mean']:.3g}, p99 {e['p99']:.3g} nats")
    modes = s["modes"]
    head = f"{'attack':16s}" + "".join(f"{'AUC ' + m:>15s}" for m in modes) + \
        "".join(f"{'dAUC ' + m:>15s}{'rho':>9s}{'max chg':>9s}" for m in modes[1:])
    print(head)
    for r in s["attacks"]:
        line = f"{r['attack']:16s}" + "".join(f"{fmt(r.get(f'auc_{m}'), 4):>15s}" for m in modes)
        for m in modes[1:]:
            if f"dauc_{m}" in r:
                line += f"{r[f'dauc_{m}']:+15.4f}{r[f'rho_{m}']:9.5f}{r[f'max_change_{m}']:9.2e}"
            else:
                line += f"{'':15s}{'':9s}{'':9s}"
        print(line)
    worst = max((abs(r[f"dauc_{m}"]) for r in s["attacks"] for m in s["dtypes"][1:] if f"dauc_{m}" in r),
                default=0.0)
    print(f"largest |dAUC| between dtypes: {worst:.4f}; seconds per mode: "
          + ", ".join(f"{m} {t:.1f}" for m, t in s["seconds"].items()))
    for k, v in s["skipped"].items():
        print(f"skipped {k}: {v}")


def main(argv=None) -> int:
    p = experiment_parser("python -m experiments.bench_precision", __doc__, ["default", "smoke"])
    p.add_argument("--testbed", action="append", default=[], help="a built testbed directory (repeatable) instead "
                                                                    "of the suite")
    p.add_argument("--suite-dir", default=None, help="where the suite is built or reused (default testbeds/suite-NAME)")
    p.add_argument("--member", default="largest", help="suite member: largest (default), smallest, middle or a name")
    p.add_argument("--steps", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="checkpoint step (default: the last)")
    p.add_argument("--attacks", default=None, help="comma list (default: every attack that needs no extra input)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="modes to compare, the first is the reference")
    p.add_argument("--memorize-epochs", type=MEMORIZE_TYPE, default=0,
                   help=f"memorization dial: E more epochs on the members (at most {MEMORIZE_EPOCHS_MAX:,})")
    args = p.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]

    def go():
        s = run(args.preset, args.member or "largest", testbeds=args.testbed or (), suite_dir=args.suite_dir,
                steps=args.steps, memorize_epochs=args.memorize_epochs, attacks=args.attacks, dtypes=dtypes,
                seed=args.seed, out=args.out, progress=not args.no_progress)
        print_summary(s)

    return run_main(go, debug=args.debug)[0]


if __name__ == "__main__":
    raise SystemExit(main())
