"""``mia plan``: ahead-of-time compilation of the scoring step on abstract params, per-device memory, bad input."""
from __future__ import annotations

import importlib.util
import json
import numpy as np
import pytest

from mia.engine.plan import NAMED_SHAPES, PlanError, parse_bytes, plan_scoring

TINY = {"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 256, "vocab_size": 512, "rotary_pct": 0.25, "max_position_embeddings": 4096}
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


class Result:
    def __init__(self, returncode, out):
        self.returncode, self.stdout, self.stderr = returncode, out.out, out.err


@pytest.fixture
def run_plan(capsys):
    """``mia plan ARGS`` in this process: (exit status, stdout, stderr)."""
    from mia.cli import main

    def run(*args):
        capsys.readouterr()
        status = main(["plan", *args])
        return Result(status, capsys.readouterr())

    return run


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("16g") == 16 * 2**30
    assert parse_bytes("1024") == 1024
    with pytest.raises(PlanError):
        parse_bytes("lots")


def test_named_shapes_have_the_published_parameter_counts():
    import jax

    from mia.engine.plan import abstract_model

    published = {"pythia-70m": 70_426_624, "pythia-12b": 11_846_072_320}
    for name, count in published.items():
        _, shapes = abstract_model(NAMED_SHAPES[name], "bfloat16")
        assert sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes)) == count


def test_plan_float32_params_exact_and_activation_peak_linear_in_length():
    """params_bytes is exactly the parameters' bytes; the activation peak (XLA temporaries) at T=4096 is at most
    2.5x the one at T=2048 (a materialised [T, T] score block would make it ~4x)."""
    import jax

    from mia.engine.plan import abstract_model

    _, shapes = abstract_model(TINY, "float32")
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
    short = plan_scoring(TINY, dtype="float32", batch=1, length=2048, device_bytes=2**40)
    long = plan_scoring(TINY, dtype="float32", batch=1, length=4096, device_bytes=1024)
    assert short.params_bytes == long.params_bytes == 4 * n_params
    assert short.peak_bytes >= short.params_bytes + short.temp_bytes - 1
    assert short.fits is True and long.fits is False
    assert long.temp_bytes <= 2.5 * short.temp_bytes, (short.temp_bytes, long.temp_bytes)


def test_cli_prints_a_table_and_ends_with_json(tmp_path, run_plan):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    r = run_plan("--model", str(cfg), "--dtype", "float32", "--batch", "2", "--length", "64", "--device-memory", "1GiB")
    assert r.returncode == 0, r.stderr
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"params_bytes", "peak_bytes", "device_bytes", "fits"} <= set(last)
    assert last["fits"] is True and last["device_bytes"] == 2**30 and last["peak_bytes"] >= last["params_bytes"] > 0
    assert "fits" in r.stdout.splitlines()[-2]


@pytest.mark.parametrize("args, message", [
    (["--model", "no/such/dir"], "no such directory"),
    (["--model", "pythia-70m", "--mesh", "data=3,model=4"], "needs 12 devices"),
    (["--model", "pythia-70m", "--batch", "0"], "--batch must be >= 1"),
    (["--model", "{cfg}", "--length", "64"], "num_attention_heads"),  # 0 heads: the config checks of mia score
    (["--model", "pythia-70m", "--length", "4096"], "--length 4096 is beyond the model's context"),
    (["--model", "pythia-70m", "--device-memory", "0"], "--device-memory '0': must be more than 0 bytes"),
    (["--model", "pythia-70m", "--device-memory=-8GiB"], "--device-memory '-8GiB'"),
    (["--model", "pythia-70m", "--device-memory", "."], "--device-memory '.'"),
])
def test_bad_input_is_one_line_exit_2(args, message, run_plan, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, num_attention_heads=0)))
    r = run_plan(*[a.replace("{cfg}", str(tmp_path / "config.json")) for a in args])
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_plan_context_error_names_both_numbers(run_plan):
    r = run_plan("--model", "pythia-70m", "--length", "4096")
    assert "4096" in r.stderr and f"max_position_embeddings {NAMED_SHAPES['pythia-70m']['max_position_embeddings']}" \
        in r.stderr


@pytest.mark.skipif(HAS_LIBTPU, reason="libtpu is installed here")
def test_topology_without_libtpu_is_one_line_exit_2(run_plan):
    r = run_plan("--model", "pythia-70m", "--topology", "v5e:2x4")
    assert r.returncode == 2 and "needs the libtpu wheel" in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs the libtpu wheel (pip install libtpu)")
def test_topology_compiles_for_tpu_and_refuses_unknown_names(run_plan):
    r = run_plan("--model", "pythia-70m", "--topology", "v5e:2x4", "--mesh", "model=8", "--batch", "2",
                 "--length", "512")
    assert r.returncode == 0, r.stderr
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["device_kind"] == "TPU v5 lite" and last["devices"] == 8 and last["fits"] is True
    r = run_plan("--model", "pythia-70m", "--topology", "v9z:2x4")
    assert r.returncode == 2 and "libtpu does not know it" in r.stderr


def test_mope_plan_reports_its_perturbed_group():
    from mia.engine.plan import parse_plan_attack as parse_attack

    assert parse_attack("mope:n=4,chunk=2") == ("mope", {"mope_n": 4, "mope_chunk": 2})
    with pytest.raises(PlanError):
        parse_attack("mope:n=0")
    r = plan_scoring(TINY, dtype="float32", batch=2, length=64, attack="mope", mope_n=4, mope_chunk=2)
    stats = plan_scoring(TINY, dtype="float32", batch=2, length=64)
    # the largest group: the embedding + head + final norm of TINY (2 x 512 x 64 + 2 x 64 floats) vs one layer
    assert r.group_bytes == 4 * (2 * 512 * 64 + 2 * 64)
    assert r.params_bytes == stats.params_bytes and r.peak_bytes > stats.peak_bytes
