"""Data in every common form through one reader (``mia.data.sources.read_data``): JSONL, CSV, Parquet, a saved
``datasets`` directory, a list of dicts, a pandas DataFrame, a ``datasets.Dataset``. The readers are checked without
a model (same examples from every form; each bad input one line naming its row); one scoring pass on the tiny model
checks that every form gives the JSONL's scores."""
from __future__ import annotations

import json
import sys

import numpy as np
import pandas as pd
import pytest

from mia.data.examples import DataError
from mia.data.sources import check_data_path, parse_column_map, read_data

ROWS = [  # text and token rows, both classes, one unlabelled, a partition and a doc_id
    {"id": "a", "text": "def add(a, b):\n    return a + b\n", "label": 1, "partition": "eval", "doc_id": "d1"},
    {"id": "007", "tokens": [5, 6, 7, 8, 9], "label": 0, "partition": "eval", "doc_id": "d1"},
    {"id": "c", "text": "import json, \"quoted\", comma\n", "label": None, "partition": "eval", "doc_id": "d2"},
    {"id": "d", "text": "class Point:\n    x: int\n", "label": 0, "partition": "prefix", "doc_id": "d3"},
]


def _frame(rows) -> pd.DataFrame:
    return pd.DataFrame(rows)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _csv(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


def _forms(tmp_path, rows) -> dict:
    """The same rows in every form (name -> what read_data takes)."""
    import datasets

    df = _frame(rows)
    ds = datasets.Dataset.from_pandas(df, preserve_index=False)
    df.to_csv(tmp_path / "d.csv", index=False)
    df.to_parquet(tmp_path / "d.parquet", index=False)
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "saved"))
    return {"jsonl": _jsonl(tmp_path / "d.jsonl", rows), "records": rows, "dataframe": df, "dataset": ds,
            "datasetdict": datasets.DatasetDict({"test": ds}), "csv": tmp_path / "d.csv",
            "parquet": tmp_path / "d.parquet", "saved": tmp_path / "saved", "arrow": ds.data.table,
            "iterable": ds.to_iterable_dataset()}


def _fields(examples) -> list:
    return [(e.id, e.text, None if e.tokens is None else e.tokens.tolist(), e.label, e.partition, e.doc_id)
            for e in examples]


def test_every_form_gives_the_same_examples(tmp_path):
    want = [(r["id"], r.get("text"), r.get("tokens"), r["label"], r["partition"], r["doc_id"]) for r in ROWS]
    for name, data in _forms(tmp_path, ROWS).items():
        got = _fields(read_data(data))
        assert got == want, name
        assert all(isinstance(e.label, (int, type(None))) and not isinstance(e.label, bool)
                   for e in read_data(data)), name


def test_json_tsv_and_jsonl_names_give_the_same_examples(tmp_path):
    """.json (an array of row objects, or JSON Lines under that name), .tsv, .ndjson and a name without a suffix
    read as the JSONL does; other suffixes are refused listing the forms (no longer read as JSONL)."""
    base = _fields(read_data(_jsonl(tmp_path / "d.jsonl", ROWS)))
    (tmp_path / "a.json").write_text(json.dumps(ROWS, indent=2))
    pd.DataFrame(ROWS).to_csv(tmp_path / "d.tsv", sep="\t", index=False)
    forms = {"array": tmp_path / "a.json", "lines": _jsonl(tmp_path / "l.json", ROWS), "tsv": tmp_path / "d.tsv",
             "ndjson": _jsonl(tmp_path / "d.ndjson", ROWS), "no suffix": _jsonl(tmp_path / "data", ROWS)}
    for name, path in forms.items():
        assert _fields(read_data(path)) == base, name
    assert [e.source for e in read_data(tmp_path / "a.json")][:2] == [f"{tmp_path / 'a.json'}:row {i}" for i in (1, 2)]
    (tmp_path / "d.txt").write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(DataError, match=r"data .*d\.txt: unsupported file type '\.txt'; data can be \.jsonl \(or "
                                        r"\.ndjson, or no suffix\), \.json .*\.csv, \.tsv, \.parquet, or a directory"):
        read_data(tmp_path / "d.txt")
    with pytest.raises(ValueError, match=r"--data .*d\.txt: unsupported file type"):
        check_data_path(tmp_path / "d.txt", "--data")
    (tmp_path / "bad.tsv").write_text('text\tlabel\n"a\tb\t1\n')
    with pytest.raises(DataError, match=r"bad\.tsv:row 1: not valid TSV"):
        read_data(tmp_path / "bad.tsv")


def test_rows_are_named_in_each_form(tmp_path):
    forms = _forms(tmp_path, ROWS)
    assert [e.source for e in read_data(forms["csv"])][-1] == f"{tmp_path / 'd.csv'}:row 4"
    assert read_data(forms["parquet"])[0].source == f"{tmp_path / 'd.parquet'}:row 1"
    assert read_data(forms["dataframe"])[1].source == "data.iloc[1]"
    assert read_data(forms["dataset"])[2].source == "data[2]"
    assert read_data(forms["datasetdict"])[2].source == "data['test'][2]"
    assert read_data(forms["saved"])[0].source == f"{tmp_path / 'saved' / 'test'}:row 1"
    assert read_data(forms["arrow"])[3].source == "data[3]"
    assert read_data(forms["iterable"])[1].source == "data[1]"


def test_ids_are_optional_for_the_whole_source(tmp_path):
    rows = [{"text": "a b", "label": 1}, {"text": "c d", "label": 0}]
    for name, data in _forms(tmp_path, rows).items():
        assert [e.id for e in read_data(data)] == ["0", "1"], name
    assert [e.id for e in read_data(rows, id_prefix="prefix:")] == ["prefix:0", "prefix:1"]
    with pytest.raises(DataError, match=r"data\[1\]: field 'id' is missing \(data\[0\] has one"):
        read_data([{"id": "x", "text": "a b"}, {"text": "c d"}])
    with pytest.raises(DataError, match=r"d.csv:row 2: field 'id' is given, but .*d.csv:row 1 has none"):
        read_data(_csv(tmp_path / "d.csv", "id,text\n,a b\nx,c d\n"))


def test_column_map_renames_in_every_form(tmp_path):
    rows = [{"key": "a", "body": "a b", "is_member": 1, "text": "ignored"}, {"key": "b", "body": "c d", "is_member": 0,
                                                                            "text": "ignored"}]
    cmap = {"id": "key", "text": "body", "label": "is_member"}
    for name, data in _forms(tmp_path, rows).items():
        got = [(e.id, e.text, e.label) for e in read_data(data, column_map=cmap)]
        assert got == [("a", "a b", 1), ("b", "c d", 0)], name
    assert parse_column_map("text=body, label=is_member") == {"text": "body", "label": "is_member"}


@pytest.mark.parametrize("text, error", [
    ("text=body,label", "expected FIELD=COLUMN"),
    ("lable=x", "'lable' is not a field"),
    ("text=a,text=b", "'text' given twice"),
])
def test_columns_flag_spelling(text, error):
    with pytest.raises(DataError, match=error):
        parse_column_map(text)


def test_csv_cells(tmp_path):
    """Cells as written: ids stay text ("007"), a quoted cell keeps its commas and newlines, tokens are a JSON list,
    labels 0/1 also as floats, an empty cell or NaN label is a missing value (unlabelled), a long cell is read
    whole; a byte-order mark is not part of the first column."""
    long = "x" * 300_000
    path = _csv(tmp_path / "d.csv", "\ufeffid,text,tokens,label\n007,\"a, b\nc\",,1.0\n8,,\"[1, 2]\",0\n"
                                    f"9,{long},,\n10,e f,,nan\n")
    ex = read_data(path)
    assert _fields(ex) == [("007", "a, b\nc", None, 1, "eval", None), ("8", None, [1, 2], 0, "eval", None),
                           ("9", long, None, None, "eval", None), ("10", "e f", None, None, "eval", None)]


def _bad_csv(tmp_path, body):
    return _csv(tmp_path / "d.csv", body)


@pytest.mark.parametrize("body, error", [
    ("id,text,label\n1,a b,1\n2,c d,2\n", r"d.csv:row 2: field 'label' must be 0 or 1 \(1 = member\), got '2'"),
    ("id,text,label\n1,a b,0.5\n", r"d.csv:row 1: field 'label' must be 0 or 1 .*got '0.5'"),
    ("id,text,label\n1,a b,yes\n", r"d.csv:row 1: field 'label' must be 0 or 1 .*got 'yes'"),
    ("id,text,label\n1,a b,inf\n", r"d.csv:row 1: field 'label' must be 0 or 1"),
    ("id,tokens\n1,1 2 3\n", r"d.csv:row 1: field 'tokens' must be a JSON list of token ids"),
    ("id,tokens\n1,\"[1, -2]\"\n", r"d.csv:row 1: field 'tokens'\[1\] = -2 is not a token id"),
    ("id,tokens\n1,\"[1.5, 2]\"\n", r"d.csv:row 1: field 'tokens'\[0\] must be an integer token id"),
    ("id,tokens\n1,7\n", r"d.csv:row 1: field 'tokens' must be a list of token ids"),
    ("id,text\n1,a b\n2,c d,extra\n", r"d.csv:row 2: 3 cell\(s\), the header has 2"),
    ("id,body\n1,a b\n", r"d.csv: no 'text' or 'tokens' column \(columns: id, body\)"),
    ("id,text,text\n1,a,b\n", r"d.csv: column 'text' appears twice"),
    ("id,text\n1,a b\n2,\"c d\n", r"d.csv:row 2: not valid CSV"),
    ("id,text\n1,a b\n1,c d\n", r"d.csv:row 2: duplicate id '1' \(first at .*d.csv:row 1\)"),
    ("id,text,partition\n1,a b,evl\n", r"d.csv:row 1: field 'partition' must be one of"),
    ("id,text\n1,\n", r"d.csv:row 1: needs a 'text' or a 'tokens' field"),
    ("", r"d.csv: no header row"),
    ("id,text\n", r"d.csv: no examples"),
])
def test_bad_csv_is_one_line_naming_the_row(tmp_path, body, error):
    with pytest.raises(DataError, match=error) as e:
        read_data(_bad_csv(tmp_path, body), partitions=("eval", "prefix"))
    assert "\n" not in str(e.value)


def test_csv_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(b"id,text\n1,ok\n2,\xff\n")
    with pytest.raises(DataError, match=r"d.csv:line 3: not valid UTF-8"):
        read_data(path)


def test_tables_values_are_never_coerced(tmp_path):
    """pandas / Parquet types: NumPy integers are integers, token arrays ids, NaN and NA missing, a float label 1.0 is
    1; a float label 0.5, a boolean label and float token ids are refused naming the row."""
    df = pd.DataFrame({"id": np.array([3, 4, 5], np.int64), "tokens": [np.array([1, 2], np.int64),
                                                                       np.array([3, 4], np.int32), np.array([5, 6])],
                       "label": [1.0, np.nan, 0.0]})
    assert _fields(read_data(df)) == [("3", None, [1, 2], 1, "eval", None), ("4", None, [3, 4], None, "eval", None),
                                      ("5", None, [5, 6], 0, "eval", None)]
    nullable = pd.DataFrame({"text": ["a b", "c d"], "label": pd.array([1, None], dtype="Int64")})
    assert [e.label for e in read_data(nullable)] == [1, None]
    with pytest.raises(DataError, match=r"data.iloc\[1\]: field 'label' must be 0 or 1 .*got '0.5'"):
        read_data(df.assign(label=[1.0, 0.5, 0.0]))
    with pytest.raises(DataError, match=r"data.iloc\[0\]: field 'label' must be 0 or 1 .*got 'True'"):
        read_data(df.assign(label=[True, False, True]))
    df.assign(tokens=[[1.0, 2.0], [3.0], [4.0]]).to_parquet(tmp_path / "f.parquet")
    with pytest.raises(DataError, match=r"f.parquet:row 1: field 'tokens'\[0\] must be an integer token id"):
        read_data(tmp_path / "f.parquet")
    df.assign(label=[1.0, 0.5, 0.0]).to_parquet(tmp_path / "h.parquet")
    with pytest.raises(DataError, match=r"h.parquet:row 2: field 'label' must be 0 or 1"):
        read_data(tmp_path / "h.parquet")


def test_numpy_values_in_records_are_python_values():
    """A list of dicts with NumPy values: np.int64 ids and labels count as integers; np.True_ as a label is a
    boolean, refused (it used to pass ``label in (0, 1)`` and be scored as a member)."""
    ex = read_data([{"id": np.int64(3), "tokens": np.array([1, 2]), "label": np.int64(1)}])
    assert (ex[0].id, ex[0].label) == ("3", 1)
    with pytest.raises(DataError, match=r"data\[0\]: field 'label' must be 0 or 1"):
        read_data([{"id": 1, "text": "a b", "label": np.True_}])


def test_dataframe_named_index_is_a_column():
    df = pd.DataFrame({"id": ["x", "y"], "text": ["a b", "c d"]}).set_index("id")
    assert [e.id for e in read_data(df)] == ["x", "y"]


def test_datasets_splits_are_chosen_by_name(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"text": "a b"}])
    both = datasets.DatasetDict({"train": ds, "test": ds})
    with pytest.raises(DataError, match=r"data: a DatasetDict with splits 'test', 'train': pass one, e.g. "
                                        r"data\['test'\]"):
        read_data(both)
    both.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd: a DatasetDict with splits 'test', 'train': give one, e.g. .*dd/test"):
        read_data(tmp_path / "dd")
    assert read_data(tmp_path / "dd" / "train")[0].text == "a b"
    assert check_data_path(tmp_path / "dd", "--data") == tmp_path / "dd"
    for read in (read_data, lambda p: check_data_path(p, "--data")):  # a split name that is none: the splits listed
        with pytest.raises(ValueError, match=r"dd/tset: no split 'tset' in the saved DatasetDict .*dd; its splits: "
                                             r"test, train$"):
            read(tmp_path / "dd" / "tset")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match=r"--data .*plain: is a directory, and not a dataset saved by datasets"):
        check_data_path(tmp_path / "plain", "--data")


def test_unreadable_tables_and_missing_packages(tmp_path, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"x.parquet: not a readable Parquet file"):
        read_data(tmp_path / "x.parquet")
    _frame([{"text": "a b"}]).to_parquet(tmp_path / "y.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if pyarrow were not installed
    with pytest.raises(DataError, match=r"y.parquet: reading Parquet needs the pyarrow package \(pip install pyarrow"):
        read_data(tmp_path / "y.parquet")
    with pytest.raises(DataError, match=r"data.iloc\[0\]: needs a 'text' or a 'tokens'"):
        read_data(pd.DataFrame({"text": [None], "tokens": [None]}))
    with pytest.raises(DataError, match=r"data: no column 'body' \(mapped to 'text'\); columns: text"):
        read_data(pd.DataFrame({"text": ["a"]}), column_map={"text": "body"})
    with pytest.raises(DataError, match=r"data: no example has the field 'body' \(mapped to 'text'\)"):
        read_data([{"text": "a"}], column_map={"text": "body"})
    with pytest.raises(DataError, match=r"d.jsonl: no example has the field 'body'"):
        read_data(_jsonl(tmp_path / "d.jsonl", [{"text": "a b"}]), column_map={"label": "body"})
    with pytest.raises(DataError, match=r"data: expected a path, a list of dicts, a pandas DataFrame, a datasets "
                                        r"Dataset or a pyarrow Table; got dict"):
        read_data({"text": ["a b"]})
    import pyarrow as pa
    with pytest.raises(DataError, match=r"data\[1\]: needs a 'text' or a 'tokens'"):
        read_data(pa.table({"text": ["a b", None]}))


def test_cli_bad_csv_is_one_error_line(tiny_neox_dir, tmp_path, capsys):
    """`mia score --data d.csv`: a bad row stops before the model is loaded, with one line naming the row; a bad
    --columns is one argparse line naming the flag."""
    from mia.cli import main

    data = _csv(tmp_path / "d.csv", "id,body,is_member\n1,a b,1\n2,c d,7\n")
    argv = ["score", "--model", str(tiny_neox_dir), "--data", str(data), "--out", str(tmp_path / "o.jsonl"),
            "--no-cache", "--no-progress"]
    assert main(argv + ["--columns", "text=body,label=is_member"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {data}:row 2: field 'label' must be 0 or 1 (1 = member), got '7'"]
    with pytest.raises(SystemExit) as e:
        main(argv + ["--columns", "txt=body"])
    assert e.value.code == 2 and "--columns" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_every_form_gives_the_jsonl_scores(tiny_model, tiny_neox_dir, tmp_path, capsys):
    """One scoring pass per form on the tiny model: scores, ids and labels equal to the JSONL's. No ids anywhere
    (positions serve), and a learned-from partition given as a DataFrame without ids does not clash with them."""
    import mia
    from mia.cli import main

    texts = ["def add(a, b):\n    return a + b\n", "import json\nprint(json.dumps({'a': 1}))\n",
             "class Point:\n    x: int\n    y: int\n", "for i in range(10):\n    print(i * i)\n"]
    rows = [{"text": t, "label": i % 2} for i, t in enumerate(texts)] + [{"tokens": [5, 6, 7, 8, 9], "label": 1}]
    forms = _forms(tmp_path, rows)
    kw = dict(attacks="loss,zlib", cache=False, progress=False, max_length=16)
    base = mia.score(tiny_model, forms.pop("jsonl"), **kw)
    assert base.ids == ["0", "1", "2", "3", "4"]
    prefix = pd.DataFrame({"text": ["x = 1\n", "y = 2\n"]})
    for name, data in forms.items():
        run = mia.score(tiny_model, data, **kw, prefix=prefix if name == "dataframe" else None)
        assert run.ids == base.ids and run.labels.tolist() == base.labels.tolist(), name
        for attack in base.scores:
            np.testing.assert_array_equal(run.scores[attack], base.scores[attack], err_msg=name)
    renamed = tmp_path / "renamed.csv"  # the CLI: --columns applies to --data and to --prefix-data
    pd.DataFrame(rows).rename(columns={"text": "body", "label": "is_member"}).to_csv(renamed, index=False)
    prefix.rename(columns={"text": "body"}).to_parquet(tmp_path / "prefix.parquet")
    out = tmp_path / "o.jsonl"
    assert main(["score", "--model", str(tiny_neox_dir), "--data", str(renamed), "--columns",
                 "text=body,label=is_member", "--prefix-data", str(tmp_path / "prefix.parquet"), "--attacks",
                 "loss,zlib", "--max-length", "16", "--out", str(out), "--no-cache", "--no-progress",
                 "--bootstrap", "10"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == base.ids
    assert [line["scores"]["loss"] for line in lines] == base.scores["loss"].tolist()
    capsys.readouterr()


def test_saved_dataset_digest_covers_every_file(tmp_path):
    """Several processes agree on --data by its digest (``mia.cli.score_inputs``): a saved dataset directory's
    covers every file under it."""
    from mia.files.hashing import path_sha256

    (tmp_path / "ds" / "test").mkdir(parents=True)
    (tmp_path / "ds" / "dataset_dict.json").write_text('{"splits": ["test"]}')
    (tmp_path / "ds" / "test" / "data-00000-of-00001.arrow").write_bytes(b"abc")
    first = path_sha256(tmp_path / "ds")
    assert first == path_sha256(tmp_path / "ds") and len(first) == 64
    (tmp_path / "ds" / "test" / "data-00000-of-00001.arrow").write_bytes(b"abd")
    assert path_sha256(tmp_path / "ds") != first


def test_learned_from_sets_may_lack_mapped_columns(tmp_path):
    """``require_columns=False`` (what ``mia.score`` reads --prefix-data etc. with): a mapped column a set lacks
    leaves its field missing (prefixes need no labels), in every form; the scored data must have every one."""
    cmap = {"text": "body", "label": "is_member"}
    rows = [{"body": "a b"}, {"body": "c d"}]
    for name, data in _forms(tmp_path, rows).items():
        got = [(e.text, e.label) for e in read_data(data, column_map=cmap, require_columns=False)]
        assert got == [("a b", None), ("c d", None)], name
        with pytest.raises(DataError, match="'is_member'"):
            read_data(data, column_map=cmap)
    standard = [{"text": "a b"}]  # a set that uses the standard name for a mapped field
    assert read_data(standard, column_map=cmap, require_columns=False)[0].text == "a b"
    assert read_data(_frame(standard), column_map=cmap, require_columns=False)[0].text == "a b"


def test_a_byte_order_mark_opening_a_jsonl_file_is_not_content(tmp_path):
    """Windows editors open a UTF-8 file with a BOM: the file reads as without it; a BOM elsewhere is still text."""
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    body = '{"text": "hello world", "label": 1}\n{"text": "\\ufeffbye", "label": 0}\n'
    plain.write_text(body, encoding="utf-8")
    marked.write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))
    assert _fields(read_data(marked)) == _fields(read_data(plain))
    assert [e.text for e in read_data(marked)] == ["hello world", "\ufeffbye"]
