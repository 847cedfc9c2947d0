"""Pythia training order: step <-> row arithmetic and checkpoint member/non-member splits.

Facts (ALGORITHMS.md §7): the preshuffled deduped Pile is one ``MMapIndexedDataset`` of 2049-token rows;
step ``s`` trains on rows ``[s*B, (s+1)*B)`` with ``B = 1024``; revision ``stepN`` has trained on rows
``[0, N*B)`` (UNCONFIRMED convention, hence the ``gap``); epoch 1 ends near step 98,500 (CheckMIABench's value).

``draw_checkpoint_split`` draws members uniformly from the rows of steps ``[0, S-G)`` and non-members from
steps ``[S+G, end_step)``, without replacement, with ``numpy.random.default_rng(seed)``.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .examples import out_of_vocab
from .indexed import IndexedDataset
from .splits import (SplitError, assign_partitions, file_record, partition_counts, position_problems,
                     rows_to_lists)

BATCH_SIZE = 1024
ROW_LEN = 2049
EPOCH_END_STEP = 98_500
EOD = 0


def step_rows(step: int, batch_size: int = BATCH_SIZE) -> tuple:
    """Rows ``[lo, hi)`` trained on at step ``step``."""
    step = int(step)
    return step * batch_size, (step + 1) * batch_size


def rows_seen(step: int, batch_size: int = BATCH_SIZE) -> tuple:
    """Rows ``[0, hi)`` that revision ``step{step}`` has trained on."""
    return 0, int(step) * batch_size


def row_step(index: int, batch_size: int = BATCH_SIZE) -> tuple:
    """``(step, batch_pos)`` of a row index."""
    index = int(index)
    return index // batch_size, index % batch_size


def steps_in_data(n_rows: int, batch_size: int = BATCH_SIZE) -> int:
    """Number of complete steps the data holds."""
    return int(n_rows) // batch_size


def _draw(rng: np.random.Generator, lo: int, hi: int, n: int, what: str) -> np.ndarray:
    size = hi - lo
    if n > size:
        raise SplitError(f"asked for {n} {what} but rows [{lo}, {hi}) hold only {size}")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    return lo + rng.choice(size, size=n, replace=False).astype(np.int64)


def open_dataset(data, idx=None) -> IndexedDataset:
    if isinstance(data, IndexedDataset):
        return data
    return IndexedDataset(data, idx_path=idx)


def check_rows_vocab(ds: IndexedDataset, indices, rows: np.ndarray, vocab_size: int, batch_size: int) -> None:
    """Raise naming the ``.bin`` shard, row and token of the first id in ``rows`` outside ``[0, vocab_size)``."""
    bad = out_of_vocab(rows, vocab_size)
    if bad is None:
        return
    (r, j), tok_id = bad
    index = int(indices[r])
    byte = int(ds.pointers[index]) + j * ds.dtype.itemsize
    shard = int(np.searchsorted(ds.shard_starts, byte, side="right")) - 1
    s, pos = row_step(index, batch_size)
    raise SplitError(f"{ds.bin_paths[shard]}: row {index} (step {s}, batch position {pos}) token {j} (byte "
                     f"{byte - int(ds.shard_starts[shard])}) is id {tok_id}, outside the model vocabulary "
                     f"({vocab_size} ids): the data do not match the model's tokenizer")


def member_nonmember_steps(step: int, gap: int, end_step: int) -> tuple:
    return (0, step - gap), (step + gap, end_step)


def draw_checkpoint_split(dataset, step: int, n_members: int, n_nonmembers: int, seed: int, gap: int = 0,
                          end_step: int = EPOCH_END_STEP, batch_size: int = BATCH_SIZE,
                          partitions: Optional[dict] = None, hash_bin_limit: int = 64 << 20,
                          vocab_size: Optional[int] = None):
    """Draw a checkpoint split for revision ``step{step}``.

    Returns ``(header, examples)``; write it with ``splits.write_split``. ``dataset`` is an ``IndexedDataset``
    (or a prefix / list of shards with a single ``.idx`` next to it). With ``vocab_size`` (the model's), a drawn
    token id outside ``[0, vocab_size)`` stops with one line naming the shard, row and token."""
    ds = open_dataset(dataset)
    step, gap, end_step, batch_size = int(step), int(gap), int(end_step), int(batch_size)
    n_members, n_nonmembers = int(n_members), int(n_nonmembers)
    if batch_size <= 0:
        raise SplitError(f"batch size must be positive, got {batch_size}")
    if step < 0 or gap < 0 or n_members < 0 or n_nonmembers < 0:
        raise SplitError("step, gap and counts must be non-negative")
    n_rows = len(ds)
    data_steps = steps_in_data(n_rows, batch_size)
    if step > data_steps:
        raise SplitError(f"step {step} is past the data: {n_rows} rows hold {data_steps} steps of {batch_size}")
    if end_step > data_steps:
        raise SplitError(f"non-member range [{step + gap}, {end_step}) crosses the end of the data "
                         f"({n_rows} rows = {data_steps} steps of {batch_size}); lower --end-step")
    (m_lo, m_hi), (n_lo, n_hi) = member_nonmember_steps(step, gap, end_step)
    if m_hi <= 0 and n_members:
        raise SplitError(f"member range [0, {m_hi}) is empty (step {step} - gap {gap})")
    if n_lo >= n_hi and n_nonmembers:
        raise SplitError(f"non-member range [{n_lo}, {n_hi}) is empty or crosses the epoch end {end_step} "
                         f"(step {step} + gap {gap})")
    m_hi = max(m_hi, 0)
    rng = np.random.default_rng(seed)
    members = _draw(rng, 0, m_hi * batch_size, n_members, f"members (steps [0, {m_hi}))")
    nonmembers = _draw(rng, n_lo * batch_size, max(n_hi, n_lo) * batch_size, n_nonmembers,
                       f"non-members (steps [{n_lo}, {n_hi}))")

    indices = np.concatenate([members, nonmembers])
    labels = [1] * len(members) + [0] * len(nonmembers)
    rows = ds.get_rows(indices) if len(indices) else np.zeros((0, 0), dtype=ds.dtype)
    if vocab_size is not None:
        check_rows_vocab(ds, indices, rows, int(vocab_size), batch_size)
    token_lists = rows_to_lists(rows)
    examples = []
    for k, (index, label) in enumerate(zip(indices.tolist(), labels)):
        s, pos = row_step(index, batch_size)
        examples.append({"id": f"row{index}", "label": label, "partition": "eval", "tokens": token_lists[k],
                         "step": s, "batch_pos": pos, "index": index})
    if partitions:
        assign_partitions(examples, partitions, seed)
    row_len = int(rows.shape[1]) if len(indices) else None
    header = {
        "source": {
            "kind": "pythia",
            "bin": [file_record(p, full_limit=hash_bin_limit) for p in ds.bin_paths],
            "idx": file_record(ds.idx_path, full_limit=None),
            "dtype": str(ds.dtype),
            "n_rows": n_rows,
        },
        "params": {
            "step": step, "gap": gap, "seed": seed, "end_step": end_step, "batch_size": batch_size,
            "row_len": row_len, "member_steps": [0, m_hi], "nonmember_steps": [n_lo, n_hi],
            "member_rows": [0, m_hi * batch_size], "nonmember_rows": [n_lo * batch_size, n_hi * batch_size],
            "sampler": "numpy.random.default_rng(seed).choice(range, n, replace=False): members, then non-members",
            "revision": f"step{step}",
        },
    }
    header.update(partition_counts(examples))
    return header, examples


def verify_examples(header: dict, examples: list, problems: list) -> None:
    """Re-read the rows named by ``examples`` from the sources in ``header`` (used by ``check_split``)."""
    src, params = header.get("source", {}), header.get("params", {})
    try:
        bins = [r["path"] for r in src["bin"]]
        ds = IndexedDataset(bins, idx_path=src["idx"]["path"])
    except (KeyError, TypeError) as e:
        problems.append(f"header: pythia source incomplete ({e})")
        return
    except (ValueError, OSError) as e:
        problems.append(f"header: cannot open sources: {e}")
        return
    _verify_rows(ds, params, examples, problems)


def _verify_rows(ds, params, examples, problems):
    B = int(params.get("batch_size", BATCH_SIZE))
    for e in examples:
        ln = e.get("_line", "?")
        found, readable = position_problems(e, params, B, len(ds), "row", f"data ({len(ds)} rows)")
        problems.extend(found)
        if not readable:
            continue
        index = e["index"]
        toks = e.get("tokens")
        if toks is None:
            problems.append(f"line {ln}: no tokens")
            continue
        try:
            row = ds[index]
        except ValueError as ex:
            problems.append(f"line {ln}: cannot read row {index}: {ex}")
            continue
        if len(toks) != len(row) or not np.array_equal(np.asarray(toks), row):
            diff = next((j for j, (a, b) in enumerate(zip(toks, row.tolist())) if a != b), min(len(toks), len(row)))
            problems.append(f"line {ln}: tokens differ from row {index} of the data (first at position {diff})")
