"""Conditional log-likelihood LL(x | p): the mean log-probability of a target's tokens given a prefix.

Used by ReCaLL (one long prefix, many targets) and EM-MIA (every text as a prefix of every text). The prefix's
keys/values are computed ONCE (``prefix_cache``) and reused for every target batch, so each target costs only its
own tokens' forward pass (attending to the cached prefix), instead of a pass over [prefix ; target].

Convention (ALGORITHMS.md 0, 1.1, 1.2). For a prefix p and target tokens x_1..x_L,
  ``include_first=True``  (ReCaLL, mimir): mean over j = 1..L   of log p(x_j | p, x_<j)   (L terms; x_1 from p)
  ``include_first=False`` (em-mia):       mean over j = 2..L   of log p(x_j | p, x_<j)   (L-1 terms, the same
                                           positions as the unconditional LL(x))
Log-probabilities are float32 whatever the activation dtype.

Layout: a batch of prefixes is LEFT padded ([B, S], ``valid`` False on pads) so that column -1 is each prefix's
last token; targets are RIGHT padded. Attention masks by position ids (``mia.models.common``), so pads never leak.

``loglik_matrix`` is the host loop: LL[p, x] for P prefixes x X targets, length-bucketed (power-of-two shapes, so a
dataset compiles a handful of programs), each prefix group's cache computed once and reused over all target
batches, a progress bar, and an on-disk cache keyed by the model fingerprint and the prefix/target token hashes
(a second EM-MIA run with another initial score makes no model call). ``plain_loglik_matrix`` is the reference
path (concatenate [p ; x], one pass, keep the target positions); tests and ``experiments/bench_attacks.py`` use it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .models.common import KVCache
from .scoring import ScoringSettings, bucket_length, cache_namespace, chunk_size, example_key

CONDLL_VERSION = "1"  # bump when the meaning of cached conditional LLs changes

# Tests replace this with ``chex.assert_max_traces(n=...)`` to count compilations; identity otherwise.
_TRACE_WRAP = lambda f: f  # noqa: E731


# ------------------------------------------------------------------------------------------------ pure functions
@struct.dataclass
class PrefixCache:
    """A processed prefix batch. ``kv``: its KVCache (keys/values [L, B, S, K, E], positions/valid [B, S]).
    ``last_h``: [B, D] final hidden state at the last prefix token, which predicts the first target token."""

    kv: KVCache
    last_h: jax.Array

    @property
    def batch(self) -> int:
        return self.kv.positions.shape[0]

    def broadcast_to(self, batch: int) -> "PrefixCache":
        """Repeat a batch-1 prefix for ``batch`` targets."""
        return PrefixCache(self.kv.broadcast_to(batch), jnp.broadcast_to(self.last_h, (batch,) + self.last_h.shape[1:]))

    def select(self, idx) -> "PrefixCache":
        """Rows ``idx`` ([B'] int) of the prefix batch, e.g. one prefix per target row."""
        return PrefixCache(self.kv.take_rows(idx), jnp.take(self.last_h, idx, axis=0))

    def slice_rows(self, start, size: int) -> "PrefixCache":
        """Rows [start, start + size) of the prefix batch; ``start`` may be traced."""
        return PrefixCache(self.kv.slice_rows(start, size), jax.lax.dynamic_slice_in_dim(self.last_h, start, size, axis=0))


def prefix_cache(model, params, prefix_tokens, valid=None) -> PrefixCache:
    """Pure: prefix tokens [S] or [B, S] (LEFT padded, ``valid`` [B, S]) -> PrefixCache."""
    tokens = jnp.atleast_2d(jnp.asarray(prefix_tokens))
    valid = jnp.ones(tokens.shape, bool) if valid is None else jnp.atleast_2d(jnp.asarray(valid, bool))
    h, kv = model.hidden(params, tokens, valid)
    return PrefixCache(kv, h[:, -1])


def logprob_from_hidden(unembed, params, h_bnd: jax.Array, next_bn: jax.Array, chunk: int) -> jax.Array:
    """float32 log p(next | h) [B, N] with the LM head applied ``chunk`` positions at a time (memory stays flat)."""
    b, n, d = h_bnd.shape
    n_pad = -n % chunk
    h = jnp.pad(h_bnd, ((0, 0), (0, n_pad), (0, 0)))
    nxt = jnp.pad(next_bn, ((0, 0), (0, n_pad)))
    k = (n + n_pad) // chunk

    def one(a):
        logits = unembed(params, a[0]).astype(jnp.float32)
        tok = jnp.take_along_axis(logits, a[1][..., None].astype(jnp.int32), axis=-1)[..., 0]
        return tok - jax.nn.logsumexp(logits, axis=-1)

    out = jax.lax.map(one, (h.reshape(b, k, chunk, d).swapaxes(0, 1), nxt.reshape(b, k, chunk).swapaxes(0, 1)))
    return out.swapaxes(0, 1).reshape(b, n + n_pad)[:, :n]


def conditional_logprobs(model, params, cache: PrefixCache, targets, valid, *, include_first: bool = True,
                         chunk: Optional[int] = None) -> tuple[jax.Array, jax.Array]:
    """Pure: per-target-token log p(x_j | prefix, x_<j) [B, T] float32 and the mask [B, T] of counted terms.

    Only the target tokens go through the model; they attend to the cached prefix. A batch-1 cache is broadcast.
    """
    targets = jnp.asarray(targets)
    valid = jnp.asarray(valid, bool)
    b, t = targets.shape
    if cache.batch != b:
        cache = cache.broadcast_to(b)
    h, _ = model.hidden(params, targets, valid, cache=cache.kv)
    h_prev = jnp.concatenate([cache.last_h[:, None].astype(h.dtype), h[:, :-1]], axis=1)  # row j predicts x_j
    lp = logprob_from_hidden(model.unembed, params, h_prev, targets, chunk or chunk_size(b, t, model.vocab_size))
    first = jnp.full((b, 1), include_first) & valid[:, :1]
    mask = jnp.concatenate([first, valid[:, 1:] & valid[:, :-1]], axis=1)
    return lp, mask


def conditional_loglik(model, params, cache: PrefixCache, targets, valid, *, include_first: bool = True,
                       chunk: Optional[int] = None) -> jax.Array:
    """Pure: [B] mean log p of the target tokens given the cached prefix (see module docstring for the two modes)."""
    lp, mask = conditional_logprobs(model, params, cache, targets, valid, include_first=include_first, chunk=chunk)
    m = mask.astype(jnp.float32)
    return jnp.sum(lp * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


def token_logprobs(model, params, tokens, valid, *, chunk: Optional[int] = None) -> jax.Array:
    """Pure: [B, T-1] float32 log p(t_{i+1} | t_<=i) of a plain pass (no prefix cache)."""
    b, t = tokens.shape
    h, _ = model.hidden(params, tokens, valid)
    return logprob_from_hidden(model.unembed, params, h[:, :-1], tokens[:, 1:], chunk or chunk_size(b, t - 1, model.vocab_size))


@functools.lru_cache(maxsize=32)
def _jit_prefix(model):
    return jax.jit(_TRACE_WRAP(lambda params, tokens, valid: prefix_cache(model, params, tokens, valid)))


@functools.lru_cache(maxsize=32)
def _jit_cond(model, include_first: bool):
    def fn(params, group: PrefixCache, p_idx, tokens, valid):
        return conditional_loglik(model, params, group.slice_rows(p_idx, 1), tokens, valid, include_first=include_first)

    return jax.jit(_TRACE_WRAP(fn))


@functools.lru_cache(maxsize=32)
def _jit_plain(model):
    return jax.jit(_TRACE_WRAP(lambda params, tokens, valid: token_logprobs(model, params, tokens, valid)))


# ------------------------------------------------------------------------------------------------ on-disk cache
class PairCache:
    """LL[p, x] values on disk under ``root/condll-<namespace>/``: one .npz part per flush, written atomically."""

    def __init__(self, root: Optional[str], namespace: str):
        self.dir = Path(root) / f"condll-{namespace}" if root else None
        self.mem: dict[str, dict[str, float]] = {}
        self.pending: list[tuple[str, str, float]] = []
        if self.dir is not None and self.dir.exists():
            for f in sorted(self.dir.glob("part-*.npz")):
                try:
                    with np.load(f) as z:
                        pk, tk = json.loads(str(z["pkeys"])), json.loads(str(z["tkeys"]))
                        for i, j, v in zip(z["pi"], z["ti"], z["v"]):
                            self.mem.setdefault(pk[i], {})[tk[j]] = float(v)
                except Exception:  # a corrupt part: its pairs are recomputed
                    continue

    def get(self, pk: str, tk: str) -> Optional[float]:
        return self.mem.get(pk, {}).get(tk)

    def put(self, pk: str, tk: str, v: float) -> None:
        self.mem.setdefault(pk, {})[tk] = v
        self.pending.append((pk, tk, v))

    def flush(self) -> None:
        if self.dir is None or not self.pending:
            self.pending = []
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        pkeys = sorted({p for p, _, _ in self.pending})
        tkeys = sorted({t for _, t, _ in self.pending})
        pi = {k: i for i, k in enumerate(pkeys)}
        ti = {k: i for i, k in enumerate(tkeys)}
        arrays = dict(pkeys=json.dumps(pkeys), tkeys=json.dumps(tkeys),
                      pi=np.array([pi[p] for p, _, _ in self.pending], np.int32),
                      ti=np.array([ti[t] for _, t, _ in self.pending], np.int32),
                      v=np.array([v for _, _, v in self.pending], np.float32))
        name = hashlib.sha256(("".join(pkeys) + "|" + "".join(tkeys) + str(len(self.pending))).encode()).hexdigest()[:16]
        tmp = self.dir / f"tmp-{name}-{os.getpid()}.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, self.dir / f"part-{name}.npz")
        self.pending = []


def condll_namespace(model, include_first: bool, cache_tag: str = "") -> str:
    return cache_namespace(model, f"condll|{CONDLL_VERSION}|first={int(include_first)}|{cache_tag}")


# ------------------------------------------------------------------------------------------------ host loops
def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def _rows_for(tlen: int, plen: int, settings: ScoringSettings) -> int:
    """Target rows per call: ``token_budget`` target tokens, and at most 2x``token_budget`` prefix+target key
    positions (the broadcast cache and the attention scores scale with rows x (S + T)); a power of two."""
    cap = min(settings.max_batch, settings.token_budget // tlen, (2 * settings.token_budget) // (plen + tlen))
    cap = max(1, cap)
    return 1 << (cap.bit_length() - 1)


def _target_batches(lengths: Sequence[int], rows_of, min_bucket: int) -> list[tuple[int, list[int]]]:
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    out, i = [], 0
    while i < len(order):
        blen = bucket_length(lengths[order[i]], min_bucket)
        cap = rows_of(blen)
        members = []
        while i < len(order) and len(members) < cap and bucket_length(lengths[order[i]], min_bucket) == blen:
            members.append(order[i])
            i += 1
        out.append((blen, members))
    return out


def loglik_matrix(model, prefixes: Sequence[np.ndarray], targets: Sequence[np.ndarray], *, include_first: bool,
                  settings: ScoringSettings = ScoringSettings(), params=None, desc: str = "conditional LL",
                  cache_tag: str = "") -> np.ndarray:
    """LL[p, x] (float32 [P, X]) = mean log p(target x | prefix p) for every pair, prefix caches reused.

    Each prefix needs >= 1 token, each target >= 1 (>= 2 when ``include_first`` is False). With
    ``settings.cache_dir`` set, computed pairs are stored on disk and reused (also by an interrupted run). Pass
    ``params`` to use other parameters than ``model.params`` (then also a distinct ``cache_tag``).
    """
    from tqdm.auto import tqdm

    params = model.params if params is None else params
    prefixes = [np.asarray(p, np.int32) for p in prefixes]
    targets = [np.asarray(t, np.int32) for t in targets]
    for what, seqs, need in (("prefix", prefixes, 1), ("target", targets, 1 if include_first else 2)):
        for i, s in enumerate(seqs):
            if s.ndim != 1 or len(s) < need:
                raise ValueError(f"{what} {i} has {len(s)} token(s); at least {need} needed")
    store = PairCache(settings.cache_dir, condll_namespace(model, include_first, cache_tag))
    pkeys, tkeys = [example_key(p) for p in prefixes], [example_key(t) for t in targets]
    out = np.full((len(prefixes), len(targets)), np.nan, np.float32)
    # unique prefixes/targets that still have missing pairs
    uniq_p: dict[str, int] = {}
    uniq_t: dict[str, int] = {}
    todo: dict[str, set] = {}
    for i, pk in enumerate(pkeys):
        uniq_p.setdefault(pk, i)
        for j, tk in enumerate(tkeys):
            v = store.get(pk, tk)
            if v is None:
                todo.setdefault(pk, set()).add(tk)
                uniq_t.setdefault(tk, j)
    total = sum(len(v) for v in todo.values())
    if total:
        prefix_fn, cond_fn = _jit_prefix(model), _jit_cond(model, bool(include_first))
        mb = settings.min_bucket
        todo_p = sorted(todo, key=lambda k: (len(prefixes[uniq_p[k]]), k))
        # prefix groups: same bucket length, group rows * bucket <= token_budget
        groups, g = [], 0
        while g < len(todo_p):
            plen = bucket_length(len(prefixes[uniq_p[todo_p[g]]]), mb)
            cap = max(1, min(settings.max_batch, settings.token_budget // plen))
            cap = 1 << (cap.bit_length() - 1)
            members = []
            while g < len(todo_p) and len(members) < cap and bucket_length(len(prefixes[uniq_p[todo_p[g]]]), mb) == plen:
                members.append(todo_p[g])
                g += 1
            groups.append((plen, members))
        last_flush = time.monotonic()
        with tqdm(total=total, desc=desc, unit="pair", disable=not settings.progress, leave=False) as bar:
            for plen, members in groups:
                rows = _pow2(len(members))
                ptok = np.zeros((rows, plen), np.int32)
                pval = np.zeros((rows, plen), bool)
                for r, pk in enumerate(members):
                    p = prefixes[uniq_p[pk]]
                    ptok[r, plen - len(p):] = p
                    pval[r, plen - len(p):] = True
                group = prefix_fn(params, ptok, pval)
                need_t = sorted(set().union(*(todo[pk] for pk in members)))
                lengths = [len(targets[uniq_t[tk]]) for tk in need_t]
                for tlen, tmembers in _target_batches(lengths, lambda tl: _rows_for(tl, plen, settings), mb):
                    trows = _pow2(len(tmembers))
                    ttok = np.zeros((trows, tlen), np.int32)
                    tval = np.zeros((trows, tlen), bool)
                    for r, m in enumerate(tmembers):
                        t = targets[uniq_t[need_t[m]]]
                        ttok[r, :len(t)] = t
                        tval[r, :len(t)] = True
                    for r, pk in enumerate(members):
                        want = [m for m in tmembers if need_t[m] in todo[pk]]
                        if not want:
                            continue
                        ll = np.asarray(jax.device_get(cond_fn(params, group, np.int32(r), ttok, tval)))
                        for rr, m in enumerate(tmembers):
                            if need_t[m] in todo[pk]:
                                store.put(pk, need_t[m], float(ll[rr]))
                        bar.update(len(want))
                    if len(store.pending) >= 65536 or time.monotonic() - last_flush > 30:
                        store.flush()
                        last_flush = time.monotonic()
                store.flush()
                last_flush = time.monotonic()
    for i, pk in enumerate(pkeys):
        for j, tk in enumerate(tkeys):
            out[i, j] = store.get(pk, tk)
    return out


def plain_loglik_matrix(model, prefixes: Sequence[np.ndarray], targets: Sequence[np.ndarray], *, include_first: bool,
                        settings: ScoringSettings = ScoringSettings(), params=None, pairs=None) -> np.ndarray:
    """Reference path: LL[p, x] from one plain pass over the concatenation [p ; x] per pair (no cache, no reuse).

    Same bucketing and token budget as the scoring engine. ``pairs`` (list of (p, x)) restricts the work; other
    entries are NaN.
    """
    from .scoring import plan_batches

    params = model.params if params is None else params
    prefixes = [np.asarray(p, np.int32) for p in prefixes]
    targets = [np.asarray(t, np.int32) for t in targets]
    pairs = [(i, j) for i in range(len(prefixes)) for j in range(len(targets))] if pairs is None else list(pairs)
    seqs = [np.concatenate([prefixes[i], targets[j]]) for i, j in pairs]
    out = np.full((len(prefixes), len(targets)), np.nan, np.float32)
    fn = _jit_plain(model)
    for blen, members in plan_batches([len(s) for s in seqs], settings):
        rows = _pow2(len(members))
        tok = np.zeros((rows, blen), np.int32)
        val = np.zeros((rows, blen), bool)
        for r, m in enumerate(members):
            tok[r, :len(seqs[m])] = seqs[m]
            val[r, :len(seqs[m])] = True
        lp = np.asarray(jax.device_get(fn(params, tok, val)))
        for r, m in enumerate(members):
            i, j = pairs[m]
            s = len(prefixes[i]) + (0 if include_first else 1)  # first counted target token's index in [p ; x]
            out[i, j] = lp[r, s - 1: len(seqs[m]) - 1].mean()
    return out
