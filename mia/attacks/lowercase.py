"""Lowercase ratio (Carlini et al. 2021, "Extracting Training Data from Large Language Models", section 5.2).

  lowercase(x) = -LL(x) / LL(lower(x))

LL is the target's mean token log-likelihood (docs/algorithms.md#conventions); lower(x) is Python's ``str.lower`` of the
example's text, tokenized with the target tokenizer and cut to the run's max length, scored by the shared engine
(one extra pass; identical token sequences are served from the stats cache). Both LLs are negative, so the ratio
LL(x)/LL(lower(x)) = Loss(x)/Loss(lower(x)) is positive and SMALL for a memorized x (its cased form is much more
likely than its lowercased form).

Sign: Carlini rank by the perplexity ratio, low = memorized; the DC-PDD repo stores log ppl(x)/log ppl(lower x)
("larger for non-member"); the SoK benchmark (computationalprivacy/mia_llms_benchmark ``attacks/lowercase.py``)
returns -nlloss/lowercase_nlloss, higher = member. Ours is that one: -Loss/Loss_lower = -LL/LL_lower, HIGHER = MEMBER.
A text whose lowercased form has < 2 tokens scores NaN (noted). Needs the text (token-only examples are decoded).

Definition and differences from the public code: docs/algorithms.md#lowercase.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._texts import stats_or_none, target_ids
from .recall import unconditional_ll
from .registry import register


@jax.jit
def lowercase_ratio(ll_b: jax.Array, ll_lower_b: jax.Array) -> jax.Array:
    """[B] LL(x) and [B] LL(lower(x)) -> [B] -LL(x) / LL(lower(x)) (higher = member)."""
    return -ll_b.astype(jnp.float32) / ll_lower_b.astype(jnp.float32)


def lowercase_ll(ctx) -> np.ndarray:
    """[N] float64 LL of each evaluated example's lowercased text (NaN when it has < 2 tokens)."""
    lowered = [t.lower() for t in ctx.texts()]
    stats = stats_or_none(ctx, target_ids(ctx, lowered, "lowercase"), "lowercase: scoring lowercased texts")
    ll = np.array([np.nan if s is None else np.mean(s["logprob"], dtype=np.float64) for s in stats])
    if np.isnan(ll).any():
        ctx.notes.append(f"lowercase: {int(np.isnan(ll).sum())} lowercased text(s) had < 2 tokens; their score is NaN")
    return ll


@register("lowercase", needs=("stats", "model", "text"), stats=("logprob",))
def _lowercase(ctx) -> np.ndarray:
    """-LL(x) / LL(lowercased x) (higher = member; SoK benchmark sign). Carlini et al. 2021."""
    return np.asarray(lowercase_ratio(unconditional_ll(ctx), lowercase_ll(ctx)), np.float64)
