"""The splash kernel (Pallas splash attention, TPU) against the exact reference, run in Pallas interpret mode on
the CPU; its dispatch; and, where libtpu is installed, a compile-only check of the token-stats step for a TPU slice.

Interpret mode runs the very kernel body the TPU compiles (its block skipping, segment-id and causal/local
masking, online softmax), so these tests check our argument mapping (scaled q, [H, T, E] layout, segment ids 1 =
valid / 0 = padding or the packed ids, the local window) against ``exact_attention``'s position-id rule.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from xla_env import device_flags

from mia.models import attention as A

SCALE = 0.3
T = 256  # splash needs a length divisible by 128; blocks of 256 here


def rows(kind: str, *, b=3, t=T, heads=4, kv_heads=2, e=8, seed=0):
    """(q, k, v, q_pos, k_pos, k_valid) with no cache, and the query rows that have a segment [B, T].

    right: right padding (row 1 all padding); left: left padding (the prefix pass); packed: texts packed in a row
    with positions restarting per text (int32 ids, 0 = padding); hole: padding inside a row (not index aligned).
    """
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, heads, e)).astype(np.float32)
    k = rng.normal(size=(b, t, kv_heads, e)).astype(np.float32)
    v = rng.normal(size=(b, t, kv_heads, e)).astype(np.float32)
    valid = np.ones((b, t), bool)
    if kind == "right":
        valid[0, t - 57:] = False
        valid[1] = False
    elif kind == "left":
        valid[0, :70] = False
        valid[2, :3] = False
    elif kind == "hole":
        valid[0, 100:110] = False
    if kind == "packed":
        seg = np.zeros((b, t), np.int32)
        pos = np.zeros((b, t), np.int32)
        for r, lengths in enumerate([(100, 90, 40), (256,), (3, 130, 5, 60)]):
            start = 0
            for i, n in enumerate(lengths, 1):
                seg[r, start:start + n] = i
                pos[r, start:start + n] = np.arange(n)
                start += n
        return (q, k, v, pos, pos, seg), seg > 0
    pos = np.maximum(np.cumsum(valid, 1) - 1, 0).astype(np.int32)
    return (q, k, v, pos, pos, valid), valid


def _exact(args, window):
    return np.asarray(jax.jit(lambda *a: A.exact_attention(*a, scale=SCALE, window=window))(*args))


def _splash(args, window, dtype=jnp.float32):
    qkv = [jnp.asarray(a, dtype) for a in args[:3]]
    fn = jax.jit(lambda *a: A.splash_attention(*a, scale=SCALE, window=window, interpret=True))
    return np.asarray(fn(*qkv, *args[3:]).astype(jnp.float32))


@pytest.mark.parametrize("kind, window, kv_heads", [
    ("right", None, 2),  # GQA, right padding, an all-padding row
    ("left", None, 1),  # MQA, left padding (the prefix pass)
    ("packed", None, 2),  # packed rows: integer segment ids
    pytest.param("right", 5, 4, marks=pytest.mark.slow),  # MHA, GPT-Neo's local window
    pytest.param("packed", 37, 2, marks=pytest.mark.slow),  # a window within packed texts
])
def test_splash_equals_exact_on_valid_queries(kind, window, kv_heads):
    args, live = rows(kind, kv_heads=kv_heads)
    assert bool(A.index_aligned(*args[3:]))
    got = _splash(args, window)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[live], _exact(args, window)[live], atol=2e-5, rtol=0)


def test_traced_window_from_a_layer_table():
    """GPT-Neo's mixed stack passes the window as a traced table entry (int32 max = global): the global value runs
    splash, a local one blocked, and both equal exact."""
    args, live = rows("right")
    fn = jax.jit(lambda w, *a: A.splash_attention(*a, scale=SCALE, window=w, interpret=True))
    for traced, static in ((5, 5), (np.iinfo(np.int32).max, None)):
        got = np.asarray(fn(jnp.int32(traced), *args))
        np.testing.assert_allclose(got[live], _exact(args, static)[live], atol=2e-5, rtol=0)


def test_splash_runs_blocked_where_the_layout_is_not_index_aligned():
    """Padding inside a row (positions then differ from index + a constant): with a local window splash's index
    mask would differ from the position rule, so the kernel must notice at run time, take the blocked branch and
    still equal exact."""
    args, live = rows("hole")
    assert not bool(A.index_aligned(*args[3:]))
    got = _splash(args, 5)
    np.testing.assert_allclose(got[live], _exact(args, 5)[live], atol=2e-5, rtol=0)
    # splash alone on this layout is wrong (so the run-time check matters)
    seg = jnp.asarray(args[5], jnp.int32)
    q, k, v = (jnp.asarray(a) for a in args[:3])
    raw = np.asarray(A.splash_per_device(q, k, v, seg, scale=SCALE, window=5, interpret=True))
    assert np.abs(raw[live] - _exact(args, 5)[live]).max() > 1e-2


def test_index_aligned_rules():
    t = 8
    pos = np.arange(t)[None]
    ones = np.ones((1, t), bool)
    assert bool(A.index_aligned(pos, pos, ones))
    assert not bool(A.index_aligned(pos + 1, pos, ones))  # q_pos != k_pos
    skip = np.array([[0, 1, 2, 4, 5, 6, 7, 8]])  # a position jump inside one segment
    assert not bool(A.index_aligned(skip, skip, ones))
    assert bool(A.index_aligned(skip, skip, np.array([[1, 1, 1, 2, 2, 2, 2, 2]])))  # the jump opens a new text
    back = np.array([[1, 1, 2, 2, 1, 1, 0, 0]])  # segment 1 reappears after 2: not contiguous
    bpos = np.array([[0, 1, 0, 1, 2, 3, 0, 0]])
    assert not bool(A.index_aligned(bpos, bpos, back))
    left = np.array([[False, False, True, True, True, True, True, True]])
    lpos = np.array([[0, 0, 0, 1, 2, 3, 4, 5]])
    assert bool(A.index_aligned(lpos, lpos, left))


def test_splash_bfloat16_within_input_rounding():
    args, live = rows("right", seed=2)
    got = _splash(args, None, jnp.bfloat16)
    up = [np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)) for a in args[:3]]
    want = _exact(up + list(args[3:]), None)
    assert np.abs(got[live] - want[live]).max() < 3e-2


def test_dispatch_picks_splash_on_tpu_and_blocked_elsewhere(monkeypatch):
    monkeypatch.delenv(A.ENV_VAR, raising=False)
    bf16 = jnp.bfloat16
    monkeypatch.setattr(jax, "device_count", lambda *a: 8)  # several chips, outside an engine step: not splash
    assert A.select_kernel(2, 12, 2048, 2048, 64, bf16, backend="tpu") == "blocked"
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with A.over_mesh(mesh):
        assert A.select_kernel(2, 12, 2048, 2048, 64, bf16, backend="tpu") == "splash"
    monkeypatch.setattr(jax, "device_count", lambda *a: 1)
    with A.planning_for("tpu", "tpu"):  # a plan (a topology's devices, whatever the local count): only over a mesh
        assert A.select_kernel(2, 12, 2048, 2048, 64, bf16, backend="tpu") == "blocked"
        with A.over_mesh(mesh):
            assert A.select_kernel(2, 12, 2048, 2048, 64, bf16, backend="tpu") == "splash"
    assert A.select_kernel(2, 12, 2048, 2048, 64, bf16, backend="tpu") == "splash"
    assert A.select_kernel(2, 12, 2048, 2048, 64, bf16, backend="cpu") == "blocked"
    assert A.select_kernel(2, 12, 2000, 2000, 64, bf16, backend="tpu") == "blocked"  # not a multiple of 128
    assert A.select_kernel(2, 12, 64, 2048, 64, bf16, backend="tpu") == "blocked"  # a cache
    assert A.select_kernel(2, 12, 2048, 2048, 64, bf16, backend="tpu", window_static=False) == "splash"
    # through the model-facing entry point, with the backend name monkeypatched
    args, _ = rows("right", b=2)
    chosen = []
    for backend in ("tpu", "cpu"):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        with A.planning_for(None) as got:  # traced only: a TPU kernel does not lower for the CPU
            jax.make_jaxpr(lambda *a: A.dot_product_attention(*a, scale=SCALE))(*args)
        chosen += got
    assert chosen == [("splash", "splash"), ("exact", "exact")]  # 256 keys: exact off a TPU
    monkeypatch.setenv(A.ENV_VAR, "splash")
    assert A.select_kernel(2, 12, 512, 512, 64, bf16, backend="cpu") == "splash"


def test_planning_tpu_on_cpu_devices_compiles_the_stand_in(monkeypatch):
    monkeypatch.delenv(A.ENV_VAR, raising=False)
    args, _ = rows("right", b=2)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with A.planning_for("tpu", "cpu") as got:  # an engine step: traced over its mesh
        jax.jit(A.traced_over(mesh, lambda *a: A.dot_product_attention(*a, scale=SCALE))).lower(*args)
    assert got == [("splash", "blocked")]


HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="needs the libtpu wheel (pip install libtpu)")
def test_token_stats_step_compiles_splash_for_a_tpu_slice():
    """libtpu compiles the Pythia-shaped token-stats step with splash on a v5e:2x4 slice (data=2, model=4:
    shard_map over rows and heads). Splash buys speed, not memory: the blocked kernel is already linear in the
    length, and the step's temporaries with splash stay within 5% of the blocked kernel's (docs/benchmarks.md)."""
    env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", JAX_PLATFORMS="cpu")
    out = {}
    for kernel in ("auto", "blocked"):
        env["MIA_ATTENTION"] = kernel
        r = subprocess.run([sys.executable, "-m", "mia", "plan", "--model", "pythia-70m", "--topology", "v5e:2x4",
                            "--mesh", "data=2,model=4", "--batch", "4", "--length", "1024"],
                           capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        out[kernel] = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["auto"]["attention"] == [{"chosen": "splash", "compiled": "splash"}]
    assert out["blocked"]["attention"] == [{"chosen": "blocked", "compiled": "blocked"}]
    assert out["auto"]["temp_bytes"] <= 1.05 * out["blocked"]["temp_bytes"]


MESH_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from mia.sharding import make_mesh
from mia.models import attention as A
sys.path.insert(0, "tests")
from test_splash import SCALE, rows

mesh = make_mesh({"data": 2, "model": 2}, jax.devices())
out = {}
for kind, kv_heads in (("right", 2), ("packed", 1)):  # heads over model (4 and 2 divide by 2); MQA: heads replicated
    args, live = rows(kind, b=4, kv_heads=kv_heads)
    spec = NamedSharding(mesh, P("data"))
    placed = [jax.device_put(a, spec) for a in args]
    fn = A.traced_over(mesh, lambda *a: A.splash_attention(*a, scale=SCALE, interpret=True))
    got = np.asarray(jax.jit(fn)(*placed))
    text = jax.jit(fn).lower(*placed).as_text()
    want = np.asarray(A.exact_attention(*args, scale=SCALE))
    out[kind] = {"err": float(np.abs(got[live] - want[live]).max()), "shard_map": "shard_map" in text or
                 "sdy.manual_computation" in text}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_splash_under_shard_map_on_a_mesh_equals_exact():
    """On 4 CPU devices (data=2, model=2), the engine's way (``traced_over``): splash runs per device under
    shard_map (rows over data; heads over model for GQA, replicated for MQA) and still equals exact."""
    env = dict(os.environ, XLA_FLAGS=device_flags(4), JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", MESH_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for kind, res in out.items():
        assert res["shard_map"], kind
        assert res["err"] < 2e-5, (kind, res)


def test_whole_model_splash_equals_exact(monkeypatch):
    """A tiny GPT-Neo (a global and a local layer: the traced window) and a GQA Llama on 128-token rows that are left
    padded, right padded or empty, MIA_ATTENTION=splash (interpret mode) vs exact; the splash program holds the
    Pallas call (the lowered text names it)."""
    from test_attention import NEO, _tiny

    rng = np.random.default_rng(0)
    t = 128
    valid = np.ones((3, t), bool)
    valid[0, :30] = False
    valid[1, 100:] = False
    valid[2] = False
    models = [_tiny("gpt_neo", **dict(NEO, max_position_embeddings=t)),
              _tiny("llama", vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=40, max_position_embeddings=t)]
    for model in models:
        tokens = rng.integers(0, 61, (3, t))

        def run(kernel):
            monkeypatch.setenv(A.ENV_VAR, kernel)  # read when traced: a fresh function per kernel
            lowered = jax.jit(lambda p: model.hidden(p, tokens, valid)[0]).lower(model.params)
            return np.asarray(lowered.compile()(model.params)), lowered.as_text()

        (exact, exact_text), (splash, text) = run("exact"), run("splash")
        assert "splash" in text and "splash" not in exact_text
        np.testing.assert_allclose(splash[valid], exact[valid], atol=2e-5, rtol=0)


@pytest.mark.parametrize("window", [None, pytest.param(5, marks=pytest.mark.slow)])
def test_splash_soft_caps_with_its_own_cap(window):
    """Gemma 2's soft cap runs inside splash (``attn_logits_soft_cap``, applied to the pre-scaled scores) and equals
    exact's capped scores; a traced per-layer window (global: splash, local: blocked) caps on both branches."""
    args, live = rows("right")
    cap = 0.7
    want = np.asarray(jax.jit(lambda *a: A.exact_attention(*a, scale=SCALE, window=window, softcap=cap))(*args))
    got = np.asarray(jax.jit(lambda *a: A.splash_attention(*a, scale=SCALE, window=window, softcap=cap,
                                                           interpret=True))(*args))
    np.testing.assert_allclose(got[live], want[live], atol=2e-5, rtol=0)
    assert np.abs(want[live] - _exact(args, window)[live]).max() > 1e-2
    fn = jax.jit(lambda w, *a: A.splash_attention(*a, scale=SCALE, window=w, softcap=cap, interpret=True))
    traced = np.iinfo(np.int32).max if window is None else window
    np.testing.assert_allclose(np.asarray(fn(jnp.int32(traced), *args))[live], want[live], atol=2e-5, rtol=0)
