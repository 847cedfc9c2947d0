"""Generation: sampling continuations from a decoder over its KV cache, in one jitted loop.

Shapes: prompts [B, S] LEFT padded (``valid`` False on pads, so column S - 1 is each prompt's last token), ``n``
samples per prompt give R = B * n rows, each generating at most N (``max_new``) tokens into a fixed [R, N] buffer.

The loop (``decode``, pure, jittable):
  1. prefill: one pass over the prompts -> their KVCache ([L, B, S, K, E]) and the logits at the last prompt token;
     the cache is computed ONCE per prompt and repeated for its n samples (rows b * n .. b * n + n - 1);
  2. the cache is copied into fixed buffers of S + N key slots (slots past the prompt start invalid); token 0 is
     drawn from the prefill logits;
  3. ``lax.while_loop`` over steps 1 .. N - 1: token i - 1 goes through the model at position len(prompt) + i - 1
     attending to the buffer (``models.common`` masks by position ids and validity), its keys/values are written
     into slot S + i - 1, and token i is drawn from its logits. The loop ends when every row is done.

A row is done after it emits an end-of-sequence id (``eos_ids``; the EOS token is kept in the output, as in
transformers) or after ``budget`` tokens (per row, <= N); a done row's later entries are ``pad_id``.

Sampling (``sample_next``) follows transformers' ``generate(do_sample=True)`` warpers in their order: logits /
temperature, then top-k (logits below the k-th largest set to -inf, ties kept), then a categorical draw (inverse
CDF, one uniform per row and step). Greedy is
the argmax (``generate(do_sample=False)``). Each row carries its own PRNG key; the draw for token i uses
``fold_in(row_key, i)``, so a row's tokens depend on its key only, never on the batch it is in. ``generate``
derives row keys from (seed, prompt id, sample index).

On a mesh (``build_decode_step``, the layout the model was loaded with: ``mia.engine.loop.engine_layout``): prompt
rows, and so every per-row array (row keys, budgets, the KV cache's batch axis, the token buffer), are split over
``data``; the parameters stay as the model holds them (tensor parallel over ``model``, FSDP shards all-gathered one
layer at a time inside the layer scan, as in scoring); the KV cache's kv-head axis is split over ``model`` when the
kv-head count divides by it (else whole on every ``model`` device); each step's logits are gathered whole over
``model`` before sampling, so a draw sees the same logits as on one device. ``B`` must divide by the ``data`` size
(``generate`` pads with empty prompts of budget 0 and drops their rows).

Context: a row's positions run to len(prompt) + budget - 1; ``generate`` refuses (``GenerationError``, one line)
any request that would put a token at a position >= the model's context (``Model.max_length``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import NamedSharding, PartitionSpec

from ..models.attention import traced_over
from ..models.common import KVCache
from ..models.hub import cached_per_architecture
from .batching import bucket_length, bucket_rows, pow2_ceil, put_padded
from .failsafe import fail_safe
from .loop import engine_layout, placed_params
from ..sharding import (batch_sharding, data_size, fetch, gather_outside_layers, layer_gather, mesh_axes, put_array,
                       put_rows, replicated)


class GenerationError(ValueError):
    """A generation request the model cannot serve (beyond its context, an empty prompt ...). One line for the user."""


# ------------------------------------------------------------------------------------------------ pure functions
def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> int32 keys in the same order (an involution: applied to its output it gives the bits back)."""
    i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def kth_largest(x_rv: jax.Array, k: int) -> jax.Array:
    """[R] the k-th largest value of each row of float32 [R, V] (ties counted), exactly.

    A 32-step bisection over the values' order-preserving int32 keys for the largest t with count(x >= t) >= k:
    32 vectorised passes over [R, V], several times cheaper on CPU than ``lax.top_k`` (which sorts).
    """
    keys = _sortable(x_rv)
    lo = jnp.full(x_rv.shape[:-1], jnp.iinfo(jnp.int32).min, jnp.int32)  # count(keys >= lo) = V >= k
    hi = jnp.full(x_rv.shape[:-1], jnp.iinfo(jnp.int32).max, jnp.int32)

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + ((lo | hi) & 1)  # ceil((lo + hi) / 2) without overflow
        ok = jnp.sum(keys >= mid[:, None], axis=-1) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return jax.lax.bitcast_convert_type(_sortable(jax.lax.bitcast_convert_type(lo, jnp.float32)), jnp.float32)


def categorical(key: jax.Array, logits_v: jax.Array) -> jax.Array:
    """One draw from softmax(logits) [V] by the inverse CDF: the first index whose cumulative probability exceeds
    u ~ U[0, total). One uniform per row (a Gumbel draw needs V); -inf logits are never drawn."""
    cdf = jnp.cumsum(jax.nn.softmax(logits_v))
    u = jax.random.uniform(key, (), jnp.float32) * cdf[-1]
    return jnp.minimum(jnp.sum(cdf <= u), logits_v.shape[-1] - 1)


def sample_next(logits_rv: jax.Array, keys_r: jax.Array, step, *, temperature, top_k: int, greedy: bool) -> jax.Array:
    """[R] int32 next tokens from float32 logits [R, V].

    ``greedy``: argmax. Otherwise logits / ``temperature``, top-k filter (``top_k`` 0 or >= V: no filter; logits
    below the k-th largest become -inf, ties kept, as transformers' ``TopKLogitsWarper``), then one categorical draw
    per row with ``fold_in(keys_r[r], step)`` (raw uint32 [R, 2] keys).
    """
    logits = logits_rv.astype(jnp.float32)
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / jnp.asarray(temperature, jnp.float32)
    if 0 < top_k < logits.shape[-1]:
        logits = jnp.where(logits < kth_largest(logits, top_k)[:, None], -jnp.inf, logits)
    draw = lambda key, row: categorical(jax.random.fold_in(key, step), row)  # noqa: E731
    return jax.vmap(draw)(keys_r, logits).astype(jnp.int32)


def grow_cache(kv: KVCache, extra: int) -> KVCache:
    """The cache with ``extra`` empty (invalid) key slots appended: keys/values [L, R, S + extra, K, E]."""
    pad_kv = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, extra), (0, 0), (0, 0)))  # noqa: E731
    return KVCache(pad_kv(kv.keys), pad_kv(kv.values), jnp.pad(kv.positions, ((0, 0), (0, extra))),
                   jnp.pad(kv.valid, ((0, 0), (0, extra))))


def repeat_rows(kv: KVCache, n: int) -> KVCache:
    """Each row of the batch ``n`` times in a row (row b -> rows b * n .. b * n + n - 1): keys/values [L, B * n, S, K,
    E]. A broadcast and a reshape, not a gather, so rows split over ``data`` stay on their devices."""
    return KVCache(_repeat(kv.keys, n, 1), _repeat(kv.values, n, 1), _repeat(kv.positions, n, 0),
                   _repeat(kv.valid, n, 0))


def _repeat(a: jax.Array, n: int, axis: int) -> jax.Array:
    """``jnp.repeat(a, n, axis)`` as broadcast + reshape (row-local under a sharding of ``axis``)."""
    if n == 1:
        return a
    wide = jnp.broadcast_to(jnp.expand_dims(a, axis + 1), a.shape[:axis + 1] + (n,) + a.shape[axis + 1:])
    return wide.reshape(a.shape[:axis] + (a.shape[axis] * n,) + a.shape[axis + 1:])


def write_slot(buf: KVCache, new: KVCache, slot) -> KVCache:
    """Write one step's keys/values ([L, R, 1, K, E]), positions and validity ([R, 1]) into key slot ``slot``."""
    put = lambda a, b, axis: jax.lax.dynamic_update_slice_in_dim(a, b.astype(a.dtype), slot, axis)  # noqa: E731
    return KVCache(put(buf.keys, new.keys, 2), put(buf.values, new.values, 2), put(buf.positions, new.positions, 1),
                   put(buf.valid, new.valid, 1))


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Static decoding settings (one compiled program each): buffer length ``max_new``, samples per prompt ``n``,
    ``top_k`` (0: no top-k filter), ``greedy``."""

    max_new: int
    n: int = 1
    top_k: int = 0
    greedy: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Where ``decode`` keeps its arrays on ``mesh`` (see the module docstring): per-row arrays split over ``data``,
    the KV cache's kv heads over ``model`` when they divide, logits whole over ``model``. ``shardings``: the params'
    NamedShardings (FSDP shards are gathered as in scoring: ``gather_outside_layers``, ``layer_gather``)."""

    mesh: object
    shardings: object
    layers: str

    def _put(self, x: jax.Array, *spec) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(*spec)))

    def rows(self, x: jax.Array) -> jax.Array:
        """[R, ...] rows over ``data``, whole over ``model``."""
        return self._put(x, "data", *([None] * (x.ndim - 1)))

    def cache(self, kv: KVCache) -> KVCache:
        """keys/values [L, R, S, K, E]: rows over ``data``, K over ``model`` when it divides; positions/valid rows."""
        heads = "model" if kv.keys.shape[3] % mesh_axes(self.mesh)["model"] == 0 else None
        kv_spec = (None, "data", None, heads, None)
        return KVCache(self._put(kv.keys, *kv_spec), self._put(kv.values, *kv_spec), self.rows(kv.positions),
                       self.rows(kv.valid))

    def params(self, params):
        """The leaves outside the layer stack gathered whole over ``data`` (once per call)."""
        return gather_outside_layers(params, self.shardings, self.layers)

    @property
    def layer_transform(self):
        """One layer's FSDP shards gathered just before it runs (None: nothing is split over ``data``)."""
        return layer_gather(self.shardings, self.layers)


class _OneDevice:
    """``Placement``'s interface doing nothing: ``decode`` traced without a mesh."""

    layer_transform = None

    def rows(self, x):
        return x

    def cache(self, kv):
        return kv

    def params(self, params):
        return params


def row_keys(seed, prompt_ids_b: jax.Array, n: int) -> jax.Array:
    """[B * n, 2] uint32 raw keys: row b * n + j draws with fold_in(fold_in(PRNGKey(seed), prompt_ids_b[b]), j)."""
    base = jax.random.PRNGKey(seed)
    per_prompt = lambda pid: jax.vmap(lambda j: jax.random.fold_in(jax.random.fold_in(base, pid), j))(jnp.arange(n))  # noqa: E731
    return jax.vmap(per_prompt)(prompt_ids_b.astype(jnp.uint32)).reshape(-1, 2)


def decode(model, params, tokens_bs, valid_bs, prompt_ids_b, seed, budget_r, temperature, eos_e, pad_id,
           cfg: Sampling, place: Optional[Placement] = None):
    """Pure: (tokens [B, S] LEFT padded, valid [B, S], prompt ids [B] uint32 and seed (row keys: ``row_keys``),
    budget [R] int32 new tokens per row (<= ``cfg.max_new``), temperature scalar, eos_e [E] int32 ids that end a
    row (-1: unused slot), pad_id scalar filling a row after it is done) -> (generated [R, N] int32, lengths [R]
    int32), R = B * cfg.n.

    Row r continues prompt r // n. ``lengths`` counts each row's tokens up to and including its EOS.
    ``place``: the mesh layout of the intermediates (``Placement``; None: no constraints, one device).
    """
    b, s = tokens_bs.shape
    n_new, r = cfg.max_new, b * cfg.n
    place = _OneDevice() if place is None else place
    gather = place.layer_transform
    params = place.params(params)
    keys_r = place.rows(row_keys(seed, prompt_ids_b, cfg.n))
    eos = jnp.asarray(eos_e, jnp.int32)
    sample = functools.partial(sample_next, temperature=temperature, top_k=cfg.top_k, greedy=cfg.greedy)
    pick = lambda logits_rv, step: sample(place.rows(logits_rv), keys_r, step)  # noqa: E731  (logits whole over model)

    h, kv = model.hidden(params, tokens_bs, valid_bs, layer_transform=gather)
    logits = model.unembed(params, h[:, -1])  # [B, V]
    kv, logits = repeat_rows(place.cache(kv), cfg.n), _repeat(logits, cfg.n, 0)
    start_pos = kv.next_positions()  # [R] position of the first generated token
    buf = place.cache(grow_cache(kv, n_new - 1))

    def emit(i, tok, out, lengths, done):
        """Record token i (pad where done), advance lengths, update done."""
        tok = jnp.where(done, pad_id, tok)
        out = out.at[:, i].set(tok)
        lengths = lengths + (~done).astype(jnp.int32)
        done = done | jnp.isin(tok, eos) | (lengths >= budget_r)
        return tok, out, lengths, done

    done0 = budget_r <= 0
    out0 = place.rows(jnp.full((r, n_new), pad_id, jnp.int32))
    tok, out, lengths, done = emit(0, pick(logits, 0), out0, place.rows(jnp.zeros((r,), jnp.int32)), done0)

    def cond(state):
        i, _, _, _, _, done = state
        return (i < n_new) & ~jnp.all(done)

    def body(state):
        i, tok, buf, out, lengths, done = state
        buf = place.cache(buf)  # pinned at both ends of the carry: else the loop may carry another layout
        pos = (start_pos + i - 1)[:, None]
        h, new = model.hidden(params, tok[:, None], jnp.ones((r, 1), bool), pos, buf, layer_transform=gather)
        buf = place.cache(write_slot(buf, new, s + i - 1))
        tok, out, lengths, done = emit(i, pick(model.unembed(params, h[:, 0]), i), out, lengths, done)
        return i + 1, place.rows(tok), buf, place.rows(out), place.rows(lengths), place.rows(done)

    _, _, _, out, lengths, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), tok, buf, out, lengths, done))
    return out, lengths


def build_decode_step(model, mesh, shardings, cfg: Sampling):
    """jit of ``decode`` with explicit shardings: (params [``shardings``], tokens [B, S], valid [B, S], prompt ids
    [B] and budget [R] rows over ``data``, seed, temperature, eos [E] and pad_id replicated) -> (generated [R, N],
    lengths [R]) replicated on every device. B must divide by the ``data`` size.

    Like ``loop.build_token_stats_step`` it can be ``.lower()``ed on ``jax.ShapeDtypeStruct``s (abstract devices)."""
    rows, rep = batch_sharding(mesh), replicated(mesh)
    place = Placement(mesh, shardings, model.module.LAYERS)

    def step(params, tokens, valid, ids, seed, budget, temperature, eos, pad_id):
        return decode(model, params, tokens, valid, ids, seed, budget, temperature, eos, pad_id, cfg, place)

    return fail_safe(lambda: jax.jit(traced_over(mesh, step),
                                     in_shardings=(shardings, rows, rows, rows, rep, rows, rep, rep, rep),
                                     out_shardings=(rep, rep)))


@cached_per_architecture()
def jitted_decode(model, cfg: Sampling):
    """``decode`` compiled for one model and one ``Sampling`` on the model's layout (``engine_layout``): (params,
    tokens, valid, prompt ids, seed, budget, temperature, eos, pad_id) -> (generated, lengths); built once per
    architecture, dtypes and layout (``mia.models.hub.program_model``)."""
    mesh, shardings = engine_layout(model)
    return build_decode_step(model, mesh, shardings, cfg)


# ------------------------------------------------------------------------------------------------ host loop
def default_eos_ids(model) -> tuple:
    """The model config's ``eos_token_id`` (an int or a list) as a tuple; () when it has none."""
    eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def check_context(model, prompt_lengths: Sequence[int], budgets: Sequence[int]) -> None:
    """Refuse (GenerationError) a row whose last generated token would sit at a position >= the model's context."""
    context = model.max_length
    for i, (p, m) in enumerate(zip(prompt_lengths, budgets)):
        if p < 1:
            raise GenerationError(f"generation: prompt {i} is empty; at least 1 token is needed")
        if p + m > context:
            raise GenerationError(
                f"generation past the model's context: prompt {i} has {p} tokens + {m} new = {p + m} > the "
                f"{context}-token context the model was trained at (max_position_embeddings); ask for at most "
                f"{max(context - p, 0)} new tokens")


def generate(model, prompts: Sequence[np.ndarray], *, max_new: Union[int, Sequence[int]], n: int = 1,
             temperature: float = 1.0, top_k: int = 0, greedy: bool = False, eos_ids: Optional[Sequence[int]] = None,
             seed: int = 0, prompt_ids: Optional[Sequence[int]] = None, params=None, token_budget: int = 1 << 16,
             min_bucket: int = 16) -> list[list[np.ndarray]]:
    """Continue each prompt ``n`` times; returns out[i][j] = sample j of prompt i, int32 [<= max_new] (its EOS
    included when one was drawn, nothing after it).

    ``max_new``: new tokens per prompt (an int, or one per prompt). ``eos_ids`` None: the model config's
    ``eos_token_id``; () never stops early. ``greedy``: argmax (``n`` must be 1). Sampling: ``temperature`` then
    ``top_k`` (0: none), seeded: sample j of prompt i is drawn with fold_in(fold_in(PRNGKey(seed), prompt_ids[i]), j)
    (``prompt_ids`` default 0 .. len - 1), so it does not depend on the order or batching of the prompts.

    Batching: prompts sorted by length into power-of-two length buckets (>= ``min_bucket``), a power-of-two number
    of prompts per data-parallel device per call with at most ``token_budget`` key slots (rows x (S + N)) per device
    (at least one prompt); one program per bucket. On the model's mesh (``load(..., mesh=)``) the prompts of a call
    are split over ``data`` (a call holds a multiple of the ``data`` size; empty prompts fill it, their rows are
    dropped), the parameters stay as placed; the samples are the ones one device draws (``decode``).
    Raises GenerationError past the model's context.
    """
    prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    budgets = [int(max_new)] * len(prompts) if np.ndim(max_new) == 0 else [int(m) for m in max_new]
    if len(budgets) != len(prompts):
        raise GenerationError(f"generation: {len(budgets)} max_new values for {len(prompts)} prompts")
    if n < 1 or (greedy and n != 1):
        raise GenerationError(f"generation: n must be >= 1 (and 1 when greedy), got {n}")
    if not greedy and not temperature > 0:
        raise GenerationError(f"generation: temperature must be > 0 when sampling, got {temperature}")
    if any(m < 0 for m in budgets):
        raise GenerationError("generation: max_new must be >= 0")
    check_context(model, [len(p) for p in prompts], budgets)
    prompt_ids = list(range(len(prompts))) if prompt_ids is None else [int(i) for i in prompt_ids]
    if not prompts:
        return []
    mesh, _ = engine_layout(model)
    params = placed_params(model, params)
    rows_sharding, rep = batch_sharding(mesh), replicated(mesh)
    n_data = data_size(mesh)
    eos = default_eos_ids(model) if eos_ids is None else tuple(int(e) for e in eos_ids)
    cfg = Sampling(max_new=max(1, max(budgets)), n=n, top_k=int(top_k), greedy=bool(greedy))
    eos_e = np.full(pow2_ceil(max(1, len(eos))), -1, np.int32)  # a power-of-two slot count: few programs
    eos_e[:len(eos)] = eos
    pad_id = np.int32(eos[0] if eos else 0)
    scalars = [put_array(np.asarray(x), rep) for x in
               (np.uint32(seed), np.float32(temperature if not greedy else 1.0), eos_e, pad_id)]
    out: list[list[np.ndarray]] = [[] for _ in prompts]
    buckets: dict[int, list[int]] = {}
    for i in sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i)):
        buckets.setdefault(bucket_length(len(prompts[i]), min_bucket), []).append(i)
    fn = jitted_decode(model, cfg)
    for length, members in sorted(buckets.items()):
        per_call = bucket_rows(len(members), max(1, token_budget // (n * (length + cfg.max_new))), n_data)
        for lo in range(0, len(members), per_call):
            chunk = members[lo:lo + per_call]
            ids = np.asarray([prompt_ids[i] for i in chunk] + [0] * (per_call - len(chunk)), np.uint32)
            budget = np.repeat([budgets[i] for i in chunk] + [0] * (per_call - len(chunk)), n).astype(np.int32)
            tokens, valid = put_padded([prompts[i] for i in chunk], per_call, length, rows_sharding, left=True)
            gen, lengths = fetch(fn(params, tokens, valid, put_rows(ids.shape, rows_sharding, lambda r: ids[r]),
                                    scalars[0], put_rows(budget.shape, rows_sharding, lambda r: budget[r]),
                                    *scalars[1:]))
            for k, i in enumerate(chunk):
                out[i] = [np.asarray(gen[k * n + j, :lengths[k * n + j]]) for j in range(n)]
    return out
