"""Fitting a prefix and its targets into the context the model was trained at (ReCaLL, EM-MIA, ReCaLL-Avg).

A model trained on sequences of C tokens (``Model.max_length``: Pythia 2048, a testbed its ``seq_len``) has never
seen a position >= C; a prefix P before a target x puts x's tokens at positions len(P) .. len(P) + len(x) - 1. We
never feed a position beyond the context: prefix + target <= C tokens. The rule, for a wanted prefix of W tokens and
evaluated targets of at most L tokens:

  prefix room   R = min(W, max(C - L, C // 2))
  target room   C - len(prefix actually used)  (>= C - R)

So when the whole prefix fits beside the longest target nothing changes; otherwise the prefix is shortened to what
fits (ReCaLL keeps its last whole shots, EM-MIA the last tokens of each prefix text), but never below half the
context (or W), and targets longer than the rest are cut to their FIRST tokens. On full-context rows (Pythia's
2049-token rows, the testbed's seq_len + 1: a text may hold C + 1 tokens, its last only predicted) this gives the
prefix half of the context and scores the targets' first half. LL(x) in the ratio LL(x | P) / LL(x) is then the mean
over the same cut target (its first n - 1 log-probs of the unconditional pass; the model is causal, so they are the
cut target's own): both terms see the same tokens. Every cut is said in a note (``ctx.notes``, printed by
``mia score``).
"""
from __future__ import annotations

import numpy as np

from ..engine.conditional import prefix_room  # noqa: F401 (the rule above; the engine plans with it too)
from .registry import AttackError


def context_length(ctx) -> int:
    """C: the context the model was trained at (its ``max_position_embeddings``)."""
    return int(ctx.model.max_length)


def cut_targets(targets: list, length: int, min_tokens: int, what: str) -> tuple[list, int]:
    """(targets cut to their first ``length`` tokens, how many were cut); an error when ``length < min_tokens``."""
    if length < min_tokens:
        raise AttackError(f"{what}: no room for a prefix: the model context leaves {length} target token(s), "
                          f"at least {min_tokens} needed")
    cut = sum(len(t) > length for t in targets)
    return [np.asarray(t[:length]) for t in targets], int(cut)


def truncated_ll(padded: dict, length: int) -> np.ndarray:
    """[N] float64 mean log-prob of each sequence's first ``length`` tokens (its first length - 1 predictions) from
    the padded token stats of the whole sequences (``AttackContext.padded()``: ``logprob`` and ``mask`` [N, T-1])."""
    lp = np.asarray(padded["logprob"], np.float64)[:, : max(length - 1, 0)]
    mask = np.asarray(padded["mask"], bool)[:, : max(length - 1, 0)]
    return np.where(mask, lp, 0.0).sum(1) / np.maximum(mask.sum(1), 1)


def cut_note(what: str, n_cut: int, length: int, context: int, prefix_len: int) -> str:
    return (f"{what}: {n_cut} target(s) cut to their first {length} tokens (LL(x) on the same tokens) so that a "
            f"{prefix_len}-token prefix + target fit the {context}-token context the model was trained at")


def add_note(ctx, note: str) -> None:
    if note not in ctx.notes:
        ctx.notes.append(note)
