"""LOSS (Yeom et al. 2018): the mean token log-likelihood LL(x) = mean_i log p(x_i | x_<i); docs/algorithms.md#loss.

Higher = member (the source thresholds the loss -LL). The template of a token-statistics attack: one pure function
of [B, L] arrays, registered with the statistics it reads (in argument order, then the mask) and its parameters.
"""
import jax
import jax.numpy as jnp

from .context import eos_ids_if_skipping
from .registry import register_stats


@register_stats("loss", stats=("logprob", "eos_target"), check=eos_ids_if_skipping, skip_eos=False)
def loss(logprob_bl: jax.Array, eos_target_bl: jax.Array, mask_bl: jax.Array, *, skip_eos: bool = False) -> jax.Array:
    """Mean token log-likelihood (higher = member): [B, L] log-probs under the mask -> [B]; ``skip_eos``: without the
    positions whose target is the end-of-document token (pandora), NaN when none is left."""
    keep = mask_bl & ~eos_target_bl if skip_eos else mask_bl
    m = keep.astype(jnp.float32)
    ll = jnp.sum(logprob_bl * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
    return jnp.where(jnp.any(keep, axis=1), ll, jnp.nan)
