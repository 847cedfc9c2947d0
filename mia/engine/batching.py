"""Batching: length buckets, one row count per bucket, padded rows placed on the mesh.

Every number here changes speed and memory, never a score (tests check it): rows are padded to a length bucket
(``bucket_length``: powers of two up to ``bucket_step``, multiples of it above) and every batch of a bucket has the
same row count, so a dataset compiles at most one program per bucket. ``token_budget`` and ``max_batch`` count per
data-parallel device.
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import Optional, Sequence

import jax
import numpy as np

from ..sharding import put_rows


@dataclasses.dataclass(frozen=True)
class ScoringSettings:
    """How the host loop batches. None of these change any score (tests check it); they change speed and memory.

    ``token_budget`` and ``max_batch`` are per data-parallel device: 8 devices on ``data`` score 8x the rows.
    """

    token_budget: int = 16384  # padded tokens per batch per data-parallel device
    min_bucket: int = 16  # lengths are padded up to a power of two >= this
    bucket_step: int = 128  # above this length, buckets are multiples of it (0: powers of two only); bucket_length
    max_batch: int = 256  # rows per batch per data-parallel device
    pack: Optional[bool] = None  # token stats: several texts per row (pack_rows). None: auto (packs_rows)
    pack_length: int = 512  # packed rows are at least this long (shorter texts share them)
    cache_dir: Optional[str] = None  # None: no on-disk cache
    progress: bool = True


# Cost of one attention score (one query, one key, one head) beyond its 4 x head-dim matmul FLOPs: mask, exp and
# the float32 score traffic. On the CPU it dominates (XLA:CPU materialises the scores): fitted from one step's time
# at row lengths 128 / 256 / 512 with the same tokens (experiments/bench_padding.py, "row length" table). On GPU/TPU
# flash-style kernels keep scores on chip; 16 is a guess there, not a measurement.
SCORE_OVERHEAD_FLOPS = {"cpu": 1024}
SCORE_OVERHEAD_FLOPS_DEFAULT = 16
# Packing must save at least this fraction of the estimated work: segment masks and the longer rows' attention are
# not free, and the estimate is rough (on the CPU, a model of hidden 256 estimated 3% cheaper packed ran 2% slower).
PACK_MIN_SAVING = 0.05


@dataclasses.dataclass(frozen=True)
class RowCost:
    """Forward cost of one row of T tokens, ``T * (dense + attention * T)`` in FLOP-equivalents: ``dense`` per token
    (2 x the parameters: every weight is one multiply-add per token, the tied LM head counted once) and ``attention``
    per token per key (layers x heads x (4 x head dim + the backend's score overhead)). Only used to compare two
    batch plans of the same texts."""

    dense: float
    attention: float

    def of(self, rows: int, length: int) -> float:
        return rows * length * (self.dense + self.attention * length)


def row_cost(model, backend: Optional[str] = None) -> RowCost:
    """``RowCost`` of a ``mia.models.hub.Model`` on ``backend`` (default ``jax.default_backend()``) from its config
    (shared names: ``num_hidden_layers``, ``num_attention_heads``, ``head_dim`` or ``hidden_size``) and its
    parameter count."""
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(model.params))
    overhead = SCORE_OVERHEAD_FLOPS.get(backend or jax.default_backend(), SCORE_OVERHEAD_FLOPS_DEFAULT)
    return RowCost(2.0 * n_params, float(cfg.num_hidden_layers * heads * (4 * head_dim + overhead)))


def plan_cost(plan: Sequence, cost: RowCost) -> float:
    """Estimated forward cost of a batch plan (``plan_batches`` or ``pack_rows``), empty rows included."""
    return sum(cost.of(b.rows, b.length) for b in plan)


def token_stats_plan(settings: ScoringSettings, lengths: Sequence[int], cost: Optional[RowCost], n_data: int = 1,
                     backend: Optional[str] = None) -> list:
    """The token-stats batches of texts of ``lengths``: packed rows (``pack_rows``) or one text per row
    (``plan_batches``). ``settings.pack`` True / False decides; None (the default) packs when the packed plan's
    estimated cost (``plan_cost``) is at least ``PACK_MIN_SAVING`` below the one-text-per-row plan's, except on a GPU
    (``backend``, default ``jax.default_backend()``): there unpacked rows keep cuDNN's mask-free causal flash
    attention and packing has not been measured. Packing trades padding for attention over ``pack_length`` keys: it
    pays on mixed lengths when the dense layers dominate (real models), not on equal lengths or tiny attention-bound
    models. Each candidate plan is built once."""
    pack = settings.pack
    if pack is None and cost is not None and len(lengths) >= 2 and (backend or jax.default_backend()) != "gpu":
        packed, plain = pack_rows(lengths, settings, n_data), plan_batches(lengths, settings, n_data)
        return packed if plan_cost(packed, cost) < (1 - PACK_MIN_SAVING) * plan_cost(plain, cost) else plain
    return (pack_rows if pack else plan_batches)(lengths, settings, n_data)


def packs_rows(settings: ScoringSettings, lengths: Sequence[int], cost: Optional[RowCost], n_data: int = 1,
               backend: Optional[str] = None) -> bool:
    """Whether ``token_stats_plan`` packs these texts (several per row)."""
    plan = token_stats_plan(settings, lengths, cost, n_data, backend)
    return bool(plan) and isinstance(plan[0], PackedBatch)


def pow2_ceil(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, 1), and at least ``minimum``."""
    return max(minimum, 1 << (max(1, int(n)) - 1).bit_length())


def pow2_floor(n: int) -> int:
    """The largest power of two <= max(n, 1)."""
    return 1 << (max(1, int(n)).bit_length() - 1)


BUCKETS_PER_OCTAVE = 8  # above bucket_step: at most this many buckets between a power of two and its double


def bucket_length(n: int, min_bucket: int = 16, step: int = 0) -> int:
    """The padded length of an n-token row.

    ``step`` 0 (or n <= ``step``): the power of two >= n and >= ``min_bucket``. Above ``step``: n rounded up to a
    multiple of max(``step``, p / 16), p the power of two >= n, so an octave (p/2, p] holds at most
    ``BUCKETS_PER_OCTAVE`` buckets however long the rows, and a row of n > 2 ``step`` tokens is padded by less than
    max(``step``, n / 8) tokens.

    Buckets for lengths up to L > ``step`` (a bound on compiled programs; ``step`` a power of two >= ``min_bucket``):
    log2(``step`` / ``min_bucket``) + 1 powers of two, plus at most min(p / (2 ``step``), 8) per octave (p/2, p]
    above ``step``: 4 + 1 + 2 + 4 + 8 = 19 up to 2048 at the defaults (16, 128), 8 more per doubling of L,
    against 8 powers of two (16 ... 2048).
    """
    p = pow2_ceil(n, min_bucket)
    if step <= 0 or p <= step:
        return p
    g = max(step, p // (2 * BUCKETS_PER_OCTAVE))
    return -(-n // g) * g


def row_length(n: int, min_bucket: int = 16, step: int = 0) -> int:
    """The padded length of a row holding an n-token text in a next-token pass: the model reads its first n - 1
    tokens (``mia.engine.stats.next_token_inputs``), so the row is ``bucket_length(n - 1) + 1`` tokens and the model
    sees a bucketed length (2048 for Pythia's 2049-token rows, and for 2048-token texts)."""
    return bucket_length(max(1, int(n) - 1), min_bucket, step) + 1


@dataclasses.dataclass(frozen=True)
class Batch:
    """One call of a jitted step: ``rows`` x ``length`` padded tokens holding the examples ``members`` (row order)."""

    length: int
    rows: int
    members: tuple


def bucket_rows(n_examples: int, cap_per_device: int, n_data: int) -> int:
    """Rows of every batch of one length bucket of ``n_examples``: ``n_data`` x the rows per device.

    Per device at most pow2_floor(``cap_per_device``) (the token budget); the bucket is split into the fewest
    batches that cap allows, k = ceil(n / (cap x n_data)), and every batch gets ceil(n / (k x n_data)) rows rounded
    up to a multiple of max(1, p / 8), p the power of two <= that count. So the padding rows of a bucket are under
    1/8 of its rows plus one granule per batch (a power-of-two count cost up to 2x on a set just past a power of two,
    e.g. 33 rows padded to 64), and a dataset still compiles one program per bucket."""
    cap = pow2_floor(cap_per_device)
    per_device = -(-int(n_examples) // n_data)
    batches = -(-per_device // cap)
    need = -(-per_device // batches)
    granule = max(1, pow2_floor(need) // 8)
    return min(cap, -(-need // granule) * granule) * n_data


def plan_batches(lengths: Sequence[int], settings: ScoringSettings, n_data: int = 1) -> list[Batch]:
    """Group example indices into batches of a next-token pass: sorted by length, rows of ``row_length`` (the
    ``bucket_length`` of the n - 1 tokens the model reads, with ``settings.min_bucket`` and ``settings.bucket_step``,
    plus the last token), and ONE row count per bucket (a multiple of the ``data`` size), so a dataset compiles at
    most one program per length bucket.

    Rows per bucket: ``bucket_rows`` with at most min(token_budget // positions read, max_batch) per device.
    """
    buckets: dict[int, list[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        buckets.setdefault(row_length(lengths[i], settings.min_bucket, settings.bucket_step), []).append(i)
    batches = []
    for blen, members in sorted(buckets.items()):
        cap = max(1, min(settings.max_batch, settings.token_budget // (blen - 1)))
        rows = bucket_rows(len(members), cap, n_data)
        batches.extend(Batch(blen, rows, tuple(members[k:k + rows])) for k in range(0, len(members), rows))
    return batches


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One call of the token-stats step on packed rows: ``rows`` x ``length`` tokens; example ``members[j]`` sits in
    row ``slots[j][0]`` from column ``slots[j][1]`` (its segment id there is its rank within the row, from 1)."""

    length: int
    rows: int
    members: tuple
    slots: tuple


def first_fit_rows(lengths: Sequence[int], settings: ScoringSettings) -> list:
    """[(row length, [example indices in row order])]: longest first, each text into the open row with the most
    room left if it fits there, else into a new row of ``row_length`` of max(its length, ``pack_length``). Long
    texts get rows of about their own length whose tails shorter texts fill; short texts share rows of
    ``pack_length`` (attention then runs over ``pack_length`` keys, masked per text, instead of over each text's
    own length: a little more attention work for much less padding)."""
    rows: list = []
    room: list = []  # max-heap of (-room left, row index)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = int(lengths[i])
        if room and -room[0][0] >= n:
            left, r = heapq.heappop(room)
            rows[r][1].append(i)
            left = -left - n
        else:
            length = row_length(max(n, settings.pack_length), settings.min_bucket, settings.bucket_step)
            rows.append((length, [i]))
            r, left = len(rows) - 1, length - n
        if left >= 2:  # a text needs at least 2 tokens
            heapq.heappush(room, (-left, r))
    return rows


def pack_rows(lengths: Sequence[int], settings: ScoringSettings, n_data: int = 1) -> list[PackedBatch]:
    """Batches of packed rows: several texts per row, each text attending only to itself (segment ids), so a
    mixed-length set pads only the tail of each row. Rows of one length form batches of one row count (``bucket_rows``
    as in ``plan_batches``), so a dataset compiles at most one program per row length. Deterministic."""
    by_length: dict = {}
    for length, members in first_fit_rows(lengths, settings):
        by_length.setdefault(length, []).append(members)
    batches = []
    for length, rows in sorted(by_length.items()):
        cap = max(1, min(settings.max_batch, settings.token_budget // (length - 1)))
        per = bucket_rows(len(rows), cap, n_data)
        for k in range(0, len(rows), per):
            members, slots = [], []
            for r, row in enumerate(rows[k:k + per]):
                offset = 0
                for m in row:
                    members.append(m)
                    slots.append((r, offset))
                    offset += int(lengths[m])
            batches.append(PackedBatch(length, per, tuple(members), tuple(slots)))
    return batches


def packed_rows(seqs: Sequence[np.ndarray], batch: PackedBatch) -> tuple[np.ndarray, np.ndarray]:
    """tokens [rows, length] int32 and segment ids [rows, length] int32 (0 padding, 1.. the texts of each row in
    order) of a packed batch; ``seqs[j]`` is the text of ``batch.members[j]``."""
    tokens = np.zeros((batch.rows, batch.length), np.int32)
    segments = np.zeros((batch.rows, batch.length), np.int32)
    for t, (r, off) in zip(seqs, batch.slots):
        t = np.asarray(t)
        tokens[r, off:off + len(t)] = t
        segments[r, off:off + len(t)] = segments[r, off - 1] + 1 if off else 1
    return tokens, segments


def put_packed(seqs: Sequence[np.ndarray], batch: PackedBatch, sharding):
    """(tokens, segment ids) global [rows, length] arrays of a packed batch placed with ``sharding``."""
    tokens, segments = packed_rows(seqs, batch)
    return (put_rows(tokens.shape, sharding, lambda r: tokens[r]),
            put_rows(segments.shape, sharding, lambda r: segments[r]))


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
    return (put_rows((rows, length), sharding, lambda r: padded_rows(seqs, length, r, left)[0]),
            put_rows((rows, length), sharding, lambda r: padded_rows(seqs, length, r, left)[1]))


def pad_pow2(arrays: dict, min_len: int = 16) -> tuple[dict, int]:
    """Pad every [N, L] array (and ``mask`` with False) to [pow2_ceil(N), pow2_ceil(L, min_len)] with zeros, so that
    batches of other sizes reuse a compiled function; returns (padded, N)."""
    n, l = arrays["mask"].shape
    rows, cols = pow2_ceil(n), pow2_ceil(l, min_len)
    out = {}
    for key, a in arrays.items():
        out[key] = np.zeros((rows, cols), a.dtype)
        out[key][:n, :l] = a
    return out, n
