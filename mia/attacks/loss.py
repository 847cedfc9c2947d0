"""LOSS attack (Yeom et al. 2018): the mean token log-likelihood LL(x) = mean_i log p(x_i | x_<i).

Higher = member (the source thresholds the loss -LL, lower = member).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .registry import register


@jax.jit
def mean_loglik(logprob_bl: jax.Array, mask_bl: jax.Array) -> jax.Array:
    """[B, L] per-token log-probs and mask -> [B] masked mean (LL; higher = member)."""
    m = mask_bl.astype(jnp.float32)
    return jnp.sum(logprob_bl * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


@register("loss", needs=("stats",))
def _loss(ctx) -> np.ndarray:
    """Mean token log-likelihood (higher = member)."""
    p = ctx.padded()
    return np.asarray(mean_loglik(p["logprob"], p["mask"]))
