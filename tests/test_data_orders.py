"""OLMo order files as OLMo writes them (padded / trimmed to a multiple of the world size), and the vocabulary bound
of `mia split pythia|olmo` and of scored examples."""
import json
import math

import numpy as np
import pytest

from mia.data import olmo_order, pythia
from mia.data.examples import DataError, Example, tokenize_examples
from mia.data.indexed import IndexedDataset
from mia.data.splits import read_split
from mia.data.verify import check_split

from order_files import SEQ, make_files, raw_pythia, split_cli as olmo_cli


def olmo_global_indices(n: int, world_size: int, drop_last: bool, seed: int = 6198, epoch: int = 0) -> np.ndarray:
    """OLMo's IterableDataset._build_global_indices, restated (olmo/data/iterable_dataset.py): total_size from
    __init__, a PCG64(seed + epoch) shuffle, then the tail trimmed (drop_last) or the head repeated (padding)."""
    if drop_last and n % world_size:
        num_samples = math.ceil((n - world_size) / world_size)
    else:
        num_samples = math.ceil(n / world_size)
    total = num_samples * world_size
    idx = np.arange(n, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(seed=seed + epoch)).shuffle(idx)
    if drop_last:
        return idx[:total]
    parts, pad = [idx], total - n
    while pad > 0:
        parts.append(idx[:min(pad, n)])
        pad -= len(parts[-1])
    return np.concatenate(parts)


@pytest.mark.parametrize("drop_last", [True, False])
def test_olmo_order_as_olmo_writes_it(tmp_path, drop_last, capsys):
    _, inst = make_files(tmp_path, lengths=(5 * SEQ + 7, 1 * SEQ + 3, 5 * SEQ))  # 11 instances
    n, world, batch = len(inst), 4, 4  # the world size divides the global batch size
    gi = olmo_global_indices(n, world, drop_last)
    assert len(gi) == (8 if drop_last else 12)
    gi.astype("<u4").tofile(tmp_path / "global_indices.npy")
    order = olmo_order.OlmoOrder(tmp_path / "global_indices.npy", tmp_path / "paths.txt", seq_len=SEQ, batch_size=batch)
    assert len(order) == (8 if drop_last else 11)  # the padded repeat is not a position of the order
    (note,) = order.notes
    if drop_last:
        assert "the last 3 shuffled instances are not in the order" in note and "drop_last=True" in note
    else:
        assert "the last 1 entries repeat the first 1" in note and "positions >= 11 are ignored" in note
    for q in range(len(order)):
        np.testing.assert_array_equal(order[q], inst[gi[q]])
    # a split drawn through the CLI: every position inside the usable order, the note in the header and on stderr
    out = tmp_path / "s.jsonl"
    assert olmo_cli(["split", "olmo", "--global-indices", str(tmp_path / "global_indices.npy"), "--data-paths",
                     str(tmp_path / "paths.txt"), "--seq-len", str(SEQ), "--batch-size", str(batch), "--steps", "1",
                     "--n-members", "4", "--n-nonmembers", "4", "--out", str(out)]) == 0
    assert note in capsys.readouterr().err
    s = read_split(out)
    assert s.header["source"]["notes"] == [note] and max(e["index"] for e in s.examples) < len(order)
    assert check_split(out) == []


def test_olmo_order_refuses_what_olmo_does_not_write(tmp_path):
    _, inst = make_files(tmp_path)
    gi = olmo_global_indices(len(inst), 8, drop_last=False)
    gi[-1] = (gi[3] + 1) % len(inst)  # the padding is not a repeat of the head
    gi.astype("<u4").tofile(tmp_path / "gi")
    with pytest.raises(olmo_order.OlmoDataError, match=r"gi: 16 entries but the 3 token files hold 12 instances of 16 "
                                                  r"tokens, and the 4 extra entries are not OLMo's padding"):
        olmo_order.OlmoOrder(tmp_path / "gi", tmp_path / "paths.txt", seq_len=SEQ, batch_size=8)
    gi[:6].astype("<u4").tofile(tmp_path / "gi")  # 6 short of 12: more than a world size <= the batch size 4
    with pytest.raises(olmo_order.OlmoDataError,
                       match=r"6 entries but .* less than the world size <= the batch size 4"):
        olmo_order.OlmoOrder(tmp_path / "gi", tmp_path / "paths.txt", seq_len=SEQ, batch_size=4)


def test_pythia_draw_stops_at_the_first_id_outside_the_vocabulary(tmp_path, capsys):
    bins, idx = raw_pythia(tmp_path, cut=5 * 6 * 2 + 3)  # 48 rows of 6 tokens: row i holds 1009 i + 1 + 31 j
    ds = IndexedDataset(bins, idx_path=idx)
    kw = dict(end_step=12, batch_size=4)
    pythia.draw_checkpoint_split(ds, 6, 24, 24, seed=0, vocab_size=47581, **kw)  # every id fits (max 47580)
    msg = (r"document-00001-of-00001.bin: row 47 \(step 11, batch position 3\) token 0 \(byte 501\) is id 47424, "
           r"outside the model vocabulary \(47000 ids\): the data do not match the model's tokenizer")
    with pytest.raises(ValueError, match=msg):
        pythia.draw_checkpoint_split(ds, 6, 24, 24, seed=0, vocab_size=47000, **kw)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"vocab_size": 47000}))
    argv = ["split", "pythia", "--data", *bins, "--idx", idx, "--steps", "6", "--end-step", "12", "--batch-size", "4",
            "--n-members", "24", "--n-nonmembers", "24", "--out", str(tmp_path / "o.jsonl")]
    for bound in (["--model", str(tmp_path / "m")], ["--vocab-size", "47000"]):
        with pytest.raises(ValueError, match=msg):
            olmo_cli(argv + bound)


def test_olmo_draw_stops_at_the_first_id_outside_the_vocabulary(tmp_path):
    arrays, inst = make_files(tmp_path)
    arrays[2][3 * SEQ + 5] = 60000  # file part-2, its chunk 3 = instance 6 + 3, token 5
    arrays[2].tofile(tmp_path / "part-2.npy")
    gi = np.random.default_rng(1).permutation(len(inst)).astype("<u4")
    gi.tofile(tmp_path / "gi")
    order = olmo_order.OlmoOrder(tmp_path / "gi", tmp_path / "paths.txt", seq_len=SEQ, batch_size=3)
    q = int(np.flatnonzero(gi == 9)[0])
    msg = (rf"part-2.npy: instance 9 \(global position {q}, step {q // 3}\) token 5 \(token 53 of the file\) is id "
           r"60000, outside the model vocabulary \(50304 ids\)")
    with pytest.raises(olmo_order.OlmoDataError, match=msg):
        olmo_order.draw_checkpoint_split(order, 2, 6, 6, seed=0, vocab_size=50304)
    olmo_order.draw_checkpoint_split(order, 2, 6, 6, seed=0, vocab_size=60001)


def test_scored_examples_name_the_offending_token():
    ex = [Example("a", tokens=np.array([5, 7, 9], np.int32), source="d.jsonl:3"),
          Example("b", tokens=np.array([5, 700, 9], np.int32), source="d.jsonl:4")]
    with pytest.raises(DataError, match=r"d.jsonl:4: token 1 is id 700, outside the model vocabulary \(512 ids\)"):
        tokenize_examples(ex, None, None, vocab_size=512)
