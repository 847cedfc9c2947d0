"""Writers of training-order files for the data tests: Pythia's Megatron ``.bin``/``.idx`` (an independent writer
with struct headers), OLMo's raw token files and ``global_indices``, a Pythia checkpoint + order layout, and the
``mia split`` CLI in-process. Plain functions, shared by the split, order, check and fuzz tests."""
from __future__ import annotations

import argparse
import os
import shutil
import struct
from pathlib import Path

import numpy as np

from mia.data.cli import add_split_parser
from mia.data.indexed import write_indexed

# ------------------------------------------------------------------------------------------- OLMo order
SEQ = 16  # tokens per instance
EOS = 50279


def make_files(tmp_path, lengths=(5 * SEQ + 7, 1 * SEQ + 3, 6 * SEQ), seed=0, eos_every=None):
    """Token files written with ndarray.tofile (raw little-endian uint16, no header) + a path list."""
    rng = np.random.default_rng(seed)
    arrays, names = [], []
    for k, n in enumerate(lengths):
        a = rng.integers(2, 50000, size=n).astype("<u2")
        if eos_every:
            a[::eos_every] = EOS
        name = f"part-{k}.npy"
        a.tofile(tmp_path / name)
        arrays.append(a)
        names.append(name)
    (tmp_path / "paths.txt").write_text("# dolma parts\n" + "\n".join(names) + "\n\n")
    instances = np.concatenate([a[: (len(a) // SEQ) * SEQ] for a in arrays]).reshape(-1, SEQ)
    return arrays, instances


def make_order(tmp_path, n_inst, seed=1):
    gi = np.random.default_rng(seed).permutation(n_inst).astype("<u4")
    gi.tofile(tmp_path / "global_indices.npy")  # raw, no .npy header
    return gi



# ----------------------------------------------------------------------------------------- Pythia order
B, L, STEPS = 4, 6, 12  # rows per step, tokens per row, steps: 48 rows


def row_values(i):
    return (np.arange(L, dtype=np.int64) * 31 + i * 1009 + 1) % 65536


def raw_pythia(dirpath, n_rows=B * STEPS, cut=None):
    """Independent writer (struct header); optionally two shards cut at byte ``cut``."""
    stream = b"".join(row_values(i).astype("<u2").tobytes() for i in range(n_rows))
    idx = os.path.join(dirpath, "document.idx")
    with open(idx, "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n_rows, n_rows + 1))
        f.write(struct.pack(f"<{n_rows}i", *([L] * n_rows)))
        f.write(struct.pack(f"<{n_rows}q", *[i * L * 2 for i in range(n_rows)]))
        f.write(struct.pack(f"<{n_rows + 1}q", *range(n_rows + 1)))
    cuts = [0, len(stream)] if cut is None else [0, cut, len(stream)]
    bins = []
    for k in range(len(cuts) - 1):
        p = os.path.join(dirpath, f"document-{k:05d}-of-{len(cuts) - 2:05d}.bin")
        open(p, "wb").write(stream[cuts[k]:cuts[k + 1]])
        bins.append(p)
    return bins, idx


LAYOUT_B, LAYOUT_ROW, LAYOUT_STEP, LAYOUT_END = 4, 33, 100, 130  # batch, row length, checkpoint step, last step


def pythia_layout(root: Path, tiny_neox_dir: Path, vocab: int, bad_token=None, copies=()) -> tuple:
    """pythia-70m-deduped/step100/ (the tiny GPT-NeoX) + the order as two .bin shards and one .idx. ``copies``:
    ``(dst, src)`` row pairs, row ``dst`` written as a copy of row ``src`` (a duplicate planted in the order)."""
    ckpt = root / "models" / "pythia-70m-deduped" / f"step{LAYOUT_STEP}"
    if not ckpt.exists():
        shutil.copytree(tiny_neox_dir, ckpt)
    rows = np.random.default_rng(0).integers(1, vocab, size=(LAYOUT_END * LAYOUT_B + 7, LAYOUT_ROW))
    if bad_token is not None:
        rows[:, 3] = bad_token
    for dst, src in copies:
        rows[dst] = rows[src]
    write_indexed(root / "data" / "document", rows)
    blob = (root / "data" / "document.bin").read_bytes()
    cut = len(blob) // 2 + 1  # shards split inside a row, as the real 21 shards are
    (root / "data" / "document-00000-of-00002.bin").write_bytes(blob[:cut])
    (root / "data" / "document-00001-of-00002.bin").write_bytes(blob[cut:])
    (root / "data" / "document.bin").unlink()
    shards = sorted(str(p) for p in (root / "data").glob("document-*.bin"))
    return root / "models", shards, str(root / "data" / "document.idx"), rows


def split_cli(argv):
    """``mia split ...`` in-process: the split subcommands' parser and function, without the rest of the CLI."""
    ap = argparse.ArgumentParser(prog="mia")
    add_split_parser(ap.add_subparsers(dest="command"))
    args = ap.parse_args(argv)
    return args.func(args)


