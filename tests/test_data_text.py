"""Local text benchmarks (MIMIR, WikiMIA, generic) -> split files; n-gram overlap filter; CLI."""
import argparse
import json

import pytest

from mia.data import text
from mia.data.cli import add_split_parser
from mia.data.splits import SplitError, read_split
from mia.data.verify import check_split


def run_cli(argv):
    ap = argparse.ArgumentParser(prog="mia")
    add_split_parser(ap.add_subparsers(dest="command"))
    args = ap.parse_args(argv)
    return args.func(args)


def words(k, n=20, base="w"):
    return " ".join(f"{base}{(k * 7 + i) % 97}" for i in range(n))


def test_wikimia_jsonl(tmp_path):
    p = tmp_path / "wikimia.jsonl"
    p.write_text("\n".join(json.dumps({"input": f"event {i}", "label": i % 2}) for i in range(6)) + "\n")
    ex, files = text.load_wikimia(p)
    assert [e["label"] for e in ex] == [0, 1, 0, 1, 0, 1] and ex[3] == {"id": "3", "text": "event 3", "label": 1}
    assert files == [p]


@pytest.mark.parametrize("name, content, message", [
    ("w.txt", b"", "the file is empty"),
    ("w.jsonl", b"", "the file is empty"),
    ("w.jsonl", b"\n  \n", "the file is empty"),
    ("w.csv", b"", "the file is empty"),
    ("w.json", b"", "the file is empty"),
    ("w.jsonl", b'"a text"\n"b \xff c"\n', ":2: not valid UTF-8"),
])
def test_empty_or_undecodable_text_file_is_one_line_naming_it(name, content, message, tmp_path, capsys):
    """An empty (or blank) file or a JSONL line that is not UTF-8: one ``error:`` line naming the file, not
    ``StopIteration`` or a bare codec error."""
    from mia.cli import main

    (tmp_path / name).write_bytes(content)
    with pytest.raises(text.TextDataError, match=message) as e:
        text.load_wikimia(tmp_path / name)
    assert str(tmp_path / name) in str(e.value)
    capsys.readouterr()
    assert main(["split", "text", "--format", "wikimia", "--file", str(tmp_path / name), "--out",
                 str(tmp_path / "s.jsonl")]) == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and str(tmp_path / name) in lines[0], lines


def test_generic_csv_string_labels_and_ids(tmp_path):
    p = tmp_path / "g.csv"
    p.write_text("doc,body,is_member\nd1,hello there,member\nd2,general kenobi,non-member\nd3,x,true\n")
    ex, _ = text.load_generic(p, text_column="body", label_column="is_member", id_column="doc")
    assert [(e["id"], e["label"]) for e in ex] == [("d1", 1), ("d2", 0), ("d3", 1)]
    with pytest.raises(SplitError, match="no label column 'label'"):
        text.load_generic(p, text_column="body")
    with pytest.raises(SplitError, match="no column 'text'"):
        text.load_generic(p, label_column="is_member")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "a", "label": "maybe"}) + "\n")
    with pytest.raises(SplitError, match="b.jsonl row 0: label 'maybe' is not"):
        text.load_generic(tmp_path / "b.jsonl")
    with pytest.raises(SplitError, match="local file not found"):
        text.load_generic("org/some-hub-dataset")
    (tmp_path / "x.xlsx").write_text("")
    with pytest.raises(SplitError, match="unsupported file type"):
        text.load_generic(tmp_path / "x.xlsx")


def test_mimir_table_and_two_files(tmp_path):
    import pandas as pd

    d = tmp_path / "mimir" / "arxiv"
    d.mkdir(parents=True)
    pd.DataFrame({"member": ["m0", "m1"], "nonmember": ["n0", "n1"]}).to_parquet(d / "ngram_13_0.8.parquet")
    (tmp_path / "mimir" / "github").mkdir()
    pd.DataFrame({"member": ["g"], "nonmember": ["h"]}).to_parquet(
        tmp_path / "mimir" / "github" / "ngram_13_0.8.parquet"
    )
    ex, files = text.load_mimir(file=tmp_path / "mimir", domain="arxiv")
    assert [(e["id"], e["text"], e["label"]) for e in ex] == [
        ("member-0", "m0", 1), ("member-1", "m1", 1), ("nonmember-0", "n0", 0), ("nonmember-1", "n1", 0)]
    assert len(files) == 1
    (tmp_path / "mem.json").write_text(json.dumps(["a b", "c d"]))  # MIMIR cache: JSON list of strings
    (tmp_path / "non.txt").write_text("e f\ng h\ni j\n")
    ex, files = text.load_mimir(member=tmp_path / "mem.json", nonmember=tmp_path / "non.txt")
    assert sum(e["label"] for e in ex) == 2 and len(ex) == 5 and len(files) == 2
    with pytest.raises(SplitError, match="needs --file TABLE, or both"):
        text.load_mimir(member=tmp_path / "mem.json")


def test_ngram_filter_counts():
    members = [words(0, 40), words(1, 40)]
    nonmembers = [
        {"id": "copy", "text": words(0, 30)},                        # fully inside member 0
        {"id": "fresh", "text": words(0, 30, base="z")},             # no overlap
        {"id": "short", "text": "w0 w7"},                            # fewer than 13 words: kept
        {"id": "half", "text": words(0, 20) + " " + words(0, 20, base="q")},  # 8 of 28 13-grams in members
    ]
    kept, dropped = text.ngram_filter(nonmembers, members, n=13, threshold=0.8)
    assert dropped == 1 and [k["id"] for k in kept] == ["fresh", "short", "half"]
    ref = text.ngram_set(members, 13)
    assert text.ngram_overlap(nonmembers[3], ref, 13) == pytest.approx(8 / 28)
    kept, dropped = text.ngram_filter(nonmembers, members, n=13, threshold=0.2)
    assert dropped == 2
    # exactly at the threshold is kept (drop only when the fraction exceeds it)
    kept, dropped = text.ngram_filter(nonmembers, members, n=13, threshold=8 / 28)
    assert dropped == 1
    # token lists use token n-grams
    kept, dropped = text.ngram_filter([[1, 2, 3], [4, 5, 6]], [[1, 2, 3, 9]], n=2, threshold=0.5)
    assert kept == [[4, 5, 6]] and dropped == 1


def test_cli_text_wikimia_with_partitions_and_filter(tmp_path, capsys):
    p = tmp_path / "w.jsonl"
    rows = [{"input": words(i, 20), "label": 1} for i in range(10)]
    rows += [{"input": words(i, 20, base="n"), "label": 0} for i in range(9)]
    rows += [{"input": words(3, 20), "label": 0}]  # a non-member copy of a member
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "s.jsonl"
    assert run_cli(["split", "text", "--format", "wikimia", "--file", str(p), "--ngram-filter", "13:0.8",
                    "--partition", "prefix=2,eval=rest", "--n-members", "8", "--n-nonmembers", "8",
                    "--seed", "1", "--out", str(out)]) == 0
    assert "dropped 1 non-members" in capsys.readouterr().out
    s = read_split(out)
    assert s.header["source"]["kind"] == "text" and s.header["params"]["ngram_filter"]["dropped"] == 1
    assert s.header["partitions"] == {
        "prefix": {"members": 2, "nonmembers": 2},
        "eval": {"members": 6, "nonmembers": 6},
    } or s.header["partitions"] == {"eval": {"members": 6, "nonmembers": 6}, "prefix": {"members": 2, "nonmembers": 2}}
    assert all(e["step"] is None and e["index"] is None and "text" in e for e in s.examples)
    assert run_cli(["split", "check", str(out)]) == 0
    # a tampered text split: duplicate text across classes is reported
    lines = out.read_text().splitlines()
    a, b = (
        json.loads(lines[1]),
        next(
            json.loads(x)
            for x in lines[1:]
            if json.loads(x)["label"] == 0 and json.loads(x)["partition"] == json.loads(lines[1])["partition"]
        ),
    )
    k = next(i for i, x in enumerate(lines) if json.loads(x).get("id") == b["id"])
    b["text"] = a["text"]
    lines[k] = json.dumps(b)
    out.write_text("\n".join(lines) + "\n")
    probs = check_split(out, verify_hashes=False)
    assert probs == [f"line {k + 1}: row differs from its row_sha256 (id, label, partition, text or tokens edited "
                     "after the split was written)", f"line {k + 1}: non-member has the same text as member on line 2"]
    with pytest.raises(ValueError, match="asked for 11 members but the files hold only 10"):
        run_cli(["split", "text", "--format", "wikimia", "--file", str(p), "--ngram-filter", "13:0.8", "--n-members",
                 "11", "--out", str(out)])
    # without the filter the copy is one text under both labels: refused when the split is made, whatever is drawn
    with pytest.raises(ValueError, match=r"w.jsonl \(id '19', label 0\): the same text as .*w.jsonl \(id '3', label "
                                         r"1\): one input cannot be both a member and a non-member"):
        run_cli(["split", "text", "--format", "wikimia", "--file", str(p), "--n-members", "2", "--out", str(out)])


def test_cli_text_generic_and_mimir(tmp_path):
    p = tmp_path / "g.jsonl"
    p.write_text("\n".join(json.dumps({"t": f"x{i}", "y": bool(i % 2), "k": f"id{i}"}) for i in range(4)) + "\n")
    out = tmp_path / "g_split.jsonl"
    assert run_cli(["split", "text", "--format", "generic", "--file", str(p), "--text-column", "t",
                    "--label-column", "y", "--id-column", "k", "--out", str(out)]) == 0
    s = read_split(out)
    assert [e["id"] for e in s.examples] == ["id1", "id3", "id0", "id2"]
    (tmp_path / "m.jsonl").write_text(json.dumps({"text": "mm"}) + "\n")
    (tmp_path / "n.jsonl").write_text(json.dumps({"text": "nn"}) + "\n")
    assert run_cli(["split", "text", "--format", "mimir", "--member", str(tmp_path / "m.jsonl"), "--nonmember",
                    str(tmp_path / "n.jsonl"), "--out", str(out)]) == 0
    assert check_split(out) == []
    with pytest.raises(ValueError, match="bad --ngram-filter"):
        run_cli(["split", "text", "--format", "generic", "--file", str(p), "--ngram-filter", "x", "--out", str(out)])
