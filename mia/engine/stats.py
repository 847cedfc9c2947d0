"""Token statistics of a causal LM: the log-prob primitive every attack builds on.

Convention (docs/algorithms.md, "Conventions"): for tokens t_1..t_T, position i (0-based, i = 0..T-2) of every
output holds the statistics of predicting t_{i+2} from t_{<=i+1}, i.e.
``logprob[:, i] = log_softmax(logits[:, i])[t_{i+1}]`` (0-based tokens). So every per-token array has T-1 columns,
and ``mask[:, i] = valid[:, i+1]``.

Per target token, all float32:
  logprob   log p(x_t | x_<t)
  mean_logp mu_t  = sum_v p_v log p_v      (probability-weighted mean of log p; Min-K%++)
  std_logp  sigma_t = sqrt(sum_v p_v (log p_v - mu_t)^2)
  entropy   H_t = -mu_t
  top1      1.0 when the target token has the largest logit (a tie counts), else 0.0 (EZ-MIA's "error zone" is
            top1 = 0): z_tok - max z == 0 exactly, from the same subtraction as the moments

Statistics on demand: a pass computes only the statistics it is asked for (``stats=``; each attack declares what it
reads). ``logprob`` is always the logit minus the logsumexp (``logprob_from_logits``, as the conditional engine
computes it); the moments come from one fused pass of three sums (``stats_from_logits``) only when an attack reads
one (``program_stats``). A statistic has the same bits whatever else was asked for (tested).

Vocabulary x sequence memory is bounded: ``head_chunks`` applies the LM head to ``chunk`` positions at a time
(``lax.map``), never to the whole [B, T, V] block. Scoring (``token_stats``) and conditional likelihoods
(``mia.engine.conditional``) share it.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

STAT_NAMES = ("logprob", "mean_logp", "std_logp", "entropy", "top1")
CONTINUOUS_STATS = STAT_NAMES[:4]  # the statistics that precision moves a little (top1 flips or not)
_LANES = 128  # vocabulary block of the fused reduction in ``stats_from_logits``


def stats_from_logits(logits_bcv: jax.Array, next_bc: jax.Array) -> dict:
    """Float32 statistics of one chunk of logits [B, C, V] with next tokens [B, C].

    One max pass, then one fused pass of three sums over the vocabulary: with z' = z - max z and e = exp(z'),
    S = sum e, A = sum e z', Q = sum e z'^2, we get log p(tok) = z'_tok - log S, mu = A/S - log S and, since
    log p and z' differ by a constant, sigma^2 = Q/S - (A/S)^2 (the variance of z' under p).
    The three sums are one variadic reduction over blocks of 128 entries (so exp is evaluated once per entry,
    not once per sum) followed by ordinary sums over the blocks (so float32 accuracy stays that of a tree sum).
    """
    zs, blocks = _blocked(logits_bcv)
    e = jnp.exp(blocks)
    ez = e * blocks
    s, a, q = jax.lax.reduce((e, ez, ez * blocks), (0.0, 0.0, 0.0),
                             lambda x, y: (x[0] + y[0], x[1] + y[1], x[2] + y[2]), (blocks.ndim - 1,))
    s, a, q = s.sum(-1), a.sum(-1), q.sum(-1)
    log_s = jnp.log(s)
    z_tok = jnp.take_along_axis(zs, next_bc[..., None].astype(jnp.int32), axis=-1)[..., 0]
    tok = z_tok - log_s
    mean_z = a / s
    mu = mean_z - log_s
    var = jnp.maximum(q / s - jnp.square(mean_z), 0.0)
    return {"logprob": tok, "mean_logp": mu, "std_logp": jnp.sqrt(var), "entropy": -mu,
            "top1": (z_tok == 0.0).astype(jnp.float32)}


def _blocked(logits_bcv: jax.Array) -> tuple:
    """(z - max z [..., V], the same in blocks of 128 [..., V / 128, 128] padded with -1e4) in float32."""
    z = logits_bcv.astype(jnp.float32)
    zs = z - jnp.max(z, axis=-1, keepdims=True)
    *lead, v = zs.shape
    pad = -v % _LANES
    # padded entries: e = exp(-1e4) = 0 exactly, so they add nothing to any sum
    return zs, jnp.pad(zs, [(0, 0)] * len(lead) + [(0, pad)], constant_values=-1e4).reshape(*lead, -1, _LANES)


def stat_reducer(names: Sequence[str]) -> Callable:
    """The chunk reduction of a pass asked for ``names`` (``program_stats``): {stat: [B, C]} of ``logprob`` alone
    (``logprob_from_logits``: logit minus logsumexp), or of every statistic (the same ``logprob`` beside the fused
    pass's moments, ``stats_from_logits``)."""
    if program_stats(names) == ("logprob",):
        return lambda logits, nxt: {"logprob": logprob_from_logits(logits, nxt)}

    def every_stat(logits_bcv, next_bc):
        return {**stats_from_logits(logits_bcv, next_bc), "logprob": logprob_from_logits(logits_bcv, next_bc)}

    return every_stat


def program_stats(names: Optional[Sequence[str]]) -> tuple:
    """What a pass asked for the statistics ``names`` (None: all) computes: ``("logprob",)`` when that is all, else
    every statistic. Two programs only, because XLA compiles a reduction differently in other company (and drops
    outputs nobody returns), and the last bit of a sum depends on it: so a statistic has the same bits whatever else
    was asked for (tested). The moments cost little beside each other (one fused pass); the log-prob alone costs
    one logsumexp."""
    wanted = canonical_stats(names)
    return ("logprob",) if wanted == ("logprob",) else STAT_NAMES


def canonical_stats(names: Optional[Sequence[str]]) -> tuple:
    """``names`` (None: all) in ``STAT_NAMES`` order, without repeats; ``ValueError`` for an unknown name or none."""
    names = STAT_NAMES if names is None else tuple(names)
    unknown = [n for n in names if n not in STAT_NAMES]
    if unknown or not names:
        raise ValueError(f"token statistics must be a non-empty subset of {', '.join(STAT_NAMES)}; got {names}")
    return tuple(n for n in STAT_NAMES if n in names)


def logprob_from_logits(logits_bcv: jax.Array, next_bc: jax.Array) -> jax.Array:
    """Float32 log p(next) [B, C] of one chunk of logits [B, C, V] (logit minus logsumexp; no other statistic)."""
    logits = logits_bcv.astype(jnp.float32)
    tok = jnp.take_along_axis(logits, next_bc[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return tok - jax.nn.logsumexp(logits, axis=-1)


CHUNK_FLOATS = 1 << 25  # one logits chunk on an accelerator: 128 MiB of float32
CHUNK_FLOATS_BY_PLATFORM = {"cpu": 1 << 23}  # 32 MiB: a server CPU's last-level cache


def chunk_budget(platform: Optional[str] = None) -> int:
    """Float32 entries of one logits chunk [B, C, V] on ``platform`` (the devices' kind, e.g. a mesh's
    ``devices.flat[0].platform``; default: jax's default backend). On a CPU 32 MiB, so that the chunk the LM head
    writes is still in the last-level cache when the vocabulary reduction reads it back (a Pythia-70m-shaped model's
    token stats ran 1.09-1.12x faster than at 128 MiB on a 2-core EPYC with 32 MiB of L3; docs/benchmarks.md).
    Elsewhere 128 MiB: accelerator memory is not a cache, and fewer, larger LM-head matmuls keep the chip busy."""
    return CHUNK_FLOATS_BY_PLATFORM.get(platform or jax.default_backend(), CHUNK_FLOATS)


def chunk_size(batch: int, length: int, vocab: int, budget_floats: Optional[int] = None,
               platform: Optional[str] = None) -> int:
    """Positions per logits chunk (a power of two, at most ``length``) so that B * C * V float32 stays under
    ``budget_floats`` (default ``chunk_budget(platform)``)."""
    budget_floats = budget_floats or chunk_budget(platform)
    c = max(1, budget_floats // max(1, batch * vocab))
    return int(min(length, 1 << int(math.floor(math.log2(c)))))


def head_chunks(unembed: Callable, params, h_bnd: jax.Array, next_bn: jax.Array, chunk: int,
                reduce_logits: Callable):
    """Apply the LM head ``chunk`` positions at a time and reduce each chunk's logits right away.

    h [B, N, D], next tokens [B, N] -> ``reduce_logits(logits [B, C, V], next [B, C])`` evaluated on every chunk and
    put back in sequence order: a pytree of [B, N] arrays. Only one chunk's logits exist at a time.
    """
    b, n, d = h_bnd.shape
    n_pad = -n % chunk
    h = jnp.pad(h_bnd, ((0, 0), (0, n_pad), (0, 0)))
    nxt = jnp.pad(next_bn, ((0, 0), (0, n_pad)))
    k = (n + n_pad) // chunk
    h_kbcd = h.reshape(b, k, chunk, d).swapaxes(0, 1)
    nxt_kbc = nxt.reshape(b, k, chunk).swapaxes(0, 1)
    out = jax.lax.map(lambda a: reduce_logits(unembed(params, a[0]), a[1]), (h_kbcd, nxt_kbc))
    return jax.tree_util.tree_map(lambda v: v.swapaxes(0, 1).reshape(b, n + n_pad)[:, :n], out)


def stats_from_hidden(unembed: Callable, params, h_btd: jax.Array, next_bt: jax.Array, chunk: int,
                      stats: Sequence[str] = STAT_NAMES) -> dict:
    """The statistics ``stats`` of every position (``stat_reducer``): h [B, N, D], next tokens [B, N] ->
    {stat: [B, N]}."""
    return head_chunks(unembed, params, h_btd, next_bt, chunk, stat_reducer(stats))


def logprob_from_hidden(unembed: Callable, params, h_bnd: jax.Array, next_bn: jax.Array, chunk: int) -> jax.Array:
    """float32 log p(next | h) [B, N] of every position (``logprob_from_logits``), chunked like the stats."""
    return head_chunks(unembed, params, h_bnd, next_bn, chunk, logprob_from_logits)


def next_token_inputs(tokens_bt: jax.Array, valid_bt: jax.Array) -> tuple:
    """(inputs [B, T-1], their validity [B, T-1], targets [B, T-1], mask [B, T-1] bool) of a next-token pass over
    rows of T tokens: the model reads a token only when the next one is a target of the same text, so a text of n
    tokens feeds n - 1 positions (0 .. n-2) and its last token is only predicted. A text of C + 1 tokens thus fits a
    C-token context (Pythia's 2049-token rows, a testbed's seq_len + 1): C predictions, no position >= C, whatever
    the row's padded length. Tokens not read are padding for the model (position 0 in packed rows, the text's last
    position otherwise: never past it), and no kept output depends on them (the model is causal).

    ``valid``: bool, or int32 segment ids of packed rows (0 padding; ``mia.models.common.is_packed``)."""
    if jnp.issubdtype(valid_bt.dtype, jnp.integer):  # packed rows: a target in the same text as its context
        mask = (valid_bt[:, 1:] == valid_bt[:, :-1]) & (valid_bt[:, 1:] > 0)
        fed = jnp.where(mask, valid_bt[:, :-1], 0)
    else:
        mask = valid_bt[:, 1:] & valid_bt[:, :-1]
        fed = mask
    return tokens_bt[:, :-1], fed, tokens_bt[:, 1:], mask


def token_stats(model, params, tokens_bt: jax.Array, valid_bt: jax.Array, *, chunk: Optional[int] = None,
                layer_transform: Optional[Callable] = None, stats: Sequence[str] = STAT_NAMES) -> dict:
    """Pure: (params, tokens [B, T], valid [B, T]) -> {stat: [B, T-1] float32 for each of ``stats``, "mask":
    [B, T-1] bool}. ``valid``: bool, or int32 segment ids of packed rows (``mia.models.common.is_packed``). The model
    reads T-1 positions (``next_token_inputs``: each text's last token is only predicted).
    ``layer_transform``: see ``Model.hidden`` (the engine gathers FSDP shards one layer at a time with it)."""
    b, t = tokens_bt.shape
    chunk = chunk or chunk_size(b, t - 1, model.vocab_size)
    inputs, fed, targets, mask = next_token_inputs(tokens_bt, valid_bt)
    h, _ = model.hidden(params, inputs, fed, layer_transform=layer_transform)
    out = stats_from_hidden(model.unembed, params, h, targets, chunk, stats)
    out["mask"] = mask
    return out


def pad_stats(stats: Sequence[dict], names: Sequence[str] = STAT_NAMES) -> dict:
    """Stack variable-length per-example stats into [N, L] arrays (zero padded) plus a bool ``mask``."""
    n = len(stats)
    width = max((len(next(iter(s.values()))) for s in stats if s), default=1)
    out = {k: np.zeros((n, width), np.float32) for k in names}
    mask = np.zeros((n, width), bool)
    for i, s in enumerate(stats):
        m = len(next(iter(s.values())))
        for k in names:
            out[k][i, :m] = s[k]
        mask[i, :m] = True
    out["mask"] = mask
    return out
