"""Do the attention kernels agree in bf16? Per-token log-probs of one model under each kernel, side by side.

    python -m experiments.bench_kernels --model DIR [--dtype bfloat16] [--rows 64 --length 512]
    python -m experiments.bench_kernels --testbed DIR [--steps 100] [--block 32]

Each kernel (``exact``, ``blocked``, ``xla``: cuDNN flash attention on a CUDA GPU, jax's own elsewhere; ``splash``
with ``--kernels exact,blocked,splash`` on a TPU) runs in a
fresh process with ``MIA_ATTENTION`` set (the kernel is chosen when a function is traced), on the same rows: the
first ``--rows`` rows of the testbed's data order cut to ``--length`` tokens, or random tokens for ``--model``. A
float32 exact run is the reference. Printed: max and mean |Δ log p| per target token for every pair.
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

KERNELS = ("exact", "blocked", "xla")


def rows_of(args) -> np.ndarray:
    """[rows, length] int32 token ids: the testbed's first rows, or seeded random ids below the model's vocab."""
    if args.testbed:
        from mia.testbed import open_testbed as open_built_testbed  # heavy import only where used

        data = open_built_testbed(args.testbed).dataset()
        return np.stack([np.asarray(data[i], np.int32)[: args.length] for i in range(args.rows)])
    from mia.models.hub import load_config

    _, cfg, _ = load_config(args.model)
    return np.random.default_rng(0).integers(0, cfg.vocab_size, (args.rows, args.length), dtype=np.int32)


def model_dir(args) -> str:
    if args.model:
        return args.model
    from mia.testbed import open_testbed as open_built_testbed

    tb = open_built_testbed(args.testbed)
    return str(tb.checkpoint_dir(args.steps or tb.train_steps))


def one_kernel(path: str, tokens_file: str, dtype: str, out_file: str, block: str) -> None:
    """Child process: per-token log-probs [rows, length - 1] of the model at ``path`` (MIA_ATTENTION already set;
    ``block``: the blocked kernel's query/key block size)."""
    import mia
    from mia.engine.batching import ScoringSettings
    from mia.engine.loop import compute_token_stats
    from mia.models import attention

    attention.BLOCK_Q = attention.BLOCK_K = int(block)

    tokens = np.load(tokens_file)
    model = mia.load(path, dtype=dtype, tokenizer=False)
    stats = compute_token_stats(model, list(tokens), ScoringSettings(progress=False, cache_dir=None))
    np.save(out_file, np.stack([np.asarray(s["logprob"], np.float64) for s in stats]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--testbed", help="built testbed directory")
    ap.add_argument("--steps", type=int, default=None, help="testbed checkpoint (default: the last)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--block", type=int, default=256, help="the blocked kernel's block size (smaller: more blocks "
                                                            "on short rows)")
    ap.add_argument("--kernels", default=",".join(KERNELS),
                    help="comma-separated kernels to compare (default: %(default)s; on a TPU add splash; off a TPU "
                         "splash runs in Pallas interpret mode, very slowly)")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        one_kernel(*args.child)
        return 0
    path = model_dir(args)
    with tempfile.TemporaryDirectory() as tmp:
        tokens_file = str(Path(tmp) / "tokens.npy")
        np.save(tokens_file, rows_of(args))
        kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
        runs = [("float32 exact", "exact", "float32")] + [(f"{args.dtype} {k}", k, args.dtype) for k in kernels]
        out = {}
        for name, kernel, dtype in runs:
            f = str(Path(tmp) / f"{name.replace(' ', '_')}.npy")
            env = dict(os.environ, MIA_ATTENTION=kernel)
            cmd = [sys.executable, "-m", "experiments.bench_kernels", "--model", path, "--child", path, tokens_file,
                   dtype, f, str(args.block)]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode:
                print(f"{name}: failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
                continue
            out[name] = np.load(f)
    import jax

    print(f"{path}: {args.rows} rows x {args.length} tokens on {jax.devices()[0].device_kind}")
    print(f"{'a':>18s} {'b':>18s} {'max |dlogp|':>12s} {'mean |dlogp|':>13s}")
    for a, b in itertools.combinations(out, 2):
        d = np.abs(out[a] - out[b])
        print(f"{a:>18s} {b:>18s} {d.max():12.3e} {d.mean():13.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
