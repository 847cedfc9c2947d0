"""Where the token-stats step's time goes on this machine: the step whole, cut into parts, and XLA's matmul alone.

    [XLA_FLAGS=...] python -m experiments.profile_token_stats [--part matmul,step,parts] [--chunks 16,64]
        [--hidden 512 --layers 6 --heads 8 --vocab 50304 --batch 8 --length 512]

One process measures one setting of ``XLA_FLAGS`` (XLA reads it once, at start): run it once per option to compare
XLA:CPU's dot libraries (e.g. ``--xla_cpu_experimental_xnn_fusion_type=dot``). Defaults: a Pythia-70m-shaped random
GPT-NeoX, batch 8 x 512 with the last quarter of rows half padded (as ``bench_scoring``). Best of ``--repeats`` after
a compile call, float32. Prints one line per figure:

  matmul  GFLOP/s of XLA's dot (``precision="highest"``) and of numpy at the model's shapes: 2048³, the MLP's up and
          down projections and QKV over batch x length rows, the LM head over 512 rows (one 128 MiB chunk at the
          default shape)
  step    seconds of the whole token-stats step (``jitted_token_stats``), every statistic and the log-prob alone, at
          each of ``--chunks`` positions per logits chunk (0: the engine's own choice, ``chunk_size``)
  parts   seconds of the body alone (``Model.hidden``), and of the LM head + log-prob (every ``--chunks``) or + every
          statistic (the engine's chunk) on the body's output
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from experiments.random_models import add_shape_flags, save_random_gpt_neox

PARTS = ("matmul", "step", "parts")


def best_seconds(fn, repeats: int) -> float:
    """Best wall time of ``fn()`` over ``repeats`` calls, after one untimed call (the compile)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_rates(shapes: dict, repeats: int) -> dict:
    """{name: (XLA GFLOP/s, numpy GFLOP/s)} of an [M, K] x [K, N] float32 product for each (M, K, N)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    dot = jax.jit(lambda a, b: jnp.dot(a, b, precision="highest"))
    out = {}
    for name, (m, k, n) in shapes.items():
        a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        flop = 2.0 * m * k * n
        out[name] = (flop / best_seconds(lambda: jax.block_until_ready(dot(ja, jb)), repeats) / 1e9,
                     flop / best_seconds(lambda: a @ b, repeats) / 1e9)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_flags(ap)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--part", default=",".join(PARTS), help="comma list of: " + ", ".join(PARTS))
    ap.add_argument("--chunks", default="0,16,64", help="positions per logits chunk to time (0: the engine's choice)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    parts = set(filter(None, args.part.split(",")))
    if parts - set(PARTS):
        ap.error(f"--part: unknown {sorted(parts - set(PARTS))}; choose from {', '.join(PARTS)}")
    chunks = [int(c) for c in args.chunks.split(",")]

    import jax

    import mia.models as mm
    from mia.engine import stats as st
    from mia.engine.loop import jitted_token_stats

    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; jax {jax.__version__} on {jax.devices()[0].platform}; "
          f"GPT-NeoX hidden={args.hidden} layers={args.layers} vocab={args.vocab}, batch {args.batch} x {args.length}")
    rows = args.batch * args.length
    default_chunk = st.chunk_size(args.batch, args.length - 1, args.vocab)
    if "matmul" in parts:
        d = args.hidden
        shapes = {"2048^3": (2048, 2048, 2048), "mlp_up": (rows, d, 4 * d), "mlp_down": (rows, 4 * d, d),
                  "qkv": (rows, d, 3 * d), "lm_head": (min(rows, 512), d, args.vocab)}
        for name, (xla, npy) in matmul_rates(shapes, args.repeats).items():
            print(f"matmul {name:<10} {'x'.join(map(str, shapes[name])):>18}  XLA {xla:7.1f}  numpy {npy:7.1f} GFLOP/s")
    if not parts & {"step", "parts"}:
        return
    with tempfile.TemporaryDirectory() as d:
        save_random_gpt_neox(d, hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab)
        model = mm.load(d)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.length)).astype(np.int32)
    valid = np.ones_like(tokens, bool)
    valid[-max(1, args.batch // 4):, args.length // 2:] = False
    tokens, valid, p = jax.device_put(tokens), jax.device_put(valid), model.params
    if "step" in parts:
        for c in chunks:
            for label, stats in (("every statistic", st.STAT_NAMES), ("log-prob alone", ("logprob",))):
                fn = jitted_token_stats(model, c or None, stats)
                s = best_seconds(lambda: jax.block_until_ready(fn(p, tokens, valid)), args.repeats)
                print(f"step  chunk {c or default_chunk:>4}  {label:<16} {s:7.3f} s")
    if "parts" in parts:
        inputs, fed, targets, _ = st.next_token_inputs(tokens, valid)
        body = jax.jit(lambda p, i, f: model.hidden(p, i, f)[0])
        s = best_seconds(lambda: jax.block_until_ready(body(p, inputs, fed)), args.repeats)
        print(f"parts body {'':>22} {s:7.3f} s")
        h = body(p, inputs, fed)
        for c in [c or default_chunk for c in chunks]:
            head = jax.jit(lambda p, h, t, c=c: st.logprob_from_hidden(model.unembed, p, h, t, c))
            s = best_seconds(lambda: jax.block_until_ready(head(p, h, targets)), args.repeats)
            print(f"parts LM head + log-prob, chunk {c:>4} {s:7.3f} s")
        every = jax.jit(lambda p, h, t: st.stats_from_hidden(model.unembed, p, h, t, default_chunk))
        s = best_seconds(lambda: jax.block_until_ready(every(p, h, targets)), args.repeats)
        print(f"parts LM head + every statistic, chunk {default_chunk:>4} {s:7.3f} s")


if __name__ == "__main__":
    main()
