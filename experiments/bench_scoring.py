"""Benchmark: token stats of our jitted Flax scoring engine vs transformers PyTorch eager, same weights and batch.

    python -m experiments.bench_scoring [--hidden 512 --layers 6 --heads 8 --vocab 50304 --batch 8 --length 512]

Defaults are a Pythia-70m-shaped model with random weights. Both sides compute, for every target token, the
log-prob and the probability-weighted mean/std of log p and the entropy (what Min-K%++ needs), in float32, on the
same right-padded batch (the last quarter of rows padded). Prints a table with tokens/second and the ratio.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np


def torch_stats(model, tokens, mask):
    import torch

    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=mask).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1)
        tok = logp.gather(-1, tokens[:, 1:, None])[..., 0]
        p = logp.exp()
        mu = (p * logp).sum(-1)
        std = (p * (logp - mu[..., None]) ** 2).sum(-1).sqrt()
        return tok, mu, std, -mu


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), float(np.median(times))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    import jax
    import torch
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    import mia.models as mm
    from mia.engine.loop import jitted_token_stats

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                        max_position_embeddings=2048, rotary_pct=0.25)
    with tempfile.TemporaryDirectory() as d:
        AutoModelForCausalLM.from_config(cfg).float().eval().save_pretrained(d)
        ref = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").float().eval()
        ours = mm.load(d)

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.length)).astype(np.int64)
    mask = np.ones_like(tokens)
    mask[-max(1, args.batch // 4):, args.length // 2:] = 0  # some right padding, identical on both sides
    real_tokens = int(mask.sum())

    fn = jitted_token_stats(ours)
    j_tokens, j_mask = jax.device_put(tokens.astype(np.int32)), jax.device_put(mask.astype(bool))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(ours.params, j_tokens, j_mask))
    compile_s = time.perf_counter() - t0
    ours_best, ours_med = best_of(lambda: jax.block_until_ready(fn(ours.params, j_tokens, j_mask)), args.repeats)

    t_tokens, t_mask = torch.tensor(tokens), torch.tensor(mask)
    torch_stats(ref, t_tokens, t_mask)  # warm-up
    torch_best, torch_med = best_of(lambda: torch_stats(ref, t_tokens, t_mask), args.repeats)

    a = np.asarray(fn(ours.params, j_tokens, j_mask)["logprob"])
    b = torch_stats(ref, t_tokens, t_mask)[0].numpy()
    m = (mask[:, 1:] * mask[:, :-1]).astype(bool)
    diff = float(np.abs(a - b)[m].max())

    print(f"token stats, GPT-NeoX hidden={args.hidden} layers={args.layers} heads={args.heads} vocab={args.vocab}, "
          f"batch {args.batch} x {args.length} ({real_tokens} real tokens), {torch.get_num_threads()} torch threads, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")
    print(f"{'engine':<36} {'best s':>8} {'median s':>9} {'tokens/s':>10}")
    print(f"{'mia (jit, vocab-chunked)':<36} {ours_best:8.3f} {ours_med:9.3f} {real_tokens / ours_best:10.0f}")
    print(f"{'transformers PyTorch eager no_grad':<36} {torch_best:8.3f} {torch_med:9.3f} "
          f"{real_tokens / torch_best:10.0f}")
    print(f"speed-up (torch best / mia best): {torch_best / ours_best:.2f}x   (mia compile once: {compile_s:.1f}s)")
    print(f"max |logprob difference| on real tokens: {diff:.2e}")


if __name__ == "__main__":
    main()
