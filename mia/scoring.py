"""The scoring engine: per-token statistics of a causal LM, and the host loop that runs it over a dataset.

Convention (ALGORITHMS.md section 0): for tokens t_1..t_T, position i (0-based, i = 0..T-2) of every output holds
the statistics of predicting t_{i+2} from t_{<=i+1}, i.e. ``logprob[:, i] = log_softmax(logits[:, i])[t_{i+1}]``
(0-based tokens). So every per-token array has T-1 columns, and ``mask[:, i] = valid[:, i+1]``.

Per target token we return, all float32:
  logprob   log p(x_t | x_<t)
  mean_logp mu_t  = sum_v p_v log p_v      (probability-weighted mean of log p; Min-K%++)
  std_logp  sigma_t = sqrt(sum_v p_v (log p_v - mu_t)^2)
  entropy   H_t = -mu_t
Vocabulary x sequence memory is bounded: logits are formed for ``chunk`` positions at a time (lax.map), never for
the whole [B, T, V] block.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import zlib
from pathlib import Path
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .atomic import write_bytes, write_json

STAT_NAMES = ("logprob", "mean_logp", "std_logp", "entropy")
STATS_VERSION = "2"  # bump when the meaning or the numerics of cached statistics change (2: precision policy)


# ------------------------------------------------------------------------------------------------ pure functions
_LANES = 128  # vocabulary block of the fused reduction below


def stats_from_logits(logits_bcv: jax.Array, next_bc: jax.Array) -> dict:
    """Float32 statistics of one chunk of logits [B, C, V] with next tokens [B, C].

    One max pass, then one fused pass of three sums over the vocabulary: with z' = z - max z and e = exp(z'),
    S = sum e, A = sum e z', Q = sum e z'^2, we get log p(tok) = z'_tok - log S, mu = A/S - log S and, since
    log p and z' differ by a constant, sigma^2 = Q/S - (A/S)^2 (the variance of z' under p).
    The three sums are one variadic reduction over blocks of 128 entries (so exp is evaluated once per entry,
    not once per sum) followed by ordinary sums over the blocks (so float32 accuracy stays that of a tree sum).
    """
    z = logits_bcv.astype(jnp.float32)
    zs = z - jnp.max(z, axis=-1, keepdims=True)
    *lead, v = zs.shape
    pad = -v % _LANES
    # padded entries: e = exp(-1e4) = 0 exactly, so they add nothing to S, A or Q
    blocks = jnp.pad(zs, [(0, 0)] * len(lead) + [(0, pad)], constant_values=-1e4).reshape(*lead, -1, _LANES)
    e = jnp.exp(blocks)
    ez = e * blocks
    s, a, q = jax.lax.reduce((e, ez, ez * blocks), (0.0, 0.0, 0.0),
                             lambda x, y: (x[0] + y[0], x[1] + y[1], x[2] + y[2]), (blocks.ndim - 1,))
    s, a, q = s.sum(-1), a.sum(-1), q.sum(-1)
    log_s = jnp.log(s)
    tok = jnp.take_along_axis(zs, next_bc[..., None].astype(jnp.int32), axis=-1)[..., 0] - log_s
    mean_z = a / s
    mu = mean_z - log_s
    var = jnp.maximum(q / s - jnp.square(mean_z), 0.0)
    return {"logprob": tok, "mean_logp": mu, "std_logp": jnp.sqrt(var), "entropy": -mu}


def chunk_size(batch: int, length: int, vocab: int, budget_floats: int = 1 << 25) -> int:
    """Positions per logits chunk so that B * C * V float32 stays under ``budget_floats`` (128 MiB by default)."""
    c = max(1, budget_floats // max(1, batch * vocab))
    return int(min(length, 1 << int(math.floor(math.log2(c)))))


def stats_from_hidden(unembed: Callable, params, h_btd: jax.Array, next_bt: jax.Array, chunk: int) -> dict:
    """Apply the LM head chunk by chunk along the sequence. h [B, N, D], next tokens [B, N] -> dict of [B, N]."""
    b, n, d = h_btd.shape
    n_pad = -n % chunk
    h = jnp.pad(h_btd, ((0, 0), (0, n_pad), (0, 0)))
    nxt = jnp.pad(next_bt, ((0, 0), (0, n_pad)))
    k = (n + n_pad) // chunk
    h_kbcd = h.reshape(b, k, chunk, d).swapaxes(0, 1)
    nxt_kbc = nxt.reshape(b, k, chunk).swapaxes(0, 1)
    out = jax.lax.map(lambda a: stats_from_logits(unembed(params, a[0]), a[1]), (h_kbcd, nxt_kbc))
    return {name: v.swapaxes(0, 1).reshape(b, n + n_pad)[:, :n] for name, v in out.items()}


def token_stats(model, params, tokens_bt: jax.Array, valid_bt: jax.Array, *, chunk: Optional[int] = None,
                layer_transform: Optional[Callable] = None) -> dict:
    """Pure: (params, tokens [B, T], valid [B, T]) -> {stat: [B, T-1] float32, "mask": [B, T-1] bool}.
    ``layer_transform``: see ``Model.hidden`` (the engine gathers FSDP shards one layer at a time with it)."""
    b, t = tokens_bt.shape
    chunk = chunk or chunk_size(b, t - 1, model.vocab_size)
    h, _ = model.hidden(params, tokens_bt, valid_bt, layer_transform=layer_transform)
    out = stats_from_hidden(model.unembed, params, h[:, :-1], tokens_bt[:, 1:], chunk)
    out["mask"] = valid_bt[:, 1:] & valid_bt[:, :-1]
    return out


# ------------------------------------------------------------------------------------------------ layout and steps
@functools.lru_cache(maxsize=1)
def default_mesh():
    """All visible devices (of every process) on ``data``."""
    from .sharding import make_mesh

    return make_mesh()


@functools.lru_cache(maxsize=32)
def engine_layout(model):
    """(mesh, params shardings) the engine uses for ``model``: the ones it was loaded with (``load(mesh=...)``),
    else the default mesh with parameters replicated. Memoized per Model (Models hash by identity)."""
    from .sharding import param_shardings

    mesh = getattr(model, "mesh", None) or default_mesh()
    return mesh, param_shardings(model.params, mesh, fsdp=bool(getattr(model, "fsdp", False)))


def placed_params(model, params=None):
    """``params`` (default ``model.params``) placed with the engine's shardings for ``model``; leaves that are
    already there are returned as they are (no transfer), so call it once per host loop, not per batch."""
    from .sharding import put_params

    _, shardings = engine_layout(model)
    return put_params(model.params if params is None else params, shardings)


def rows_per_device(batch_rows: int, mesh) -> int:
    from .sharding import data_size

    return max(1, batch_rows // data_size(mesh))


def build_token_stats_step(model, mesh, shardings, chunk: Optional[int] = None):
    """jit of ``token_stats`` with explicit shardings: (params [``shardings``], tokens [B, T] and valid [B, T] rows
    over ``data``) -> {stat: [B, T-1]} replicated on every device. FSDP shards are all-gathered one layer at a
    time inside the layer scan (``sharding.layer_gather``), the other leaves once per call.

    ``model`` needs only ``hidden``/``unembed``/``vocab_size``, and the step can be ``.lower()``ed on
    ``jax.ShapeDtypeStruct`` arguments for abstract devices (compile-only planning). B must divide by ``data``.
    """
    from .sharding import batch_sharding, gather_outside_layers, layer_gather, replicated

    rows = batch_sharding(mesh)
    layers = model.module.LAYERS
    gather = layer_gather(shardings, layers)

    def step(params, tokens, valid):
        b, t = tokens.shape
        c = chunk or chunk_size(rows_per_device(b, mesh), t - 1, model.vocab_size)
        params = gather_outside_layers(params, shardings, layers)
        return token_stats(model, params, tokens, valid, chunk=c, layer_transform=gather)

    return jax.jit(step, in_shardings=(shardings, rows, rows), out_shardings=replicated(mesh))


@functools.lru_cache(maxsize=32)
def jitted_token_stats(model, chunk: Optional[int] = None):
    """The engine's token-stats step for one Model, on its layout (``engine_layout``)."""
    mesh, shardings = engine_layout(model)
    return build_token_stats_step(model, mesh, shardings, chunk)


# ------------------------------------------------------------------------------------------------ host loop
@dataclasses.dataclass(frozen=True)
class ScoringSettings:
    """How the host loop batches. None of these change any score (tests check it); they change speed and memory.

    ``token_budget`` and ``max_batch`` are per data-parallel device: 8 devices on ``data`` score 8x the rows.
    """

    token_budget: int = 16384  # padded tokens per batch per data-parallel device
    min_bucket: int = 16  # lengths are padded up to a power of two >= this
    max_batch: int = 256  # rows per batch per data-parallel device
    cache_dir: Optional[str] = None  # None: no on-disk cache
    progress: bool = True


def bucket_length(n: int, min_bucket: int = 16) -> int:
    return max(min_bucket, 1 << (max(1, n) - 1).bit_length())


def pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def pow2_ceil(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Batch:
    """One call of a jitted step: ``rows`` x ``length`` padded tokens holding the examples ``members`` (row order)."""

    length: int
    rows: int
    members: tuple


def bucket_rows(n_examples: int, cap_per_device: int, n_data: int) -> int:
    """Rows of every batch of one length bucket: ``n_data`` x min(cap, the power of two holding the bucket)."""
    per_device = min(pow2_floor(cap_per_device), pow2_ceil(-(-n_examples // n_data)))
    return per_device * n_data


def plan_batches(lengths: Sequence[int], settings: ScoringSettings, n_data: int = 1) -> list[Batch]:
    """Group example indices into batches: sorted by length, power-of-two length buckets, and ONE row count per
    bucket (a multiple of the ``data`` size), so a dataset compiles at most one program per length bucket.

    Rows per bucket: min(token_budget // length, max_batch) per device (rounded down to a power of two), or fewer
    when the whole bucket fits (the power of two holding it), times the ``data`` size.
    """
    buckets: dict[int, list[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        buckets.setdefault(bucket_length(lengths[i], settings.min_bucket), []).append(i)
    batches = []
    for blen, members in sorted(buckets.items()):
        cap = max(1, min(settings.max_batch, settings.token_budget // blen))
        rows = bucket_rows(len(members), cap, n_data)
        batches.extend(Batch(blen, rows, tuple(members[k:k + rows])) for k in range(0, len(members), rows))
    return batches


def padded_rows(seqs: Sequence[np.ndarray], length: int, row_ids: np.ndarray, left: bool = False):
    """tokens [R, length] int32 and valid [R, length] bool for ``row_ids`` into ``seqs`` (ids past the end: padding).

    Right padded, or ``left`` padded (prefixes: the last column is the last token)."""
    tokens = np.zeros((len(row_ids), length), np.int32)
    valid = np.zeros((len(row_ids), length), bool)
    for r, i in enumerate(row_ids):
        if i < len(seqs):
            t = np.asarray(seqs[i])
            sl = slice(length - len(t), length) if left else slice(0, len(t))
            tokens[r, sl] = t
            valid[r, sl] = True
    return tokens, valid


def put_padded(seqs: Sequence[np.ndarray], rows: int, length: int, sharding, left: bool = False):
    """(tokens, valid) global [rows, length] arrays placed with ``sharding``; each process pads only its own rows."""
    from .sharding import put_rows

    return (put_rows((rows, length), sharding, lambda r: padded_rows(seqs, length, r, left)[0]),
            put_rows((rows, length), sharding, lambda r: padded_rows(seqs, length, r, left)[1]))


def pipelined(batches, dispatch: Callable, consume: Callable, depth: int = 1) -> None:
    """Asynchronous host loop: ``dispatch(b)`` prepares b's inputs, transfers them and starts the device work
    (jax dispatch returns at once); ``consume(b, host_outputs)`` runs ``depth`` batches behind, so the device
    computes batch i+1 while the host fetches and stores batch i and prepares batch i+2.

    A ``DRAIN`` item in ``batches`` consumes everything in flight first (e.g. before a large new prefix cache).
    """
    from collections import deque

    from .sharding import fetch, start_fetch

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


class BackgroundWriter:
    """Runs write jobs on one thread, in submission order, off the scoring loop's critical path.

    ``close()`` (also on leaving a ``with`` block, including by KeyboardInterrupt) waits for every submitted job, so
    nothing finished is lost; an error in a job is raised in the caller at the next submit or at close.
    """

    def __init__(self):
        import queue
        import threading

        self._queue: queue.Queue = queue.Queue(maxsize=64)
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="mia-cache-writer", daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._error is None:
                try:
                    job()
                except BaseException as e:  # reported to the caller
                    self._error = e

    def submit(self, job: Callable[[], None]) -> None:
        self._raise()
        self._queue.put(job)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise()

    def _raise(self):
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def example_key(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).hexdigest()[:24]


class StatsCache:
    """On-disk cache of per-example token stats under ``root/<namespace>/`` (``cache_namespace``: the namespace is
    the content address of everything that determines the stats, so an entry is never served for other inputs).

    One part per finished batch, written (by ``writer``, a BackgroundWriter, when given) as soon as it is fetched,
    so an interrupted run loses at most the batches still on the device:
      ``part-<name>.f32``   float32 little-endian [positions, len(STAT_NAMES)]: example j's rows are the
                            contiguous block offsets[j]:offsets[j+1] (its T_j - 1 positions x the stats in order)
      ``part-<name>.json``  the index {"stats", "keys", "offsets", "crc32", "rows"}: crc32[j] covers key j's bytes
                            and then its block's bytes. Written after the data; a part without an index is ignored.
    Both files are written atomically (``mia.atomic``); processes writing the same part write the same bytes.

    Reading (``lookup``) is bounded by what the run asks for: each index is read, then one contiguous read per
    requested example that is there, copied into arrays of exactly its length. A damaged part (unreadable index,
    missing or truncated data, a CRC mismatch) is reported by one ``warning:`` line on stderr and its examples are
    recomputed; nothing from a damaged block is served. ``bytes_read`` counts the bytes read from disk.
    """

    def __init__(self, root: Optional[str], namespace: str, writer: Optional[BackgroundWriter] = None):
        self.dir = Path(root) / namespace if root else None
        self.writer = writer
        self.bytes_read = 0

    def lookup(self, keys: Sequence[str]) -> dict[str, dict]:
        """{key: {stat: float32 [n]}} for those of ``keys`` found intact on disk (the others are absent)."""
        wanted, found = set(keys), {}
        if self.dir is None or not self.dir.is_dir():
            return found
        for index_file in sorted(self.dir.glob("part-*.json")):
            if len(found) == len(wanted):
                break
            try:
                raw = index_file.read_bytes()
                self.bytes_read += len(raw)
                index = _checked_index(json.loads(raw))
            except (OSError, ValueError, TypeError, KeyError) as e:
                _warn_damaged(index_file, f"unreadable index: {e}")
                continue
            todo = [(j, k) for j, k in enumerate(index["keys"]) if k in wanted and k not in found]
            if todo:
                found.update(self._read_rows(index_file.with_suffix(".f32"), index, todo))
        return found

    def _read_rows(self, data_file: Path, index: dict, todo: list) -> dict[str, dict]:
        width = 4 * len(STAT_NAMES)
        out: dict[str, dict] = {}
        try:
            with open(data_file, "rb") as f:
                if os.fstat(f.fileno()).st_size != index["rows"] * width:
                    raise ValueError(f"{os.fstat(f.fileno()).st_size} bytes, the index says {index['rows'] * width}")
                for j, k in todo:
                    lo, hi = index["offsets"][j], index["offsets"][j + 1]
                    f.seek(lo * width)
                    block = f.read((hi - lo) * width)
                    self.bytes_read += len(block)
                    if len(block) != (hi - lo) * width or zlib.crc32(block, zlib.crc32(k.encode())) != index["crc32"][j]:
                        raise ValueError(f"example {k}: checksum mismatch")
                    rows = np.frombuffer(block, "<f4").reshape(hi - lo, len(STAT_NAMES))
                    out[k] = {s: np.array(rows[:, c], np.float32) for c, s in enumerate(STAT_NAMES)}  # own copies
        except (OSError, ValueError) as e:
            _warn_damaged(data_file, str(e))
            return {}
        return out

    def put_many(self, items: dict[str, dict]) -> None:
        """Store {key: {stat: [n]}} as one part (in the background when a writer was given)."""
        if self.dir is None or not items:
            return
        items = dict(items)
        job = lambda: self._write(items)  # noqa: E731
        self.writer.submit(job) if self.writer is not None else job()

    def _write(self, items: dict[str, dict]) -> None:
        keys = list(items)
        blocks = [np.stack([np.asarray(items[k][s], "<f4") for s in STAT_NAMES], axis=1).tobytes() for k in keys]
        offsets = np.cumsum([0] + [len(items[k]["logprob"]) for k in keys]).tolist()
        name = hashlib.sha256("".join(keys).encode()).hexdigest()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        write_bytes(self.dir / f"part-{name}.f32", b"".join(blocks))
        write_json(self.dir / f"part-{name}.json",
                   {"stats": list(STAT_NAMES), "keys": keys, "offsets": offsets, "rows": offsets[-1],
                    "crc32": [zlib.crc32(b, zlib.crc32(k.encode())) for k, b in zip(keys, blocks)]})


def _checked_index(index) -> dict:
    """The part index, or ValueError when its fields do not fit together."""
    keys, offsets, crc = index["keys"], index["offsets"], index["crc32"]
    if index["stats"] != list(STAT_NAMES):
        raise ValueError(f"stats {index['stats']} are not {list(STAT_NAMES)}")
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise ValueError("keys are not a list of strings")
    if not (isinstance(offsets, list) and len(offsets) == len(keys) + 1 and all(type(o) is int for o in offsets)
            and offsets[0] == 0 and all(a < b for a, b in zip(offsets, offsets[1:])) and offsets[-1] == index["rows"]):
        raise ValueError("offsets are not increasing from 0 to rows")
    if not (isinstance(crc, list) and len(crc) == len(keys) and all(type(c) is int for c in crc)):
        raise ValueError("crc32 does not have one integer per key")
    return index


def _warn_damaged(path: Path, reason: str) -> None:
    print(f"warning: cache file {path} is damaged ({reason}); its entries are recomputed", file=sys.stderr)


def cache_namespace(model, extra: str = "") -> str:
    """Content address of every cached result of ``model``: the hex SHA-256 of ``cache_key(model, extra)``."""
    return hashlib.sha256(json.dumps(cache_key(model, extra), sort_keys=True).encode()).hexdigest()[:32]


def cache_key(model, extra: str = "") -> dict:
    """Everything besides the input tokens that determines a cached result of ``model``:

    model        the checkpoint's content address (``mia.models.hub.fingerprint``: every byte of the weights, the
                 config and the tokenizer files; ``params_fingerprint`` for an in-memory model)
    dtypes       the activation dtype, the module's parameter dtype and the dtypes the parameters are held in
    precision    the matmul precision the model runs under (``Model.matmul_precision``)
    attention    the requested attention kernel (``$MIA_ATTENTION``) and the backend (auto dispatch depends on it)
    version      STATS_VERSION (the engine's numerics); ``extra`` carries the caller's own key (attack parameters,
                 the conditional engine's version and mode)
    """
    from .models.attention import requested_kernel

    module = model.module
    return {"model": model.fingerprint, "dtype": str(jnp.dtype(module.dtype)),
            "param_dtype": str(jnp.dtype(getattr(module, "param_dtype", module.dtype))),
            "param_leaf_dtypes": sorted({str(leaf.dtype) for leaf in jax.tree_util.tree_leaves(model.params)}),
            "precision": getattr(model, "matmul_precision", None), "attention": requested_kernel(),
            "backend": jax.default_backend(), "stats_version": STATS_VERSION, "extra": extra}


def cacheable(model, params) -> bool:
    """A result may be cached only under a content address: a model with a fingerprint scored with its own params."""
    return bool(getattr(model, "fingerprint", "")) and params is None


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
) -> list[dict]:
    """Token stats for each token sequence (each at least 2 tokens): a list of {stat: np.ndarray [T_i - 1]}.

    Batches are length-bucketed (one row count per bucket), their rows sharded over the mesh's ``data`` axis,
    parameters placed once with the model's shardings; the next batch is dispatched before the previous one is
    fetched, and cache writes run on a background thread. With ``settings.cache_dir`` set, finished batches are
    stored on disk and reused by later runs (``StatsCache``; only the requested examples are read back). Pass
    ``params`` to score other parameters than ``model.params`` (such results are never cached). With several processes every process calls this with
    the same arguments and gets every result.
    """
    from tqdm.auto import tqdm

    from .distributed import any_process
    from .sharding import batch_sharding, data_size

    for i, t in enumerate(token_lists):
        if len(t) < 2:
            raise ValueError(f"example {i} has {len(t)} token(s); at least 2 are needed to score")
    cache_dir = settings.cache_dir if settings.cache_dir and cacheable(model, params) else None  # no cache, no hash
    mesh, _ = engine_layout(model)
    params = placed_params(model, params)
    keys = [example_key(t) for t in token_lists]
    with BackgroundWriter() as writer:
        cache = StatsCache(cache_dir, cache_namespace(model, cache_tag) if cache_dir else "", writer)
        cached = cache.lookup(keys)
        results: list[Optional[dict]] = [cached.get(k) for k in keys]
        del cached
        todo = np.flatnonzero(any_process(np.array([r is None for r in results], bool)))
        fn = jitted_token_stats(model)
        rows_sharding = batch_sharding(mesh)
        plan = plan_batches([len(token_lists[i]) for i in todo], settings, data_size(mesh))
        total = sum(len(token_lists[i]) for i in todo)

        def dispatch(batch: Batch):
            seqs = [token_lists[todo[m]] for m in batch.members]
            return fn(params, *put_padded(seqs, batch.rows, batch.length, rows_sharding))

        with tqdm(total=total, desc=desc, unit="tok", disable=not show_progress(settings) or total == 0,
                  leave=False) as bar:
            def consume(batch: Batch, out: dict):
                fresh = {}
                for r, m in enumerate(batch.members):
                    i = todo[m]
                    n = len(token_lists[i]) - 1
                    results[i] = {s: np.asarray(out[s][r, :n], np.float32) for s in STAT_NAMES}
                    fresh[keys[i]] = results[i]
                cache.put_many(fresh)
                bar.update(sum(len(token_lists[todo[m]]) for m in batch.members))

            pipelined(plan, dispatch, consume)
    return results  # type: ignore[return-value]


def pad_stats(stats: Sequence[dict], names: Sequence[str] = STAT_NAMES) -> dict:
    """Stack variable-length per-example stats into [N, L] arrays (zero padded) plus a bool ``mask``."""
    n = len(stats)
    width = max((len(s["logprob"]) for s in stats), default=1)
    out = {k: np.zeros((n, width), np.float32) for k in names}
    mask = np.zeros((n, width), bool)
    for i, s in enumerate(stats):
        m = len(s["logprob"])
        for k in names:
            out[k][i, :m] = s[k]
        mask[i, :m] = True
    out["mask"] = mask
    return out
