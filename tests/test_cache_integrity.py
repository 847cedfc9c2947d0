"""A cache that cannot lie, atomic outputs, offline by construction.

- The score cache is content-addressed: an edit of any weight byte (size and mtime kept), the tokenizer, the config,
  the dtypes or the attention kernel gives another key; a damaged entry is recomputed with one warning line.
- Reading the cache is bounded by the run: only the requested examples' bytes are read and kept.
- Every output goes through ``mia.files.atomic``: two writers of one path never leave a partial file.
- ``datasets``/``transformers`` never reach for the network, whatever HF_*_OFFLINE say.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import mia.engine.cache as cache_mod
import mia.engine.loop as sc
from mia.files.atomic import atomic_write
from mia.files.hashing import file_sha256
from mia.models.hub import fingerprint

REPO = Path(__file__).resolve().parents[1]


def _tensor_in_the_middle(weights: Path) -> tuple[str, int, int]:
    """(name, absolute byte offset, byte length) of the float32 tensor whose data is nearest the file's middle."""
    raw = weights.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    mid = len(raw) // 2
    name, info = min(((k, v) for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32"),
                     key=lambda kv: abs(8 + n + sum(kv[1]["data_offsets"]) // 2 - mid))
    lo, hi = info["data_offsets"]
    return name, 8 + n + lo, hi - lo


def _edit_in_place(path: Path, offset: int, length: int) -> None:
    """Double every float32 of path[offset:offset+length], keeping the file's size and its mtime."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        a = np.frombuffer(f.read(length), "<f4") * 2
        f.seek(offset)
        f.write(a.astype("<f4").tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size


@pytest.fixture()
def ckpt(tiny_neox_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MIA_CACHE_DIR", str(tmp_path / "mia-cache"))
    return Path(shutil.copytree(tiny_neox_dir, tmp_path / "ckpt"))


def test_fingerprint_covers_every_weight_byte_tokenizer_and_config(ckpt):
    before = fingerprint(ckpt)
    _, off, length = _tensor_in_the_middle(ckpt / "model.safetensors")
    _edit_in_place(ckpt / "model.safetensors", off, length)
    after_weights = fingerprint(ckpt)
    assert after_weights != before
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    (ckpt / "tokenizer.json").write_text(json.dumps(tok, indent=1))  # same tokenizer, other bytes
    after_tokenizer = fingerprint(ckpt)
    assert after_tokenizer != after_weights
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "layer_norm_eps": 1e-6}))
    assert fingerprint(ckpt) not in (before, after_weights, after_tokenizer)


def test_file_hash_is_memoised_and_misses_after_an_in_place_edit(tmp_path, monkeypatch):
    import time

    import mia.files.hashing as fh

    f, memo = tmp_path / "w.bin", tmp_path / "memo"
    f.write_bytes(bytes(range(256)) * 64)
    file_sha256(f, memo)
    assert list(memo.glob("*.json")) == []  # modified (ctime) just now: never memoised (racy-write guard)
    monkeypatch.setattr(fh, "SETTLE_NS", 0)  # the ctime cannot be set back, so settle at once here
    first = file_sha256(f, memo)
    assert len(list(memo.glob("*.json"))) == 1
    calls = []
    real = fh.sha256_of_file
    monkeypatch.setattr(fh, "sha256_of_file", lambda p: calls.append(p) or real(p))
    assert file_sha256(f, memo) == first and calls == []  # served from the memo: not rehashed
    time.sleep(0.05)  # past the filesystem's timestamp granularity
    _edit_in_place(f, 8192, 64)  # same size, same mtime: only the ctime moves
    second = file_sha256(f, memo)
    assert len(calls) == 1 and second != first and second == real(f)


def test_edited_checkpoint_or_other_dtype_is_never_served_from_the_cache(ckpt, tmp_path, monkeypatch):
    import mia.models as mm

    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50, n).astype(np.int32) for n in (7, 12, 5)]
    cached = sc.ScoringSettings(progress=False, cache_dir=str(tmp_path / "scores"))
    m1 = mm.load(ckpt, tokenizer=False)
    s1 = sc.compute_token_stats(m1, seqs, cached)
    _, off, length = _tensor_in_the_middle(ckpt / "model.safetensors")
    _edit_in_place(ckpt / "model.safetensors", off, length)
    m2 = mm.load(ckpt, tokenizer=False)
    s2 = sc.compute_token_stats(m2, seqs, cached)
    truth = sc.compute_token_stats(m2, seqs, sc.ScoringSettings(progress=False))
    for a, b, t in zip(s1, s2, truth):
        np.testing.assert_array_equal(b["logprob"], t["logprob"])
        assert not np.array_equal(a["logprob"], b["logprob"])
    # every other determinant of the numbers is in the key
    keys = {sc.cache_namespace(m2)}
    for dtype, param_dtype in (("bfloat16", None), ("float32", "float16"), ("float32", "bfloat16")):
        keys.add(sc.cache_namespace(mm.load(ckpt, dtype=dtype, param_dtype=param_dtype, tokenizer=False)))
    monkeypatch.setenv("MIA_ATTENTION", "blocked")
    keys.add(sc.cache_namespace(m2))
    monkeypatch.delenv("MIA_ATTENTION")
    keys.add(sc.cache_namespace(m2, "other attack parameters"))
    monkeypatch.setattr(cache_mod, "STATS_VERSION", "999")
    keys.add(sc.cache_namespace(m2))
    assert len(keys) == 7


def _stats(n_examples: int, seed: int = 0) -> dict:
    """{key: {stat: float32 [n]}} with one length per example (as the engine stores them)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n_examples):
        n = int(rng.integers(3, 60))
        out[f"k{seed}-{i:05d}"] = {s: rng.standard_normal(n).astype(np.float32) for s in sc.STAT_NAMES}
    return out


def test_lookup_reads_and_keeps_only_the_requested_examples(tmp_path):
    """2,000 cached examples in 20 parts, 10 requested: the data bytes read are exactly those 10 examples' blocks
    and the arrays kept are exactly their lengths (own buffers, not views into a whole part)."""
    cache = sc.StatsCache(str(tmp_path), "ns")
    every = {}
    for part in range(20):
        items = _stats(100, seed=part)
        cache.put_many(items)
        every.update(items)
    data_bytes = sum(f.stat().st_size for f in (tmp_path / "ns").glob("*.f32"))
    index_bytes = sum(f.stat().st_size for f in (tmp_path / "ns").glob("*.json"))
    wanted = sorted(every)[::200]
    reader = sc.StatsCache(str(tmp_path), "ns")
    got = reader.lookup(wanted + ["not-cached"])
    assert sorted(got) == wanted
    need = sum(4 * len(sc.STAT_NAMES) * len(every[k]["logprob"]) for k in wanted)
    assert reader.bytes_read == index_bytes + need  # every index (one key is missing), then 10 blocks only
    kept = 0
    for k in wanted:
        for s in sc.STAT_NAMES:
            a = got[k][s]
            np.testing.assert_array_equal(a, every[k][s])
            assert a.dtype == np.float32 and a.base is None and a.flags.c_contiguous
            kept += a.nbytes
    assert kept == need < data_bytes / 100


def test_pair_cache_keeps_only_the_run_pairs(tmp_path):
    from mia.engine.conditional import PairCache

    writer = PairCache(str(tmp_path), "ns")
    for p in range(30):
        for t in range(30):
            writer.put(f"p{p}", f"t{t}", float(p * 100 + t))
    writer.flush()
    reader = PairCache(str(tmp_path), "ns", prefixes={"p3", "p7"}, targets={"t1", "t2", "t29"})
    assert sum(len(v) for v in reader.mem.values()) == 6
    assert reader.get("p7", "t29") == 729.0 and reader.get("p0", "t1") is None


def test_a_file_where_a_cache_namespace_should_be_is_one_warning(tmp_path, capsys):
    """A regular file in place of a namespace directory: one ``warning:`` line naming it, nothing cached, no
    traceback (the score cache and the conditional pair cache)."""
    from mia.engine.conditional import PairCache

    (tmp_path / "ns").write_text("x")
    (tmp_path / "condll-ns").write_text("x")
    capsys.readouterr()
    stats = sc.StatsCache(str(tmp_path), "ns")
    stats.put_many(_stats(3))
    assert stats.lookup(["a"]) == {}
    pairs = PairCache(str(tmp_path), "ns")
    pairs.put("p", "t", 1.0)
    pairs.flush()
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 2 and all(l.startswith("warning:") and "is a file" in l for l in lines), lines
    assert str(tmp_path / "ns") in lines[0] and str(tmp_path / "condll-ns") in lines[1]
    assert (tmp_path / "ns").read_text() == "x"
    (tmp_path / "f").write_text("x")  # an unusable root: one warning however many namespaces are opened under it
    for ns in ("a", "b", "c"):
        assert sc.StatsCache(str(tmp_path / "f"), ns).dir is None
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 1 and str(tmp_path / "f") in lines[0], lines


@pytest.mark.parametrize("damage", ["flip", "truncate", "index"])
def test_damaged_entry_is_recomputed_with_one_warning(tiny_model, tmp_path, capsys, damage):
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, tiny_model.vocab_size, n).astype(np.int32) for n in (9, 14)]
    settings = sc.ScoringSettings(progress=False, cache_dir=str(tmp_path), token_budget=16)  # two parts
    truth = sc.compute_token_stats(tiny_model, seqs, settings)
    # the part holding the 14-token example (its own part on one device; with more devices the per-device budget
    # may put both examples in one part): the largest part file
    part = max(tmp_path.glob("*/part-*.f32"), key=lambda f: f.stat().st_size)
    assert part.stat().st_size >= 13 * 16
    if damage == "flip":
        raw = bytearray(part.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        part.write_bytes(bytes(raw))
    elif damage == "truncate":
        part.write_bytes(part.read_bytes()[:-5])
    else:
        part.with_suffix(".json").write_text('{"keys": [')
    capsys.readouterr()
    again = sc.compute_token_stats(tiny_model, seqs, settings)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("warning: cache file") and "damaged" in err[0]
    for a, b in zip(truth, again):
        for s in sc.STAT_NAMES:
            np.testing.assert_array_equal(a[s], b[s])
    sc.compute_token_stats(tiny_model, seqs, settings)  # the recomputed part replaced the damaged one
    assert not capsys.readouterr().err.strip()


WRITER = r"""
import sys
sys.path.insert(0, sys.argv[1])
from mia.files.atomic import atomic_write
letter, path = sys.argv[2], sys.argv[3]
for i in range(40):
    with atomic_write(path) as f:
        for _ in range(64):
            f.write(letter * 4095 + "\n")
"""


def test_two_writers_of_one_path_never_leave_a_partial_file(tmp_path):
    out = tmp_path / "scores.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(REPO), letter, str(out)]) for letter in "ab"]
    seen = set()
    while any(p.poll() is None for p in procs):
        if out.exists():
            text = out.read_text()
            assert len(text) == 64 * 4096 and len(set(text) - {"\n"}) == 1, "a partial or mixed file was visible"
            seen.add(text[0])
    assert [p.returncode for p in procs] == [0, 0]
    assert out.read_text()[0] in "ab" and sorted(os.listdir(tmp_path)) == ["scores.jsonl"]  # no temporaries left
    with pytest.raises(RuntimeError):
        with atomic_write(out) as f:
            f.write("half")
            raise RuntimeError
    assert len(out.read_text()) == 64 * 4096 and sorted(os.listdir(tmp_path)) == ["scores.jsonl"]


def test_no_fixed_temporary_names_in_the_code():
    """Every writer goes through mia.files.atomic (unique temporaries); a fixed ``x.tmp`` name would be shared."""
    pattern = re.compile(r"""["'][^"'\n]*\.tmp["'{]|with_suffix\([^)]*tmp""")
    hits = [f"{f.relative_to(REPO)}:{i}" for d in ("mia", "experiments") for f in sorted((REPO / d).rglob("*.py"))
            if f.name != "atomic.py" for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


OFFLINE = r"""
import socket, sys
sys.path.insert(0, sys.argv[1])
attempts = []
def refuse(*a, **k):
    attempts.append(a[:2])
    raise OSError("network access attempted")
socket.getaddrinfo = refuse
socket.socket.connect = refuse
socket.create_connection = refuse
from mia.data.corpus import table_corpus
from mia.data.text import load_rows
docs = table_corpus(sys.argv[2]).documents
rows = load_rows(sys.argv[3])
assert len(docs) == 3 and len(rows[0] if isinstance(rows, tuple) else rows) >= 2, (docs, rows)
print("attempts", len(attempts), attempts[:3])
sys.exit(3 if attempts else 0)
"""


def test_local_loading_makes_no_network_attempt_whatever_the_environment(tmp_path):
    jsonl, csv = tmp_path / "corpus.jsonl", tmp_path / "data.csv"
    jsonl.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(3)))
    csv.write_text("text,label\nhello there,1\ngeneral kenobi,0\n")
    env = dict(os.environ, HF_DATASETS_OFFLINE="0", HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0",
               HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run([sys.executable, "-c", OFFLINE, str(REPO), str(jsonl), str(csv)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, textwrap.shorten(r.stdout + r.stderr, 2000)


def test_no_cache_never_hashes_the_weights(tiny_neox_dir, tmp_path, monkeypatch, capsys):
    """``mia score --no-cache`` builds no cache key, so it never reads the weight files to hash them (a 12B
    checkpoint costs minutes): the whole-file hash is made to fail, and the run must still succeed. The model's
    fingerprint is still there on demand (the cache's key), from the same hash."""
    import mia.files.hashing as fh
    from mia.cli import main
    from mia.models import load

    real, real_memoised = fh.sha256_of_file, fh.file_sha256

    def refuse(path, *args, **kwargs):
        raise AssertionError(f"hashed {path} with the cache off")

    monkeypatch.setattr(fh, "sha256_of_file", refuse)
    monkeypatch.setattr(fh, "file_sha256", refuse)  # a memo of an earlier hash must not be read either
    (tmp_path / "d.jsonl").write_text('{"id": 1, "text": "def f(x): return x", "label": 1}\n'
                                      '{"id": 2, "text": "import os", "label": 0}\n')
    argv = ["score", "--model", str(tiny_neox_dir), "--data", str(tmp_path / "d.jsonl"), "--out",
            str(tmp_path / "o.jsonl"), "--attacks", "loss", "--no-progress", "--no-cache"]
    assert main(argv) == 0, capsys.readouterr().err
    model = load(tiny_neox_dir)
    with pytest.raises(AssertionError, match="cache off"):  # the key, when asked for, does hash the weights
        model.fingerprint
    monkeypatch.setattr(fh, "sha256_of_file", real)
    monkeypatch.setattr(fh, "file_sha256", real_memoised)
    assert model.fingerprint == fingerprint(tiny_neox_dir)


# ----------------------------------------------------------------------------------------------- sampled digest
def test_sampled_weights_digest_rule(tmp_path):
    """``mia.models.inspect.weights_digest``: a byte-identical copy gives the same digest; one byte changed in a
    sampled block (or the header) gives another; a byte outside the sample is, as documented, not seen."""
    from mia.models.hub import write_safetensors
    from mia.models.inspect import SAMPLE_BLOCK, SAMPLE_WHOLE, sample_ranges, weights_digest

    a = tmp_path / "a" / "model.safetensors"
    a.parent.mkdir()
    write_safetensors({"w": np.arange(3 * 2**20, dtype=np.float32)}, a)  # 12 MiB: sampled, not hashed whole
    size = a.stat().st_size
    ranges = sample_ranges(size)
    assert size > SAMPLE_WHOLE and sum(hi - lo for lo, hi in ranges) == SAMPLE_WHOLE
    assert ranges[0][0] == 0 and ranges[-1][1] == size and all(r[1] <= s[0] for r, s in zip(ranges, ranges[1:]))
    b = tmp_path / "b" / "model.safetensors"
    b.parent.mkdir()
    shutil.copyfile(a, b)
    assert weights_digest([a]) == weights_digest([b])

    def flipped(offset: int) -> str:
        raw = bytearray(a.read_bytes())
        raw[offset] ^= 1
        b.write_bytes(bytes(raw))
        return weights_digest([b])

    lo, _ = ranges[len(ranges) // 2]  # a block in the middle of the weights
    assert flipped(lo + SAMPLE_BLOCK // 2) != weights_digest([a])
    assert flipped(size - 3) != weights_digest([a])  # the tail
    assert flipped(10) != weights_digest([a])  # the header
    gap = ranges[len(ranges) // 2][1] + 10  # between two sampled blocks
    assert all(not lo_ <= gap < hi_ for lo_, hi_ in ranges)
    assert flipped(gap) == weights_digest([a])
    small = tmp_path / "small.safetensors"  # at most SAMPLE_WHOLE bytes: every byte counts
    write_safetensors({"w": np.zeros(1000, np.float32)}, small)
    before = weights_digest([small])
    raw = bytearray(small.read_bytes())
    raw[-1000] ^= 1
    small.write_bytes(bytes(raw))
    assert weights_digest([small]) != before


def test_check_checkpoint_reads_headers_not_weights(tiny_neox_dir, tmp_path, monkeypatch):
    """``check_checkpoint`` checks the config, tensor names, shapes and dtypes from the headers; without the digest no
    byte of the data region is read (every read of the weight file counted)."""
    import builtins

    from safetensors.numpy import load_file, save_file

    from mia.models import CheckpointError, ConfigError, check_checkpoint

    weights, read, real_open = tiny_neox_dir / "model.safetensors", [], builtins.open

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            out = self.f.read(n)
            read.append(len(out))
            return out

        def __getattr__(self, k):
            return getattr(self.f, k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def counting_open(path, *args, **kw):
        f = real_open(path, *args, **kw)
        return Counting(f) if str(path) == str(weights) else f

    monkeypatch.setattr(builtins, "open", counting_open)
    header_bytes = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    assert check_checkpoint(tiny_neox_dir, digest=False).n_params > 0
    assert 0 < sum(read) <= header_bytes < weights.stat().st_size
    monkeypatch.undo()
    r = check_checkpoint(tiny_neox_dir)
    assert r.model_type == "gpt_neox" and r.dtypes == ("float32",) and r.files == ("model.safetensors",)
    assert r.digest and check_checkpoint(tiny_neox_dir, digest=False).digest == ""
    ckpt = tmp_path / "c"
    shutil.copytree(tiny_neox_dir, ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    short = tensors["embed_out.weight"][:, :-1]
    save_file(dict(tensors, **{"embed_out.weight": short}), str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'embed_out.weight' has shape"):
        check_checkpoint(ckpt)
    save_file(dict(tensors, extra=np.zeros(2, np.float32)), str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        check_checkpoint(ckpt)
    save_file(dict(tensors, **{"embed_out.weight": tensors["embed_out.weight"].astype(np.int32)}),
              str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensor .embed_out.weight. is int32; gpt_neox weights are floating"):
        check_checkpoint(ckpt)
    save_file(tensors, str(ckpt / "model.safetensors"))
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(cfg, hidden_size=30)))
    with pytest.raises((CheckpointError, ConfigError), match="config.json"):
        check_checkpoint(ckpt)
