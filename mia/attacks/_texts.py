"""Scoring texts that are not the evaluated examples (lowercased copies, augmentations) with the target model.

One helper shared by the attacks that re-tokenize a text variant and run it through the shared scoring engine
(``mia.engine.compute_token_stats``: the same batched, bucketed, cached forward pass as the evaluated examples;
never a second copy of it).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..engine.loop import compute_token_stats
from .registry import AttackError


def target_ids(ctx, texts: Sequence[str], what: str) -> list:
    """Token ids of each text under the target tokenizer, cut to the run's max length ([T_i] int32)."""
    tok = ctx.model.tokenizer
    if tok is None:
        raise AttackError(f"attack {what} needs the target model's tokenizer to score re-written texts")
    limit = int(ctx.options.get("max_length") or ctx.model.max_tokens)
    return [np.asarray(tok(t)["input_ids"] if t else [], np.int32)[:limit] for t in texts]


def stats_or_none(ctx, seqs: Sequence[np.ndarray], desc: str) -> list:
    """Token stats ({stat: [T_i - 1]}) of each sequence through the shared engine; None for sequences of < 2 tokens."""
    usable = [i for i, s in enumerate(seqs) if len(s) >= 2]
    got = compute_token_stats(ctx.model, [seqs[i] for i in usable], ctx.settings, desc=desc,
                              stats=("logprob",)) if usable else []
    out: list[Optional[dict]] = [None] * len(seqs)
    for i, s in zip(usable, got):
        out[i] = s
    return out
