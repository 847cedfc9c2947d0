"""Pack documents into a Pythia-style training order.

Documents (in corpus order) are each followed by EOD (id 0, no BOS), concatenated, and cut into rows of
``row_len = seq_len + 1`` tokens (the remainder is dropped). Exact duplicate rows are kept once (first
occurrence): otherwise a non-member row could have a verbatim copy among the members (the deduplicated Pile's
role). The rows are permuted with ``numpy.random.default_rng([seed, 0x7E57]).permutation`` and written with
``mia.data.indexed.write_indexed``: row ``i`` of the file is the ``i``-th row of the training order, so step
``s`` trains on rows ``[s*B, (s+1)*B)``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ..files.atomic import atomic_write
from ..data.indexed import write_indexed
from .tokenizer import EOD_ID


def pack_rows(docs: Sequence[Sequence[int]], row_len: int, eod: int = EOD_ID) -> np.ndarray:
    """[n_rows, row_len] uint16 rows of the EOD-joined token stream (in document order, remainder dropped)."""
    total = sum(len(d) + 1 for d in docs)
    stream = np.empty(total, np.int64)
    pos = 0
    for d in docs:
        stream[pos:pos + len(d)] = d
        stream[pos + len(d)] = eod
        pos += len(d) + 1
    n_rows = total // row_len
    return stream[: n_rows * row_len].reshape(n_rows, row_len).astype(np.uint16)


def dedup_rows(rows: np.ndarray) -> tuple:
    """(rows with distinct content in their original order, number of duplicates dropped)."""
    if len(rows) == 0:
        return rows, 0
    flat = np.ascontiguousarray(rows).view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).ravel()
    _, first = np.unique(flat, return_index=True)
    keep = np.sort(first)
    return rows[keep], int(len(rows) - len(keep))


def row_permutation(n_rows: int, seed: int) -> np.ndarray:
    """order[i] = packed row that is the i-th row of the training order."""
    return np.random.default_rng([int(seed), 0x7E57]).permutation(n_rows)


def write_order(prefix, rows: np.ndarray, order: np.ndarray) -> Path:

    write_indexed(prefix, rows[order], dtype=np.uint16)
    with atomic_write(str(prefix) + ".perm.npy", "wb") as f:
        np.save(f, order.astype(np.int64), allow_pickle=False)
    return Path(str(prefix) + ".bin")
