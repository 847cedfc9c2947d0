"""`mia split check` verifies everything a split claims, and the Megatron / OLMo readers stop bad
files with one `error:` line naming the file (exit 2). Each issue example is a test here: a widened member range, a
changed checkpoint step, a flipped label or edited text, a wrong .idx dtype code, shards in the wrong order."""
import json
import struct

import numpy as np
import pytest

from mia.cli import main as mia_main
from mia.data import pythia
from mia.data.indexed import IndexedDataError, IndexedDataset
from mia.data.splits import read_split, write_split
from mia.data.verify import check_split, verify_split

from order_files import SEQ, B, L, make_files, make_order, raw_pythia, row_values

HASH_EDIT = "row differs from its row_sha256"


def draw(tmp_path, vocab_size=65536, name="split.jsonl", **kw):
    bins, idx = raw_pythia(tmp_path, cut=5 * L * 2 + 3)
    args = dict(n_members=6, n_nonmembers=6, seed=0, gap=1, end_step=10, batch_size=B, partitions="train=4,eval=2",
                vocab_size=vocab_size)
    args.update(kw)
    h, ex = pythia.draw_checkpoint_split(IndexedDataset(bins, idx_path=idx), 5, **args)
    return write_split(tmp_path / name, h, ex), bins, idx


def edit_line(path, lineno, fn):
    """Edit line ``lineno`` (1 = header) as a hand edit would: the rest of the line, row_sha256 included, kept."""
    lines = path.read_text().splitlines()
    obj = json.loads(lines[lineno - 1])
    fn(obj)
    lines[lineno - 1] = json.dumps(obj)
    path.write_text("\n".join(lines) + "\n")


def cli(argv, capsys):
    capsys.readouterr()
    code = mia_main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def text_split(tmp_path):
    src = tmp_path / "bench.jsonl"
    src.write_text("".join(json.dumps({"text": f"text number {i}", "label": i % 2}) + "\n" for i in range(8)))
    from mia.data.text import build_text_split, load_generic

    ex, files = load_generic(src)
    h, out = build_text_split(ex, files, {"format": "generic"}, seed=0, partitions="prefix=1,eval=rest")
    return write_split(tmp_path / "text.jsonl", h, out)


# ----------------------------------------------------------------------------------------------- header

def test_clean_split_with_vocab_is_fully_verified(tmp_path, capsys):
    p, _, _ = draw(tmp_path)
    report = verify_split(p)
    assert report.problems == [] and report.not_verified == []
    assert cli(["split", "check", str(p)], capsys)[:2] == (0, f"{p}: ok\n")


def test_widened_member_range_in_header_is_caught(tmp_path):
    p, _, _ = draw(tmp_path)
    edit_line(p, 1, lambda h: h["params"].update(member_steps=[0, 6], member_rows=[0, 6 * B]))
    probs = check_split(p)
    assert (
        "line 1: header params.member_steps is [0, 6] but step 5, gap 1, end_step 10 and batch_size 4 give [0, 4]"
        in probs
    )
    assert (
        "line 1: header params.member_rows is [0, 24] but step 5, gap 1, end_step 10 and batch_size 4 give [0, 16]"
        in probs
    )


def test_changed_checkpoint_step_is_caught(tmp_path):
    p, _, _ = draw(tmp_path)
    edit_line(p, 1, lambda h: h["params"].update(step=6))
    probs = check_split(p)
    assert "line 1: header differs from its header_sha256 (edited after the split was written)" in probs
    assert any(x.startswith("line 1: header params.member_steps is [0, 4] but step 6, gap 1") for x in probs), probs
    assert (
        "line 1: header params.revision is 'step5' but step 6, gap 1, end_step 10 and batch_size 4 give 'step6'"
        in probs
    )


def test_consistently_forged_step_is_caught_by_the_redraw(tmp_path):
    """Every derived field moved with the step: the rows are still in the (wider) claimed ranges, but they are
    not the rows the header's seed draws."""
    p, _, _ = draw(tmp_path)
    edit_line(
        p, 1, lambda h: h["params"].update(step=6, **{k: v for k, v in pythia.expected_params(6, 1, 10, B).items()})
    )
    probs = check_split(p)
    assert probs and not any("header params." in x for x in probs)
    assert any("position" in x and "is not one the header's draw gives (seed 0, step 6, gap 1" in x for x in probs), (
        probs
    )


def test_row_replaced_by_another_in_range_row_is_caught_by_the_redraw(tmp_path):
    p, _, _ = draw(tmp_path)
    s = read_split(p)
    taken = {e["index"] for e in s.examples}
    new = next(i for i in range(4 * B) if i not in taken)  # a member row the draw did not pick
    ex = [dict(e) for e in s.examples]
    first = next(k for k, e in enumerate(ex) if e["label"] == 1)
    ex[first].update(index=new, step=new // B, batch_pos=new % B, id=f"row{new}", tokens=row_values(new).tolist())
    q = write_split(tmp_path / "again.jsonl", s.header, ex)  # row hashes rewritten: only the redraw can tell
    assert check_split(q) == [
        f"line {first + 2}: member position {new} is not one the header's draw gives (seed 0, step 5, gap 1, "
        f"end_step 10, batch 4)",
        f"line 1: 1 of the 6 member positions the header's draw gives (seed 0, step 5, gap 1, end_step 10, batch 4) "
        f"are not in the file, e.g. {s.examples[first]['index']}"]


def test_edited_text_split_header_is_caught(tmp_path):
    p = text_split(tmp_path)
    edit_line(p, 1, lambda h: h["params"].update(seed=1))
    assert check_split(p) == ["line 1: header differs from its header_sha256 (edited after the split was written)"]


def test_header_fields_of_the_wrong_type_are_problems_not_crashes(tmp_path):
    p, _, _ = draw(tmp_path)
    edit_line(p, 1, lambda h: h.update(partitions=[1], counts="many") or h["params"].update(step="5"))
    probs = check_split(p)
    assert "line 1: header field 'partitions' is list, expected an object" in probs
    assert "line 1: header params.step is '5', expected a non-negative integer" in probs


# -------------------------------------------------------------------------------------------------- rows

def test_flipped_label_and_edited_text_in_a_text_split_are_caught(tmp_path):
    p = text_split(tmp_path)
    assert check_split(p) == []
    edit_line(p, 2, lambda o: o.update(label=1 - o["label"]))
    edit_line(p, 4, lambda o: o.update(text=o["text"] + "!"))
    edit_line(p, 5, lambda o: o.update(partition="prefix" if o["partition"] == "eval" else "eval"))
    probs = check_split(p)
    for ln in (2, 4, 5):
        assert (
            f"line {ln}: {HASH_EDIT} (id, label, partition, text or tokens edited after the split was written)" in probs
        )
    assert any(x.startswith("line 1: header counts") for x in probs)  # the label flip also moves the counts


def test_row_added_by_hand_is_caught(tmp_path):
    p = text_split(tmp_path)
    with open(p, "a") as f:
        f.write(json.dumps({"id": "extra", "label": 0, "partition": "eval", "text": "new"}) + "\n")
    assert "line 10: no row_sha256 though the other rows have one (a row added by hand?)" in check_split(p)


def test_old_split_without_new_fields_lists_what_it_could_not_verify(tmp_path, capsys):
    p, _, _ = draw(tmp_path, vocab_size=None)
    lines = p.read_text().splitlines()
    objs = [json.loads(x) for x in lines]
    objs[0].pop("header_sha256")
    for r in objs[1:]:
        r.pop("row_sha256")
    p.write_text("\n".join(json.dumps(o) for o in objs) + "\n")
    code, out, _ = cli(["split", "check", str(p)], capsys)
    assert code == 0 and "ok" not in out.split()
    assert out.splitlines() == [
        f"{p}: not verified: header: no header_sha256 (written before header hashes): fields that follow from no "
        "other field (seed, source notes, text-split parameters) are not checked against an edit",
        f"{p}: not verified: rows: no row_sha256 (written before row hashes): edits of ids, labels, partitions and "
        "texts are not detectable from the file itself",
        f"{p}: not verified: tokens: ids not checked against a vocabulary (the header records no vocab_size; give "
        "--model DIR or --vocab-size N)",
        f"{p}: no problem found, but 3 verification(s) could not be done (listed above)"]
    # the vocabulary given to check verifies the ids (and finds those past a smaller one)
    assert cli(["split", "check", str(p), "--vocab-size", "65536"], capsys)[1].count("not verified") == 2
    code, out, _ = cli(["split", "check", str(p), "--vocab-size", "100"], capsys)
    assert code == 1 and "outside the vocabulary (100 ids)" in out


# ------------------------------------------------------------------------------------- dtype and shards

def set_idx_code(idx, code):
    with open(idx, "r+b") as f:
        f.seek(17)
        f.write(struct.pack("<B", code))


@pytest.mark.parametrize("code,msg", [
    (1, r"rows end at byte 570 \(Megatron writes no bytes past the last row\); the \.idx declares dtype uint8 \(code "
        r"1\)"),
    (4, r"the last row ends at byte 588; the \.idx declares dtype int32 \(code 4\)"),
    (3, r"document\.idx: row \d+ token \d+ is id -\d+ read as int16 \(dtype code 3\): negative ids"),
    (9, r"document\.idx: unknown dtype code 9"),
])
def test_wrong_dtype_code_refused_at_draw(tmp_path, capsys, code, msg):
    bins, idx = raw_pythia(tmp_path, cut=5 * L * 2 + 3)
    set_idx_code(idx, code)
    argv = ["split", "pythia", "--data", *bins, "--idx", idx, "--steps", "5", "--end-step", "10", "--batch-size",
            str(B), "--n-members", "6", "--n-nonmembers", "6", "--out", str(tmp_path / "x.jsonl")]
    code_, out, err = cli(argv, capsys)
    assert code_ == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    import re
    assert re.search(msg, err), err
    assert not (tmp_path / "x.jsonl").exists()


def test_float_dtype_code_refused(tmp_path):
    from mia.data.indexed import write_indexed

    write_indexed(tmp_path / "f", [np.arange(L) + i for i in range(B * 12)], dtype=np.int32)
    set_idx_code(tmp_path / "f.idx", 6)  # float32: same item size, so the layout still fits
    with pytest.raises(ValueError, match=r"f\.idx: dtype code 6 \(float32\) is not an integer dtype"):
        pythia.draw_checkpoint_split(IndexedDataset(tmp_path / "f"), 5, 1, 1, seed=0, end_step=10, batch_size=B)


def test_dtype_code_changed_after_the_draw_is_caught(tmp_path):
    p, _, idx = draw(tmp_path, vocab_size=None)
    set_idx_code(idx, 3)  # int16: same size, ids > 32767 read negative
    probs = check_split(p)
    assert any("document.idx: sha256 (full) differs from the header" in x for x in probs)
    assert "line 1: header source.dtype 'uint16' but document.idx declares int16" in probs
    assert any("read as int16: negative (the .idx declares int16: a wrong dtype code?)" in x for x in probs), probs


def test_shards_in_the_wrong_order(tmp_path, capsys):
    bins, idx = raw_pythia(tmp_path, cut=5 * L * 2 + 3)
    argv = ["split", "pythia", "--data", bins[1], bins[0], "--idx", idx, "--steps", "5", "--end-step", "10",
            "--batch-size", str(B), "--n-members", "6", "--n-nonmembers", "6", "--out", str(tmp_path / "x.jsonl")]
    code, _, err = cli(argv, capsys)
    assert (code, err) == (2, f"error: {bins[0]}: shard given after {bins[1]} but numbered before "
                              "or equal to it: shards are read as one byte stream in the order given, so they must "
                              "be in numbered order\n")
    # a split drawn before this check with the shards swapped: check names it
    (tmp_path / "d").mkdir()
    p, _, _ = draw(tmp_path / "d")
    edit_line(p, 1, lambda h: h["source"].update(bin=h["source"]["bin"][::-1]))
    assert any("cannot open sources" in x and "numbered order" in x for x in check_split(p))


# ------------------------------------------------------------------------------------------ file readers

def test_truncated_idx_and_bin_are_one_error_line(tmp_path, capsys):
    bins, idx = raw_pythia(tmp_path)
    base = ["split", "pythia", "--data", bins[0], "--idx", idx, "--steps", "5", "--end-step", "10", "--batch-size",
            str(B), "--n-members", "1", "--n-nonmembers", "1", "--out", str(tmp_path / "x.jsonl")]
    data = open(idx, "rb").read()
    for cut, msg in ((len(data) - 3, "document.idx: index is"), (30, "document.idx: truncated header"),
                     (5, "document.idx: not a Megatron MMIDIDX index")):
        open(idx, "wb").write(data[:cut])
        code, _, err = cli(base, capsys)
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and msg in err, err
    open(idx, "wb").write(data)
    with open(bins[0], "r+b") as f:
        f.truncate(B * L * 2 * 12 - 7)
    code, _, err = cli(base, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "document-00000-of-00000.bin: .bin is" in err, err


def test_row_span_outside_the_data_is_an_error(tmp_path):
    bins, idx = raw_pythia(tmp_path)
    with open(idx, "r+b") as f:  # pointer of row 3 far past the data
        f.seek(34 + 4 * B * 12 + 8 * 3)
        f.write(struct.pack("<q", 10**12))
    with pytest.raises(IndexedDataError, match=r"document\.idx: row 3 spans bytes \[1000000000000, "):
        IndexedDataset(bins[0], idx_path=idx)[3]


@pytest.mark.parametrize("dtype,msg", [("float32", "is float32, not an integer dtype"),
                                       ("nonsense", "is not a numpy dtype")])
def test_bad_olmo_token_dtype(tmp_path, capsys, dtype, msg):
    _, inst = make_files(tmp_path)
    make_order(tmp_path, len(inst))
    code, _, err = cli(["split", "olmo", "--global-indices", str(tmp_path / "global_indices.npy"), "--data-paths",
                        str(tmp_path / "paths.txt"), "--steps", "2", "--batch-size", "3", "--seq-len", str(SEQ),
                        "--n-members", "1", "--n-nonmembers", "1", "--token-dtype", dtype,
                        "--out", str(tmp_path / "o.jsonl")], capsys)
    assert (
        code == 2 and len(err.splitlines()) == 1 and err.startswith(f"error: --token-dtype {dtype!r} ") and msg in err
    ), err


def test_olmo_global_indices_out_of_range(tmp_path, capsys):
    _, inst = make_files(tmp_path)
    gi = make_order(tmp_path, len(inst))
    gi[gi == 0] = 4_000_000_000  # one entry past the instances
    gi.tofile(tmp_path / "global_indices.npy")
    code, _, err = cli(["split", "olmo", "--global-indices", str(tmp_path / "global_indices.npy"), "--data-paths",
                        str(tmp_path / "paths.txt"), "--steps", "3", "--batch-size", "3", "--seq-len", str(SEQ),
                        "--n-members", "9", "--n-nonmembers", "0", "--out", str(tmp_path / "o.jsonl")], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "global_indices.npy: position" in err and "holds instance 4000000000, but the token files hold 12" in err


def test_olmo_split_is_fully_verified_and_redrawn(tmp_path, capsys):
    _, inst = make_files(tmp_path)
    make_order(tmp_path, len(inst))
    out = tmp_path / "o.jsonl"
    base = ["split", "olmo", "--global-indices", str(tmp_path / "global_indices.npy"), "--data-paths",
            str(tmp_path / "paths.txt"), "--steps", "2", "--nonmember-start", "3", "--batch-size", "3", "--seq-len",
            str(SEQ), "--seed", "3", "--vocab-size", "50304", "--n-members", "2", "--n-nonmembers", "2"]
    assert cli(base + ["--out", str(out)], capsys)[0] == 0
    assert cli(["split", "check", str(out)], capsys)[:2] == (0, f"{out}: ok\n")
    edit_line(out, 1, lambda h: h["params"].update(seed=4))
    probs = check_split(out)
    assert probs.pop(0) == "line 1: header differs from its header_sha256 (edited after the split was written)"
    assert probs and all("is not one the header's draw gives" in x or "are not in the file" in x for x in probs), probs
