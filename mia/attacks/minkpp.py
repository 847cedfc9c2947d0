"""Min-K%++ (Zhang et al. 2024, "Min-K%++: Improved Baseline for Detecting Pre-Training Data from LLMs").

At each position, with p = softmax over the full logit vector (padded vocabulary entries included):
mu_i = sum_v p_v log p_v, sigma_i^2 = sum_v p_v (log p_v)^2 - mu_i^2, z_i = (l_i - mu_i) / sigma_i (no epsilon, as the
official code). The score is the mean of the k_n = max(1, floor(k (T-1))) smallest z_i. Higher = member (official code).

mu and sigma come from the shared scoring pass (``mean_logp``, ``std_logp``), so this attack costs no extra model call.
pandora's variant (unweighted vocabulary mean and unbiased std of log p, +1e-8, negated) is NOT offered: it needs
unweighted vocabulary moments, which the shared token stats do not hold. docs/algorithms.md#minkpp.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..validate import Range
from .mink import bottom_k_mean
from .registry import register_stats


def z_scores(logprob_bl: jax.Array, mean_logp_bl: jax.Array, std_logp_bl: jax.Array) -> jax.Array:
    """[B, L] z_i = (l_i - mu_i) / sigma_i (padding may be NaN; callers mask it)."""
    return (logprob_bl - mean_logp_bl) / std_logp_bl


@register_stats("minkpp", stats=("logprob", "mean_logp", "std_logp"), k=0.2, limits={"k": Range(0, 1, lo_open=True)})
def min_k_plus_plus(logprob_bl: jax.Array, mean_logp_bl: jax.Array, std_logp_bl: jax.Array, mask_bl: jax.Array,
                    *, k: float = 0.2) -> jax.Array:
    """Min-K%++: [B, L] log-probs, mu, sigma and mask -> [B] mean of the max(1, floor(k (T-1))) lowest
    z = (logp - mu) / sigma (higher = member). Zhang et al. 2024."""
    z = z_scores(logprob_bl.astype(jnp.float32), mean_logp_bl.astype(jnp.float32), std_logp_bl.astype(jnp.float32))
    return bottom_k_mean(z, mask_bl, k=k)
