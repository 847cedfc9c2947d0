"""OLMo training order: ``global_indices`` + token memmaps -> training instances, checkpoint splits, OLMoMIA documents.

Facts (docs/algorithms.md#olmo-order and #difficulty):

* ``global_indices.npy`` (epoch 1) is a **raw uint32 memmap without a .npy header**;
* instance ``k`` is the ``k``-th ``seq_len``-token chunk of the ordered list of raw uint16 token files
  (``cfg.data.paths``); each file contributes ``floor(tokens / seq_len)`` chunks, the remainder is dropped;
* batch ``b`` = ``global_indices[b*B:(b+1)*B]`` with ``B = 2160`` and ``seq_len = 2048``;
* the file's length is not the instance count N: OLMo's ``IterableDataset`` (olmo/data/iterable_dataset.py,
  ``__init__``'s ``total_size`` and ``_build_global_indices``) makes it a multiple of the world size W, which divides
  the global batch size. With ``drop_last=True`` (OLMo-7B's ``data.drop_last``) it is ``ceil((N - W) / W) * W``:
  the shuffled order's last ``N mod W`` entries are dropped (never trained on in the epoch); with
  ``drop_last=False`` it is ``ceil(N / W) * W``: the first ``pad`` entries are repeated at the end. Both differ
  from N by less than W <= B; see ``reconcile_length`` (the ignored part is reported in ``OlmoOrder.notes``);
* OLMoMIA documents: split an instance at EOS (50279), keep the segments strictly between two consecutive EOS,
  keep the first with ``L/2 < len <= L`` (at most one per instance).

Members are drawn from positions of steps ``[0, S)`` and non-members from ``[S2, E)``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .examples import out_of_vocab
from .splits import (BOOL, INT, NONNEG_INT, POS_INT, SEED, Kind, SplitError, assign_partitions, checked_fields,
                     derived_problems, draw_counts, dropped_rows, file_record, is_int, one_line, partition_counts,
                     position_problems, redraw_problems, rows_to_lists, short_repr, token_id_problems, vocab_bound)

BATCH_SIZE = 2160
SEQ_LEN = 2048
EOS = 50279
PAD = 1
DOC_LEN = 128


class OlmoDataError(SplitError):
    """Inconsistent OLMo order / token files (the message names the file)."""


def read_data_paths(list_file) -> list:
    """One token file per line (blank lines and ``#`` comments skipped). Relative paths are resolved against
    the list file's folder when they exist there, else against the working directory."""
    list_file = Path(list_file)
    if not list_file.exists():
        raise OlmoDataError(f"{list_file}: data path list not found")
    out = []
    for line in list_file.read_text().splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        p = Path(s)
        if not p.is_absolute() and (list_file.parent / p).exists():
            p = list_file.parent / p
        out.append(p)
    if not out:
        raise OlmoDataError(f"{list_file}: no data paths listed")
    return out


def token_dtype(spec) -> np.dtype:
    """The numpy dtype of ``--token-dtype``: an integer dtype (OLMo writes uint16, or uint32 for larger
    vocabularies); anything else is one ``OlmoDataError``."""
    try:
        dt = np.dtype(spec)
    except (TypeError, ValueError, SyntaxError):
        raise OlmoDataError(f"--token-dtype {spec!r} is not a numpy dtype (OLMo token files are uint16 or "
                            "uint32)") from None
    if dt.kind not in "iu":
        raise OlmoDataError(f"--token-dtype {spec!r} is {dt}, not an integer dtype (OLMo token files are uint16 "
                            "or uint32)")
    return dt


class TokenFiles:
    """The ordered token files as a list of ``seq_len``-token instances."""

    def __init__(self, paths: Sequence, seq_len: int = SEQ_LEN, dtype=np.uint16):
        self.paths = [Path(p) for p in paths]
        self.seq_len = int(seq_len)
        self.dtype = token_dtype(dtype)
        if self.seq_len <= 0:
            raise OlmoDataError(f"seq_len must be positive, got {seq_len}")
        counts = []
        for p in self.paths:
            if not p.is_file():
                raise OlmoDataError(f"{p}: token file not found" + (" (a directory)" if p.is_dir() else ""))
            counts.append(os.path.getsize(p) // self.dtype.itemsize // self.seq_len)
        self.chunks = np.asarray(counts, dtype=np.int64)
        self.starts = np.zeros(len(self.paths) + 1, dtype=np.int64)
        np.cumsum(self.chunks, out=self.starts[1:])
        self._maps = [None] * len(self.paths)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, k: int) -> tuple:
        """``(file number, chunk within the file)`` of instance ``k``."""
        k = int(k)
        if not 0 <= k < len(self):
            raise IndexError(f"instance {k} out of range ({len(self)} instances in {len(self.paths)} files)")
        f = int(np.searchsorted(self.starts, k, side="right")) - 1
        return f, k - int(self.starts[f])

    def _map(self, f: int):
        if self._maps[f] is None:
            n = int(self.chunks[f]) * self.seq_len
            self._maps[f] = (
                np.memmap(self.paths[f], dtype=self.dtype.newbyteorder("<"), mode="r", shape=(n,))
                if n
                else np.zeros(0, self.dtype)
            )
        return self._maps[f]

    def __getitem__(self, k: int) -> np.ndarray:
        f, c = self.locate(k)
        return np.asarray(self._map(f)[c * self.seq_len:(c + 1) * self.seq_len], dtype=self.dtype)

    def get_many(self, ks) -> np.ndarray:
        ks = list(ks)
        out = np.empty((len(ks), self.seq_len), dtype=self.dtype)
        for r, k in enumerate(ks):
            out[r] = self[k]
        return out


def load_global_indices(path, fmt: str = "raw", dtype=np.uint32) -> np.ndarray:
    """Memory-map the order file: ``fmt="raw"`` (OLMo's headerless uint32 memmap) or ``"npy"``."""
    path = Path(path)
    if not path.exists():
        raise OlmoDataError(f"{path}: global indices file not found")
    if path.is_dir():
        raise OlmoDataError(f"{path}: global indices file is a directory")
    if fmt == "npy":
        try:
            a = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise OlmoDataError(f"{path}: not a .npy file ({msg}); OLMo's file is raw, use the raw format") from None
        if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "iu":
            raise OlmoDataError(f"{path}: expected a 1-D integer array of instance indices, got "
                                f"{getattr(a, 'dtype', type(a).__name__)} of shape {getattr(a, 'shape', '?')}")
        return a
    if fmt != "raw":
        raise OlmoDataError(f"unknown global indices format {fmt!r} (raw | npy)")
    dt = np.dtype(dtype)
    size = os.path.getsize(path)
    if size % dt.itemsize:
        raise OlmoDataError(f"{path}: {size} bytes is not a whole number of {dt} entries")
    if size == 0:
        return np.zeros(0, dtype=dt)
    return np.memmap(path, dtype=dt.newbyteorder("<"), mode="r")


class OlmoOrder:
    """``global_indices`` + token files; ``order[q]`` is the instance at global position ``q``."""

    def __init__(self, global_indices, data_paths, seq_len: int = SEQ_LEN, batch_size: int = BATCH_SIZE,
                 token_dtype=np.uint16, indices_format: str = "raw"):
        self.global_indices_path = None
        if isinstance(global_indices, (str, os.PathLike)):
            self.global_indices_path = Path(global_indices)
            global_indices = load_global_indices(global_indices, indices_format)
        self.global_indices = global_indices
        if isinstance(data_paths, (str, os.PathLike)):
            self.data_paths_file = Path(data_paths)
            data_paths = read_data_paths(data_paths)
        else:
            self.data_paths_file = None
        self.tokens = TokenFiles(data_paths, seq_len=seq_len, dtype=token_dtype)
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        if self.batch_size <= 0:
            raise OlmoDataError(f"batch size must be positive, got {batch_size}")
        name = str(self.global_indices_path or "global indices")
        usable, note = reconcile_length(self.global_indices, len(self.tokens), self.batch_size, name,
                                        len(self.tokens.paths), self.seq_len)
        self.global_indices = self.global_indices[:usable]
        self.notes = [note] if note else []

    def __len__(self) -> int:
        return len(self.global_indices)

    @property
    def steps(self) -> int:
        """Complete batches in the order."""
        return len(self) // self.batch_size

    def instance_id(self, q: int) -> int:
        """The instance at global position ``q``, checked against the token files (one ``OlmoDataError`` naming
        the order file when the position or the instance is out of range)."""
        q = int(q)
        name = self.global_indices_path or "global indices"
        if not 0 <= q < len(self):
            raise OlmoDataError(f"{name}: position {q} is past the order ({len(self)} positions used)")
        k = int(self.global_indices[q])
        if not 0 <= k < len(self.tokens):
            raise OlmoDataError(f"{name}: position {q} holds instance {k}, but the token files hold "
                                f"{len(self.tokens)} instances (wrong file list, seq_len or --token-dtype?)")
        return k

    def __getitem__(self, q: int) -> np.ndarray:
        return self.tokens[self.instance_id(q)]

    def check_vocab(self, q: int, tokens: np.ndarray, vocab_size: int, offset: int = 0) -> None:
        """Raise naming the token file, instance and token of the first id of ``tokens`` (the instance at position
        ``q``, from token ``offset`` on) outside ``[0, vocab_size)``."""
        bad = out_of_vocab(tokens, vocab_size)
        if bad is None:
            return
        j, tok_id = bad[0][0] + offset, bad[1]
        k = self.instance_id(q)
        f, c = self.tokens.locate(k)
        raise OlmoDataError(f"{self.tokens.paths[f]}: instance {k} (global position {q}, step {q // self.batch_size}) "
                            f"token {j} (token {c * self.seq_len + j} of the file) is id {tok_id}, outside the model "
                            f"vocabulary ({vocab_size} ids): the data do not match the model's tokenizer")

    def batch(self, b: int) -> np.ndarray:
        """Instance ids of batch ``b``."""
        lo, hi = step_positions(b, self.batch_size)
        if hi > len(self):
            raise IndexError(f"batch {b} is past the order ({self.steps} complete batches)")
        return np.asarray(self.global_indices[lo:hi], dtype=np.int64)


def reconcile_length(global_indices, n_instances: int, batch_size: int, name: str = "global indices",
                     n_files: int = 0, seq_len: int = SEQ_LEN) -> tuple:
    """(usable length of the order, note or None) for an order file of ``len(global_indices)`` entries over
    ``n_instances`` instances, accepting exactly what OLMo writes (module docstring; world size W <= batch size):

    * as many entries as instances: all usable;
    * fewer, by less than ``batch_size`` (drop_last=True): all usable; the missing instances were never trained on;
    * more, by less than ``batch_size``, the extra entries equal to the first ones (drop_last=False padding): the
      first ``n_instances`` are usable; the repeats at the end are ignored (they would be trained twice, so they are
      neither clean members nor non-members).

    Anything else is an error naming the file (a wrong file list, seq_len or dtype)."""
    n = len(global_indices)
    diff = n - n_instances
    where = (f"{name}: {n} entries but the {n_files} token files hold {n_instances} instances of {seq_len} tokens")
    if diff == 0:
        return n, None
    if abs(diff) >= batch_size:
        raise OlmoDataError(f"{where} (wrong file list, order, seq_len or dtype?); OLMo's order differs from the "
                            f"instance count by less than the world size <= the batch size {batch_size}")
    if diff < 0:
        return n, (f"{where}: the last {-diff} shuffled instances are not in the order (OLMo's IterableDataset with "
                   "drop_last=True trims the order to a multiple of the world size); they were never trained on "
                   "in this epoch and are never drawn")
    head = np.asarray(global_indices[:diff])
    tail = np.asarray(global_indices[n_instances:])
    if not np.array_equal(head, tail):
        raise OlmoDataError(f"{where}, and the {diff} extra entries are not OLMo's padding (a repeat of the first "
                            f"{diff} entries): wrong file list, order, seq_len or dtype?")
    return n_instances, (f"{where}: the last {diff} entries repeat the first {diff} (OLMo's IterableDataset with "
                         f"drop_last=False pads the order to a multiple of the world size); positions >= "
                         f"{n_instances} are ignored")


def step_positions(step: int, batch_size: int = BATCH_SIZE) -> tuple:
    """Global positions ``[lo, hi)`` trained on at step ``step``."""
    return int(step) * batch_size, (int(step) + 1) * batch_size


# ------------------------------------------------------------------------------------------- documents

def split_documents(tokens, eos: int = EOS) -> list:
    """Segments strictly between two consecutive EOS: list of ``(segment_no, start, end)`` with
    ``tokens[start:end]`` the document (EOS excluded). The leading and trailing partial documents are dropped;
    empty segments (two adjacent EOS) are kept as empty and numbered (they never pass a length filter)."""
    t = np.asarray(tokens)
    pos = np.nonzero(t == eos)[0]
    return [(j, int(pos[j]) + 1, int(pos[j + 1])) for j in range(len(pos) - 1)]


def pick_document(tokens, eos: int = EOS, doc_len: int = DOC_LEN):
    """The first inner document with ``doc_len/2 < length <= doc_len``: ``(segment_no, start, end)`` or None."""
    for seg, s, e in split_documents(tokens, eos):
        n = e - s
        if 2 * n > doc_len and n <= doc_len:
            return seg, s, e
    return None


# ---------------------------------------------------------------------------------------------- drawing

def _positions(rng, lo: int, hi: int, n: int, what: str) -> np.ndarray:
    size = hi - lo
    if n > size:
        raise OlmoDataError(f"asked for {n} {what} but positions [{lo}, {hi}) hold only {size}")
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    return lo + rng.choice(size, size=n, replace=False).astype(np.int64)


def _draw_documents(
    order: OlmoOrder, rng, lo: int, hi: int, n: int, eos: int, doc_len: int, pool: Optional[int], what: str
):
    size = hi - lo
    k = min(size, pool if pool is not None else max(20 * n, 1000))
    if n > size:
        raise OlmoDataError(f"asked for {n} {what} but positions [{lo}, {hi}) hold only {size} instances")
    cand = lo + rng.choice(size, size=k, replace=False).astype(np.int64) if n > 0 else np.zeros(0, np.int64)
    out = []
    for q in cand.tolist():
        if len(out) == n:
            break
        toks = order[q]
        d = pick_document(toks, eos, doc_len)
        if d is not None:
            out.append((q, d, toks[d[1]:d[2]]))
    if len(out) < n:
        raise OlmoDataError(f"only {len(out)} of {n} {what} found in {k} candidate instances "
                            f"({doc_len // 2} < length <= {doc_len} between two EOS {eos}); raise --pool or --doc-len")
    return out


SAMPLER = "numpy.random.default_rng(seed).choice(range, n, replace=False): members, then non-members"


def draw_positions(order: OlmoOrder, seed, m_rng: tuple, n_rng: tuple, n_members: int, n_nonmembers: int,
                   documents: bool = False, eos: int = EOS, doc_len: int = DOC_LEN, pool: Optional[int] = None) -> list:
    """The draw itself: ``[(label, position, document or None, tokens or None), ...]``, members then non-members,
    from one ``numpy.random.default_rng(seed)`` stream. Positions uniformly without replacement from ``m_rng`` /
    ``n_rng`` (``[lo, hi)``); with ``documents``, candidate positions scanned in drawn order (``_draw_documents``;
    the document's tokens come along)."""
    rng = np.random.default_rng(seed)
    out = []
    if documents:
        for label, (lo, hi), n, what in ((1, m_rng, n_members, "member documents"),
                                         (0, n_rng, n_nonmembers, "non-member documents")):
            out += [(label, q, d, toks) for q, d, toks in
                    _draw_documents(order, rng, lo, hi, n, eos, doc_len, pool, what)]
    else:
        for label, (lo, hi), n, what in ((1, m_rng, n_members, "members"), (0, n_rng, n_nonmembers, "non-members")):
            out += [(label, q, None, None) for q in _positions(rng, lo, hi, n, what).tolist()]
    return out


def check_token_ids(order: OlmoOrder, q: int, toks: np.ndarray, vocab_size: Optional[int], offset: int = 0) -> None:
    """``check_vocab`` when the vocabulary size is known; else only negative ids (a signed ``--token-dtype`` over
    unsigned data) stop."""
    if vocab_size is not None:
        order.check_vocab(q, toks, int(vocab_size), offset=offset)
    elif order.tokens.dtype.kind == "i" and toks.size and toks.min() < 0:
        j = int(np.argmax(toks < 0))
        raise OlmoDataError(f"{order.tokens.paths[order.tokens.locate(order.instance_id(q))[0]]}: instance "
                            f"{order.instance_id(q)} token {j + offset} is id {int(toks[j])} read as "
                            f"{order.tokens.dtype}: negative ids are not token ids (wrong --token-dtype?)")


def draw_checkpoint_split(dataset: OlmoOrder, step: int, n_members: int, n_nonmembers: int, seed: int,
                          nonmember_start: Optional[int] = None, end_step: Optional[int] = None,
                          batch_size: Optional[int] = None, partitions=None, documents: bool = False,
                          eos: int = EOS, doc_len: int = DOC_LEN, pool: Optional[int] = None,
                          hash_limit: int = 64 << 20, vocab_size: Optional[int] = None):
    """Members from the positions of steps ``[0, step)``, non-members from ``[nonmember_start, end_step)``
    (default: ``step`` and the last complete batch), uniformly without replacement
    (``numpy.random.default_rng(seed)``: members first, then non-members).

    ``documents=True`` turns each drawn position into one OLMoMIA document (see ``pick_document``): candidate
    positions are drawn (``pool`` per class, default ``max(20 n, 1000)``) and scanned in drawn order. With
    ``vocab_size`` (the model's), a drawn token id outside ``[0, vocab_size)`` stops with one line naming the token
    file, instance and token. The order's ``notes`` (ignored entries, see ``reconcile_length``) go to the header."""
    order = dataset
    B = int(batch_size or order.batch_size)
    step = int(step)
    S2 = step if nonmember_start is None else int(nonmember_start)
    E = order.steps if end_step is None else int(end_step)
    total_steps = len(order) // B
    if step < 0 or S2 < 0:
        raise OlmoDataError("steps must be non-negative")
    if step > total_steps:
        raise OlmoDataError(f"step {step} is past the data: {len(order)} positions hold {total_steps} steps of {B}")
    if E > total_steps:
        raise OlmoDataError(f"non-member range [{S2}, {E}) crosses the end of the order "
                            f"({len(order)} positions = {total_steps} steps of {B}); lower --end-step")
    if S2 < step:
        raise OlmoDataError(f"non-member start {S2} is before the checkpoint step {step}: those positions were trained "
                            "on")
    if S2 >= E and n_nonmembers:
        raise OlmoDataError(f"non-member range [{S2}, {E}) is empty")
    if step == 0 and n_members:
        raise OlmoDataError("member range [0, 0) is empty (step 0)")
    m_rng, n_rng = (0, step * B), (S2 * B, max(E, S2) * B)
    if documents and doc_len <= 0:
        raise OlmoDataError("doc_len must be positive")
    examples = []
    for label, q, doc, toks in draw_positions(order, seed, m_rng, n_rng, int(n_members), int(n_nonmembers),
                                              documents, eos, doc_len, pool):
        if toks is None:
            toks = order[q]
        check_token_ids(order, q, toks, vocab_size, offset=0 if doc is None else doc[1])
        e = {"id": f"olmo{q}" if doc is None else f"olmo{q}-{doc[0]}", "label": label, "partition": "eval",
             "tokens": rows_to_lists(toks[None])[0], "step": q // B, "batch_pos": q % B, "index": q,
             "instance": order.instance_id(q)}
        if doc is not None:
            e.update(segment=doc[0], offset=doc[1])
        examples.append(e)
    if partitions:
        assign_partitions(examples, partitions, seed)
    src = {
        "kind": "olmo",
        "global_indices": (file_record(order.global_indices_path, full_limit=hash_limit)
                           if order.global_indices_path else None),
        "global_indices_format": "raw",
        "data_paths": [file_record(p, full_limit=hash_limit) for p in order.tokens.paths],
        "data_paths_file": str(order.data_paths_file.resolve()) if order.data_paths_file else None,
        "token_dtype": str(order.tokens.dtype),
        "n_instances": len(order.tokens),
        "order_positions_used": len(order),
        "notes": list(order.notes),
    }
    params = {"step": step, "seed": seed, "batch_size": B, "seq_len": order.seq_len, "end_step": E,
              "nonmember_start": S2, "member_steps": [0, step], "nonmember_steps": [S2, E],
              "member_positions": list(m_rng), "nonmember_positions": list(n_rng),
              "documents": bool(documents), "vocab_size": None if vocab_size is None else int(vocab_size),
              "sampler": SAMPLER}
    if documents:
        params.update({"eos": eos, "doc_len": doc_len, "pool": pool,
                       "doc_rule": "first segment strictly between two EOS with doc_len/2 < len <= doc_len, "
                                   "one per instance, candidates scanned in drawn order"})
    header = {"source": src, "params": params}
    header.update(partition_counts(examples))
    return header, examples


def expected_params(step: int, nonmember_start: int, end_step: int, batch_size: int) -> dict:
    """The header fields that follow from the step parameters (what ``draw_checkpoint_split`` writes)."""
    return {"member_steps": [0, step], "nonmember_steps": [nonmember_start, end_step],
            "member_positions": [0, step * batch_size],
            "nonmember_positions": [nonmember_start * batch_size, max(end_step, nonmember_start) * batch_size]}


PARAMS = {"step": NONNEG_INT, "nonmember_start": NONNEG_INT, "end_step": INT, "batch_size": POS_INT,
          "seq_len": POS_INT, "documents": BOOL, "pool": NONNEG_INT.or_null()}
"""The header ``params`` an OLMo split is verified from (the step ranges follow from them: ``expected_params``)."""

DOCUMENT_PARAMS = {"eos": NONNEG_INT, "doc_len": POS_INT}
"""The document rule's ``params`` of an OLMoMIA document split (absent: the defaults ``EOS`` and ``DOC_LEN``)."""


def _is_integer_dtype_name(v) -> bool:
    try:
        return isinstance(v, str) and np.dtype(v).kind in "iu"
    except (TypeError, ValueError, SyntaxError):
        return False


SOURCE = {"token_dtype": Kind("an integer numpy dtype (uint16, uint32)", _is_integer_dtype_name).or_null(),
          "global_indices_format": Kind("'raw' or 'npy'", lambda v: v in ("raw", "npy")).or_null(),
          "n_instances": NONNEG_INT.or_null(), "order_positions_used": NONNEG_INT.or_null()}
"""The header ``source`` fields besides the file records (``splits.SOURCE_FILES``) used to open and compare."""


def verify_examples(header: dict, examples: list, problems: list, not_verified: Optional[list] = None,
                    vocab_size: Optional[int] = None) -> None:
    """Verify an OLMo split against its header and sources (used by ``verify.verify_split``, which has checked the
    header's file records and the rows' field types): the header's parameters against each other and the order,
    the drawn positions against a re-draw, every row re-read."""
    not_verified = [] if not_verified is None else not_verified
    src, params = header.get("source", {}), header.get("params", {})
    p = checked_fields(params, PARAMS, "line 1: header params.", problems)
    s = checked_fields(src, SOURCE, "line 1: header source.", problems)
    docs = p is not None and p["documents"]
    d = checked_fields({"eos": EOS, "doc_len": DOC_LEN, **params}, DOCUMENT_PARAMS, "line 1: header params.",
                       problems) if docs else {"eos": EOS, "doc_len": DOC_LEN}
    if p is None or s is None or d is None:
        not_verified.append("rows: not verified against the data (unusable header parameters)")
        return
    step, S2, E, B = p["step"], p["nonmember_start"], p["end_step"], p["batch_size"]
    eos, doc_len = d["eos"], d["doc_len"]
    if S2 < step:
        problems.append(f"line 1: header params.nonmember_start {S2} is before params.step {step}: those positions "
                        "were trained on")
        not_verified.append("rows: not verified against the data (unusable header parameters)")
        return
    derived_problems(params, expected_params(step, S2, E, B), problems,
                     f"step {step}, nonmember_start {S2}, end_step {E} and batch_size {B}")
    try:
        order = OlmoOrder(src["global_indices"]["path"], [r["path"] for r in src["data_paths"]], seq_len=p["seq_len"],
                          batch_size=B, token_dtype=s["token_dtype"] or "uint16",
                          indices_format=s["global_indices_format"] or "raw")
    except (KeyError, TypeError) as e:
        problems.append(f"line 1: olmo source incomplete ({one_line(str(e))})")
        return
    except (ValueError, OSError) as e:
        problems.append(f"line 1: cannot open sources: {one_line(str(e))}")
        return
    for k, now in (("n_instances", len(order.tokens)), ("order_positions_used", len(order)),
                   ("token_dtype", str(order.tokens.dtype))):
        if s[k] not in (None, now):
            problems.append(f"line 1: header source.{k} is {short_repr(s[k])} but the sources give {now!r}")
    if step > order.steps or E > order.steps:
        problems.append(f"line 1: header step {step} / end_step {E} past the order ({order.steps} steps of {B})")
        return
    _redraw(order, params, p["pool"], header.get("counts") or {}, (step, S2, E, B), docs, eos, doc_len, examples,
            problems, not_verified)
    vocab = vocab_bound(params, vocab_size, problems, not_verified)
    note = f" (token files read as {order.tokens.dtype}: a wrong token dtype?)"
    step_ranges = {1: (0, step), 0: (S2, E)}
    for e in examples:
        ln = e.get("_line", "?")
        found, readable = position_problems(e, step_ranges, B, len(order), "position", f"order ({len(order)})")
        problems.extend(found)
        if not readable:
            continue
        q = e["index"]
        try:
            inst = order.instance_id(q)
        except OlmoDataError as ex:
            problems.append(f"line {ln}: {ex}")
            continue
        if is_int(e.get("instance")) and e["instance"] != inst:  # another value: reported by the row checks
            problems.append(f"line {ln}: instance {e['instance']} but global_indices[{q}] = {inst}")
        toks = e.get("tokens")
        if toks is None:
            problems.append(f"line {ln}: no tokens")
            continue
        problems.extend(token_id_problems(e, vocab, note))
        if not isinstance(toks, np.ndarray):
            continue  # reported by the row checks
        full = order.tokens[inst]
        if docs:
            doc = pick_document(full, eos, doc_len)
            if doc is None or doc[0] != e.get("segment") or doc[1] != e.get("offset"):
                problems.append(f"line {ln}: segment {short_repr(e.get('segment'))} at offset "
                                f"{short_repr(e.get('offset'))} is not the document picked from instance {inst} "
                                f"({doc})")
                continue
            ref = full[doc[1]:doc[2]]
        else:
            ref = full
        if len(toks) != len(ref) or not np.array_equal(toks, ref):
            diff = next(
                (j for j, (a, b) in enumerate(zip(toks.tolist(), ref.tolist())) if a != b), min(len(toks), len(ref))
            )
            problems.append(f"line {ln}: tokens differ from the data at position {q} (first at token {diff})")


def _redraw(order, params, pool, counts, steps, docs, eos, doc_len, examples, problems, not_verified) -> None:
    step, S2, E, B = steps
    if params.get("sampler") != SAMPLER:
        not_verified.append(f"rows: not re-drawn from the seed (params.sampler {short_repr(params.get('sampler'))} "
                            "is not mia's OLMo sampler)")
        return
    seed = checked_fields(params, {"seed": SEED}, "line 1: header params.", problems)
    dropped = dropped_rows(params, problems)
    n = draw_counts(counts, examples, problems, not_verified, dropped)
    if seed is None or n is None:
        return
    seed = seed["seed"]
    m_rng, n_rng = (0, step * B), (S2 * B, max(E, S2) * B)
    try:
        drawn = draw_positions(order, seed, m_rng, n_rng, n["members"], n["nonmembers"], docs, eos, doc_len, pool)
    except (ValueError, TypeError) as e:
        used = "seed, step, nonmember_start, end_step, batch_size" + (", eos, doc_len, pool" if docs else "")
        problems.append(f"line 1: the header's parameters ({used} and counts) do not give a draw: "
                        f"{one_line(str(e))}")
        return
    keys: dict = {0: set(), 1: set()}
    for label, q, doc, _ in drawn:
        keys[label].add(q if doc is None else (q, doc[0]))
    redraw_problems(examples, keys, problems,
                    f"seed {short_repr(seed)}, steps [0, {step}) and [{S2}, {E}), batch {B}", dropped)
