"""The cache directory stays under its size limit: least recently used entries of every kind are evicted, by
several processes at once without harm, and ``mia cache info`` / ``prune`` show and delete what it holds."""
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from mia.files import cache_limit
from mia.cli import main
from mia.engine.cache import STAT_NAMES, StatsCache
from mia.files import hashing as file_hash
from mia.files.hashing import file_sha256

ROOT = Path(__file__).resolve().parent.parent
NS, OLD, NEW, SHARED = "0123456789abcdef" * 2, "a" * 32, "b" * 32, "c" * 32  # namespaces: 32 hex, as mia names them


def _stats(key: str, n: int = 200) -> dict:
    """Synthetic stats whose values are derived from the key (so a served entry can be checked)."""
    base = float(sum(map(ord, key)))
    return {s: np.arange(n, dtype=np.float32) + base + c for c, s in enumerate(STAT_NAMES)}


def _parts(root: Path, ns: str) -> set:
    return {p.stem for p in (root / ns).glob("part-*.json")}


@pytest.fixture()
def limit(monkeypatch):
    """Set this process's limit in bytes (``set_max_gb``), reset afterwards."""
    monkeypatch.setattr(cache_limit, "_override_gb", None)
    monkeypatch.setattr(cache_limit, "_estimates", {})

    def set_bytes(n: int) -> int:
        cache_limit.set_max_gb(n / cache_limit.GB)
        return cache_limit.max_bytes()
    return set_bytes


def test_filling_beyond_the_limit_keeps_the_cache_under_it(tmp_path, limit, monkeypatch):
    monkeypatch.setenv("MIA_CACHE_MAX_GB", "0.0001")  # 100 kB, through the environment
    monkeypatch.setattr(cache_limit, "_override_gb", None)
    monkeypatch.setattr(cache_limit, "_estimates", {})
    assert cache_limit.max_bytes() == 100_000
    cache = StatsCache(str(tmp_path), NS)
    for i in range(60):  # ~3.4 kB each: 200 kB written
        cache.put_many({f"k{i}": _stats(f"k{i}")})
        assert cache_limit.total_size(tmp_path) <= 100_000
    kept = StatsCache(str(tmp_path), NS).lookup([f"k{i}" for i in range(60)])
    assert 20 < len(kept) < 60 and "k59" in kept and "k0" not in kept  # the newest are kept
    for k, v in kept.items():
        np.testing.assert_array_equal(v["logprob"], _stats(k)["logprob"])


def test_the_least_recently_read_entry_goes_first_across_kinds(tmp_path, limit, monkeypatch, capsys):
    """A, B, C written long ago (A oldest), A read since; a compiled program and a hash memo older still: over the
    limit, the program and memo go first, then B (the oldest unread); A (read) stays."""
    cache = StatsCache(str(tmp_path), NS)
    for k in "ABC":
        cache.put_many({k: _stats(k)})
    part = {k: next(p.stem for p in (tmp_path / NS).glob("part-*.json")
                    if f'"{k}"' in p.read_text()) for k in "ABC"}
    one = cache_limit.total_size(tmp_path) // 3
    now = time.time()
    for age, k in ((300, "A"), (200, "B"), (100, "C")):
        for suffix in (".json", ".f32"):
            os.utime(tmp_path / NS / (part[k] + suffix), (now - age, now - age))
    (tmp_path / "xla").mkdir()
    (tmp_path / "xla" / "prog-cache").write_bytes(b"x" * 100)
    os.utime(tmp_path / "xla" / "prog-cache", (now - 1000, now - 1000))
    model = tmp_path / "weights.bin"
    model.write_bytes(b"w" * 1000)
    monkeypatch.setattr(file_hash, "SETTLE_NS", 0)  # memoise a file this young (its ctime cannot be set back)
    file_sha256(model, memo_dir=str(tmp_path / "file-sha256"))
    memo = next((tmp_path / "file-sha256").glob("*.json"))
    os.utime(memo, (now - 900, now - 900))
    assert set(StatsCache(str(tmp_path), NS).lookup(["A"])) == {"A"}  # A read: touched
    limit(int(3.5 * one) + 100)  # room for 3 parts and the small files, not 4 parts
    cache.put_many({"D": _stats("D")})
    assert not (tmp_path / "xla" / "prog-cache").exists() and not memo.exists()
    assert _parts(tmp_path, NS) & set(part.values()) == {part["A"], part["C"]}
    assert set(StatsCache(str(tmp_path), NS).lookup(list("ABCD"))) == {"A", "C", "D"}  # B recomputed
    assert capsys.readouterr().err == ""  # an evicted entry is no warning


def test_a_part_evicted_while_it_is_read_is_recomputed_silently(tmp_path, capsys):
    cache = StatsCache(str(tmp_path), NS)
    cache.put_many({"a": _stats("a")})
    index = next((tmp_path / NS).glob("part-*.json"))
    reader = StatsCache(str(tmp_path), NS)
    real = reader._read_rows

    def evicted_meanwhile(data_file, index_obj, *rest):  # the index was read, then both files were evicted
        index.unlink()
        data_file.unlink()
        return real(data_file, index_obj, *rest)
    reader._read_rows = evicted_meanwhile
    assert reader.lookup(["a"]) == {}
    assert capsys.readouterr().err == ""


def test_files_being_written_and_the_lock_are_never_touched(tmp_path, limit):
    limit(10)
    ns = tmp_path / NS
    ns.mkdir()
    (ns / ".part-x.f32.abc.tmp").write_bytes(b"t" * 1000)  # another process's write in progress
    (ns / "part-y.f32").write_bytes(b"d" * 1000)  # its index not written yet
    cache_limit.enforce(tmp_path)
    assert (ns / ".part-x.f32.abc.tmp").exists() and (ns / "part-y.f32").exists()
    old = time.time() - 2 * cache_limit.INCOMPLETE_GRACE_S
    os.utime(ns / "part-y.f32", (old, old))  # an orphan left by a killed writer
    cache_limit.enforce(tmp_path)
    assert not (ns / "part-y.f32").exists() and (ns / ".part-x.f32.abc.tmp").exists()
    old = time.time() - 2 * cache_limit.STALE_TEMP_S
    os.utime(ns / ".part-x.f32.abc.tmp", (old, old))  # left by a killed writer a day ago
    cache_limit.enforce(tmp_path)
    assert not (ns / ".part-x.f32.abc.tmp").exists()


WRITER = textwrap.dedent("""
    import sys, numpy as np
    from mia.engine.cache import StatsCache, STAT_NAMES
    root, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cache = StatsCache(root, "cccccccccccccccccccccccccccccccc")
    for i in range(n):
        k = f"{who}{i}"
        base = float(sum(map(ord, k)))
        cache.put_many({k: {s: np.arange(200, dtype=np.float32) + base + c for c, s in enumerate(STAT_NAMES)}})
        if i % 10 == 0:
            cache.lookup([f"{who}{j}" for j in range(i)])
""")


def test_two_processes_filling_the_cache_at_once_end_under_the_limit(tmp_path, capsys):
    n = 150  # entries per process, ~3.4 kB each: ~1 MB written into a 100 kB cache
    env = {**os.environ, "MIA_CACHE_MAX_GB": "0.0001", "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), who, str(n)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for who in ("a", "b")]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and [o[1] for o in outs] == ["", ""], outs
    total = cache_limit.total_size(tmp_path)
    assert 0 < total <= 100_000
    assert not list(tmp_path.rglob("*.tmp"))
    keys = [f"{w}{i}" for w in "ab" for i in range(n)]
    kept = StatsCache(str(tmp_path), SHARED).lookup(keys)
    assert len(kept) == len(list((tmp_path / SHARED).glob("part-*.json")))  # every remaining entry is intact
    for k, v in kept.items():
        for stat in STAT_NAMES:
            np.testing.assert_array_equal(v[stat], _stats(k)[stat])
    assert capsys.readouterr().err == ""


def _fill(root: Path) -> None:
    StatsCache(str(root), OLD, label={"path": "/models/old-pythia", "dtype": "float32"}).put_many(
        {"x": _stats("x")})
    StatsCache(str(root), NEW, label={"path": "/models/new-llama", "dtype": "bfloat16"}).put_many(
        {"y": _stats("y"), "z": _stats("z")})
    old = time.time() - 3 * 86400
    for p in (root / OLD).glob("part-*"):
        os.utime(p, (old, old))


def test_cache_info_shows_sizes_by_kind_and_namespace(tmp_path, capsys):
    _fill(tmp_path)
    assert main(["cache", "info", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    total = cache_limit.total_size(tmp_path)
    assert out.splitlines()[0].startswith(f"cache {tmp_path}: {cache_limit.fmt_bytes(total)} in 2 entries")
    row = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert row["scores"][1] == "2" and row["xla"][1] == "0" and row["hashes"][1] == "0"
    assert "/models/old-pythia" in " ".join(row[OLD]) and "bfloat16" in " ".join(row[NEW])


def test_prune_by_age_and_by_model_deletes_and_says_what_it_freed(tmp_path, capsys):
    _fill(tmp_path)
    size_old = sum(p.stat().st_size for p in (tmp_path / OLD).glob("part-*"))
    assert main(["cache", "prune", "--older-than", "2", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"freed {cache_limit.fmt_bytes(size_old)} in 1 entries under {tmp_path}"
    assert OLD in out and not (tmp_path / OLD).exists() and (tmp_path / NEW).is_dir()
    assert main(["cache", "prune", "--model", "LLAMA", "--cache-dir", str(tmp_path)]) == 0
    assert NEW in capsys.readouterr().out and cache_limit.total_size(tmp_path) == 0
    assert not (tmp_path / NEW).exists()


def test_prune_max_gb_keeps_the_most_recent(tmp_path, capsys):
    _fill(tmp_path)
    keep = sum(p.stat().st_size for p in (tmp_path / NEW).glob("part-*"))
    assert main(["cache", "prune", "--max-gb", str(keep / cache_limit.GB), "--cache-dir", str(tmp_path)]) == 0
    assert OLD in capsys.readouterr().out and cache_limit.total_size(tmp_path) == keep


@pytest.mark.parametrize("argv, flag", [
    (["score", "--model", "m", "--data", "d", "--out", "o", "--cache-max-gb", "lots"], "--cache-max-gb"),
    (["score", "--model", "m", "--data", "d", "--out", "o", "--cache-max-gb", "0"], "--cache-max-gb"),
    (["cache", "prune", "--max-gb", "-1"], "--max-gb"),
    (["cache", "info", "--cache-dir", "/nonexistent/mia-cache"], "--cache-dir"),
])
def test_a_bad_flag_is_one_error_line_naming_it(argv, flag, capsys):
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's type check
        status = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error:") and flag in err[0], err


def test_prune_without_a_selection_deletes_nothing(tmp_path, capsys):
    _fill(tmp_path)
    total = cache_limit.total_size(tmp_path)
    assert main(["cache", "prune", "--cache-dir", str(tmp_path)]) == 2
    assert "--older-than" in capsys.readouterr().err and cache_limit.total_size(tmp_path) == total


def test_a_bad_environment_limit_is_one_error_line_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MIA_CACHE_MAX_GB", "five")
    assert main(["score", "--model", "m", "--data", "d", "--out", "o"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MIA_CACHE_MAX_GB" in err[0]


def test_mia_score_keeps_its_cache_under_cache_max_gb_and_labels_it(tiny_neox_dir, tmp_path, capsys, limit):
    """End to end: ``mia score --cache-max-gb`` scores, its namespace is labelled with the model's path, and the
    directory (scores and hash memos) ends under the limit; ``mia cache info`` names the model."""
    import json

    import jax

    data = tmp_path / "d.jsonl"  # 8 batches of one row per device (the budget is per device)
    data.write_text("".join(json.dumps({"id": i, "tokens": [3 + (t + i // 8) % 50 for t in range(37 + i % 8)],
                                                "label": i % 2}) + "\n"
                            for i in range(8 * jax.device_count())))
    cache = tmp_path / "cache"
    argv = ["score", "--model", str(tiny_neox_dir), "--data", str(data), "--out", str(tmp_path / "o.jsonl"),
            "--no-progress", "--cache-dir", str(cache), "--batch-tokens", "64", "--bootstrap", "0"]
    assert main(argv) == 0
    full = cache_limit.total_size(cache)
    (ns,) = [d for d in cache.iterdir() if (d / cache_limit.LABEL_NAME).exists()]
    assert cache_limit.read_label(ns)["path"] == str(tiny_neox_dir)
    capsys.readouterr()
    for d in cache.iterdir():
        if d.is_dir():
            for f in d.iterdir():
                f.unlink()
    assert main(argv + ["--cache-max-gb", str(full / 2 / cache_limit.GB)]) == 0
    assert 0 < cache_limit.total_size(cache) <= full / 2
    capsys.readouterr()
    assert main(["cache", "info", "--cache-dir", str(cache)]) == 0
    assert str(tiny_neox_dir) in capsys.readouterr().out


def test_eviction_waits_for_jax_lock_on_the_compiled_programs(tmp_path, limit):
    """While JAX holds its cache lock (``xla/.lockfile``, taken around each read when it has a size limit), no
    program is deleted under it; eviction goes on once the lock is released."""
    import threading

    filelock = pytest.importorskip("filelock")
    limit(10)
    (tmp_path / "xla").mkdir()
    prog = tmp_path / "xla" / "prog-cache"
    prog.write_bytes(b"x" * 100)
    jax_lock = filelock.FileLock(str(tmp_path / "xla" / ".lockfile"))
    jax_lock.acquire()
    t = threading.Thread(target=cache_limit.enforce, args=(tmp_path,))
    t.start()
    t.join(0.5)
    assert t.is_alive() and prog.exists()
    jax_lock.release()
    t.join(10)
    assert not t.is_alive() and not prog.exists()


def test_cache_commands_start_without_jax(tmp_path):
    """``mia cache info`` / ``prune`` need no jax (the CLI's fast start) and set up no compilation cache."""
    _fill(tmp_path)
    code = ("import sys; from mia.cli import main; "
            f"assert main(['cache', 'info', '--cache-dir', {str(tmp_path)!r}]) == 0; "
            f"assert main(['cache', 'prune', '--all', '--cache-dir', {str(tmp_path)!r}]) == 0; "
            "print('jax' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MIA_COMPILE_CACHE": "1", "MIA_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "False", out.stderr
    assert not (tmp_path / "xla").exists() and cache_limit.total_size(tmp_path) == 0


def test_files_mia_did_not_make_are_never_counted_or_deleted(tmp_path, limit):
    """A --cache-dir that also holds other things: only mia's own directories (32-hex namespaces, condll-,
    neighbors-, file-sha256, xla) count towards the limit or are evicted."""
    limit(10)
    (tmp_path / "my-data").mkdir()
    (tmp_path / "my-data" / "big.bin").write_bytes(b"d" * 5000)
    (tmp_path / "notes.txt").write_text("mine")
    StatsCache(str(tmp_path), NS).put_many({"a": _stats("a")})
    assert cache_limit.total_size(tmp_path) == 0 and not (tmp_path / NS).exists()  # evicted at once (limit 10 B)
    assert (tmp_path / "my-data" / "big.bin").stat().st_size == 5000 and (tmp_path / "notes.txt").exists()


def test_a_pair_part_that_serves_the_run_is_marked_used(tmp_path):
    from mia.engine.conditional import PairCache

    ns = "d" * 32
    for pk in ("p1", "p2"):
        store = PairCache(str(tmp_path), ns)
        store.put(pk, "t", 1.5)
        store.flush()
    parts = sorted((tmp_path / f"condll-{ns}").glob("part-*.npz"))
    old = time.time() - 1000
    for p in parts:
        os.utime(p, (old, old))
    assert PairCache(str(tmp_path), ns, prefixes={"p1"}).get("p1", "t") == 1.5
    used = [p for p in parts if p.stat().st_mtime > old + 500]
    assert len(used) == 1 and {e.kind for e in cache_limit.scan(tmp_path)} == {"condll"}


def test_a_writer_recreates_a_namespace_removed_under_it(tmp_path):
    d = tmp_path / NS
    calls = []

    def write():
        if not calls:  # an evictor removed the emptied directory between mkdir and the write
            calls.append(1)
            d.rmdir()
        (d / "part-x.json").write_text("{}")
    cache_limit.write_in(d, write)
    assert (d / "part-x.json").exists()
