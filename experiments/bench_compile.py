"""Benchmark: how XLA compile work grows with model depth, and what the persistent compilation cache saves.

    python -m experiments.bench_compile [--layers 2,12,24 --hidden 64 --batch 4 --length 128]

For a tiny-width random GPT-NeoX of each depth, lowers and compiles ``scoring.token_stats`` (the scoring engine's
jitted program) and prints the number of instructions in XLA's optimised HLO and the lower+compile seconds. With
stacked (scanned) layers the program does not grow with depth; a Python list of layers grows linearly.

Then (when ``mia.engine.compile_cache`` exists) it compiles the same program in two fresh processes sharing one new
cache
directory: the first writes the cache (cold), the second reads it (warm). Timings are single runs; say whether the
machine was shared when you quote them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

_INSTRUCTION = re.compile(r"^\s+(ROOT\s+)?%?[\w.\-]+\s*=\s")


def hlo_instruction_count(hlo_text: str) -> int:
    """Instructions in an HLO module's text: lines ``name = op(...)`` inside computations."""
    return sum(1 for line in hlo_text.splitlines() if _INSTRUCTION.match(line))


def tiny_neox(layers: int, hidden: int, vocab: int):
    import mia.models as mm
    from mia.models.gpt_neox import GPTNeoXConfig

    cfg = GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=4 * hidden, max_position_embeddings=2048)
    return mm.from_config(cfg)


def compile_token_stats(layers: int, hidden: int, vocab: int, batch: int, length: int) -> dict:
    """Lower + compile jit(token_stats) for one depth; returns seconds and the optimised HLO instruction count."""
    import numpy as np

    from mia.engine.loop import jitted_token_stats

    model = tiny_neox(layers, hidden, vocab)
    tokens = np.zeros((batch, length), np.int32)
    valid = np.ones((batch, length), bool)
    t0 = time.perf_counter()
    compiled = jitted_token_stats(model).lower(model.params, tokens, valid).compile()
    seconds = time.perf_counter() - t0
    return {"layers": layers, "compile_s": seconds, "hlo_instructions": hlo_instruction_count(compiled.as_text())}


def _child(args) -> None:
    """One fresh process: enable the persistent cache, compile once, print a JSON line."""
    from mia.engine.compile_cache import enable_compile_cache

    enable_compile_cache(args.cache_dir)
    out = compile_token_stats(args.child_layers, args.hidden, args.vocab, args.batch, args.length)
    print(json.dumps(out))


def cold_warm(args, layers: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for label in ("cold (empty cache)", "warm (cache filled)"):
            cmd = [
                sys.executable,
                "-m",
                "experiments.bench_compile",
                "--child-layers",
                str(layers),
                "--cache-dir",
                cache,
                "--hidden",
                str(args.hidden),
                "--vocab",
                str(args.vocab),
                "--batch",
                str(args.batch),
                "--length",
                str(args.length),
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy())
            rows.append({"run": label, **json.loads(out.stdout.strip().splitlines()[-1])})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,12,24", help="comma-separated depths")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--child-layers", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_layers is not None:
        return _child(args)

    depths = [int(x) for x in args.layers.split(",")]
    print(f"token_stats of a GPT-NeoX, hidden {args.hidden}, vocab {args.vocab}, batch {args.batch} x {args.length}")
    print("| layers | optimised HLO instructions | lower+compile s |")
    print("|---:|---:|---:|")
    compile_token_stats(1, args.hidden, args.vocab, args.batch, args.length)  # warm-up: backend start, tracing caches
    for n in depths:
        r = compile_token_stats(n, args.hidden, args.vocab, args.batch, args.length)
        print(f"| {n} | {r['hlo_instructions']} | {r['compile_s']:.2f} |", flush=True)
    try:
        import mia.engine.compile_cache  # noqa: F401
    except ImportError:
        print("\n(mia.engine.compile_cache not available: no cold/warm comparison)")
        return
    layers = max(depths)
    rows = cold_warm(args, layers)
    print(f"\npersistent compilation cache, {layers} layers, each run a fresh process:")
    print("| run | lower+compile s |")
    print("|---|---:|")
    for r in rows:
        print(f"| {r['run']} | {r['compile_s']:.2f} |")
    print(f"warm / cold: {rows[1]['compile_s'] / rows[0]['compile_s']:.2f}")


if __name__ == "__main__":
    main()
