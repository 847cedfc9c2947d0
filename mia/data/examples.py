"""Examples to score: checking the input of ``mia score`` (JSONL here; every other form through
``mia.data.sources``) and tokenizing it.

Input line: ``{"id" (optional), "text" | "tokens", "label" (optional, 1 = member), "partition" (optional),
"doc_id" (optional: the document the line belongs to, for ``mia score --documents``)}``; a missing value (absent or
null) is the same as an absent field. Split files (with a header line) are read the same way.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional

import numpy as np

from .. import validate as V


class DataError(ValueError):
    """Malformed input data; the message names the file and line."""


@dataclasses.dataclass
class Example:
    id: str
    tokens: Optional[np.ndarray] = None  # int32 token ids as scored (after truncation)
    text: Optional[str] = None
    label: Optional[int] = None
    partition: str = "eval"
    truncated: bool = False
    invalid: Optional[str] = None  # reason, when --skip-invalid kept an unusable line
    source: str = ""  # "file:line" for error messages
    doc_id: Optional[str] = None  # the document this sequence belongs to (``mia.documents``)

    @property
    def n_tokens(self) -> int:
        return 0 if self.tokens is None else int(len(self.tokens))


# what ``mia score`` reads; docs/score.md#bad-input
SCORE_PARTITIONS = ("eval", "prefix", "member_prefix", "calib", "train")
LEARNED_PARTITIONS = ("prefix", "member_prefix", "calib", "train")  # what attacks learn from; never scored


def example_field(e, name: str):
    """Field ``name`` of an ``Example`` or of an example dict (None when absent)."""
    return e.get(name) if isinstance(e, dict) else getattr(e, name, None)


def disjointness_keys(e) -> list:
    """What makes two examples the same for disjointness: the id, the token ids, the text (those present). The one
    rule of mia: a scored example may share none of them with an example an attack learns from."""
    keys = [("id", str(example_field(e, "id")))]
    tokens = example_field(e, "tokens")
    if tokens is not None:
        keys.append(("tokens", np.asarray(tokens, np.int64).tobytes()))
    text = example_field(e, "text")
    if text is not None:
        keys.append(("text", text))
    return keys


def read_examples(path, partitions: Optional[tuple] = SCORE_PARTITIONS, what: str = "data file", *,
                  column_map: Optional[dict] = None, id_prefix: str = "",
                  require_columns: bool = True) -> tuple[dict, list[Example]]:
    """(header, examples) from a JSONL file; the header is {} for plain example files.

    Every field goes through ``mia.validate`` (one ``DataError`` naming file:line and field): ``id`` a string or
    integer, unique (or absent from every line: ids are then the positions, see ``examples_from_rows``); ``label``
    0 or 1; ``text`` valid Unicode; ``tokens`` ids in [0, 2**31); ``partition`` one of ``partitions`` (None: any
    name), so a misspelt partition is an error, not a line silently left unscored. ``column_map``: field -> the key
    the lines use for it, ``require_columns``: a key no line has is an error (``examples_from_rows``).
    """
    path = V.input_file(path, what, error=DataError)
    header: dict = {}

    def lines():
        nonlocal header
        for lineno, line in V.utf8_lines(path, DataError):
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as e:
                raise DataError(f"{where}: invalid JSON ({getattr(e, 'msg', type(e).__name__)})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            if obj.get("type") == "header":
                header = obj
                continue
            yield where, obj

    examples = examples_from_rows(lines(), str(path), partitions, column_map=column_map, id_prefix=id_prefix,
                                  require_columns=require_columns)
    return header, examples  # (the header is known once the lines are read)


def examples_from_records(records: list, what: str = "data", partitions: Optional[tuple] = None, *,
                          column_map: Optional[dict] = None, id_prefix: str = "",
                          require_columns: bool = True) -> list[Example]:
    """``Example``s (or dicts with the fields of an input line) -> checked ``Example`` copies, each field through the
    same checks as a file's line (errors name ``what[i]``). NumPy scalars and arrays count as the Python values they
    hold (``np.int64(1)`` is 1, ``np.True_`` a boolean, refused as a label); ``column_map`` renames dict keys (not
    the fields of ``Example``s)."""
    def rows():
        for i, r in enumerate(records):
            where = f"{what}[{i}]"
            if isinstance(r, Example):
                yield r.source or where, {"id": r.id, "tokens": r.tokens, "text": r.text, "label": r.label,
                                          "partition": r.partition, "doc_id": r.doc_id, "truncated": r.truncated}
            elif isinstance(r, dict):
                yield where, {k: python_value(v) for k, v in renamed(r, column_map).items()}
            else:
                raise DataError(f"{where}: expected an example (a dict or mia Example), got {type(r).__name__}")

    dicts = [r for r in records if isinstance(r, dict)]
    keys = {k for r in dicts for k in r}
    absent = [(f, c) for f, c in (column_map or {}).items() if c not in keys]
    if absent and dicts and require_columns:
        raise DataError(f"{what}: no example has the field {absent[0][1]!r} (mapped to {absent[0][0]!r})")
    out = examples_from_rows(rows(), what, partitions, id_prefix=id_prefix)
    for e, r in zip(out, records):
        e.truncated = bool(r.truncated if isinstance(r, Example) else r.get("truncated", False))
    return out


FIELDS = ("id", "text", "tokens", "label", "partition", "doc_id")  # an example's fields (docs/formats.md#examples)


def renamed(obj: dict, column_map: Optional[dict]) -> dict:
    """``obj`` with each mapped key under its field name: ``column_map`` is field -> key (``{"text": "body"}``).
    A key that a field is read from is not also read under its own name; a field read from another key that ``obj``
    has ignores the key of its own name."""
    if not column_map:
        return obj
    sources = set(column_map.values())
    out = {k: v for k, v in obj.items() if k not in sources and not (k in column_map and column_map[k] in obj)}
    out.update({f: obj[c] for f, c in column_map.items() if c in obj})
    return out


def python_value(v, nan_is_missing: bool = False):
    """A value read from a table or an in-memory record as the Python value it holds: NumPy scalars as Python
    scalars (``np.int64(3)`` -> 3, ``np.float64(1.0)`` -> 1.0, ``np.True_`` -> True), a 1-D integer array kept
    (token ids), other arrays and lists element by element; pandas' ``NA`` / ``NaT`` -> None, and with
    ``nan_is_missing`` (tables, where NaN marks a missing cell) a float NaN -> None. Nothing is converted to another
    kind of value: a float stays a float (a label 1.0 is accepted, 0.5 refused by the field's check)."""
    if v is None:
        return None
    if isinstance(v, np.ndarray):
        if v.ndim == 1 and v.dtype.kind in "iu":
            return v
        v = v.tolist()
    if isinstance(v, np.generic):
        v = v.item()
    if type(v).__name__ in ("NAType", "NaTType"):
        return None
    if isinstance(v, float) and nan_is_missing and math.isnan(v):
        return None
    if isinstance(v, (list, tuple)):
        return [x.item() if isinstance(x, np.generic) else x for x in v]
    return v


@dataclasses.dataclass
class _Ids:
    """The ids of one source: every example gives one, or none does (then each gets its position, 0-based, after
    ``prefix``); either way unique."""

    prefix: str = ""
    seen: dict = dataclasses.field(default_factory=dict)  # id -> where
    given: Optional[str] = None  # where the first example with an id is
    missing: Optional[str] = None  # where the first example without one is

    def take(self, obj: dict, where: str) -> str:
        if obj.get("id") is None:
            if self.given is not None:
                raise DataError(f"{where}: field 'id' is missing ({self.given} has one: give every example an id, "
                                "or none)")
            self.missing = self.missing or where
            ex_id = f"{self.prefix}{len(self.seen)}"
        else:
            if self.missing is not None:
                raise DataError(f"{where}: field 'id' is given, but {self.missing} has none (give every example an "
                                "id, or none)")
            self.given = self.given or where
            ex_id = _identifier(obj["id"], f"{where}: field 'id'")
        if ex_id in self.seen:
            raise DataError(f"{where}: duplicate id {ex_id[:80]!r} (first at {self.seen[ex_id]})")
        self.seen[ex_id] = where
        return ex_id


def examples_from_rows(rows, source: str, partitions: Optional[tuple] = None, *, column_map: Optional[dict] = None,
                       id_prefix: str = "", require_columns: bool = True) -> list[Example]:
    """Checked ``Example``s from ``rows``, an iterable of (where, dict with an input line's fields): the one place
    every form of data (``mia.data.sources``) goes through. ``where`` names the row in errors (``data.jsonl:7``,
    ``data.csv:row 7``, ``data[6]``); ``source`` names the whole. ``id`` is optional: when no row has one, the ids
    are the rows' positions (0-based, after ``id_prefix``); a source where some rows have one and others not is an
    error. ``column_map`` (field -> key) renames each row's keys first; a key no row has is an error
    (``require_columns``; else that field is missing, as if it were not mapped)."""
    ids = _Ids(id_prefix)
    found: set = set()
    out = []
    for where, obj in rows:
        if column_map:
            found.update(c for c in column_map.values() if c in obj)
            obj = renamed(obj, column_map)
        out.append(_example(obj, where, ids, partitions))
    if not out:
        raise DataError(f"{source}: no examples")
    absent = [(f, c) for f, c in (column_map or {}).items() if c not in found]
    if absent and require_columns:
        raise DataError(f"{source}: no example has the field {absent[0][1]!r} (mapped to {absent[0][0]!r})")
    return out


def _example(obj: dict, where: str, ids: _Ids, partitions: Optional[tuple]) -> Example:
    """One checked example from one JSON object (``ids``: the source's ids so far, updated)."""
    ex_id = ids.take(obj, where)
    label = obj.get("label")
    if label is not None:
        if isinstance(label, bool) or label not in (0, 1):
            raise DataError(f"{where}: field 'label' must be 0 or 1 (1 = member), got {str(label)[:40]!r}")
        label = int(label)
    has_text, has_tokens = obj.get("text") is not None, obj.get("tokens") is not None
    if not has_text and not has_tokens:
        raise DataError(f"{where}: needs a 'text' or a 'tokens' field")
    tokens = V.token_ids(obj["tokens"], f"{where}: field 'tokens'", error=DataError) if has_tokens else None
    text = V.text(obj["text"], f"{where}: field 'text'", error=DataError) if has_text else None
    partition = obj.get("partition")
    partition = V.text("eval" if partition is None else partition, f"{where}: field 'partition'", choices=partitions,
                       error=DataError)
    doc_id = _identifier(obj["doc_id"], f"{where}: field 'doc_id'") if obj.get("doc_id") is not None else None
    return Example(ex_id, tokens, text, label, partition, source=where, doc_id=doc_id)


def _identifier(raw, where: str) -> str:
    """An ``id``/``doc_id`` value: a string or an integer, as a string."""
    if isinstance(raw, bool) or not isinstance(raw, (str, int)):
        raise DataError(f"{where} must be a string or an integer, got {type(raw).__name__}")
    return V.text(str(raw), where, error=DataError)


def out_of_vocab(tokens, vocab_size: int) -> Optional[tuple]:
    """Index (a tuple, one entry per axis of ``tokens``) and value of the first token id outside ``[0, vocab_size)``,
    or None. Ids past the embedding table would be clamped silently by an accelerator gather: a wrong number."""
    arr = np.asarray(tokens)
    if arr.size == 0:
        return None
    bad = (arr < 0) | (arr >= int(vocab_size))
    if not bad.any():
        return None
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    return where, int(arr[where])


CUT_CHARS_PER_TOKEN = 16  # first cut of a long text before tokenizing: max_length * 16 characters
CUT_MARGIN_TOKENS = 64  # a cut is kept when it gives at least max_length + 64 tokens (else it grows 4x)


def bounded_token_ids(tokenizer, text: str, max_length: Optional[int]) -> tuple[np.ndarray, bool]:
    """(token ids of ``text``, whether it was cut before tokenizing). Tokenizing a hostile 30 MB line in full
    would take gigabytes; so a text longer than ``max_length * 16`` characters is cut to that many characters
    first, and the cut grows 4x until it yields at least ``max_length + 64`` tokens or covers the whole text.
    The first ``max_length`` ids then equal those of the whole text: tokenizers split into pre-tokens and merge
    locally, and the cut lies at least 64 tokens past what is kept (the caller truncates to ``max_length``)."""
    encode = lambda s: np.asarray(tokenizer(s)["input_ids"], np.int32)
    if max_length is None:
        return encode(text), False
    n = max_length * CUT_CHARS_PER_TOKEN
    while n < len(text):
        ids = encode(text[:n])
        if len(ids) >= max_length + CUT_MARGIN_TOKENS:
            return ids, True
        n *= 4
    return encode(text), False


def check_label_conflicts(examples: list[Example], notes: Optional[list] = None) -> None:
    """Refuse one input labelled both a member (1) and a non-member (0): two labelled ``examples`` with the same
    text, or the same token ids as given or tokenized (not truncated), and different labels are one ``DataError``
    naming both lines and ids. Two that only become the same when truncated to ``max_length`` are allowed (they get
    equal scores, a tie); ``notes`` receives one line counting them. Examples set aside as invalid are skipped.
    Pieces of two different documents (``doc_id``) are judged as documents (``check_document_conflicts``)."""
    first: dict = {}
    cut_pairs: list = []
    for e in examples:
        if e.label is None or e.invalid is not None:
            continue
        keys = [] if e.text is None else [("text", e.text)]
        if e.tokens is not None:
            keys.append(("truncated tokens" if e.truncated else "tokens", np.asarray(e.tokens, np.int64).tobytes()))
        for key in keys:
            other = first.setdefault(key, e)
            if other.label == e.label:
                continue
            if e.doc_id is not None and other.doc_id is not None and e.doc_id != other.doc_id:
                continue  # pieces of two documents: the input is the document (check_document_conflicts)
            if key[0] == "truncated tokens":
                cut_pairs.append((other, e))
                continue
            what = "text" if key[0] == "text" else "token ids"
            raise DataError(f"{e.source} (id {e.id[:80]!r}, label {e.label}): the same {what} as {other.source} "
                            f"(id {other.id[:80]!r}, label {other.label}): one input cannot be both a member and a "
                            "non-member")
    if cut_pairs and notes is not None:
        a, b = cut_pairs[0]
        notes.append(f"{len(cut_pairs)} evaluated example(s) labelled unlike an earlier one are identical to it once "
                     f"truncated (first: {b.source} and {a.source}); each such pair gets equal scores")


def check_document_conflicts(examples: list[Example]) -> None:
    """Refuse one document labelled both a member and a non-member: two documents (the labelled ``examples`` with a
    ``doc_id``, grouped by it in order) made of the same pieces (texts, or token ids) with different labels are one
    ``DataError`` naming both. A piece shared by a member and a non-member document (a licence header, a common
    line) is allowed: in document-level inference the input is the document, and each document keeps its label."""
    docs: dict = {}
    for e in examples:
        if e.doc_id is not None and e.label is not None and e.invalid is None:
            piece = e.text if e.tokens is None else np.asarray(e.tokens, np.int64).tobytes()
            docs.setdefault(e.doc_id, [e, []])[1].append(piece)
    first: dict = {}
    for doc_id, (e, pieces) in docs.items():
        other = first.setdefault(tuple(pieces), e)
        if other.label != e.label:
            raise DataError(f"{e.source} (document {doc_id[:80]!r}, label {e.label}): the same pieces as document "
                            f"{other.doc_id[:80]!r} ({other.source}, label {other.label}): one document cannot be "
                            "both a member and a non-member")


def tokenize_examples(examples: list[Example], tokenizer, max_length: Optional[int], skip_invalid: bool = False,
                      vocab_size: Optional[int] = None, notes: Optional[list] = None) -> list[Example]:
    """Fill ``tokens`` (tokenizer defaults) and truncate to ``max_length``; validate that each has >= 2 tokens.

    Token ids given in the file are used as they are (never decoded and re-encoded). Long texts are cut before
    tokenizing (``bounded_token_ids``); ``notes`` (a list) receives one line saying how many were.
    """
    n_cut = n_truncated = 0
    for ex in examples:
        if ex.tokens is None:
            if tokenizer is None:
                raise DataError(f"{ex.source}: example has text but the model directory has no tokenizer")
            if ex.text == "":
                ex.tokens = np.zeros(0, np.int32)
            else:
                ex.tokens, cut = bounded_token_ids(tokenizer, ex.text, max_length)
                n_cut += cut
        bad = out_of_vocab(ex.tokens, vocab_size) if vocab_size is not None else None
        if bad is not None:
            raise DataError(f"{ex.source}: token {bad[0][0]} is id {bad[1]}, outside the model vocabulary "
                            f"({vocab_size} ids): the data do not match the model's tokenizer")
        if max_length is not None and len(ex.tokens) > max_length:
            ex.tokens = ex.tokens[:max_length]
            ex.truncated = True
            n_truncated += 1
        if len(ex.tokens) < 2:
            reason = "empty text" if ex.text == "" else f"only {len(ex.tokens)} token(s); at least 2 are needed"
            if not skip_invalid:
                raise DataError(f"{ex.source}: {reason} (use --skip-invalid to record and continue)")
            ex.invalid = reason
    if n_truncated and notes is not None:
        notes.append(f"{n_truncated} example(s) longer than {max_length} tokens were truncated to their first "
                     f"{max_length} tokens")
    if n_cut and notes is not None:
        notes.append(f"{n_cut} text(s) longer than {max_length * CUT_CHARS_PER_TOKEN} characters were cut before "
                     f"tokenizing (at least {max_length + CUT_MARGIN_TOKENS} tokens kept, then truncated to "
                     f"--max-length {max_length}); they are marked truncated")
    return examples
