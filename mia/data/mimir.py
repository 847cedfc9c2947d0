"""MIMIR's benchmark files (Duan et al. 2024): the directory layout, the (domain, split) pairs it holds, and its
texts as examples for ``mia.score``.

Layout: ``[cache_100_200_1000_512/]{train,test}/<domain>[_<split>].jsonl``, train = members, test = non-members, the
split an ``ngram_<n>_<t>`` suffix ("none" without one). The texts are read by ``mia.data.text.load_mimir``.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .draw import without_label_conflicts
from .text import TextDataError, load_mimir

MIMIR_CACHES = ("cache_100_200_1000_512", "cache_100_200_10000_512")
_MIMIR_NAME = re.compile(r"^(?P<domain>.+?)(?:_(?P<split>ngram_\d+_[0-9.]+))?$")


def mimir_index(root, flag: str = "--mimir") -> dict:
    """{(domain, split): (member file, non-member file)} of MIMIR's cache layout under ``root``:
    ``[cache_100_200_1000_512/]{train,test}/<domain>[_<split>].jsonl`` (train = members, test = non-members; split
    "none" when the name has no ``_ngram_<n>_<t>`` suffix)."""
    root = Path(root)
    if not root.is_dir():
        raise TextDataError(f"{flag} {root}: not a directory")
    bases = [root] if (root / "train").is_dir() else [root / c for c in MIMIR_CACHES if (root / c / "train").is_dir()]
    found = {}
    for base in bases:
        for f in sorted((base / "train").glob("*.json*")):
            other = base / "test" / f.name
            m = _MIMIR_NAME.match(f.name.rsplit(".", 1)[0])
            if m and other.exists():
                found.setdefault((m.group("domain"), m.group("split") or "none"), (f, other))
    if not found:
        raise TextDataError(f"{flag} {root}: no MIMIR files (expected "
                              f"{MIMIR_CACHES[0]}/train/<domain>_<split>.jsonl "
                              "with the same name under test/)")
    return found


def mimir_listing(index: dict) -> str:
    """The domains of ``index`` with their splits, for a message: ``arxiv (ngram_7_0.2, none); ...``."""
    by: dict = {}
    for d, s in sorted(index):
        by.setdefault(d, []).append(s)
    return "; ".join(f"{d} ({', '.join(v)})" for d, v in by.items())


def mimir_pick(index: dict, domains: Optional[Sequence[str]], split: str) -> list:
    """The (domain, split) keys to run: every requested domain must have ``split``; one line lists what is there."""
    have = sorted({d for d, _ in index})
    domains = list(domains) if domains else [d for d in have if (d, split) in index]
    missing = [d for d in domains if (d, split) not in index]
    if missing or not domains:
        what = f"domain(s) {', '.join(missing)}" if missing else "any domain"
        raise TextDataError(f"the MIMIR files have no {what} with split {split!r}; domains there: "
                            f"{mimir_listing(index)}")
    return [(d, split) for d in domains]


def mimir_examples(member_file, nonmember_file, tokenizer, max_per_class: Optional[int], seed: int) -> tuple:
    """(examples with text and token ids, notes): MIMIR texts (``mia.data.text.load_mimir``), at most
    ``max_per_class`` per class (a seeded subsample), tokenized with the model's tokenizer defaults; texts of fewer
    than 2 tokens are left out (noted), and so is a non-member text equal to a member text (the member kept, noted:
    ``mia.score`` refuses one input labelled both, while MIMIR's member and non-member files may share a text)."""
    ex, _ = load_mimir(member=str(member_file), nonmember=str(nonmember_file))
    rng = np.random.default_rng([int(seed), 0x313])
    out, notes = [], []
    for label in (1, 0):
        pool = [e for e in ex if e["label"] == label]
        if max_per_class is not None and len(pool) > max_per_class:
            pool = [pool[i] for i in np.sort(rng.choice(len(pool), max_per_class, replace=False))]
        out += pool
    short = 0
    kept = []
    for e in out:
        e["tokens"] = [int(t) for t in tokenizer(e["text"])["input_ids"]]
        if len(e["tokens"]) < 2:
            short += 1
            continue
        kept.append(e)
    if short:
        notes.append(f"{Path(member_file).name}: {short} text(s) with fewer than 2 tokens left out")
    kept, conflicts = without_label_conflicts(kept)
    if conflicts:
        notes.append(f"{Path(member_file).name}: {conflicts} non-member text(s) with the same text or token ids as a "
                     "member text dropped (the member kept: one input cannot be both)")
    return kept, notes

