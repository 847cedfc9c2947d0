"""A size limit on the mia cache directory, with least-recently-used eviction of whole entries.

The cache root (``$MIA_CACHE_DIR`` or ``~/.cache/mia``; ``mia.files.hashing.default_cache_dir``) holds, one level down:

  ``<namespace>/part-<name>.{f32,json}``   score parts (``mia.engine.cache.StatsCache``; the pair is one entry)
  ``condll-<namespace>/part-<name>.npz``   conditional log-likelihood parts (``mia.engine.conditional.PairCache``)
  ``neighbors-<tag>/<hash>.json``          neighbour texts (the ``neighbor`` attack)
  ``file-sha256/<hash>.json``              file-hash memos (``mia.files.hashing``)
  ``xla/<key>-cache`` (+ ``-atime``)       compiled programs (JAX's persistent compilation cache)

An entry's recency is the newest mtime of its files: writers create them, readers touch them (``touch``) when an
entry is served, and JAX records its own reads in ``-atime`` files. The limit (``max_bytes``: ``set_max_gb``, else
``$MIA_CACHE_MAX_GB``, else ``DEFAULT_MAX_GB``; GB = 10^9 bytes) is kept by ``enforce``: above it, whole entries
are deleted oldest first until the total is at most ``LOW_WATER`` of it, then namespace directories left empty
are removed.

Safety with several processes: eviction holds an exclusive ``fcntl.flock`` on ``<root>/.evict.lock`` (two evictors
do not fight); temporary files of ``mia.files.atomic`` (``.<name>.*.tmp``) are never counted or deleted; a score part
whose index is not written yet is left alone for ``INCOMPLETE_GRACE_S``; files vanishing during a scan are skipped;
a writer re-creates a namespace directory removed under it (``write_in``).
A reader that finds its entry gone recomputes it (the score cache checks every block's CRC, so nothing partial is
served). Writers call ``note_write`` after each write: it runs ``evict`` when this process's estimate of the total
passes the limit, and once more when the writer closes (``flush``) or the process exits, so a run ends under it.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from .atomic import is_temporary, write_json
from ..validate import InputError

ENV_MAX_GB = "MIA_CACHE_MAX_GB"
DEFAULT_MAX_GB = 5.0
GB = 10 ** 9
LOCK_NAME = ".evict.lock"
LABEL_NAME = "namespace.json"  # what a namespace holds (the model, dtype, ...), for ``mia cache info`` / ``prune``
INCOMPLETE_GRACE_S = 600.0  # a score part's data file without its index is being written unless older than this
STALE_TEMP_S = 86400.0  # a temporary file older than this is left over from a killed writer
LOW_WATER = 0.9  # eviction goes down to this fraction of the limit
_XLA_SUFFIXES = ("-cache", "-atime")


# ------------------------------------------------------------------------------------------------ the limit
_override_gb: Optional[float] = None
_warned_env = False


def parse_max_gb(text, where: str) -> float:
    """``text`` as a positive, finite number of GB, or ``InputError`` naming ``where`` (the flag or variable)."""
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise InputError(f"{where}: expected a number of GB, got {text!r}") from None
    if not (v > 0 and v != float("inf")):
        raise InputError(f"{where}: must be a positive finite number of GB, got {text!r}")
    return v


def set_max_gb(gb: Optional[float]) -> None:
    """The limit for this process (``--cache-max-gb``); None goes back to ``$MIA_CACHE_MAX_GB`` or the default."""
    global _override_gb
    _override_gb = None if gb is None else parse_max_gb(gb, "--cache-max-gb")


def check_env() -> None:
    """``InputError`` naming ``MIA_CACHE_MAX_GB`` when it is set to something that is not a positive number."""
    raw = os.environ.get(ENV_MAX_GB, "").strip()
    if raw:
        parse_max_gb(raw, ENV_MAX_GB)


def max_bytes() -> int:
    """The limit in bytes (see the module docstring). A bad ``$MIA_CACHE_MAX_GB`` outside the CLI (which refuses it
    up front) gives one ``warning:`` line and the default."""
    global _warned_env
    if _override_gb is not None:
        return int(_override_gb * GB)
    try:
        check_env()
        raw = os.environ.get(ENV_MAX_GB, "").strip()
        return int((parse_max_gb(raw, ENV_MAX_GB) if raw else DEFAULT_MAX_GB) * GB)
    except InputError as e:
        if not _warned_env:
            _warned_env = True
            print(f"warning: {e}; using {DEFAULT_MAX_GB} GB", file=sys.stderr)
        return int(DEFAULT_MAX_GB * GB)


# ------------------------------------------------------------------------------------------------ entries
@dataclasses.dataclass
class Entry:
    """One evictable unit: its files (deleted in this order), total bytes, newest mtime (s), kind and namespace."""
    kind: str  # "scores", "condll", "neighbors", "hashes", "xla"
    namespace: str  # the directory under the root
    files: list
    size: int
    mtime: float


def _hex(text: str, n: int) -> bool:
    return len(text) == n and all(c in "0123456789abcdef" for c in text)


def kind_of(dirname: str) -> Optional[str]:
    """The kind of a directory under the cache root, or None for one mia did not make (never counted or touched:
    a ``--cache-dir`` that holds other files loses none of them)."""
    if dirname in ("xla", "file-sha256"):
        return {"xla": "xla", "file-sha256": "hashes"}[dirname]
    if dirname.startswith("condll-") and _hex(dirname[7:], 32):
        return "condll"
    if dirname.startswith("neighbors-") and _hex(dirname[10:], 20):
        return "neighbors"
    return "scores" if _hex(dirname, 32) else None


def _entry_key(kind: str, name: str) -> str:
    """Files with the same key form one entry: a score part's .f32 and .json, a compiled program and its atime."""
    if kind == "xla":
        for s in _XLA_SUFFIXES:
            if name.endswith(s):
                return name[: -len(s)]
        return name
    if kind == "scores" and name.startswith("part-"):
        return name.rsplit(".", 1)[0]
    return name


def scan(root) -> Iterator[Entry]:
    """Every entry under ``root`` (temporary files, the lock and namespace labels are not entries); a file that
    vanishes while it is looked at is skipped."""
    root = Path(root)
    try:
        dirs = sorted((d for d in os.scandir(root) if d.is_dir(follow_symlinks=False)), key=lambda d: d.name)
    except (FileNotFoundError, NotADirectoryError):
        return
    now = time.time()
    for d in dirs:
        kind = kind_of(d.name)
        if kind is None:
            continue
        groups: dict[str, Entry] = {}
        try:
            files = list(os.scandir(d.path))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for f in files:
            if f.name in (LABEL_NAME, ".lockfile"):
                continue
            try:
                st = f.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if is_temporary(f.name) and now - st.st_mtime < STALE_TEMP_S:
                continue  # a write in progress; an older one was left by a killed writer and is evicted
            e = groups.setdefault(_entry_key(kind, f.name), Entry(kind, d.name, [], 0, 0.0))
            e.files.append(Path(f.path))
            e.size += st.st_size
            e.mtime = max(e.mtime, st.st_mtime)
        for e in groups.values():
            if kind == "scores":
                if not any(p.suffix == ".json" for p in e.files) and now - e.mtime < INCOMPLETE_GRACE_S:
                    continue  # its index is still to be written by another process
                e.files.sort(key=lambda p: p.suffix != ".json")  # the index first: readers then skip the part
            yield e


def total_size(root) -> int:
    return sum(e.size for e in scan(root))


@contextlib.contextmanager
def _locked(lock_file: Path):
    """An exclusive ``fcntl.flock`` on ``lock_file`` for the block (waits for its holder)."""
    import fcntl  # here: POSIX only, and only an evicting process needs it

    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def delete_entry(e: Entry) -> int:
    """Remove ``e``'s files (already gone: fine); the bytes freed."""
    freed = 0
    for p in e.files:
        try:
            size = p.stat().st_size
            p.unlink()
            freed += size
        except FileNotFoundError:
            pass
    return freed


def remove_empty_namespaces(root: Path) -> None:
    """Remove namespace directories that hold nothing but their label (a writer's temp file keeps one)."""
    for d in list(root.iterdir()) if root.is_dir() else ():
        if not d.is_dir() or d.name == "xla" or kind_of(d.name) is None:
            continue
        try:
            names = os.listdir(d)
            if set(names) <= {LABEL_NAME}:
                for n in names:
                    (d / n).unlink()
                d.rmdir()
        except OSError:  # refilled or removed meanwhile
            pass


def evict(root, limit: Optional[int] = None, select: Optional[Callable[[Entry], bool]] = None,
          target: Optional[int] = None) -> list[Entry]:
    """Under the lock: when the total is above ``limit`` bytes (None: always), delete the entries ``select`` picks
    (all when None), oldest first, until the total is at most ``target`` (default ``limit``; None: every picked
    entry). Returns the deleted entries."""
    root = Path(root)
    if not root.is_dir():
        return []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_locked(root / LOCK_NAME))  # one evictor at a time
        if (root / "xla").is_dir():  # JAX's own lock (filelock's flock): no program vanishes while JAX reads it
            stack.enter_context(_locked(root / "xla" / ".lockfile"))
        entries = sorted(scan(root), key=lambda e: e.mtime)
        total = sum(e.size for e in entries)
        gone = []
        if limit is not None and total <= limit:
            entries = []
        target = limit if target is None else target
        for e in entries:
            if target is not None and total <= target:
                break
            if select is not None and not select(e):
                continue
            delete_entry(e)
            total -= e.size
            gone.append(e)
        if gone:
            remove_empty_namespaces(root)
    _estimates[str(root)] = total
    return gone


def enforce(root) -> list[Entry]:
    """When the cache is above the limit, evict down to ``LOW_WATER`` of it (so that the next scan is due only after
    that much more was written). An OSError (unwritable root) is ignored: the cache is optional."""
    try:
        limit = max_bytes()
        return evict(root, limit, target=int(LOW_WATER * limit))
    except OSError:
        return []


# ------------------------------------------------------------------------------------------------ writers' hooks
_estimates: dict[str, int] = {}  # root -> this process's estimate of its total size
_unflushed: set = set()
_lock = threading.Lock()


def note_write(root, nbytes: int) -> None:
    """Record ``nbytes`` written under ``root`` by this process; evict when the estimate passes the limit."""
    key = str(root)
    with _lock:
        _unflushed.add(key)
        est = _estimates.get(key)
        _estimates[key] = (est or 0) + nbytes
        due = est is None or _estimates[key] > max_bytes()
    if due:
        enforce(key)


def flush() -> None:
    """Evict once under every root this process wrote to since the last flush (the end of a run)."""
    with _lock:
        roots = sorted(_unflushed)
        _unflushed.clear()
    for root in roots:
        enforce(root)


atexit.register(flush)


def touch(*paths) -> None:
    """Mark files as just used (their mtime set to now); a file gone meanwhile is fine."""
    for p in paths:
        with contextlib.suppress(OSError):
            os.utime(p)


def write_in(directory: Path, write: Callable[[], None], attempts: int = 3) -> None:
    """``directory.mkdir`` then ``write()``; again when an evictor removed the emptied directory in between."""
    for i in range(attempts):
        directory.mkdir(parents=True, exist_ok=True)
        try:
            return write()
        except FileNotFoundError:
            if i == attempts - 1 or directory.is_dir():
                raise


def file_size(path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def write_label(directory: Path, label: dict) -> None:
    """Write ``<directory>/namespace.json`` (what the namespace holds: model, dtype, ...) when it is missing."""
    if directory is None or (directory / LABEL_NAME).exists():
        return
    with contextlib.suppress(OSError):
        write_in(directory, lambda: write_json(directory / LABEL_NAME, label, sort_keys=True))


def read_label(directory: Path) -> dict:
    try:
        out = json.loads((Path(directory) / LABEL_NAME).read_text())
        return out if isinstance(out, dict) else {}
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------------------------------------ mia cache
def fmt_bytes(n: int) -> str:
    for unit, scale in (("GB", GB), ("MB", 10 ** 6), ("kB", 10 ** 3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def describe_namespace(root: Path, namespace: str) -> str:
    """A namespace's label in a few words: the model's path, dtype and attention kernel ('' when unlabelled)."""
    lab = read_label(root / namespace)
    return " ".join(str(lab[k]) for k in ("path", "dtype", "attention") if lab.get(k)) if lab else ""


def info_table(root) -> str:
    """``mia cache info``: the total, then size by kind, then by namespace (newest use first), as text tables."""
    root = Path(root)
    entries = list(scan(root))
    total = sum(e.size for e in entries)
    lines = [f"cache {root}: {fmt_bytes(total)} in {len(entries)} entries (limit {fmt_bytes(max_bytes())})"]
    by_kind: dict[str, list] = {}
    by_ns: dict[str, list] = {}
    for e in entries:
        by_kind.setdefault(e.kind, []).append(e)
        by_ns.setdefault(e.namespace, []).append(e)
    lines += ["", f"{'kind':<10} {'entries':>8} {'size':>10}"]
    for kind in ("scores", "condll", "neighbors", "hashes", "xla"):
        es = by_kind.get(kind, [])
        lines.append(f"{kind:<10} {len(es):>8} {fmt_bytes(sum(e.size for e in es)):>10}")
    lines += ["", f"{'namespace':<42} {'kind':<10} {'entries':>8} {'size':>10}  {'last used':<16}  model"]
    for ns, es in sorted(by_ns.items(), key=lambda kv: -max(e.mtime for e in kv[1])):
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(max(e.mtime for e in es)))
        lines.append(f"{ns:<42} {es[0].kind:<10} {len(es):>8} {fmt_bytes(sum(e.size for e in es)):>10}  {used:<16}  "
                     f"{describe_namespace(root, ns)}".rstrip())
    return "\n".join(lines)


def prune(root, *, older_than_days: Optional[float] = None, model: Optional[str] = None,
          max_gb: Optional[float] = None) -> list[Entry]:
    """``mia cache prune``: delete the entries last used more than ``older_than_days`` ago and/or whose namespace
    (its name or label: model path, fingerprint, dtype ...) contains ``model``; with ``max_gb``, only the least
    recently used of those until the cache is under ``max_gb``. Returns the deleted entries."""
    root = Path(root)
    cutoff = None if older_than_days is None else time.time() - older_than_days * 86400
    labels: dict[str, str] = {}

    def select(e: Entry) -> bool:
        if cutoff is not None and e.mtime >= cutoff:
            return False
        if model is not None:
            if e.namespace not in labels:
                labels[e.namespace] = e.namespace + " " + json.dumps(read_label(root / e.namespace), sort_keys=True)
            return model.lower() in labels[e.namespace].lower()
        return True

    return evict(root, None if max_gb is None else int(max_gb * GB), select)


def prune_report(gone: list[Entry], root) -> str:
    """What ``prune`` freed: the total, then one line per namespace."""
    lines = [f"freed {fmt_bytes(sum(e.size for e in gone))} in {len(gone)} entries under {root}"]
    by_ns: dict[str, list] = {}
    for e in gone:
        by_ns.setdefault(e.namespace, []).append(e)
    for ns, es in sorted(by_ns.items()):
        lines.append(f"  {ns:<42} {es[0].kind:<10} {len(es):>6} entries {fmt_bytes(sum(e.size for e in es)):>10}")
    return "\n".join(lines)
