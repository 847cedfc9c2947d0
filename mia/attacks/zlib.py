"""Zlib ratio (Carlini et al. 2021, "Extracting Training Data from Large Language Models").

z(x) = len(zlib.compress(text.encode("utf-8"))) in bytes at the default level, on the example's text (or the tokens
decoded with the target tokenizer when only token ids, or a truncated text, are available).

  zlib          LL(x) / z(x), LL = mean token log-likelihood. Higher = member (ReCaLL, em-mia, Min-K%++ repos; Carlini
                and mimir use Loss / z, lower = member, the same ranking).
  zlib_entropy  z(x) alone: CheckMIABench's "Zlib" (Table 2, AUC ~0.5 there). pandora's model-free "zlib" feature is
                -z and the paper predicts member with the LOWER feature (pandora's plot_ROC assumes members have the
                lower statistic), i.e. with the HIGHER z: our score z, higher = member, has the paper's AUC.
                A sanity baseline, not a membership signal.

docs/algorithms.md#zlib, #zlib_entropy.
"""
from __future__ import annotations

import zlib as _zlib

import jax
import jax.numpy as jnp
import numpy as np

from .registry import get, register


def zlib_length(text: str) -> int:
    """Bytes of the zlib-compressed UTF-8 text (default level)."""
    return len(_zlib.compress(text.encode("utf-8")))


@jax.jit
def zlib_ratio(loglik_b: jax.Array, zlen_b: jax.Array) -> jax.Array:
    """[B] LL and [B] compressed lengths -> [B] LL / z (higher = member)."""
    return loglik_b.astype(jnp.float32) / zlen_b.astype(jnp.float32)


@register("zlib", needs=("stats", "text"), stats=("logprob", "eos_target"), skip_eos=False)
def _zlib_attack(ctx, *, skip_eos: bool = False) -> np.ndarray:
    """LL / zlib-compressed byte length of the text (higher = member). Carlini et al. 2021. ``skip_eos``: LL without
    end-of-document targets (``mia.attacks.loss``; NaN when none is left)."""
    ll = get("loss").fn(ctx, skip_eos=skip_eos).astype(np.float32)  # float32, as computed
    z = np.array([zlib_length(t) for t in ctx.texts()], np.float32)
    return np.asarray(zlib_ratio(ll, z), np.float64)


@register("zlib_entropy", needs=("text",))
def _zlib_entropy(ctx) -> np.ndarray:
    """zlib-compressed byte length: CheckMIABench's model-free "Zlib" in the paper's orientation (higher = member;
    a sanity baseline, expect AUC ~0.5)."""
    return np.array([zlib_length(t) for t in ctx.texts()], np.float64)
