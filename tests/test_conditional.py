"""Cached-prefix conditional log-likelihood (mia.engine.conditional) against transformers' PyTorch implementation.

The checkpoint is a tiny random GPT-NeoX built, initialised and saved by transformers (torch, float32, seeded) and
loaded by mia; the reference is the obviously-correct loop: torch logits of the concatenation [p ; x] in one pass,
float64 log-softmax, the log-probs of x's tokens. Nothing in the reference comes from mia's Flax model.
"""
import chex
import jax
import numpy as np
import pytest

import mia.engine.conditional as C
import mia.models as mm
from mia.engine.batching import ScoringSettings

VOCAB = 97
RTOL = 1e-4  # float32 model, float64 reference: relative error of a (mean) token log-prob
ATOL = 1e-6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(mia model, transformers model) of one tiny GPT-NeoX checkpoint (partial rotary with an odd rotary width)."""
    from transformers import GPTNeoXConfig

    from hf_tiny import save_tiny

    path = tmp_path_factory.mktemp("cond_neox")
    ref = save_tiny(GPTNeoXConfig(vocab_size=VOCAB, hidden_size=40, num_hidden_layers=2, num_attention_heads=5,
                                  intermediate_size=56, rotary_pct=0.4, max_position_embeddings=128,
                                  tie_word_embeddings=False), path, seed=3)
    return mm.load(path), ref


@pytest.fixture(scope="module")
def model(checkpoint):
    return checkpoint[0]


def seqs(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).astype(np.int32) for n in lengths]


def torch_target_logprobs(ref, prefix, target) -> np.ndarray:
    """[len(target)] log p(x_j | p, x_<j) from one torch pass over [p ; x]: position i - 1 predicts token i."""
    import torch

    seq = np.concatenate([prefix, target]).astype(np.int64)
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor(seq)[None]).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1).numpy()
    return np.array([lp[i - 1, seq[i]] for i in range(len(prefix), len(seq))])


def torch_cond_ll(ref, prefix, target, include_first):
    """LL(x | p): mean over x's counted tokens (all of them, or all but the first)."""
    lp = torch_target_logprobs(ref, prefix, target)
    return lp.mean() if include_first else lp[1:].mean()


SETTINGS = ScoringSettings(progress=False, min_bucket=32)  # few shapes: compiling dominates on a small CPU


@pytest.mark.parametrize("include_first", [True, False])
def test_matrix_matches_torch_concatenation(checkpoint, include_first):
    """Prefixes of 1..31 tokens, targets of 2..30 (padded to one bucket), batched: LL[p, x] = the torch loop."""
    model, ref = checkpoint
    prefixes = seqs([5, 17, 1, 9, 31], 0)
    targets = seqs([2, 7, 30, 12, 3, 16, 17], 1)
    got = C.loglik_matrix(model, prefixes, targets, include_first=include_first, settings=SETTINGS)
    want = np.array([[torch_cond_ll(ref, p, x, include_first) for x in targets] for p in prefixes])
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    plain = C.plain_loglik_matrix(model, prefixes, targets, include_first=include_first, settings=SETTINGS)
    np.testing.assert_allclose(plain, want, rtol=RTOL, atol=ATOL)
    # the prefix matters (otherwise this test would not test the cache)
    assert np.ptp(got, axis=0).max() > 1e-2


@pytest.mark.parametrize("include_first", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_pure_left_padded_prefix_batch(checkpoint, include_first):
    """The pure functions on a left-padded prefix batch and right-padded targets: every counted per-token log-prob
    equals torch's, and padding is never counted (``conditional_loglik``, their mean, runs in the matrix tests)."""
    model, ref = checkpoint
    prefixes, targets = seqs([3, 11, 6], 2), seqs([9, 4, 12], 3)
    s, t = 32, 32
    ptok, pval = np.zeros((3, s), np.int32), np.zeros((3, s), bool)
    ttok, tval = np.zeros((3, t), np.int32), np.zeros((3, t), bool)
    for r, (p, x) in enumerate(zip(prefixes, targets)):
        ptok[r, s - len(p):], pval[r, s - len(p):] = p, True
        ttok[r, :len(x)], tval[r, :len(x)] = x, True
    prefix = jax.jit(lambda p, t, v: C.prefix_cache(model, p, t, v))
    per_token = jax.jit(lambda p, c, t, v: C.conditional_logprobs(model, p, c, t, v, include_first=include_first))

    def check(cache, prefix_of_row):
        lp, mask = (np.asarray(a) for a in per_token(model.params, cache, ttok, tval))
        for r, x in enumerate(targets):
            counted = np.zeros(t, bool)
            counted[0 if include_first else 1:len(x)] = True
            np.testing.assert_array_equal(mask[r], counted)
            want = torch_target_logprobs(ref, prefix_of_row[r], x)[counted[:len(x)]]
            np.testing.assert_allclose(lp[r, counted], want, rtol=RTOL, atol=ATOL)

    check(prefix(model.params, ptok, pval), prefixes)
    # a batch-1 cache broadcasts over the targets
    check(prefix(model.params, prefixes[1][None], np.ones((1, len(prefixes[1])), bool)), [prefixes[1]] * 3)


def test_batching_does_not_change_values(model):
    prefixes, targets = seqs([4, 20, 9, 2], 4), seqs([5, 31, 8, 14, 2, 6], 5)
    a = C.loglik_matrix(model, prefixes, targets, include_first=True, settings=SETTINGS)
    b = C.loglik_matrix(model, prefixes, targets, include_first=True,
                        settings=ScoringSettings(progress=False, token_budget=64, min_bucket=32))
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_bucketed_shapes_compile_once(model, monkeypatch):
    monkeypatch.setattr(C, "_TRACE_WRAP", lambda f: chex.assert_max_traces(f, n=1))
    for fn in (C.jitted_prefix, C.jitted_conditional):
        fn.cache_clear()
    try:
        # every length is in the 32-bucket, 2 prefixes and 4 targets: one shape each, whatever the lengths
        for seed in range(3):
            rng = np.random.default_rng(seed)
            prefixes = seqs(rng.integers(2, 16, 2), seed)
            targets = seqs(rng.integers(2, 16, 4), seed + 10)
            C.loglik_matrix(model, prefixes, targets, include_first=False, settings=SETTINGS)
    finally:
        for fn in (C.jitted_prefix, C.jitted_conditional):
            fn.cache_clear()
        chex.clear_trace_counter()


def test_disk_cache_makes_no_model_call(model, tmp_path, monkeypatch):
    prefixes, targets = seqs([6, 3], 6), seqs([5, 9, 4], 7)
    settings = ScoringSettings(progress=False, min_bucket=32, cache_dir=str(tmp_path))
    a = C.loglik_matrix(model, prefixes, targets, include_first=False, settings=settings)
    assert list(tmp_path.glob("condll-*/part-*.npz"))

    def boom(*a, **k):
        raise AssertionError("model called although every pair is cached")

    monkeypatch.setattr(C, "jitted_prefix", boom)
    monkeypatch.setattr(C, "jitted_conditional", boom)
    b = C.loglik_matrix(model, prefixes[::-1], targets, include_first=False, settings=settings)
    np.testing.assert_array_equal(a[::-1], b)
    # the include_first setting is part of the key
    with pytest.raises(AssertionError, match="model called"):
        C.loglik_matrix(model, prefixes, targets, include_first=True, settings=settings)


def test_short_target_refused(model):
    with pytest.raises(ValueError, match="target 0 has 1 token"):
        C.loglik_matrix(model, seqs([3], 0), seqs([1], 1), include_first=False, settings=SETTINGS)
