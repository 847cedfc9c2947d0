"""Benchmark: draw a 10,000 + 10,000 Pythia checkpoint split from a ~5 GB ``.bin``.

The ``.bin`` is a sparse file (``truncate``), so no 5 GB is written; its ``.idx`` is generated (2049-token
uint16 rows, packed pointers). The rows the seed will draw are pre-filled with random tokens so that token
values (and hence Python int objects and JSON sizes) are realistic instead of all zero. By default the drawn rows
were just written, so they are read from the page cache: this measures the library's overhead, not the disk.
``--cold`` flushes the ``.bin`` and ``.idx`` and asks the kernel to drop their cached pages
(``posix_fadvise(DONTNEED)``, this file's pages only) before the draw, so the drawn rows are read from the disk
(through whatever cache the host keeps below the VM).

    python -m experiments.bench_split [--gb 5] [--n 10000] [--keep DIR] [--cold]

Prints wall time of each phase (draw, write, check) and peak RSS (``resource.getrusage``).
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time

import numpy as np


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def drop_cached_pages(*paths) -> None:
    """Write each file's dirty pages to disk and drop its pages from the page cache (this file only)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv=None) -> int:
    from mia.data import pythia
    from mia.data.indexed import IndexedDataset, write_idx
    from mia.data.splits import write_split
    from mia.data.verify import check_split

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=5.0, help="size of the sparse .bin in GB (1e9 bytes)")
    ap.add_argument("--n", type=int, default=10_000, help="members and non-members each")
    ap.add_argument("--gap", type=int, default=10)
    ap.add_argument("--seed", type=int, default=229)
    ap.add_argument("--keep", default=None, help="work in this folder and keep it (default: a temp dir, removed)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--cold", action="store_true", help="drop the files' cached pages before the draw")
    args = ap.parse_args(argv)

    L, B = pythia.ROW_LEN, pythia.BATCH_SIZE
    row_bytes = L * 2
    n_rows = (int(args.gb * 1e9) // row_bytes) // B * B
    steps = n_rows // B
    step = int(steps * 0.8)
    work = args.keep or tempfile.mkdtemp(prefix="mia-bench-split-")
    os.makedirs(work, exist_ok=True)
    try:
        t0 = time.perf_counter()
        prefix = os.path.join(work, "document")
        with open(prefix + ".bin", "wb") as f:
            f.truncate(n_rows * row_bytes)
        write_idx(prefix + ".idx", np.full(n_rows, L, dtype=np.int64), np.uint16)
        # pre-fill the rows this seed draws (same generator calls as draw_checkpoint_split)
        rng = np.random.default_rng(args.seed)
        m = rng.choice((step - args.gap) * B, size=args.n, replace=False)
        nm = (step + args.gap) * B + rng.choice((steps - step - args.gap) * B, size=args.n, replace=False)
        fill = np.random.default_rng(0)
        with open(prefix + ".bin", "r+b") as f:
            for r in np.sort(np.concatenate([m, nm])).tolist():
                f.seek(r * row_bytes)
                f.write(fill.integers(1, 50_000, size=L, dtype=np.uint16).tobytes())
        t_setup = time.perf_counter() - t0
        rss_setup = peak_rss_mb()
        print(f"setup: {n_rows:,} rows x {L} tokens = {n_rows * row_bytes / 1e9:.2f} GB sparse .bin "
              f"({steps} steps), .idx {os.path.getsize(prefix + '.idx') / 1e6:.1f} MB, "
              f"{t_setup:.1f} s, peak RSS {rss_setup:.0f} MB")

        if args.cold:
            drop_cached_pages(prefix + ".bin", prefix + ".idx")
            print("cold: the .bin and .idx pages were flushed and dropped from the page cache")
        t0 = time.perf_counter()
        ds = IndexedDataset(prefix)
        header, ex = pythia.draw_checkpoint_split(ds, step, args.n, args.n, args.seed, gap=args.gap, end_step=steps)
        t_draw = time.perf_counter() - t0
        rss_draw = peak_rss_mb()
        assert sorted(e["index"] for e in ex if e["label"] == 1) == sorted(m.tolist())
        assert all(e["tokens"][0] != 0 for e in ex[:100])
        print(f"draw:  {args.n:,} + {args.n:,} rows at step {step} (gap {args.gap}, end {steps}): "
              f"{t_draw:.2f} s, peak RSS {rss_draw:.0f} MB")

        t0 = time.perf_counter()
        out = os.path.join(work, "split.jsonl")
        write_split(out, header, ex)
        t_write = time.perf_counter() - t0
        print(f"write: {out} {os.path.getsize(out) / 1e6:.0f} MB, {t_write:.2f} s, peak RSS {peak_rss_mb():.0f} MB")
        del ex

        if not args.no_check:
            t0 = time.perf_counter()
            problems = check_split(out)
            t_check = time.perf_counter() - t0
            print(f"check: {len(problems)} problems, {t_check:.2f} s, peak RSS {peak_rss_mb():.0f} MB")
            if problems:
                print("\n".join(problems[:5]))
                return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
