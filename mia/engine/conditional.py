"""Conditional log-likelihood LL(x | p): the mean log-probability of a target's tokens given a prefix.

Used by ReCaLL (one long prefix, many targets) and EM-MIA (every text as a prefix of every text). The prefix's
keys/values are computed ONCE (``prefix_cache``) and reused for every target batch, so each target costs only its
own tokens' forward pass (attending to the cached prefix), instead of a pass over [prefix ; target].

Convention (docs/algorithms.md: Conventions, ReCaLL, EM-MIA). For a prefix p and target tokens x_1..x_L,
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

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from ..files import cache_limit
from ..files.atomic import save_npz
from ..models.attention import traced_over
from ..models.common import KVCache
from ..models.hub import cached_per_architecture
from .batching import (ScoringSettings, bucket_length, bucket_rows, padded_rows, plan_batches, pow2_ceil, pow2_floor,
                       put_padded)
from .cache import BackgroundWriter, cache_label, cache_namespace, cacheable, example_key, usable_cache_dir
from .distributed import any_process
from .failsafe import fail_safe
from .loop import DRAIN, engine_layout, mesh_chunk_size, pipelined, placed_params, show_progress
from ..sharding import batch_sharding, data_size, gather_outside_layers, layer_gather, replicated
from .stats import chunk_size, logprob_from_hidden, next_token_inputs

CONDLL_VERSION = "3"  # bump when the meaning or numerics of cached conditional LLs change (2: precision policy;
# 3: one attention rounding rule)

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
        return PrefixCache(
            self.kv.slice_rows(start, size), jax.lax.dynamic_slice_in_dim(self.last_h, start, size, axis=0)
        )


def prefix_room(context: int, longest_target: int, wanted: int) -> int:
    """Tokens a prefix may take before targets of at most ``longest_target`` tokens in a ``context``-token model:
    R = min(wanted, max(context - longest_target, context // 2)). No position beyond the context is ever fed: when the
    whole prefix does not fit beside the longest target it is shortened, never below half the context (or
    ``wanted``), and the targets are cut to the rest (``mia.attacks.fit`` applies the rule; ``mia plan`` plans it)."""
    return int(min(wanted, max(context - longest_target, context // 2)))


def prefix_cache(model, params, prefix_tokens, valid=None, layer_transform=None) -> PrefixCache:
    """Pure: prefix tokens [S] or [B, S] (LEFT padded, ``valid`` [B, S]) -> PrefixCache."""
    tokens = jnp.atleast_2d(jnp.asarray(prefix_tokens))
    valid = jnp.ones(tokens.shape, bool) if valid is None else jnp.atleast_2d(jnp.asarray(valid, bool))
    h, kv = model.hidden(params, tokens, valid, layer_transform=layer_transform)
    return PrefixCache(kv, h[:, -1])


def conditional_logprobs(model, params, cache: PrefixCache, targets, valid, *, include_first: bool = True,
                         chunk: Optional[int] = None, layer_transform=None) -> tuple[jax.Array, jax.Array]:
    """Pure: per-target-token log p(x_j | prefix, x_<j) [B, T] float32 and the mask [B, T] of counted terms.

    Only the target tokens go through the model; they attend to the cached prefix. A batch-1 cache is broadcast.
    """
    targets = jnp.asarray(targets)
    valid = jnp.asarray(valid, bool)
    b, t = targets.shape
    if cache.batch != b:
        cache = cache.broadcast_to(b)
    h, _ = model.hidden(params, targets, valid, cache=cache.kv, layer_transform=layer_transform)
    h_prev = jnp.concatenate([cache.last_h[:, None].astype(h.dtype), h[:, :-1]], axis=1)  # row j predicts x_j
    lp = logprob_from_hidden(model.unembed, params, h_prev, targets, chunk or chunk_size(b, t, model.vocab_size))
    first = jnp.full((b, 1), include_first) & valid[:, :1]
    mask = jnp.concatenate([first, valid[:, 1:] & valid[:, :-1]], axis=1)
    return lp, mask


def conditional_loglik(model, params, cache: PrefixCache, targets, valid, *, include_first: bool = True,
                       chunk: Optional[int] = None, layer_transform=None) -> jax.Array:
    """Pure: [B] mean log p of the target tokens given the cached prefix (see module docstring for the two modes)."""
    lp, mask = conditional_logprobs(model, params, cache, targets, valid, include_first=include_first, chunk=chunk,
                                    layer_transform=layer_transform)
    m = mask.astype(jnp.float32)
    return jnp.sum(lp * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


def token_logprobs(model, params, tokens, valid, *, chunk: Optional[int] = None, layer_transform=None,
                   head_params=None) -> jax.Array:
    """Pure: [B, T-1] float32 log p(t_{i+1} | t_<=i) of a plain pass (no prefix cache); the model reads T-1
    positions, each text's last token only predicted (``stats.next_token_inputs``). ``layer_transform``: see
    ``Model.hidden`` (MoPe perturbs each layer inside the layer scan). ``head_params(params, h) -> params``, if
    given, gives the parameters the LM head uses once the final hidden states ``h`` [B, T-1, D] exist (MoPe draws
    its perturbed head there, so that the copy is not alive during the layer scan)."""
    b, t = tokens.shape
    inputs, fed, targets, _ = next_token_inputs(tokens, valid)
    h, _ = model.hidden(params, inputs, fed, layer_transform=layer_transform)
    if head_params is not None:
        params = head_params(params, h)
    return logprob_from_hidden(model.unembed, params, h, targets, chunk or chunk_size(b, t - 1, model.vocab_size))


def prefix_shardings(model, mesh, params=None):
    """Shardings of a PrefixCache on ``mesh``: keys/values [L, G, S, K, E] split over ``model`` by kv heads when K
    divides, everything else replicated (every device holds every prefix of a group; targets are split by rows).
    ``params``: the parameters' pytree or its ``jax.ShapeDtypeStruct``s (default ``model.params``)."""
    model_size = dict(mesh.shape).get("model", 1)
    params = model.params if params is None else params
    shapes = jax.eval_shape(lambda p: prefix_cache(model, p, jnp.zeros((1, 2), jnp.int32)), params)
    heads = jax.tree_util.tree_leaves(shapes.kv.keys)[0].shape[-2]
    kv = (NamedSharding(mesh, PartitionSpec(*([None] * (shapes.kv.keys.ndim - 2)), "model", None))
          if model_size > 1 and heads % model_size == 0 else replicated(mesh))
    rep = replicated(mesh)
    return PrefixCache(KVCache(kv, kv, rep, rep), rep)


def build_prefix_step(model, mesh, shardings, cache_shardings: PrefixCache):
    """jit of the prefix pass with explicit shardings: (params [``shardings``], tokens [G, S] and valid [G, S],
    replicated, LEFT padded) -> PrefixCache [``cache_shardings``]; every device computes the whole (small) group.

    Like ``loop.build_token_stats_step``, it can be ``.lower()``ed on ``jax.ShapeDtypeStruct``s for abstract devices
    (``mia plan``): the engine (``jitted_prefix``) and the planner build the step here, so they cannot differ."""
    layers = model.module.LAYERS
    gather = layer_gather(shardings, layers)
    fn = lambda params, tokens, valid: prefix_cache(  # noqa: E731
        model, gather_outside_layers(params, shardings, layers), tokens, valid, gather)
    return fail_safe(lambda: jax.jit(_TRACE_WRAP(traced_over(mesh, fn)),
                                     in_shardings=(shardings, replicated(mesh), replicated(mesh)),
                                     out_shardings=cache_shardings))


def build_cond_step(model, mesh, shardings, cache_shardings: PrefixCache, include_first: bool):
    """jit of one conditional-LL call: (params, prefix group [G, S] [``cache_shardings``], p_idx int32 scalar,
    targets [B, T], valid [B, T]) -> [B] LL(target | prefix p_idx), target rows over ``data`` (B must divide by it),
    the result replicated. Shared by the engine (``jitted_conditional``) and ``mia plan``, as ``build_prefix_step``."""
    rows = batch_sharding(mesh)
    layers = model.module.LAYERS
    gather = layer_gather(shardings, layers)

    def fn(params, group: PrefixCache, p_idx, tokens, valid):
        b, t = tokens.shape
        chunk = mesh_chunk_size(mesh, b, t, model.vocab_size)
        params = gather_outside_layers(params, shardings, layers)
        return conditional_loglik(model, params, group.slice_rows(p_idx, 1), tokens, valid,
                                  include_first=include_first, chunk=chunk, layer_transform=gather)

    return fail_safe(lambda: jax.jit(_TRACE_WRAP(lambda *a: fn(*a)),
                                     in_shardings=(shardings, cache_shardings, replicated(mesh), rows, rows),
                                     out_shardings=replicated(mesh)))


@cached_per_architecture()
def jitted_prefix(model):
    """The prefix pass on the engine's layout (``build_prefix_step``), built once per architecture, dtypes and
    layout (``mia.models.hub.program_model``), as the two below."""
    mesh, shardings = engine_layout(model)
    return build_prefix_step(model, mesh, shardings, prefix_shardings(model, mesh))


@cached_per_architecture()
def jitted_conditional(model, include_first: bool):
    """The conditional-LL call on the engine's layout (``build_cond_step``)."""
    mesh, shardings = engine_layout(model)
    return build_cond_step(model, mesh, shardings, prefix_shardings(model, mesh), include_first)


@cached_per_architecture()
def jitted_token_logprobs(model):
    """``token_logprobs`` jitted for ``model`` (a plain pass, no prefix cache; default placement)."""
    return fail_safe(lambda: jax.jit(_TRACE_WRAP(lambda params, tokens, valid: token_logprobs(model, params, tokens,
                                                                                             valid))))


# ------------------------------------------------------------------------------------------------ on-disk cache
class PairCache:
    """LL[p, x] values on disk under ``root/condll-<namespace>/``: one .npz part per flush, written atomically
    (``mia.files.atomic``), and the pairs in memory.

    Only the pairs of the run's prefixes x targets (``prefixes``/``targets``: key sets; None: all) are kept when
    the parts are read, so memory is bounded by the run, not by the cache. A damaged part (unreadable zip, a CRC
    error, indices out of range) is reported by one ``warning:`` line and its pairs are recomputed.
    """
    def __init__(self, root: Optional[str], namespace: str, writer=None, prefixes=None, targets=None, label=None):
        self.dir = usable_cache_dir(Path(root) / f"condll-{namespace}" if root else None)
        self.label = label  # <dir>/namespace.json, written when missing at a flush (``mia cache info``)
        self.writer = writer  # a scoring.BackgroundWriter: parts are written off the scoring loop
        self.mem: dict[str, dict[str, float]] = {}
        self.pending: list[tuple[str, str, float]] = []
        if self.dir is not None and self.dir.is_dir():
            for f in sorted(self.dir.glob("part-*.npz")):
                self._read_part(f, prefixes, targets)

    def _read_part(self, f: Path, prefixes, targets) -> None:
        try:
            with np.load(f, allow_pickle=False) as z:
                pk, tk = json.loads(str(z["pkeys"])), json.loads(str(z["tkeys"]))
                pi, ti, v = z["pi"], z["ti"], z["v"]
            if not (pi.shape == ti.shape == v.shape and pi.ndim == 1 and v.dtype == np.float32
                    and ((pi >= 0) & (pi < len(pk))).all() and ((ti >= 0) & (ti < len(tk))).all()):
                raise ValueError("arrays do not fit together")
        except FileNotFoundError:
            return  # evicted since the directory was listed: recomputed
        except Exception as e:  # zipfile, json and numpy raise many types; a damaged part is recomputed
            print(f"warning: cache file {f} is damaged ({type(e).__name__}: {e}); its entries are recomputed",
                  file=sys.stderr)
            return
        keep_p = np.array([prefixes is None or k in prefixes for k in pk], bool)
        keep_t = np.array([targets is None or k in targets for k in tk], bool)
        kept = np.flatnonzero(keep_p[pi] & keep_t[ti])
        for n in kept:
            self.mem.setdefault(pk[pi[n]], {}).setdefault(tk[ti[n]], float(v[n]))
        if len(kept):
            cache_limit.touch(f)  # recency for LRU eviction

    def get(self, pk: str, tk: str) -> Optional[float]:
        return self.mem.get(pk, {}).get(tk)

    def put(self, pk: str, tk: str, v: float) -> None:
        self.mem.setdefault(pk, {})[tk] = v
        self.pending.append((pk, tk, v))

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        if self.dir is None or not pending:
            return
        if self.label is not None:  # again when eviction emptied the directory and removed it
            cache_limit.write_label(self.dir, self.label)
        job = lambda: self._write(pending)  # noqa: E731
        self.writer.submit(job) if self.writer is not None else job()

    def _write(self, pending: list) -> None:
        pkeys = sorted({p for p, _, _ in pending})
        tkeys = sorted({t for _, t, _ in pending})
        pi = {k: i for i, k in enumerate(pkeys)}
        ti = {k: i for i, k in enumerate(tkeys)}
        arrays = dict(pkeys=json.dumps(pkeys), tkeys=json.dumps(tkeys),
                      pi=np.array([pi[p] for p, _, _ in pending], np.int32),
                      ti=np.array([ti[t] for _, t, _ in pending], np.int32),
                      v=np.array([v for _, _, v in pending], np.float32))
        name = hashlib.sha256(("".join(pkeys) + "|" + "".join(tkeys) + str(len(pending))).encode()).hexdigest()[:16]
        cache_limit.write_in(self.dir, lambda: save_npz(self.dir / f"part-{name}.npz", **arrays))
        cache_limit.note_write(self.dir.parent, cache_limit.file_size(self.dir / f"part-{name}.npz"))


def condll_namespace(model, include_first: bool, cache_tag: str = "") -> str:
    return cache_namespace(model, f"condll|{CONDLL_VERSION}|first={int(include_first)}|{cache_tag}")


# ------------------------------------------------------------------------------------------------ host loops
def _rows_for(tlen: int, plen: int, settings: ScoringSettings) -> int:
    """Target rows per data-parallel device: ``token_budget`` target tokens, and at most 2x``token_budget``
    prefix+target key positions (the broadcast cache and the attention scores scale with rows x (S + T))."""
    cap = min(settings.max_batch, settings.token_budget // tlen, (2 * settings.token_budget) // (plen + tlen))
    return pow2_floor(max(1, cap))


def _buckets(lengths: dict, min_bucket: int) -> dict[int, list]:
    """{bucket length: keys sorted by (length, key)} for {key: length}."""
    out: dict[int, list] = {}
    for k in sorted(lengths, key=lambda k: (lengths[k], k)):
        out.setdefault(bucket_length(lengths[k], min_bucket), []).append(k)
    return dict(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class _Call:
    """One conditional-LL call: prefix row ``p_row`` of the current group against one target batch."""
    pk: str
    p_row: int
    target_keys: tuple
    arrays: tuple  # (group, p_idx, tokens, valid) on the devices


def loglik_matrix(model, prefixes: Sequence[np.ndarray], targets: Sequence[np.ndarray], *, include_first: bool,
                  settings: ScoringSettings = ScoringSettings(), params=None, desc: str = "conditional LL",
                  cache_tag: str = "") -> np.ndarray:
    """LL[p, x] (float32 [P, X]) = mean log p(target x | prefix p) for every pair, prefix caches reused.

    Each prefix needs >= 1 token, each target >= 1 (>= 2 when ``include_first`` is False). Prefixes are processed
    in groups (one power-of-two row count per prefix length bucket, at most ``token_budget`` tokens, every device
    holding the group's cache); targets in batches whose rows are split over the mesh's ``data`` axis (one row
    count per (prefix bucket, target bucket)). Calls are dispatched one ahead of the fetch; cache parts are written
    on a background thread. With ``settings.cache_dir`` set, computed pairs are stored on disk and reused (also by
    an interrupted run). Pass ``params`` to use other parameters than ``model.params``
    (such results are never cached). With several processes every process calls this with the same arguments and
    gets the matrix.
    """

    prefixes = [np.asarray(p, np.int32) for p in prefixes]
    targets = [np.asarray(t, np.int32) for t in targets]
    for what, seqs, need in (("prefix", prefixes, 1), ("target", targets, 1 if include_first else 2)):
        for i, s in enumerate(seqs):
            if s.ndim != 1 or len(s) < need:
                raise ValueError(f"{what} {i} has {len(s)} token(s); at least {need} needed")
    pkeys, tkeys = [example_key(p) for p in prefixes], [example_key(t) for t in targets]
    p_of = {k: prefixes[i] for i, k in reversed(list(enumerate(pkeys)))}
    t_of = {k: targets[j] for j, k in reversed(list(enumerate(tkeys)))}
    up, ut = sorted(p_of), sorted(t_of)
    with BackgroundWriter() as writer:
        cache_dir = settings.cache_dir if settings.cache_dir and cacheable(model, params) else None  # no cache, no hash
        store = PairCache(cache_dir, condll_namespace(model, include_first, cache_tag) if cache_dir else "", writer,
                          set(pkeys), set(tkeys), label=cache_label(model, f"condll|first={int(include_first)}|"
                                                                            f"{cache_tag}") if cache_dir else None)
        have_not = np.array([[store.get(pk, tk) is None for tk in ut] for pk in up], bool).reshape(len(up), len(ut))
        missing = any_process(have_not)
        todo = {up[a]: {ut[b] for b in np.flatnonzero(missing[a])} for a in range(len(up)) if missing[a].any()}
        total = int(missing.sum())
        if total:
            mesh, _ = engine_layout(model)
            params = placed_params(model, params)
            prefix_fn, cond_fn = jitted_prefix(model), jitted_conditional(model, bool(include_first))
            rows_sharding, rep, n_data = batch_sharding(mesh), replicated(mesh), data_size(mesh)
            need_t = sorted(set().union(*todo.values()))
            t_buckets = _buckets({tk: len(t_of[tk]) for tk in need_t}, settings.min_bucket)

            def calls():
                for plen, pmembers in _buckets({pk: len(p_of[pk]) for pk in todo}, settings.min_bucket).items():
                    grows = min(pow2_floor(max(1, min(settings.max_batch, settings.token_budget // plen))),
                                pow2_ceil(len(pmembers)))
                    p_idx = [jax.device_put(np.int32(r), rep) for r in range(grows)]
                    for g in range(0, len(pmembers), grows):
                        members = pmembers[g:g + grows]
                        yield DRAIN  # one group's cache on the devices at a time
                        ptok = put_padded([p_of[pk] for pk in members], grows, plen, rep, left=True)
                        group = prefix_fn(params, *ptok)
                        for tlen, tmembers in t_buckets.items():
                            rows = bucket_rows(len(tmembers), _rows_for(tlen, plen, settings), n_data)
                            for k in range(0, len(tmembers), rows):
                                batch = tuple(tmembers[k:k + rows])
                                if not any(tk in todo[pk] for pk in members for tk in batch):
                                    continue
                                tok, val = put_padded([t_of[tk] for tk in batch], rows, tlen, rows_sharding)
                                for r, pk in enumerate(members):
                                    if any(tk in todo[pk] for tk in batch):
                                        yield _Call(pk, r, batch, (group, p_idx[r], tok, val))

            with tqdm(total=total, desc=desc, unit="pair", disable=not show_progress(settings), leave=False) as bar:
                def consume(call: _Call, ll: np.ndarray):
                    want = [(rr, tk) for rr, tk in enumerate(call.target_keys) if tk in todo[call.pk]]
                    for rr, tk in want:
                        store.put(call.pk, tk, float(ll[rr]))
                    bar.update(len(want))
                    if len(store.pending) >= 65536:
                        store.flush()

                pipelined(calls(), lambda c: cond_fn(params, *c.arrays), consume)
            store.flush()
    out = np.full((len(prefixes), len(targets)), np.nan, np.float32)
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
    params = model.params if params is None else params
    prefixes = [np.asarray(p, np.int32) for p in prefixes]
    targets = [np.asarray(t, np.int32) for t in targets]
    pairs = [(i, j) for i in range(len(prefixes)) for j in range(len(targets))] if pairs is None else list(pairs)
    seqs = [np.concatenate([prefixes[i], targets[j]]) for i, j in pairs]
    out = np.full((len(prefixes), len(targets)), np.nan, np.float32)
    fn = jitted_token_logprobs(model)
    for batch in plan_batches([len(s) for s in seqs], settings):
        tok, val = padded_rows([seqs[m] for m in batch.members], batch.length, np.arange(batch.rows))
        lp = np.asarray(jax.device_get(fn(params, tok, val)))
        for r, m in enumerate(batch.members):
            i, j = pairs[m]
            s = len(prefixes[i]) + (0 if include_first else 1)  # first counted target token's index in [p ; x]
            out[i, j] = lp[r, s - 1: len(seqs[m]) - 1].mean()
    return out
