"""The persistent compilation cache: a second process finds the first one's program (by JAX's cache-hit events)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mia.cli
import mia.engine.compile_cache as cc

# Compiles one small jitted function with the cache on and prints JAX's cache events as JSON.
CHILD = r"""
import json, sys
from jax import monitoring
events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
from mia.engine.compile_cache import enable_compile_cache
where = enable_compile_cache(sys.argv[1], min_compile_seconds=0)
import jax, jax.numpy as jnp
jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0))(jnp.arange(64.0).reshape(8, 8)).block_until_ready()
print(json.dumps({"dir": str(where), "hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses")}))
"""


def _child(cache_dir: Path) -> dict:
    env = dict(os.environ, MIA_COMPILE_CACHE="1")
    out = subprocess.run([sys.executable, "-c", CHILD, str(cache_dir)], check=True, capture_output=True, text=True,
                         env=env, cwd=Path(__file__).resolve().parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_hits_the_cache(tmp_path):
    cache = tmp_path / "xla"
    first = _child(cache)
    assert first["dir"] == str(cache) and first["hits"] == 0 and first["misses"] >= 1
    assert len(list(cache.iterdir())) >= first["misses"], "no cache entry written"
    second = _child(cache)
    assert second == {"dir": str(cache), "hits": first["misses"], "misses": 0}


def test_default_dir_and_opt_out(tmp_path, monkeypatch):
    monkeypatch.setenv("MIA_CACHE_DIR", str(tmp_path))
    assert cc.default_compile_cache_dir() == tmp_path / "xla"
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("MIA_COMPILE_CACHE", off)
        assert not cc.compile_cache_wanted() and cc.enable_compile_cache() is None
    monkeypatch.setenv("MIA_COMPILE_CACHE", "1")
    assert cc.compile_cache_wanted() and not cc.compile_cache_wanted(False)


@pytest.mark.parametrize("argv, want", [(["attacks"], [True]), (["--no-compile-cache", "attacks"], [False])])
def test_entry_points_turn_it_on_unless_told_not_to(argv, want, monkeypatch, capsys):
    calls = []
    import mia.entry

    monkeypatch.setattr(mia.entry, "enable_compile_cache", lambda *a, enabled=True, **k: calls.append(enabled))
    assert mia.cli.main(argv) == 0
    assert calls == want
    from experiments.checkmia import build_parser as checkmia_parser
    from mia.testbed.__main__ import build_parser as testbed_parser

    for parser in (checkmia_parser(), testbed_parser()):
        assert parser.parse_args(["--no-compile-cache"]).no_compile_cache


def test_empty_cache_dir_env_counts_as_unset(tmp_path, monkeypatch):
    """MIA_CACHE_DIR="" is the default (~/.cache/mia), not the working directory (which would get ./xla)."""
    monkeypatch.setenv("MIA_CACHE_DIR", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cc.default_compile_cache_dir() == tmp_path / "home" / ".cache" / "mia" / "xla"


def _file_as_cache_dir(tmp):
    (tmp / "f").write_text("x")
    return tmp / "f", tmp / "f"


def _file_as_xla(tmp):
    (tmp / "c").mkdir()
    (tmp / "c" / "xla").write_text("x")
    return tmp / "c", tmp / "c" / "xla"


def _under_a_file(tmp):
    (tmp / "f").write_text("x")
    return tmp / "f" / "cache", tmp / "f"


@pytest.mark.parametrize("make", [_file_as_cache_dir, _file_as_xla, _under_a_file])
def test_unusable_compile_cache_dir_is_one_warning(make, tmp_path, monkeypatch, capsys):
    """The compilation cache is optional: a regular file where MIA_CACHE_DIR or <cache>/xla should be gives one
    ``warning:`` line naming it and the command runs (exit 0), with the cache off."""
    cache, named = make(tmp_path)
    monkeypatch.setenv("MIA_CACHE_DIR", str(cache))
    monkeypatch.setenv("MIA_COMPILE_CACHE", "1")
    capsys.readouterr()
    assert mia.cli.main(["attacks"]) == 0
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning:") and str(named) in lines[0], lines
    assert "compilation cache" in lines[0]


def test_unusable_cache_dir_with_no_cache_still_scores(tiny_neox_dir, tmp_path, monkeypatch, capsys):
    """``mia score --no-cache`` with MIA_CACHE_DIR a regular file: one warning (the compilation cache is off), the
    scores are written."""
    (tmp_path / "f").write_text("x")
    (tmp_path / "d.jsonl").write_text('{"id": 1, "text": "def f(x): return x"}\n')
    monkeypatch.setenv("MIA_CACHE_DIR", str(tmp_path / "f"))
    monkeypatch.setenv("MIA_COMPILE_CACHE", "1")
    capsys.readouterr()
    code = mia.cli.main(["score", "--model", str(tiny_neox_dir), "--data", str(tmp_path / "d.jsonl"), "--out",
                         str(tmp_path / "o.jsonl"), "--no-cache", "--no-progress"])
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert code == 0, lines
    assert [l for l in lines if l.startswith(("warning:", "error:"))] == [lines[0]] and str(tmp_path / "f") in lines[0]
    assert (tmp_path / "o.jsonl").exists()
