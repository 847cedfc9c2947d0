"""SURP, surprising tokens (Zhang & Wu 2024, "Adaptive Pre-training Data Detection for Large Language Models via
Surprising Tokens").

A token is surprising when the model was confident (entropy H_i < max_entropy, in nats) yet gave the true token a low
probability (l_i among the k_n = max(1, floor(k (T-1))) lowest log-probs of the example). The score is the mean l_i
over the surprising tokens:

  surp(x) = mean { l_i : rank(l_i) < k_n and H_i < max_entropy }

Defaults k = 0.4, max_entropy = 2.0 (the SoK benchmark's ``surp_40_2``, the setting reported best). Entropy and
log-probs come from the shared stats pass (no extra model call). Sign: the source's raw mean, HIGHER = MEMBER
(computationalprivacy/mia_llms_benchmark ``attacks/surp.py``; members' surprising tokens are less surprising).

Deviations, stated: k_n = max(1, .) as Min-K% (the SoK code takes int(k T) and an empty set for short texts); ties at
the k_n boundary keep the earlier position (stable sort; torch.topk picks arbitrarily). An example with NO surprising
token scores EMPTY_SCORE = 0, the log-prob ceiling: by the paper's hypothesis (members surprise the model less) it is
the most member-like case. The SoK code maps it to -100 (``nan_to_num``), the least member-like, which inverts the
attack where confident models leave many texts without surprising tokens (counted in a note either way; measured
on the smoke memorization dial: docs/attacks.md#rewritten-texts). docs/algorithms.md#surp.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .mink import k_count_table
from ..validate import Range
from .registry import register_stats

EMPTY_SCORE = 0.0


def bottom_k_selection(values_bl: jax.Array, mask_bl: jax.Array, *, k: float) -> jax.Array:
    """[B, L] bool: the k_n = max(1, floor(k n_valid)) smallest valid values of each row (stable: earlier wins ties)."""
    b, l = values_bl.shape
    kn_b = jnp.asarray(k_count_table(k, l))[jnp.sum(mask_bl, axis=1)]
    order_bl = jnp.argsort(jnp.where(mask_bl, values_bl, jnp.inf), axis=1, stable=True)
    rank_bl = jnp.argsort(order_bl, axis=1)  # inverse permutation: each position's rank in sorted order
    return (rank_bl < kn_b[:, None]) & mask_bl


def _note_empty(count_b, *, k: float, max_entropy: float):
    """The user's line when some examples had no surprising token (they score ``EMPTY_SCORE``)."""
    empty = int((count_b == 0).sum())
    if empty:
        return (f"surp: {empty} example(s) had no surprising token (k={k}, max_entropy={max_entropy}); they score "
                f"{EMPTY_SCORE}")
    return None


@register_stats("surp", stats=("logprob", "entropy"), note=_note_empty, k=0.4, max_entropy=2.0,
                limits={"k": Range(0, 1, lo_open=True), "max_entropy": Range(0, lo_open=True)})
def surp(logprob_bl: jax.Array, entropy_bl: jax.Array, mask_bl: jax.Array, *, k: float = 0.4,
         max_entropy: float = 2.0) -> tuple:
    """SURP (Zhang & Wu 2024): mean log-prob of the bottom-k tokens whose entropy is below max_entropy (higher =
    member). [B, L] log-probs, entropies, mask -> ([B] score, [B] number of surprising tokens)."""
    lp = logprob_bl.astype(jnp.float32)
    chosen = bottom_k_selection(lp, mask_bl, k=k) & (entropy_bl.astype(jnp.float32) < max_entropy)
    n_b = jnp.sum(chosen, axis=1)
    mean_b = jnp.sum(jnp.where(chosen, lp, 0.0), axis=1) / jnp.maximum(n_b, 1).astype(jnp.float32)
    return jnp.where(n_b > 0, mean_b, EMPTY_SCORE), n_b
