"""Local text benchmarks -> split files (``"text"`` examples), read through ``datasets`` from local paths only.

Layouts:

* **MIMIR**: either one table (jsonl / json / parquet / csv, or a folder of them) with a ``member`` and a
  ``nonmember`` column per row (the HF ``iamgroot42/mimir`` layout, one file per domain / split: ``domain`` picks
  the files whose path contains it), or two files of members and non-members (a JSON list of strings, a JSONL
  file of one JSON string per line as MIMIR's ``cache_100_200_1000_512/{train,test}/<domain>_<split>.jsonl``, a
  ``.txt`` with one example per line, or a table with a text column).
* **WikiMIA**: a table with ``input`` (text) and ``label`` (1 = member).
* **generic**: any table with configurable text / label / id columns.

Labels accept 1/0, true/false, "member"/"nonmember" (also "non-member", "non_member").

``ngram_filter`` is MIMIR's ``ngram_<n>_<threshold>`` cleaning: drop non-members whose fraction of word n-grams
found in the member (or training) set exceeds the threshold.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from ..offline import force_offline
from ..validate import check_json_file, utf8_lines
from .examples import DataError, Example, check_label_conflicts
from .splits import SplitError, assign_partitions, file_record, partition_counts

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "csv", ".txt": "text"}


class TextDataError(SplitError):
    pass


def _builder(path: Path) -> str:
    name = path.name.lower()
    for suf in (".gz", ".bz2", ".xz", ".zst"):
        if name.endswith(suf):
            name = name[: -len(suf)]
    ext = os.path.splitext(name)[1]
    if ext not in BUILDERS:
        raise TextDataError(f"{path}: unsupported file type {ext!r} (jsonl, json, parquet, csv, tsv, txt)")
    return BUILDERS[ext]


def _files(path, contains: Optional[str] = None) -> list:
    p = Path(path)
    if not p.exists():
        raise TextDataError(f"{p}: local file not found (only local paths are read)")
    if p.is_dir():
        fs = []
        for q in sorted(p.rglob("*")):
            if q.is_file() and not q.name.startswith("."):
                try:
                    _builder(q)
                except TextDataError:
                    continue
                if contains is None or contains in str(q.relative_to(p)):
                    fs.append(q)
        if not fs:
            raise TextDataError(
                f"{p}: no jsonl/json/parquet/csv/txt files" + (f" matching {contains!r}" if contains else "")
            )
        return fs
    return [p]


def load_rows(path, contains: Optional[str] = None) -> tuple:
    """Rows (list of dicts) of a local file or folder, and the list of files read."""
    files = _files(path, contains)
    rows: list = []
    for f in files:
        b = _builder(f)
        if _blank(f):
            raise TextDataError(f"{f}: the file is empty (no rows)")
        if b == "json" and f.suffix.lower() == ".json":
            try:
                obj = json.loads(f.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                obj = None
            if isinstance(obj, list) and all(isinstance(x, str) for x in obj):  # MIMIR cache: list of strings
                rows.extend({"text": x} for x in obj)
                continue
            if isinstance(obj, dict) and all(isinstance(v, list) for v in obj.values()) and obj:
                n = {len(v) for v in obj.values()}
                if len(n) == 1:  # column-oriented json
                    keys = list(obj)
                    rows.extend({k: obj[k][i] for k in keys} for i in range(n.pop()))
                    continue
        strings = _jsonl_strings(f) if f.suffix.lower() == ".jsonl" else None
        if strings is not None:  # MIMIR's cache_*/{train,test}/*.jsonl: one JSON string per line
            rows.extend({"text": x} for x in strings)
            continue
        if b == "json":  # a bad line is named here (file:LINE), not in datasets' words ("An error occurred ...")
            check_json_file(f, TextDataError)
        rows.extend(_load_with_datasets(f, b))
    return rows, files


def _blank(f: Path, chunk: int = 1 << 16) -> bool:
    """True when an uncompressed file holds nothing but whitespace (compressed files: False, left to the reader)."""
    if f.name.lower().endswith((".gz", ".bz2", ".xz", ".zst")):
        return False
    with open(f, "rb") as fh:
        while block := fh.read(chunk):
            if block.strip():
                return False
    return True


def _jsonl_strings(f: Path) -> Optional[list]:
    """The lines of a JSONL file when every non-blank line is a JSON string (MIMIR's cache layout), else None.
    A line that is not UTF-8 is one ``TextDataError`` naming the file and line."""
    out = []
    for i, line in utf8_lines(f, TextDataError):
        if not line.lstrip().startswith('"'):
            return None
        try:
            v = json.loads(line)
        except json.JSONDecodeError:
            return None
        if not isinstance(v, str):
            return None
        out.append(v)
    return out or None


def _load_with_datasets(f: Path, builder: str) -> list:

    force_offline()
    import datasets

    kwargs = {}
    if builder == "csv" and f.name.lower().replace(".gz", "").endswith(".tsv"):
        kwargs["sep"] = "\t"
    bars = datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="mia-text-") as cache:
            try:
                ds = datasets.load_dataset(builder, data_files=[str(f)], split="train", cache_dir=cache,
                                           keep_in_memory=True, **kwargs)
            except Exception as e:  # datasets raises many types; report one line
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise TextDataError(f"{f}: cannot read as {builder}: {msg}") from None
            return ds.to_list()
    finally:
        if not bars:
            datasets.utils.enable_progress_bars()


def to_label(v, where: str) -> int:
    if isinstance(v, (bool, np.bool_)):
        return int(v)
    if isinstance(v, (int, np.integer)) and int(v) in (0, 1):
        return int(v)
    if isinstance(v, float) and v in (0.0, 1.0):
        return int(v)
    if isinstance(v, str):
        s = v.strip().lower()
        if s in ("1", "true", "member", "members", "in", "yes"):
            return 1
        if s in ("0", "false", "nonmember", "non-member", "non_member", "nonmembers", "out", "no"):
            return 0
    raise TextDataError(f"{where}: label {v!r} is not 0/1/true/false/member/nonmember")


def _text_of(row: dict, col: Optional[str], where: str) -> str:
    if col is None:
        strs = [k for k, v in row.items() if isinstance(v, str)]
        if "text" in row:
            col = "text"
        elif len(strs) == 1:
            col = strs[0]
        else:
            raise TextDataError(f"{where}: cannot tell the text column among {sorted(row)}; pass --text-column")
    if col not in row:
        raise TextDataError(f"{where}: no column {col!r} (columns: {sorted(row)})")
    v = row[col]
    if not isinstance(v, str):
        raise TextDataError(f"{where}: column {col!r} is {type(v).__name__}, not text")
    return v


def load_mimir(file=None, member=None, nonmember=None, domain: Optional[str] = None, text_column: Optional[str] = None,
               member_column: str = "member", nonmember_column: str = "nonmember") -> tuple:
    """``(examples, files)`` for a MIMIR-style benchmark (see module doc)."""
    ex: list = []
    files: list = []
    if file is not None:
        if member is not None or nonmember is not None:
            raise TextDataError("give either one MIMIR table (--file) or --member and --nonmember files, not both")
        rows, files = load_rows(file, contains=domain if Path(file).is_dir() else None)
        if rows and "domain" in rows[0] and domain is not None and not Path(file).is_dir():
            rows = [r for r in rows if r.get("domain") == domain]
            if not rows:
                raise TextDataError(f"{file}: no rows of domain {domain!r}")
        for col, label, tag in ((member_column, 1, "member"), (nonmember_column, 0, "nonmember")):
            for i, r in enumerate(rows):
                if col not in r:
                    raise TextDataError(f"{files[0]}: no column {col!r} (columns: {sorted(r)})")
                v = r[col]
                if v is None or (isinstance(v, str) and not v.strip()):
                    continue
                if not isinstance(v, str):
                    raise TextDataError(f"{files[0]}: row {i} column {col!r} is not text")
                ex.append({"id": f"{tag}-{i}", "text": v, "label": label})
    else:
        if member is None or nonmember is None:
            raise TextDataError("MIMIR format needs --file TABLE, or both --member and --nonmember files")
        for path, label, tag in ((member, 1, "member"), (nonmember, 0, "nonmember")):
            rows, fs = load_rows(path, contains=domain if Path(path).is_dir() else None)
            files += fs
            for i, r in enumerate(rows):
                ex.append({"id": f"{tag}-{i}", "text": _text_of(r, text_column, f"{fs[0]} row {i}"), "label": label})
    return ex, files


def load_wikimia(path, text_column: str = "input", label_column: str = "label") -> tuple:
    return load_generic(path, text_column=text_column, label_column=label_column)


def load_generic(
    path, text_column: str = "text", label_column: str = "label", id_column: Optional[str] = None
) -> tuple:
    rows, files = load_rows(path)
    ex = []
    for i, r in enumerate(rows):
        where = f"{files[0] if len(files) == 1 else path} row {i}"
        if label_column not in r:
            raise TextDataError(f"{where}: no label column {label_column!r} (columns: {sorted(r)})")
        if id_column and id_column not in r:
            raise TextDataError(f"{where}: no id column {id_column!r} (columns: {sorted(r)})")
        e = {"id": str(r[id_column]) if id_column else str(i), "text": _text_of(r, text_column, where),
             "label": to_label(r[label_column], where)}
        ex.append(e)
    ids = [e["id"] for e in ex]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise TextDataError(f"{path}: id {dup!r} appears more than once in column {id_column!r}")
    return ex, files


# ----------------------------------------------------------------------------------------------- n-grams

def _units(x, lowercase: bool) -> list:
    if isinstance(x, dict):
        x = x.get("text") if x.get("text") is not None else x.get("tokens")
    if isinstance(x, str):
        return (x.lower() if lowercase else x).split()
    return list(x)


def ngrams(units: Sequence, n: int) -> list:
    return [tuple(units[i:i + n]) for i in range(len(units) - n + 1)]


def ngram_overlap(x, reference_set: set, n: int = 13, lowercase: bool = False) -> float:
    """Fraction of ``x``'s n-grams found in ``reference_set``; 0.0 when ``x`` has fewer than n words."""
    g = ngrams(_units(x, lowercase), n)
    if not g:
        return 0.0
    return sum(1 for t in g if hash(t) in reference_set) / len(g)


def ngram_set(reference: Iterable, n: int = 13, lowercase: bool = False) -> set:
    """Hashes of every word n-gram (token n-gram for token lists) of the reference texts."""
    s: set = set()
    for x in reference:
        s.update(hash(t) for t in ngrams(_units(x, lowercase), n))
    return s


def ngram_filter(nonmembers: list, reference: Iterable, n: int = 13, threshold: float = 0.8,
                 lowercase: bool = False) -> tuple:
    """MIMIR ``ngram_{n}_{threshold}``: keep the non-members whose fraction of n-grams (words from
    ``str.split()``; tokens for token lists) found in ``reference`` (the member / training texts) is at most
    ``threshold``. Returns ``(kept, n_dropped)``; texts shorter than ``n`` words have no n-grams and are kept."""
    if n <= 0:
        raise TextDataError(f"n-gram size must be positive, got {n}")
    ref = ngram_set(reference, n, lowercase)
    kept = [x for x in nonmembers if ngram_overlap(x, ref, n, lowercase) <= threshold]
    return kept, len(nonmembers) - len(kept)


# ------------------------------------------------------------------------------------------------ splits

def check_text_label_conflicts(examples: list, files: Sequence) -> None:
    """Refuse a text under both labels, before a split is drawn from ``examples`` (the rows loaded, after the n-gram
    filter): ``mia score``'s rule (``mia.data.examples.check_label_conflicts``: the same text labelled 1 and 0 is
    one input that cannot be both a member and a non-member), applied when the split is made, whichever rows the
    seed draws. One ``TextDataError`` naming both ids and the input."""
    where = str(files[0]) if len(files) == 1 else "the input files"
    try:
        check_label_conflicts([Example(id=str(e["id"]), text=e["text"], label=e["label"], source=where)
                               for e in examples])
    except DataError as e:
        raise TextDataError(f"{e}; remove one of the two from the input files") from None


def build_text_split(examples: list, files: list, params: dict, n_members: Optional[int] = None,
                     n_nonmembers: Optional[int] = None, seed: int = 0, partitions=None,
                     ngram: Optional[tuple] = None, ngram_reference: Optional[list] = None) -> tuple:
    """Subsample / filter loaded examples into ``(header, examples)``.

    ``ngram=(n, threshold)`` runs ``ngram_filter`` on the non-members against ``ngram_reference`` (texts) or, by
    default, all loaded members, before subsampling. A text that is then under both labels is refused
    (``check_text_label_conflicts``), whatever rows the seed would draw."""
    mem = [e for e in examples if e["label"] == 1]
    non = [e for e in examples if e["label"] == 0]
    params = dict(params)
    if ngram is not None:
        n, thr = ngram
        ref = ngram_reference if ngram_reference is not None else [e["text"] for e in mem]
        non, dropped = ngram_filter(non, ref, n=int(n), threshold=float(thr))
        params["ngram_filter"] = {"n": int(n), "threshold": float(thr), "dropped": dropped,
                                  "reference": "ngram_reference" if ngram_reference is not None else "members"}
    check_text_label_conflicts(mem + non, files)
    rng = np.random.default_rng(seed)
    out = []
    for pool, want, what in ((mem, n_members, "members"), (non, n_nonmembers, "non-members")):
        if want is None:
            out += pool
            continue
        if want > len(pool):
            raise TextDataError(f"asked for {want} {what} but the files hold only {len(pool)}"
                                + (" after the n-gram filter" if ngram is not None and what == "non-members" else ""))
        pick = np.sort(rng.choice(len(pool), size=int(want), replace=False))
        out += [pool[i] for i in pick.tolist()]
    for e in out:
        e.setdefault("partition", "eval")
        e.update({"step": None, "batch_pos": None, "index": None})
    if partitions:
        assign_partitions(out, partitions, seed)
    params.update({"seed": seed, "n_members": n_members, "n_nonmembers": n_nonmembers})
    header = {"source": {"kind": "text", "files": [file_record(f) for f in files]}, "params": params}
    header.update(partition_counts(out))
    return header, out
