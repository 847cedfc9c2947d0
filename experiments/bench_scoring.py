"""Benchmark: token stats of our jitted Flax scoring engine vs transformers PyTorch eager, same weights and batch,
against this machine's float32 matmul peak measured in the same run.

    python -m experiments.bench_scoring [--hidden 512 --layers 6 --heads 8 --vocab 50304 --batch 8 --length 512]

Defaults are a Pythia-70m-shaped model with random weights. Two workloads on each side, in float32, on the same
right-padded batch (the last quarter of rows padded): every statistic (the log-prob and the probability-weighted
mean/std of log p and the entropy: what Min-K%++ needs) and the log-prob alone (what LOSS, Min-K%, zlib need; mia's
log-prob-only program, torch's logits - logsumexp gathered). The peak: the best of numpy, jax and torch on a
``--matmul``-cubed float32 matmul, on the same threads. Prints tokens/second, the ratio, and each side's model FLOP/s
(``mia.flops.forward_flops_per_token`` x tokens/s) as a fraction of that peak.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from experiments.random_models import add_shape_flags, save_random_gpt_neox


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


def torch_logprob(model, tokens, mask):
    """The log-prob alone: logit of the next token minus the logsumexp (no [B, T, V] log-softmax kept)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=mask).logits[:, :-1].float()
        return logits.gather(-1, tokens[:, 1:, None])[..., 0] - torch.logsumexp(logits, -1)


def matmul_peak(n: int, repeats: int) -> dict:
    """{library: best float32 GFLOP/s of an n x n x n matmul} for numpy, jax and torch, on this process's threads."""
    import jax
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    jdot = jax.jit(jnp.matmul)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    runs = {"numpy": lambda: a @ b, "jax": lambda: jax.block_until_ready(jdot(ja, jb)), "torch": lambda: ta @ tb}
    out = {}
    for name, fn in runs.items():
        fn()  # warm-up (and jax's compile)
        out[name] = 2.0 * n ** 3 / best_of(fn, repeats)[0] / 1e9
    return out


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), float(np.median(times))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_flags(ap)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--matmul", type=int, default=2048, help="size of the peak matmul (n x n x n)")
    args = ap.parse_args(argv)

    import jax
    import torch
    from transformers import AutoModelForCausalLM

    import mia.models as mm
    from mia.engine.loop import jitted_token_stats
    from mia.flops import forward_flops_per_token

    with tempfile.TemporaryDirectory() as d:
        save_random_gpt_neox(d, hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab)
        ref = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").float().eval()
        ours = mm.load(d)

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.length)).astype(np.int64)
    mask = np.ones_like(tokens)
    mask[-max(1, args.batch // 4):, args.length // 2:] = 0  # some right padding, identical on both sides
    real_tokens = int(mask.sum())

    peak = matmul_peak(args.matmul, args.repeats)
    best_peak = max(peak.values())
    j_tokens, j_mask = jax.device_put(tokens.astype(np.int32)), jax.device_put(mask.astype(bool))
    t_tokens, t_mask = torch.tensor(tokens), torch.tensor(mask)
    rows, compile_s = [], {}
    for label, stats in (("every statistic", None), ("log-prob alone", ("logprob",))):
        fn = jitted_token_stats(ours) if stats is None else jitted_token_stats(ours, None, stats)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(ours.params, j_tokens, j_mask))
        compile_s[label] = time.perf_counter() - t0
        rows.append((f"mia (jit), {label}", best_of(lambda: jax.block_until_ready(fn(ours.params, j_tokens, j_mask)),
                                                    args.repeats)))
        torch_fn = torch_stats if stats is None else torch_logprob
        torch_fn(ref, t_tokens, t_mask)  # warm-up
        rows.append((f"transformers eager, {label}", best_of(lambda: torch_fn(ref, t_tokens, t_mask), args.repeats)))

    a = np.asarray(jitted_token_stats(ours)(ours.params, j_tokens, j_mask)["logprob"])
    b = torch_stats(ref, t_tokens, t_mask)[0].numpy()
    c = torch_logprob(ref, t_tokens, t_mask).numpy()
    m = (mask[:, 1:] * mask[:, :-1]).astype(bool)
    diff = float(max(np.abs(a - b)[m].max(), np.abs(a - c)[m].max()))
    flops_tok = forward_flops_per_token(args.hidden, args.layers, 4 * args.hidden, args.vocab, args.length)

    print(f"token stats, GPT-NeoX hidden={args.hidden} layers={args.layers} heads={args.heads} vocab={args.vocab}, "
          f"batch {args.batch} x {args.length} ({real_tokens} real tokens), {torch.get_num_threads()} torch threads, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")
    print(f"float32 matmul peak, {args.matmul}^3, same run: " + ", ".join(f"{k} {v:.1f}" for k, v in peak.items())
          + f" GFLOP/s; peak = {best_peak:.1f}")
    print(f"model FLOPs per token (2N + 4LTD): {flops_tok / 1e6:.1f} M")
    print(f"{'engine':<44} {'best s':>8} {'median s':>9} {'tokens/s':>10} {'GFLOP/s':>8} {'of peak':>8}")
    for name, (best, med) in rows:
        rate = real_tokens / best
        print(f"{name:<44} {best:8.3f} {med:9.3f} {rate:10.0f} {rate * flops_tok / 1e9:8.1f} "
              f"{rate * flops_tok / 1e9 / best_peak:8.1%}")
    for i in (0, 2):
        ratio = rows[i + 1][1][0] / rows[i][1][0]
        print(f"speed-up, {rows[i][0].split(', ')[1]} (torch best / mia best): {ratio:.2f}x")
    print(f"mia: log-prob alone vs every statistic: {rows[0][1][0] / rows[2][1][0]:.2f}x faster   "
          f"(compile once: " + ", ".join(f"{k} {v:.1f}s" for k, v in compile_s.items()) + ")")
    print(f"max |logprob difference| on real tokens: {diff:.2e}")


if __name__ == "__main__":
    main()
