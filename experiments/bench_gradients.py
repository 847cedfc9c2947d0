"""Benchmark: the gradient attacks (gradnorm, alora) in mia against pandora's way, a PyTorch loop at batch 1.

    python -m experiments.bench_gradients [--hidden 512 --layers 6 --heads 8 --vocab 50304 --texts 64 --length 512]

One random GPT-NeoX (Pythia-70m-shaped by default) is made by transformers, saved, and loaded by mia, so both sides
have the same weights. Over ``--texts`` random texts of ``--length`` tokens:

  mia    the registered attacks (``get("gradnorm").fn``, ``get("alora").fn``) on an ``AttackContext``: per-example
         gradients under vmap, ``--chunk`` rows at a time, one jitted program per batch shape
  torch  pandora_llm's loop: per text, zero_grad, forward with labels, backward, then gradnorm's per-tensor norms
         (p = 1, 2, inf) of every ``named_parameters()`` gradient, or alora's in-place SGD step, second forward
         and restore (float32, eval mode, no ``model.half()``)

Times are steady state: each side runs once to warm up (mia compiles), then once timed. The scores of both sides
are compared (relative tolerance ``--rtol``) before anything is printed, so a fast wrong answer cannot pass.
"""
from __future__ import annotations

import argparse
import resource
import tempfile
import time

import numpy as np

from experiments.random_models import add_shape_flags, save_random_gpt_neox


def torch_gradnorm(model, seqs) -> np.ndarray:
    """[N] -||g||_2 of the whole gradient, pandora's per-example loop (the three per-tensor norms computed too)."""
    import torch

    out = []
    for s in seqs:
        ids = torch.tensor(s, dtype=torch.long)[None]
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        per = torch.stack([torch.stack([torch.linalg.vector_norm(p.grad.flatten(), o) for o in (1, 2, float("inf"))])
                           for p in model.parameters()])
        out.append(-float(torch.linalg.vector_norm(per[:, 1], 2)))
    model.zero_grad()
    return np.array(out)


def torch_alora(model, seqs, lr: float) -> np.ndarray:
    """[N] loss after one SGD step on the text minus the loss before, pandora's ALoRa loop."""
    import torch

    out = []
    for s in seqs:
        ids = torch.tensor(s, dtype=torch.long)[None]
        model.zero_grad()
        base = model(input_ids=ids, labels=ids).loss
        base.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-lr)
            stepped = model(input_ids=ids, labels=ids).loss
            for p in model.parameters():
                p.add_(p.grad, alpha=lr)
        out.append(float(stepped) - float(base.detach()))
    model.zero_grad()
    return np.array(out)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_flags(ap)
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--length", type=int, default=512, help="tokens per text")
    ap.add_argument("--chunk", type=int, default=4, help="rows per vmapped chunk of per-example gradients")
    ap.add_argument("--lr", type=float, default=1e-4, help="alora's step size")
    ap.add_argument("--rtol", type=float, default=1e-3, help="agreement required between the two sides' scores")
    ap.add_argument("--atol", type=float, default=1e-5,
                    help="absolute agreement too: alora is a difference of two float32 losses of about ln(vocab), "
                         "so each side rounds it by ~1e-6")
    args = ap.parse_args(argv)

    import jax
    import torch

    import mia.models as mm
    from mia.attacks import AttackContext, get
    from mia.data.examples import Example
    from mia.engine.batching import ScoringSettings

    with tempfile.TemporaryDirectory() as tmp:
        hf = save_random_gpt_neox(tmp, hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab)
        model = mm.load(tmp)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, args.vocab, args.length).astype(np.int64) for _ in range(args.texts)]
    examples = [Example(f"x{i}", s.astype(np.int32)) for i, s in enumerate(seqs)]
    settings = ScoringSettings(progress=False)

    def ours(name, **params):
        ctx = AttackContext(model, examples, settings, {}, {"seed": 0})  # fresh: no memoized features
        return np.asarray(get(name).fn(ctx, **params))

    rows = []
    for name, params, reference in (
            ("gradnorm", dict(p="2", chunk=args.chunk), lambda: torch_gradnorm(hf, seqs)),
            ("alora", dict(lr=args.lr, chunk=args.chunk), lambda: torch_alora(hf, seqs, args.lr))):
        first, _ = timed(lambda: ours(name, **params))
        t_mia, got = timed(lambda: ours(name, **params))
        reference_fn = torch_gradnorm if name == "gradnorm" else (lambda m, s: torch_alora(m, s, args.lr))
        reference_fn(hf, seqs[:1])  # torch warm-up
        t_torch, want = timed(reference)
        np.testing.assert_allclose(got, want, rtol=args.rtol, atol=args.atol, err_msg=f"{name}: mia and torch disagree")
        rows.append((name, t_mia, t_torch, first))

    shape = f"{args.texts} texts x {args.length} tokens, GPT-NeoX hidden {args.hidden}, {args.layers} layers, " \
            f"{args.heads} heads, vocab {args.vocab}"
    print(f"bench_gradients: {shape}; mia chunk {args.chunk}; jax {jax.__version__} on "
          f"{jax.devices()[0].device_kind}, torch {torch.__version__} ({torch.get_num_threads()} threads)")
    print("| attack | mia (s) | torch loop at batch 1 (s) | speed-up | mia first call, compile included (s) |")
    print("|---|---:|---:|---:|---:|")
    for name, t_mia, t_torch, first in rows:
        print(f"| {name} | {t_mia:.2f} | {t_torch:.2f} | {t_torch / t_mia:.2f}x | {first:.1f} |")
    print(f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
