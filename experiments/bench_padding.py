"""Benchmark: padding and speed of the scoring engine's rows: power-of-two buckets, multiple-of-step buckets, packing.

    python -m experiments.bench_padding [--rows 128 --batch-tokens 2048] [--plan-rows 1000 10000] [--bucket-step 128]

Three rules side by side on the same synthetic corpora (``ScoringSettings``, everything else at its default):

  baseline  ``bucket_step=0, pack=False``: every text in its own row padded to the power of two >= its length
            (>= ``min_bucket`` 16)
  buckets   ``bucket_step=--bucket-step, pack=False``: powers of two up to the step, multiples of it above (at
            most 8 per octave), one text per row (the default)
  packed    ``bucket_step=--bucket-step, pack=True``: several texts per row (segment ids), rows of those bucket lengths

The default (``pack=None``, auto) is one of the last two, chosen per call by ``packs_rows``' cost estimate; each
timed corpus prints which one auto picks for the model and the estimated packed / unpacked cost.

Corpora (token counts per text; seeded):

  log-uniform   lengths log-uniform in [32, 2048]
  wikimia+mimir half WikiMIA-like (a length split L in {32, 64, 128, 256} words at random, L x U(1.0, 1.5) tokens),
                half MIMIR-like (normal around 200 tokens, sd 40, clipped to [64, 400])
  long          lengths uniform in [512, 2048] (long-row mixes: whole documents, long MIMIR/pile chunks)

Printed per corpus and rule: compiled programs (distinct batch shapes of the plan = length buckets), the padding
factor (padded tokens / real tokens, by the row lengths alone, and as computed: batches x rows x length, which also
counts the empty rows of each bucket: a bucket's row count is a power of two), the first run (compiling included)
and the best of ``--repeats`` warm runs of ``compute_token_stats`` with a tiny random GPT-NeoX (hidden 32, 1 layer,
vocab 256: cheap enough that 2 CPU cores finish in about 2 minutes) at ``--batch-tokens`` padded tokens per batch, real
tokens/s, and the ratio baseline / mia. The two rules' log-probs are compared (max |difference|). The plan-only
table (no model) gives the same padding columns at the default token budget for ``--plan-rows`` texts.

The "row length" table times one token-stats step on the same 2,048 random tokens as rows of 128, 256 and 512 and
fits the per-score attention cost that ``mia.engine.batching.SCORE_OVERHEAD_FLOPS`` holds for this backend:
the estimate says t(T) is proportional to dense + a T per token, so a least-squares line t = alpha + beta T gives
a = dense beta / alpha, and the overhead per score is a / (layers x heads) - 4 x head dim (in FLOP-equivalents).
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from typing import Optional

import numpy as np

from mia import validate as V

CORPORA = ("log-uniform", "wikimia+mimir", "long")


def corpus_lengths(name: str, n: int, seed: int = 0) -> np.ndarray:
    """Token counts of ``n`` synthetic texts of corpus ``name`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    if name == "log-uniform":
        return np.exp(rng.uniform(np.log(32), np.log(2048), n)).round().astype(int)
    if name == "wikimia+mimir":
        wiki = rng.choice([32, 64, 128, 256], n - n // 2) * rng.uniform(1.0, 1.5, n - n // 2)
        mimir = np.clip(rng.normal(200, 40, n // 2), 64, 400)
        return rng.permutation(np.concatenate([wiki, mimir])).round().astype(int)
    if name == "long":
        return rng.integers(512, 2049, n)
    raise ValueError(f"unknown corpus {name!r}; one of {', '.join(CORPORA)}")


def plan_numbers(lengths, settings) -> dict:
    """Programs, padding factor by row lengths, padding factor as computed (batches x rows x positions read). The
    model reads n - 1 positions of an n-token text (its last token is only predicted) and length - 1 of a row."""
    from mia.engine.batching import first_fit_rows, pack_rows, plan_batches, row_length

    lengths = [int(n) for n in lengths]
    plan = (pack_rows if settings.pack else plan_batches)(lengths, settings)
    real = int(np.sum(lengths)) - len(lengths)
    if settings.pack:
        by_row = sum(length - 1 for length, _ in first_fit_rows(lengths, settings))
    else:
        by_row = sum(row_length(int(n), settings.min_bucket, settings.bucket_step) - 1 for n in lengths)
    return {"programs": len({(b.length, b.rows) for b in plan}), "pad_rows": by_row / real,
            "pad_computed": sum(b.rows * (b.length - 1) for b in plan) / real}


def tiny_model(hidden: int, layers: int, vocab: int):
    import torch
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    import mia.models as mm

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=4 * hidden, max_position_embeddings=2048, rotary_pct=0.25)
    with tempfile.TemporaryDirectory() as d:
        AutoModelForCausalLM.from_config(cfg).float().eval().save_pretrained(d)
        return mm.load(d)


def timed_runs(model, seqs, settings, repeats: int):
    """(first run s with compiling, best warm s, results) of ``compute_token_stats`` from empty jit caches."""
    import jax

    from mia.engine import loop

    jax.clear_caches()
    loop.jitted_token_stats.cache_clear()
    t0 = time.perf_counter()
    out = loop.compute_token_stats(model, seqs, settings)
    cold = time.perf_counter() - t0
    warm = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loop.compute_token_stats(model, seqs, settings)
        warm.append(time.perf_counter() - t0)
    return cold, min(warm), out


def step_seconds(model, rows: int, length: int, repeats: int = 5) -> float:
    """Best of ``repeats`` warm calls of the jitted token-stats step on random [rows, length] tokens."""
    import jax
    import jax.numpy as jnp

    from mia.engine import loop

    fn, params = loop.jitted_token_stats(model), loop.placed_params(model, None)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.vocab_size, (rows, length)), jnp.int32)
    valid = jnp.ones((rows, length), bool)
    jax.block_until_ready(fn(params, tokens, valid))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(params, tokens, valid))
        best = min(best, time.perf_counter() - t0)
    return best


def fitted_score_overhead(model, seconds: dict) -> Optional[float]:
    """The per-score cost beyond 4 x head dim implied by step times at several row lengths (same tokens): a least-
    squares line t(T) = alpha + beta T, so per key = dense x beta / alpha (module docstring); None when the line has
    alpha <= 0 (the step time grows faster than linearly in T: attention-bound, the cost model does not hold)."""
    from mia.engine.batching import row_cost

    cfg, dense = model.config, row_cost(model).dense
    beta, alpha = np.polyfit(list(seconds), list(seconds.values()), 1)
    if alpha <= 0:
        return None
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return dense * beta / alpha / (cfg.num_hidden_layers * cfg.num_attention_heads) - 4 * head_dim


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128, help="texts per corpus for the timed runs")
    ap.add_argument("--batch-tokens", dest="budget", type=int, default=2048,
                    help="token budget per batch of the timed runs (mia score's --batch-tokens)")
    ap.add_argument("--plan-rows", type=int, nargs="+", default=[1000, 10000],
                    help="texts per corpus for the plan-only table")
    ap.add_argument("--bucket-step", dest="step", type=int, default=128,
                    help="bucket step of the mia side (mia score's --bucket-step)")
    ap.add_argument("--corpora", nargs="+", default=list(CORPORA), choices=CORPORA)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plan-only", action="store_true", help="print the plan table only (no model, no timing)")
    for old, new in (("--budget", "--batch-tokens"), ("--step", "--bucket-step")):
        V.add_renamed_flag(ap, old, new)
    args = ap.parse_args(argv)

    import jax

    from mia.engine.batching import (SCORE_OVERHEAD_FLOPS, SCORE_OVERHEAD_FLOPS_DEFAULT, ScoringSettings, pack_rows,
                                     packs_rows, plan_batches, plan_cost, row_cost)

    rules = {"baseline (powers of two)": ScoringSettings(progress=False, bucket_step=0, pack=False),
             f"buckets (step {args.step})": ScoringSettings(progress=False, bucket_step=args.step, pack=False),
             f"packed (step {args.step})": ScoringSettings(progress=False, bucket_step=args.step, pack=True)}
    timed = {k: dataclasses.replace(s, token_budget=args.budget) for k, s in rules.items()}

    print(f"plan only, default token budget {ScoringSettings().token_budget}, one device")
    print(f"{'corpus':<15} {'texts':>6} {'rule':<26} {'programs':>8} {'pad (rows)':>10} {'pad (computed)':>14}")
    for name in args.corpora:
        for n in args.plan_rows:
            lengths = corpus_lengths(name, n, seed=1)
            for label, s in rules.items():
                p = plan_numbers(lengths, s)
                print(f"{name:<15} {n:6d} {label:<26} {p['programs']:8d} {p['pad_rows']:10.3f} "
                      f"{p['pad_computed']:14.3f}")
    if args.plan_only:
        return

    model = tiny_model(args.hidden, args.layers, args.vocab)
    print(f"\ntoken stats, random GPT-NeoX hidden={args.hidden} layers={args.layers} vocab={args.vocab}, "
          f"{args.rows} texts per corpus, token budget {args.budget},\njax {jax.__version__} on "
          f"{jax.devices()[0].platform} ({len(jax.devices())} device), first run compiles, "
          f"warm = best of {args.repeats}")
    print(f"{'corpus':<15} {'rule':<26} {'programs':>8} {'pad':>6} {'first s':>8} {'warm s':>7} {'tok/s':>8}")
    for name in args.corpora:
        lengths = corpus_lengths(name, args.rows, seed=0)
        rng = np.random.default_rng(0)
        seqs = [rng.integers(0, args.vocab, int(n)).astype(np.int32) for n in lengths]
        real = int(lengths.sum())
        rows = {}
        for label, s in timed.items():
            cold, warm, out = timed_runs(model, seqs, s, args.repeats)
            p = plan_numbers(lengths, s)
            rows[label] = (cold, warm, out)
            print(f"{name:<15} {label:<26} {p['programs']:8d} {p['pad_computed']:6.3f} {cold:8.2f} {warm:7.2f} "
                  f"{real / warm:8.0f}")
        auto = dataclasses.replace(timed[f"buckets (step {args.step})"], pack=None)
        cost = row_cost(model)
        ratio = plan_cost(pack_rows(list(lengths), auto), cost) / plan_cost(plan_batches(list(lengths), auto), cost)
        print(f"{name:<15} auto (pack=None) picks {'packed' if packs_rows(auto, list(lengths), cost) else 'buckets'}: "
              f"estimated packed / unpacked cost {ratio:.3f}")
        (b_cold, b_warm, b_out), *others = rows.values()
        for label, (m_cold, m_warm, m_out) in zip(list(rows)[1:], others):
            diff = max(float(np.abs(a["logprob"] - b["logprob"]).max()) for a, b in zip(b_out, m_out))
            print(f"{name:<15} baseline / {label.split()[0]}: warm {b_warm / m_warm:.2f}x, first run "
                  f"{b_cold / m_cold:.2f}x; {real} real tokens; max |logprob difference| {diff:.1e}")

    backend = jax.default_backend()
    print(f"\nrow length: one step on 2048 tokens, best of 5 ({backend})")
    seconds = {t: step_seconds(model, 2048 // t, t) for t in (128, 256, 512)}
    for t, sec in seconds.items():
        print(f"  rows {2048 // t:3d} x {t:3d}: {sec * 1e3:8.2f} ms  ({sec / seconds[128]:.2f}x the 128-token rows)")
    fitted = fitted_score_overhead(model, seconds)
    print(f"  fitted score overhead "
          f"{'n/a (time grows faster than linearly in T)' if fitted is None else f'{fitted:.0f}'} per score; "
          f"SCORE_OVERHEAD_FLOPS for {backend}: "
          f"{SCORE_OVERHEAD_FLOPS.get(backend, SCORE_OVERHEAD_FLOPS_DEFAULT)}")


if __name__ == "__main__":
    main()
