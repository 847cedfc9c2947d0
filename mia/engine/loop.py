"""The host loop: the jitted token-stats step on the model's layout, run over a dataset batch by batch.

``compute_token_stats`` plans length-bucketed batches (``mia.engine.batching``), places the parameters once, keeps
one batch in flight on the device while the host fetches the previous one (``pipelined``), and stores finished
batches in the score cache on a background thread (``mia.engine.cache``), so an interrupted run loses at most the
batches still on the device. With several processes every process runs the same calls and gets every result.
"""
from __future__ import annotations

import functools
from collections import deque
from typing import Callable, Optional, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from ..models.attention import traced_over
from ..models.hub import cached_per_architecture
from .batching import (Batch, PackedBatch, ScoringSettings, put_packed, put_padded, row_cost, token_stats_plan)
from .failsafe import fail_safe
from .cache import BackgroundWriter, StatsCache, cache_label, cacheable, cache_namespace, example_key
from .distributed import any_process
from ..sharding import (batch_sharding, data_size, fetch, gather_outside_layers, layer_gather, mesh_platform, make_mesh,
                       param_shardings, put_params, replicated, start_fetch)
from .stats import STAT_NAMES, canonical_stats, chunk_size, program_stats, token_stats

@functools.lru_cache(maxsize=1)
def default_mesh():
    """All visible devices (of every process) on ``data``."""
    return make_mesh()


@functools.lru_cache(maxsize=32)
def engine_layout(model):
    """(mesh, params shardings) the engine uses for ``model``: the ones it was loaded with (``load(mesh=...)``),
    else the default mesh with parameters replicated. Memoized per Model (Models hash by identity)."""
    mesh = getattr(model, "mesh", None) or default_mesh()
    return mesh, param_shardings(model.params, mesh, fsdp=bool(getattr(model, "fsdp", False)))


def placed_params(model, params=None):
    """``params`` (default ``model.params``) placed with the engine's shardings for ``model``; leaves that are
    already there are returned as they are (no transfer), so call it once per host loop, not per batch."""
    _, shardings = engine_layout(model)
    return put_params(model.params if params is None else params, shardings)


def rows_per_device(batch_rows: int, mesh) -> int:
    return max(1, batch_rows // data_size(mesh))


def mesh_chunk_size(mesh, batch_rows: int, length: int, vocab: int) -> int:
    """``chunk_size`` of a step on ``mesh``: the rows one device holds, and the logits budget of its devices'
    platform (``chunk_budget``), not of the host that traces it (a TPU plan compiled on a CPU host)."""
    return chunk_size(rows_per_device(batch_rows, mesh), length, vocab, platform=mesh_platform(mesh))


def build_token_stats_step(model, mesh, shardings, chunk: Optional[int] = None, stats: tuple = STAT_NAMES):
    """jit of ``token_stats`` with explicit shardings: (params [``shardings``], tokens [B, T] and valid [B, T] rows
    over ``data``) -> {stat: [B, T-1]} (each of ``stats``) replicated on every device. FSDP shards are all-gathered
    one layer at a time inside the layer scan (``sharding.layer_gather``), the other leaves once per call.

    ``model`` needs only ``hidden``/``unembed``/``vocab_size``, and the step can be ``.lower()``ed on
    ``jax.ShapeDtypeStruct`` arguments for abstract devices (compile-only planning). B must divide by ``data``.
    An auto-picked attention kernel that fails here falls back to blocked attention (``mia.engine.failsafe``).
    """
    rows = batch_sharding(mesh)
    layers = model.module.LAYERS
    gather = layer_gather(shardings, layers)

    def step(params, tokens, valid):
        b, t = tokens.shape
        c = chunk or mesh_chunk_size(mesh, b, t - 1, model.vocab_size)
        params = gather_outside_layers(params, shardings, layers)
        return token_stats(model, params, tokens, valid, chunk=c, layer_transform=gather, stats=stats)

    return fail_safe(lambda: jax.jit(traced_over(mesh, step), in_shardings=(shardings, rows, rows),
                                     out_shardings=replicated(mesh)))


@cached_per_architecture()
def jitted_token_stats(model, chunk: Optional[int] = None, stats: tuple = STAT_NAMES):
    """The engine's token-stats step for one Model and one set of statistics, on its layout (``engine_layout``);
    built once for every Model of the same architecture, dtypes and layout (``mia.models.hub.program_model``)."""
    mesh, shardings = engine_layout(model)
    return build_token_stats_step(model, mesh, shardings, chunk, program_stats(stats))


def pipelined(batches, dispatch: Callable, consume: Callable, depth: int = 1) -> None:
    """Asynchronous host loop: ``dispatch(b)`` prepares b's inputs, transfers them and starts the device work
    (jax dispatch returns at once); ``consume(b, host_outputs)`` runs ``depth`` batches behind, so the device
    computes batch i+1 while the host fetches and stores batch i and prepares batch i+2.

    A ``DRAIN`` item in ``batches`` consumes everything in flight first (e.g. before a large new prefix cache).
    """
    inflight: deque = deque()
    for b in batches:
        if b is DRAIN:
            while inflight:
                consume(*_ready(inflight.popleft(), fetch))
            continue
        out = dispatch(b)
        start_fetch(out)
        inflight.append((b, out))
        while len(inflight) > depth:
            consume(*_ready(inflight.popleft(), fetch))
    while inflight:
        consume(*_ready(inflight.popleft(), fetch))


DRAIN = object()


def _ready(item, fetch):
    b, out = item
    return b, fetch(out)


def show_progress(settings: ScoringSettings) -> bool:
    """Progress bars on process 0 only."""
    return settings.progress and jax.process_index() == 0


def compute_token_stats(
    model,
    token_lists: Sequence[np.ndarray],
    settings: ScoringSettings = ScoringSettings(),
    params=None,
    desc: str = "scoring",
    cache_tag: str = "",
    stats=None,
) -> list[dict]:
    """Token stats for each token sequence (each at least 2 tokens): a list of {stat: np.ndarray [T_i - 1]}, one
    entry per statistic of ``stats`` (None: all of ``STAT_NAMES``). The pass computes the log-prob alone when that
    is all that is asked for, else every statistic (``mia.engine.stats.program_stats``), and caches what it computed.
    A cached entry serves any request it covers; an example whose cached entries lack a requested statistic is
    computed again, whole (and stored with every statistic).

    Batches are length-bucketed (one row count per bucket), their rows sharded over the mesh's ``data`` axis,
    parameters placed once with the model's shardings; the next batch is dispatched before the previous one is
    fetched, and cache writes run on a background thread. With ``settings.cache_dir`` set, finished batches are
    stored on disk and reused by later runs (``StatsCache``; only the requested examples are read back). Pass
    ``params`` to score other parameters than ``model.params`` (such results are never cached). With several processes
    every process calls this with
    the same arguments and gets every result.
    """
    limit = getattr(model, "max_tokens", None)
    for i, t in enumerate(token_lists):
        if len(t) < 2:
            raise ValueError(f"example {i} has {len(t)} token(s); at least 2 are needed to score")
        if limit is not None and len(t) > limit:  # never a position the model was not trained at
            raise ValueError(f"example {i} has {len(t)} tokens; the model's context of {limit - 1} positions scores "
                             f"at most {limit} (the last only predicted)")
    cache_dir = settings.cache_dir if settings.cache_dir and cacheable(model, params) else None  # no cache, no hash
    mesh, _ = engine_layout(model)
    params = placed_params(model, params)
    keys = [example_key(t) for t in token_lists]
    with BackgroundWriter() as writer:
        cache = StatsCache(cache_dir, cache_namespace(model, cache_tag) if cache_dir else "", writer,
                           label=cache_label(model, cache_tag) if cache_dir else None)
        stats = canonical_stats(stats)
        program = program_stats(stats)
        cached = cache.lookup(keys, stats)
        results: list[Optional[dict]] = [cached.get(k) for k in keys]
        del cached
        todo = np.flatnonzero(any_process(np.array([r is None for r in results], bool)))
        fn = jitted_token_stats(model, None, program)
        rows_sharding = batch_sharding(mesh)
        lengths = [len(token_lists[i]) for i in todo]
        plan = token_stats_plan(settings, lengths, row_cost(model), data_size(mesh))
        total = sum(lengths)

        def dispatch(batch):
            seqs = [token_lists[todo[m]] for m in batch.members]
            if isinstance(batch, PackedBatch):
                return fn(params, *put_packed(seqs, batch, rows_sharding))
            return fn(params, *put_padded(seqs, batch.rows, batch.length, rows_sharding))

        with tqdm(total=total, desc=desc, unit="tok", disable=not show_progress(settings) or total == 0,
                  leave=False) as bar:
            def consume(batch: Batch, out: dict):
                fresh = {}
                slots = getattr(batch, "slots", None) or [(r, 0) for r in range(len(batch.members))]
                for (r, off), m in zip(slots, batch.members):
                    i = todo[m]
                    n = len(token_lists[i]) - 1
                    fresh[keys[i]] = {s: np.asarray(out[s][r, off:off + n], np.float32) for s in program}
                    results[i] = {s: fresh[keys[i]][s] for s in stats}
                cache.put_many(fresh)
                bar.update(sum(len(token_lists[todo[m]]) for m in batch.members))

            pipelined(plan, dispatch, consume)
    return results  # type: ignore[return-value]
