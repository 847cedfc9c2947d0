"""Pythia step arithmetic, checkpoint split drawing, partitions, assert_disjoint, check_split and the CLI."""
import json

import numpy as np
import pytest

from mia.data import pythia
from mia.data.indexed import IndexedDataset, write_indexed
from mia.data.splits import SplitError, assign_partitions, parse_partitions, read_split, write_split
from mia.data.verify import check_split

from order_files import STEPS, B, L, raw_pythia, row_values, split_cli as run_cli


@pytest.fixture
def pdata(tmp_path):
    bins, idx = raw_pythia(tmp_path, cut=5 * L * 2 + 3)  # shard boundary inside row 5
    return IndexedDataset(bins, idx_path=idx), bins, idx


# ---------------------------------------------------------------------------------------------- arithmetic

def test_step_arithmetic_defaults():
    assert pythia.step_rows(0) == (0, 1024)
    assert pythia.step_rows(97_000) == (97_000 * 1024, 97_001 * 1024)
    assert pythia.rows_seen(0) == (0, 0)
    assert pythia.rows_seen(143_000) == (0, 143_000 * 1024)
    assert pythia.row_step(0) == (0, 0)
    assert pythia.row_step(1023) == (0, 1023) and pythia.row_step(1024) == (1, 0)
    assert pythia.row_step(98_500 * 1024 - 1) == (98_499, 1023)
    assert pythia.steps_in_data(143_000 * 1024 + 5) == 143_000
    assert pythia.ROW_LEN == 2049 and pythia.EPOCH_END_STEP == 98_500


def test_rows_for_given_steps_across_shard_boundary(pdata):
    ds, _, _ = pdata
    lo, hi = pythia.step_rows(1, B)  # rows 4..7: row 5 straddles the shards
    got = ds.get_rows(range(lo, hi))
    np.testing.assert_array_equal(got, np.stack([row_values(i) for i in range(4, 8)]))


# ----------------------------------------------------------------------------------------------- drawing

def test_draw_ranges_cover_both_ends(pdata):
    ds, _, _ = pdata
    S, G, E = 5, 1, 10
    # ask for every row of each range: both ends of both ranges must be drawn
    h, ex = pythia.draw_checkpoint_split(ds, S, (S - G) * B, (E - S - G) * B, seed=3, gap=G, end_step=E, batch_size=B)
    mem = sorted(e["index"] for e in ex if e["label"] == 1)
    non = sorted(e["index"] for e in ex if e["label"] == 0)
    assert mem == list(range(0, (S - G) * B))
    assert non == list(range((S + G) * B, E * B))
    assert h["params"]["member_steps"] == [0, 4] and h["params"]["nonmember_steps"] == [6, 10]
    assert h["counts"]["members"] == 16 and h["counts"]["nonmembers"] == 16
    for e in ex:
        assert e["index"] == e["step"] * B + e["batch_pos"]
        assert e["tokens"] == row_values(e["index"]).tolist()
        assert e["id"] == f"row{e['index']}" and e["partition"] == "eval"
    assert h["source"]["kind"] == "pythia" and len(h["source"]["bin"]) == 2
    assert h["source"]["idx"]["hash_scope"] == "full" and len(h["source"]["idx"]["sha256"]) == 64


def test_draw_is_seeded_and_without_replacement(pdata):
    ds, _, _ = pdata
    a = pythia.draw_checkpoint_split(ds, 6, 10, 10, seed=1, end_step=12, batch_size=B)[1]
    b = pythia.draw_checkpoint_split(ds, 6, 10, 10, seed=1, end_step=12, batch_size=B)[1]
    c = pythia.draw_checkpoint_split(ds, 6, 10, 10, seed=2, end_step=12, batch_size=B)[1]
    ia, ic = [e["index"] for e in a], [e["index"] for e in c]
    assert ia == [e["index"] for e in b] and ia != ic and len(set(ia)) == 20


@pytest.mark.parametrize("kw,msg", [
    (dict(step=13, end_step=12), "step 13 is past the data: 48 rows hold 12 steps of 4"),
    (dict(step=5, end_step=13), r"non-member range \[5, 13\) crosses the end of the data"),
    (dict(step=10, gap=2, end_step=12), r"non-member range \[12, 12\) is empty or crosses the epoch end 12"),
    (dict(step=5, end_step=98_500), "crosses the end of the data"),
    (dict(step=5, gap=1, end_step=12, n_members=17), r"asked for 17 members .* hold only 16"),
    (dict(step=5, gap=1, end_step=7, n_nonmembers=5), r"asked for 5 non-members .* hold only 4"),
    (dict(step=1, gap=1, end_step=12), r"member range \[0, 0\) is empty"),
])
def test_draw_errors(pdata, kw, msg):
    ds, _, _ = pdata
    args = dict(n_members=2, n_nonmembers=2, seed=0, batch_size=B)
    args.update(kw)
    step = args.pop("step")
    with pytest.raises(SplitError, match=msg):
        pythia.draw_checkpoint_split(ds, step, **args)


# -------------------------------------------------------------------------------------------- partitions

def test_partitions_disjoint_seeded_and_checked():
    assert parse_partitions("train=4000,calib=500,eval=1000") == {"train": 4000, "calib": 500, "eval": 1000}
    assert parse_partitions("train=3, eval=rest") == {"train": 3, "eval": "rest"}
    for bad, msg in (("train", "expected NAME=COUNT"), ("a=x", "integer or 'rest'"), ("a=1,a=2", "given twice"),
                     ("a=rest,b=rest", "at most one")):
        with pytest.raises(SplitError, match=msg):
            parse_partitions(bad)
    ex = [{"id": str(i), "label": int(i < 10)} for i in range(20)]
    assign_partitions(ex, "train=6,calib=1,eval=3", seed=5)
    for lab in (0, 1):
        got = [e["partition"] for e in ex if e["label"] == lab]
        assert got.count("train") == 6 and got.count("calib") == 1 and got.count("eval") == 3
    ex2 = [{"id": str(i), "label": int(i < 10)} for i in range(20)]
    assign_partitions(ex2, "train=6,calib=1,eval=3", seed=5)
    assert [e["partition"] for e in ex] == [e["partition"] for e in ex2]
    with pytest.raises(SplitError, match="need 11 per class but 10 non-members were drawn"):
        assign_partitions(ex, "train=10,eval=1", seed=0)
    with pytest.raises(SplitError, match="need 9"):
        assign_partitions(ex, "train=9", seed=0)


def test_assert_disjoint_by_id_tokens_and_text():
    from mia.attacks import AttackError, assert_disjoint

    ev = [{"id": "a", "tokens": [1, 2]}, {"id": "b", "tokens": [3, 4]}, {"id": "c", "text": "hello"}]
    assert_disjoint(ev, [{"id": "x", "tokens": [9]}, {"id": "y", "text": "other"}], "prefix")
    with pytest.raises(AttackError, match=r"ReCaLL prefix overlaps the evaluated examples \(1\): b$"):
        assert_disjoint(ev, [{"id": "b", "tokens": [7]}], "ReCaLL prefix")
    with pytest.raises(AttackError, match=r"\(1\): a$"):
        assert_disjoint(ev, [{"id": "z", "tokens": [1, 2]}], "CAMIA calibration")
    with pytest.raises(AttackError, match=r"\(1\): c$"):
        assert_disjoint(ev, [{"id": "t", "text": "hello"}], "prefix")
    with pytest.raises(AttackError, match=r"\(2\): a, c$"):  # tokens and text under other ids at once
        assert_disjoint(ev, [{"id": "t", "text": "hello"}, {"id": "u", "tokens": [1, 2], "text": "x"}], "prefix")


# ------------------------------------------------------------------------------------------------ check

def _draw_to(tmp_path, ds, **kw):
    args = dict(n_members=6, n_nonmembers=6, seed=0, gap=1, end_step=10, batch_size=B, partitions="train=4,eval=2")
    args.update(kw)
    h, ex = pythia.draw_checkpoint_split(ds, 5, **args)
    p = tmp_path / "split.jsonl"
    write_split(p, h, ex)
    return p


def _edit(path, lineno, fn):
    lines = path.read_text().splitlines()
    obj = json.loads(lines[lineno - 1])
    fn(obj)
    lines[lineno - 1] = json.dumps(obj)
    path.write_text("\n".join(lines) + "\n")


def test_drawn_split_rereads_clean(tmp_path, pdata):
    p = _draw_to(tmp_path, pdata[0])
    assert check_split(p) == []
    s = read_split(p)
    assert s.header["format"] == "mia-split/1" and len(s.partition("train")) == 8


def test_tampered_token_fails_naming_the_line(tmp_path, pdata):
    p = _draw_to(tmp_path, pdata[0])
    _edit(p, 4, lambda o: o["tokens"].__setitem__(2, o["tokens"][2] + 1))
    probs = check_split(p)
    assert probs == [
        "line 4: row differs from its row_sha256 (id, label, partition, text or tokens edited after the "
        "split was written)",
        "line 4: tokens differ from row %d of the data (first at position 2)"
        % json.loads(p.read_text().splitlines()[3])["index"],
    ]


def test_member_moved_into_nonmember_range_fails(tmp_path, pdata):
    p = _draw_to(tmp_path, pdata[0])
    moved = 7 * B + 1  # step 7: non-member range [6, 10)

    def move(o):
        assert o["label"] == 1
        o.update(index=moved, step=7, batch_pos=1, tokens=row_values(moved).tolist(), id=f"row{moved}")
    lines = p.read_text().splitlines()
    taken = {json.loads(x)["index"] for x in lines[1:]}
    assert moved not in taken
    _edit(p, 2, move)
    probs = check_split(p)
    assert any(x.startswith("line 2: member row 29 is at step 7, outside the member steps [0, 4)") for x in probs), (
        probs
    )


def test_check_reports_duplicates_counts_and_sources(tmp_path, pdata):
    p = _draw_to(tmp_path, pdata[0])
    lines = p.read_text().splitlines()
    # duplicate line (same id, same row), wrong label value
    p.write_text("\n".join(lines + [lines[1]]) + "\n")
    probs = check_split(p)
    assert any("line 14: id" in x and "already used on line 2" for x in probs)
    assert any(x.startswith("line 1: header counts members=6 but the file has 7") for x in probs)
    # source file changed after drawing
    p2 = _draw_to(tmp_path, pdata[0])
    with open(pdata[1][1], "r+b") as f:
        f.seek(10)
        f.write(b"\xff\xff")
    probs = check_split(p2)
    assert any("sha256 (full) differs" in x for x in probs)


def test_check_reports_identical_rows_across_classes(tmp_path):
    rows = [np.full(L, i % 3) for i in range(B * STEPS)]  # only three distinct rows
    write_indexed(tmp_path / "dup", rows)
    ds = IndexedDataset(tmp_path / "dup")
    p = _draw_to(tmp_path, ds, partitions=None)
    probs = check_split(p)
    assert probs and all("non-member has the same tokens as member on line" in x for x in probs)
    assert probs[0].startswith("line ")


# --------------------------------------------------------------------------------------------------- CLI

def test_cli_pythia_shards_and_check(tmp_path, pdata, capsys):
    _, bins, idx = pdata
    out = tmp_path / "cli.jsonl"
    argv = ["split", "pythia"] + sum((["--data", b] for b in bins), []) + [
        "--idx", idx, "--steps", "5", "--gap", "1", "--end-step", "10", "--batch-size", str(B),
        "--seed", "7", "--partition", "train=3,calib=1,eval=2", "--out", str(out)]
    assert run_cli(argv) == 0
    assert "6 members, 6 non-members" in capsys.readouterr().out
    s = read_split(out)
    assert s.header["params"]["seed"] == 7 and sorted(s.header["partitions"]) == ["calib", "eval", "train"]
    assert run_cli(["split", "check", str(out)]) == 0
    _edit(out, 3, lambda o: o.__setitem__("label", 1 - o["label"]))
    assert run_cli(["split", "check", str(out)]) == 1
    assert "line 3:" in capsys.readouterr().out


def test_cli_errors_are_value_errors(tmp_path, pdata):
    _, bins, idx = pdata
    with pytest.raises(ValueError, match="give --n-members"):
        run_cli(["split", "pythia", "--data", bins[0], "--idx", idx, "--steps", "3", "--out", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="crosses the end of the data"):
        run_cli(["split", "pythia", "--data", bins[0], "--data", bins[1], "--idx", idx, "--steps", "3",
                 "--n-members", "1", "--n-nonmembers", "1", "--batch-size", "4", "--out", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="pass the single .idx"):
        run_cli(["split", "pythia", "--data", bins[0], bins[1], "--steps", "3",
                 "--n-members", "1", "--n-nonmembers", "1", "--out", str(tmp_path / "x")])


def test_check_reports_same_content_in_two_partitions(tmp_path):
    from mia.data.splits import write_split
    ex = [{"id": "a", "label": 1, "partition": "prefix", "text": "same"},
          {"id": "b", "label": 1, "partition": "eval", "text": "same"},
          {"id": "c", "label": 0, "partition": "eval", "text": "other"}]
    p = write_split(tmp_path / "t.jsonl", {"source": {"kind": "text"}}, ex)
    assert check_split(p) == ["line 3: same text as line 2 but in partition 'eval' vs 'prefix'"]


def test_read_write_roundtrip_drops_line_numbers(tmp_path, pdata):
    p = _draw_to(tmp_path, pdata[0])
    s = read_split(p, compact_tokens=True)
    assert isinstance(s.examples[0]["tokens"], np.ndarray)
    q = write_split(tmp_path / "again.jsonl", s.header, s.examples)
    assert "_line" not in q.read_text() and check_split(q) == []
