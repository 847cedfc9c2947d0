"""``mia plan``: ahead-of-time compilation of the scoring step on abstract params, per-device memory, bad input."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from mia.engine.plan import NAMED_SHAPES, PlanError, parse_bytes, plan_scoring

TINY = {"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 256, "vocab_size": 512, "rotary_pct": 0.25, "max_position_embeddings": 4096}
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
# the API's plans pin one device, so a run with 8 (XLA_FLAGS) sees the same batch rules; the CLI ones use --batch 8
ONE_DEVICE = __import__("jax").devices()[:1]


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
    short = plan_scoring(TINY, devices=ONE_DEVICE, dtype="float32", batch=1, length=2048, device_bytes=2**40)
    long = plan_scoring(TINY, devices=ONE_DEVICE, dtype="float32", batch=1, length=4096, device_bytes=1024)
    assert short.params_bytes == long.params_bytes == 4 * n_params
    assert short.peak_bytes >= short.params_bytes + short.temp_bytes - 1
    assert short.fits is True and long.fits is False
    assert long.temp_bytes <= 2.5 * short.temp_bytes, (short.temp_bytes, long.temp_bytes)


def test_plan_chooses_attention_for_the_target_platform(run_plan, tmp_path):
    """The kernels are chosen for the platform planned, not the host: bf16 on "gpu" picks cuDNN's (xla), which
    cannot compile without a GPU, so the blocked kernel stands in and the plan says so; on "cpu", or in float32 on
    "gpu" (cuDNN needs 16-bit inputs), nothing stands in; --platform gpu makes --dtype auto bfloat16."""
    gpu = plan_scoring(TINY, devices=ONE_DEVICE, dtype="bfloat16", batch=2, length=256, platform="gpu")
    assert gpu.platform == "gpu" and gpu.attention == (("xla", "blocked"),) and gpu.stand_in
    cpu = plan_scoring(TINY, devices=ONE_DEVICE, dtype="bfloat16", batch=2, length=256, platform="cpu")
    assert cpu.attention == (("exact", "exact"),) and not cpu.stand_in
    f32 = plan_scoring(TINY, devices=ONE_DEVICE, dtype="float32", batch=2, length=256, platform="gpu")
    assert f32.attention == (("exact", "exact"),) and not f32.stand_in and f32.platform == "gpu"
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    r = run_plan("--model", str(cfg), "--batch", "8", "--length", "128", "--platform", "gpu")
    assert r.returncode == 0, r.stderr
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["platform"] == "gpu" and last["attention"] == [{"chosen": "xla", "compiled": "blocked"}]
    assert "bfloat16" in r.stdout.splitlines()[0] and "blocked kernel stood in" in r.stdout


def test_cli_prints_a_table_and_ends_with_json(tmp_path, run_plan):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    r = run_plan("--model", str(cfg), "--dtype", "float32", "--batch", "8", "--length", "64", "--device-memory", "1GiB")
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
    (["--model", "pythia-70m", "--topology", "v5e:2x4", "--platform", "gpu"], "a topology is a TPU slice"),
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
    r = plan_scoring(TINY, devices=ONE_DEVICE, dtype="float32", batch=2, length=64, attack="mope", mope_n=4,
                     mope_chunk=2)
    stats = plan_scoring(TINY, devices=ONE_DEVICE, dtype="float32", batch=2, length=64)
    # the largest group: the embedding + head + final norm of TINY (2 x 512 x 64 + 2 x 64 floats) vs one layer
    assert r.group_bytes == 4 * (2 * 512 * 64 + 2 * 64)
    assert r.params_bytes == stats.params_bytes and r.peak_bytes > stats.peak_bytes


def test_gradient_plan_options():
    import mia.attacks  # noqa: F401 (registers the attacks' planned steps)
    from mia.engine.plan import parse_plan_attack as parse_attack

    assert parse_attack("jl:chunk=2,k=4") == ("jl", {"chunk": 2, "k": 4})
    assert parse_attack("alora") == ("alora", {"chunk": 1})
    with pytest.raises(PlanError, match="gradnorm takes chunk=INT"):
        parse_attack("gradnorm:chunk=0")


@pytest.mark.slow
def test_gradient_plans_hold_chunk_gradients():
    """gradnorm / alora / jl: per-example gradients of ``chunk`` rows at once (each the size of the parameters)."""
    import mia.attacks  # noqa: F401 (registers the attacks' planned steps)

    one = plan_scoring(TINY, devices=ONE_DEVICE, dtype="float32", batch=4, length=64, attack="gradnorm", chunk=1)
    two = plan_scoring(TINY, devices=ONE_DEVICE, dtype="float32", batch=4, length=64, attack="gradnorm", chunk=2)
    stats = plan_scoring(TINY, devices=ONE_DEVICE, dtype="float32", batch=4, length=64)
    assert one.params_bytes == two.params_bytes == stats.params_bytes
    assert two.peak_bytes - one.peak_bytes >= 0.9 * one.params_bytes  # one more gradient alive at once
    assert one.peak_bytes >= stats.peak_bytes + one.params_bytes


# ------------------------------------------------------------------------------------------------ attacks' own steps
def _spy(seen: dict, name: str, make):
    """Wrap a jit factory so that each call records the lowered text and argument shapes of what it runs."""
    import jax

    def factory(*a):
        fn = make(*a)

        def call(*args):
            seen[name] = (fn.lower(*args).as_text(), [x.shape for x in jax.tree_util.tree_leaves(args[-2:])])
            return fn(*args)
        return call
    return factory


@pytest.mark.parametrize("attack, prefix_len, target_len, n_targets, opts", [
    ("recall", 40, 30, 2, {"prefix_len": 40}),   # one 40-token prefix (bucket 64), targets of 30 (bucket 32)
    ("em_mia", 30, 30, 4, {"group": 4}),        # every text a prefix: a group of 4
])
def test_conditional_plan_lowers_the_programs_scoring_runs(attack, prefix_len, target_len, n_targets, opts,
                                                           tiny_model, tiny_neox_dir, monkeypatch):
    """The plan's prefix pass and conditional-LL call are the StableHLO programs loglik_matrix runs, same shapes."""
    from mia.engine import conditional as C
    from mia.engine.batching import ScoringSettings
    from mia.engine.plan import lowered_steps, read_hf_config

    seen = {}
    monkeypatch.setattr(C, "jitted_prefix", _spy(seen, "prefix", C.jitted_prefix))
    monkeypatch.setattr(C, "jitted_conditional", _spy(seen, "conditional", C.jitted_conditional))
    rng = np.random.default_rng(0)
    texts = [rng.integers(0, tiny_model.vocab_size, target_len).astype(np.int32) for _ in range(n_targets)]
    prefixes = [t[-prefix_len:] for t in texts] if attack == "em_mia" else [rng.integers(0, 50, prefix_len)]
    C.loglik_matrix(tiny_model, prefixes, texts, include_first=attack == "recall",
                    settings=ScoringSettings(progress=False))
    rows = seen["conditional"][1][0][0]
    *_, steps = lowered_steps(read_hf_config(str(tiny_neox_dir)), dtype="float32", batch=rows, length=target_len,
                              attack=attack, **opts)
    planned = {name: (lowered.as_text(), shape) for name, shape, lowered in steps}
    assert planned["prefix"][1] == seen["prefix"][1][0] and planned["conditional"][1] == seen["conditional"][1][0]
    assert planned["prefix"][0] == seen["prefix"][0]
    assert planned["conditional"][0] == seen["conditional"][0]


def test_samia_plan_lowers_the_program_generation_runs(tiny_model, tiny_neox_dir, monkeypatch):
    """samia: the decode loop ``generate`` runs for prompts of the first half of --length tokens, n samples each
    continuing to --length (the same StableHLO, the same prompt rows)."""
    from mia.engine import generate as G
    from mia.engine.plan import lowered_steps, read_hf_config

    seen = {}

    def spy(model, cfg):
        real = original(model, cfg)

        def call(*args):
            seen["decode"] = (real.lower(*args).as_text(), args[1].shape, cfg)
            return real(*args)
        return call

    original = G.jitted_decode
    monkeypatch.setattr(G, "jitted_decode", spy)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tiny_model.vocab_size, 16).astype(np.int32) for _ in range(2)]
    G.generate(tiny_model, prompts, max_new=16, n=3, top_k=50, seed=1)
    text, prompt_shape, cfg = seen["decode"]
    *_, steps = lowered_steps(read_hf_config(str(tiny_neox_dir)), dtype="float32", batch=prompt_shape[0], length=32,
                              attack="samia", samia_n=3, top_k=50)
    [(name, shape, lowered)] = steps
    assert cfg == G.Sampling(max_new=16, n=3, top_k=50)
    assert name == "samia" and shape == (prompt_shape[0] * 3, prompt_shape[1] + 16)
    assert lowered.as_text() == text


@pytest.mark.parametrize("attack", ["stats", "camia"])
def test_stats_and_camia_plans_lower_the_program_scoring_runs(attack, tiny_model, tiny_neox_dir, monkeypatch):
    """stats: the pass over --length rows; camia: the pass over the 6x repeated text (``repeated_logprobs``)."""
    from mia.attacks.camia import REPEATS, repeated_logprobs
    from mia.engine import loop
    from mia.engine.batching import ScoringSettings
    from mia.engine.plan import lowered_steps, read_hf_config

    seen = {}
    monkeypatch.setattr(loop, "jitted_token_stats", _spy(seen, "stats", loop.jitted_token_stats))
    rng = np.random.default_rng(1)
    length, settings = 30, ScoringSettings(progress=False)
    rows = [rng.integers(0, tiny_model.vocab_size, length).astype(np.int32) for _ in range(2)]
    if attack == "camia":
        repeated_logprobs(tiny_model, [np.tile(r, REPEATS) for r in rows], settings, tiny_model.max_length)
    else:
        loop.compute_token_stats(tiny_model, [np.pad(r, (0, 2)) for r in rows], settings)  # 32 tokens: a bucket
        length = 32
    shape = seen["stats"][1][0]
    *_, steps = lowered_steps(read_hf_config(str(tiny_neox_dir)), dtype="float32", batch=shape[0], length=length,
                              attack=attack)
    [(_, planned_shape, lowered)] = steps
    assert planned_shape == shape and lowered.as_text() == seen["stats"][0]


@pytest.mark.parametrize("attack", ["recall", "em_mia:group=2", "camia", "samia:n=2,top_k=5"])
def test_attack_plans_are_sane_on_the_cli(attack, run_plan, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(TINY, max_position_embeddings=256)))
    r = run_plan("--model", str(cfg), "--dtype", "float32", "--batch", "8", "--length", "200", "--attack", attack,
                 "--device-memory", "1GiB")
    assert r.returncode == 0, r.stderr
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["peak_bytes"] >= last["params_bytes"] > 0 and last["fits"] is True
    steps = last["steps"]
    assert last["peak_bytes"] == max(s["peak_bytes"] for s in steps.values())
    assert all(s["peak_bytes"] >= last["params_bytes"] for s in steps.values())
    if attack == "camia":  # 6 x 200 tokens, windowed at the 256-token context: rows of 257 (the last only predicted)
        assert steps["camia"]["shape"] == [8, 257]
    elif attack.startswith("samia"):  # prompts of 100 tokens (bucket 128) + 100 new, 2 samples per prompt
        assert steps["samia"]["shape"] == [16, 228] and "SaMIA generation (n=2, top_k=5)" in r.stdout
    else:  # the context rule: prefix max(256 - 200, 128) = 128 tokens, targets cut to 128
        assert steps["prefix"]["shape"] == [1 if attack == "recall" else 2, 128]
        assert steps["conditional"]["shape"] == [8, 128]
        assert "step conditional" in r.stdout


def test_em_mia_prefix_group_costs_memory():
    small = plan_scoring(TINY, devices=ONE_DEVICE, dtype="float32", batch=2, length=512, attack="em_mia", group=1)
    big = plan_scoring(TINY, devices=ONE_DEVICE, dtype="float32", batch=2, length=512, attack="em_mia", group=8)
    assert big.steps["prefix"]["output_bytes"] >= 7.9 * small.steps["prefix"]["output_bytes"]  # the group's KV
    assert big.steps["conditional"]["argument_bytes"] > small.steps["conditional"]["argument_bytes"]


@pytest.mark.parametrize("args, message", [
    (["--attack", "recall:shots=3"], "recall takes prefix_len=INT"),
    (["--attack", "em_mia:group=0"], "em_mia takes group=INT"),
    (["--attack", "pac"], "em_mia[:group=INT], gradnorm[:chunk=1], jl[:chunk=1,k=8], mope[:n=10,chunk=2], recall"),
    (["--attack", "recall", "--length", "4096"], "--length 4096 is beyond the model's context"),
    (["--attack", "em_mia", "--length", "4096"], "--length 4096 is beyond the model's context"),
    (["--attack", "camia", "--length", "4096"], "--length 4096 is beyond the model's context"),
])
def test_attack_bad_input_is_one_line_exit_2(args, message, run_plan):
    r = run_plan("--model", "pythia-70m", *args)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], lines


# ------------------------------------------------------------------------------------------------ libtpu's lock
# libtpu's own text when another process holds /tmp/libtpu_lockfile (its TryAcquireTpuLock), as jax raises it
LOCKED_TEXT = "ABORTED: The TPU is already in use by process with pid 4242. Not attempting to load libtpu.so in this " \
              "process."


@pytest.fixture
def fake_libtpu(monkeypatch, tmp_path):
    """libtpu 'installed', its lock file under tmp_path, and the topology call raising ``fake_libtpu.error``."""
    import jax
    from jax.experimental import topologies

    from mia.engine import plan

    class Fake:
        lock = tmp_path / "libtpu_lockfile"
        error = jax.errors.JaxRuntimeError("INVALID_ARGUMENT: unknown topology")

    def raise_(*a, **k):
        raise Fake.error

    monkeypatch.setattr(plan, "libtpu_installed", lambda: True)
    monkeypatch.setattr(plan, "LIBTPU_LOCK", str(Fake.lock))
    monkeypatch.setattr(topologies, "get_topology_desc", raise_)
    return Fake


def _one_error_line(r):
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_topology_locked_by_libtpu_text_names_the_lock_file(fake_libtpu, run_plan):
    import jax

    fake_libtpu.error = jax.errors.JaxRuntimeError(LOCKED_TEXT)
    line = _one_error_line(run_plan("--model", "pythia-70m", "--topology", "v5e:2x4"))
    assert str(fake_libtpu.lock) in line and "held by another process" in line and "does not know" not in line
    assert "ALLOW_MULTIPLE_LIBTPU_LOAD=1" in line


def test_topology_with_a_held_lock_file_says_so(fake_libtpu, run_plan):
    """A lock file another process holds (a child process takes libtpu's kind of lock, lockf) is reported even
    when the libtpu error text does not mention it; a free or absent file is not."""
    line = _one_error_line(run_plan("--model", "pythia-70m", "--topology", "v5e:2x4"))
    assert "does not know it" in line  # no lock file
    fake_libtpu.lock.write_text("")
    line = _one_error_line(run_plan("--model", "pythia-70m", "--topology", "v5e:2x4"))
    assert "does not know it" in line  # a file nobody holds: libtpu would take it
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); "
                               "os.lockf(fd, os.F_LOCK, 0); print('held', flush=True); time.sleep(120)",
                               str(fake_libtpu.lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = _one_error_line(run_plan("--model", "pythia-70m", "--topology", "v5e:2x4"))
    finally:
        holder.kill()
        holder.wait()
    assert f"libtpu's lock file {fake_libtpu.lock} is held by another process" in line, line


def test_opt_6_7b_from_its_real_config_has_the_published_parameters():
    """OPT-6.7B's published config.json (``tests/configs_opt_phi3.py``): the abstract model has exactly the published
    parameter count (2050 learned positions included), so a plan's parameter bytes are the real model's."""
    import jax

    from mia.engine.plan import abstract_model

    from configs_opt_phi3 import OPT_6_7B, OPT_6_7B_PARAMETERS

    _, shapes = abstract_model(OPT_6_7B, "bfloat16")
    leaves = jax.tree_util.tree_leaves(shapes)
    assert sum(int(np.prod(x.shape)) for x in leaves) == OPT_6_7B_PARAMETERS
    assert {x.dtype for x in leaves} == {np.dtype("bfloat16")}


@pytest.mark.slow  # (about 100 s a topology: libtpu compiles the 6.7B step)
@pytest.mark.skipif(not HAS_LIBTPU, reason="needs the libtpu wheel (pip install libtpu)")
@pytest.mark.parametrize("topology, mesh, batch, per_device", [
    ("v5e:1x1", [], 4, 1), ("v5e:2x4", ["--mesh", "model=8"], 8, 8)])
def test_opt_6_7b_plan_on_v5e_from_its_real_config(topology, mesh, batch, per_device, run_plan, tmp_path):
    """``mia plan`` of OPT-6.7B's published config.json in bf16 at 2048 positions for v5e: one chip holds the whole
    model (2 bytes a parameter) and a batch of 4 within its 15.75 GiB; model=8 holds an eighth of it a chip."""
    from mia.engine.plan import TPU_HBM_BYTES

    from configs_opt_phi3 import OPT_6_7B, OPT_6_7B_PARAMETERS

    (tmp_path / "config.json").write_text(json.dumps(OPT_6_7B))
    r = run_plan("--model", str(tmp_path), "--dtype", "bfloat16", "--topology", topology, *mesh,
                 "--batch", str(batch), "--length", "2048")
    assert r.returncode == 0, r.stderr
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["device_kind"] == "TPU v5 lite" and last["device_bytes"] == TPU_HBM_BYTES["tpu v5 lite"]
    whole = 2 * OPT_6_7B_PARAMETERS
    assert whole / per_device <= last["params_bytes"] <= whole / per_device + 40 * 2**20  # + replicated positions
    assert last["params_bytes"] < last["peak_bytes"] <= last["device_bytes"] and last["fits"] is True


# ------------------------------------------------------------------------------------------------ Gemma-2-9B on v5e
GEMMA2_9B_PARAMETERS = 9_241_705_984  # google/gemma-2-9b's published parameter count (tied head)


def _gemma2_9b() -> dict:
    from test_gemma_mistral import REAL

    return REAL["google/gemma-2-9b"]


def test_gemma2_9b_from_its_real_config_does_not_fit_one_v5e_chip():
    """Gemma-2-9B's published config.json: its bf16 parameters are exactly the published count x 2 bytes, more than
    one v5e chip's 15.75 GiB, so the plan (Gemma's soft-capped attention compiled, exact at 256 positions) says it
    does not fit; the figures are those of the compiled step."""
    import jax

    from mia.engine.plan import TPU_HBM_BYTES, abstract_model

    _, shapes = abstract_model(_gemma2_9b(), "bfloat16")
    assert sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes)) == GEMMA2_9B_PARAMETERS
    r = plan_scoring(_gemma2_9b(), devices=ONE_DEVICE, dtype="bfloat16", batch=1, length=256,
                     device_bytes=TPU_HBM_BYTES["tpu v5 lite"])
    assert r.params_bytes == 2 * GEMMA2_9B_PARAMETERS and r.device_bytes == int(15.75 * 2**30)
    assert r.peak_bytes >= r.params_bytes and r.fits is False and r.attention == (("exact", "exact"),)


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs the libtpu wheel (pip install libtpu)")
def test_gemma2_9b_fits_a_v5e_2x4_slice_with_fsdp(run_plan, tmp_path):
    """On v5e:2x4 with FSDP (data=8) each chip holds an eighth of the parameters, and splash caps the scores."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(_gemma2_9b()))
    r = run_plan("--model", str(cfg), "--topology", "v5e:2x4", "--mesh", "data=8", "--batch", "8", "--length", "2048")
    assert r.returncode == 0, r.stderr
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["device_kind"] == "TPU v5 lite" and last["fits"] is True
    assert last["params_bytes"] <= 2 * GEMMA2_9B_PARAMETERS / 8 * 1.01
