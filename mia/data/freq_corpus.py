"""A plain local frequency corpus (for reference token frequencies, ``mia score --freq-corpus FILE``), read into token
ids.

Two layouts: ``.jsonl`` (one JSON object per line with a ``text`` or a ``tokens`` field; ``id`` optional) or any other
file as UTF-8 plain text, one document per non-empty line. Texts are tokenized with the target tokenizer; given
token ids are kept as they are and checked against the vocabulary. A line that is not UTF-8, not valid, or out of
the vocabulary is one error line naming file:line.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from ..validate import INT32_MAX, utf8_lines
from .examples import DataError, out_of_vocab


def read_corpus(path, tokenizer, vocab_size: Optional[int] = None) -> list:
    """[D] int32 token-id arrays, one per document of ``path`` (empty documents are dropped)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"corpus file not found: {path}")
    jsonl = path.suffix == ".jsonl"
    docs = []
    for lineno, line in utf8_lines(path, DataError):
        where = f"{path}:{lineno}"
        tokens, text = None, line.rstrip("\n")
        if jsonl:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or (obj.get("text") is None and obj.get("tokens") is None):
                raise DataError(f"{where}: expected an object with a 'text' or a 'tokens' field")
            text, tokens = obj.get("text"), obj.get("tokens")
            if tokens is not None and not (isinstance(tokens, list) and all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in tokens)):
                raise DataError(f"{where}: field 'tokens' must be a list of integers in [0, {INT32_MAX}]")
            if tokens is None and not isinstance(text, str):
                raise DataError(f"{where}: field 'text' must be a string")
        if tokens is None:
            if tokenizer is None:
                raise DataError(f"{where}: a text corpus needs the model's tokenizer, and the model has none")
            tokens = tokenizer(text)["input_ids"]
        ids = np.asarray(tokens, np.int32)
        bad = out_of_vocab(ids, vocab_size) if vocab_size is not None else None
        if bad is not None:
            raise DataError(f"{where}: token {bad[0][0]} is id {bad[1]}, outside the model vocabulary "
                            f"({vocab_size} ids): the corpus does not match the model's tokenizer")
        if ids.size:
            docs.append(ids)
    if not docs:
        raise DataError(f"{path}: the corpus holds no token")
    return docs
