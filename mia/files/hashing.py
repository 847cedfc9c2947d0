"""SHA-256 of whole files, memoised so that a rerun does not rehash gigabytes of unchanged weights.

``file_sha256(path)`` hashes every byte of the file the first time and records the digest in a small sidecar JSON
under ``<mia cache dir>/file-sha256/`` (``$MIA_CACHE_DIR`` or ``~/.cache/mia``), keyed by the file's absolute path
and checked against its size, mtime_ns, ctime_ns and inode: any write to the file (even one that keeps its size
and resets its mtime: the ctime still moves) makes the memo miss and the file is hashed again.

Racy writes (the same problem git's index has): a file modified within the filesystem's timestamp granularity
after it was hashed could keep all four stat fields. So a memo is only recorded for a file whose mtime and ctime are
at least ``SETTLE_NS`` in the past when hashing starts and whose stat did not change while it was read; fresher
files are simply hashed on every call. An unwritable or damaged memo directory only costs the rehash.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Optional

from .. import validate
from . import cache_limit
from .atomic import write_json

SETTLE_NS = 2_000_000_000  # a file must be this old (mtime and ctime) before its digest is memoised
_CHUNK = 1 << 22


def default_cache_dir() -> str:
    """``$MIA_CACHE_DIR`` or ``~/.cache/mia``: the root of every mia cache (scores, compiled programs, hashes).
    An empty ``MIA_CACHE_DIR`` counts as unset (it would otherwise put the caches in the working directory)."""
    return os.environ.get("MIA_CACHE_DIR", "").strip() or str(Path.home() / ".cache" / "mia")


def cache_dir_origin() -> str:
    """Where ``default_cache_dir`` came from, for messages: "MIA_CACHE_DIR" or the default's description."""
    if os.environ.get("MIA_CACHE_DIR", "").strip():
        return "the cache directory from MIA_CACHE_DIR"
    return "the default cache directory ~/.cache/mia (set MIA_CACHE_DIR to move it)"


def check_cache_dir(path=None, what: Optional[str] = None, *, error=ValueError) -> Path:
    """The cache directory ``path`` (default ``default_cache_dir()``) made and proved writable: created if missing
    and a probe file written and removed in it. Permission bits alone are not enough: root may "write" to any
    directory, yet /proc refuses every new entry. Raises ``error`` with one line naming ``what`` (default: where
    the directory came from, e.g. MIA_CACHE_DIR) and the reason."""
    p = Path(default_cache_dir() if path is None else path)
    what = what or (cache_dir_origin() if path is None else "the cache directory")
    validate.output_dir(p, what, error=error)  # a file in the way, an unwritable directory: said as such
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        where = f" at {e.filename}" if e.filename and Path(e.filename) != p else ""
        raise error(f"{what} {p}: cannot be used ({reason}{where})") from None
    return p


def _stat_key(st: os.stat_result) -> list:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def sha256_of_file(path) -> str:
    """Hex SHA-256 of every byte of the file at ``path`` (no memo: for files written by this run)."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def file_sha256(path, memo_dir: Optional[str] = None) -> str:
    """Hex SHA-256 of the whole file at ``path``; memoised (see the module docstring). ``memo_dir`` defaults to
    ``<mia cache dir>/file-sha256``."""
    path = Path(path).resolve()
    memo = Path(memo_dir or Path(default_cache_dir()) / "file-sha256") / (
        hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")
    before = os.stat(path)
    try:
        rec = json.loads(memo.read_text())
        if rec.get("path") == str(path) and rec.get("stat") == _stat_key(before) and len(rec.get("sha256", "")) == 64:
            cache_limit.touch(memo)  # recency for LRU eviction
            return rec["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    settled = time.time_ns() - max(before.st_mtime_ns, before.st_ctime_ns) >= SETTLE_NS
    digest = sha256_of_file(path)
    if settled and _stat_key(os.stat(path)) == _stat_key(before):
        try:
            cache_limit.write_in(memo.parent, lambda: write_json(memo, {"path": str(path), "stat": _stat_key(before),
                                                                        "sha256": digest}))
            if memo_dir is None:  # in the mia cache dir: counts towards its size limit
                cache_limit.note_write(memo.parent.parent, cache_limit.file_size(memo))
        except OSError:
            pass
    return digest


def path_sha256(path, memo_dir: Optional[str] = None) -> str:
    """``file_sha256`` of a file; of a directory (a saved dataset), the SHA-256 of the sorted list of (path relative
    to it, ``file_sha256``) of every file under it."""
    path = Path(path)
    if not path.is_dir():
        return file_sha256(path, memo_dir)
    files = sorted(p for p in path.rglob("*") if p.is_file())
    listing = [[p.relative_to(path).as_posix(), file_sha256(p, memo_dir)] for p in files]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()
