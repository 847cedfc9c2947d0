"""Which corpus document each row of a testbed's order comes from (the testbed does not record it).

``row_documents(tb)`` re-derives it: the corpus is re-read and re-tokenized, packed as ``mia.testbed.packing`` packs
it, and every row of ``order.bin`` is matched by content to its first occurrence in the packed stream. A row belongs
to the document holding most of its tokens (``majority_documents``), with the share of its tokens that document
holds. ``domain_of`` groups corpus paths by their top-level name (the CAMIA experiment's domains). The mapping is
cached in the testbed's ``cache/``.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..files.atomic import save_npz
from .config import TestbedError


@dataclasses.dataclass(frozen=True)
class RowDocuments:
    """Which corpus document each row of a testbed's order comes from."""

    paths: tuple  # document paths (corpus order)
    doc: np.ndarray  # [n_rows] int: index into ``paths`` of the document holding most of row i's tokens
    share: np.ndarray  # [n_rows] float: the fraction of row i's tokens from that document


def domain_of(path: str) -> str:
    """The top-level name of a corpus path: its package (``asyncio/base_events.py`` -> ``asyncio``) or, for a
    top-level file, its module name (``argparse.py`` -> ``argparse``)."""
    head = path.split("/", 1)[0]
    if "/" not in path:
        head = head.split("#", 1)[0]
        for suffix in (".py", ".txt", ".md"):
            if head.endswith(suffix):
                return head[: -len(suffix)]
    return head


def majority_documents(packed_rows: np.ndarray, doc_lengths: np.ndarray, row_len: int) -> tuple:
    """(doc [R], share [R]) of packed rows: ``packed_rows`` are row numbers in the packed token stream (row p holds
    stream tokens [p*row_len, (p+1)*row_len)); document j holds ``doc_lengths[j]`` stream tokens (its EOD included)."""
    starts = np.concatenate([[0], np.cumsum(np.asarray(doc_lengths, np.int64))])
    lo = np.asarray(packed_rows, np.int64) * row_len
    d0 = np.searchsorted(starts, lo, side="right") - 1
    d1 = np.searchsorted(starts, lo + row_len - 1, side="right") - 1
    doc, share = d0.copy(), np.ones(len(lo))
    for i in np.flatnonzero(d0 != d1):
        js = np.arange(d0[i], d1[i] + 1)
        overlap = np.minimum(starts[js + 1], lo[i] + row_len) - np.maximum(starts[js], lo[i])
        k = int(np.argmax(overlap))
        doc[i], share[i] = js[k], overlap[k] / row_len
    return doc, share


def row_documents(tb, progress: bool = False) -> RowDocuments:
    """The document of every row of testbed ``tb``'s order, re-derived (the testbed does not record it): the corpus
    is re-read and re-tokenized, packed as ``mia.testbed.packing`` packs it, and each row of ``order.bin`` is matched
    by content to its first occurrence in the packed stream (duplicate rows were kept once, first occurrence). A row
    of the order missing from the re-packed stream stops the run. Cached in ``tb.root/cache``."""
    from ..data.corpus import load_corpus  # (datasets, tokenizers: only when a mapping is computed)
    from .packing import pack_rows  # (the same)
    from .tokenizer import encode_documents  # (the same)

    m = tb.manifest
    key = f"{m['data']['bin']['sha256'][:16]}-{m['corpus']['sha256'][:16]}"
    cache = tb.root / "cache" / f"row_documents-{key}.npz"
    if cache.exists():
        z = np.load(cache, allow_pickle=False)
        return RowDocuments(tuple(str(p) for p in z["paths"]), z["doc"], z["share"])
    cfg = tb.config
    corpus = load_corpus(cfg.corpus, cfg.text_column, cfg.max_corpus_bytes)
    if corpus.sha256 != m["corpus"]["sha256"]:
        raise TestbedError(f"{tb.root}: its corpus changed since the testbed was built (sha256 "
                              f"{corpus.sha256[:12]} != {m['corpus']['sha256'][:12]}); cannot map rows to documents")
    if progress:
        from tqdm.auto import tqdm

        tqdm.write(f"mapping the rows of {tb.root} to their corpus documents (re-tokenizing {len(corpus)} documents)")
    docs = encode_documents(tb.tokenizer(), corpus.texts)
    packed = pack_rows(docs, tb.row_len)
    first: dict = {}
    for p in range(len(packed)):
        first.setdefault(packed[p].tobytes(), p)
    order = tb.dataset().get_rows(np.arange(tb.n_rows))
    found = np.array([first.get(np.ascontiguousarray(r, np.uint16).tobytes(), -1) for r in order], np.int64)
    if (found < 0).any():
        i = int(np.flatnonzero(found < 0)[0])
        raise TestbedError(f"{tb.root}: row {i} of data/order.bin is not in the corpus re-packed with its tokenizer "
                              f"({int((found < 0).sum())} such rows); cannot map rows to documents")
    doc, share = majority_documents(found, np.array([len(d) + 1 for d in docs]), tb.row_len)
    out = RowDocuments(tuple(d.path for d in corpus.documents), doc, share)
    cache.parent.mkdir(parents=True, exist_ok=True)
    save_npz(cache, paths=np.array(out.paths), doc=doc.astype(np.int32), share=share.astype(np.float32))
    return out

