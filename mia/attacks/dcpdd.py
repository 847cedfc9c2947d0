"""DC-PDD, divergence-based calibration (Zhang et al. 2024, "Pretraining Data Detection for Large Language Models: A
Divergence-based Calibration Method", EMNLP 2024; official code zhang-wei-chao/DC-PDD ``com_det_sco.py``).

Reference token frequencies from a local corpus (each document's first ``FREQ_MAX_TOKENS`` = 1024 target-tokenizer
ids counted, as ``com_fre_dis.py``), Laplace smoothed over the model's vocabulary of V ids:

  f_v = (count_v + 1) / (sum_u count_u + V)

For the targets t_2..t_T of x (the T-1 positions of the shared stats) with p_i = exp(l_i), keep the FIRST occurrence
of each token id, and

  ce_i = min(p_i * (-log f_{t_i}), a),      dcpdd(x) = mean over first occurrences of ce_i

with the cap a = 0.01 (the official default). Sign: the official code stores -mean(ce) and its ROC negates it
(member = larger mean); mimir's port returns -mean(ce) (lower = member). Ours is mean(ce): HIGHER = MEMBER.

The corpus: ``--freq-corpus FILE`` (``AttackContext.options["freq_corpus"]``, token-id arrays read at the CLI edge),
else the ``calib`` partition of non-members (disjoint from the evaluated examples). A corpus with no token, or whose
ids fall outside the vocabulary, or that shares no token with the evaluated examples, is refused (one line).
The log-probs come from the shared stats pass: no extra model call.

Definition and differences from the public code: docs/algorithms.md#dcpdd.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .recall import memo
from ..validate import Range
from ..engine.batching import pad_pow2
from .registry import AttackError, register

FREQ_MAX_TOKENS = 1024


def token_counts(docs: Sequence[np.ndarray], vocab_size: int, max_tokens: int = FREQ_MAX_TOKENS) -> np.ndarray:
    """[V] int64 occurrences of each id over the first ``max_tokens`` ids of every document; refuses ids >= V."""
    ids = np.concatenate([np.asarray(d, np.int64)[:max_tokens] for d in docs]) if docs else np.zeros(0, np.int64)
    outside = (ids < 0) | (ids >= vocab_size)
    if outside.all() and ids.size:
        raise AttackError(f"dcpdd: the frequency corpus shares no token with the model's vocabulary ({vocab_size} "
                          f"ids; e.g. id {int(ids[0])}): it was not tokenized with the target tokenizer")
    if outside.any():
        raise AttackError(f"dcpdd: the frequency corpus holds {int(outside.sum())} token id(s) outside the model's "
                          f"vocabulary ({vocab_size} ids), e.g. {int(ids[outside][0])}")
    if ids.size == 0:
        raise AttackError("dcpdd: the frequency corpus holds no token")
    return np.bincount(ids, minlength=vocab_size)


def smoothed_frequencies(counts_v: np.ndarray) -> np.ndarray:
    """[V] float64 Laplace-smoothed frequencies (count + 1) / (total + V)."""
    counts_v = np.asarray(counts_v, np.float64)
    return (counts_v + 1.0) / (counts_v.sum() + counts_v.size)


def first_occurrences(targets: np.ndarray) -> np.ndarray:
    """[T-1] bool: True where the id appears for the first time in ``targets``."""
    first = np.zeros(len(targets), bool)
    first[np.unique(targets, return_index=True)[1]] = True
    return first


@jax.jit
def dcpdd_scores(logprob_bl: jax.Array, neg_log_freq_bl: jax.Array, first_bl: jax.Array, cap: jax.Array) -> jax.Array:
    """[B, L] log-probs, -log f of each target, first-occurrence mask (padding False), scalar cap a ->
    [B] mean of min(p * (-log f), a) over first occurrences (higher = member)."""
    ce = jnp.minimum(jnp.exp(logprob_bl.astype(jnp.float32)) * neg_log_freq_bl, cap)
    n = jnp.sum(first_bl, axis=1)
    return jnp.sum(jnp.where(first_bl, ce, 0.0), axis=1) / jnp.maximum(n, 1).astype(jnp.float32)


def reference_counts(ctx) -> np.ndarray:
    """[V] token counts of --freq-corpus, else of the calib partition (memoised per run)."""
    m = memo(ctx)
    if "dcpdd_counts" not in m:
        docs = ctx.options.get("freq_corpus")
        if docs is None:
            docs = [e.tokens for e in ctx.partition("calib", 1, flag="--freq-corpus FILE or --calib-data")]
        m["dcpdd_counts"] = token_counts(docs, ctx.model.vocab_size)
    return m["dcpdd_counts"]


@register("dcpdd", needs=("stats", "freq"), stats=("logprob",), a=0.01, limits={"a": Range(0, lo_open=True)})
def _dcpdd(ctx, *, a: float) -> np.ndarray:
    """Mean over first occurrences of min(p(t) * -log f(t), a), f = corpus token frequency (higher = member).
    Zhang et al. 2024."""
    if not a > 0:
        raise AttackError(f"attack dcpdd: the cap a must be > 0, got {a}")
    counts = reference_counts(ctx)
    targets = [e.tokens[1:] for e in ctx.examples]
    if not counts[np.unique(np.concatenate(targets))].any():
        raise AttackError("dcpdd: the frequency corpus shares no token with the evaluated examples: every frequency "
                          "would be the smoothing floor (use a corpus tokenized like the data)")
    freq = smoothed_frequencies(counts)
    p = ctx.padded()
    n, width = p["mask"].shape
    neg_log_f = np.zeros((n, width), np.float32)
    first = np.zeros((n, width), bool)
    for i, t in enumerate(targets):
        neg_log_f[i, :len(t)] = -np.log(freq[t])
        first[i, :len(t)] = first_occurrences(t)
    padded, n = pad_pow2({"logprob": p["logprob"], "neg_log_freq": neg_log_f, "first": first, "mask": p["mask"]})
    return np.asarray(dcpdd_scores(padded["logprob"], padded["neg_log_freq"], padded["first"], np.float32(a)),
                      np.float64)[:n]
