"""Text corpora for the testbed: the running Python's standard library by default, or local files.

A :class:`Corpus` is an ordered list of :class:`Document` (``path``, ``sha256``, ``text``), sorted by path so that the
same files always give the same corpus; exact duplicate documents (same sha256) are kept once (first path).
Its ``sha256`` hashes every (path, document hash) pair; ``manifest()`` is the JSON record written next to
anything built from it.

Sources (``load_corpus(source)``):
  None / "stdlib"          the standard library ``.py`` sources of this interpreter (``sysconfig`` "stdlib" path),
                           without tests, idlelib, lib2to3, turtledemo, site-packages and other non-library code
  a directory              every ``.txt``, ``.md`` and ``.py`` file under it (recursive, UTF-8)
  a .jsonl/.json/.parquet  one document per record, read with ``datasets``; ``text_column`` names the field
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Optional

from ..files.atomic import write_text
from ..offline import force_offline
from ..validate import check_json_file

DIR_SUFFIXES = (".txt", ".md", ".py")
TABLE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Path components that are never library source (tests, IDE, bundled third-party packages, caches, demo scripts).
STDLIB_EXCLUDE = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__",
                            "turtledemo", "lib-dynload", "ensurepip", "venv"})


class CorpusError(ValueError):
    """A corpus that cannot be built (empty, unreadable); the message is one line naming the path."""


@dataclasses.dataclass(frozen=True)
class Document:
    path: str  # relative to the corpus root ("file.jsonl#12" for records of a table)
    sha256: str
    text: str

    @property
    def n_bytes(self) -> int:
        return len(self.text.encode("utf-8"))


@dataclasses.dataclass(frozen=True)
class Corpus:
    kind: str  # "stdlib" | "directory" | "table"
    root: str
    documents: tuple
    options: dict = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.documents)

    @property
    def texts(self) -> list:
        return [d.text for d in self.documents]

    @property
    def n_bytes(self) -> int:
        return sum(d.n_bytes for d in self.documents)

    @property
    def sha256(self) -> str:
        h = hashlib.sha256()
        for d in self.documents:
            h.update(f"{d.path}\0{d.sha256}\n".encode())
        return h.hexdigest()

    def manifest(self, with_documents: bool = True) -> dict:
        out = {"kind": self.kind, "root": self.root, "options": dict(self.options), "n_documents": len(self),
               "n_bytes": self.n_bytes, "sha256": self.sha256}
        if self.kind == "stdlib":
            out["python"] = sys.version.split()[0]
        if with_documents:
            out["documents"] = [{"path": d.path, "sha256": d.sha256, "bytes": d.n_bytes} for d in self.documents]
        return out

    def write_manifest(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(self.manifest(), indent=1))
        return path


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CorpusError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: not UTF-8 text (byte {e.start})") from None


def _dedup(docs: list) -> tuple:
    """Documents with distinct content (the first path of each sha256 is kept) and how many were dropped."""
    seen, out = set(), []
    for d in docs:
        if d.sha256 not in seen:
            seen.add(d.sha256)
            out.append(d)
    return out, len(docs) - len(out)


def _limit(docs: list, max_bytes: Optional[int], max_docs: Optional[int]) -> list:
    """The first documents (in path order) up to ``max_docs`` and ``max_bytes`` (always at least one)."""
    out, total = [], 0
    for d in docs:
        if max_docs is not None and len(out) >= max_docs:
            break
        if max_bytes is not None and out and total + d.n_bytes > max_bytes:
            break
        out.append(d)
        total += d.n_bytes
    return out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Optional[Path] = None) -> list:
    """Relative paths (posix, sorted) of the standard library's own ``.py`` sources."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        # prune excluded directories in place (os.walk honours it) and any test-suite package
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_EXCLUDE and not d.startswith(("test_", "config-")))
        for f in filenames:
            if f.endswith(".py") and not f.startswith("test_"):
                out.append((rel_dir / f).as_posix())
    return sorted(out)


def stdlib_corpus(max_bytes: Optional[int] = None, max_docs: Optional[int] = None) -> Corpus:
    root = stdlib_root()
    if not root.is_dir():
        raise CorpusError(f"{root}: standard library directory not found; give a corpus directory or file")
    docs = []
    for rel in stdlib_files(root):
        text = _read_text(root / rel)
        if text.strip():
            docs.append(Document(rel, _sha(text), text))
    if not docs:
        raise CorpusError(f"{root}: no standard library sources found")
    docs, dropped = _dedup(docs)
    return Corpus("stdlib", str(root), tuple(_limit(docs, max_bytes, max_docs)),
                  {"max_bytes": max_bytes, "max_docs": max_docs, "exclude": sorted(STDLIB_EXCLUDE),
                   "duplicates_dropped": dropped})


def directory_corpus(root, suffixes=DIR_SUFFIXES, max_bytes: Optional[int] = None,
                     max_docs: Optional[int] = None) -> Corpus:
    root = Path(root)
    if not root.is_dir():
        raise CorpusError(f"corpus directory not found: {root}")
    paths = sorted((p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in suffixes and
                    not any(part.startswith(".") for part in p.relative_to(root).parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    if not paths:
        raise CorpusError(f"corpus directory {root} is empty: no {'/'.join(suffixes)} files found")
    docs = []
    for p in paths:
        text = _read_text(p)
        if text.strip():
            docs.append(Document(p.relative_to(root).as_posix(), _sha(text), text))
    if not docs:
        raise CorpusError(f"corpus directory {root} is empty: all {len(paths)} file(s) hold only whitespace")
    docs, dropped = _dedup(docs)
    return Corpus("directory", str(root.resolve()), tuple(_limit(docs, max_bytes, max_docs)),
                  {"suffixes": list(suffixes), "max_bytes": max_bytes, "max_docs": max_docs,
                   "duplicates_dropped": dropped})


def table_corpus(path, text_column: str = "text", max_bytes: Optional[int] = None,
                 max_docs: Optional[int] = None) -> Corpus:
    """One document per record of a local jsonl/json/parquet file (read with ``datasets``; no network)."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"corpus file not found: {path}")
    builder = TABLE_SUFFIXES.get(path.suffix.lower())
    if builder is None:
        raise CorpusError(f"{path}: unsupported corpus file type {path.suffix!r} (use .jsonl, .json or .parquet)")
    if not os.access(path, os.R_OK):
        raise CorpusError(f"{path}: cannot read (permission denied)")
    if builder == "json":
        check_json_file(path, CorpusError)  # a bad line named (file:LINE), not in datasets' words
    force_offline()
    import datasets

    # datasets' Arrow copy of the file goes to a temporary directory, removed once the texts are read, not to the
    # user's ~/.cache/huggingface/datasets (a second copy of every corpus ever read)
    with tempfile.TemporaryDirectory(prefix="mia-corpus-") as cache:
        try:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache)
        except Exception as e:  # datasets raises many types; keep the first line
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CorpusError(f"{path}: cannot read as {builder} ({msg})") from None
        if text_column not in ds.column_names:
            raise CorpusError(f"{path}: no column {text_column!r}; columns: {', '.join(ds.column_names)} "
                              f"(choose one with --text-column)")
        texts = ds[text_column]
        del ds
    docs = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise CorpusError(f"{path}: record {i}: column {text_column!r} is {type(text).__name__}, not text")
        if text.strip():
            docs.append(Document(f"{path.name}#{i}", _sha(text), text))
    if not docs:
        raise CorpusError(f"corpus file {path} is empty: no non-blank {text_column!r} values")
    docs, dropped = _dedup(docs)
    return Corpus("table", str(path.resolve()), tuple(_limit(docs, max_bytes, max_docs)),
                  {"text_column": text_column, "max_bytes": max_bytes, "max_docs": max_docs,
                   "duplicates_dropped": dropped})


def load_corpus(source=None, text_column: str = "text", max_bytes: Optional[int] = None,
                max_docs: Optional[int] = None) -> Corpus:
    """``None``/"stdlib": the standard library; a directory; or a .jsonl/.json/.parquet file."""
    if source is None or str(source) == "stdlib":
        return stdlib_corpus(max_bytes, max_docs)
    p = Path(source)
    if p.is_dir():
        return directory_corpus(p, max_bytes=max_bytes, max_docs=max_docs)
    if p.is_file():
        return table_corpus(p, text_column, max_bytes, max_docs)
    raise CorpusError(f"corpus not found: {source} (give a directory, a .jsonl/.parquet file or 'stdlib')")
