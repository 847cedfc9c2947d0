"""Helpers shared by the attack tests: examples over a tiny tokenizer, attack contexts, NumPy log-likelihoods, and
hand-made token statistics with the stats an attack reads. Plain functions; fixtures live in conftest.py."""
from __future__ import annotations

import math

import numpy as np

from mia.attacks import AttackContext
from mia.data.examples import Example, tokenize_examples
from mia.engine.batching import ScoringSettings

from hf_tiny import log_softmax

WORDS = ("the of and to in is that for it as with was on be by this are from not but have which "
         "data model train member loss token text line file value").split()
SETTINGS = ScoringSettings(progress=False, min_bucket=32)


def make_text(rng, n):
    return " ".join(rng.choice(WORDS, n))


def make_examples(tok, n, seed, words=(3, 14), partition="eval", prefix="e", label=None):
    """``n`` tokenized examples of random words; labels alternate 0, 1, ... unless ``label`` fixes them."""
    rng = np.random.default_rng(seed)
    ex = [Example(f"{prefix}{i}", text=make_text(rng, int(rng.integers(*words))),
                  label=(i % 2) if label is None else label, partition=partition) for i in range(n)]
    return tokenize_examples(ex, tok, 256)


def np_ll(logits_of, seq, start=1):
    """mean over i >= start of log p(seq[i] | seq[:i]), ``logits_of(seq)`` -> [T, V]."""
    lp = log_softmax(logits_of(np.asarray(seq)))
    return np.mean([lp[i - 1, seq[i]] for i in range(start, len(seq))])


def ctx_for(model, examples, prefix=(), **options):
    return AttackContext(model, list(examples), SETTINGS, {"prefix": list(prefix)} if prefix else {},
                         {"seed": 0, **options})



# ------------------------------------------------------------------ hand-made token statistics
LENGTHS = (1, 2, 3, 4, 7, 10, 23, 40)  # T-1 values; 1..4 exercise k*(T-1) < 1 at k = 0.2


def _softmax_stats(logits):
    """Spec form from the full logit vector: log p, mu = sum p log p, sigma^2 = sum p (log p)^2 - mu^2."""
    out = {"logprob": [], "mean_logp": [], "std_logp": [], "entropy": []}
    for row in logits:
        lp = row - np.log(np.sum(np.exp(row - row.max()))) - row.max()
        p = np.exp(lp)
        mu = float(np.sum(p * lp))
        out["mean_logp"].append(mu)
        out["std_logp"].append(math.sqrt(float(np.sum(p * lp * lp)) - mu * mu))
        out["entropy"].append(-mu)
    return out


def stat_examples(seed=0, lengths=LENGTHS, vocab=11):
    """Hand-made per-token stats from random logits (token ids random, stats consistent with them)."""
    rng = np.random.default_rng(seed)
    examples, stats, logits_all = [], [], []
    for i, n in enumerate(lengths):
        tokens = rng.integers(0, vocab, size=n + 1).astype(np.int32)
        logits = rng.normal(0, 2.0, size=(n, vocab))
        s = _softmax_stats(logits)
        lps = []
        for t in range(n):
            row = logits[t]
            lp = row - row.max() - np.log(np.sum(np.exp(row - row.max())))
            lps.append(lp[tokens[t + 1]])
        s["logprob"] = lps
        stats.append({k: np.asarray(v, np.float32) for k, v in s.items()})
        examples.append(Example(f"e{i}", tokens, text=f"text number {i} " * (i + 1), label=i % 2))
        logits_all.append(logits)
    return examples, stats


def ctx_with(examples, stats, model=None):
    ctx = AttackContext(model, examples)
    ctx._stats = stats
    return ctx


