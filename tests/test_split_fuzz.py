"""Fuzzing of the split-file reader / checker and the Megatron .idx reader: any bytes, any edit of a split give a
valid result or one user error (a ``ValueError`` subclass with a one-line message), never another exception or a
hang.

* a table, independent of Hypothesis: every header field (down to the fields of the file records) and every field
  of one row of each split kind (Pythia, testbed, OLMo positions, OLMo documents, text) set to each of a few JSON
  values, the line's hash rewritten so that the field alone is wrong: the checker never raises, and a report that
  finds something names the field;
* regression rows: edits that once crashed the checker;
* Hypothesis: the default run is derandomized and keeps no example database (the same inputs on every run with one
  Hypothesis version: a few dozen per reader); ``-m slow`` explores at random, thousands of inputs per split kind.
"""
import copy
import json
import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")  # in setup.py's test extras
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mia.data import olmo_order, pythia  # noqa: E402
from mia.data.indexed import MAGIC, IndexedDataError, IndexedDataset  # noqa: E402
from mia.data.splits import (HEADER_HASH, ROW_HASH, SplitError, read_split, row_digest, short_repr,  # noqa: E402
                             write_split)
from mia.data.verify import verify_split  # noqa: E402
from mia.data.text import build_text_split, load_generic  # noqa: E402

from order_files import B, EOS, SEQ, make_files, make_order, raw_pythia  # noqa: E402

FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                database=None)
SLOW_EXAMPLES = int(os.environ.get("MIA_FUZZ_EXAMPLES", "3000"))
SLOW = settings(max_examples=SLOW_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)

KINDS = ("pythia", "testbed", "olmo", "olmo_documents", "text")


def _text_split(d):
    """A text split from a column-oriented JSON file (read without ``datasets``)."""
    src = d / "bench.json"
    src.write_text(json.dumps({"text": [f"text number {i}" for i in range(8)], "label": [i % 2 for i in range(8)]}))
    ex, files = load_generic(src)
    h, out = build_text_split(ex, files, {"format": "generic"}, seed=0, partitions="prefix=1,eval=rest")
    return write_split(d / "text.jsonl", h, out)


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """``{kind: (folder, lines)}``: a valid split of each kind over real files, to mutate."""
    d = tmp_path_factory.mktemp("fuzz")
    bins, idx = raw_pythia(d, cut=5 * 6 * 2 + 3)
    h, ex = pythia.draw_checkpoint_split(IndexedDataset(bins, idx_path=idx), 5, 3, 3, seed=0, gap=1, end_step=10,
                                         batch_size=B, partitions="train=1,eval=2", vocab_size=65536)
    paths = {"pythia": write_split(d / "pythia.jsonl", h, ex)}
    h["source"]["kind"] = "testbed"  # the testbed's orders are Pythia-format files
    paths["testbed"] = write_split(d / "testbed.jsonl", h, ex)
    _, inst = make_files(d, eos_every=5)
    make_order(d, len(inst))
    order = olmo_order.OlmoOrder(d / "global_indices.npy", d / "paths.txt", seq_len=SEQ, batch_size=3)
    h, ex = olmo_order.draw_checkpoint_split(order, 2, 2, 2, seed=4, nonmember_start=3, vocab_size=50304)
    paths["olmo"] = write_split(d / "olmo.jsonl", h, ex)
    h, ex = olmo_order.draw_checkpoint_split(order, 2, 2, 2, seed=4, nonmember_start=3, documents=True, eos=EOS,
                                             doc_len=6)
    paths["olmo_documents"] = write_split(d / "olmo_documents.jsonl", h, ex)
    paths["text"] = _text_split(d)
    for kind, p in paths.items():
        assert verify_split(p).problems == [], kind
    return {kind: (d, p.read_text().splitlines()) for kind, p in paths.items()}


def one_line_user_error(e: Exception) -> None:
    assert isinstance(e, ValueError), f"{type(e).__name__}: {e}"
    assert str(e) and "\n" not in str(e).strip(), repr(str(e))


def check_file(path):
    """The checker's report on ``path`` (it must not raise): one short line per finding, each problem naming a line
    of the file; the reader either reads the file or raises one ``SplitError`` naming a line the check names too."""
    report = verify_split(path)
    found = report.problems + report.not_verified
    assert all(isinstance(x, str) and "\n" not in x and len(x) < 800 for x in found), found
    assert all(x.startswith(("line ", f"{path}:")) for x in report.problems), report.problems
    try:
        read_split(path, compact_tokens=True)
    except SplitError as e:
        one_line_user_error(e)
        assert str(e).startswith(f"{path}:"), str(e)
        line = str(e)[len(str(path)) + 1:].split(":")[0]
        assert str(e) in report.problems or any(x.startswith(f"line {line}:") for x in report.problems), (e, report)
    return report


def write_lines(folder, lines, name="mutated.jsonl"):
    p = folder / name
    p.write_text("\n".join(lines) + "\n")
    return p


# ---------------------------------------------------------------------------------- every field, a table

BAD_VALUES = (None, -1, 2**70, 2.5, True, "x", "", [], [None, 3], {"a": 1})


def field_paths(obj: dict):
    """Paths (tuples of keys and list indices) of every field of a split line, three levels down; for a list of
    objects (the file records), the fields of its first one."""
    for k, v in obj.items():
        if k in (HEADER_HASH, ROW_HASH):
            continue
        yield (k,)
        for k2, v2 in (v.items() if isinstance(v, dict) else ()):
            yield (k, k2)
            if isinstance(v2, dict):
                yield from ((k, k2, k3) for k3 in v2)
            if isinstance(v2, list) and v2 and isinstance(v2[0], dict):
                yield from ((k, k2, 0, k3) for k3 in v2[0])


def set_field(obj: dict, path: tuple, value, rehash: bool) -> dict:
    """A copy of ``obj`` with the field at ``path`` set; with ``rehash``, its row_sha256 / header_sha256 rewritten to
    match (an edit the hashes cannot tell: only the field's own checks can)."""
    obj = copy.deepcopy(obj)
    inner = obj
    for k in path[:-1]:
        inner = inner[k]
    inner[path[-1]] = value
    field = HEADER_HASH if HEADER_HASH in obj else ROW_HASH
    if rehash and field in obj:
        body = {k: v for k, v in obj.items() if k != field}
        obj = {**body, field: row_digest(json.dumps(body))}
    return obj


def names_of(path: tuple) -> tuple:
    """What a report line may call the field at ``path``: its name, or the file record it is in."""
    if len(path) == 4:
        return str(path[3]), f"{path[1]}[{path[2]}]"
    return (str(path[-1]), str(path[-2])) if len(path) == 3 else (str(path[-1]),)


@pytest.mark.parametrize("kind", KINDS)
def test_every_field_set_to_values_of_other_types(templates, kind):
    """Each header field and each field of the first row, set to each of ``BAD_VALUES`` (hashes rewritten): the check
    never raises; when it finds something, a line names the field (or its file record)."""
    d, lines = templates[kind]
    unnamed = []
    for lineno in (1, 2):
        obj = json.loads(lines[lineno - 1])
        for path in field_paths(obj):
            for value in BAD_VALUES:
                edited = list(lines)
                edited[lineno - 1] = json.dumps(set_field(obj, path, value, rehash=True))
                report = check_file(write_lines(d, edited))
                if report.problems and not any(n in x for n in names_of(path) for x in report.problems
                                               + report.not_verified):
                    unnamed.append((lineno, path, value, report.problems))
    assert not unnamed, "\n".join(map(repr, unnamed))


# the edits that once crashed the checker: (kind, line, field, value, hash rewritten, a problem the check reports)
OLMO_STEPS = "but step 2, nonmember_start 3, end_step 4 and batch_size 3 give"
REGRESSIONS = [
    ("olmo_documents", 1, ("params", "member_steps"), None, False,
     f"line 1: header params.member_steps is None {OLMO_STEPS} [0, 2]"),
    ("olmo_documents", 1, ("params", "member_steps"), [], False,
     f"line 1: header params.member_steps is [] {OLMO_STEPS} [0, 2]"),
    ("olmo_documents", 1, ("params", "member_steps"), [None, 3], False,
     f"line 1: header params.member_steps is [None, 3] {OLMO_STEPS} [0, 2]"),
    ("olmo", 1, ("params", "nonmember_steps"), [None, 3], True,
     f"line 1: header params.nonmember_steps is [None, 3] {OLMO_STEPS} [3, 4]"),
    ("pythia", 1, ("source", "bin"), 5, True, "line 1: header source.bin is 5, expected a non-empty list of objects"),
    ("text", 1, ("source", "files"), 5, True, "line 1: header source.files is 5, expected a list of objects or null"),
    ("olmo", 1, ("source", "global_indices", "path"), [0, 1, 2], True,
     "line 1: header source.global_indices.path is [0, 1, 2], expected a non-empty string"),
    ("pythia", 1, ("source", "idx", "path"), "x" * 5000, True,
     f"line 1: header source.idx: source file {'x' * 297}...: cannot read (File name too long)"),
    ("olmo_documents", 1, ("params", "doc_len"), 0, True,
     "line 1: header params.doc_len is 0, expected a positive integer"),
    ("olmo_documents", 1, ("params", "documents"), "no", True,
     "line 1: header params.documents is 'no', expected true or false"),
    ("pythia", 2, ("index",), True, True, "line 2: index is True, expected a non-negative integer or null"),
    # a long value in a row once made the header-partitions problem thousands of characters long
    ("testbed", 2, ("partition",), {"x" * 1000: False}, True,
     f"line 2: partition {short_repr({'x' * 1000: False})} is not a string"),
]


@pytest.mark.parametrize("kind, lineno, path, value, rehash, problem", REGRESSIONS,
                         ids=[f"{r[0]}-{'.'.join(map(str, r[2]))}-{short_repr(r[3], 12)}" for r in REGRESSIONS])
def test_edits_that_crashed_the_checker(templates, kind, lineno, path, value, rehash, problem):
    d, lines = templates[kind]
    edited = list(lines)
    edited[lineno - 1] = json.dumps(set_field(json.loads(lines[lineno - 1]), path, value, rehash))
    report = check_file(write_lines(d, edited))
    assert problem in report.problems, report.problems


def test_reader_stops_a_partition_that_is_not_a_string(templates):
    d, lines = templates["text"]
    edited = list(lines)
    edited[2] = json.dumps(set_field(json.loads(lines[2]), ("partition",), ["eval"], rehash=True))
    p = write_lines(d, edited)
    with pytest.raises(SplitError, match=r"mutated.jsonl:3: partition \['eval'\] is not a string$"):
        read_split(p)
    assert "line 3: partition ['eval'] is not a string" in verify_split(p).problems


# ------------------------------------------------------------------------------------------- hypothesis

def mutate(lines, data) -> list:
    """One random edit of one line: a field (at any depth, list items included) set to any JSON value or dropped, a
    field added, or the line replaced by any text."""
    lines = list(lines)
    k = data.draw(st.integers(0, len(lines) - 1))
    try:
        obj = json.loads(lines[k])
    except ValueError:
        obj = None  # a line an earlier mutation made raw text
    how = data.draw(st.sampled_from(["set", "drop", "raw"]))
    if how == "raw" or not isinstance(obj, dict):
        lines[k] = data.draw(st.text(max_size=40))
        return lines
    inner = obj
    while True:
        keys = sorted(inner) + ["extra"] if isinstance(inner, dict) else list(range(len(inner)))
        key = data.draw(st.sampled_from(keys))
        child = inner.get(key) if isinstance(inner, dict) else inner[key]
        if not (isinstance(child, (dict, list)) and child) or not data.draw(st.booleans()):
            break
        inner = child
    if how == "drop" and isinstance(inner, dict):
        inner.pop(key, None)
    elif how == "drop":
        del inner[key]
    else:
        inner[key] = data.draw(json_values)
    lines[k] = json.dumps(obj)
    return lines


def _bytes_case(templates, raw: bytes):
    d, _ = templates["pythia"]
    p = d / "bytes.jsonl"
    p.write_bytes(raw)
    check_file(p)


def _mutation_case(templates, kind, data):
    d, lines = templates[kind]
    for _ in range(data.draw(st.integers(1, 3))):
        lines = mutate(lines, data)
    check_file(write_lines(d, lines))


@FAST
@given(raw=st.binary(max_size=400) | st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_split_reader_any_bytes(templates, raw):
    _bytes_case(templates, raw)


@pytest.mark.parametrize("kind", KINDS)
@FAST
@given(data=st.data())
def test_split_checker_mutated_splits(templates, kind, data):
    _mutation_case(templates, kind, data)


def test_split_reader_deep_nesting_and_bad_utf8(templates):
    for raw in (b"[" * 100_000 + b"]" * 100_000 + b"\n", b'{"id": "\xff\xfe"}\n', b"\x00" * 50):
        _bytes_case(templates, raw)


# ---------------------------------------------------------------------------------------------- .idx

def idx_bytes():
    """Byte strings that are often a well-formed header (so the reader gets past the magic) followed by anything."""
    header = st.tuples(st.integers(0, 3), st.integers(0, 12), st.integers(0, 2**64 - 1) | st.integers(0, 40),
                       st.integers(0, 2**64 - 1) | st.integers(0, 40)).map(
        lambda t: MAGIC + t[0].to_bytes(8, "little") + bytes([t[1]]) + t[2].to_bytes(8, "little")
        + t[3].to_bytes(8, "little"))
    return st.one_of(st.binary(max_size=200), st.tuples(header, st.binary(max_size=600)).map(lambda t: t[0] + t[1]))


def _idx_case(tmp, idx_raw: bytes, bin_raw: bytes):
    (tmp / "f.idx").write_bytes(idx_raw)
    (tmp / "f.bin").write_bytes(bin_raw)
    try:
        ds = IndexedDataset(tmp / "f")
        n = min(len(ds), 20)
        rows = [ds[i] for i in range(n)]
        if n and len({len(r) for r in rows}) == 1:
            np.testing.assert_array_equal(ds.get_rows(range(n)), np.stack(rows))
    except IndexedDataError as e:
        one_line_user_error(e)
        assert "f.idx" in str(e) or "f.bin" in str(e), str(e)


@FAST
@given(idx_raw=idx_bytes(), bin_raw=st.binary(max_size=300))
def test_idx_reader_any_bytes(tmp_path_factory, idx_raw, bin_raw):
    _idx_case(tmp_path_factory.getbasetemp(), idx_raw, bin_raw)


# ------------------------------------------------------------------------------------------------ slow
# An exploratory run at random (no fixed seed): SLOW_EXAMPLES inputs per test (MIA_FUZZ_EXAMPLES, default 3000).

@pytest.mark.slow
@SLOW
@given(raw=st.binary(max_size=2000))
def test_split_reader_any_bytes_long(templates, raw):
    _bytes_case(templates, raw)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@SLOW
@given(data=st.data())
def test_split_checker_mutated_splits_long(templates, kind, data):
    _mutation_case(templates, kind, data)


@pytest.mark.slow
@SLOW
@given(idx_raw=idx_bytes(), bin_raw=st.binary(max_size=2000))
def test_idx_reader_any_bytes_long(tmp_path_factory, idx_raw, bin_raw):
    _idx_case(tmp_path_factory.getbasetemp(), idx_raw, bin_raw)
