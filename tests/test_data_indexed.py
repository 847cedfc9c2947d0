"""Megatron .bin/.idx reader and writer, against an independent struct-based writer."""
import os
import struct

import numpy as np
import pytest

from mia.data.indexed import IndexedDataError, IndexedDataset, read_idx_header, write_idx, write_indexed

CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
         np.dtype(np.int64): 5, np.dtype(np.float32): 6, np.dtype(np.float64): 7, np.dtype(np.uint16): 8}


def raw_idx(path, sizes, pointers, doc_idx, code=8, version=1, magic=b"MMIDIDX\x00\x00"):
    """Independent .idx writer: struct.pack of the header, then the three arrays."""
    with open(path, "wb") as f:
        f.write(magic)
        f.write(struct.pack("<Q", version))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        for s in sizes:
            f.write(struct.pack("<i", s))
        for p in pointers:
            f.write(struct.pack("<q", p))
        for d in doc_idx:
            f.write(struct.pack("<q", d))


def raw_write(dirpath, rows, dtype=np.uint16, cuts=(), name="doc"):
    """Independent writer: byte stream of the rows, cut into shards at the given byte offsets."""
    dt = np.dtype(dtype)
    stream = b"".join(np.asarray(r, dtype=dt).astype(dt.newbyteorder("<")).tobytes() for r in rows)
    sizes = [len(r) for r in rows]
    pointers, off = [], 0
    for s in sizes:
        pointers.append(off)
        off += s * dt.itemsize
    idx = os.path.join(dirpath, f"{name}.idx")
    raw_idx(idx, sizes, pointers, list(range(len(rows) + 1)), code=CODES[dt])
    bounds = [0, *cuts, len(stream)]
    bins = []
    for k in range(len(bounds) - 1):
        b = os.path.join(dirpath, f"{name}-{k:05d}.bin" if cuts else f"{name}.bin")
        with open(b, "wb") as f:
            f.write(stream[bounds[k]:bounds[k + 1]])
        bins.append(b)
    return bins, idx


def grid(n, L, mod=65536):
    return (np.arange(n, dtype=np.int64)[:, None] * 7919 + np.arange(L)[None, :] * 13) % mod


def test_reads_independently_written_file(tmp_path):
    rows = grid(12, 9)
    bins, idx = raw_write(tmp_path, rows)
    ds = IndexedDataset(bins[0], idx)
    assert len(ds) == 12 and ds.dtype == np.uint16
    assert list(ds.sizes) == [9] * 12
    for i in (0, 5, 11, -1):
        np.testing.assert_array_equal(ds[i], rows[i])
    got = ds.get_rows([11, 0, 3])
    assert got.shape == (3, 9) and got.dtype == np.uint16
    np.testing.assert_array_equal(got, rows[[11, 0, 3]])
    np.testing.assert_array_equal(ds[2:5], rows[2:5])
    with pytest.raises(IndexError):
        ds[12]
    with pytest.raises(IndexError):
        ds.get_rows([0, 12])
    assert ds.uniform_row_len() == 9
    # prefix form
    ds2 = IndexedDataset(str(tmp_path / "doc"))
    np.testing.assert_array_equal(ds2[7], rows[7])


def test_writer_matches_independent_writer_bytes(tmp_path):
    rows = [np.array([1, 2, 3]), np.array([4]), np.array([5, 6, 70000 % 65536])]
    raw_write(tmp_path, rows, name="ref")
    write_indexed(tmp_path / "ours", rows)
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    assert read_idx_header(tmp_path / "ours.idx") == (np.dtype(np.uint16), 3, 4)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float32, np.float64, np.uint16])
def test_roundtrip_every_dtype(tmp_path, dtype):
    rows = [np.arange(k, dtype=dtype) for k in (3, 1, 4)]
    write_indexed(tmp_path / "d", rows, dtype=dtype)
    ds = IndexedDataset(tmp_path / "d")
    assert ds.dtype == np.dtype(dtype)
    for r, got in zip(rows, (ds[0], ds[1], ds[2])):
        np.testing.assert_array_equal(got, r)
    with pytest.raises(IndexedDataError, match="different sizes"):
        ds.get_rows([0, 1])


def test_writer_2d_array_and_range_check(tmp_path):
    rows = grid(5, 4)
    write_indexed(str(tmp_path / "a.bin"), rows)  # suffix tolerated
    np.testing.assert_array_equal(IndexedDataset(tmp_path / "a").get_rows(range(5)), rows)
    with pytest.raises(IndexedDataError, match="do not fit uint16"):
        write_indexed(tmp_path / "b", [np.array([1, 70000])])
    with pytest.raises(IndexedDataError, match="do not fit uint16"):
        write_indexed(tmp_path / "c", [np.array([-1])])


def test_shards_read_as_one_concatenation(tmp_path):
    rows = grid(10, 7)  # 14 bytes per row
    # cut inside row 2 (between tokens), inside a token of row 5, an empty shard, then exactly at a row edge
    cuts = (31, 77, 77, 112)
    bins, idx = raw_write(tmp_path, rows, cuts=cuts)
    assert len(bins) == 5 and os.path.getsize(bins[2]) == 0
    ds = IndexedDataset(bins, idx_path=idx)
    assert ds.total_bytes == 140
    for i in range(10):
        np.testing.assert_array_equal(ds[i], rows[i])
    np.testing.assert_array_equal(ds.get_rows([2, 5, 7, 8, 9]), rows[[2, 5, 7, 8, 9]])
    with pytest.raises(IndexedDataError, match="pass the single .idx"):
        IndexedDataset(bins)
    # numbered shards in the wrong order would read other bytes as well-formed rows: refused, naming the shard
    with pytest.raises(IndexedDataError, match=r"doc-00003\.bin: shard given after \S*doc-00004\.bin .* numbered"):
        IndexedDataset(list(reversed(bins)), idx_path=idx)
    # shards named without a common numbered pattern are read in the order given
    renamed = [os.path.join(tmp_path, n) for n in ("e.bin", "d.bin", "c.bin", "b.bin", "a.bin")]
    for b, r in zip(bins, renamed):
        os.rename(b, r)
    np.testing.assert_array_equal(IndexedDataset(renamed, idx_path=idx)[9], rows[9])


def test_shards_out_of_order_by_number_gap_or_size(tmp_path, capsys):
    """Shards given out of order are refused in one line naming both files: numbered names with a gap (a shard
    missing or moved), and renamed equal parts of a cut file whose short last part is not last (the .idx geometry:
    every part but the last is the same size). The same from ``mia split pythia``."""
    from mia.cli import main

    rows = grid(12, 7)  # 168 bytes, cut into 50 + 50 + 50 + 18 as `split -b 50` does
    bins, idx = raw_write(tmp_path, rows, cuts=(50, 100, 150))
    ds = IndexedDataset(bins, idx_path=idx)
    np.testing.assert_array_equal(ds.get_rows(range(12)), rows)
    with pytest.raises(IndexedDataError, match=rf"{bins[2]}: shard given after {bins[0]}, but their numbers are not "
                                               r"consecutive \(shard\(s\) 1\.\.1 missing\)"):
        IndexedDataset([bins[0], bins[2], bins[1], bins[3]], idx_path=idx)
    renamed = [str(tmp_path / n) for n in ("w.bin", "x.bin", "y.bin", "z.bin")]
    for b, r in zip(bins, renamed):
        os.rename(b, r)
    np.testing.assert_array_equal(IndexedDataset(renamed, idx_path=idx)[11], rows[11])  # in order: read
    swapped = [renamed[0], renamed[3], renamed[1], renamed[2]]
    with pytest.raises(IndexedDataError, match=rf"{renamed[3]}: shard of 18 bytes given before {renamed[1]}, but every "
                                               "other shard is 50 bytes"):
        IndexedDataset(swapped, idx_path=idx)
    capsys.readouterr()
    assert main(["split", "pythia", "--data", *swapped, "--idx", idx, "--steps", "1", "--batch-size", "2",
                 "--n-members", "1", "--n-nonmembers", "1", "--out", str(tmp_path / "s.jsonl")]) == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and renamed[3] in lines[0] and renamed[1] in lines[0]
    assert not (tmp_path / "s.jsonl").exists()


def test_int64_offsets_past_4gib(tmp_path):
    """Pointers past 2**32 bytes and total sizes past int32: a sparse 5 GB .bin with two real rows."""
    L = 2049
    far = 5_000_000_000  # bytes; even
    b = tmp_path / "big.bin"
    a0, a1 = np.arange(L, dtype=np.uint16), (np.arange(L, dtype=np.uint16) * 3)
    with open(b, "wb") as f:
        f.write(a0.tobytes())
        f.seek(far)
        f.write(a1.tobytes())
    raw_idx(tmp_path / "big.idx", [L, L], [0, far], [0, 1, 2])
    ds = IndexedDataset(tmp_path / "big")
    np.testing.assert_array_equal(ds[1], a1)
    np.testing.assert_array_equal(ds.get_rows([1, 0]), np.stack([a1, a0]))
    # write_idx computes packed pointers in int64
    write_idx(tmp_path / "p.idx", np.full(1_100_000, L), np.uint16)
    with open(tmp_path / "p.idx", "rb") as f:
        f.seek(34 + 4 * 1_100_000 + 8 * (1_100_000 - 1))
        (last,) = struct.unpack("<q", f.read(8))
    assert last == (1_100_000 - 1) * L * 2 > 2**32


@pytest.mark.parametrize("kw,msg", [
    (dict(magic=b"MMIDIDY\x00\x00"), "bad magic"),
    (dict(version=2), "unsupported index version 2"),
    (dict(code=9), "unknown dtype code 9"),
    (dict(code=0), "unknown dtype code 0"),
])
def test_bad_header_errors_name_the_file(tmp_path, kw, msg):
    (tmp_path / "x.bin").write_bytes(b"\x00" * 8)
    raw_idx(tmp_path / "x.idx", [4], [0], [0, 1], **kw)
    with pytest.raises(IndexedDataError, match=msg) as e:
        IndexedDataset(tmp_path / "x")
    assert "x.idx" in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_bin_shorter_than_index(tmp_path):
    rows = grid(4, 5)
    bins, idx = raw_write(tmp_path, rows)
    with open(bins[0], "r+b") as f:
        f.truncate(4 * 5 * 2 - 2)
    with pytest.raises(IndexedDataError,
                       match=r"doc\.bin: \.bin is 38 bytes but doc\.idx says the last row ends at byte 40"):
        IndexedDataset(bins[0], idx)


def test_a_directory_is_named_as_one(tmp_path, capsys):
    """A directory given as the data or the index says it is a directory (not a missing ``<dir>.idx``), in the
    library and from ``mia split pythia`` (naming --data / --idx)."""
    from mia.cli import main

    rows = grid(4, 5)
    bins, idx = raw_write(tmp_path, rows)
    (tmp_path / "d").mkdir()
    with pytest.raises(IndexedDataError, match=r"/d: is a directory, expected a \.bin file"):
        IndexedDataset(tmp_path / "d")
    with pytest.raises(IndexedDataError, match=r"/d: is a directory, expected a \.idx index file"):
        IndexedDataset(bins[0], tmp_path / "d")
    for extra, flag in ((["--data", tmp_path / "d"], "--data"),
                        (["--data", bins[0], "--idx", tmp_path / "d"], "--idx")):
        capsys.readouterr()
        assert main(["split", "pythia", *map(str, extra), "--steps", "1", "--n-members", "1", "--n-nonmembers", "1",
                     "--out", str(tmp_path / "s.jsonl")]) == 2
        lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: {flag} ") and "is a directory" in lines[0], lines


def test_truncated_or_missing_index(tmp_path):
    rows = grid(4, 5)
    bins, idx = raw_write(tmp_path, rows)
    data = open(idx, "rb").read()
    open(idx, "wb").write(data[:-8])
    with pytest.raises(IndexedDataError, match="doc.idx: index is"):
        IndexedDataset(bins[0], idx)
    open(idx, "wb").write(data[:20])
    with pytest.raises(IndexedDataError, match="truncated header"):
        IndexedDataset(bins[0], idx)
    with pytest.raises(IndexedDataError, match="nope.idx: index file not found"):
        IndexedDataset(tmp_path / "nope")
    os.remove(bins[0])
    open(idx, "wb").write(data)
    with pytest.raises(IndexedDataError, match="doc.bin: data file not found"):
        IndexedDataset(tmp_path / "doc")
