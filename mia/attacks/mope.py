"""MoPe (Li et al. 2023, "MoPe: Model Perturbation-based Privacy Attacks on Language Models"). ALGORITHMS.md 3.

  L_i(x) = mean token NLL under theta_i;  theta_0 = the model, theta_i = theta_0 + eps_i (i = 1..n)
  eps_i ~ N(0, sigma^2) i.i.d. on EVERY float parameter (embeddings, unembedding, norms, attention, MLP), added in
  float32, one PRNG key per perturbed model (``jax.random.split(key, n)``; see ``perturb`` for the draw)
  score(x) = mean_i L_i(x) - L_0(x)

HIGHER = MEMBER (training points sit in sharper minima, so noise raises their loss more). pandora's statistic is
L_0 - mean_i L_i (lower = member): ours is its negative. Defaults n = 10, sigma = 0.005 (CheckMIABench App. A).

The perturbed copies are never materialised all at once: ``chunk`` copies are vmapped, and ``lax.map`` runs the
ceil(n / chunk) chunks one after another, so peak memory is ~ (1 + chunk) x params + chunk x activations. The
same key gives the same n models in every batch, so a score does not depend on batching. Nothing goes to disk.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..conditional import token_logprobs
from ..scoring import plan_batches
from .registry import AttackError, register


def perturb(key: jax.Array, params, sigma: float):
    """params + N(0, sigma^2) noise on every floating leaf, in float32.

    One draw of sum(leaf sizes) normals from ``key``, split over the floating leaves in tree order (one threefry
    call instead of one per leaf: much faster to compile, the same distribution).
    """
    leaves, treedef = jax.tree_util.tree_flatten(params)
    floating = [i for i, leaf in enumerate(leaves) if jnp.issubdtype(leaf.dtype, jnp.floating)]
    sizes = [leaves[i].size for i in floating]
    noise = sigma * jax.random.normal(key, (sum(sizes),), jnp.float32)
    out = list(leaves)
    offset = 0
    for i, size in zip(floating, sizes):
        out[i] = leaves[i].astype(jnp.float32) + noise[offset: offset + size].reshape(leaves[i].shape)
        offset += size
    return jax.tree_util.tree_unflatten(treedef, out)


def mean_nll(logprob_fn: Callable, params, tokens_bt, mask_bt) -> jax.Array:
    """[B] mean token NLL over the T-1 predicted positions of valid tokens."""
    lp = logprob_fn(params, tokens_bt, mask_bt).astype(jnp.float32)
    m = (mask_bt[:, 1:] & mask_bt[:, :-1]).astype(jnp.float32)
    return -jnp.sum(lp * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


def make_mope(logprob_fn: Callable, *, n: int = 10, sigma: float = 0.005, chunk: int = 1) -> Callable:
    """Build ``fn(key, params, tokens [B, T], mask [B, T]) -> [B]`` MoPe scores (higher = member).

    ``logprob_fn(params, tokens, mask) -> [B, T-1]`` float32 log p(t_{i+1} | t_<=i). Perturbation i uses
    ``jax.random.split(key, n)[i]``, whatever ``chunk`` is (chunk changes memory and speed, not scores). When
    ``chunk`` does not divide n, the last chunk is padded with repeats of key 0 whose results are dropped.
    """
    if n < 1 or chunk < 1:
        raise ValueError(f"make_mope: n and chunk must be >= 1, got n={n}, chunk={chunk}")
    chunk = min(chunk, n)
    n_chunks = -(-n // chunk)

    def fn(key, params, tokens_bt, mask_bt):
        mask_bt = mask_bt.astype(bool)
        l0 = mean_nll(logprob_fn, params, tokens_bt, mask_bt)
        keys = jax.random.split(key, n)
        pad = n_chunks * chunk - n
        if pad:
            keys = jnp.concatenate([keys, jnp.broadcast_to(keys[:1], (pad,) + keys.shape[1:])])
        keys = keys.reshape((n_chunks, chunk) + keys.shape[1:])
        one = lambda k: mean_nll(logprob_fn, perturb(k, params, sigma), tokens_bt, mask_bt)  # noqa: E731
        losses = jax.lax.map(jax.vmap(one), keys).reshape(n_chunks * chunk, -1)[:n]  # [n, B]
        return jnp.mean(losses, axis=0) - l0

    return fn


@functools.lru_cache(maxsize=16)
def jitted_mope(model, n: int, sigma: float, chunk: int):
    logprob_fn = lambda p, t, v: token_logprobs(model, p, t, v)  # noqa: E731
    return jax.jit(make_mope(logprob_fn, n=n, sigma=sigma, chunk=chunk))


@register("mope", needs=("model",), n=10, sigma=0.005, chunk=2)
def _mope(ctx, *, n: int, sigma: float, chunk: int) -> np.ndarray:
    """MoPe: mean NLL under n Gaussian-perturbed models minus the NLL of the model (higher = member). Li et al. 2023."""
    if n < 1 or chunk < 1 or not sigma > 0:
        raise AttackError(f"attack mope: need n >= 1, chunk >= 1, sigma > 0; got n={n}, chunk={chunk}, sigma={sigma}")
    from tqdm.auto import tqdm

    fn = jitted_mope(ctx.model, int(n), float(sigma), int(chunk))
    key = jax.random.PRNGKey(ctx.seed)
    toks = [np.asarray(e.tokens, np.int32) for e in ctx.examples]
    # each vmapped copy holds its own activations: shrink the batch by the chunk size
    settings = dataclasses.replace(ctx.settings, token_budget=max(16, ctx.settings.token_budget // min(chunk, n)))
    out = np.zeros(len(toks), np.float64)
    with tqdm(total=len(toks), desc="mope", disable=not ctx.settings.progress, leave=False) as bar:
        for blen, members in plan_batches([len(t) for t in toks], settings):
            rows = 1 << (len(members) - 1).bit_length()
            tok = np.zeros((rows, blen), np.int32)
            val = np.zeros((rows, blen), bool)
            for r, i in enumerate(members):
                tok[r, :len(toks[i])] = toks[i]
                val[r, :len(toks[i])] = True
            s = np.asarray(jax.device_get(fn(key, ctx.model.params, tok, val)))
            out[members] = s[:len(members)]
            bar.update(len(members))
    return out
