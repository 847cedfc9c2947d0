"""LOSS attack (Yeom et al. 2018): the mean token log-likelihood LL(x) = mean_i log p(x_i | x_<i).

Higher = member (the source thresholds the loss -LL, lower = member).

``skip_eos=true`` (``loss`` and ``zlib``): the mean leaves out the positions whose TARGET token is the model's
end-of-document token (``config.eos_token_id``; every id when it is a list), as pandora's LOSS does for Pythia's EOD
(id 0: ``attention_mask = input_ids > 0``, ``mean = sum(lp * mask[:, 1:]) / mask[:, 1:].sum()``). pandora also drops
EOD from the attention, which changes the other tokens' log-probs; we do not (the shared stats pass is one ordinary
causal pass, as every other attack sees it), so on texts with an inner EOD our values differ from pandora's in that
way only. A text whose every target is EOD gets NaN (pandora divides by zero). Off by default (docs/algorithms.md#loss).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .registry import AttackError, register


@jax.jit
def mean_loglik(logprob_bl: jax.Array, mask_bl: jax.Array) -> jax.Array:
    """[B, L] per-token log-probs and mask -> [B] masked mean (LL; higher = member)."""
    m = mask_bl.astype(jnp.float32)
    return jnp.sum(logprob_bl * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


def eos_ids(model) -> tuple:
    """The model's end-of-document token id(s) from its config; an error when it has none."""
    eos = getattr(model.config, "eos_token_id", None)
    ids = tuple(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]) if i is not None)
    if not ids:
        raise AttackError("skip_eos=true: the model config has no eos_token_id")
    return ids


def target_is_eos(tokens_list: list, ids: tuple, width: int) -> np.ndarray:
    """[N, width] bool: position j predicts token j + 1 and that token is one of ``ids`` (padded False)."""
    out = np.zeros((len(tokens_list), width), bool)
    for i, t in enumerate(tokens_list):
        tgt = np.asarray(t)[1 : width + 1]
        out[i, : len(tgt)] = np.isin(tgt, ids)
    return out


def loglik_mask(ctx, skip_eos: bool) -> np.ndarray:
    """[N, L] mask of the terms LOSS-type scores average: every predicted token, or all but EOS targets."""
    p = ctx.padded()
    if not skip_eos:
        return p["mask"]
    return p["mask"] & ~target_is_eos([e.tokens for e in ctx.examples], eos_ids(ctx.model), p["mask"].shape[1])


def masked_mean_loglik(ctx, skip_eos: bool) -> np.ndarray:
    """[N] LL(x), optionally without EOS targets (NaN when nothing is left)."""
    mask = loglik_mask(ctx, skip_eos)
    ll = np.asarray(mean_loglik(ctx.padded()["logprob"], mask), np.float64)
    return np.where(mask.any(axis=1), ll, np.nan)


@register("loss", needs=("stats",), skip_eos=False)
def _loss(ctx, *, skip_eos: bool = False) -> np.ndarray:
    """Mean token log-likelihood (higher = member); ``skip_eos``: without end-of-document targets (pandora)."""
    return masked_mean_loglik(ctx, skip_eos)
