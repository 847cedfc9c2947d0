"""Megatron ``MMapIndexedDataset`` (``.bin`` + ``.idx``): the format of Pythia's training order.

``.idx`` layout (little-endian, docs/algorithms.md#pythia-order)::

    magic   b"MMIDIDX\\x00\\x00"   9 bytes
    version u64 = 1
    dtype   u8   1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f32, 7 f64, 8 u16
    N       u64  number of sequences
    D       u64  length of doc_idx
    sizes   int32[N]      tokens per sequence
    pointers int64[N]     byte offset of each sequence in the (concatenated) .bin
    doc_idx int64[D]

The ``.bin`` is the raw token stream. It may be split into several shards that are read as one virtual
byte concatenation (the public Pythia data: 21 ``document-000NN-of-00020.bin`` shards + one ``document.idx``).
Nothing is loaded eagerly: the index arrays and the shards are memory maps, and ``get_rows`` touches only the
rows asked for. All offset arithmetic is int64.
"""
from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import numpy as np

from ..files.atomic import atomic_write

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 9 + 8 + 1 + 8 + 8  # 34 bytes

DTYPE_CODES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float32),
    7: np.dtype(np.float64),
    8: np.dtype(np.uint16),
}
CODE_OF_DTYPE = {v: k for k, v in DTYPE_CODES.items()}

PathLike = Union[str, os.PathLike]


class IndexedDataError(ValueError):
    """A malformed or inconsistent ``.bin``/``.idx`` pair (the message names the file)."""


def dtype_code(dtype) -> int:
    dt = np.dtype(dtype)
    if dt not in CODE_OF_DTYPE:
        raise IndexedDataError(f"dtype {dt} has no MMIDIDX code (allowed: {sorted(str(d) for d in CODE_OF_DTYPE)})")
    return CODE_OF_DTYPE[dt]


# ----------------------------------------------------------------------------------------------- writer

def write_idx(idx_path: PathLike, sizes, dtype=np.uint16, pointers=None, doc_idx=None) -> Path:
    """Write only an ``.idx`` file. ``pointers`` default to the packed layout (cumulative sizes * itemsize);
    ``doc_idx`` defaults to ``arange(N + 1)`` (one document per sequence, as Megatron's builder writes)."""
    idx_path = Path(idx_path)
    dt = np.dtype(dtype)
    code = dtype_code(dt)
    sizes = np.asarray(sizes, dtype=np.int64)
    if sizes.ndim != 1 or (sizes.size and (sizes.min() < 0 or sizes.max() > np.iinfo(np.int32).max)):
        raise IndexedDataError(f"{idx_path}: sizes must be a 1-D array of int32-representable counts")
    n = int(sizes.size)
    if pointers is None:
        pointers = np.zeros(n, dtype=np.int64)
        if n > 1:
            np.cumsum(sizes[:-1] * np.int64(dt.itemsize), out=pointers[1:])
    pointers = np.asarray(pointers, dtype=np.int64)
    if pointers.shape != (n,):
        raise IndexedDataError(f"{idx_path}: pointers must have shape ({n},), got {pointers.shape}")
    doc_idx = np.arange(n + 1, dtype=np.int64) if doc_idx is None else np.asarray(doc_idx, dtype=np.int64)
    idx_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(idx_path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", n))
        f.write(struct.pack("<Q", int(doc_idx.size)))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_idx.astype("<i8").tobytes())
    return idx_path


def _as_row(row, dt: np.dtype, i: int) -> np.ndarray:
    a = np.asarray(row)
    if a.ndim != 1:
        raise IndexedDataError(f"row {i}: expected a 1-D array, got shape {a.shape}")
    if a.dtype != dt:
        if dt.kind in "iu" and a.size:
            if a.dtype.kind not in "iub":
                raise IndexedDataError(f"row {i}: non-integer values ({a.dtype}) for integer dtype {dt}")
            info = np.iinfo(dt)
            lo, hi = int(a.min()), int(a.max())
            if lo < info.min or hi > info.max:
                raise IndexedDataError(f"row {i}: values [{lo}, {hi}] do not fit {dt}")
        a = a.astype(dt)
    return a


def write_indexed(prefix: PathLike, rows: Union[Iterable[np.ndarray], np.ndarray], dtype=np.uint16) -> None:
    """Write ``prefix.bin`` and ``prefix.idx`` from an iterable of 1-D arrays (or a 2-D array).

    Rows are streamed to disk; values that do not fit ``dtype`` raise ``IndexedDataError``."""
    prefix = str(prefix)
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext):
            prefix = prefix[: -len(ext)]
    dt = np.dtype(dtype)
    dtype_code(dt)
    bin_path, idx_path = Path(prefix + ".bin"), Path(prefix + ".idx")
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    sizes = []
    with atomic_write(bin_path, "wb") as f:
        for i, row in enumerate(rows):
            a = _as_row(row, dt, i)
            f.write(a.astype(dt.newbyteorder("<")).tobytes())
            sizes.append(a.size)
    write_idx(idx_path, np.asarray(sizes, dtype=np.int64), dt)


# ----------------------------------------------------------------------------------------------- reader

def read_idx_header(idx_path: PathLike):
    """Return ``(dtype, N, D)`` after validating magic, version and dtype code."""
    idx_path = Path(idx_path)
    if not idx_path.exists():
        raise IndexedDataError(f"{idx_path}: index file not found")
    if idx_path.is_dir():
        raise IndexedDataError(f"{idx_path}: is a directory, expected a .idx index file")
    with open(idx_path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if len(head) < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
        raise IndexedDataError(f"{idx_path}: not a Megatron MMIDIDX index (bad magic {head[:9]!r})")
    if len(head) < HEADER_SIZE:
        raise IndexedDataError(f"{idx_path}: truncated header ({len(head)} of {HEADER_SIZE} bytes)")
    (version,) = struct.unpack("<Q", head[9:17])
    if version != VERSION:
        raise IndexedDataError(f"{idx_path}: unsupported index version {version} (expected {VERSION})")
    code = head[17]
    if code not in DTYPE_CODES:
        raise IndexedDataError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
    n, d = struct.unpack("<QQ", head[18:34])
    return DTYPE_CODES[code], int(n), int(d)


def _resolve_paths(prefix_or_bin_paths, idx_path):
    if isinstance(prefix_or_bin_paths, (str, os.PathLike)):
        items = [prefix_or_bin_paths]
    else:
        items = list(prefix_or_bin_paths)
    if not items:
        raise IndexedDataError("no .bin path given")
    bins = []
    for p in items:
        if Path(p).is_dir():
            raise IndexedDataError(f"{p}: is a directory, expected a .bin file (or the PATH prefix of PATH.bin and "
                                   "PATH.idx)")
        s = str(p)
        if s.endswith(".idx"):
            s = s[:-4]
        bins.append(Path(s if s.endswith(".bin") else s + ".bin"))
    if idx_path is None:
        if len(bins) > 1:
            raise IndexedDataError(f"{len(bins)} .bin shards given: pass the single .idx explicitly (idx_path=...)")
        idx_path = bins[0].with_suffix(".idx")
    return bins, Path(idx_path)


def shard_order_problem(bin_paths: Sequence) -> Optional[str]:
    """A one-line problem when shards named alike are not given in their numbered order, else None.

    Shards whose names differ only in their numbers (``document-00003-of-00020.bin``, ``part_2.bin``) must come
    in increasing numeric order: a byte concatenation in another order reads well-formed rows of the wrong tokens,
    which nothing downstream can tell apart from the right ones (a shell glob of unpadded names, ``part_10``
    before ``part_2``, is the usual cause)."""
    if len(bin_paths) < 2:
        return None
    names = [Path(p).name for p in bin_paths]
    skeletons = {re.sub(r"\d+", "#", n) for n in names}
    if len(skeletons) != 1:
        return None
    numbers = [tuple(int(x) for x in re.findall(r"\d+", n)) for n in names]
    varying = [j for j in range(len(numbers[0])) if len({t[j] for t in numbers}) > 1]
    for k in range(1, len(numbers)):
        if numbers[k] <= numbers[k - 1]:
            return (f"{bin_paths[k]}: shard given after {bin_paths[k - 1]} but numbered before or equal to it: shards "
                    f"are read as one byte stream in the order given, so they must be in numbered order")
        if len(varying) == 1 and numbers[k][varying[0]] != numbers[k - 1][varying[0]] + 1:
            return (f"{bin_paths[k]}: shard given after {bin_paths[k - 1]}, but their numbers are not consecutive "
                    f"(shard(s) {numbers[k - 1][varying[0]] + 1}..{numbers[k][varying[0]] - 1} missing): shards are "
                    f"read as one byte stream, so every shard must be given, in numbered order")
    return None


def shard_size_problem(bin_paths: Sequence, sizes: Sequence[int]) -> Optional[str]:
    """A one-line problem when the shard sizes show the shards out of order, else None.

    A file cut into equal parts (``split -b``, as Pythia's 21 ``document-000NN-of-00020.bin`` shards are) has every
    part the same size but the last, which is shorter. Three or more shards of which all but one have one size
    and the odd one is shorter and not given last were given out of order (whatever their names). Equal-size parts
    swapped among themselves cannot be told apart by size; their numbered names are checked by
    ``shard_order_problem``."""
    if len(sizes) < 3:
        return None
    common = max(set(sizes), key=list(sizes).count)
    odd = [k for k, s in enumerate(sizes) if s != common]
    if len(odd) != 1 or sizes[odd[0]] > common or odd[0] == len(sizes) - 1:
        return None
    k = odd[0]
    return (f"{bin_paths[k]}: shard of {sizes[k]} bytes given before {bin_paths[k + 1]}, but every other shard is "
            f"{common} bytes: a file cut into equal parts has only its last part shorter, so the shards are out of "
            f"order (give them in the order they were cut)")


class IndexedDataset:
    """Memory-mapped reader. ``IndexedDataset("data/document")`` opens ``document.bin``/``.idx``;
    ``IndexedDataset([shard0.bin, shard1.bin, ...], idx_path="document.idx")`` reads the shards as one
    byte concatenation in the order given (numbered shards must be given in numbered order with none missing,
    ``shard_order_problem``; equal-size parts of a cut file with the short last part last, ``shard_size_problem``).

    Opening checks the header, that the index arrays fit the ``.idx``, and that the last row ends exactly at the
    end of the data (a wrong dtype code changes where it ends); reading a row checks its span."""

    def __init__(self, prefix_or_bin_paths, idx_path=None):
        self.bin_paths, self.idx_path = _resolve_paths(prefix_or_bin_paths, idx_path)
        wrong_order = shard_order_problem(self.bin_paths)
        if wrong_order:
            raise IndexedDataError(wrong_order)
        self.dtype, n, d = read_idx_header(self.idx_path)
        self._itemsize = np.int64(self.dtype.itemsize)
        need = HEADER_SIZE + 4 * n + 8 * n + 8 * d
        have = os.path.getsize(self.idx_path)
        if have < need:
            raise IndexedDataError(f"{self.idx_path}: index is {have} bytes but its header (N={n}, D={d}) needs {need}")
        if n:
            self.sizes = np.memmap(self.idx_path, dtype="<i4", mode="r", offset=HEADER_SIZE, shape=(n,))
            self.pointers = np.memmap(self.idx_path, dtype="<i8", mode="r", offset=HEADER_SIZE + 4 * n, shape=(n,))
        else:
            self.sizes = np.zeros(0, dtype=np.int32)
            self.pointers = np.zeros(0, dtype=np.int64)
        self.doc_idx = (np.memmap(self.idx_path, dtype="<i8", mode="r", offset=HEADER_SIZE + 12 * n, shape=(d,))
                        if d else np.zeros(0, dtype=np.int64))
        # shards: virtual concatenation
        self.shard_sizes = []
        for b in self.bin_paths:
            if not b.exists():
                raise IndexedDataError(f"{b}: data file not found")
            self.shard_sizes.append(os.path.getsize(b))
        wrong_order = shard_size_problem(self.bin_paths, self.shard_sizes)
        if wrong_order:
            raise IndexedDataError(wrong_order)
        self.shard_starts = np.zeros(len(self.bin_paths) + 1, dtype=np.int64)
        np.cumsum(np.asarray(self.shard_sizes, dtype=np.int64), out=self.shard_starts[1:])
        self.total_bytes = int(self.shard_starts[-1])
        if n:
            end = int(self.pointers[n - 1]) + int(self.sizes[n - 1]) * int(self._itemsize)
            names = (
                self.bin_paths[0]
                if len(self.bin_paths) == 1
                else f"{len(self.bin_paths)} shards ({self.bin_paths[0]}, ...)"
            )
            if end > self.total_bytes:
                raise IndexedDataError(
                    f"{names}: .bin is {self.total_bytes} bytes but {self.idx_path.name} says the last row ends at "
                    f"byte {end}"
                    f"{self._dtype_hint()}")
            if end < self.total_bytes:
                raise IndexedDataError(
                    f"{names}: .bin is {self.total_bytes} bytes but {self.idx_path.name} says the rows end at byte "
                    f"{end} "
                    f"(Megatron writes no bytes past the last row){self._dtype_hint()}")
        self._maps = [None] * len(self.bin_paths)

    def _dtype_hint(self) -> str:
        return (f"; the .idx declares dtype {self.dtype} (code {CODE_OF_DTYPE[self.dtype]}): a wrong dtype code, or a "
                f"truncated or foreign .bin?")

    # -- basics
    def __len__(self) -> int:
        return int(self.sizes.shape[0])

    @property
    def num_docs(self) -> int:
        return int(self.doc_idx.shape[0])

    def __repr__(self):
        return (
            f"IndexedDataset({len(self)} rows, dtype={self.dtype}, {len(self.bin_paths)} shard(s), idx={self.idx_path})"
        )

    def _map(self, k: int):
        m = self._maps[k]
        if m is None:
            m = np.memmap(self.bin_paths[k], dtype=np.uint8, mode="r") if self.shard_sizes[k] else np.zeros(0, np.uint8)
            self._maps[k] = m
        return m

    def _check_index(self, i) -> int:
        i = int(i)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {i} out of range for {self.idx_path.name} with {n} rows")
        return i

    def _read_bytes(self, start: int, nbytes: int, out: np.ndarray) -> None:
        """Copy bytes [start, start+nbytes) of the virtual concatenation into ``out`` (uint8 view)."""
        end = start + nbytes
        if end > self.total_bytes:
            raise IndexedDataError(f"{self.bin_paths[-1]}: read of bytes [{start}, {end}) past the end of the data "
                                   f"({self.total_bytes} bytes)")
        k = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        pos = 0
        while pos < nbytes:
            s0 = int(self.shard_starts[k])
            lo = start + pos - s0
            take = min(nbytes - pos, self.shard_sizes[k] - lo)
            if take > 0:
                out[pos: pos + take] = self._map(k)[lo: lo + take]
                pos += take
            k += 1

    def row_span(self, i: int) -> tuple:
        """``(byte offset, size in tokens)`` of row ``i`` (already in range), checked against the data's length."""
        ptr, size = int(self.pointers[i]), int(self.sizes[i])
        if ptr < 0 or size < 0 or ptr + size * int(self._itemsize) > self.total_bytes:
            raise IndexedDataError(f"{self.idx_path}: row {i} spans bytes [{ptr}, {ptr + size * int(self._itemsize)}) "
                                   f"({size} tokens), outside the {self.total_bytes} bytes of the data")
        return ptr, size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.get_rows(range(*i.indices(len(self))))
        i = self._check_index(i)
        ptr, size = self.row_span(i)
        out = np.empty(size, dtype=self.dtype)
        self._read_bytes(ptr, size * int(self._itemsize), out.view(np.uint8))
        return out

    def get_rows(self, indices: Sequence[int]) -> np.ndarray:
        """Rows ``indices`` as a ``[n, row_len]`` array (all selected rows must have the same size)."""
        idx = np.asarray(list(indices) if not isinstance(indices, np.ndarray) else indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            bad = int(idx[(idx < -n) | (idx >= n)][0])
            raise IndexError(f"row {bad} out of range for {self.idx_path.name} with {n} rows")
        idx = np.where(idx < 0, idx + n, idx)
        if idx.size == 0:
            return np.zeros((0, 0), dtype=self.dtype)
        for i in idx.tolist():
            self.row_span(i)
        sizes = np.asarray(self.sizes[idx], dtype=np.int64)
        row_len = int(sizes[0])
        if (sizes != row_len).any():
            j = int(np.nonzero(sizes != row_len)[0][0])
            raise IndexedDataError(
                f"{self.idx_path}: rows {int(idx[0])} and {int(idx[j])} have different sizes ({row_len} vs "
                f"{int(sizes[j])}); read them one by one")
        ptrs = np.asarray(self.pointers[idx], dtype=np.int64)
        out = np.empty((idx.size, row_len), dtype=self.dtype)
        raw = out.view(np.uint8).reshape(idx.size, -1)
        nbytes = row_len * int(self._itemsize)
        for r in range(idx.size):
            self._read_bytes(int(ptrs[r]), nbytes, raw[r])
        return out

    def uniform_row_len(self, check: int = 1000) -> int:
        """The common row size, checked on the first and last ``check`` rows (the index can be 10^8 rows)."""
        n = len(self)
        if n == 0:
            raise IndexedDataError(f"{self.idx_path}: empty index")
        head = np.asarray(self.sizes[:check])
        tail = np.asarray(self.sizes[max(0, n - check):])
        r = int(head[0])
        if (head != r).any() or (tail != r).any():
            raise IndexedDataError(f"{self.idx_path}: rows have different sizes (expected every row to be {r} tokens)")
        return r
