"""Causal grouped-query attention masked by position ids: one function, three kernels.

Shapes (legend in :mod:`mia.models.common`): q [B, T, H, E]; k, v [B, S, K, E] with H = K * G; q_pos [B, T] and
k_pos [B, S] integer position ids; k_valid [B, S] bool. The keys are [cached prefix ; current tokens], so query i
is key S - T + i. Key j is *allowed* for query i when

    k_valid[j]  and  k_pos[j] <= q_pos[i]  (and  q_pos[i] - k_pos[j] < window  for a local window).

Masking by position id makes right-padded targets, left-padded prefixes and a cached prefix one case. A query
whose token is valid always has at least one allowed key (itself); a fully masked row (an all-padding batch row)
yields some finite value (uniform attention in ``exact``), never NaN. Rows of padding queries are not used downstream.

Kernels (all return [B, T, H, E] in v's dtype; scores, softmax and accumulation in float32 for any input dtype).
exact and blocked share one rounding rule (``_weights``): unnormalised weights 2^(score*log2(e) - M) with M the
row maximum rounded up to an integer, rounded to v's dtype for the weighted sum (float32 accumulation), divided by
their float32 sum at the end. In bf16 the two then agree to float32 summation order, not bf16 rounding.
  exact    materialises the float32 scores [B, K, G, T, S]: the reference the tests compare against; used for
           short keys.
  blocked  flash-style online softmax in plain JAX: for each block of queries, a scan over key blocks keeps the
           running max, sum and weighted values in float32 and skips key blocks that no query of the block may
           see (above the causal diagonal, outside a local window, all padding). The activation peak is one
           [B, H, block_q, block_k] score block plus the output, linear in T.
  xla      ``jax.nn.dot_product_attention`` (cuDNN flash attention on a CUDA GPU for bf16/fp16). When there is
           no cache and the batch is laid out plainly (right padding, position = index), checked at run time,
           our mask is its ``is_causal`` + sequence lengths + ``local_window_size``: no mask tensor, causal
           blocks skipped. Otherwise it gets the boolean mask [B, 1, T, S] (quadratic, but booleans/bias, not
           float32 scores per head). Shapes cuDNN refuses at trace time run the blocked kernel instead.

  splash   Pallas splash attention on a TPU (``jax.experimental.pallas.ops.tpu.splash_attention``): no cache (T = S),
           a length divisible by 128; a traced per-layer window (GPT-Neo's mixed stack) runs splash for the global
           layers and blocked for the local ones (``lax.cond``). Our mask is its causal (or local, window - 1 to the
           left) mask by index plus segment ids: 1 for valid tokens and 0 for padding, or the packed rows' ids as they
           are. That equals the position-id rule when, in every row, the tokens of each segment are contiguous with
           positions index + a constant, and q_pos = k_pos (right or left padding, packed rows): checked at run time
           (:func:`index_aligned`), else the blocked kernel runs. Scores, softmax and sums in float32 (its own
           rounding: q is scaled before the kernel, weights exp(s - running max), not the integer-max rule, so it
           agrees with exact to the input dtype's rounding). Padding queries see padding keys (finite, unused). Inside
           :func:`over_mesh` (the engine's jitted steps) it runs under ``shard_map``: rows over ``data``, heads over
           ``model`` when both head counts divide by it.

Soft caps (Gemma-2's ``attn_logit_softcapping``, ``softcap``): the scaled scores become softcap * tanh(s / softcap)
before masking, in every kernel: exact and blocked in their float32 scores, splash through its own
``attn_logits_soft_cap``, xla through :func:`capped_xla_attention` (jax's XLA formula written out: neither cuDNN nor
``jax.nn.dot_product_attention`` caps scores), so auto never picks xla for a capped model.

Dispatch (:func:`select_kernel`, at trace time, from static shapes and ``jax.default_backend()``):
  the environment variable ``MIA_ATTENTION`` = exact | blocked | xla | splash forces a kernel; auto (the
  default) picks xla on a GPU when cuDNN can run it (bf16/fp16, no cache, head dim a multiple of 8 and <= 128),
  splash on a TPU when it can run (:func:`splash_can_run`) inside the engine's steps or on one chip, else
  exact while the keys are short (S <= EXACT_MAX_KEYS and the scores fit EXACT_MAX_SCORE_BYTES), else blocked.
  A forced splash that cannot run these shapes (a cache, a length not a multiple of 128) runs blocked.
  jit caches are per process: set the variable before anything is traced.

Failures (:mod:`mia.engine.failsafe`): xla and splash may fail to lower, compile or run on a backend. The engine's
steps then mark the kernel failed for the process (:func:`failed_kernels`; auto picks FALLBACK = blocked instead
from then on), print one ``warning:`` line and rerun with blocked; a kernel MIA_ATTENTION asked for raises
:class:`KernelError` naming the variable instead. :func:`forced_kernel` pins a kernel for code traced inside it
(``mia doctor`` checks every kernel that way).
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from functools import partial, wraps
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Window = Optional[Union[int, Array]]  # None (global), an int, or a traced int32 scalar from a per-layer table

# A finite "minus infinity": a fully masked row then softmaxes to a uniform row, not NaN.
MASK_VALUE = -1e30

ENV_VAR = "MIA_ATTENTION"
KERNEL_NAMES = ("exact", "blocked", "xla", "splash")

# auto dispatch thresholds (CPU measurements in docs/benchmarks.md#attention)
EXACT_MAX_KEYS = 512
EXACT_MAX_SCORE_BYTES = 1 << 30
BLOCK_Q = 256
BLOCK_K = 256


# ------------------------------------------------------------------------------------------------ masks
def query_segments(k_valid_bs: Array, t: int) -> Optional[Array]:
    """[B, T] segment ids of the queries (the last T keys) for packed rows (integer ``k_valid``), else None."""
    return k_valid_bs[:, k_valid_bs.shape[1] - t:] if jnp.issubdtype(k_valid_bs.dtype, jnp.integer) else None


def allowed_mask(q_pos_bt: Array, k_pos_bs: Array, k_valid_bs: Array, window,
                 q_seg_bt: Optional[Array] = None) -> Array:
    """[B, T, S] bool: may query t attend to key s (position-id causal, valid keys, optional local window).

    ``window``: None, an int, or a traced int32 scalar (a per-layer table entry; a huge value means global).
    Packed rows: ``k_valid`` holds segment ids (0 = padding) and ``q_seg_bt`` the queries' ids; a key is allowed
    only within the query's own segment.
    """
    if q_seg_bt is not None:
        live = (k_valid_bs[:, None, :] == q_seg_bt[:, :, None]) & (k_valid_bs[:, None, :] > 0)
    else:
        live = k_valid_bs[:, None, :]
    allowed = (k_pos_bs[:, None, :] <= q_pos_bt[:, :, None]) & live
    if window is not None:
        allowed = allowed & (q_pos_bt[:, :, None] - k_pos_bs[:, None, :] < window)
    return allowed


# ------------------------------------------------------------------------------------------------ rounding rule
LOG2E = 1.4426950408889634


def soft_capped(scores: Array, softcap: Optional[float]) -> Array:
    """Gemma-2's attention-logit soft cap on scaled float32 scores: ``softcap * tanh(scores / softcap)`` (applied
    before masking, as transformers does); None: the scores unchanged."""
    return scores if softcap is None else jnp.tanh(scores / softcap) * softcap


def _log2_scores(spec: str, q: Array, k: Array, scale: float, softcap: Optional[float] = None) -> Array:
    """Scores in base-2 units, float32: (q . k) * scale * log2(e), products of the inputs summed in float32; with
    ``softcap`` the scaled scores are soft-capped (:func:`soft_capped`) before the change of base."""
    s = jnp.einsum(spec, q, k, preferred_element_type=jnp.float32)
    if softcap is None:
        return s * (scale * LOG2E)
    return soft_capped(s * scale, softcap) * LOG2E


def _integer_max(scores: Array) -> Array:
    """[..., 1] the row maximum of base-2 scores rounded up to an integer (float32)."""
    return jnp.ceil(jnp.max(scores, axis=-1, keepdims=True))


def _weights(scores: Array, row_max: Array) -> Array:
    """Unnormalised float32 softmax weights 2^(score - max) in (0, 1].

    The one rounding rule of every kernel we own: these weights are rounded to v's dtype for the weighted sum of
    values (accumulated in float32) and normalised afterwards by their float32 sum. Because the maximum is an
    integer, the online softmax's rescaling between key blocks is a power of two, which commutes with rounding to
    bf16/fp16: the blocked kernel rounds exactly the weights the exact kernel rounds, and the two differ only by
    float32 summation order, in any dtype (a plain softmax rounded to bf16 differs from the blocked recurrence by up
    to ~1e-2 nats per token).
    """
    return jnp.exp2(scores - row_max)


# ------------------------------------------------------------------------------------------------ exact
def exact_attention(q_bthe, k_bske, v_bske, q_pos_bt, k_pos_bs, k_valid_bs, *, scale: float,
                    window: Window = None, softcap: Optional[float] = None) -> Array:
    """The reference: full float32 scores [B, K, G, T, S], the shared rounding rule (:func:`_weights`), float32
    sums."""
    b, t, h, e = q_bthe.shape
    kv_heads = k_bske.shape[2]
    q = q_bthe.reshape(b, t, kv_heads, h // kv_heads, e)
    scores = _log2_scores("btkge,bske->bkgts", q, k_bske, scale, softcap)
    allowed = allowed_mask(q_pos_bt, k_pos_bs, k_valid_bs, window, query_segments(k_valid_bs, t))
    scores = jnp.where(allowed[:, None, None, :, :], scores, MASK_VALUE)
    p = _weights(scores, _integer_max(scores))
    out = jnp.einsum("bkgts,bske->btkge", p.astype(v_bske.dtype), v_bske, preferred_element_type=jnp.float32)
    l = jnp.sum(p, axis=-1).transpose(0, 3, 1, 2)[..., None]  # [B, T, K, G, 1]
    return (out / l).reshape(b, t, h, e).astype(v_bske.dtype)


# ------------------------------------------------------------------------------------------------ blocked
def reachable_blocks(q_pos_bnq: Array, k_pos_bnk: Array, k_valid_bnk: Array, window: Window) -> Array:
    """[n_q_blocks, n_k_blocks] bool, False only where no query of the block may see any key of the block.

    Conservative from per-block extremes: some valid key with position <= the block's largest query position
    (and, with a window, > its smallest query position - window). Blocks of shape [B, n, block].
    """
    big = jnp.iinfo(jnp.int32).max // 4
    k_pos = k_pos_bnk.astype(jnp.int32)
    k_min = jnp.min(jnp.where(k_valid_bnk, k_pos, big), axis=-1)  # [B, nk]
    q_max = jnp.max(q_pos_bnq, axis=-1).astype(jnp.int32)  # [B, nq]
    reach = k_min[:, None, :] <= q_max[:, :, None]
    if window is not None:
        k_max = jnp.max(jnp.where(k_valid_bnk, k_pos, -big), axis=-1)
        q_min = jnp.min(q_pos_bnq, axis=-1).astype(jnp.int32)
        reach = reach & (k_max[:, None, :] > q_min[:, :, None] - window)
    return jnp.any(reach, axis=0)


def same_segment_blocks(q_seg_bnq: Array, k_seg_bnk: Array) -> Array:
    """[n_q_blocks, n_k_blocks] bool for packed rows: False only where, in every row, the key block's segments
    (ids > 0) and the query block's lie in disjoint ranges, so no query may see any key of the block."""
    big = jnp.iinfo(jnp.int32).max // 4
    k_lo = jnp.min(jnp.where(k_seg_bnk > 0, k_seg_bnk, big), axis=-1)  # [B, nk]
    k_hi = jnp.max(jnp.where(k_seg_bnk > 0, k_seg_bnk, -big), axis=-1)
    q_lo = jnp.min(jnp.where(q_seg_bnq > 0, q_seg_bnq, big), axis=-1)  # [B, nq]
    q_hi = jnp.max(jnp.where(q_seg_bnq > 0, q_seg_bnq, -big), axis=-1)
    overlap = (k_lo[:, None, :] <= q_hi[:, :, None]) & (k_hi[:, None, :] >= q_lo[:, :, None])
    return jnp.any(overlap, axis=0)


def _pad_axis1(x: Array, n: int, value=0) -> Array:
    if n == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n)
    return jnp.pad(x, pad, constant_values=value)


def _online_softmax_step(carry, q_bqkge, k_bske, v_bske, q_pos_bq, k_pos_bs, k_valid_bs, q_seg_bq=None, *, scale,
                         window, softcap=None):
    """Fold one key block into the running (integer max m of base-2 scores, sum l, weighted values acc) of one
    query block, all float32.

    m, l: [B, K, G, Q]; acc: [B, K, G, Q, E]. Masked scores are MASK_VALUE (finite), so m is finite after the
    first block and a row that later sees a real key forgets its masked entries (their weight exp(MASK - m) is 0).
    """
    m, l, acc = carry
    s = _log2_scores("bqkge,bske->bkgqs", q_bqkge, k_bske, scale, softcap)
    allowed = allowed_mask(q_pos_bq, k_pos_bs, k_valid_bs, window, q_seg_bq)
    s = jnp.where(allowed[:, None, None, :, :], s, MASK_VALUE)
    m_new = jnp.maximum(m, _integer_max(s)[..., 0])
    p = _weights(s, m_new[..., None])
    correction = jnp.exp2(m - m_new)  # an exact power of two (or 0 from the initial -inf)
    l = l * correction + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgqs,bske->bkgqe", p.astype(v_bske.dtype), v_bske, preferred_element_type=jnp.float32)
    return m_new, l, acc * correction[..., None] + pv


def blocked_attention(q_bthe, k_bske, v_bske, q_pos_bt, k_pos_bs, k_valid_bs, *, scale: float,
                      window: Window = None, block_q: Optional[int] = None,
                      block_k: Optional[int] = None, softcap: Optional[float] = None) -> Array:
    """Query-blocked online-softmax attention (FlashAttention's recurrence in plain JAX). Same result as
    :func:`exact_attention` up to float32 rounding for every query that sees at least one key.

    T and S need not be multiples of the block sizes: queries are padded (rows dropped) and keys padded as
    invalid. A query that no reachable key block serves gets zeros. Block sizes default to BLOCK_Q, BLOCK_K.
    """
    b, t, h, e = q_bthe.shape
    s, kv_heads = k_bske.shape[1], k_bske.shape[2]
    g = h // kv_heads
    bq, bk = min(block_q or BLOCK_Q, t), min(block_k or BLOCK_K, s)
    nq, nk = -(-t // bq), -(-s // bk)
    q = _pad_axis1(q_bthe, nq * bq - t)
    q_pos = _pad_axis1(q_pos_bt, nq * bq - t)
    k = _pad_axis1(k_bske, nk * bk - s)
    v = _pad_axis1(v_bske, nk * bk - s)
    k_pos = _pad_axis1(k_pos_bs, nk * bk - s)
    k_valid = _pad_axis1(k_valid_bs, nk * bk - s, False)

    q_blocks = q.reshape(b, nq, bq, kv_heads, g, e).swapaxes(0, 1)  # [nq, B, bq, K, G, E]
    q_pos_blocks = q_pos.reshape(b, nq, bq)
    k_blocks = k.reshape(b, nk, bk, kv_heads, e).swapaxes(0, 1)  # [nk, B, bk, K, E]
    v_blocks = v.reshape(b, nk, bk, kv_heads, e).swapaxes(0, 1)
    k_pos_blocks = k_pos.reshape(b, nk, bk)
    k_valid_blocks = k_valid.reshape(b, nk, bk)
    q_seg = query_segments(k_valid_bs, t)
    packed = q_seg is not None
    q_seg_blocks = _pad_axis1(q_seg, nq * bq - t).reshape(b, nq, bq) if packed else jnp.zeros((b, nq, 0), jnp.int32)
    reach = reachable_blocks(q_pos_blocks, k_pos_blocks, k_valid_blocks != 0, window)  # [nq, nk]
    if packed:  # texts are contiguous and numbered along the row: a key block wholly of other texts is skipped
        reach = reach & same_segment_blocks(q_seg_blocks, k_valid_blocks)
    step = partial(_online_softmax_step, scale=scale, window=window, softcap=softcap)

    def one_query_block(args):
        q_blk, q_pos_blk, q_seg_blk, reach_row = args
        q_seg_blk = q_seg_blk if packed else None
        init = (jnp.full((b, kv_heads, g, bq), -jnp.inf, jnp.float32),
                jnp.zeros((b, kv_heads, g, bq), jnp.float32),
                jnp.zeros((b, kv_heads, g, bq, e), jnp.float32))

        def body(carry, xs):
            k_blk, v_blk, k_pos_blk, k_valid_blk, reachable = xs
            carry = jax.lax.cond(reachable, lambda c: step(c, q_blk, k_blk, v_blk, q_pos_blk, k_pos_blk, k_valid_blk,
                                                           q_seg_blk), lambda c: c, carry)
            return carry, None

        xs = (k_blocks, v_blocks, k_pos_blocks.swapaxes(0, 1), k_valid_blocks.swapaxes(0, 1), reach_row)
        (_, l, acc), _ = jax.lax.scan(body, init, xs)
        return (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(v_bske.dtype)  # [B, K, G, bq, E]

    out = jax.lax.map(one_query_block, (q_blocks, q_pos_blocks.swapaxes(0, 1), q_seg_blocks.swapaxes(0, 1), reach))
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, h, e)
    return out[:, :t]


# ------------------------------------------------------------------------------------------------ xla / cuDNN
def plain_causal_layout(q_pos_bt: Array, k_pos_bs: Array, k_valid_bs: Array) -> Array:
    """Scalar bool: no cache and every row is [valid tokens at positions 0..n-1 ; right padding].

    Then, for every valid query, our position-id mask equals index-causal attention over the first n keys
    (``is_causal`` with ``key_value_seq_lengths`` = n; a local window becomes an index window).
    """
    if q_pos_bt.shape[1] != k_pos_bs.shape[1]:
        return jnp.asarray(False)
    index = jnp.arange(k_pos_bs.shape[1], dtype=jnp.int32)[None, :]
    n = jnp.sum(k_valid_bs, axis=1, dtype=jnp.int32)[:, None]
    prefix = k_valid_bs == (index < n)
    same_tokens = q_pos_bt == k_pos_bs
    positions = jnp.where(k_valid_bs, k_pos_bs == index, True)
    return jnp.all(prefix & same_tokens & positions)


def is_static(window) -> bool:
    """A window known when traced (None or an int), not a per-layer lookup inside the layer scan."""
    return window is None or isinstance(window, (int, np.integer))


def _cudnn_can_run(head_dim: int, dtype) -> bool:
    """cuDNN flash attention's conditions (16-bit inputs; head dim <= 128 on every GPU generation it supports)."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return half and head_dim % 8 == 0 and head_dim <= 128


def _jax_attention(q_bthe, k_bske, v_bske, q_pos_bt, k_pos_bs, k_valid_bs, *, scale, window, implementation):
    dtype = q_bthe.dtype
    attend = partial(jax.nn.dot_product_attention, q_bthe, k_bske.astype(dtype), v_bske.astype(dtype), scale=scale,
                     implementation=implementation)

    q_seg = query_segments(k_valid_bs, q_bthe.shape[1])

    def general(_):
        return attend(mask=allowed_mask(q_pos_bt, k_pos_bs, k_valid_bs, window, q_seg)[:, None])

    # a cache, a per-layer window table, or packed rows (segments): the mask
    if q_bthe.shape[1] != k_bske.shape[1] or not is_static(window) or q_seg is not None:
        return general(None)

    def plain(_):
        # at least one key per row, so an all-padding batch row stays finite; padding queries are zeroed
        n = jnp.maximum(jnp.sum(k_valid_bs, axis=1, dtype=jnp.int32), 1)
        local = None if window is None else (window - 1, 0)
        return attend(is_causal=True, query_seq_lengths=n, key_value_seq_lengths=n, local_window_size=local)

    return jax.lax.cond(plain_causal_layout(q_pos_bt, k_pos_bs, k_valid_bs), plain, general, None)


def capped_xla_attention(q_bthe, k_bske, v_bske, q_pos_bt, k_pos_bs, k_valid_bs, *, scale: float,
                         window: Window = None, softcap: float) -> Array:
    """The xla kernel for soft-capped scores: ``jax.nn.dot_product_attention``'s XLA formula written out (it has no
    soft cap): float32 scores [B, K, G, T, S] scaled, capped (:func:`soft_capped`) and masked with the float32
    minimum, ``jax.nn.softmax`` in float32, weights rounded to the input dtype, values summed in float32. Quadratic
    in the length, on every backend (cuDNN's kernel has no soft cap in jax's API, so auto never picks xla for a
    capped model)."""
    b, t, h, e = q_bthe.shape
    dtype, kv_heads = q_bthe.dtype, k_bske.shape[2]
    q = q_bthe.reshape(b, t, kv_heads, h // kv_heads, e)
    s = jnp.einsum("btkge,bske->bkgts", q, k_bske.astype(dtype), preferred_element_type=jnp.float32) * scale
    allowed = allowed_mask(q_pos_bt, k_pos_bs, k_valid_bs, window, query_segments(k_valid_bs, t))
    s = jnp.where(allowed[:, None, None], soft_capped(s, softcap), jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(dtype)
    out = jnp.einsum("bkgts,bske->btkge", p, v_bske.astype(dtype), preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, e).astype(v_bske.dtype)


def xla_attention(q_bthe, k_bske, v_bske, q_pos_bt, k_pos_bs, k_valid_bs, *, scale: float,
                  window: Window = None, softcap: Optional[float] = None) -> Array:
    """``jax.nn.dot_product_attention`` with our masking: cuDNN on a CUDA GPU where it can run, jax's XLA version
    on other backends. If cuDNN fails when traced (missing, old GPU, shapes it refuses), the failure is the engine
    step's to handle (:mod:`mia.engine.failsafe`: blocked attention and one warning under auto, an error when
    ``MIA_ATTENTION`` asked for xla); outside an engine step the blocked kernel runs (:func:`failed_outside_step`).

    Valid query rows equal :func:`exact_attention`; padding rows are finite (zeros on the plain-layout branch).
    """
    args = (q_bthe, k_bske, v_bske, q_pos_bt, k_pos_bs, k_valid_bs)
    if softcap is not None:  # neither cuDNN nor jax's XLA version caps scores: the XLA formula, capped
        return capped_xla_attention(*args, scale=scale, window=window, softcap=softcap)
    if jax.default_backend() == "gpu" and _cudnn_can_run(q_bthe.shape[-1], q_bthe.dtype):
        try:
            return _jax_attention(*args, scale=scale, window=window, implementation="cudnn").astype(v_bske.dtype)
        except Exception as e:  # cuDNN missing, too old, or refusing the shapes
            if _USED.get():
                raise  # inside an engine step: its fail-safe wrapper falls back for the whole step
            failed_outside_step("xla", e)  # a model call jitted elsewhere: this call runs blocked
            return blocked_attention(*args, scale=scale, window=window)
    return _jax_attention(*args, scale=scale, window=window, implementation=None).astype(v_bske.dtype)


# ------------------------------------------------------------------------------------------------ splash (TPU)
SPLASH_BLOCKS = (512, 256, 128)  # the largest that divides the length is used for queries and keys
SPLASH_LANES = 128
_MESH: contextvars.ContextVar = contextvars.ContextVar("mia_attention_mesh", default=None)


@contextlib.contextmanager
def bound(var: contextvars.ContextVar, value):
    """``var`` holds ``value`` inside the block (yielded), and what it held before after it."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def over_mesh(mesh):
    """Trace attention for a jitted step over ``mesh`` (axes ``data``, ``model``): kernels that cannot be
    partitioned by XLA (splash's Pallas call) run under ``shard_map`` on it. The engine's step builders wrap
    the traced function in it."""
    return bound(_MESH, mesh)


def traced_over(mesh, fn: Callable) -> Callable:
    """``fn`` traced inside :func:`over_mesh` (``mesh``): what the engine's step builders hand to ``jax.jit``."""
    @wraps(fn)
    def wrapped(*args, **kwargs):
        with over_mesh(mesh):
            return fn(*args, **kwargs)

    return wrapped


def splash_block(length: int) -> Optional[int]:
    """The splash block size for a length: the largest of SPLASH_BLOCKS dividing it, None if none does."""
    return next((b for b in SPLASH_BLOCKS if length % b == 0), None)


def splash_can_run(t: int, s: int) -> bool:
    """Static conditions of the splash kernel: no cache (T = S), a length divisible by 128."""
    return t == s and splash_block(t) is not None


def index_aligned(q_pos_bt: Array, k_pos_bs: Array, k_valid_bs: Array) -> Array:
    """Scalar bool: (T = S and) q_pos = k_pos, and in every row the keys of each segment (the valid keys, or the
    keys of one packed text; ids > 0) are contiguous with positions = index + a per-segment constant.

    Then, with segment ids 1 = valid / 0 = padding (or the packed ids), index-causal attention within a segment
    (and an index window) allows exactly what the position-id rule allows for every query that has a segment.
    """
    seg = k_valid_bs.astype(jnp.int32)
    live = seg > 0
    index = jnp.arange(seg.shape[1], dtype=jnp.int32)[None, :]
    offset = k_pos_bs.astype(jnp.int32) - index
    # the previous live key of each key (-1: none): for live keys of one segment it must be the key just before
    prev = jax.lax.cummax(jnp.where(live, index, -1), axis=1)
    prev = jnp.concatenate([jnp.full_like(prev[:, :1], -1), prev[:, :-1]], axis=1)
    has_prev = prev >= 0
    at = jnp.maximum(prev, 0)
    prev_seg = jnp.take_along_axis(seg, at, axis=1)
    prev_off = jnp.take_along_axis(offset, at, axis=1)
    same = has_prev & (prev_seg == seg)
    # a live key continues its segment (adjacent, same offset) or opens one never seen before (ids increase)
    ok = ~live | jnp.where(same, (prev == index - 1) & (prev_off == offset), ~has_prev | (prev_seg < seg))
    return jnp.all(ok) & jnp.all(q_pos_bt == k_pos_bs)


def _splash_kernel(heads: int, length: int, window, interpret: bool, softcap: Optional[float] = None):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    shape = (length, length)
    head_mask = sa.CausalMask(shape) if window is None else sa.LocalMask(shape, (int(window) - 1, 0), 0)
    block = splash_block(length)
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=min(block, 512))
    return sa.make_splash_mha(sa.MultiHeadMask([head_mask] * heads), block_sizes=sizes, head_shards=1,
                              q_seq_shards=1, interpret=interpret, attn_logits_soft_cap=softcap)


def splash_per_device(q_bthe, k_bske, v_bske, seg_bt, *, scale, window, interpret, softcap=None):
    """Splash on one device's rows and heads: q [b, T, h, E], k, v [b, T, k, E] (q's dtype), seg [b, T] int32.
    q is scaled in float32 and rounded to its dtype (splash takes no scale), after the transpose to the kernel's
    [b, h, T, E] so that XLA does both in one pass. ``softcap``: splash's own ``attn_logits_soft_cap``, applied to
    the scaled scores before masking."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    kernel = _splash_kernel(q_bthe.shape[2], q_bthe.shape[1], window, interpret, softcap)

    def one_row(q, k, v, seg):  # [h, T, E], [k, T, E], [k, T, E], [T]
        return kernel(q, k, v, segment_ids=SegmentIds(q=seg, kv=seg))

    q = (q_bthe.transpose(0, 2, 1, 3).astype(jnp.float32) * scale).astype(q_bthe.dtype)
    out = jax.vmap(one_row)(q, k_bske.transpose(0, 2, 1, 3),
                            v_bske.transpose(0, 2, 1, 3), seg_bt)
    return out.transpose(0, 2, 1, 3)


def _splash_sharded(q, k, v, seg, *, scale, window, interpret, softcap=None):
    mesh = _MESH.get()
    local = partial(splash_per_device, scale=scale, window=window, interpret=interpret, softcap=softcap)
    if mesh is None or mesh.size == 1:
        return local(q, k, v, seg)
    from jax.sharding import PartitionSpec as P

    axes = dict(mesh.shape)
    rows = "data" if q.shape[0] % axes.get("data", 1) == 0 else None
    m = axes.get("model", 1)
    heads = "model" if q.shape[2] % m == 0 and k.shape[2] % m == 0 else None
    spec = P(rows, None, heads, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P(rows, None)), out_specs=spec,
                         check_vma=False)(q, k, v, seg)


def splash_attention(q_bthe, k_bske, v_bske, q_pos_bt, k_pos_bs, k_valid_bs, *, scale: float,
                     window: Window = None, interpret: Optional[bool] = None,
                     softcap: Optional[float] = None) -> Array:
    """Pallas splash attention (TPU) with our masking; the blocked kernel where it cannot run (see the module
    docstring: statically :func:`splash_can_run`, at run time :func:`index_aligned`). Valid query rows equal
    :func:`exact_attention` to the input dtype's rounding; padding rows are finite.

    ``interpret``: run the Pallas kernel in interpret mode (default: when the backend is not a TPU), which is
    how the tests check it on a CPU.
    """
    args = (q_bthe, k_bske, v_bske, q_pos_bt, k_pos_bs, k_valid_bs)
    b, t, h, e = q_bthe.shape
    if not splash_can_run(t, k_bske.shape[1]):
        return blocked_attention(*args, scale=scale, window=window, softcap=softcap)
    if not is_static(window):  # a per-layer table entry (GPT-Neo): global layers run splash, local ones blocked
        return jax.lax.cond(window >= t,
                            lambda _: splash_attention(*args, scale=scale, interpret=interpret, softcap=softcap),
                            lambda _: blocked_attention(*args, scale=scale, window=window, softcap=softcap), None)
    if interpret is None:
        interpret = lowering_platform() != "tpu"
    dtype = q_bthe.dtype
    seg = k_valid_bs.astype(jnp.int32)

    def splash(_):
        out = _splash_sharded(q_bthe, k_bske.astype(dtype), v_bske.astype(dtype), seg, scale=scale, window=window,
                              interpret=interpret, softcap=softcap)
        return out.astype(v_bske.dtype)

    def blocked(_):
        return blocked_attention(*args, scale=scale, window=window, softcap=softcap)

    return jax.lax.cond(index_aligned(q_pos_bt, k_pos_bs, k_valid_bs), splash, blocked, None)


# ------------------------------------------------------------------------------------------------ dispatch
KERNELS: dict[str, Callable[..., Array]] = {
    "exact": exact_attention,
    "blocked": blocked_attention,
    "xla": xla_attention,
    "splash": splash_attention,
}


def requested_kernel() -> str:
    """``MIA_ATTENTION`` from the environment: auto (default) or one of KERNEL_NAMES."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value != "auto" and value not in KERNEL_NAMES:
        raise ValueError(f"environment variable {ENV_VAR}={value!r}: expected auto, {', '.join(KERNEL_NAMES)}")
    return value


# ------------------------------------------------------------------------------------------------ kernels that fail
# xla (cuDNN) and splash (Mosaic) are not plain JAX: a backend may fail to lower, compile or run them (cuDNN missing
# or too old, a Pallas/Mosaic error, out of VMEM). The engine's steps (mia.engine.failsafe) then mark the kernel
# failed for this process, print one warning line and rebuild the step: from then on auto picks FALLBACK instead.
FALLIBLE = ("xla", "splash")
FALLBACK = "blocked"
_FAILED: dict = {}  # kernel -> reason it failed in this process
_WARNED: set = set()
_USED: contextvars.ContextVar = contextvars.ContextVar("mia_attention_used", default=())  # lists recording kernels
_FORCED: contextvars.ContextVar = contextvars.ContextVar("mia_attention_forced", default=None)


class KernelError(ValueError):
    """The attention kernel that ``MIA_ATTENTION`` asks for cannot run on this backend (one line for the user)."""


def failed_kernels() -> dict:
    """{kernel: reason} of the kernels found not to work in this process (auto no longer picks them)."""
    return dict(_FAILED)


def mark_failed(kernel: str, reason: str) -> bool:
    """Record that ``kernel`` fails here; True when it was not recorded before."""
    new = kernel not in _FAILED
    _FAILED.setdefault(kernel, reason)
    return new


def unmark_failed(kernel: str) -> None:
    _FAILED.pop(kernel, None)


def reset_failed_kernels() -> None:
    """Forget every failure and warning (tests; a new process starts empty)."""
    _FAILED.clear()
    _WARNED.clear()


def failure_reason(error: BaseException, limit: int = 200) -> str:
    """One line naming an exception: its type and its first line (its last line too when the first only announces a
    traceback, as a host callback's error does)."""
    lines = [x.strip() for x in str(error).splitlines() if x.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1 and text.endswith("Traceback (most recent call last):"):
        text = f"{text[:-len('Traceback (most recent call last):')].rstrip()} {lines[-1]}"
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def warn_fallback(kernel: str, reason: str) -> None:
    """``warning: attention kernel K failed on this backend (reason); using blocked`` on stderr, once per kernel."""
    if kernel not in _WARNED:
        _WARNED.add(kernel)
        print(f"warning: attention kernel {kernel} failed on this backend ({reason}); using {FALLBACK}",
              file=sys.stderr)


def explicit_request_error(kernel: str, reason: str) -> KernelError:
    """The error for a kernel ``MIA_ATTENTION`` asked for that failed: it names the variable and the way out."""
    return KernelError(f"attention kernel {kernel} failed on this backend ({reason}); it was asked for by "
                       f"{ENV_VAR}={kernel}: unset {ENV_VAR} (auto falls back to {FALLBACK}) or set "
                       f"{ENV_VAR}={FALLBACK}")


def multiprocess_failure_error(kernels, reason: str, process: int, processes: int) -> KernelError:
    """The error for an auto-picked kernel that failed in one of several processes: no process falls back alone (the
    others would run another program), so it names the way out that every process takes together."""
    names = ", ".join(kernels)
    return KernelError(f"attention kernel {names} failed on this backend in process {process} of {processes} "
                       f"({reason}); with several processes mia does not fall back in one process alone: rerun every "
                       f"process with {ENV_VAR}={FALLBACK}")


def failed_outside_step(kernel: str, error: BaseException) -> None:
    """A kernel failed when traced outside an engine step (a model call the user jitted): raise the error naming
    ``MIA_ATTENTION`` when it asked for the kernel, else record the failure and warn; the caller runs FALLBACK."""
    reason = failure_reason(error)
    if _FORCED.get() == kernel:
        raise error  # pinned by forced_kernel (mia doctor): its caller reports the failure
    if requested_kernel() == kernel:
        raise explicit_request_error(kernel, reason) from error
    mark_failed(kernel, reason)
    warn_fallback(kernel, reason)


@contextlib.contextmanager
def recording_kernels():
    """Yields a list that receives the name of every kernel compiled by attention traced inside (nothing when no
    tracing happens: a jitted call that hits its cache); recordings nest. The engine's fail-safe steps use it to know
    which kernels a fresh program contains."""
    used: list = []
    with bound(_USED, _USED.get() + (used,)):
        yield used


def forced_kernel(kernel: Optional[str]):
    """Attention traced inside uses ``kernel`` (one of KERNEL_NAMES; None: the usual choice), whatever
    ``MIA_ATTENTION`` and the failures recorded here say: ``mia doctor`` checks each kernel this way. A failure of a
    forced kernel is not fallen back from."""
    if kernel is not None and kernel not in KERNEL_NAMES:
        raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {', '.join(KERNEL_NAMES)}")
    return bound(_FORCED, kernel)


def is_forced() -> bool:
    return _FORCED.get() is not None


def splash_partitionable() -> bool:
    """Whether a splash call traced now can be compiled: inside :func:`over_mesh` (the engine's steps run it under
    ``shard_map``), or on one local device when not planning. XLA cannot partition a Pallas call by itself, so a
    model call jitted outside the engine on several chips, or a plan's step not traced over its mesh, gets blocked."""
    return _MESH.get() is not None or (_LOWERING.get() is None and jax.device_count() == 1)


def select_kernel(batch: int, heads: int, t: int, s: int, head_dim: int, dtype, *, backend: Optional[str] = None,
                  requested: Optional[str] = None, window_static: bool = True,
                  softcap: Optional[float] = None) -> str:
    """The kernel name for static shapes (see the module docstring); ``requested`` defaults to the kernel
    :func:`forced_kernel` sets, else MIA_ATTENTION.

    A traced per-layer window (``window_static`` False) does not change the choice: on a GPU the xla kernel then
    passes it in the mask; on a TPU splash runs the layers whose window is global and blocked the local ones.
    Under auto, a kernel that failed on this backend in this process (:func:`failed_kernels`) is replaced by
    FALLBACK, except when planning for another backend (``backend`` given). ``softcap``: see :func:`auto_kernel`.
    """
    requested = requested or _FORCED.get() or requested_kernel()
    if requested != "auto":
        return requested
    kernel = auto_kernel(batch, heads, t, s, head_dim, dtype, backend=backend, softcap=softcap)
    return FALLBACK if backend is None and kernel in _FAILED else kernel


def auto_kernel(batch: int, heads: int, t: int, s: int, head_dim: int, dtype, *,
                backend: Optional[str] = None, softcap: Optional[float] = None) -> str:
    """What auto picks for static shapes on ``backend`` (default: the local one), failures aside.

    Auto picks splash only inside :func:`over_mesh` (the engine's steps, which run it under ``shard_map``) or with
    one device: a model call jitted elsewhere on several TPU chips gets blocked, which XLA partitions itself.
    Soft-capped scores (``softcap``, Gemma-2) never pick xla: cuDNN has no soft cap in jax's API, and the xla kernel's
    capped formula (:func:`capped_xla_attention`) is quadratic; splash caps natively.
    """
    backend = backend or jax.default_backend()
    if backend == "gpu" and t == s and softcap is None and _cudnn_can_run(head_dim, dtype):
        return "xla"
    if backend == "tpu" and splash_can_run(t, s) and splash_partitionable():
        return "splash"
    score_bytes = 4 * batch * heads * t * s
    return "exact" if s <= EXACT_MAX_KEYS and score_bytes <= EXACT_MAX_SCORE_BYTES else "blocked"


# ------------------------------------------------------------------------------------------------ planning
_TARGET: contextvars.ContextVar = contextvars.ContextVar("mia_attention_target", default=None)
_CHOSEN: contextvars.ContextVar = contextvars.ContextVar("mia_attention_chosen", default=None)
_LOWERING: contextvars.ContextVar = contextvars.ContextVar("mia_attention_lowering", default=None)
NEEDS_PLATFORM = {"xla": "gpu", "splash": "tpu"}  # kernels whose target's version lowers only for that platform
STAND_IN = "blocked"  # what a plan off the target compiles in place of a kernel only the target can compile


@contextlib.contextmanager
def planning_for(backend: Optional[str], lowering: Optional[str] = None):
    """Trace attention as it would be chosen on ``backend`` ("cpu", "gpu", "tpu"; None: the local one) and record
    the choices: yields a list that receives one (kernel chosen, kernel compiled) pair per attention call traced
    inside. ``mia plan`` uses it to lower a TPU topology's or a GPU's program on a CPU host. A kernel that cannot
    be compiled off its backend (cuDNN's, planned for "gpu" on a host without one) is replaced by ``STAND_IN``, the
    blocked kernel, whose memory is linear in the length as cuDNN's flash attention is; the pair then differs.

    ``lowering``: the platform the program is compiled for (default: the local backend); a TPU topology's devices
    compile splash's Pallas kernel for a TPU from a CPU host, CPU devices planned for "tpu" compile ``STAND_IN``."""
    chosen: list = []
    target, record, low = _TARGET.set(backend), _CHOSEN.set(chosen), _LOWERING.set(lowering)
    try:
        yield chosen
    finally:
        _TARGET.reset(target)
        _CHOSEN.reset(record)
        _LOWERING.reset(low)


def unrecorded():
    """Attention traced inside is not recorded by an enclosing ``planning_for`` (a module's abstract init)."""
    return bound(_CHOSEN, None)


def lowering_platform() -> str:
    """The platform attention is being compiled for: ``planning_for``'s ``lowering``, else the local backend."""
    return _LOWERING.get() or jax.default_backend()


def dot_product_attention(q_bthe: Array, k_bske: Array, v_bske: Array, q_pos_bt: Array, k_pos_bs: Array,
                          k_valid_bs: Array, *, scale: float, window: Window = None,
                          softcap: Optional[float] = None) -> Array:
    """Causal (by position id) grouped-query attention; scores and softmax in float32. Returns [B, T, H, E].
    ``softcap``: scaled scores soft-capped before masking (:func:`soft_capped`; Gemma-2), in every kernel.

    The kernel is chosen by :func:`select_kernel` when traced (for the backend ``planning_for`` names, if any);
    every kernel agrees with ``exact_attention``.
    """
    b, t, h, e = q_bthe.shape
    target = _TARGET.get()
    kernel = select_kernel(b, h, t, k_bske.shape[1], e, q_bthe.dtype, backend=target,
                           window_static=is_static(window), softcap=softcap)
    compiled = kernel
    if target is not None and target == NEEDS_PLATFORM.get(kernel) and lowering_platform() != target:
        compiled = STAND_IN  # cuDNN's kernel lowers only with a GPU present, splash's only for TPU devices
    chosen = _CHOSEN.get()
    if chosen is not None:
        chosen.append((kernel, compiled))
    for used in _USED.get():
        used.append(compiled)
    capped = {} if softcap is None else {"softcap": softcap}  # every kernel takes it; passed only when set
    return KERNELS[compiled](q_bthe, k_bske, v_bske, q_pos_bt, k_pos_bs, k_valid_bs, scale=scale, window=window,
                             **capped)
