"""Benchmark: memory and bytes read when a run takes its token stats from a large score cache.

A cache of ``--cached`` examples (lengths uniform in [10, 80) tokens, parts of 256 examples, as the scoring engine
writes them) is read back by a run that needs ``--need`` of them, two ways side by side:

  baseline  the reader of mia 38bd59c (``StatsCache.__init__`` before the per-part index): every .npz part of the
  namespace
            read whole, every example kept as a view into its part's arrays
  mia       ``mia.engine.StatsCache.lookup``: every part's index, then one contiguous read per needed example,
            copied into arrays of exactly its length

    python -m experiments.bench_cache [--cached 5000] [--need 50 500 5000]

Prints bytes read from disk, bytes still held after the read (tracemalloc; the arrays the run keeps and what
they pin) and the ratio baseline / mia. Synthetic stats, no model: this measures the cache, not the engine.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np

from mia.files.atomic import save_npz
from mia.engine.cache import StatsCache
from mia.engine.stats import STAT_NAMES


def synthetic(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(10, 80, n) - 1  # T - 1 positions per example
    return {hashlib.sha256(f"{seed}-{i}".encode()).hexdigest()[:24]:
            {s: rng.standard_normal(int(t)).astype(np.float32) for s in STAT_NAMES} for i, t in enumerate(lengths)}


def write_baseline_part(directory: Path, items: dict) -> None:
    """One part in the pre-issue-12 format (.npz: keys, offsets, one concatenated array per stat)."""
    keys = list(items)
    offsets = np.cumsum([0] + [len(items[k]["logprob"]) for k in keys])
    arrays = {s: np.concatenate([items[k][s] for k in keys]) for s in STAT_NAMES}
    name = hashlib.sha256("".join(keys).encode()).hexdigest()[:16]
    save_npz(directory / f"part-{name}.npz", keys=json.dumps(keys), offsets=offsets, **arrays)


def baseline_read(directory: Path) -> tuple[dict, int]:
    """The reader of mia 38bd59c: every part whole, every example a view into its part."""
    mem, read = {}, 0
    for f in sorted(directory.glob("part-*.npz")):
        read += f.stat().st_size
        with np.load(f) as z:
            keys = json.loads(str(z["keys"]))
            offsets = z["offsets"]
            arrays = {s: z[s] for s in STAT_NAMES}
        for j, k in enumerate(keys):
            mem[k] = {s: arrays[s][offsets[j]:offsets[j + 1]] for s in STAT_NAMES}
    return mem, read


def held_after(fn):
    """(result, bytes still allocated after ``fn()`` returned, peak bytes during it)."""
    gc.collect()
    tracemalloc.start()
    out = fn()
    gc.collect()
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return out, held, peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cached", type=int, default=5000)
    ap.add_argument("--need", type=int, nargs="+", default=[50, 500, 5000])
    args = ap.parse_args(argv)
    items = synthetic(args.cached)
    keys = list(items)
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        old, new = Path(tmp) / "old", Path(tmp) / "new"
        old.mkdir()
        cache = StatsCache(tmp, "new")
        for a in range(0, len(keys), 256):
            part = {k: items[k] for k in keys[a:a + 256]}
            write_baseline_part(old, part)
            cache.put_many(part)
        data = sum(4 * len(STAT_NAMES) * len(v["logprob"]) for v in items.values())
        print(f"cache: {args.cached} examples, {data / 1e6:.2f} MB of stats, {len(keys) // 256 + 1} parts "
              f"(baseline .npz {sum(f.stat().st_size for f in old.iterdir()) / 1e6:.2f} MB, mia .f32+.json "
              f"{sum(f.stat().st_size for f in new.iterdir()) / 1e6:.2f} MB)")
        print(f"{'needed':>7} {'needed MB':>10} {'read MB base':>13} {'read MB mia':>12} {'held MB base':>13} "
              f"{'held MB mia':>12} {'held ratio':>11}")
        rng = np.random.default_rng(1)
        for n in args.need:
            want = [keys[i] for i in sorted(rng.choice(len(keys), n, replace=False))]
            need = sum(4 * len(STAT_NAMES) * len(items[k]["logprob"]) for k in want)

            def base():
                mem, read = baseline_read(old)
                return {k: mem[k] for k in want}, read  # the run keeps only its examples; views pin whole parts

            def ours():
                reader = StatsCache(tmp, "new")
                return reader.lookup(want), reader.bytes_read

            (got_b, read_b), held_b, _ = held_after(base)
            (got_m, read_m), held_m, _ = held_after(ours)
            assert all(np.array_equal(got_b[k][s], got_m[k][s]) for k in want for s in STAT_NAMES)
            print(f"{n:>7} {need / 1e6:>10.3f} {read_b / 1e6:>13.2f} {read_m / 1e6:>12.3f} {held_b / 1e6:>13.2f} "
                  f"{held_m / 1e6:>12.3f} {held_b / max(held_m, 1):>10.1f}x")
            del got_b, got_m
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
