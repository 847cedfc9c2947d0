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
from pathlib import Path
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

STAT_NAMES = ("logprob", "mean_logp", "std_logp", "entropy")
STATS_VERSION = "1"  # bump when the meaning of cached statistics changes


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


def token_stats(model, params, tokens_bt: jax.Array, valid_bt: jax.Array, *, chunk: Optional[int] = None) -> dict:
    """Pure: (params, tokens [B, T], valid [B, T]) -> {stat: [B, T-1] float32, "mask": [B, T-1] bool}."""
    b, t = tokens_bt.shape
    chunk = chunk or chunk_size(b, t - 1, model.vocab_size)
    h, _ = model.hidden(params, tokens_bt, valid_bt)
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
    over ``data``) -> {stat: [B, T-1]} replicated on every device.

    ``model`` needs only ``hidden``/``unembed``/``vocab_size``, and the step can be ``.lower()``ed on
    ``jax.ShapeDtypeStruct`` arguments for abstract devices (compile-only planning). B must divide by ``data``.
    """
    from .sharding import batch_sharding, replicated

    rows = batch_sharding(mesh)

    def step(params, tokens, valid):
        b, t = tokens.shape
        c = chunk or chunk_size(rows_per_device(b, mesh), t - 1, model.vocab_size)
        return token_stats(model, params, tokens, valid, chunk=c)

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


def write_npz_atomic(directory: Path, name: str, arrays: dict) -> None:
    """``directory/part-<name>.npz`` written whole or not at all (temporary file, then an atomic rename)."""
    import threading

    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"tmp-{name}-{os.getpid()}-{threading.get_ident()}.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, directory / f"part-{name}.npz")


class StatsCache:
    """On-disk cache of per-example token stats under ``root/<namespace>/``, one .npz per finished batch.

    A batch is written atomically (by ``writer``, a BackgroundWriter, when given) as soon as it is fetched, so an
    interrupted run loses at most the batches still on the device. Every process of a multi-process run writes
    the same parts (same names, same bytes).
    """

    def __init__(self, root: Optional[str], namespace: str, writer: Optional[BackgroundWriter] = None):
        self.dir = Path(root) / namespace if root else None
        self.writer = writer
        self.mem: dict[str, dict] = {}
        if self.dir is not None and self.dir.exists():
            for f in sorted(self.dir.glob("part-*.npz")):
                try:
                    with np.load(f) as z:
                        keys = json.loads(str(z["keys"]))
                        offsets = z["offsets"]
                        for j, k in enumerate(keys):
                            lo, hi = offsets[j], offsets[j + 1]
                            self.mem[k] = {s: z[s][lo:hi] for s in STAT_NAMES}
                except Exception:  # a corrupt part (killed mid-write on a filesystem without atomic rename): recompute
                    continue

    def get(self, key: str) -> Optional[dict]:
        return self.mem.get(key)

    def put_many(self, items: dict[str, dict]) -> None:
        self.mem.update(items)
        if self.dir is None or not items:
            return
        items = dict(items)
        job = lambda: self._write(items)  # noqa: E731
        self.writer.submit(job) if self.writer is not None else job()

    def _write(self, items: dict[str, dict]) -> None:
        keys = list(items)
        offsets = np.cumsum([0] + [len(items[k]["logprob"]) for k in keys])
        arrays = {s: np.concatenate([items[k][s] for k in keys]).astype(np.float32) for s in STAT_NAMES}
        name = hashlib.sha256("".join(keys).encode()).hexdigest()[:16]
        write_npz_atomic(self.dir, name, dict(keys=json.dumps(keys), offsets=offsets, **arrays))


def cache_namespace(model, extra: str = "") -> str:
    dtype = str(getattr(model.module, "dtype", "float32"))
    param_dtype = getattr(model.module, "param_dtype", None)
    if param_dtype is not None and param_dtype != getattr(model.module, "dtype", None):  # e.g. the float16 mode
        dtype += f"|params={param_dtype}"
    return hashlib.sha256(f"{model.fingerprint}|{dtype}|{STATS_VERSION}|{extra}".encode()).hexdigest()[:20]


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
    stored on disk and reused by later runs. Pass ``params`` to score other parameters than ``model.params``
    (then give a distinct ``cache_tag`` or no cache_dir). With several processes every process calls this with
    the same arguments and gets every result.
    """
    from tqdm.auto import tqdm

    from .distributed import any_process
    from .sharding import batch_sharding, data_size

    for i, t in enumerate(token_lists):
        if len(t) < 2:
            raise ValueError(f"example {i} has {len(t)} token(s); at least 2 are needed to score")
    mesh, _ = engine_layout(model)
    params = placed_params(model, params)
    keys = [example_key(t) for t in token_lists]
    with BackgroundWriter() as writer:
        cache = StatsCache(settings.cache_dir, cache_namespace(model, cache_tag), writer)
        results: list[Optional[dict]] = [cache.get(k) for k in keys]
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
