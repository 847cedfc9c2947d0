"""The persistent compilation cache: a second process finds the first one's program (by JAX's cache-hit events)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    import mia.commands

    monkeypatch.setattr(mia.commands, "enable_compile_cache", lambda *a, enabled=True, **k: calls.append(enabled))
    assert mia.cli.main(argv) == 0
    assert calls == want
    from experiments.checkmia import build_parser as checkmia_parser
    from mia.testbed.__main__ import build_parser as testbed_parser

    for parser in (checkmia_parser(), testbed_parser()):
        assert parser.parse_args(["--no-compile-cache"]).no_compile_cache
