"""Streaming load (``mia.models.load`` through ``mia.sharding.put_params`` / ``read_shard``): each device's
shard is read from the memory map and converted block by block into its final dtype. The params must be bit for
bit those of the whole-leaf path (``hub.params_from_hf``: every leaf stacked whole, widened to float32, converted),
for every family and every checkpoint dtype x parameter dtype; no stacked leaf may be read whole; the host memory a
load costs beyond its result must stay about one block; the finite check must not hold a bool per parameter."""
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from xla_env import device_flags

import mia.models as mm
from mia import sharding
from mia.models import hub
from tiny_configs import PARITY

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def bits(a) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(jax.device_get(a)))
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.itemsize in (1, 2, 4, 8) else a


def wide_values(rng, shape) -> np.ndarray:
    """float32 normals scaled over 10 decades (1e-8..1e2): float16 subnormals, values that bf16/f16 round."""
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-8, 2, shape)).astype(np.float32)


def write_checkpoint(hf: dict, ckpt_dtype: str, path: Path, seed: int = 0) -> Path:
    """A checkpoint of family ``hf["model_type"]`` whose every weight is ``wide_values``, saved in ``ckpt_dtype``."""
    fam = hub.family(hf["model_type"])
    cfg = fam.config_cls.from_hf(hf)
    _, shapes = hub.abstract_params(fam, cfg)
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map(lambda s: wide_values(rng, s.shape), shapes)
    hub.save(mm.from_config(cfg, params=params), path, dtype=ckpt_dtype)
    return path


def reference(path: Path, param_dtype: str):
    """The whole-leaf path: every tensor read whole, widened to float32, converted (``params_from_hf``)."""
    fam, cfg, _ = hub.load_config(path)
    _, shapes = hub.abstract_params(fam, cfg, hub.DTYPES[param_dtype], hub.DTYPES[param_dtype])
    return hub.params_from_hf(hub.read_safetensors(path / "model.safetensors"), fam, cfg, shapes,
                              hub.DTYPES[param_dtype])


def assert_same_bits(got, want):
    g = jax.tree_util.tree_flatten_with_path(got)[0]
    w = jax.tree_util.tree_flatten_with_path(want)[0]
    assert [p for p, _ in g] == [p for p, _ in w]
    for (p, a), (_, b) in zip(g, w):
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(p)
        assert np.array_equal(bits(a), bits(b)), f"{jax.tree_util.keystr(p)}: bits differ"


# ------------------------------------------------------------------------------------------------ conversion
def test_convert_has_the_float32_round_trip_bits():
    """Every source dtype x target dtype: ``convert`` (direct where exact, else through float32 per block) gives the
    bits of ``a.astype(float32).astype(target)``, on normals, subnormals, ties, -0, inf, NaN and overflow."""
    rng = np.random.default_rng(0)
    f32 = np.concatenate([wide_values(rng, 4096), np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e6, -7e4,
                                                              65520.0, 1e-45, 6e-8, 3e-8, 1.00390625, 1.01171875])])
    for src in (np.float64, np.float32, ml_dtypes.bfloat16, np.float16):
        with np.errstate(over="ignore", invalid="ignore"):
            a = f32.astype(src)
        for dst in (np.float32, ml_dtypes.bfloat16, np.float16):
            with np.errstate(over="ignore", invalid="ignore"):
                want = a.astype(np.float32).astype(dst)
            got = sharding.convert(a, dst)
            assert got.dtype == np.dtype(dst)
            assert np.array_equal(bits(got), bits(want)), (np.dtype(src).name, np.dtype(dst).name)


def test_read_shard_blocks_give_the_same_slice(monkeypatch):
    """A shard read a row at a time (strided and transposed sources, a stacked view; transposed parts copied in
    tiles of 3 x 3, partial ones at the edges) is exactly ``host[index]``."""
    monkeypatch.setattr(sharding, "TILE", 3)
    rng = np.random.default_rng(1)
    layers = [wide_values(rng, (6, 10)).T for _ in range(5)]  # transposed views, as a Conv1D/linear mapping gives
    view = hub.StackedView(layers)
    whole = np.stack(layers)
    for index in [(), (slice(1, 4),), (slice(0, 5), slice(2, 8)), (slice(None), slice(None), slice(3, 6))]:
        for block in (1, 100, 10**9):
            got = sharding.read_shard(view, index, ml_dtypes.bfloat16, block_bytes=block)
            assert np.array_equal(bits(got), bits(whole[index].astype(ml_dtypes.bfloat16)))
            assert got.ctypes.data % 64 == 0  # a CPU device takes it over without a copy
    matrix = wide_values(rng, (11, 7)).T  # a plain transposed matrix: blocks along the file's rows
    for index in [(), (slice(2, 5),), (slice(None), slice(4, 11))]:
        got = sharding.read_shard(matrix, index, np.float16, block_bytes=1)
        assert np.array_equal(bits(got), bits(matrix[index].astype(np.float16)))
    assert sharding.read_shard(np.float32(3.5), ()).shape == ()


# ------------------------------------------------------------------------------------------------ bit for bit
COMBOS = [(c, p) for c in DTYPES for p in DTYPES]


@pytest.mark.parametrize("ckpt_dtype, param_dtype", COMBOS)
def test_streamed_load_equals_whole_leaf_load_every_dtype(tmp_path, ckpt_dtype, param_dtype):
    """GPT-NeoX (Pythia's family): every checkpoint dtype x parameter dtype, bit for bit, one row per block."""
    path = write_checkpoint(PARITY["gpt_neox"]().to_dict(), ckpt_dtype, tmp_path / "m")
    want = reference(path, param_dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sharding, "BLOCK_BYTES", 1)
        got = mm.load(path, dtype=param_dtype, param_dtype=param_dtype, tokenizer=False).params
    assert_same_bits(got, want)


@pytest.mark.parametrize("name", sorted(set(PARITY) - {"gpt_neox"}))
@pytest.mark.parametrize("ckpt_dtype, param_dtype", [
    ("bfloat16", "float32"), pytest.param("float32", "bfloat16", marks=pytest.mark.slow)])  # (~3 s each)
def test_streamed_load_equals_whole_leaf_load_every_family(tmp_path, name, ckpt_dtype, param_dtype):
    """Every other family: a bf16 checkpoint into float32 params (and, slow, a float32 one into bf16 params)."""
    path = write_checkpoint(PARITY[name]().to_dict(), ckpt_dtype, tmp_path / "m")
    assert_same_bits(mm.load(path, dtype=param_dtype, tokenizer=False).params, reference(path, param_dtype))


# ------------------------------------------------------------------------------------------------ memory
def test_no_stacked_leaf_is_read_whole(tiny_neox_dir, monkeypatch):
    """With one row per block, every read of a stacked leaf covers one layer: the whole [L, ...] leaf never exists
    on the host beside its shard."""
    reads = []
    real = hub.StackedView.__getitem__

    def spy(self, index):
        out = real(self, index)
        reads.append(out.shape[0] if isinstance(index, tuple) and not isinstance(index[0], int) else 1)
        return out

    monkeypatch.setattr(hub.StackedView, "__getitem__", spy)
    monkeypatch.setattr(hub.StackedView, "__array__", lambda *a, **k: pytest.fail("a stacked leaf was read whole"))
    monkeypatch.setattr(sharding, "BLOCK_BYTES", 1)
    model = mm.load(tiny_neox_dir, tokenizer=False)
    assert max(reads, default=1) == 1  # (the loader reads each layer's own tensor: no view reads at all)
    assert model.params["layers"]["mlp_dense_h_to_4h"]["kernel"].shape[0] == 2


def test_host_transient_of_a_load_is_about_one_block(tmp_path):
    """numpy's host allocations (``tracemalloc``) while placing a bf16 checkpoint as float32 params: the peak
    beyond what is still held at the end (on a CPU, the params themselves) stays under one block plus a layer, where
    the whole-leaf path held the stacked leaf, its float32 copy and a converted copy (3x the largest leaf)."""
    hf = dict(PARITY["gpt_neox"]().to_dict(), hidden_size=160, intermediate_size=640, num_hidden_layers=6,
              num_attention_heads=5)
    path = write_checkpoint(hf, "bfloat16", tmp_path / "m")
    fam, cfg, _ = hub.load_config(path)
    _, shapes = hub.abstract_params(fam, cfg)
    views = hub.host_params_from_hf(hub.read_safetensors(path / "model.safetensors"), fam, cfg, shapes)
    leaf = 160 * 640 * 4 * 6  # the largest leaf, float32 (an MLP kernel)
    block = 64 << 10
    shardings = sharding.param_shardings(shapes, sharding.make_mesh(), fsdp=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sharding, "BLOCK_BYTES", block)
        tracemalloc.start()
        try:
            params = sharding.put_params(views, shardings, dtype=jnp.float32)
            jax.block_until_ready(params)
            end, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak - end <= block + 160 * 640 * 4, (peak - end, leaf)
    assert_same_bits(params, reference(path, "float32"))


def picked_rule(monkeypatch):
    """The finite rule ``hub._finite_flags`` calls on this backend (its name and the function), found by spying on
    both candidates while it checks one leaf (compiled: ``host_bytes=0``)."""
    called, rules = [], {n: getattr(hub, n) for n in ("finite_leaves", "finite_leaves_isfinite")}
    with monkeypatch.context() as m:
        for name, rule in rules.items():
            m.setattr(hub, name, lambda leaves, name=name, rule=rule: called.append(name) or rule(leaves))
        hub._finite_flags([jnp.ones(3)], host_bytes=0)
    assert len(called) == 1, called
    return called[0], rules[called[0]]


def test_finite_check_holds_no_bool_per_parameter(monkeypatch):
    """The rule the finite check uses here (``_finite_flags``' pick) compiles to reductions without a temporary the
    size of the parameters: the frugal rule, which its own check (``finite_rule_holds``) confirms on this backend."""
    name, rule = picked_rule(monkeypatch)
    assert name == "finite_leaves" and hub.finite_rule_holds()
    leaves = [jax.ShapeDtypeStruct((4, 256, 1024), jnp.float32), jax.ShapeDtypeStruct((4, 1024), jnp.bfloat16),
              jax.ShapeDtypeStruct((0,), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.int32)]
    memory = jax.jit(rule).lower(leaves).compile().memory_analysis()
    assert memory.temp_size_in_bytes < 4096, memory.temp_size_in_bytes
    x = np.ones((2, 3), np.float32)
    for bad, ok in ((np.nan, False), (np.inf, False), (-np.inf, False), (3e38, True)):
        y = x.copy()
        y[1, 2] = bad
        leaves = [jnp.asarray(y), jnp.asarray(x, jnp.bfloat16), jnp.zeros((0,)), jnp.arange(3)]
        for host_bytes in (0, hub.HOST_FINITE_CHECK_BYTES):  # compiled, then in NumPy
            assert hub._finite_flags(leaves, host_bytes=host_bytes).tolist() == [ok, True, True, True], bad


def test_small_cpu_params_are_checked_in_numpy_and_large_ones_compiled(monkeypatch):
    """The finite check reads a small model held by CPU devices in NumPy (no program to compile) and compiles the
    reduction for anything larger than ``host_bytes``: the flags agree either way."""
    leaves = [jnp.ones((64, 64)), jnp.asarray(np.full(8, np.nan), jnp.bfloat16), np.arange(4)]
    assert hub._host_checkable(leaves) and not hub._host_checkable(leaves, host_bytes=64 * 64 * 4)
    assert not hub._host_checkable([jnp.ones(3), object()])
    compiled = []
    monkeypatch.setattr(hub, "finite_leaves", lambda ls, rule=hub.finite_leaves: compiled.append(1) or rule(ls))
    assert hub._finite_flags(leaves).tolist() == [True, False, True] and not compiled
    assert hub._finite_flags(leaves, host_bytes=64 * 64 * 4).tolist() == [True, False, True] and compiled


@pytest.mark.parametrize("host_bytes", [0, 1 << 30], ids=["compiled", "numpy"])
@pytest.mark.parametrize("dtype", [np.float32, "bfloat16", "bfloat16 as float32"])
@pytest.mark.parametrize("damage", ["all nan", "one nan", "one inf", "one -inf"])
def test_finite_check_sees_nan_in_large_leaves(damage, dtype, host_bytes):
    """Leaves large enough for XLA:CPU to vectorise the reduction (64,000 elements): its float32 max drops NaN (an
    all-NaN leaf's max |x| is -inf, one NaN among ones gives 1), so the check must not rest on max; every damage is
    seen by the check ``_finite_flags`` runs, alone or among healthy leaves, in float32 and bfloat16 leaves, and in
    a bfloat16 leaf widened to float32 (a bf16 checkpoint loaded as float32 params: what a CPU run does, and the bf16
    case a max-based rule misses here, where a bf16 max happens to keep the NaN)."""
    x = np.ones((1000, 64), np.float32)
    if damage == "all nan":
        x[:] = np.nan
    else:
        x[617, 33] = {"one nan": np.nan, "one inf": np.inf, "one -inf": -np.inf}[damage]
    if dtype == "bfloat16 as float32":
        leaf, dtype = jnp.asarray(jnp.asarray(x, jnp.bfloat16), jnp.float32), np.float32
    else:
        leaf = jnp.asarray(x, dtype)
    healthy = jnp.ones((1000, 64), dtype)
    assert hub._finite_flags([healthy, leaf, healthy], host_bytes=host_bytes).tolist() == [True, False, True]
    assert hub.finite_rule_holds()


def test_a_nan_in_a_bfloat16_checkpoint_loaded_as_float32_is_refused(tmp_path):
    """A bf16 checkpoint (as on the Hub) with one NaN in its largest tensor (32,768 values), loaded as float32 params
    (the CPU's default): ``load`` refuses it naming the tensor. (bf16 params: the leaf-level cases above.)"""
    from mia.models.hub import CheckpointError, read_safetensors, write_safetensors

    hf = dict(PARITY["gpt_neox"]().to_dict(), hidden_size=64, intermediate_size=256, num_attention_heads=4)
    path = write_checkpoint(hf, "bfloat16", tmp_path / "m")
    tensors = {k: np.array(v) for k, v in read_safetensors(path / "model.safetensors").items()}
    big = max(tensors, key=lambda k: (tensors[k].size, k))
    assert tensors[big].dtype == ml_dtypes.bfloat16 and tensors[big].size >= 16384
    tensors[big].flat[tensors[big].size // 2 + 5] = np.nan
    write_safetensors(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"tensor '{big}' holds 1 non-finite"):
        mm.load(path, dtype="float32", tokenizer=False)


def test_mapped_pages_release_finds_the_maps(tiny_neox_dir):
    tensors = hub.read_safetensors(tiny_neox_dir / "model.safetensors")
    release = hub.mapped_pages_release(tensors.values())
    assert release is not None
    release()  # the maps stay readable: the pages come back from the file
    assert all(np.isfinite(np.asarray(t, np.float32)).all() for t in tensors.values())
    assert hub.mapped_pages_release([np.zeros(3)]) is None


# ------------------------------------------------------------------------------------------------ 8 devices
@pytest.mark.slow  # (~15 s: a subprocess with 8 devices; the bit-for-bit rules it checks are in the default run)
def test_sharded_streamed_load_equals_whole_leaf_load(tmp_path):
    """8 CPU devices, mesh data=2,model=4 with FSDP, one row per block: every leaf's global value is bit for bit the
    whole-leaf path's, and each device holds only its shard (``load_check.py`` in a subprocess)."""
    out = tmp_path / "load.json"
    env = dict(os.environ, XLA_FLAGS=device_flags(8), JAX_PLATFORMS="cpu",
               MIA_COMPILE_CACHE="0", PYTHONPATH=str(ROOT) + os.pathsep + str(TESTS))
    r = subprocess.run([sys.executable, str(TESTS / "load_check.py"), str(out), str(tmp_path)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) == {"gpt_neox/bfloat16->float32", "llama/float32->bfloat16"}
    for name, r in report.items():
        assert r["differ"] == [], (name, r["differ"])
        assert r["split_leaves"] >= 4, name  # the mesh really splits the matrices


@pytest.mark.slow  # (~15 s: two subprocesses)
def test_bench_load_runs_small(capsys):
    """``experiments.bench_load`` on a 1-layer, width-64 model: both rows load the same params (exit 0)."""
    from experiments import bench_load

    assert bench_load.main(["--layers", "1", "--hidden", "64", "--modes", "stream,whole"]) == 0
    out = capsys.readouterr().out
    assert "params identical across rows" in out and "| stream |" in out and "| whole |" in out
