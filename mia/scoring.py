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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

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


@functools.lru_cache(maxsize=32)
def jitted_token_stats(model, chunk: Optional[int] = None):
    """jit(token_stats) for one Model (Model objects hash by identity)."""
    return jax.jit(lambda params, tokens, valid: token_stats(model, params, tokens, valid, chunk=chunk))


# ------------------------------------------------------------------------------------------------ host loop
@dataclasses.dataclass(frozen=True)
class ScoringSettings:
    """How the host loop batches. None of these change any score (tests check it); they change speed and memory."""

    token_budget: int = 16384  # padded tokens per batch
    min_bucket: int = 16  # lengths are padded up to a power of two >= this
    max_batch: int = 256
    cache_dir: Optional[str] = None  # None: no on-disk cache
    progress: bool = True


def bucket_length(n: int, min_bucket: int = 16) -> int:
    return max(min_bucket, 1 << (max(1, n) - 1).bit_length())


def plan_batches(lengths: Sequence[int], settings: ScoringSettings, n_devices: int = 1) -> list[tuple[int, list[int]]]:
    """Group example indices into (padded_length, [indices]) batches: sorted by length, power-of-two buckets,
    power-of-two batch sizes (a multiple of the device count) so a dataset compiles only a handful of shapes."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches, i = [], 0
    while i < len(order):
        blen = bucket_length(lengths[order[i]], settings.min_bucket)
        cap = max(1, min(settings.max_batch, settings.token_budget // blen))
        cap = 1 << (cap.bit_length() - 1)
        members = []
        while i < len(order) and len(members) < cap and bucket_length(lengths[order[i]], settings.min_bucket) == blen:
            members.append(order[i])
            i += 1
        batches.append((blen, members))
    return batches


def _batch_rows(n: int, n_devices: int) -> int:
    """Rows actually fed: next power of two >= n, and a multiple of the device count."""
    rows = 1 << (max(1, n) - 1).bit_length()
    return int(math.ceil(rows / n_devices) * n_devices)


def data_sharding() -> Optional[NamedSharding]:
    devices = jax.devices()
    if len(devices) == 1:
        return None
    return NamedSharding(Mesh(np.array(devices), ("data",)), PartitionSpec("data"))


def example_key(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).hexdigest()[:24]


class StatsCache:
    """On-disk cache of per-example token stats under ``root/<namespace>/``, one .npz per finished batch.

    A batch is written atomically as soon as it is computed, so an interrupted run loses at most one batch.
    """

    def __init__(self, root: Optional[str], namespace: str):
        self.dir = Path(root) / namespace if root else None
        self.mem: dict[str, dict] = {}
        if self.dir is not None and self.dir.exists():
            for f in sorted(self.dir.glob("part-*.npz")):
                try:
                    with np.load(f) as z:  # each array read once (z[name] decompresses it on every access)
                        keys = json.loads(str(z["keys"]))
                        offsets = z["offsets"]
                        arrays = {s: z[s] for s in STAT_NAMES}
                    for j, k in enumerate(keys):
                        lo, hi = offsets[j], offsets[j + 1]
                        self.mem[k] = {s: arrays[s][lo:hi] for s in STAT_NAMES}
                except Exception:  # a corrupt part (killed mid-write on a filesystem without atomic rename): recompute
                    continue

    def get(self, key: str) -> Optional[dict]:
        return self.mem.get(key)

    def put_many(self, items: dict[str, dict]) -> None:
        self.mem.update(items)
        if self.dir is None or not items:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        keys = list(items)
        offsets = np.cumsum([0] + [len(items[k]["logprob"]) for k in keys])
        arrays = {s: np.concatenate([items[k][s] for k in keys]).astype(np.float32) for s in STAT_NAMES}
        name = hashlib.sha256("".join(keys).encode()).hexdigest()[:16]
        tmp = self.dir / f"tmp-{name}-{os.getpid()}.npz"
        np.savez(tmp, keys=json.dumps(keys), offsets=offsets, **arrays)
        os.replace(tmp, self.dir / f"part-{name}.npz")


def cache_namespace(model, extra: str = "") -> str:
    dtype = str(getattr(model.module, "dtype", "float32"))
    return hashlib.sha256(f"{model.fingerprint}|{dtype}|{STATS_VERSION}|{extra}".encode()).hexdigest()[:20]


def compute_token_stats(
    model,
    token_lists: Sequence[np.ndarray],
    settings: ScoringSettings = ScoringSettings(),
    params=None,
    desc: str = "scoring",
    cache_tag: str = "",
) -> list[dict]:
    """Token stats for each token sequence (each at least 2 tokens): a list of {stat: np.ndarray [T_i - 1]}.

    Batches are length-bucketed and sharded over all visible devices along the batch axis. With
    ``settings.cache_dir`` set, finished batches are stored on disk and reused by later runs. Pass ``params`` to
    score other parameters than ``model.params`` (then give a distinct ``cache_tag`` or no cache_dir).
    """
    from tqdm.auto import tqdm

    params = model.params if params is None else params
    for i, t in enumerate(token_lists):
        if len(t) < 2:
            raise ValueError(f"example {i} has {len(t)} token(s); at least 2 are needed to score")
    cache = StatsCache(settings.cache_dir, cache_namespace(model, cache_tag))
    keys = [example_key(t) for t in token_lists]
    results: list[Optional[dict]] = [cache.get(k) for k in keys]
    todo = [i for i, r in enumerate(results) if r is None]
    sharding = data_sharding()
    n_dev = len(jax.devices())
    fn = jitted_token_stats(model)
    plan = plan_batches([len(token_lists[i]) for i in todo], settings, n_dev)
    total = sum(len(token_lists[i]) for i in todo)
    with tqdm(total=total, desc=desc, unit="tok", disable=not settings.progress or total == 0, leave=False) as bar:
        for blen, members in plan:
            idx = [todo[m] for m in members]
            rows = _batch_rows(len(idx), n_dev)
            tokens = np.zeros((rows, blen), np.int32)
            valid = np.zeros((rows, blen), bool)
            for r, i in enumerate(idx):
                t = np.asarray(token_lists[i])
                tokens[r, : len(t)] = t
                valid[r, : len(t)] = True
            if sharding is not None:
                tokens, valid = jax.device_put(tokens, sharding), jax.device_put(valid, sharding)
            out = jax.device_get(fn(params, tokens, valid))
            fresh = {}
            for r, i in enumerate(idx):
                n = len(token_lists[i]) - 1
                results[i] = {s: np.asarray(out[s][r, :n], np.float32) for s in STAT_NAMES}
                fresh[keys[i]] = results[i]
            cache.put_many(fresh)
            bar.update(sum(len(token_lists[i]) for i in idx))
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
