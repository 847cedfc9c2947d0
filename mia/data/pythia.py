"""Pythia training order: step <-> row arithmetic and checkpoint member/non-member splits.

Facts (docs/algorithms.md#pythia-order): the preshuffled deduped Pile is one ``MMapIndexedDataset`` of 2049-token rows;
step ``s`` trains on rows ``[s*B, (s+1)*B)`` with ``B = 1024``; revision ``stepN`` has trained on rows
``[0, N*B)`` (UNCONFIRMED convention, hence the ``gap``); epoch 1 ends near step 98,500 (CheckMIABench's value).

``draw_checkpoint_split`` draws members uniformly from the rows of steps ``[0, S-G)`` and non-members from
steps ``[S+G, end_step)``, without replacement, with ``numpy.random.default_rng(seed)``.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import numpy as np

from .examples import out_of_vocab
from .indexed import CODE_OF_DTYPE, IndexedDataset
from .splits import (INT, NONNEG_INT, POS_INT, SEED, STRING, SplitError, assign_partitions, checked_fields,
                     derived_problems, draw_counts, dropped_rows, file_record, one_line, partition_counts,
                     position_problems, redraw_problems, rows_to_lists, short_repr, token_id_problems, vocab_bound)

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


def check_rows_vocab(ds: IndexedDataset, indices, rows: np.ndarray, vocab_size: Optional[int], batch_size: int) -> None:
    """Raise naming the ``.bin`` shard, row and token of the first id in ``rows`` outside ``[0, vocab_size)``
    (``vocab_size`` None: the first negative id, which no tokenizer writes: a wrong dtype code in the ``.idx``)."""
    if vocab_size is None:
        if ds.dtype.kind == "u" or rows.size == 0 or rows.min() >= 0:
            return
        bad = out_of_vocab(rows, int(rows.max()) + 1)
        (r, j), tok_id = bad
        raise SplitError(f"{ds.idx_path}: row {int(indices[r])} token {j} is id {tok_id} read as {ds.dtype} (dtype "
                         f"code {CODE_OF_DTYPE[ds.dtype]}): negative ids are not token ids (a wrong dtype code?)")
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


SAMPLER = "numpy.random.default_rng(seed).choice(range, n, replace=False): members, then non-members"


def draw_row_indices(step: int, gap: int, end_step: int, batch_size: int, n_members: int, n_nonmembers: int,
                     seed) -> tuple:
    """``(members, nonmembers)`` row indices (int64 arrays, in drawn order) of the checkpoint split, from the
    parameters alone: members uniformly from the rows of steps ``[0, step - gap)``, then non-members from
    ``[step + gap, end_step)``, without replacement, one ``numpy.random.default_rng(seed)`` stream."""
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
    return members, nonmembers


def token_dtype_problem(ds: IndexedDataset) -> Optional[str]:
    """A problem when the ``.idx`` declares a dtype that cannot hold token ids (floats)."""
    if ds.dtype.kind not in "iu":
        return (f"{ds.idx_path}: dtype code {CODE_OF_DTYPE[ds.dtype]} ({ds.dtype}) is not an integer dtype: not "
                "token ids (a wrong dtype code?)")
    return None


def draw_checkpoint_split(dataset, step: int, n_members: int, n_nonmembers: int, seed: int, gap: int = 0,
                          end_step: int = EPOCH_END_STEP, batch_size: int = BATCH_SIZE,
                          partitions: Optional[dict] = None, hash_bin_limit: int = 64 << 20,
                          vocab_size: Optional[int] = None):
    """Draw a checkpoint split for revision ``step{step}``.

    Returns ``(header, examples)``; write it with ``splits.write_split``. ``dataset`` is an ``IndexedDataset``
    (or a prefix / list of shards with a single ``.idx`` next to it). A float dtype in the ``.idx`` or a negative
    token id stops (a wrong dtype code); with ``vocab_size`` (the model's, recorded in the header), a drawn token
    id outside ``[0, vocab_size)`` stops with one line naming the shard, row and token."""
    ds = open_dataset(dataset)
    step, gap, end_step, batch_size = int(step), int(gap), int(end_step), int(batch_size)
    n_members, n_nonmembers = int(n_members), int(n_nonmembers)
    if batch_size <= 0:
        raise SplitError(f"batch size must be positive, got {batch_size}")
    if step < 0 or gap < 0 or n_members < 0 or n_nonmembers < 0:
        raise SplitError("step, gap and counts must be non-negative")
    bad_dtype = token_dtype_problem(ds)
    if bad_dtype:
        raise SplitError(bad_dtype)
    if vocab_size is not None and int(vocab_size) <= 0:
        raise SplitError(f"vocabulary size must be positive, got {vocab_size}")
    n_rows = len(ds)
    data_steps = steps_in_data(n_rows, batch_size)
    if step > data_steps:
        raise SplitError(f"step {step} is past the data: {n_rows} rows hold {data_steps} steps of {batch_size}")
    if end_step > data_steps:
        raise SplitError(f"non-member range [{step + gap}, {end_step}) crosses the end of the data "
                         f"({n_rows} rows = {data_steps} steps of {batch_size}); lower --end-step")
    members, nonmembers = draw_row_indices(step, gap, end_step, batch_size, n_members, n_nonmembers, seed)
    (_, m_hi), (n_lo, n_hi) = member_nonmember_steps(step, gap, end_step)
    m_hi = max(m_hi, 0)

    indices = np.concatenate([members, nonmembers])
    labels = [1] * len(members) + [0] * len(nonmembers)
    rows = ds.get_rows(indices) if len(indices) else np.zeros((0, 0), dtype=ds.dtype)
    check_rows_vocab(ds, indices, rows, None if vocab_size is None else int(vocab_size), batch_size)
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
            "sampler": SAMPLER,
            "revision": f"step{step}",
            "vocab_size": None if vocab_size is None else int(vocab_size),
        },
    }
    header.update(partition_counts(examples))
    return header, examples


def expected_params(step: int, gap: int, end_step: int, batch_size: int) -> dict:
    """The header fields that follow from the step parameters (what ``draw_checkpoint_split`` writes)."""
    (_, m_hi), (n_lo, n_hi) = member_nonmember_steps(step, gap, end_step)
    m_hi = max(m_hi, 0)
    return {"member_steps": [0, m_hi], "nonmember_steps": [n_lo, n_hi], "member_rows": [0, m_hi * batch_size],
            "nonmember_rows": [n_lo * batch_size, n_hi * batch_size], "revision": f"step{step}"}


PARAMS = {"step": NONNEG_INT, "gap": NONNEG_INT, "end_step": INT, "batch_size": POS_INT, "row_len": POS_INT.or_null(),
          "cut_len": POS_INT.or_null()}
"""The header ``params`` a Pythia-format split is verified from (the step ranges follow from them:
``expected_params``). ``cut_len`` (optional): every row holds the first ``cut_len`` tokens of its data row (a split
cut after the draw, e.g. ``experiments.em_mia``'s pool); ``row_len`` stays the data's row length."""

SOURCE = {"dtype": STRING.or_null(), "n_rows": NONNEG_INT.or_null(), "checkpoint": STRING.or_null()}
"""The header ``source`` fields besides the file records (``splits.SOURCE_FILES``) compared with the data."""


def verify_examples(header: dict, examples: list, problems: list, not_verified: Optional[list] = None,
                    vocab_size: Optional[int] = None) -> None:
    """Verify a Pythia-format split against its header and sources (used by ``verify.verify_split``, which has
    checked the header's file records and the rows' field types): the header's parameters against each other and
    the data, the drawn rows against a re-draw, and every row re-read."""
    not_verified = [] if not_verified is None else not_verified
    src, params = header.get("source", {}), header.get("params", {})
    p = checked_fields(params, PARAMS, "line 1: header params.", problems)
    s = checked_fields(src, SOURCE, "line 1: header source.", problems)
    if p is None or s is None:
        not_verified.append("rows: not verified against the data (unusable header parameters)")
        return
    step, gap, end_step, B = p["step"], p["gap"], p["end_step"], p["batch_size"]
    derived_problems(params, expected_params(step, gap, end_step, B), problems,
                     f"step {step}, gap {gap}, end_step {end_step} and batch_size {B}")
    ckpt = s["checkpoint"]
    if ckpt is not None and re.fullmatch(r"step\d+", Path(ckpt).name) and Path(ckpt).name != f"step{step}":
        problems.append(f"line 1: header source.checkpoint {ckpt} is not the checkpoint of params.step {step}")
    try:
        ds = IndexedDataset([r["path"] for r in src["bin"]], idx_path=src["idx"]["path"])
    except (KeyError, TypeError) as e:
        problems.append(f"line 1: pythia source incomplete ({one_line(str(e))})")
        return
    except (ValueError, OSError) as e:
        problems.append(f"line 1: cannot open sources: {one_line(str(e))}")
        return
    bad_dtype = token_dtype_problem(ds)
    if bad_dtype:
        problems.append(f"line 1: {bad_dtype}")
    if s["dtype"] not in (None, str(ds.dtype)):
        problems.append(f"line 1: header source.dtype {short_repr(s['dtype'])} but {ds.idx_path.name} declares "
                        f"{ds.dtype}")
    if s["n_rows"] not in (None, len(ds)):
        problems.append(f"line 1: header source.n_rows {s['n_rows']} but {ds.idx_path.name} has {len(ds)} rows")
    data_steps = steps_in_data(len(ds), B)
    if step > data_steps or end_step > data_steps:
        problems.append(f"line 1: header step {step} / end_step {end_step} past the data ({len(ds)} rows = "
                        f"{data_steps} steps of {B})")
    row_len, cut = p["row_len"], p["cut_len"]
    want = row_len if cut is None or row_len is None else min(row_len, cut)
    for e in examples:
        toks = e.get("tokens")
        if want is not None and isinstance(toks, np.ndarray) and len(toks) != want:
            problems.append(f"line {e.get('_line')}: {len(toks)} tokens but params.row_len is {row_len}"
                            + ("" if cut is None else f" and params.cut_len {cut}"))
    if step > data_steps or end_step > data_steps:
        not_verified.append("rows: not re-drawn from the seed (the header's steps are past the data)")
    else:
        _redraw(params, header.get("counts") or {}, step, gap, end_step, B, examples, problems, not_verified)
    vocab = vocab_bound(params, vocab_size, problems, not_verified)
    (m_lo, m_hi), (n_lo, n_hi) = member_nonmember_steps(step, gap, end_step)
    _verify_rows(ds, {1: (m_lo, max(m_hi, 0)), 0: (n_lo, n_hi)}, B, examples, problems, vocab, cut)


def _redraw(params, counts, step, gap, end_step, B, examples, problems, not_verified) -> None:
    if params.get("sampler") != SAMPLER:
        not_verified.append(f"rows: not re-drawn from the seed (params.sampler {short_repr(params.get('sampler'))} "
                            "is not mia's pythia sampler)")
        return
    seed = checked_fields(params, {"seed": SEED}, "line 1: header params.", problems)
    dropped = dropped_rows(params, problems)
    n = draw_counts(counts, examples, problems, not_verified, dropped)
    if seed is None or n is None:
        return
    seed = seed["seed"]
    try:
        members, nonmembers = draw_row_indices(step, gap, end_step, B, n["members"], n["nonmembers"], seed)
    except (ValueError, TypeError) as e:
        problems.append(f"line 1: the header's parameters (seed, step, gap, end_step, batch_size and counts) do not "
                        f"give a draw: {one_line(str(e))}")
        return
    redraw_problems(examples, {1: set(members.tolist()), 0: set(nonmembers.tolist())}, problems,
                    f"seed {short_repr(seed)}, step {step}, gap {gap}, end_step {end_step}, batch {B}", dropped)


def _verify_rows(ds, step_ranges, B, examples, problems, vocab_size=None, cut=None):
    note = f" (the .idx declares {ds.dtype}: a wrong dtype code?)"
    for e in examples:
        ln = e.get("_line", "?")
        found, readable = position_problems(e, step_ranges, B, len(ds), "row", f"data ({len(ds)} rows)")
        problems.extend(found)
        if not readable:
            continue
        index = e["index"]
        toks = e.get("tokens")
        if toks is None:
            problems.append(f"line {ln}: no tokens")
            continue
        problems.extend(token_id_problems(e, vocab_size, note))
        try:
            row = ds[index] if cut is None else ds[index][:cut]
        except ValueError as ex:
            problems.append(f"line {ln}: cannot read row {index}: {ex}")
            continue
        if row.dtype.kind == "i" and row.size and row.min() < 0:
            problems.append(f"line {ln}: row {index} of the data holds id {int(row.min())} read as {ds.dtype}: "
                            f"negative{note}")
        if not isinstance(toks, np.ndarray):
            continue  # reported by the row checks
        if len(toks) != len(row) or not np.array_equal(toks, row):
            diff = next(
                (j for j, (a, b) in enumerate(zip(toks.tolist(), row.tolist())) if a != b), min(len(toks), len(row))
            )
            problems.append(f"line {ln}: tokens differ from row {index} of the data (first at position {diff})")
