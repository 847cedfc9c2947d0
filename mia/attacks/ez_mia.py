"""EZ-MIA (Ilic, Stanojevic, Cvejoski 2026, arXiv 2601.12104): the target's gain over a reference model where the
target errs; docs/attacks.md#ez_mia.

One target pass (log-probs and whether each target token is the target model's top-1 prediction, ``top1``) and one
reference pass (log-probs of the same token ids; with ``--adapter`` the base model). Over the scored positions but
the first (the official code drops the first prediction, ``ignore_bos``), the *error zone* is where the target's
top-1 token is not the text's token; with d_t = log p_target(x_t) - log p_ref(x_t) there,

    P = sum of the positive d_t,  N = sum of |negative d_t|,  EZ(x) = P / (N + 1e-12)

and EZ = 0 when the error zone has fewer than 2 tokens, when N = 0, or when the value is NaN or negative (as the
official ``compute_ez_scores`` / ``error_zone_pos_neg_sum_ratio``). HIGHER = MEMBER: the fine-tune gained on x even
where it does not predict x. float32 throughout, as the official code.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..engine.batching import pad_pow2
from .reference import aligned_reference_logprobs
from .registry import register

MIN_TOKENS = 2  # the official min_tokens: fewer error-zone tokens score 0


@jax.jit
def ez_scores(target_lp_bl: jax.Array, ref_lp_bl: jax.Array, top1_bl: jax.Array, mask_bl: jax.Array) -> jax.Array:
    """Pure: [B, L] target log-probs, reference log-probs, top1 (1.0: the target's argmax is the token) and mask
    (right-padded rows, column 0 the first prediction) -> [B] float32 EZ scores (module docstring)."""
    keep = mask_bl.at[:, 0].set(False)  # ignore_bos: the first scored position
    err = keep & (top1_bl < 0.5)
    d = target_lp_bl.astype(jnp.float32) - ref_lp_bl.astype(jnp.float32)
    pos = jnp.sum(jnp.where(err & (d > 0), d, 0.0), axis=1)
    neg = jnp.sum(jnp.where(err & (d < 0), -d, 0.0), axis=1)
    value = pos / (neg + jnp.float32(1e-12))
    bad = (jnp.sum(err, axis=1) < MIN_TOKENS) | (neg == 0) | jnp.isnan(value) | (value < 0)
    return jnp.where(bad, jnp.float32(0.0), value)


def padded_reference(ref_lps: list, shape: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(reference log-probs [N, L] float32, [N, L] bool: where the reference scored the position) from the per-example
    arrays (None: no reference tokens), cut or zero-padded to the target's [N, L]."""
    out = np.zeros(shape, np.float32)
    have = np.zeros(shape, bool)
    for i, lp in enumerate(ref_lps):
        if lp is not None:
            n = min(len(lp), shape[1])
            out[i, :n], have[i, :n] = lp[:n], True
    return out, have


@register("ez_mia", needs=("stats", "ref"), stats=("logprob", "top1"))
def _ez_mia(ctx) -> np.ndarray:
    """EZ-MIA: positive over negative target-minus-reference log-prob gains where the target's top-1 token is wrong
    (higher = member). Needs a reference model: --ref-model, or the base of --adapter."""
    p = ctx.padded(("logprob", "top1"))
    ref, have = padded_reference(aligned_reference_logprobs(ctx, "ez_mia"), p["mask"].shape)
    arrays, n = pad_pow2({"t": p["logprob"], "r": ref, "top1": p["top1"], "mask": p["mask"] & have})
    return np.asarray(ez_scores(arrays["t"], arrays["r"], arrays["top1"], arrays["mask"]), np.float64)[:n]
