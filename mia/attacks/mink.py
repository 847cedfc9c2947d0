"""Min-K% Prob (Shi et al. 2024, "Detecting Pretraining Data from Large Language Models").

For the T-1 token log-probs l_i of an example, take the k_n = max(1, floor(k * (T-1))) smallest and return their mean.
Higher = member (the official Min-K%++ / ReCaLL / em-mia code; mimir and pandora return -mean, lower = member).
``max(1, .)`` is ours: with k * (T-1) < 1 the source takes an empty mean (NaN, or a division by zero in pandora).

docs/algorithms.md#mink. Shared here: the masked bottom-k mean (also used by Min-K%++).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..validate import Range
from .registry import AttackError, register_stats


def k_count_table(k: float, length: int) -> np.ndarray:
    """[length + 1] int32: k_n for n = 0..length valid values, max(1, int(k * n)) in Python float64 arithmetic.

    Computed on the host at trace time so that floor(k * n) is exactly the reference's ``int(n * k)`` (float32 on
    the device gives e.g. int(0.29 * 100) = 29 where Python's float64 gives 28).
    """
    return np.array([max(1, int(n * k)) for n in range(length + 1)], np.int32)


def bottom_k_mean(values_bl: jax.Array, mask_bl: jax.Array, *, k: float) -> jax.Array:
    """[B, L] values and mask -> [B] mean of the k_n smallest valid values, k_n = max(1, floor(k * n_valid)).

    Padding is pushed to +inf before the sort, so it never enters the bottom k_n. Not jitted itself (k must be a
    Python float); see ``min_k``.
    """
    b, l = values_bl.shape
    n_b = jnp.sum(mask_bl, axis=1)
    kn_b = jnp.asarray(k_count_table(k, l))[n_b]
    sorted_bl = jnp.sort(jnp.where(mask_bl, values_bl, jnp.inf), axis=1)
    take_bl = jnp.arange(l)[None, :] < kn_b[:, None]
    return jnp.sum(jnp.where(take_bl, sorted_bl, 0.0), axis=1) / kn_b.astype(jnp.float32)


@register_stats("mink", stats=("logprob",), k=0.2, limits={"k": Range(0, 1, lo_open=True)})
def min_k(logprob_bl: jax.Array, mask_bl: jax.Array, *, k: float = 0.2) -> jax.Array:
    """Min-K%: [B, L] token log-probs, [B, L] bool mask -> [B] mean of the max(1, floor(k (T-1))) lowest log-probs
    (higher = member). Shi et al. 2024."""
    return bottom_k_mean(logprob_bl.astype(jnp.float32), mask_bl, k=k)


def check_k(name: str, k: float) -> float:
    if not 0.0 < k <= 1.0:
        raise AttackError(f"attack {name}: k must be in (0, 1], got {k}")
    return float(k)
