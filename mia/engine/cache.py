"""The on-disk score cache: per-example token stats under a content address of everything that determines them.

``cache_namespace(model, extra)`` hashes the model's content fingerprint, dtypes, matmul precision, attention kernel,
backend and engine version (``cache_key``); ``example_key`` hashes an example's token ids. An entry is therefore
never served for other inputs, and an interrupted run resumes from the parts already written.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import threading
import zlib
from pathlib import Path
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..files import cache_limit
from ..files.atomic import write_bytes, write_json
from ..models.attention import requested_kernel
from ..validate import InputError, output_dir
from .stats import STAT_NAMES

STATS_VERSION = "5"  # bump when the meaning or the numerics of cached statistics change (2: precision policy;
# 3: one attention rounding rule; 4: a part holds the statistics it was asked for, named in its index; 5: CPU logits
# chunks of 32 MiB, so the LM head's matmuls can have other shapes, and the last bits of a statistic may move)


class BackgroundWriter:
    """Runs write jobs on one thread, in submission order, off the scoring loop's critical path.

    ``close()`` (also on leaving a ``with`` block, including by KeyboardInterrupt) waits for every submitted job, so
    nothing finished is lost; an error in a job is raised in the caller at the next submit or at close.
    """

    def __init__(self):
        self._queue: queue.Queue = queue.Queue(maxsize=64)
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="mia-cache-writer", daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._error is None:
                try:
                    job()
                except BaseException as e:  # reported to the caller
                    self._error = e

    def submit(self, job: Callable[[], None]) -> None:
        self._raise()
        self._queue.put(job)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
            cache_limit.flush()  # the run's writes are done: the cache back under its size limit
        self._raise()

    def _raise(self):
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


_WARNED_CACHE_DIRS: set = set()


def usable_cache_dir(path: Optional[Path]) -> Optional[Path]:
    """``path`` (``<root>/<namespace>``) when the cache can live there (a writable directory, or one that can be
    created); otherwise a ``warning:`` line on stderr (once per process for an unusable root) and None (the results
    are computed but not cached)."""
    if path is None:
        return None
    for p in (path.parent, path):
        try:
            output_dir(p, "cache directory")
        except InputError as e:
            if str(p) not in _WARNED_CACHE_DIRS:
                _WARNED_CACHE_DIRS.add(str(p))
                print(f"warning: {e}; results are not cached there", file=sys.stderr)
            return None
    return path


def example_key(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).hexdigest()[:24]


class StatsCache:
    """On-disk cache of per-example token stats under ``root/<namespace>/`` (``cache_namespace``: the namespace is
    the content address of everything that determines the stats, so an entry is never served for other inputs).

    One part per finished batch, written (by ``writer``, a BackgroundWriter, when given) as soon as it is fetched,
    so an interrupted run loses at most the batches still on the device:
      ``part-<name>.f32``   float32 little-endian [positions, len(stats)]: example j's rows are the
                            contiguous block offsets[j]:offsets[j+1] (its T_j - 1 positions x the part's stats)
      ``part-<name>.json``  the index {"stats", "keys", "offsets", "crc32", "rows"}: ``stats`` names the part's
                            columns (a subset of ``STAT_NAMES``, in that order: what the pass was asked for);
                            crc32[j] covers key j's bytes and then its block's bytes. Written after the data; a part
                            without an index is ignored.
    A lookup for some statistics is served by any part that holds all of them (a subset of its columns); an example
    that no part covers is not served, and the engine computes it again with the statistics asked for.
    Both files are written atomically (``mia.files.atomic``); processes writing the same part write the same bytes.

    Reading (``lookup``) is bounded by what the run asks for: each index is read, then one contiguous read per
    requested example that is there, copied into arrays of exactly its length. A damaged part (unreadable index,
    missing or truncated data, a CRC mismatch) is reported by one ``warning:`` line on stderr and its examples are
    recomputed; nothing from a damaged block is served. ``bytes_read`` counts the bytes read from disk.

    The cache directory has a size limit (``mia.files.cache_limit``): a part that serves an example is touched (its
    recency), every write is noted and may evict the least recently used entries; a part evicted while it is read
    is recomputed without a warning.
    """

    def __init__(self, root: Optional[str], namespace: str, writer: Optional[BackgroundWriter] = None,
                 label: Optional[dict] = None):
        self.dir = usable_cache_dir(Path(root) / namespace if root else None)
        self.writer = writer
        self.bytes_read = 0
        self.label = label  # <namespace>/namespace.json, written when missing at a write (``mia cache info``)

    def lookup(self, keys: Sequence[str], stats: Sequence[str] = STAT_NAMES) -> dict[str, dict]:
        """{key: {stat: float32 [n]} for each of ``stats``} for those of ``keys`` found intact on disk in a part that
        holds every one of ``stats`` (the others are absent)."""
        wanted, found, stats = set(keys), {}, tuple(stats)
        if self.dir is None or not self.dir.is_dir():
            return found
        for index_file in sorted(self.dir.glob("part-*.json")):
            if len(found) == len(wanted):
                break
            try:
                raw = index_file.read_bytes()
                self.bytes_read += len(raw)
                index = _checked_index(json.loads(raw))
            except FileNotFoundError:
                continue  # evicted since the directory was listed: recomputed
            except (OSError, ValueError, TypeError, KeyError) as e:
                _warn_damaged(index_file, f"unreadable index: {e}")
                continue
            if not set(stats) <= set(index["stats"]):
                continue
            todo = [(j, k) for j, k in enumerate(index["keys"]) if k in wanted and k not in found]
            if todo:
                rows = self._read_rows(index_file.with_suffix(".f32"), index, todo, stats)
                if rows:
                    cache_limit.touch(index_file, index_file.with_suffix(".f32"))  # recency for LRU eviction
                found.update(rows)
        return found

    def _read_rows(self, data_file: Path, index: dict, todo: list, stats: Sequence[str]) -> dict[str, dict]:
        columns = len(index["stats"])
        width = 4 * columns
        where = [index["stats"].index(s) for s in stats]
        out: dict[str, dict] = {}
        try:
            with open(data_file, "rb") as f:
                if os.fstat(f.fileno()).st_size != index["rows"] * width:
                    raise ValueError(f"{os.fstat(f.fileno()).st_size} bytes, the index says {index['rows'] * width}")
                for j, k in todo:
                    lo, hi = index["offsets"][j], index["offsets"][j + 1]
                    f.seek(lo * width)
                    block = f.read((hi - lo) * width)
                    self.bytes_read += len(block)
                    if (
                        len(block) != (hi - lo) * width
                        or zlib.crc32(block, zlib.crc32(k.encode())) != index["crc32"][j]
                    ):
                        raise ValueError(f"example {k}: checksum mismatch")
                    rows = np.frombuffer(block, "<f4").reshape(hi - lo, columns)
                    out[k] = {s: np.array(rows[:, c], np.float32) for c, s in zip(where, stats)}  # own copies
        except FileNotFoundError as e:
            if data_file.with_suffix(".json").exists():  # an index without its data: damaged
                _warn_damaged(data_file, str(e))
            return {}  # else evicted (index first, then data) since the index was read: recomputed
        except (OSError, ValueError) as e:
            _warn_damaged(data_file, str(e))
            return {}
        return out

    def put_many(self, items: dict[str, dict]) -> None:
        """Store {key: {stat: [n]}} as one part (in the background when a writer was given). Every item has the
        same statistics (a subset of ``STAT_NAMES``); the part holds those."""
        if self.dir is None or not items:
            return
        if self.label is not None:  # again when eviction emptied the namespace and removed it
            cache_limit.write_label(self.dir, self.label)
        items = dict(items)
        job = lambda: self._write(items)  # noqa: E731
        self.writer.submit(job) if self.writer is not None else job()

    def _write(self, items: dict[str, dict]) -> None:
        keys = list(items)
        stats = [s for s in STAT_NAMES if s in items[keys[0]]]
        if any(sorted(items[k]) != sorted(stats) for k in keys):
            raise ValueError(f"the items of one cache part must hold the same statistics ({stats})")
        blocks = [np.stack([np.asarray(items[k][s], "<f4") for s in stats], axis=1).tobytes() for k in keys]
        offsets = np.cumsum([0] + [len(items[k][stats[0]]) for k in keys]).tolist()
        name = hashlib.sha256(("".join(keys) + "|" + ",".join(stats)).encode()).hexdigest()[:16]
        index = {"stats": stats, "keys": keys, "offsets": offsets, "rows": offsets[-1],
                 "crc32": [zlib.crc32(b, zlib.crc32(k.encode())) for k, b in zip(keys, blocks)]}

        def write():
            write_bytes(self.dir / f"part-{name}.f32", b"".join(blocks))
            write_json(self.dir / f"part-{name}.json", index)

        cache_limit.write_in(self.dir, write)  # again if an evictor removed the emptied namespace meanwhile
        cache_limit.note_write(self.dir.parent, sum(map(len, blocks)) + len(json.dumps(index)))


def _checked_index(index) -> dict:
    """The part index, or ValueError when its fields do not fit together."""
    keys, offsets, crc = index["keys"], index["offsets"], index["crc32"]
    names = index["stats"]
    if not (isinstance(names, list) and names and names == [s for s in STAT_NAMES if s in names]):
        raise ValueError(f"stats {names} are not a non-empty subset of {list(STAT_NAMES)} in that order")
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise ValueError("keys are not a list of strings")
    if not (isinstance(offsets, list) and len(offsets) == len(keys) + 1 and all(type(o) is int for o in offsets)
            and offsets[0] == 0 and all(a < b for a, b in zip(offsets, offsets[1:])) and offsets[-1] == index["rows"]):
        raise ValueError("offsets are not increasing from 0 to rows")
    if not (isinstance(crc, list) and len(crc) == len(keys) and all(type(c) is int for c in crc)):
        raise ValueError("crc32 does not have one integer per key")
    return index


def _warn_damaged(path: Path, reason: str) -> None:
    print(f"warning: cache file {path} is damaged ({reason}); its entries are recomputed", file=sys.stderr)


def cache_namespace(model, extra: str = "") -> str:
    """Content address of every cached result of ``model``: the hex SHA-256 of ``cache_key(model, extra)``."""
    return hashlib.sha256(json.dumps(cache_key(model, extra), sort_keys=True).encode()).hexdigest()[:32]


def cache_key(model, extra: str = "") -> dict:
    """Everything besides the input tokens that determines a cached result of ``model``:

    model        the checkpoint's content address (``mia.models.hub.fingerprint``: every byte of the weights, the
                 config and the tokenizer files; ``params_fingerprint`` for an in-memory model)
    dtypes       the activation dtype, the module's parameter dtype and the dtypes the parameters are held in
    precision    the matmul precision the model runs under (``Model.matmul_precision``)
    attention    the requested attention kernel (``$MIA_ATTENTION``) and the backend (auto dispatch depends on it)
    version      STATS_VERSION (the engine's numerics); ``extra`` carries the caller's own key (attack parameters,
                 the conditional engine's version and mode)
    """
    module = model.module
    return {"model": model.fingerprint, "dtype": str(jnp.dtype(module.dtype)),
            "param_dtype": str(jnp.dtype(getattr(module, "param_dtype", module.dtype))),
            "param_leaf_dtypes": sorted({str(leaf.dtype) for leaf in jax.tree_util.tree_leaves(model.params)}),
            "precision": getattr(model, "matmul_precision", None), "attention": requested_kernel(),
            "backend": jax.default_backend(), "stats_version": STATS_VERSION, "extra": extra}


def cache_label(model, extra: str = "") -> dict:
    """What a namespace holds, for people (``mia cache info`` / ``prune --model``): ``cache_key`` and the model's
    path."""
    return {**cache_key(model, extra), "path": getattr(model, "path", None) or "(in memory)"}


def cacheable(model, params) -> bool:
    """A result may be cached only under a content address: a model with a fingerprint scored with its own params."""
    return bool(getattr(model, "fingerprint", "")) and params is None
