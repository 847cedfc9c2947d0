"""OLMo order (raw global_indices + token files), checkpoint draws, OLMoMIA document extraction, CLI."""
import json

import numpy as np
import pytest

from mia.data import olmo_order
from mia.data.splits import SplitError, read_split, write_split
from mia.data.verify import check_split

from order_files import EOS, SEQ, make_files, make_order, split_cli as run_cli

B = 3  # instances per OLMo batch in these tests


def test_instances_across_file_boundary(tmp_path):
    arrays, inst = make_files(tmp_path)
    tf = olmo_order.TokenFiles([tmp_path / f"part-{k}.npy" for k in range(3)], seq_len=SEQ)
    assert len(tf) == 5 + 1 + 6 == len(inst)
    assert tf.locate(4) == (0, 4) and tf.locate(5) == (1, 0) and tf.locate(6) == (2, 0) and tf.locate(11) == (2, 5)
    np.testing.assert_array_equal(tf[4], arrays[0][4 * SEQ:5 * SEQ])
    np.testing.assert_array_equal(tf[5], arrays[1][:SEQ])  # remainder of file 0 (7 tokens) dropped
    np.testing.assert_array_equal(tf[6], arrays[2][:SEQ])
    np.testing.assert_array_equal(tf.get_many([11, 0]), inst[[11, 0]])
    with pytest.raises(IndexError):
        tf[12]


def test_order_batches_and_positions(tmp_path):
    _, inst = make_files(tmp_path)
    gi = make_order(tmp_path, len(inst))
    order = olmo_order.OlmoOrder(tmp_path / "global_indices.npy", tmp_path / "paths.txt", seq_len=SEQ, batch_size=B)
    assert len(order) == 12 and order.steps == 4
    np.testing.assert_array_equal(order.batch(2), gi[6:9])
    for q in range(12):
        np.testing.assert_array_equal(order[q], inst[gi[q]])
    assert olmo_order.step_positions(400_000) == (400_000 * 2160, 400_001 * 2160)
    with pytest.raises(IndexError):
        order.batch(4)


def test_global_indices_length_mismatch(tmp_path):
    _, inst = make_files(tmp_path)
    make_order(tmp_path, len(inst) + 1)
    with pytest.raises(olmo_order.OlmoDataError,
                       match=r"global_indices.npy: 13 entries but the 3 token files hold 12 instances of 16"):
        olmo_order.OlmoOrder(tmp_path / "global_indices.npy", tmp_path / "paths.txt", seq_len=SEQ, batch_size=B)
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 6)
    with pytest.raises(olmo_order.OlmoDataError, match="odd.bin: 6 bytes is not a whole number of uint32"):
        olmo_order.load_global_indices(tmp_path / "odd.bin")
    (tmp_path / "bad.txt").write_text("missing-file.npy\n")
    with pytest.raises(olmo_order.OlmoDataError, match="missing-file.npy: token file not found"):
        olmo_order.OlmoOrder(tmp_path / "global_indices.npy", tmp_path / "bad.txt", seq_len=SEQ)


def test_draw_ranges_and_errors(tmp_path):
    _, inst = make_files(tmp_path)
    gi = make_order(tmp_path, len(inst))
    order = olmo_order.OlmoOrder(tmp_path / "global_indices.npy", tmp_path / "paths.txt", seq_len=SEQ, batch_size=B)
    # all of each range: members [0, 2) -> positions 0..5, non-members [3, 4) -> 9..11
    h, ex = olmo_order.draw_checkpoint_split(order, 2, 6, 3, seed=0, nonmember_start=3)
    assert sorted(e["index"] for e in ex if e["label"] == 1) == list(range(6))
    assert sorted(e["index"] for e in ex if e["label"] == 0) == [9, 10, 11]
    for e in ex:
        assert e["instance"] == gi[e["index"]] and e["tokens"] == inst[gi[e["index"]]].tolist()
        assert e["index"] == e["step"] * B + e["batch_pos"]
    assert h["params"]["member_steps"] == [0, 2] and h["params"]["nonmember_steps"] == [3, 4]
    with pytest.raises(SplitError, match=r"asked for 7 members but positions \[0, 6\) hold only 6"):
        olmo_order.draw_checkpoint_split(order, 2, 7, 1, seed=0)
    with pytest.raises(SplitError, match=r"non-member range \[3, 5\) crosses the end of the order"):
        olmo_order.draw_checkpoint_split(order, 2, 1, 1, seed=0, nonmember_start=3, end_step=5)
    with pytest.raises(SplitError, match="step 5 is past the data"):
        olmo_order.draw_checkpoint_split(order, 5, 1, 1, seed=0)
    with pytest.raises(SplitError, match="before the checkpoint step"):
        olmo_order.draw_checkpoint_split(order, 2, 1, 1, seed=0, nonmember_start=1)


def test_split_documents_rules():
    t = [7, EOS, 1, 2, 3, EOS, EOS, 4, 5, EOS, 9]
    assert olmo_order.split_documents(t, EOS) == [(0, 2, 5), (1, 6, 6), (2, 7, 9)]
    assert olmo_order.split_documents([1, 2, 3], EOS) == []
    assert olmo_order.split_documents([EOS, 1, 2], EOS) == []  # one EOS: no complete document
    assert olmo_order.split_documents([EOS, 1, EOS], EOS) == [(0, 1, 2)]
    # length filter L/2 < len <= L with L = 4: lengths 2 (no), 3 (yes), 4 (yes), 5 (no)
    mk = lambda *lens: sum(([EOS] + [1] * n for n in lens), []) + [EOS]
    assert olmo_order.pick_document(mk(2, 5, 3), EOS, 4) == (2, 1 + 3 + 6, 1 + 3 + 6 + 3)
    assert olmo_order.pick_document(mk(2, 4), EOS, 4) == (1, 4, 8)
    assert olmo_order.pick_document(mk(2, 5), EOS, 4) is None
    assert olmo_order.pick_document([1] * 3 + [EOS] + [1] * 3, EOS, 4) is None  # partial docs dropped


def test_documents_draw_check_and_tamper(tmp_path):
    _, inst = make_files(tmp_path, eos_every=5)  # segments of 4 tokens between EOS
    make_order(tmp_path, len(inst))
    order = olmo_order.OlmoOrder(tmp_path / "global_indices.npy", tmp_path / "paths.txt", seq_len=SEQ, batch_size=B)
    h, ex = olmo_order.draw_checkpoint_split(order, 2, 3, 2, seed=4, nonmember_start=3, documents=True, eos=EOS,
                                             doc_len=6)
    assert len(ex) == 5 and len({e["index"] for e in ex}) == 5
    for e in ex:
        full = inst[e["instance"]]
        assert 3 < len(e["tokens"]) <= 6 and EOS not in e["tokens"]
        assert full[e["offset"] - 1] == EOS and full[e["offset"] + len(e["tokens"])] == EOS
        assert e["id"] == f"olmo{e['index']}-{e['segment']}"
    p = tmp_path / "docs.jsonl"
    write_split(p, h, ex)
    assert check_split(p) == []
    lines = p.read_text().splitlines()
    o = json.loads(lines[2])
    o["tokens"][0] += 1
    lines[2] = json.dumps(o)
    p.write_text("\n".join(lines) + "\n")
    assert check_split(p) == ["line 3: row differs from its row_sha256 (id, label, partition, text or tokens edited "
                              "after the split was written)",
                              "line 3: tokens differ from the data at position %d (first at token 0)" % o["index"]]
    with pytest.raises(SplitError, match=r"only 0 of 1 member documents found in 6 candidate instances"):
        olmo_order.draw_checkpoint_split(order, 2, 1, 0, seed=0, documents=True, doc_len=2)


def test_cli_olmo_and_check(tmp_path, capsys):
    _, inst = make_files(tmp_path)
    make_order(tmp_path, len(inst))
    out = tmp_path / "o.jsonl"
    base = ["split", "olmo", "--global-indices", str(tmp_path / "global_indices.npy"), "--data-paths",
            str(tmp_path / "paths.txt"), "--steps", "2", "--nonmember-start", "3", "--batch-size", str(B),
            "--seq-len", str(SEQ), "--seed", "3"]
    assert run_cli(base + ["--partition", "train=1,eval=1", "--out", str(out)]) == 0
    s = read_split(out)
    assert s.header["source"]["kind"] == "olmo" and s.header["counts"]["members"] == 2
    assert run_cli(["split", "check", str(out)]) == 0
    # a member moved into the non-member range (tokens kept consistent) is caught
    lines = out.read_text().splitlines()
    o = json.loads(lines[1])
    assert o["label"] == 1
    used = {json.loads(x)["index"] for x in lines[1:]}
    q = next(q for q in (9, 10, 11) if q not in used)
    order = olmo_order.OlmoOrder(tmp_path / "global_indices.npy", tmp_path / "paths.txt", seq_len=SEQ, batch_size=B)
    o.update(index=q, step=q // B, batch_pos=q % B, instance=order.instance_id(q), tokens=order[q].tolist())
    lines[1] = json.dumps(o)
    out.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert run_cli(["split", "check", str(out)]) == 1
    assert f"line 2: member position {q} is at step 3, outside the member steps [0, 2)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="crosses the end of the order"):
        run_cli(base + ["--n-members", "1", "--n-nonmembers", "1", "--end-step", "9", "--out", str(out)])
