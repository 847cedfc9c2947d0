"""Generation (mia.engine.generate) and SaMIA on a named mesh give the one-device samples token for token.

8-device checks run in a subprocess (``tests/generate_mesh_check.py``; the device count is fixed when jax starts).
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_sharding import run_script_on_8_devices


def _check(tmp_path, neox_dir, specs):
    return run_script_on_8_devices("generate_mesh_check.py", tmp_path / "gen_mesh.json", neox_dir, *specs)


def _assert_same_as_one_device(report):
    for name, r in report.items():
        assert r["greedy_rows_differ"] == 0 and r["sampled_rows_differ"] == 0, (name, r)
        assert r["candidates_equal"] and r["distinct_candidates"] == 15, (name, r["distinct_candidates"])
        assert r["score_diff"] == {"samia": 0.0, "samia_zlib": 0.0}, (name, r["score_diff"])
        # not trivially equal: the samples vary, some rows stop at the EOS and others run to their own max_new
        assert r["distinct_greedy"] >= 6 and r["rows"] == 21 and r["distinct_sampled"] >= 19, (name, r)
        assert 0 < r["ended_with_eos"] < r["rows"] and max(r["lengths"]) == 12, (name, r)
        assert min(r["scores"]["samia"]) > 0 and np.ptp(r["scores"]["samia"]) > 0, (name, r["scores"])


def _cache_shape(report, key):
    """[L, rows per device, slots, kv heads per device, head dim per device] of the compiled KV-cache buffer."""
    (shape,) = report[key]["cache"]
    return [int(x) for x in shape[4:-1].split(",")]


@pytest.mark.slow  # (30 s: 8 compiled sampling programs on 2 busy cores)
def test_generation_on_data2_model4_equals_one_device(tmp_path, tiny_neox_dir):
    """GPT-NeoX (MHA, 4 heads) loaded with --mesh data=2,model=4 (FSDP + tensor parallel): greedy and sampled
    continuations, and SaMIA scores, equal the one-device ones exactly; the compiled KV cache holds 12 of the 24 rows
    (data=2) and 1 of the 4 heads (model=4) per device, under jax.transfer_guard("disallow")."""
    report = _check(tmp_path, tiny_neox_dir, ["gpt_neox:data=2,model=4"])
    _assert_same_as_one_device(report)
    assert _cache_shape(report, "gpt_neox:data=2,model=4:fsdp") == [2, 12, 11, 1, 8]


@pytest.mark.slow  # (~2 min) every mesh, replicated and FSDP, MHA and grouped-query heads
def test_generation_on_every_mesh_equals_one_device(tmp_path, tiny_neox_dir):
    """data=8, data=2,model=4, model=8 (FSDP), data=2,model=4 replicated, for GPT-NeoX and Llama with grouped-query
    heads (4 query heads on 2 kv heads): every sample and score equal the one-device ones. The cache splits its rows
    over data everywhere, and its kv heads over model when they divide (Llama's 2 kv heads on model=4 or 8, and
    GPT-NeoX's 4 heads on model=8, stay whole on every model device)."""
    specs = ["gpt_neox", "gpt_neox:data=2,model=4:rep", "llama", "llama:data=4,model=2"]
    report = _check(tmp_path, tiny_neox_dir, specs)
    _assert_same_as_one_device(report)
    assert len(report) == 8
    expect = {"gpt_neox:data=8:fsdp": [2, 3, 11, 4, 8], "gpt_neox:data=2,model=4:fsdp": [2, 12, 11, 1, 8],
              "gpt_neox:model=8:fsdp": [2, 24, 11, 4, 8], "gpt_neox:data=2,model=4:rep": [2, 12, 11, 1, 8],
              "llama:data=8:fsdp": [2, 3, 11, 2, 8], "llama:data=2,model=4:fsdp": [2, 12, 11, 2, 8],
              "llama:model=8:fsdp": [2, 24, 11, 2, 8], "llama:data=4,model=2:fsdp": [2, 6, 11, 1, 8]}
    assert {k: _cache_shape(report, k) for k in report} == expect
    print(json.dumps({k: dict(scores=v["scores"]["samia"], distinct=v["distinct_sampled"]) for k, v in report.items()}))


# ------------------------------------------------------------------------------------------------ one device
def test_repeat_rows_is_take_rows():
    from mia.engine.generate import repeat_rows
    from mia.models.common import KVCache

    rng = np.random.default_rng(0)
    kv = KVCache(jnp.asarray(rng.normal(size=(2, 3, 5, 2, 4)), jnp.float32),
                 jnp.asarray(rng.normal(size=(2, 3, 5, 2, 4)), jnp.float32),
                 jnp.asarray(rng.integers(0, 9, (3, 5)), jnp.int32), jnp.asarray(rng.random((3, 5)) > 0.3))
    want = kv.take_rows(jnp.repeat(jnp.arange(3), 4))
    got = repeat_rows(kv, 4)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_decode_step_compiles_on_abstract_shapes(tiny_model):
    """The sampling program can be built and compiled from ShapeDtypeStructs (nothing allocated), as ``mia plan``
    does for the scoring step."""
    from mia.engine.generate import Sampling, build_decode_step
    from mia.sharding import make_mesh, param_shardings

    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tiny_model.params)
    mesh = make_mesh(None, jax.devices()[:1])
    step = build_decode_step(tiny_model, mesh, param_shardings(abstract, mesh), Sampling(max_new=8, n=2, top_k=5))
    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    compiled = step.lower(abstract, s((4, 16), np.int32), s((4, 16), bool), s((4,), np.uint32), s((), np.uint32),
                          s((8,), np.int32), s((), np.float32), s((1,), np.int32), s((), np.int32)).compile()
    assert compiled.memory_analysis() is not None
