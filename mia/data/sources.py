"""Example data in every common form, read by one function (``read_data``) for ``mia.score`` and ``mia score``.

The forms, told apart by the type of ``data`` (in memory) or by the path (docs/score.md#inputs):

- a JSONL file (``.jsonl``, ``.ndjson``, or a name without a suffix; split files too):
  ``mia.data.examples.read_examples``;
- a JSON file (``.json``): a JSON array of row objects (``[{"text": ...}, ...]``, rows named ``data.json:row 7``),
  or JSON Lines under that name (what ``datasets``' json loader also accepts);
- a CSV file (``.csv``) or a TSV file (``.tsv``, tab-separated): a header row of column names, one example a row;
  read with the standard library, every cell as written: ``tokens`` a JSON list in its cell (``[5, 17, 9]``),
  ``label`` ``0``/``1`` (``1.0``/``0.0`` too); an empty cell (or ``nan`` as a label) is a missing value;
- a Parquet file (``.parquet``, needs pyarrow);
- a directory written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` of one split; a
  ``DatasetDict`` directory with several splits is refused naming them: give ``DIR/SPLIT``; a ``DIR/SPLIT`` that
  names no split is refused listing the splits there);

A file with any other suffix (``.txt``, ``.jsonl.gz``, ``.xlsx`` ...) is refused in one line listing these forms
(``DATA_FORMS``): it is never guessed to be JSONL.
- a list of dicts (or ``mia.data.examples.Example``s);
- a pandas ``DataFrame`` (a named index, such as one set by ``set_index("id")``, counts as a column);
- a Hugging Face ``datasets.Dataset``, or a ``DatasetDict`` of one split (with several: pass ``dd["test"]``);
- a pyarrow ``Table`` (what ``pyarrow.parquet.read_table`` and ``Dataset.data.table`` give);
- any other iterable of dicts, read once: a streamed ``datasets.IterableDataset`` (every row is read into memory,
  since the engine plans its batches over the whole set), a generator.

Columns (keys) are the fields of a JSONL line: ``id`` (optional), ``text`` or ``tokens``, ``label`` (optional),
``partition`` (optional), ``doc_id`` (optional); other columns are ignored; ``column_map`` (field -> column, such as
``{"text": "body", "label": "is_member"}``; ``--columns text=body,label=is_member``) renames them (a mapped column
the data lack is an error, unless ``require_columns=False``: the learned-from sets). Every row goes
through the same checks (``mia.data.examples.examples_from_rows``), and a bad one is one ``DataError`` naming the row:
``data.csv:row 7`` (rows of a file counted from 1, the header not counted), ``data.iloc[6]`` (a DataFrame),
``data[6]`` (a list or Dataset). Values of tables are taken as the Python values they hold, never converted to
another kind (``mia.data.examples.python_value``): NumPy integers are integers, a label 1.0 is 1 and 0.5 an error,
and a missing cell (None, NaN, pandas' NA) is a missing value (an unlabelled example, never a 0).
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

from .. import validate as V
from .examples import (FIELDS, DataError, Example, examples_from_records, examples_from_rows, python_value,
                       read_examples, renamed)

JSONL_SUFFIXES = (".jsonl", ".ndjson", "")  # "": a name without a suffix (read as JSONL, as it always was)
JSON_SUFFIXES = (".json",)
CSV_SUFFIXES = (".csv",)
TSV_SUFFIXES = (".tsv",)
PARQUET_SUFFIXES = (".parquet",)
DATASET_DIR_FILES = ("state.json", "dataset_dict.json")  # what datasets' save_to_disk writes (Dataset, DatasetDict)
DATA_FORMS = (".jsonl (or .ndjson, or no suffix), .json (an array of row objects, or JSON Lines), .csv, .tsv, "
              ".parquet, or a directory saved by datasets' save_to_disk")  # what a data path may be, for messages


@dataclasses.dataclass(frozen=True)
class _How:
    """How to read one source (the arguments of ``read_data``)."""

    partitions: Optional[tuple]
    column_map: dict
    id_prefix: str
    require_columns: bool


def read_data(data, what: str = "data", partitions: Optional[Sequence[str]] = None, *,
              column_map: Optional[dict] = None, id_prefix: str = "", require_columns: bool = True) -> list[Example]:
    """Checked ``Example``s (copies: the caller's objects are never modified) from ``data`` in any of the forms of
    the module docstring. ``what`` names an in-memory source in errors (a path names itself); ``partitions``: the
    partition names allowed (None: any), so a misspelt one is an error, not a row left out; ``column_map``: field ->
    column; ``require_columns``: a mapped column the data lack is an error (False: that field is missing, for the
    learned-from sets, which a map made for the scored data may not fit, e.g. prefixes without labels);
    ``id_prefix``: put before the positions that serve as ids when the data give none."""
    how = _How(None if partitions is None else tuple(partitions), check_column_map(column_map), id_prefix,
               require_columns)
    if isinstance(data, (str, Path)):
        return _read_path(Path(data), what, how)
    if _is_instance(data, "pandas", "DataFrame"):
        return _read_dataframe(data, what, how)
    if _is_instance(data, "datasets", "DatasetDict"):
        splits = sorted(data)
        data = _one_split(data, what, f"pass one, e.g. {what}[{splits[0]!r}]" if splits else "")
        what = f"{what}[{splits[0]!r}]"
    if _is_instance(data, "datasets", "Dataset"):
        return _read_dataset(data, what, what, how, subscript=True)
    if _is_instance(data, "pyarrow", "Table"):
        return _read_table(list(data.column_names), data.to_pylist(), what, lambda i: f"{what}[{i}]", how)
    if isinstance(data, (dict, bytes)) or not hasattr(data, "__iter__"):
        raise DataError(f"{what}: expected a path, a list of dicts, a pandas DataFrame, a datasets Dataset or a "
                        f"pyarrow Table; got {type(data).__name__}")
    return examples_from_records(list(data), what, how.partitions, column_map=how.column_map, id_prefix=how.id_prefix,
                                 require_columns=how.require_columns)


def data_format(path, what: str = "data", error: type = DataError) -> str:
    """"jsonl", "json", "csv", "tsv", "parquet" or "dataset" (a ``save_to_disk`` directory) for ``path``; any other
    suffix is one ``error`` naming ``what`` and listing the accepted forms (``DATA_FORMS``)."""
    p = Path(path)
    if _is_dir(p):
        return "dataset"
    suffix = p.suffix.lower()
    for kind, suffixes in (("jsonl", JSONL_SUFFIXES), ("json", JSON_SUFFIXES), ("csv", CSV_SUFFIXES),
                           ("tsv", TSV_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
        if suffix in suffixes:
            return kind
    shown = "".join(p.suffixes[-2:]).lower() if suffix in (".gz", ".bz2", ".xz", ".zst", ".zip") else suffix
    packed = " (decompress it first)" if shown != suffix else ""
    raise error(f"{what} {V._shown(p)}: unsupported file type {shown!r}{packed}; data can be {DATA_FORMS}")


def _is_dir(p: Path) -> bool:
    try:
        return p.is_dir()
    except OSError:  # a name too long to look at: input_file says so
        return False


def check_data_path(path, what: str) -> Path:
    """``path`` of a data flag (``--data``, ``--prefix-data``, ...) checked before any work: a readable file of one
    of the accepted forms (``data_format``), or a directory that ``datasets``' ``save_to_disk`` wrote (a missing
    ``DIR/SPLIT`` of a saved ``DatasetDict`` lists its splits). One ``InputError`` line otherwise."""
    p = Path(path)
    if not _is_dir(p):
        _missing_split(p, what, V.InputError)
        V.input_file(p, what)
        data_format(p, what, V.InputError)
        return p
    if not any((p / f).is_file() for f in DATASET_DIR_FILES):
        raise V.InputError(f"{what} {p}: is a directory, and not a dataset saved by datasets' save_to_disk (no "
                           f"{' or '.join(DATASET_DIR_FILES)})")
    return p


def _missing_split(p: Path, what: str, error: type) -> None:
    """``p`` = ``DIR/SPLIT`` missing where ``DIR`` is a ``DatasetDict`` saved by ``save_to_disk``: one ``error``
    listing the splits there (the split name is misspelt), instead of "file not found"."""
    try:
        if p.exists() or not (p.parent / "dataset_dict.json").is_file():
            return
        splits = json.loads((p.parent / "dataset_dict.json").read_text(encoding="utf-8")).get("splits")
    except (OSError, ValueError, AttributeError):
        return  # unreadable: input_file or the reader says what is wrong
    if not isinstance(splits, list) or not splits:
        splits = [q.name for q in p.parent.iterdir() if (q / "state.json").is_file()]
    raise error(f"{what} {V._shown(p)}: no split {p.name!r} in the saved DatasetDict {V._shown(p.parent)}; its "
                f"splits: {', '.join(sorted(map(str, splits))) or 'none'}")


def check_column_map(column_map, what: str = "column_map") -> dict:
    """``column_map`` (field -> column name) checked: a dict of strings whose keys are fields of an example."""
    if column_map is None:
        return {}
    if not isinstance(column_map, dict):
        raise DataError(f"{what}: expected a dict field -> column, such as {{'text': 'body'}}, got "
                        f"{type(column_map).__name__}")
    for field, column in column_map.items():
        if field not in FIELDS:
            raise DataError(f"{what}: {field!r} is not a field of an example ({', '.join(FIELDS)})")
        if not isinstance(column, str) or not column:
            raise DataError(f"{what}: the column of {field!r} must be a non-empty string, got {column!r}")
    return dict(column_map)


def parse_column_map(text: str) -> dict:
    """``--columns text=body,label=is_member`` -> ``{"text": "body", "label": "is_member"}`` (checked)."""
    out: dict = {}
    for item in text.split(","):
        field, eq, column = item.partition("=")
        field, column = field.strip(), column.strip()
        if not eq or not field or not column:
            raise DataError(f"expected FIELD=COLUMN pairs such as text=body,label=is_member, got {item!r}")
        if field in out:
            raise DataError(f"field {field!r} given twice")
        out[field] = column
    return check_column_map(out, "--columns")


# ----------------------------------------------------------------------------------------------- the forms
def _is_instance(obj, module: str, name: str) -> bool:
    """isinstance of ``module.name`` without importing ``module`` (an object of it exists only once it is imported)."""
    mod = sys.modules.get(module)
    cls = getattr(mod, name, None) if mod is not None else None
    return cls is not None and isinstance(obj, cls)


def _read_path(p: Path, what: str, how: _How) -> list[Example]:
    if _is_dir(p):
        check_data_path(p, what)
        return _read_dataset_dir(p, how)
    _missing_split(p, what, DataError)
    V.input_file(p, what, error=DataError)
    kind = data_format(p, what)
    if kind in ("csv", "tsv"):
        return _read_csv(p, how, kind)
    if kind == "parquet":
        return _read_parquet(p, how)
    if kind == "json":
        return _read_json(p, what, how)
    return read_examples(p, how.partitions, what, column_map=how.column_map, id_prefix=how.id_prefix,
                         require_columns=how.require_columns)[1]


def _read_json(p: Path, what: str, how: _How) -> list[Example]:
    """A ``.json`` file: a JSON array of row objects (rows named ``p:row N``, from 1), or JSON Lines (read as a
    ``.jsonl`` file is). A syntax error names its line; an element that is not an object names its row."""
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise DataError(f"{p}:{line}: not valid UTF-8 (byte {raw[e.start:e.start + 1]!r})") from None
    if not text.lstrip().startswith("["):
        try:
            return read_examples(p, how.partitions, what, column_map=how.column_map, id_prefix=how.id_prefix,
                                 require_columns=how.require_columns)[1]
        except DataError as e:
            if "invalid JSON" in str(e) and isinstance(_json_document(text), dict):
                raise DataError(f"{p}: one JSON object over several lines; a .json data file is a JSON array of row "
                                "objects ([{\"text\": ...}, ...]) or JSON Lines (one object a line)") from None
            raise
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{p}:{e.lineno}: invalid JSON ({e.msg}, column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{p}: invalid JSON (nested too deeply)") from None

    def fields():
        for n, r in enumerate(rows, 1):
            if not isinstance(r, dict):
                raise DataError(f"{p}:row {n}: expected a JSON object, got {type(r).__name__}")
            yield f"{p}:row {n}", r

    return examples_from_rows(fields(), str(p), how.partitions, column_map=how.column_map, id_prefix=how.id_prefix,
                              require_columns=how.require_columns)


def _json_document(text: str):
    """``text`` parsed as one JSON document, or None when it is not one."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _check_columns(columns: list, source: str, how: _How) -> dict:
    """A table's column names: none twice, every mapped one present (``require_columns``), and a ``text`` or
    ``tokens`` column once mapped (one ``DataError`` naming ``source`` and the columns otherwise). Returns the
    column map to read the table with (without the columns it lacks)."""
    shown = ", ".join(map(str, columns[:12])) + (" ..." if len(columns) > 12 else "")
    twice = sorted({str(c) for c in columns if columns.count(c) > 1})
    if twice:
        raise DataError(f"{source}: column {twice[0]!r} appears twice")
    column_map = {f: c for f, c in how.column_map.items() if c in columns}
    for field, column in how.column_map.items():
        if column not in columns and how.require_columns:
            raise DataError(f"{source}: no column {column!r} (mapped to {field!r}); columns: {shown}")
    named = {f for f in FIELDS if f in columns and f not in column_map.values()} | set(column_map)
    if not named & {"text", "tokens"}:
        raise DataError(f"{source}: no 'text' or 'tokens' column (columns: {shown}); name yours with "
                        "column_map={'text': COLUMN} (mia score: --columns text=COLUMN)")
    return column_map


def _table_rows(records, wheres, column_map: dict):
    """(where, fields) of each row of a table: renamed, every value as the Python value it holds, None/NaN/NA
    missing."""
    for where, r in zip(wheres, records):
        yield where, {k: python_value(v, nan_is_missing=True) for k, v in renamed(r, column_map).items()
                      if k in FIELDS}


def _read_dataframe(df, what: str, how: _How) -> list[Example]:
    names = [n for n in df.index.names if n is not None]
    if names and not set(names) & set(df.columns):
        df = df.reset_index()  # a named index (set_index("id")) is a column of the data
    return _read_table(list(df.columns), df.to_dict("records"), what, lambda i: f"{what}.iloc[{i}]", how)


def _read_table(columns: list, records: list, source: str, where, how: _How) -> list[Example]:
    """The examples of a table given as its column names and its rows (dicts); ``where(i)`` names row ``i`` (from
    0) in errors; ``source`` names the table."""
    column_map = _check_columns(columns, source, how)
    rows = _table_rows(records, (where(i) for i in range(len(records))), column_map)
    return examples_from_rows(rows, source, how.partitions, id_prefix=how.id_prefix)


def _one_split(dd, source: str, hint: str):
    """The one split of a ``DatasetDict``; several (or none) is a ``DataError`` listing them."""
    splits = sorted(dd)
    if len(splits) == 1:
        return dd[splits[0]]
    if not splits:
        raise DataError(f"{source}: a DatasetDict with no split")
    raise DataError(f"{source}: a DatasetDict with splits {', '.join(map(repr, splits))}: {hint}")


def _read_dataset(ds, source: str, what: str, how: _How, subscript: bool) -> list[Example]:
    where = (lambda i: f"{what}[{i}]") if subscript else (lambda i: f"{source}:row {i + 1}")
    return _read_table(list(ds.column_names), ds.to_list(), source, where, how)


def _read_dataset_dir(p: Path, how: _How) -> list[Example]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{p}: reading a saved dataset needs the datasets package (pip install datasets)") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # noqa: BLE001 (any failure to read the directory is one line about it)
        raise DataError(f"{p}: not a readable saved dataset ({str(e).strip().splitlines()[0] if str(e) else e!r})"
                        ) from None
    if isinstance(ds, datasets.DatasetDict):
        splits = sorted(ds)
        source = p / splits[0] if len(splits) == 1 else p
        ds = _one_split(ds, str(p), f"give one, e.g. {p / (splits[0] if splits else 'SPLIT')}")
        p = source
    return _read_dataset(ds, str(p), str(p), how, subscript=False)


def _read_parquet(p: Path, how: _How) -> list[Example]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{p}: reading Parquet needs the pyarrow package (pip install pyarrow)") from None
    try:
        table = pq.read_table(p)
    except Exception as e:  # noqa: BLE001 (pyarrow's errors: not Parquet, damaged, unreadable)
        raise DataError(f"{p}: not a readable Parquet file ({str(e).strip().splitlines()[0] if str(e) else e!r})"
                        ) from None
    return _read_table(list(table.column_names), table.to_pylist(), str(p), lambda i: f"{p}:row {i + 1}", how)


CSV_FIELD_LIMIT = 2 ** 31 - 1  # characters in one cell (the csv module's default is 128 KiB: a long text)


def _read_csv(p: Path, how: _How, kind: str = "csv") -> list[Example]:
    """A CSV file (``kind`` "csv") or a tab-separated one ("tsv"): a header row, then one example a row."""
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark (spreadsheets write one) is not part of the first column
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise DataError(f"{p}:line {line}: not valid UTF-8 (byte {raw[e.start:e.start + 1]!r})") from None
    limit = csv.field_size_limit()
    csv.field_size_limit(CSV_FIELD_LIMIT)
    try:
        rows = list(_csv_rows(p, text, kind))
    finally:
        csv.field_size_limit(limit)
    if not rows:
        raise DataError(f"{p}: no header row (a {kind.upper()} file starts with its column names)")
    header, body = rows[0], rows[1:]
    column_map = _check_columns(header, str(p), how)
    records = []
    for n, cells in enumerate(body, 1):
        if len(cells) != len(header):
            raise DataError(f"{p}:row {n}: {len(cells)} cell(s), the header has {len(header)} column(s)")
        records.append(dict(zip(header, cells)))

    def fields():
        for n, r in enumerate(records, 1):
            where = f"{p}:row {n}"
            yield where, {k: _csv_cell(k, v, where) for k, v in renamed(r, column_map).items() if k in FIELDS}

    return examples_from_rows(fields(), str(p), how.partitions, id_prefix=how.id_prefix)


def _csv_rows(p: Path, text: str, kind: str = "csv"):
    """The non-blank rows of a CSV (or, ``kind`` "tsv", tab-separated) text, as lists of cells; a malformed one is a
    ``DataError`` naming its row (the header is row 0)."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True, delimiter="\t" if kind == "tsv" else ",")
    n = 0
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise DataError(f"{p}:row {n}: not valid {kind.upper()} ({e})") from None
        if row:  # a blank line is no row
            n += 1
            yield row


def _csv_cell(field: str, cell: str, where: str):
    """A CSV cell as the value of ``field``: an empty cell is missing; ``label`` 0/1 (also written as a float such
    as 1.0; NaN missing; anything else kept as written, for the field's check to refuse); ``tokens`` a JSON list;
    every other field the text as written."""
    if cell == "":
        return None
    if field == "label":
        if cell in ("0", "1"):
            return int(cell)
        try:
            x = float(cell)
        except ValueError:
            return cell
        return None if math.isnan(x) else (int(x) if x in (0.0, 1.0) else cell)
    if field == "tokens":
        try:
            return json.loads(cell)
        except (ValueError, RecursionError):
            raise DataError(f"{where}: field 'tokens' must be a JSON list of token ids such as [5, 17, 9], got "
                            f"{cell[:40]!r}") from None
    return cell
