"""Benchmark: model-querying attacks against their plain baselines, side by side, on one random GPT-NeoX.

    python -m experiments.bench_attacks [--hidden 256 --layers 4 --heads 4 --vocab 8192 --length 128]

1. ReCaLL, a 12-shot prefix (12 x length tokens) over 64 targets: the prefix's KV cache computed once and every
   target attending to it (``mia.engine.conditional.loglik_matrix``) vs one plain pass over [prefix ; target] per target
   (exact, unpadded length: the plain side gets no bucketing waste). Goal >= 4x.
2. The EM-MIA matrix LL(x | p) for 64 texts (64 x 64 pairs): cached prefixes vs plain concatenation.
2b. Con-ReCaLL: a 12-shot non-member AND a 12-shot member prefix over the same 64 targets (the registered attack's
   two conditional passes, each prefix's KV cache computed once) vs the official code's plain pass over
   [prefix ; target] per target and prefix (2 x 64 passes).
3. MoPe n = 10 (``make_mope``: vmapped chunks of perturbed copies under lax.map) vs 11 plain scoring passes of
   the same batches (the minimum any implementation must run). Goal within 1.15x.
4. Generation (SaMIA's sampling): ``mia.engine.generate`` (one jitted while-loop over a fixed KV-cache buffer) vs
   transformers' ``generate(do_sample=True, top_k=50)`` in PyTorch on the SAME weights (saved by transformers and
   loaded by mia), ``--gen-prompts`` prompts x ``--gen-samples`` samples of ``--gen-new`` new tokens after a
   ``--length``/2-token prompt, no EOS stop; tokens/s, one timed run each after a warm-up.
5. lowercase (one re-tokenized variant per text) and PAC n = 10 (swapped copies; ``augment=tokens`` since the random
   model has no tokenizer): the variants through the shared engine (``compute_token_stats``: length-bucketed batches)
   vs the reference repositories' loop, one unpadded pass per text at its own length (zhang-wei-chao/DC-PDD
   ``com_pro_dis.py`` scores the lowercased text that way, yyy01/PAC ``src/prob.py`` every augmented copy).

Times are steady state (a warm-up call compiles every shape first). Peak memory
is XLA's compiled-program estimate for the largest call of each side (arguments + outputs + temporaries); the
process max RSS is printed at the end. A Pythia-70m-shaped model (hidden 512, 6 layers, vocab 50304) is too slow for
a 2-core CPU, so the default is a smaller random GPT-NeoX; the table says which.
"""
from __future__ import annotations

import argparse
import resource
import time

import numpy as np

from mia import validate as V


def compiled_bytes(jitted, *args) -> int:
    """XLA's memory estimate for one call: arguments + outputs + temporaries - aliased."""
    m = jitted.lower(*args).compile().memory_analysis()
    if m is None:
        return -1
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def mib(b: int) -> str:
    return "n/a" if b < 0 else f"{b / 2**20:,.0f} MiB"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--length", type=int, default=128, help="tokens per text (targets, shots, EM texts)")
    ap.add_argument("--targets", type=int, default=64)
    ap.add_argument("--shots", type=int, default=12)
    ap.add_argument("--em-texts", type=int, default=64)
    ap.add_argument("--mope-n", type=int, default=10)
    ap.add_argument("--mope-chunk", type=int, default=2)
    ap.add_argument("--batch-tokens", dest="token_budget", type=int, default=16384,
                    help="token budget per batch (mia score's --batch-tokens)")
    V.add_renamed_flag(ap, "--token-budget", "--batch-tokens")
    ap.add_argument("--gen-prompts", type=int, default=8)
    ap.add_argument("--gen-samples", type=int, default=4, help="samples per prompt (SaMIA's n)")
    ap.add_argument("--gen-new", type=int, default=64, help="new tokens per sample")
    ap.add_argument("--pac-n", type=int, default=10)
    ap.add_argument("--skip", default="",
                    help="comma list of parts to skip: recall,conrecall,em,mope,generate,variants")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    import jax

    import mia.models as mm
    from mia.attacks.mope import jitted_mope
    from mia.engine.conditional import jitted_conditional, jitted_token_logprobs, jitted_prefix, loglik_matrix
    from mia.models.gpt_neox import GPTNeoXConfig
    from mia.engine.batching import ScoringSettings

    cfg = GPTNeoXConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                        max_position_embeddings=2048, rotary_pct=0.25)
    model = mm.from_config(cfg, key=jax.random.PRNGKey(0))
    params = model.params
    settings = ScoringSettings(token_budget=args.token_budget, progress=False)
    rng = np.random.default_rng(0)
    texts = lambda n: [rng.integers(1, args.vocab, args.length).astype(np.int32) for _ in range(n)]  # noqa: E731
    plain_fn = jitted_token_logprobs(model)
    rows_plain = lambda length: max(1, min(settings.max_batch, args.token_budget // length))  # noqa: E731

    def plain_pairs(prefixes, targets, pairs, include_first):
        """Plain path at the exact concatenated length (all texts have the same length): [P, X] LL matrix."""
        out = np.full((len(prefixes), len(targets)), np.nan, np.float32)
        length = len(prefixes[0]) + len(targets[0])
        rows = min(rows_plain(length), len(pairs))
        start = len(prefixes[0]) + (0 if include_first else 1)
        for lo in range(0, len(pairs), rows):
            chunk = pairs[lo:lo + rows]
            tok = np.zeros((rows, length), np.int32)
            for r, (i, j) in enumerate(chunk):
                tok[r] = np.concatenate([prefixes[i], targets[j]])
            lp = np.asarray(plain_fn(params, tok, np.ones_like(tok, bool)))
            for r, (i, j) in enumerate(chunk):
                out[i, j] = lp[r, start - 1:].mean()
        return out, rows, length

    results = []
    mem = []

    # ---------------------------------------------------------------- 1. ReCaLL
    if "recall" not in skip:
        shots, targets = texts(args.shots), texts(args.targets)
        prefix = np.concatenate(shots)
        pairs = [(0, j) for j in range(len(targets))]
        run_c = lambda: loglik_matrix(model, [prefix], targets, include_first=True, settings=settings)  # noqa: E731
        run_c()  # warm-up: compiles every shape
        tc, a = timed(run_c)
        plain_pairs([prefix], targets, pairs[:rows_plain(len(prefix) + args.length)], True)  # warm-up: one batch
        tp, (b, rows, length) = timed(lambda: plain_pairs([prefix], targets, pairs, True))
        results.append((f"ReCaLL {args.shots}-shot ({len(prefix)}-token prefix), {args.targets} targets",
                        tc, tp, float(np.nanmax(np.abs(a - b)))))
        plen = 1 << (len(prefix) - 1).bit_length()
        group = jitted_prefix(model)(params, prefix[None], np.ones((1, len(prefix)), bool))
        gp = np.zeros((1, plen), np.int32)
        trows = min(settings.max_batch, args.token_budget // args.length, 2 * args.token_budget // (plen + args.length))
        trows = min(1 << (trows.bit_length() - 1), 1 << (len(targets) - 1).bit_length())
        tt = np.zeros((trows, args.length), np.int32)
        mem.append(("ReCaLL cached: prefix pass", compiled_bytes(jitted_prefix(model), params, gp, gp.astype(bool))))
        mem.append((f"ReCaLL cached: {trows} targets x {args.length} vs cache {plen}",
                    compiled_bytes(jitted_conditional(model, True), params, group, np.int32(0), tt, tt.astype(bool))))
        tok = np.zeros((rows, length), np.int32)
        mem.append((f"ReCaLL plain: {rows} x {length}", compiled_bytes(plain_fn, params, tok, tok.astype(bool))))

    # ---------------------------------------------------------------- 2b. Con-ReCaLL (two prefixes)
    if "conrecall" not in skip:
        p_nm, p_m = np.concatenate(texts(args.shots)), np.concatenate(texts(args.shots))
        targets = texts(args.targets)
        pairs = [(i, j) for i in range(2) for j in range(len(targets))]

        def run_c():  # as mia.attacks.conrecall: one conditional pass per prefix
            return np.stack([loglik_matrix(model, [p], targets, include_first=True, settings=settings)[0]
                             for p in (p_nm, p_m)])

        run_c()
        tc, a = timed(run_c)
        plain_pairs([p_nm, p_m], targets, pairs[:rows_plain(len(p_nm) + args.length)], True)
        tp, (b, rows, length) = timed(lambda: plain_pairs([p_nm, p_m], targets, pairs, True))
        results.append((f"Con-ReCaLL 2 x {args.shots}-shot prefixes, {args.targets} targets", tc, tp,
                        float(np.nanmax(np.abs(a - b)))))

    # ---------------------------------------------------------------- 2. EM-MIA matrix
    if "em" not in skip:
        em = texts(args.em_texts)
        pairs = [(i, j) for i in range(len(em)) for j in range(len(em))]
        run_c = lambda: loglik_matrix(model, em, em, include_first=False, settings=settings)  # noqa: E731
        run_c()
        tc, a = timed(run_c)
        plain_pairs(em, em, pairs[:rows_plain(2 * args.length)], False)
        tp, (b, rows, length) = timed(lambda: plain_pairs(em, em, pairs, False))
        results.append((f"EM-MIA matrix {args.em_texts} x {args.em_texts} texts", tc, tp,
                        float(np.nanmax(np.abs(a - b)))))
        tok = np.zeros((rows, length), np.int32)
        mem.append((f"EM plain: {rows} x {length}", compiled_bytes(plain_fn, params, tok, tok.astype(bool))))

    # ---------------------------------------------------------------- 3. MoPe
    if "mope" not in skip:
        xs = texts(args.targets)
        n, chunk = args.mope_n, args.mope_chunk
        fn = jitted_mope(model, n, 0.005, chunk)
        key = jax.random.PRNGKey(0)
        # the registered attack's batching: token budget divided by the chunk size
        rows = max(1, (args.token_budget // chunk) // args.length)
        rows = min(1 << (rows.bit_length() - 1), 1 << (len(xs) - 1).bit_length())
        prow = min(1 << (rows_plain(args.length).bit_length() - 1), 1 << (len(xs) - 1).bit_length())

        def batches(r):
            for lo in range(0, len(xs), r):
                tok = np.zeros((r, args.length), np.int32)
                part = xs[lo:lo + r]
                tok[:len(part)] = part
                yield tok, np.arange(r) < len(part)

        def run_mope():
            return [np.asarray(fn(key, params, t, np.broadcast_to(v[:, None], t.shape))) for t, v in batches(rows)]

        def run_plain():
            out = []
            for t, v in batches(prow):
                for _ in range(n + 1):
                    out.append(np.asarray(plain_fn(params, t, np.broadcast_to(v[:, None], t.shape))))
            return out

        run_mope()
        tm, _ = timed(run_mope)
        run_plain()
        tp, _ = timed(run_plain)
        results.append((f"MoPe n={n} (chunk {chunk}) vs {n + 1} plain passes, {args.targets} texts", tm, tp,
                        float("nan")))
        t = np.zeros((rows, args.length), np.int32)
        mem.append((f"MoPe: {rows} x {args.length}, chunk {chunk}",
                    compiled_bytes(fn, key, params, t, t.astype(bool))))
        t = np.zeros((prow, args.length), np.int32)
        mem.append((f"plain pass: {prow} x {args.length}", compiled_bytes(plain_fn, params, t, t.astype(bool))))

    # ---------------------------------------------------------------- 4. generation
    gen_rows = []
    if "generate" not in skip:
        gen_rows.append(bench_generate(cfg, args))

    # ---------------------------------------------------------------- 5. lowercase and PAC text variants
    if "variants" not in skip:
        from mia.attacks.pac import augment_tokens
        from mia.engine.loop import compute_token_stats

        # texts of 8 lengths just under --length (variants differ in length from their originals)
        lens = args.length - rng.integers(0, 8, args.targets)
        xs = [rng.integers(1, args.vocab, int(n)).astype(np.int32) for n in lens]
        copies = [c for i, x in enumerate(xs)
                  for c in augment_tokens(x, n=args.pac_n, alpha=0.3, rng=np.random.default_rng(i))]

        def per_text(seqs):
            return [np.asarray(plain_fn(params, s[None], np.ones((1, len(s)), bool)))[0, :len(s) - 1] for s in seqs]

        for name, seqs in ((f"lowercase: {args.targets} variant texts, one engine pass", xs),
                           (f"PAC n={args.pac_n} (token swaps): {len(copies)} copies of {args.targets} texts",
                            copies)):
            # as the attacks call it (mia.attacks._texts.stats_or_none): the log-prob alone
            run_e = lambda: compute_token_stats(model, seqs, settings, stats=("logprob",))  # noqa: E731
            run_e()
            te, a = timed(run_e)
            per_text([next(s for s in seqs if len(s) == n) for n in sorted(set(map(len, seqs)))])  # compile each length
            tp, b = timed(lambda: per_text(seqs))
            results.append((name, te, tp, float(max(np.abs(x["logprob"] - y).max() for x, y in zip(a, b)))))

    n_params = sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(params))
    print(f"\nbench_attacks: random GPT-NeoX hidden={args.hidden} layers={args.layers} heads={args.heads} "
          f"vocab={args.vocab} ({n_params / 1e6:.1f}M params; smaller than Pythia-70m, which is too slow for this "
          f"CPU), {args.length}-token texts, token budget {args.token_budget}, jax {jax.__version__} on "
          f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind})")
    print(f"{'task (steady state, after a warm-up compile)':<62} {'ours s':>8} {'plain s':>8} {'plain/ours':>10} "
          f"{'max|LL diff|':>12}")
    for name, ours, plain, diff in results:
        print(f"{name:<62} {ours:8.2f} {plain:8.2f} {plain / ours:9.2f}x {diff:12.2e}")
    for name, ours, theirs, compile_s in gen_rows:
        print(f"\n{'generation (tokens/s, one timed run after a warm-up)':<62} {'mia':>8} {'HF torch':>8} "
              f"{'mia/HF':>10} "
              f"{'compile s':>12}")
        print(f"{name:<62} {ours:8.0f} {theirs:8.0f} {ours / theirs:9.2f}x {compile_s:12.1f}")
    print(f"\n{'compiled call (XLA memory estimate)':<62} {'peak':>10}")
    for name, b in mem:
        print(f"{name:<62} {mib(b):>10}")
    print(f"process max RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:,.0f} MiB")


def bench_generate(cfg, args) -> tuple:
    """(row name, mia tokens/s, transformers tokens/s, mia's first-call seconds) on one random GPT-NeoX saved by
    transformers and loaded by mia (the same weights on both sides)."""
    import tempfile

    import torch
    import transformers

    import mia.models as mm
    from mia.engine.generate import generate

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(transformers.GPTNeoXConfig(**cfg.to_hf())).float().eval()
        hf.save_pretrained(tmp, safe_serialization=True)
        model = mm.load(tmp)
    rng = np.random.default_rng(1)
    plen, new, n = max(1, args.length // 2), args.gen_new, args.gen_samples
    prompts = [rng.integers(1, args.vocab, plen).astype(np.int32) for _ in range(args.gen_prompts)]
    tokens = args.gen_prompts * n * new
    run_ours = lambda: generate(model, prompts, max_new=new, n=n, top_k=50, temperature=1.0, eos_ids=())  # noqa: E731
    first, _ = timed(run_ours)
    t_ours, out = timed(run_ours)
    assert all(len(s) == new for per in out for s in per)
    batch = torch.tensor(np.repeat(np.stack(prompts), n, axis=0), dtype=torch.long)

    def run_hf(rows):
        with torch.no_grad():
            return hf.generate(rows, attention_mask=torch.ones_like(rows), do_sample=True, top_k=50, temperature=1.0,
                               max_new_tokens=new, min_new_tokens=new, pad_token_id=0)

    run_hf(batch[:2])  # warm-up
    t_hf, g = timed(lambda: run_hf(batch))
    assert g.shape == (len(batch), plen + new)
    name = f"{args.gen_prompts} prompts x {n} samples x {new} new tokens ({plen}-token prompts)"
    return name, tokens / t_ours, tokens / t_hf, first


if __name__ == "__main__":
    main()
