"""The scoring engine on a named mesh (mia.sharding), several processes (mia.engine.distributed), bad input at
the edge.

8-device checks run in subprocesses (the device count is fixed when jax starts): one subprocess scores token stats,
a conditional-LL matrix and MoPe on one device and on data=2,model=4 (``tests/mesh_check.py``).
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from xla_env import device_flags
from jax.sharding import PartitionSpec as P

from mia.engine import distributed
from mia.cli import main
from mia.sharding import MeshError, param_partition_specs, param_shardings, parse_mesh, partition_spec

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def env_with_devices(n):
    return dict(os.environ, XLA_FLAGS=device_flags(n), JAX_PLATFORMS="cpu",
                MIA_COMPILE_CACHE="0",
                PYTHONPATH=str(ROOT) + os.pathsep + str(TESTS))


# ------------------------------------------------------------------------------------------------ pure rules
def test_parse_mesh_and_one_line_errors():
    assert parse_mesh("data=2,model=4", 8) == {"data": 2, "model": 4}
    assert parse_mesh("model=8") == {"data": 1, "model": 8}
    for text, msg in [("data=3,model=4", "--mesh data=3,model=4 needs 12 devices, 8 are visible"),
                      ("rows=8", "unknown axis 'rows'"), ("data=two", "must be an integer"),
                      ("data=0,model=8", "must be >= 1"), ("data", "must be AXIS=SIZE"), ("data=2,data=4", "twice")]:
        with pytest.raises(MeshError, match=msg.replace("(", r"\(")) as e:
            parse_mesh(text, 8)
        assert "\n" not in str(e.value)


def test_partition_rules_by_role_on_flat_and_stacked_layers():
    axes = {"data": 2, "model": 4}
    # flat layer list, and the scanned layout with a leading [L] axis that is never sharded
    assert partition_spec("layers_0/attention_query_key_value/kernel", (32, 96), axes) == P("data", "model")
    assert partition_spec("layers/attention_query_key_value/kernel", (6, 32, 96), axes) == P(None, "data", "model")
    assert partition_spec("layers/attention_query_key_value/bias", (6, 96), axes) == P(None, "model")
    assert partition_spec("layers/attention_dense/kernel", (6, 32, 32), axes) == P(None, "model", "data")
    assert partition_spec("h/mlp_c_proj/kernel", (6, 64, 32), axes) == P(None, "model", "data")
    assert partition_spec("layers/self_attn_k_proj/kernel", (6, 32, 16), axes) == P(None, "data", "model")
    assert partition_spec("layers/input_layernorm/weight", (6, 32), axes) == P(None, None)
    # OPT's fc1/fc2, Phi-3's fused qkv_proj and gate_up_proj (split by output columns, as transformers' TP plan)
    assert partition_spec("layers/fc1/kernel", (6, 32, 64), axes) == P(None, "data", "model")
    assert partition_spec("layers/fc2/kernel", (6, 64, 32), axes) == P(None, "model", "data")
    assert partition_spec("layers/self_attn_qkv_proj/kernel", (6, 32, 64), axes) == P(None, "data", "model")
    assert partition_spec("layers/mlp_gate_up_proj/kernel", (6, 32, 128), axes) == P(None, "data", "model")
    assert partition_spec("embed_in/embedding", (320, 32), axes) == P("model", "data")
    assert partition_spec("lm_head/kernel", (32, 320), axes) == P("data", "model")
    # a vocabulary that model does not divide (GPT-2's 50257) stays whole over model; FSDP takes a dimension
    assert partition_spec("wte/embedding", (50257, 32), axes) == P(None, "data")
    # without FSDP (the default layout) nothing is split over data
    assert partition_spec("lm_head/kernel", (32, 320), axes, fsdp=False) == P(None, "model")
    # heads / MLP width must divide over model: one line naming the tensor and the sizes
    with pytest.raises(MeshError, match=r"tensor layers/mlp_dense_h_to_4h/kernel \[6, 32, 52\]: dimension 2 \(52\) "
                                        r"is not divisible by mesh axis model=8"):
        partition_spec("layers/mlp_dense_h_to_4h/kernel", (6, 32, 52), {"data": 1, "model": 8})


def test_shardings_and_the_step_on_abstract_shapes(tiny_model):
    """The lead's `mia plan` path: shardings and the lowered step from ShapeDtypeStructs, nothing allocated."""
    from mia.engine.loop import build_token_stats_step
    from mia.sharding import batch_sharding, make_mesh, sharded_bytes

    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tiny_model.params)
    specs = param_partition_specs(abstract, {"data": 2, "model": 4})
    assert specs["layers"]["mlp_dense_h_to_4h"]["kernel"] == P(None, "data", "model")
    mesh = make_mesh(None, jax.devices()[:1])  # one device: every byte on it
    shardings = param_shardings(abstract, mesh)
    assert sharded_bytes(abstract, shardings) == sum(x.size * 4 for x in jax.tree_util.tree_leaves(abstract))
    step = build_token_stats_step(tiny_model, mesh, shardings)
    tokens = jax.ShapeDtypeStruct((4, 32), np.int32)
    compiled = step.lower(abstract, tokens, jax.ShapeDtypeStruct((4, 32), bool)).compile()
    assert compiled.memory_analysis() is not None
    assert batch_sharding(mesh).spec == P("data")


# ------------------------------------------------------------------------------------------------ 8 devices
def run_script_on_8_devices(script: str, out, *args) -> dict:
    """Run ``tests/<script> OUT ARGS...`` in a fresh process with 8 fake CPU devices; the JSON it wrote to OUT."""
    r = subprocess.run([sys.executable, str(TESTS / script), str(out), *map(str, args)],
                       env=env_with_devices(8), cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def _mesh_check(tmp_path, tiny_neox_dir, families):
    return run_script_on_8_devices("mesh_check.py", tmp_path / "mesh.json", tiny_neox_dir, *families)


def _assert_mesh_equals_single_device(report):
    for name, r in report.items():
        assert max(r["stats"].values()) <= 1e-5, (name, r["stats"])
        assert r["condll"] <= 1e-5 and r["mope"] <= 1e-5, (name, r["condll"], r["mope"])
        assert r["scale"]["condll"] > 0.1 and r["scale"]["mope"] > 1e-4, (name, r["scale"])  # not trivially zero
        assert r["compiled_stats_programs"] == r["length_buckets"], name  # one program per length bucket


@pytest.mark.slow  # (27 s) the default run keeps test_scores_do_not_depend_on_device_count and the abstract shardings
def test_mesh_data2_model4_equals_one_device_without_transfers(tmp_path, tiny_neox_dir):
    """GPT-NeoX loaded with --mesh data=2,model=4: stats, conditional LL and MoPe equal the one-device float32
    result within 1e-5, under jax.transfer_guard("disallow"), with the parameters really split 8 ways."""
    report = _mesh_check(tmp_path, tiny_neox_dir, ["gpt_neox"])
    _assert_mesh_equals_single_device(report)
    lay = report["gpt_neox"]["layout"]
    qkv = lay["layers/attention_query_key_value/kernel"]
    assert qkv["spec"] == str(P(None, "data", "model"))
    assert qkv["shard"] == [qkv["shape"][0], qkv["shape"][1] // 2, qkv["shape"][2] // 4]
    assert lay["embed_in/embedding"]["shard"] == [lay["embed_in/embedding"]["shape"][0] // 4,
                                                  lay["embed_in/embedding"]["shape"][1] // 2]


@pytest.mark.slow
def test_every_family_on_the_mesh_equals_one_device(tmp_path, tiny_neox_dir):
    report = _mesh_check(tmp_path, tiny_neox_dir, ["gpt_neox", "llama", "gpt2", "gpt_neo", "olmo", "olmo2", "opt",
                                                   "phi3", "mistral", "gemma2", "gemma3_text", "qwen2", "qwen3"])
    _assert_mesh_equals_single_device(report)
    print(json.dumps({k: {"stats": max(v["stats"].values()), "condll": v["condll"], "mope": v["mope"]}
                      for k, v in report.items()}))


# ------------------------------------------------------------------------------------------------ processes
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_coordinator_is_one_line_not_a_hang(tiny_neox_dir, tmp_path, capsys):
    port = _free_port()
    group = distributed.ProcessGroup(f"127.0.0.1:{port}", 2, 1)
    with pytest.raises(distributed.DistributedError, match=f"cannot reach coordinator 127.0.0.1:{port} within 1 s"):
        distributed.initialize(group, timeout=1)
    lonely = distributed.ProcessGroup(f"127.0.0.1:{port}", 2, 0)  # the coordinator, whose peer never comes
    with pytest.raises(distributed.DistributedError, match="only 1 of 2 processes reached the coordinator"):
        distributed.initialize(lonely, timeout=1)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": 1, "tokens": [1, 2, 3]}) + "\n")
    argv = ["score", "--model", str(tiny_neox_dir), "--data", str(data), "--out", str(tmp_path / "o.jsonl"),
            "--no-cache", "--no-progress"]
    cases = [(["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1",
               "--init-timeout", "1"],
              f"error: cannot reach coordinator 127.0.0.1:{port} within 1 s"),
             (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "1"], "expected HOST:PORT"),
             (["--num-processes", "2"], "--num-processes given without --coordinator"),
             (["--mesh", "data=3,model=4"], "error: --mesh data=3,model=4 needs 12 devices, "
                                            + ("1 is visible" if jax.device_count() == 1 else
                                               f"{jax.device_count()} are visible"))]
    for extra, msg in cases:
        assert main(argv + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0], err


def test_environment_variables_name_the_process_group():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert distributed.settings_from(None, None, None, env) == distributed.ProcessGroup("10.0.0.1:1234", 4, 3)
    assert distributed.settings_from(None, None, None, {}) is None
    with pytest.raises(distributed.DistributedError, match="--process-id 4 must be in 0..3"):
        distributed.settings_from("h:1", 4, 4, {})


def _score_args(model_dir, data, out, cache, attacks, extra):
    return [sys.executable, "-m", "mia", "score", "--attacks", attacks, "--no-progress", "--model", str(model_dir),
            "--data", str(data), "--out", str(out), "--cache-dir", str(cache), *extra]


@pytest.mark.parametrize("attacks, extra", [
    pytest.param("loss,mink", [], marks=pytest.mark.slow),  # 2 processes: 18 s
    pytest.param("loss,mink,zlib,mope:n=2,recall_avg", ["--mesh", "data=8"], marks=pytest.mark.slow),
])
def test_two_processes_write_the_scores_of_one_process_byte_for_byte(tiny_neox_dir, tmp_path, attacks, extra):
    """2 processes x 4 CPU devices under jax.distributed (gloo) vs 1 process x 8 devices: identical scores file;
    every process writes the same cache parts (same names, same arrays). Default layout, and (slow) FSDP with the
    model-calling attacks. (With a `model` axis the files agree within 1e-6 but not bit for bit:
    docs/engine.md#hosts.)"""
    rng = np.random.default_rng(5)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": i, "tokens": rng.integers(0, 300, int(rng.integers(3, 60))).tolist(),
                                        "label": i % 2}) + "\n" for i in range(10)))
    single = subprocess.run(_score_args(tiny_neox_dir, data, tmp_path / "one.jsonl", tmp_path / "c-one", attacks,
                                        extra), env=env_with_devices(8), cwd=ROOT, capture_output=True, text=True,
                            timeout=900)
    assert single.returncode == 0, single.stderr[-2000:]
    port = _free_port()
    group = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id"]
    procs = [subprocess.Popen(_score_args(tiny_neox_dir, data, tmp_path / f"p{i}.jsonl", tmp_path / f"c-p{i}", attacks,
                                          extra + group + [str(i)]),
                              env=env_with_devices(4), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    assert (tmp_path / "p0.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert not (tmp_path / "p1.jsonl").exists()  # process 0 alone writes the output
    parts = {i: sorted(p.relative_to(tmp_path / f"c-{i}") for p in (tmp_path / f"c-{i}").rglob("part-*"))
             for i in ("one", "p0", "p1")}
    assert parts["one"] and parts["one"] == parts["p0"] == parts["p1"]
    for rel in parts["one"]:
        if rel.suffix == ".npz":  # conditional LLs (zip members carry timestamps): same arrays
            with np.load(tmp_path / "c-one" / rel) as a, np.load(tmp_path / "c-p1" / rel) as b:
                for k in a.files:
                    np.testing.assert_array_equal(a[k], b[k])
        else:  # token stats: .f32 data and .json index, byte for byte
            assert (tmp_path / "c-one" / rel).read_bytes() == (tmp_path / "c-p1" / rel).read_bytes(), rel
