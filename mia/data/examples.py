"""Examples to score: reading the JSONL input of ``mia score`` and tokenizing it.

Input line: ``{"id", "text" | "tokens", "label" (optional, 1 = member), "partition" (optional)}``.
Split files (with a header line) are read the same way.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import numpy as np


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

    @property
    def n_tokens(self) -> int:
        return 0 if self.tokens is None else int(len(self.tokens))


def read_examples(path) -> tuple[dict, list[Example]]:
    """(header, examples) from a JSONL file; the header is {} for plain example files."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file not found: {path}")
    header: dict = {}
    out: list[Example] = []
    seen: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            if obj.get("type") == "header":
                header = obj
                continue
            if "id" not in obj:
                raise DataError(f"{where}: field 'id' is missing")
            ex_id = str(obj["id"])
            if ex_id in seen:
                raise DataError(f"{where}: duplicate id {ex_id!r} (first at {seen[ex_id]})")
            seen[ex_id] = where
            label = obj.get("label")
            if label is not None:
                if isinstance(label, bool) or label not in (0, 1):
                    raise DataError(f"{where}: field 'label' must be 0 or 1 (1 = member), got {label!r}")
                label = int(label)
            has_text, has_tokens = obj.get("text") is not None, obj.get("tokens") is not None
            if not has_text and not has_tokens:
                raise DataError(f"{where}: needs a 'text' or a 'tokens' field")
            tokens = None
            if has_tokens:
                toks = obj["tokens"]
                if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in toks):
                    raise DataError(f"{where}: field 'tokens' must be a list of non-negative integers")
                tokens = np.asarray(toks, np.int32)
            text = obj.get("text")
            if has_text and not isinstance(text, str):
                raise DataError(f"{where}: field 'text' must be a string")
            out.append(Example(ex_id, tokens, text, label, str(obj.get("partition", "eval")), source=where))
    if not out:
        raise DataError(f"{path}: no examples")
    return header, out


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


def tokenize_examples(examples: list[Example], tokenizer, max_length: Optional[int], skip_invalid: bool = False,
                      vocab_size: Optional[int] = None) -> list[Example]:
    """Fill ``tokens`` (tokenizer defaults) and truncate to ``max_length``; validate that each has >= 2 tokens.

    Token ids given in the file are used as they are (never decoded and re-encoded).
    """
    for ex in examples:
        if ex.tokens is None:
            if tokenizer is None:
                raise DataError(f"{ex.source}: example has text but the model directory has no tokenizer")
            if ex.text == "":
                ex.tokens = np.zeros(0, np.int32)
            else:
                ex.tokens = np.asarray(tokenizer(ex.text)["input_ids"], np.int32)
        bad = out_of_vocab(ex.tokens, vocab_size) if vocab_size is not None else None
        if bad is not None:
            raise DataError(f"{ex.source}: token {bad[0][0]} is id {bad[1]}, outside the model vocabulary "
                            f"({vocab_size} ids): the data do not match the model's tokenizer")
        if max_length is not None and len(ex.tokens) > max_length:
            ex.tokens = ex.tokens[:max_length]
            ex.truncated = True
        if len(ex.tokens) < 2:
            reason = "empty text" if ex.text == "" else f"only {len(ex.tokens)} token(s); at least 2 are needed"
            if not skip_invalid:
                raise DataError(f"{ex.source}: {reason} (use --skip-invalid to record and continue)")
            ex.invalid = reason
    return examples
