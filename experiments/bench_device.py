"""Device check: token stats of a Pythia-1B-shaped random model in bf16, ours (jit) vs transformers PyTorch, same
device.

    python -m experiments.bench_device [--batch 8 --length 2048 --dtype bfloat16 --peak-tflops X]
    python -m experiments.bench_device --layers 2 --batch 1 --length 256      # a quick look on a CPU

Both sides hold the same weights (transformers initialises a random GPTNeoX, saves it as safetensors in the
requested dtype, and mia loads that directory), score the same right-padded batch on the same device (CUDA when
jax sees a GPU and torch was built with CUDA, else the CPU), and compute for every target token the log-prob and the
probability-weighted mean/std of log p and the entropy (what Min-K%++ needs), in float32 from the logits.
transformers runs its default attention (SDPA, flash on a GPU) under ``torch.no_grad``; mia runs the jitted engine.

Printed: tokens/second of each side, their ratio, and MFU = model FLOPs / (seconds x peak FLOPs of the device).
Model FLOPs per token (forward only, PaLM's convention): 2 N + 4 L T D, where N counts every matmul weight
(layers and LM head, not the input embedding gather), L layers, T the padded length, D the width. The peak is looked
up from the device kind (``mia.flops``: dense bf16 tensor-core or MXU numbers from the vendors' data sheets) or given
with ``--peak-tflops``; on a CPU it is unknown unless given, and MFU is printed as n/a.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from mia.flops import forward_flops_per_token, peak_tflops

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048, help="Pythia-1B: 2048")
    ap.add_argument("--layers", type=int, default=16, help="Pythia-1B: 16")
    ap.add_argument("--heads", type=int, default=8, help="Pythia-1B: 8")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=None, help="rows per call (default 8 on an accelerator, 1 on a CPU)")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s of the device (default: looked up)")
    args = ap.parse_args(argv)

    import jax
    import torch
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    import mia.models as mm
    from mia.engine.loop import jitted_token_stats

    from .bench_scoring import best_of, torch_stats

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu" and torch.cuda.is_available()
    tdev = torch.device("cuda" if on_gpu else "cpu")
    batch = args.batch or (8 if device.platform != "cpu" else 1)
    tdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                        max_position_embeddings=max(2048, args.length), rotary_pct=0.25)
    with tempfile.TemporaryDirectory() as d:
        AutoModelForCausalLM.from_config(cfg).to(tdtype).eval().save_pretrained(d)
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=tdtype).to(tdev).eval()
        ours = mm.load(d, dtype=args.dtype)

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (batch, args.length)).astype(np.int64)
    mask = np.ones_like(tokens)
    if batch > 1:
        mask[-max(1, batch // 4):, args.length // 2:] = 0  # some right padding, identical on both sides
    real_tokens = int(mask.sum())

    fn = jitted_token_stats(ours)
    j_tokens, j_mask = jax.device_put(tokens.astype(np.int32)), jax.device_put(mask.astype(bool))
    t0 = time.perf_counter()
    ours_out = jax.block_until_ready(fn(ours.params, j_tokens, j_mask))
    compile_s = time.perf_counter() - t0
    ours_best, ours_med = best_of(lambda: jax.block_until_ready(fn(ours.params, j_tokens, j_mask)), args.repeats)

    t_tokens, t_mask = torch.tensor(tokens, device=tdev), torch.tensor(mask, device=tdev)

    def run_torch():
        out = torch_stats(ref, t_tokens, t_mask)
        sync()
        return out

    theirs = run_torch()  # warm-up
    torch_best, torch_med = best_of(run_torch, args.repeats)

    m = (mask[:, 1:] * mask[:, :-1]).astype(bool)
    diff = np.abs(np.asarray(ours_out["logprob"]) - theirs[0].float().cpu().numpy())[m]
    flops = (
        forward_flops_per_token(args.hidden, args.layers, 4 * args.hidden, args.vocab, args.length)
        * batch
        * args.length
    )
    peak = args.peak_tflops or peak_tflops(device.device_kind)

    def mfu(seconds):
        return f"{100 * flops / seconds / (peak * 1e12):5.1f}%" if peak else "  n/a"

    print(f"token stats, GPT-NeoX hidden={args.hidden} layers={args.layers} heads={args.heads} vocab={args.vocab}, "
          f"{args.dtype}, batch {batch} x {args.length} ({real_tokens} real tokens)")
    print(f"device: {device.device_kind} ({device.platform}); torch on {tdev}; jax {jax.__version__}, torch "
          f"{torch.__version__}; peak {peak or 'unknown'} TFLOP/s; model FLOPs per call {flops / 1e9:.1f} G")
    print(f"{'engine':<40} {'best s':>8} {'median s':>9} {'tokens/s':>10} {'MFU':>6}")
    print(f"{'mia (jit)':<40} {ours_best:8.3f} {ours_med:9.3f} {real_tokens / ours_best:10.0f} {mfu(ours_best):>6}")
    print(f"{'transformers PyTorch (sdpa, no_grad)':<40} {torch_best:8.3f} {torch_med:9.3f} "
          f"{real_tokens / torch_best:10.0f} {mfu(torch_best):>6}")
    print(f"speed-up (torch best / mia best): {torch_best / ours_best:.2f}x   (mia compile once: {compile_s:.1f}s)")
    print(f"|logprob difference| on real tokens: median {np.median(diff):.2e}, max {diff.max():.2e} "
          f"({args.dtype} on both sides, so not a parity check)")


if __name__ == "__main__":
    main()
