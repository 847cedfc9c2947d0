"""Attention kernels against the exact reference, the dispatch, and the precision policy (docs/models.md#precision).

Masking is by position id (mia.models.attention): right-padded targets, left-padded prefixes, a prefix cache
(keys = [cache ; current]) and GPT-Neo's local window are all checked on small shapes with blocks that do not
divide the lengths. Memory is checked from XLA's compile-only analysis, never by timing.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mia.models as mm
from mia.models import attention as A
from mia.models.hub import family
from mia.engine.cache import cache_namespace
from mia.engine.stats import token_stats

SCALE = 0.3


def make_inputs(*, b=3, t=13, cache=0, heads=4, kv_heads=2, e=8, left_pad=0, right_pad=4, empty_row=False, seed=0):
    """q, k, v, q_pos, k_pos, k_valid as the families build them, and the query validity [B, T].

    The cache (``cache`` keys) is left padded by ``left_pad`` in row 0; the current tokens are right padded by
    ``right_pad`` in the last row; ``empty_row`` makes row 1 all padding, cache included (fully masked queries).
    """
    rng = np.random.default_rng(seed)
    s = cache + t
    q = rng.normal(size=(b, t, heads, e)).astype(np.float32)
    k = rng.normal(size=(b, s, kv_heads, e)).astype(np.float32)
    v = rng.normal(size=(b, s, kv_heads, e)).astype(np.float32)
    valid_t = np.ones((b, t), bool)
    valid_t[-1, t - right_pad:] = False
    if empty_row:
        valid_t[1] = False
    pos_t = np.maximum(np.cumsum(valid_t, 1) - 1, 0)
    k_pos, k_valid = pos_t, valid_t
    if cache:
        valid_c = np.ones((b, cache), bool)
        valid_c[0, :left_pad] = False
        valid_c[1] = valid_c[1] & (not empty_row)
        pos_c = np.maximum(np.cumsum(valid_c, 1) - 1, 0)
        pos_t = pos_t + (np.max(np.where(valid_c, pos_c, -1), 1) + 1)[:, None]
        k_pos, k_valid = np.concatenate([pos_c, pos_t], 1), np.concatenate([valid_c, valid_t], 1)
    return (q, k, v, pos_t, k_pos, k_valid), valid_t


CASES = {
    "mha_right_pad": dict(kv_heads=4),
    "gqa_right_pad": dict(),
    "gqa_left_padded_prefix_cache": dict(cache=9, left_pad=4, empty_row=True),
    "mqa_long": dict(t=37, kv_heads=1, right_pad=20),
    "local_window": dict(window=4, empty_row=True),
    "local_window_with_cache": dict(window=5, cache=11, left_pad=3),
}


def _split(case):
    kw = dict(CASES[case])
    return kw.pop("window", None), kw


def _exact(args, window):
    return np.asarray(jax.jit(lambda *a: A.exact_attention(*a, scale=SCALE, window=window))(*args))


def _slow_unless(default_cases):
    return [c if c in default_cases else pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES)]


@pytest.mark.parametrize("case", _slow_unless({"gqa_left_padded_prefix_cache", "local_window_with_cache"}))
def test_blocked_equals_exact(case):
    window, kw = _split(case)
    args, valid = make_inputs(**kw)
    want = _exact(args, window)
    got = np.asarray(
        jax.jit(lambda *a: A.blocked_attention(*a, scale=SCALE, window=window, block_q=4, block_k=5))(*args)
    )
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", _slow_unless({"gqa_left_padded_prefix_cache", "local_window"}))
def test_xla_kernel_equals_exact_on_valid_queries(case):
    window, kw = _split(case)
    args, valid = make_inputs(**kw)
    got = np.asarray(jax.jit(lambda *a: A.xla_attention(*a, scale=SCALE, window=window))(*args))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[valid], _exact(args, window)[valid], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kernel", ["blocked", pytest.param("xla", marks=pytest.mark.slow)])
def test_traced_window_from_a_layer_table(kernel):
    """Inside the layer scan GPT-Neo's window is a traced table entry (int32 max = global): the kernel takes it as
    an argument and equals exact with the static window / no window."""
    args, valid = make_inputs(cache=7, left_pad=2, t=11)
    blocks = dict(block_q=4, block_k=3) if kernel == "blocked" else {}
    fn = jax.jit(lambda w, *a: A.KERNELS[kernel](*a, scale=SCALE, window=w, **blocks))
    for traced, static in ((4, 4), (np.iinfo(np.int32).max, None)):
        got = np.asarray(fn(jnp.int32(traced), *args))
        np.testing.assert_allclose(got[valid], _exact(args, static)[valid], atol=1e-5, rtol=0)


def test_plain_layout_detection():
    """The xla kernel's is_causal branch is only taken when it means the same as our mask."""
    plain, _ = make_inputs()
    assert bool(A.plain_causal_layout(*plain[3:]))
    assert not bool(A.plain_causal_layout(*make_inputs(cache=5)[0][3:]))  # a cache: S != T
    q_pos, k_pos, k_valid = plain[3:]
    left = np.roll(k_valid, 2, axis=1)  # left padding in the current tokens
    assert not bool(A.plain_causal_layout(q_pos, k_pos, left))
    shifted = k_pos + 1  # positions that are not the index
    assert not bool(A.plain_causal_layout(shifted, shifted, k_valid))


def test_reachable_blocks_skip_exactly_the_unreachable_ones():
    """Causal: lower block triangle; window: a band; and never a block that holds an allowed pair (brute force)."""
    t, blk = 16, 4
    pos = np.broadcast_to(np.arange(t), (2, t)).reshape(2, t // blk, blk)
    valid = np.ones_like(pos, bool)
    causal = np.asarray(A.reachable_blocks(pos, pos, valid, None))
    np.testing.assert_array_equal(causal, np.tril(np.ones((4, 4), bool)))
    band = np.asarray(A.reachable_blocks(pos, pos, valid, 3))
    np.testing.assert_array_equal(band, np.tril(np.ones((4, 4), bool)) & np.triu(np.ones((4, 4), bool), -1))
    rng = np.random.default_rng(0)
    for window in (None, 3):
        q_pos, k_pos = rng.integers(0, 30, (2, 12)), rng.integers(0, 30, (2, 15))
        k_valid = rng.random((2, 15)) < 0.7
        reach = np.asarray(A.reachable_blocks(q_pos.reshape(2, 3, 4), k_pos.reshape(2, 3, 5), k_valid.reshape(2, 3, 5),
                                              window))
        allowed = (k_pos[:, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
        if window is not None:
            allowed &= q_pos[:, :, None] - k_pos[:, None, :] < window
        needed = allowed.any(0).reshape(3, 4, 3, 5).any(axis=(1, 3))
        assert not (needed & ~reach).any()


def test_bfloat16_inputs_accumulate_in_float32():
    """On bf16 q/k/v the blocked kernel matches exact float32 attention on the upcast inputs to bf16 output
    rounding, and its score and value matmuls produce float32 (the lowered text is the evidence)."""
    args, valid = make_inputs(t=40, right_pad=9, seed=3)
    bf = [jnp.asarray(a, jnp.bfloat16) for a in args[:3]] + list(args[3:])
    up = [np.asarray(a, np.float32) for a in bf[:3]] + list(args[3:])
    lowered = jax.jit(lambda *a: A.blocked_attention(*a, scale=SCALE, block_q=8, block_k=8)).lower(*bf)
    got = lowered.compile()(*bf)
    assert got.dtype == jnp.bfloat16
    want = _exact(up, None)
    err = np.abs(np.asarray(got, np.float32) - want)[valid]
    assert err.max() < 2e-2 and err.mean() < 3e-3, (err.max(), err.mean())
    dots = [line for line in lowered.as_text().splitlines() if "dot_general" in line]
    assert len(dots) == 2 and all(re.search(r"bf16>\) -> tensor<[0-9x]+xf32>", d) for d in dots), dots


@pytest.mark.parametrize("case", ["gqa_left_padded_prefix_cache", "local_window_with_cache"])
def test_bfloat16_exact_and_blocked_round_the_same_weights(case):
    """In bf16 the exact and blocked kernels round the same softmax weights (integer row maxima make the online
    rescaling a power of two), so they agree to float32 summation order: at most one bf16 step on a rare element.
    A softmax rounded after normalisation against the blocked recurrence differs on about a third of the outputs."""
    window, kw = _split(case)
    args, valid = make_inputs(**{**kw, "t": 37, "right_pad": 9, "e": 16}, seed=5)
    args = [jnp.asarray(a, jnp.bfloat16) * 3 for a in args[:3]] + list(args[3:])  # peaked softmaxes
    exact = np.asarray(A.exact_attention(*args, scale=SCALE, window=window), np.float32)[valid]
    blocked = np.asarray(A.blocked_attention(*args, scale=SCALE, window=window, block_q=8, block_k=8),
                         np.float32)[valid]
    differ = exact != blocked
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(exact), 1e-30))) - 7)  # one bf16 step at each value
    assert differ.mean() < 1e-2, differ.mean()
    assert np.all(np.abs(exact - blocked)[differ] <= step[differ] * 1.01)


def test_dispatch_auto_and_override(monkeypatch):
    f32, bf16 = jnp.float32, jnp.bfloat16
    sel = lambda *shape, dtype=f32, backend="cpu": A.select_kernel(*shape, dtype, backend=backend)  # noqa: E731
    monkeypatch.delenv(A.ENV_VAR, raising=False)
    assert sel(8, 8, 512, 512, 64) == "exact"
    assert sel(2, 8, 2048, 2048, 64) == "blocked"
    assert sel(2, 8, 64, 600, 64) == "blocked"  # a long cached prefix
    assert sel(64, 32, 512, 512, 128) == "blocked"  # scores over EXACT_MAX_SCORE_BYTES
    assert sel(2, 8, 2048, 2048, 64, dtype=bf16, backend="gpu") == "xla"
    assert sel(2, 8, 64, 2048, 64, dtype=bf16, backend="gpu") == "blocked"  # cache: not cuDNN's mask
    assert sel(2, 8, 2048, 2048, 64, backend="gpu") == "blocked"  # float32: cuDNN flash needs bf16/fp16
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with A.over_mesh(one):  # inside an engine step (any device count): tests/test_splash.py has the other cases
        assert sel(2, 8, 2048, 2048, 64, dtype=bf16, backend="tpu") == "splash"  # Pallas splash
    assert sel(2, 8, 64, 2048, 64, dtype=bf16, backend="tpu") == "blocked"  # a cache
    for name in A.KERNEL_NAMES:
        monkeypatch.setenv(A.ENV_VAR, name.upper())
        assert sel(8, 8, 512, 512, 64) == name
    monkeypatch.setenv(A.ENV_VAR, "flash")
    with pytest.raises(ValueError, match="MIA_ATTENTION='flash'"):
        sel(8, 8, 512, 512, 64)


def _tiny(model_type, **hf):
    """A float32 model of ``model_type`` with N(0, 0.3) weights drawn by numpy (no init to compile)."""
    fam = family(model_type)
    cfg = fam.config_cls.from_hf({"model_type": model_type, **hf})
    _, shapes = mm.hub.abstract_params(fam, cfg)
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map(lambda s: jnp.asarray(rng.normal(0, 0.3, s.shape), jnp.float32), shapes)
    return mm.from_config(cfg, params=params)


NEO = dict(vocab_size=61, hidden_size=24, num_layers=2, num_heads=3, intermediate_size=40,
           max_position_embeddings=64, window_size=5, attention_types=[[["global", "local"], 1]])


def test_whole_model_blocked_equals_exact(monkeypatch):
    """GPT-Neo (a global and a local layer) on rows that are left padded, right padded or both, under
    MIA_ATTENTION=blocked (blocks of 4 and 5) vs exact; the blocked program holds only 4 x 5 score blocks."""
    model = _tiny("gpt_neo", **NEO)
    tokens, valid = np.random.default_rng(0).integers(0, 61, (3, 23)), np.ones((3, 23), bool)
    valid[0, :6] = False
    valid[1, 17:] = False
    valid[2, :3] = valid[2, 20:] = False
    monkeypatch.setattr(A, "BLOCK_Q", 4)
    monkeypatch.setattr(A, "BLOCK_K", 5)

    def run(kernel):
        monkeypatch.setenv(A.ENV_VAR, kernel)  # read when traced: a fresh function per kernel
        lowered = jax.jit(lambda p: model.hidden(p, tokens, valid)[0]).lower(model.params)
        return np.asarray(lowered.compile()(model.params)), lowered.as_text()

    (exact, exact_text), (blocked, blocked_text) = run("exact"), run("blocked")
    full, block = "tensor<3x3x1x23x23xf32>", "tensor<3x3x1x4x5xf32>"  # scores [B, K, G, T, S] vs one block of them
    assert full in exact_text and block not in exact_text
    assert block in blocked_text and full not in blocked_text
    np.testing.assert_allclose(blocked[valid], exact[valid], atol=1e-5, rtol=0)


def _temp_bytes(kernel, t):
    """Compile only (nothing runs): XLA:CPU temp bytes of one float32 attention call, B=1, 8 heads of 64."""
    q = jax.ShapeDtypeStruct((1, t, 8, 64), jnp.float32)
    pos, valid = jax.ShapeDtypeStruct((1, t), jnp.int32), jax.ShapeDtypeStruct((1, t), jnp.bool_)
    fn = jax.jit(lambda *a: A.KERNELS[kernel](*a, scale=0.125))
    return fn.lower(q, q, q, pos, pos, valid).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("kernel, low, high", [("blocked", 1.0, 2.5),
                                               pytest.param("exact", 3.5, 4.5, marks=pytest.mark.slow)])
def test_attention_memory_growth_from_2048_to_4096(kernel, low, high):
    """Temp bytes at T = 4096 over T = 2048 (docs/benchmarks.md#attention): blocked linear (measured 1.65x), exact
    quadratic (4x)."""
    ratio = _temp_bytes(kernel, 4096) / _temp_bytes(kernel, 2048)
    assert low <= ratio <= high, ratio


# ------------------------------------------------------------------------------------------------ precision policy
LLAMA = dict(vocab_size=67, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)


def _dots(text):
    return [line for line in text.splitlines() if "dot_general" in line]


@pytest.fixture(scope="module")
def llama32():
    return _tiny("llama", **LLAMA)


def _as(model, dtype):
    """The same weights in another dtype mode."""
    act, par = mm.hub.resolve_dtypes(dtype)
    params = jax.tree_util.tree_map(lambda x: x.astype(par), model.params)
    return mm.from_config(model.config, params=params, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_float32_compute_uses_highest_precision_on_every_matmul(llama32, dtype):
    """Every dot of the jitted token stats (layers, attention, LM head) carries HIGHEST: TF32 on GPUs and one bf16
    pass on TPUs would break parity. CPU numerics do not change, so the lowered text is the evidence."""
    model = _as(llama32, dtype)
    tokens, valid = jnp.zeros((2, 12), jnp.int32), jnp.ones((2, 12), bool)
    text = jax.jit(lambda p, t, v: token_stats(model, p, t, v)).lower(model.params, tokens, valid).as_text()
    dots = _dots(text)
    assert len(dots) >= 9 + 1  # per layer q, k, v, o, 3 MLP, 2 attention (once if layers are scanned); LM head
    assert all("precision = [HIGHEST, HIGHEST]" in d for d in dots)


def test_bfloat16_head_returns_float32_logits(llama32):
    model = _as(llama32, "bfloat16")
    tokens = jnp.zeros((2, 12), jnp.int32)
    lowered = jax.jit(lambda p: model.logits(p, tokens)).lower(model.params)
    head = [d for d in _dots(lowered.as_text()) if "x67x" in d]  # the only matmul with the vocabulary (67)
    assert len(head) == 1 and re.search(r"tensor<24x67xbf16>\) -> tensor<2x12x67xf32>", head[0]), head
    assert lowered.out_info.dtype == jnp.float32
    assert model.matmul_precision is None


def test_float16_keeps_fp16_checkpoint_exactly(llama32, tmp_path):
    """An fp16 checkpoint: float16 mode keeps every weight bit for bit and computes as float32 mode does (bf16 vs
    float32 is tests/test_families_parity.py::test_bfloat16_close_to_float32); three modes, three cache namespaces."""
    mm.save(llama32, tmp_path, dtype="float16")
    m32, m16, mbf = (mm.load(tmp_path, dtype=d, tokenizer=False) for d in ("float32", "float16", "bfloat16"))
    assert {x.dtype for x in jax.tree_util.tree_leaves(m16.params)} == {jnp.dtype(jnp.float16)}
    for a, b in zip(jax.tree_util.tree_leaves(m16.params), jax.tree_util.tree_leaves(m32.params)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))
    rng = np.random.default_rng(1)
    tokens, valid = rng.integers(0, 67, (2, 11)), np.ones((2, 11), bool)
    valid[1, 6:] = False
    l32, l16 = (np.asarray(jax.jit(m.logits)(m.params, tokens, valid)) for m in (m32, m16))
    assert l16.dtype == np.float32
    np.testing.assert_allclose(l16[valid], l32[valid], atol=1e-6, rtol=0)
    assert {x.dtype for x in jax.tree_util.tree_leaves(mbf.params)} == {jnp.dtype(jnp.bfloat16)}
    assert len({cache_namespace(m) for m in (m32, m16, mbf)}) == 3


def test_auto_dtype_follows_the_backend(llama32, tmp_path, monkeypatch):
    """auto (the default of load, from_config and `mia score --dtype`) is float32 on a CPU and bfloat16 on a GPU or
    TPU; an explicit mode is kept whatever the backend; a bf16 model's runs say so in their notes."""
    assert mm.hub.default_dtype("cpu") == "float32"
    assert mm.hub.default_dtype("gpu") == mm.hub.default_dtype("tpu") == "bfloat16"
    assert mm.hub.resolve_dtype("auto", "tpu") == "bfloat16" and mm.hub.resolve_dtype("float16", "gpu") == "float16"
    mm.save(llama32, tmp_path, dtype="float32")
    assert jax.default_backend() == "cpu"
    here = mm.load(tmp_path, tokenizer=False)
    assert {x.dtype for x in jax.tree_util.tree_leaves(here.params)} == {jnp.dtype(jnp.float32)}
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # what auto resolves by
    on_gpu = mm.load(tmp_path, tokenizer=False)
    assert on_gpu.compute_dtype == "bfloat16"
    assert {x.dtype for x in jax.tree_util.tree_leaves(on_gpu.params)} == {jnp.dtype(jnp.bfloat16)}
    with pytest.raises(ValueError, match="supported: auto, float32, bfloat16, float16"):
        mm.load(tmp_path, dtype="fp8", tokenizer=False)


def test_a_bfloat16_run_says_it_computes_in_bfloat16(llama32):
    import mia

    rows = [{"id": f"x{i}", "tokens": list(range(1 + i, 9 + i)), "label": i % 2} for i in range(4)]
    notes = {d: mia.score(_as(llama32, d), rows, "loss", cache=False, progress=False).notes
             for d in ("float32", "bfloat16")}
    assert not any("computes in" in n for n in notes["float32"])
    assert any("computes in bfloat16" in n for n in notes["bfloat16"])


# ------------------------------------------------------------------------------------------------ soft caps (Gemma 2)
CAP = 0.7  # small enough that tanh bites on these N(0, 1) inputs (|q . k| * SCALE reaches ~3)


def numpy_capped_attention(q, k, v, q_pos, k_pos, k_valid, *, scale, window, softcap):
    """An obvious float64 reference: scores * scale, softcap * tanh(s / softcap), the position-id mask, softmax."""
    b, t, h, e = q.shape
    g = h // k.shape[2]
    kk, vv = np.repeat(k, g, axis=2).astype(np.float64), np.repeat(v, g, axis=2).astype(np.float64)
    s = np.einsum("bthe,bshe->bhts", q.astype(np.float64), kk) * scale
    s = softcap * np.tanh(s / softcap)
    allowed = (k_pos[:, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
    if window is not None:
        allowed &= q_pos[:, :, None] - k_pos[:, None, :] < window
    s = np.where(allowed[:, None], s, -1e30)  # finite: a fully masked (padding) row stays finite
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhts,bshe->bthe", p / p.sum(-1, keepdims=True), vv)


@pytest.mark.parametrize("kernel", ["exact", "blocked", "xla"])
@pytest.mark.parametrize("case", ["gqa_left_padded_prefix_cache", "local_window_with_cache"])
def test_soft_capped_scores_in_every_kernel(kernel, case):
    """Each kernel caps the scaled scores before masking, as transformers' Gemma 2 does (NumPy float64 reference);
    leaving the cap out would move the outputs by far more than the tolerance."""
    window, kw = _split(case)
    args, valid = make_inputs(**kw)
    blocks = dict(block_q=4, block_k=5) if kernel == "blocked" else {}
    got = np.asarray(jax.jit(lambda *a: A.KERNELS[kernel](*a, scale=SCALE, window=window, softcap=CAP, **blocks))(
        *args))
    want = numpy_capped_attention(*args, scale=SCALE, window=window, softcap=CAP)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-5, rtol=0)
    assert np.abs(_exact(args, window)[valid] - want[valid]).max() > 1e-2  # the cap matters here


def test_auto_never_picks_xla_for_capped_scores():
    """cuDNN has no soft cap: on a GPU, auto picks xla for a plain bf16 model and the kernel a CPU would for a capped
    one; dot_product_attention records that choice (no silent drop of the cap)."""
    gpu = dict(backend="gpu")
    assert A.auto_kernel(2, 4, 256, 256, 64, jnp.bfloat16, **gpu) == "xla"
    assert A.auto_kernel(2, 4, 256, 256, 64, jnp.bfloat16, softcap=50.0, **gpu) == "exact"
    assert A.auto_kernel(2, 4, 4096, 4096, 64, jnp.bfloat16, softcap=50.0, **gpu) == "blocked"
    args, _ = make_inputs()
    with A.planning_for("gpu", "cpu") as chosen:
        jax.jit(lambda *a: A.dot_product_attention(*a, scale=SCALE, softcap=CAP)).lower(
            *[jnp.asarray(x, jnp.bfloat16) for x in args[:3]], *args[3:])
    assert chosen == [("exact", "exact")]
