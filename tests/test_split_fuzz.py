"""Property-based fuzzing (hypothesis) of the split-file reader / checker and the Megatron .idx reader: any bytes give
a valid result or one user error (a ``ValueError`` subclass with a one-line message), never another exception or a
hang. The default run tries a few dozen inputs per reader; ``-m slow`` tries thousands."""
import json
import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")  # in setup.py's test extras
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mia.data import pythia  # noqa: E402
from mia.data.indexed import MAGIC, IndexedDataError, IndexedDataset  # noqa: E402
from mia.data.splits import SplitError, read_split, verify_split, write_split  # noqa: E402

from test_data_splits import B, raw_pythia  # noqa: E402

FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
SLOW = settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A valid Pythia split (lines) over real files, to mutate."""
    d = tmp_path_factory.mktemp("fuzz")
    bins, idx = raw_pythia(d, cut=5 * 6 * 2 + 3)
    h, ex = pythia.draw_checkpoint_split(IndexedDataset(bins, idx_path=idx), 5, 3, 3, seed=0, gap=1, end_step=10,
                                         batch_size=B, partitions="train=1,eval=2", vocab_size=65536)
    path = write_split(d / "template.jsonl", h, ex)
    return d, path.read_text().splitlines()


@pytest.fixture(scope="module")
def olmo_template(tmp_path_factory):
    """A valid OLMo document split (lines) over real files, to mutate."""
    from mia.data import olmo
    from test_data_olmo import EOS, SEQ, make_files, make_order

    d = tmp_path_factory.mktemp("fuzz_olmo")
    _, inst = make_files(d, eos_every=5)
    make_order(d, len(inst))
    order = olmo.OlmoOrder(d / "global_indices.npy", d / "paths.txt", seq_len=SEQ, batch_size=3)
    h, ex = olmo.draw_checkpoint_split(order, 2, 2, 2, seed=4, nonmember_start=3, documents=True, eos=EOS, doc_len=6)
    path = write_split(d / "template.jsonl", h, ex)
    return d, path.read_text().splitlines()


def one_line_user_error(e: Exception) -> None:
    assert isinstance(e, ValueError), f"{type(e).__name__}: {e}"
    assert str(e) and "\n" not in str(e).strip(), repr(str(e))


def check_file(path) -> None:
    report = verify_split(path)  # must never raise
    assert all(isinstance(p, str) and "\n" not in p for p in report.problems + report.not_verified)
    try:
        read_split(path, compact_tokens=True)
    except SplitError as e:
        one_line_user_error(e)
        assert report.problems == [str(e)]


def mutate(lines, data) -> list:
    lines = list(lines)
    k = data.draw(st.integers(0, len(lines) - 1))
    try:
        obj = json.loads(lines[k])
    except ValueError:
        obj = None  # a line an earlier mutation made raw text
    how = data.draw(st.sampled_from(["set", "drop", "nested", "raw"]))
    if how == "raw" or not isinstance(obj, dict):
        lines[k] = data.draw(st.text(max_size=40))
        return lines
    key = data.draw(st.sampled_from(sorted(obj) + ["extra"]))
    if how == "drop":
        obj.pop(key, None)
    elif how == "nested" and isinstance(obj.get(key), dict) and obj[key]:
        sub = data.draw(st.sampled_from(sorted(obj[key])))
        obj[key][sub] = data.draw(json_values)
    else:
        obj[key] = data.draw(json_values)
    lines[k] = json.dumps(obj)
    return lines


def _bytes_case(template, raw: bytes):
    d, _ = template
    p = d / "bytes.jsonl"
    p.write_bytes(raw)
    check_file(p)


def _mutation_case(template, data):
    d, lines = template
    for _ in range(data.draw(st.integers(1, 3))):
        lines = mutate(lines, data)
    p = d / "mutated.jsonl"
    p.write_text("\n".join(lines) + "\n")
    check_file(p)


@FAST
@given(raw=st.binary(max_size=400) | st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_split_reader_any_bytes(template, raw):
    _bytes_case(template, raw)


@FAST
@given(data=st.data())
def test_split_checker_mutated_splits(template, data):
    _mutation_case(template, data)


@FAST
@given(data=st.data())
def test_split_checker_mutated_olmo_splits(olmo_template, data):
    _mutation_case(olmo_template, data)


def test_split_reader_deep_nesting_and_bad_utf8(template):
    d, _ = template
    for raw in (b"[" * 100_000 + b"]" * 100_000 + b"\n", b'{"id": "\xff\xfe"}\n', b"\x00" * 50):
        _bytes_case(template, raw)


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

@pytest.mark.slow
@SLOW
@given(raw=st.binary(max_size=2000))
def test_split_reader_any_bytes_long(template, raw):
    _bytes_case(template, raw)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_split_checker_mutated_splits_long(template, data):
    _mutation_case(template, data)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_split_checker_mutated_olmo_splits_long(olmo_template, data):
    _mutation_case(olmo_template, data)


@pytest.mark.slow
@SLOW
@given(idx_raw=idx_bytes(), bin_raw=st.binary(max_size=2000))
def test_idx_reader_any_bytes_long(tmp_path_factory, idx_raw, bin_raw):
    _idx_case(tmp_path_factory.getbasetemp(), idx_raw, bin_raw)
