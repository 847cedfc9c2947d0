"""Examples to score: reading the JSONL input of ``mia score`` and tokenizing it.

Input line: ``{"id", "text" | "tokens", "label" (optional, 1 = member), "partition" (optional), "doc_id" (optional:
the document the line belongs to, for ``mia score --documents``)}``.
Split files (with a header line) are read the same way.
"""
from __future__ import annotations

import dataclasses
import json
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


def read_examples(path, partitions: Optional[tuple] = SCORE_PARTITIONS,
                  what: str = "data file") -> tuple[dict, list[Example]]:
    """(header, examples) from a JSONL file; the header is {} for plain example files.

    Every field goes through ``mia.validate`` (one ``DataError`` naming file:line and field): ``id`` a string or
    integer, unique; ``label`` 0 or 1; ``text`` valid Unicode; ``tokens`` ids in [0, 2**31); ``partition`` one of
    ``partitions`` (None: any name), so a misspelt partition is an error, not a line silently left unscored.
    """
    path = V.input_file(path, what, error=DataError)
    header: dict = {}
    out: list[Example] = []
    seen: dict[str, str] = {}
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
        out.append(_example(obj, where, seen, partitions))
    if not out:
        raise DataError(f"{path}: no examples")
    return header, out


def examples_from_records(records: list, what: str = "data", partitions: Optional[tuple] = None) -> list[Example]:
    """``Example``s (or dicts with the fields of an input line) -> checked ``Example`` copies, each field through the
    same checks as a file's line (errors name ``what[i]``)."""
    if not records:
        raise DataError(f"{what}: no examples")
    seen: dict = {}
    out = []
    for i, r in enumerate(records):
        where = f"{what}[{i}]"
        if isinstance(r, Example):
            where = r.source or where
            r = {"id": r.id, "tokens": r.tokens, "text": r.text, "label": r.label, "partition": r.partition,
                 "doc_id": r.doc_id, "truncated": r.truncated}
        if not isinstance(r, dict):
            raise DataError(f"{where}: expected an example (a dict or mia Example), got {type(r).__name__}")
        e = _example(r, where, seen, partitions)
        e.truncated = bool(r.get("truncated", False))
        out.append(e)
    return out


def _example(obj: dict, where: str, seen: dict, partitions: Optional[tuple]) -> Example:
    """One checked example from one JSON object (``seen``: id -> where, updated)."""
    if "id" not in obj:
        raise DataError(f"{where}: field 'id' is missing")
    ex_id = _identifier(obj["id"], f"{where}: field 'id'")
    if ex_id in seen:
        raise DataError(f"{where}: duplicate id {ex_id[:80]!r} (first at {seen[ex_id]})")
    seen[ex_id] = where
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
    partition = V.text(obj.get("partition", "eval"), f"{where}: field 'partition'", choices=partitions,
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
    equal scores, a tie); ``notes`` receives one line counting them. Examples set aside as invalid are skipped."""
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
