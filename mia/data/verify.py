"""``verify_split``: re-read a split file and verify everything it claims (``mia split check``).

Rows, header and content are checked here; the rows of a training-order split (Pythia, testbed, OLMo) are re-read
from their sources and re-drawn from the seed by ``mia.data.pythia`` / ``mia.data.olmo_order``. Never raises on a bad
file: every problem is one line naming the file's line and field.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from . import olmo_order, pythia
from .splits import (FORMAT, HEADER_HASH, NONNEG_INT, ROW_HASH, SOURCE_FILES, SplitError, content_key, read_split_raw,
                     checked_fields, hash_matches, one_line, partition_counts, short_repr, source_file_records,
                     verify_file_record)

# ---------------------------------------------------------------------------------------------- checking

@dataclasses.dataclass
class SplitCheck:
    """What ``verify_split`` found: ``problems`` (each names a line; empty = nothing wrong found) and
    ``not_verified`` (one line per verification the file or the options did not allow)."""
    problems: list
    not_verified: list


_HEADER_OBJECTS = ("source", "params", "counts", "partitions")


ROW_POSITIONS = {k: NONNEG_INT.or_null() for k in ("index", "step", "batch_pos", "segment", "offset", "instance")}
"""A row's place in a training order: null in text splits, non-negative integers in Pythia / OLMo ones."""


def _row_problems(ex: list, h: dict, problems: list) -> None:
    """Per-row field checks; fields of the wrong type are replaced by their repr (a string) so later checks can run
    and know them reported."""
    hp = h.get("partitions") if isinstance(h.get("partitions"), dict) else None
    seen_ids: dict = {}
    for e in ex:
        ln = e.get("_line")
        if "id" not in e or e["id"] is None:
            problems.append(f"line {ln}: no id")
        elif not isinstance(e["id"], (str, int)) or isinstance(e["id"], bool):
            problems.append(f"line {ln}: id {short_repr(e['id'])} is not a string or integer")
        else:
            i = str(e["id"])
            if i in seen_ids:
                problems.append(f"line {ln}: id {one_line(i, 200)} already used on line {seen_ids[i]}")
            else:
                seen_ids[i] = ln
        if isinstance(e.get("label"), bool) or e.get("label") not in (0, 1):
            problems.append(f"line {ln}: label {short_repr(e.get('label'))} is not 0 or 1")
            e["label"] = repr(e.get("label"))
        if not isinstance(e.get("partition"), str):
            problems.append(f"line {ln}: partition {short_repr(e.get('partition'))} is not a string")
            e["partition"] = repr(e.get("partition"))
        if e.get("tokens") is None and e.get("text") is None:
            problems.append(f"line {ln}: neither tokens nor text")
        if e.get("text") is not None and not isinstance(e["text"], str):
            problems.append(f"line {ln}: text is {type(e['text']).__name__}, not a string")
        toks = e.get("tokens")
        if toks is not None and not isinstance(toks, np.ndarray):
            problems.append(f"line {ln}: tokens must be a list of integer ids")
        if checked_fields(e, ROW_POSITIONS, f"line {ln}: ", problems) is None:
            for k, kind in ROW_POSITIONS.items():
                if not kind.accepts(e.get(k)):
                    e[k] = repr(e[k])  # reported; hashable, and no integer for the checks that follow
        if hp is not None and e["partition"] not in hp:
            problems.append(f"line {ln}: partition {short_repr(e['partition'])} not in the header's partitions "
                            f"{short_repr(sorted(hp))}")


def _header_problems(h: dict, ex: list, problems: list) -> None:
    """Header format and field types; header counts and partitions against the rows."""
    if not h:
        first = ex[0] if ex else {}
        why = ""
        if first.get("_line") == 1 and ("format" in first or "params" in first):
            why = f" (line 1 has header fields, but type {short_repr(first.get('type'))}, not 'header')"
        problems.append(f"line 1: no header line{why}")
        return
    if h.get("format") != FORMAT:
        problems.append(f"line 1: format {short_repr(h.get('format'))}, expected {FORMAT!r}")
    for k in _HEADER_OBJECTS:
        if k in h and not isinstance(h[k], dict):
            problems.append(f"line 1: header field {k!r} is {type(h[k]).__name__}, expected an object")
            h[k] = {}
    now = partition_counts(ex)
    counts = h.get("counts")
    if counts:
        for k in ("members", "nonmembers"):
            if k in counts and counts[k] != now["counts"][k]:
                problems.append(f"line 1: header counts {k}={short_repr(counts[k])} but the file has "
                                f"{now['counts'][k]}")
        if "partitions" in counts and counts["partitions"] != now["counts"]["partitions"]:
            problems.append(f"line 1: header counts.partitions {short_repr(counts['partitions'], 200)} but the "
                            f"file has {short_repr(now['counts']['partitions'], 200)}")
    hp = h.get("partitions")
    if hp and hp != now["partitions"]:
        problems.append(f"line 1: header partitions {short_repr(hp, 200)} but the file has "
                        f"{short_repr(now['partitions'], 200)}")


def _content_problems(ex: list, problems: list) -> None:
    """The same training position twice; identical content across classes or across partitions."""
    pos_seen: dict = {}
    for e in ex:
        key = (e.get("index"), e.get("segment"))
        if e.get("index") is not None:
            if key in pos_seen:
                problems.append(f"line {e.get('_line')}: training position {short_repr(e.get('index'))} also drawn on "
                                f"line {pos_seen[key]}")
            else:
                pos_seen[key] = e.get("_line")
    by_content: dict = {}
    for e in ex:
        k = content_key(e)
        if k is not None and e.get("label") in (0, 1):
            by_content.setdefault(k, {}).setdefault(e["label"], []).append(e.get("_line"))
    for k, d in by_content.items():
        if 0 in d and 1 in d:
            problems.append(f"line {d[0][0]}: non-member has the same {k[0]} as member on line {d[1][0]}"
                            + (f" ({len(d[0]) + len(d[1]) - 2} more lines alike)" if len(d[0]) + len(d[1]) > 2 else ""))
    # the same content in two partitions (an attack learning from one would see a scored example)
    by_part: dict = {}
    for e in ex:
        k = content_key(e)
        if k is not None:
            first = by_part.setdefault(k, e)
            if first.get("partition", "eval") != e.get("partition", "eval"):
                problems.append(f"line {e.get('_line')}: same {k[0]} as line {first.get('_line')} but in partition "
                                f"{short_repr(e.get('partition', 'eval'))} vs "
                                f"{short_repr(first.get('partition', 'eval'))}")


def verify_split(path, verify_sources: bool = True, verify_hashes: bool = True,
                 vocab_size: Optional[int] = None) -> SplitCheck:
    """Re-read a split and verify everything it claims (docs/splits.md#what-mia-split-check-verifies).

    * fields: every header and row field a check below reads is first checked for its type and range (one problem
      naming the line and the field; the checks that need a bad field are skipped);
    * rows: unique ids, labels 0/1, partitions known to the header, field types; each row against the
      ``row_sha256`` written with it (id, label, partition, text or tokens: an edit after the draw);
    * header: format, counts and per-partition counts against the rows;
    * content: the same training position twice, the same tokens / text in both classes or in two partitions;
    * sources (``kind`` pythia / testbed / olmo / text): file sizes and hashes; for training orders the header's
      parameters against each other and the data (step ranges, checkpoint, rows, dtype), every row's position,
      label range and tokens re-read from the data, the drawn positions re-drawn from the seed, token ids
      non-negative and (with ``vocab_size`` or the header's) within the vocabulary.

    Never raises on a bad file: an unreadable one is one problem."""
    problems: list = []
    not_verified: list = []
    hash_missing: list = []

    def check_hash(ln, obj, line):
        if obj.get("type") == "header":
            if obj.get(HEADER_HASH) is None:
                not_verified.append(f"header: no {HEADER_HASH} (written before header hashes): fields that follow "
                                    "from no other field (seed, source notes, text-split parameters) are not "
                                    "checked against an edit")
            elif not hash_matches(line, obj, HEADER_HASH):
                problems.append(f"line {ln}: header differs from its {HEADER_HASH} (edited after the split was "
                                "written)")
        elif obj.get(ROW_HASH) is None:
            hash_missing.append(ln)
        elif not hash_matches(line, obj, ROW_HASH):
            problems.append(f"line {ln}: row differs from its {ROW_HASH} (id, label, partition, text or tokens "
                            "edited after the split was written)")

    try:
        split = read_split_raw(path, compact_tokens=True, on_line=check_hash)
    except SplitError as e:
        return SplitCheck([str(e)], [])
    h, ex = split.header, split.examples
    if hash_missing and len(hash_missing) == len(ex):
        not_verified.append(f"rows: no {ROW_HASH} (written before row hashes): edits of ids, labels, partitions and "
                            "texts are not detectable from the file itself")
    else:
        problems.extend(f"line {ln}: no {ROW_HASH} though the other rows have one (a row added by hand?)"
                        for ln in hash_missing)
    _row_problems(ex, h, problems)
    _header_problems(h, ex, problems)
    _content_problems(ex, problems)
    src = h.get("source") if isinstance(h.get("source"), dict) else {}
    kind = src.get("kind")
    known = isinstance(kind, str) and kind in SOURCE_FILES
    recs = source_file_records(kind, src, problems) if known else []
    if not verify_sources:
        not_verified.append("sources: not re-read (verify_sources=False)")
        return SplitCheck(problems, not_verified)
    if recs is None:
        not_verified.append("sources: not re-read (unusable file records in the header)")
        return SplitCheck(problems, not_verified)
    if known:
        if not verify_hashes:
            not_verified.append("sources: file hashes not checked (--no-hash)")
        else:
            for name, r in recs:
                msg = verify_file_record(r)
                if msg:
                    problems.append(f"line 1: header source.{name}: {msg}")
            if kind == "text" and not recs:
                not_verified.append("sources: the header names no source files")
    if kind in ("pythia", "testbed"):  # testbed orders are Pythia-format files
        pythia.verify_examples(h, ex, problems, not_verified, vocab_size)
    elif kind == "olmo":
        olmo_order.verify_examples(h, ex, problems, not_verified, vocab_size)
    elif kind != "text":
        not_verified.append(f"sources: source kind {short_repr(kind)} is not re-readable: rows are checked only "
                            "against the header and their row hashes")
    return SplitCheck(problems, not_verified)


def check_split(path, verify_sources: bool = True, verify_hashes: bool = True,
                vocab_size: Optional[int] = None) -> list:
    """The problems ``verify_split`` finds (empty = nothing wrong found; see ``verify_split`` for what could not
    be verified)."""
    return verify_split(path, verify_sources, verify_hashes, vocab_size).problems
