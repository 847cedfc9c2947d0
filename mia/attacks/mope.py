"""MoPe (Li et al. 2023, "MoPe: Model Perturbation-based Privacy Attacks on Language Models"). docs/algorithms.md#mope.

  L_i(x) = mean token NLL under theta_i;  theta_0 = the model, theta_i = theta_0 + eps_i (i = 1..n)
  eps_i ~ N(0, sigma^2) i.i.d. on EVERY float parameter (embeddings, unembedding, norms, attention, MLP)
  score(x) = mean_i L_i(x) - L_0(x)                                         [N] float64, one per example

HIGHER = MEMBER (training points sit in sharper minima, so noise raises their loss more). pandora's statistic is
L_0 - mean_i L_i (lower = member): ours is its negative. Defaults n = 10, sigma = 0.005 (CheckMIABench App. A).

The draw (``perturb``), per leaf and in blocks of rows, so that no flat copy of all parameters and no random-bit
array the size of a big leaf ever exists:
  k_i = jax.random.split(key, n)[i]                               one key per perturbed model
  group 0 = the leaves outside the layer stack (embeddings, head, final norm), group 1 + l = decoder layer l
  leaf j of a group (tree order of that group's subtree; a layer's subtree is its slice of the stacked leaves),
  shape [R, *rest] (a scalar counts as [1]):
      k_ij = fold_in(fold_in(k_i, group), j)
      rows = min(R, max(1, 2^22 // prod(rest)))                     rows of one block (NOISE_BLOCK = 2^22 elements)
      block b = jax.random.normal(fold_in(k_ij, b), [rows, *rest], leaf.dtype)    b = 0 .. ceil(R / rows) - 1
      eps = sigma * concatenate(blocks, axis 0)[:R]                 the last block is drawn whole and cut
      theta_i leaf = leaf + eps                                     in the PARAMETER dtype
A leaf of at most 2^22 elements is one block: eps = sigma * normal(fold_in(k_ij, 0), shape). Blocks bound the
memory of threefry's counters and depend on the leaf's shape alone, never on the mesh, the chunk or the batch. For
float32 models this is pandora's distribution; bfloat16/float16 models get noise and perturbed copy in the parameter
dtype (why, and what it changes: docs/algorithms.md#mope).

Memory: the layer groups are perturbed inside the model's layer scan (``Model.hidden(layer_transform=...)``), so
only one layer's perturbed copy exists at a time. Group 0 is drawn twice with the same keys: for the embeddings
before the scan and for the LM head after it (``token_logprobs(head_params=...)``, behind
``lax.optimization_barrier`` on the final hidden states, so XLA cannot compute the head's copy early and keep it
through the scan). Each perturbed leaf keeps the sharding of the parameter it perturbs (``jax.random`` is
partitionable). ``chunk`` copies are vmapped and ``lax.map`` runs the ceil(n / chunk) chunks one after another, so
the peak is about the params + chunk x the largest group + chunk x activations
(measured: docs/benchmarks.md#mope-memory).
The same key gives the same n models in every batch, on every mesh and for every ``chunk``, so a score depends on
none of them. Nothing goes to disk.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..engine.batching import ScoringSettings, plan_batches, put_padded, row_length
from ..models.attention import traced_over
from ..models.hub import cached_per_architecture
from ..engine.conditional import token_logprobs
from ..engine.failsafe import fail_safe
from ..engine.loop import engine_layout, mesh_chunk_size, pipelined, placed_params, show_progress
from ..engine.plan import largest_group_bytes, register_planned_attack, row_args
from ..sharding import batch_sharding, compose, data_size, gather_outside_layers, layer_gather, replicated
from ..validate import Range
from .registry import AttackError, register

NOISE_BLOCK = 1 << 22  # elements of one noise block (see the module docstring): 16 MiB of uint32 counters


def block_rows(shape: tuple, block: int = NOISE_BLOCK) -> int:
    """Rows (entries of the leading axis) of one noise block of a leaf of ``shape``: as many whole rows as fit in
    ``block`` elements, at least 1, at most all of them. A scalar is one block of one row."""
    if not shape:
        return 1
    return max(1, min(shape[0], block // max(1, math.prod(shape[1:]))))


def perturb_leaf(key: jax.Array, leaf: jax.Array, sigma: float, sharding=None, block: int = NOISE_BLOCK) -> jax.Array:
    """leaf + sigma * N(0, 1) noise drawn in the leaf's own dtype (no float32 copy), block by block of ``block_rows``
    leading rows (the module docstring's draw): block b = normal(fold_in(key, b), [rows, *rest]), the last block
    drawn whole and cut. A ``fori_loop`` writes block after block into the perturbed copy, so XLA's random counters
    are the size of one block, never of the leaf. Non-float leaves unchanged."""
    if not jnp.issubdtype(leaf.dtype, jnp.floating) or leaf.size == 0:
        return leaf
    scale = jnp.asarray(sigma, leaf.dtype)
    shape = tuple(leaf.shape)
    rows = block_rows(shape, block)
    if not shape or rows == shape[0]:
        out = leaf + scale * jax.random.normal(jax.random.fold_in(key, 0), shape, leaf.dtype)
    else:
        rest = shape[1:]

        def noisy_block(b, length):
            start = b * rows
            eps = jax.random.normal(jax.random.fold_in(key, b), (rows,) + rest, leaf.dtype)[:length]
            return start, jax.lax.dynamic_slice_in_dim(leaf, start, length) + scale * eps

        def body(b, out):
            start, new = noisy_block(b, rows)
            return jax.lax.dynamic_update_slice_in_dim(out, new, start, 0)

        whole = shape[0] // rows
        out = jax.lax.fori_loop(0, whole, body, leaf)
        if whole * rows < shape[0]:
            start, new = noisy_block(whole, shape[0] - whole * rows)
            out = jax.lax.dynamic_update_slice_in_dim(out, new, start, 0)
    return out if sharding is None else jax.lax.with_sharding_constraint(out, sharding)


def perturb_group(key: jax.Array, tree, sigma: float, shardings=None, block: int = NOISE_BLOCK):
    """Every leaf j of ``tree`` (tree order) perturbed with ``fold_in(key, j)``; ``shardings`` a matching tree."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)  # dict and FrozenDict (inside the scan): sorted keys
    shards = [None] * len(leaves) if shardings is None else jax.tree_util.tree_leaves(shardings)
    return treedef.unflatten([perturb_leaf(jax.random.fold_in(key, j), x, sigma, sh, block)
                              for j, (x, sh) in enumerate(zip(leaves, shards))])


def split_layers(params: dict, layers: str) -> tuple[dict, dict]:
    """(params without the layer stack, the stacked layer subtree [L, ...])."""
    return {k: v for k, v in params.items() if k != layers}, params[layers]


def perturb(key: jax.Array, params: dict, sigma: float, layers: str, block: int = NOISE_BLOCK) -> dict:
    """theta_i for the key k_i: the whole perturbed tree at once (the reference of the draw; the attack itself
    perturbs the layers one at a time inside the scan, with the same numbers)."""
    top, stack = split_layers(params, layers)
    n_layers = jax.tree_util.tree_leaves(stack)[0].shape[0]
    per_layer = [perturb_group(jax.random.fold_in(key, 1 + i), jax.tree_util.tree_map(lambda a: a[i], stack), sigma,
                               block=block) for i in range(n_layers)]
    out = perturb_group(jax.random.fold_in(key, 0), top, sigma, block=block)
    out[layers] = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *per_layer)
    return out


def layer_slice_shardings(stack_shardings):
    """Shardings of one layer's slice of stacked leaves (the leading [L] axis dropped), or None."""
    from jax.sharding import NamedSharding, PartitionSpec

    if stack_shardings is None:
        return None
    return jax.tree_util.tree_map(lambda s: NamedSharding(s.mesh, PartitionSpec(*tuple(s.spec)[1:])), stack_shardings)


def mean_nll(logprob_fn: Callable, params, tokens_bt, mask_bt, layer_transform=None, head_params=None) -> jax.Array:
    """[B] mean token NLL over the T-1 predicted positions of valid tokens."""
    extra = {} if head_params is None else {"head_params": head_params}
    lp = logprob_fn(params, tokens_bt, mask_bt, layer_transform, **extra).astype(jnp.float32)
    m = (mask_bt[:, 1:] & mask_bt[:, :-1]).astype(jnp.float32)
    return -jnp.sum(lp * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


def make_mope(logprob_fn: Callable, *, n: int = 10, sigma: float = 0.005, chunk: int = 1, layers: str = "layers",
              shardings=None, gather: Optional[Callable] = None, gather_top: Optional[Callable] = None,
              block: int = NOISE_BLOCK) -> Callable:
    """Build ``fn(key, params, tokens [B, T], mask [B, T]) -> [B]`` MoPe scores (higher = member).

    ``logprob_fn(params, tokens, mask, layer_transform, head_params=None) -> [B, T-1]`` float32
    log p(t_{i+1} | t_<=i), applying ``layer_transform(layer_index, layer_params)`` inside its layer scan and taking
    the LM head's parameters from ``head_params(params, h)`` once the final hidden states ``h`` exist
    (``conditional.token_logprobs`` does both). ``layers``: the key of the stacked layer
    params. ``shardings``: the params' shardings (perturbed leaves keep them), or None. ``gather``: a layer
    transform run after the perturbation (the engine's per-layer FSDP all-gather), ``gather_top(params)`` the same
    for the leaves outside the layers, or None. Perturbation i uses
    ``jax.random.split(key, n)[i]`` whatever ``chunk`` is (chunk changes memory and speed, not scores). When
    ``chunk`` does not divide n, the last chunk is padded with repeats of key 0 whose results are dropped.
    """
    if n < 1 or chunk < 1:
        raise ValueError(f"make_mope: n and chunk must be >= 1, got n={n}, chunk={chunk}")
    chunk = min(chunk, n)
    n_chunks = -(-n // chunk)
    top_shardings, stack_shardings = split_layers(shardings, layers) if shardings is not None else (None, None)
    slice_shardings = layer_slice_shardings(stack_shardings)
    top_gather = gather_top or (lambda p: p)

    def one(k, params, tokens_bt, mask_bt):
        top, stack = split_layers(params, layers)

        def noisy_tree(top_leaves):
            noisy = perturb_group(jax.random.fold_in(k, 0), top_leaves, sigma, top_shardings, block)
            noisy[layers] = stack
            return top_gather(noisy)

        def head_params(_, h):
            # group 0 drawn again (same keys, same numbers) once the final hidden states exist: the barrier makes
            # the head's perturbed copy depend on h, so XLA cannot compute it before the layer scan
            _, late = jax.lax.optimization_barrier((h, top))
            return noisy_tree(late)

        def perturb_layer(i, lp):
            return perturb_group(jax.random.fold_in(k, 1 + i), lp, sigma, slice_shardings, block)

        return mean_nll(logprob_fn, noisy_tree(top), tokens_bt, mask_bt, compose(perturb_layer, gather), head_params)

    def fn(key, params, tokens_bt, mask_bt):
        mask_bt = mask_bt.astype(bool)
        l0 = mean_nll(logprob_fn, top_gather(params), tokens_bt, mask_bt, gather)
        keys = jax.random.split(key, n)
        pad = n_chunks * chunk - n
        if pad:
            keys = jnp.concatenate([keys, jnp.broadcast_to(keys[:1], (pad,) + keys.shape[1:])])
        keys = keys.reshape((n_chunks, chunk) + keys.shape[1:])
        run = jax.vmap(lambda k: one(k, params, tokens_bt, mask_bt))
        losses = jax.lax.map(run, keys).reshape(n_chunks * chunk, -1)[:n]  # [n, B]
        return jnp.mean(losses, axis=0) - l0

    return fn


def build_mope_step(model, mesh, shardings, n: int, sigma: float, chunk: int, block: int = NOISE_BLOCK):
    """jit of MoPe with explicit shardings: (key [replicated], params [``shardings``], tokens [B, T] and mask
    [B, T] rows over ``data``) -> [B] scores, replicated. Lowers on ``jax.ShapeDtypeStruct`` arguments for abstract
    devices (compile-only planning), like ``scoring.build_token_stats_step``."""

    layers = model.module.LAYERS

    def logprob_fn(p, t, v, layer_transform=None, head_params=None):
        return token_logprobs(model, p, t, v, layer_transform=layer_transform, head_params=head_params,
                              chunk=mesh_chunk_size(mesh, t.shape[0], t.shape[1] - 1, model.vocab_size))

    fn = make_mope(logprob_fn, n=n, sigma=sigma, chunk=chunk, layers=layers, shardings=shardings, block=block,
                   gather=layer_gather(shardings, layers),
                   gather_top=lambda p: gather_outside_layers(p, shardings, layers))
    rows = batch_sharding(mesh)
    return fail_safe(lambda: jax.jit(traced_over(mesh, fn), in_shardings=(replicated(mesh), shardings, rows, rows),
                                     out_shardings=replicated(mesh)))


@cached_per_architecture(maxsize=16)
def jitted_mope(model, n: int, sigma: float, chunk: int):
    """MoPe on the engine's layout for ``model`` (``scoring.engine_layout``), built once per architecture, dtypes
    and layout (``mia.models.hub.program_model``)."""
    mesh, shardings = engine_layout(model)
    return build_mope_step(model, mesh, shardings, n, sigma, chunk)


def _planned_mope(model, mesh, shardings, params, batch, length, *, mope_n: int = 10, mope_chunk: int = 2):
    """``mia plan --attack mope``: MoPe's step lowered on abstract params (``mia.engine.plan``)."""
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated(mesh))
    step = build_mope_step(model, mesh, shardings, mope_n, 0.005, mope_chunk)
    t = row_length(length, ScoringSettings().min_bucket, ScoringSettings().bucket_step)  # as plan_batches pads it
    return [("mope", (batch, t), step.lower(key, params, *row_args(batch, t, batch_sharding(mesh))))]


register_planned_attack("mope", _planned_mope, options={"n": ("mope_n", 10), "chunk": ("mope_chunk", 2)},
                        describe=lambda o: f"MoPe (n={o.get('mope_n', 10)}, chunk={o.get('mope_chunk', 2)})",
                        group_bytes=largest_group_bytes)


@register("mope", needs=("model",), n=10, sigma=0.005, chunk=2,
          limits={"n": Range(1), "sigma": Range(0, lo_open=True), "chunk": Range(1)})
def _mope(ctx, *, n: int, sigma: float, chunk: int) -> np.ndarray:
    """MoPe: mean NLL under n Gaussian-perturbed models minus the NLL of the model (higher = member). Li et al. 2023."""
    if n < 1 or chunk < 1 or not sigma > 0:
        raise AttackError(f"attack mope: need n >= 1, chunk >= 1, sigma > 0; got n={n}, chunk={chunk}, sigma={sigma}")
    from tqdm.auto import tqdm

    model = ctx.model
    mesh, _ = engine_layout(model)
    fn = jitted_mope(model, int(n), float(sigma), int(chunk))
    params = placed_params(model)
    with jax.transfer_guard("allow"):  # the seed becomes a key once per run (not a per-batch transfer)
        key = jax.device_put(jax.random.PRNGKey(ctx.seed), replicated(mesh))
    toks = [np.asarray(e.tokens, np.int32) for e in ctx.examples]
    # each vmapped copy holds its own activations: shrink the batch by the chunk size
    settings = dataclasses.replace(ctx.settings, token_budget=max(16, ctx.settings.token_budget // min(chunk, n)))
    out = np.zeros(len(toks), np.float64)
    rows_sharding = batch_sharding(mesh)
    with tqdm(total=len(toks), desc="mope", disable=not show_progress(ctx.settings), leave=False) as bar:
        def consume(batch, s):
            out[list(batch.members)] = np.asarray(s)[:len(batch.members)]
            bar.update(len(batch.members))

        pipelined(plan_batches([len(t) for t in toks], settings, data_size(mesh)),
                  lambda b: fn(key, params, *put_padded([toks[i] for i in b.members], b.rows, b.length, rows_sharding)),
                  consume)
    return out
