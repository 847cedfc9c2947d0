"""Llama 3.x RoPE scaling (``mia.models.rope``) and the Qwen2 / Qwen2.5 / Qwen3 families.

Frequencies against transformers' rotary modules; the published config.json of real checkpoints parsed whole and
run at a tiny depth and width against transformers' PyTorch model; every refusal naming its field; the scaling and
the sliding window shown to matter (the parity tests would fail without them); ``mia plan`` on the 7-8B shapes.
The tiny parity models themselves are in tests/tiny_configs.py (``llama3_rope``, ``qwen2``, ``qwen3``), checked by
tests/test_families_parity.py with every other family.
"""
from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
import transformers as tf

import mia.models as mm
from mia.models import rope
from mia.models.common import ConfigError
from mia.models.family import FAMILIES, family_of_config, read_config

from hf_tiny import padded_batch, save_tiny, torch_logits
from real_configs import REAL
from tiny_configs import LLAMA3_ROPE, PARITY, V

LENGTHS = [13, 7, 1, 10]


def _worst(got, want, mask) -> float:
    return max(float(np.abs(got[i, :n] - want[i, :n]).max()) for i, n in enumerate(mask.sum(1)))


def _logit_diff(model, ref, lengths=LENGTHS, seed=2) -> float:
    tokens, mask = padded_batch(V, lengths, seed=seed)
    return _worst(np.asarray(model.logits(model.params, tokens, mask.astype(bool))), torch_logits(ref, tokens, mask),
                  mask)


def _hf_rotary(hf: dict):
    """transformers' rotary module of config.json ``hf`` (its inv_freq buffer is what the model uses)."""
    cfg = tf.AutoConfig.for_model(**hf)
    module = {"llama": tf.models.llama.modeling_llama.LlamaRotaryEmbedding,
              "qwen2": tf.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding,
              "qwen3": tf.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding}[hf["model_type"]]
    return cfg, module(cfg)


# ------------------------------------------------------------------------------------------------ frequencies
@pytest.mark.parametrize("params, head_dim", [
    ({"rope_type": "default", "rope_theta": 500000.0}, 128),
    ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}, 12),
    (REAL["meta-llama/Llama-3.1-8B"][0]["rope_scaling"] | {"rope_theta": 500000.0}, 128),
    (REAL["meta-llama/Llama-3.2-1B"][0]["rope_scaling"] | {"rope_theta": 500000.0}, 64),
    (LLAMA3_ROPE, 16),
])
def test_inv_freq_matches_transformers(params, head_dim):
    hf = dict(model_type="llama", hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
              max_position_embeddings=131072, rope_parameters=dict(params))
    _, module = _hf_rotary(hf)
    theta, scaling = rope.read_rope(hf)
    np.testing.assert_allclose(rope.inv_freq(head_dim, theta, scaling), module.inv_freq.numpy(), rtol=1e-6, atol=0)


def test_llama3_tiny_config_covers_all_three_bands():
    """The parity model's frequencies fall in every band (kept, interpolated, divided by factor), and at the parity
    batch's last position every frequency the scaling changes is turned by 0.1 radian or more less than unscaled."""
    theta, scaling = rope.read_rope({"rope_parameters": LLAMA3_ROPE})
    high, medium, low = rope.bands(16, theta, scaling)
    assert high >= 1 and medium >= 1 and low >= 1, (high, medium, low)
    change = rope.inv_freq(16, theta) - rope.inv_freq(16, theta, scaling)
    assert (change[:high] == 0).all() and (max(LENGTHS) - 1) * change[high:].min() > 0.1


def test_llama3_without_original_context_takes_max_position_embeddings_as_transformers_does():
    hf = dict(model_type="llama", hidden_size=64, num_attention_heads=4, max_position_embeddings=48, rope_theta=100.0,
              rope_scaling={k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"})
    _, module = _hf_rotary(json.loads(json.dumps(hf)))
    theta, scaling = rope.read_rope(hf, max_position_embeddings=48)
    assert scaling.original_max_position_embeddings == 48
    np.testing.assert_allclose(rope.inv_freq(16, theta, scaling), module.inv_freq.numpy(), rtol=1e-6, atol=0)


def test_both_spellings_read_alike_and_a_disagreement_is_refused():
    flat = {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    nested = {"rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}}
    legacy = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2}}
    assert rope.read_rope(flat) == rope.read_rope(nested) == rope.read_rope(legacy)
    with pytest.raises(ConfigError, match="rope_parameters.rope_theta=10.0, rope_theta=500000.0 disagree"):
        rope.read_rope({"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 10.0}})


# ------------------------------------------------------------------------------------------------ real configs
@pytest.mark.parametrize("name", sorted(REAL))
def test_real_config_is_read_whole_as_transformers_reads_it(name):
    """Every field of the published config.json is understood (``read_config`` refuses any it is not), and the
    shape, heads, windows and rotary frequencies equal transformers' reading of the same file."""
    hf, _ = REAL[name]
    fam = FAMILIES[hf["model_type"]]
    cfg = read_config(fam.config_cls, json.loads(json.dumps(hf)), fam.harmless)
    ref, module = _hf_rotary(json.loads(json.dumps(hf)))
    assert family_of_config(cfg) is fam
    ref_head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads  # as transformers
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.tie_word_embeddings) == (
        ref.num_key_value_heads, ref_head_dim, ref.tie_word_embeddings)
    np.testing.assert_allclose(rope.inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), module.inv_freq.numpy(),
                               rtol=1e-6, atol=0)
    if hf["model_type"] != "llama":
        windows = tuple(ref.sliding_window if kind == "sliding_attention" else None for kind in ref.layer_types)
        assert cfg.layer_windows == windows == (None,) * hf["num_hidden_layers"]


def tiny(hf: dict) -> dict:
    """The same config.json at 2 layers, width 32, 4 query heads (grouped as the real ones where they group),
    head_dim 8 (16 where the real head is wider than hidden / heads, as Qwen3's), a 97-token vocabulary; every
    other field as published (the RoPE scaling, the windows, the tie, the token ids)."""
    grouped = hf["num_key_value_heads"] < hf["num_attention_heads"]
    out = dict(hf, num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
               num_key_value_heads=2 if grouped else 4, vocab_size=V)
    if "head_dim" in hf:
        out["head_dim"] = 16 if hf["head_dim"] * hf["num_attention_heads"] != hf["hidden_size"] else 8
    return out


# Llama-3.2-1B and Qwen2.5-0.5B differ from their larger kin only in sizes and the tie: make test-all runs those
REAL_RUNS = [pytest.param(n, marks=pytest.mark.slow) if n in ("meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B") else n
             for n in sorted(REAL)]


@pytest.mark.parametrize("name", REAL_RUNS)
def test_real_config_at_tiny_size_matches_transformers(name, tmp_path):
    hf = tiny(REAL[name][0])
    (tmp_path / "config.json").write_text(json.dumps(hf))
    ref = save_tiny(tf.AutoConfig.from_pretrained(str(tmp_path)), tmp_path, seed=4)
    model = mm.load(tmp_path)
    worst = _logit_diff(model, ref)
    assert worst <= 1e-4, (name, worst)
    print(f"{name} (tiny): max |logit diff| = {worst:.2e}")


# ------------------------------------------------------------------------------------------------ what is live
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (checkpoint dir, transformers model) of the llama3_rope and qwen2 parity models."""
    out = {}
    for name in ("llama3_rope", "qwen2"):
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, save_tiny(PARITY[name](), path, seed=1))
    return out


def _load_changed(path, tmp_path, **changes):
    """The checkpoint at ``path`` loaded with config.json fields replaced by ``changes``."""
    hf = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, **changes}))
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    return mm.load(tmp_path)


def test_llama3_scaling_is_what_makes_parity(built, tmp_path):
    """The llama3 model matches transformers at positions within and beyond the original context of 32 (a row of
    48), and the same weights without the scaling (plain RoPE at the same base) do not: skipping the scaling fails
    the parity test."""
    path, ref = built["llama3_rope"]
    model = mm.load(path)
    assert _logit_diff(model, ref, [48, 20, 33], seed=7) <= 1e-4
    unscaled = _load_changed(path, tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    assert _logit_diff(unscaled, ref) > 1e-3


def test_qwen2_sliding_window_is_what_makes_parity(built, tmp_path):
    """Qwen2's sliding layer (window 4 < 13 tokens) is applied: without it, parity fails."""
    path, ref = built["qwen2"]
    assert _logit_diff(mm.load(path), ref) <= 1e-4
    everywhere_global = _load_changed(path, tmp_path, use_sliding_window=False, layer_types=None)
    assert _logit_diff(everywhere_global, ref) > 1e-3


def test_qwen3_config_maps_to_its_own_family():
    """Qwen3Config subclasses Qwen2Config: the loader and the engine find Qwen3's module, not Qwen2's."""
    cfg = mm.family("qwen3").config_cls.from_hf(dict(PARITY["qwen3"]().to_dict()))
    assert family_of_config(cfg).model_type == "qwen3"
    assert family_of_config(mm.family("qwen2").config_cls.from_hf(PARITY["qwen2"]().to_dict())).model_type == "qwen2"


# ------------------------------------------------------------------------------------------------ refusals
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


@pytest.mark.parametrize("model_type, extra, field", [
    ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type='dynamic'"),
    ("llama", dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
     "rope_scaling.rope_type='yarn'"),
    ("llama", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_parameters.rope_type"),
    ("llama", dict(rope_scaling={"rope_type": "su", "factor": 2.0}), "unknown rope_type"),
    ("llama", dict(rope_scaling={k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}),
     "rope_scaling.low_freq_factor is missing"),
    ("llama", dict(rope_scaling={**LLAMA3, "high_freq_factor": 1.0}), "high_freq_factor"),
    ("llama", dict(rope_scaling={**LLAMA3, "attention_factor": 0.5}), "rope_scaling.attention_factor"),
    ("llama", dict(rope_scaling={"rope_type": "linear"}), "rope_scaling.factor is missing"),
    ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 0}), "rope_scaling.factor=0"),
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "rope_parameters.partial_rotary_factor"),
    ("llama", dict(sliding_window=4), "sliding_window"),
    ("olmo", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling.rope_type='linear'"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=None, layer_types=["full_attention",
                                                                              "sliding_attention"]), "layer_types"),
    ("qwen2", dict(layer_types=["full_attention"]), "layer_types"),
    ("qwen2", dict(layer_types=["full_attention", "chunked_attention"]), "layer_types"),
    ("qwen2", dict(use_mrope=True), "use_mrope"),
    ("qwen2", dict(attention_bias=False), "attention_bias"),
    ("qwen2", dict(mlp_bias=True), "mlp_bias"),
    ("qwen2", dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
     "rope_scaling.rope_type='yarn'"),
    ("qwen2", dict(attention_logit_softcapping=50.0), "attention_logit_softcapping"),
    ("qwen3", dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    ("qwen3", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}),
     "rope_parameters.rope_type='dynamic'"),
    ("qwen3", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     "rope_parameters.full_attention"),
    ("qwen3", dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
])
def test_refused_config_names_its_field(tmp_path, model_type, extra, field):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": model_type, **extra}))
    with pytest.raises(ConfigError) as e:
        mm.load_config(tmp_path)
    assert field in str(e.value), str(e.value)


def test_dynamic_refusal_says_why():
    with pytest.raises(ConfigError, match="state kept across calls"):
        rope.read_rope({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


# ------------------------------------------------------------------------------------------------ mia plan
@pytest.mark.parametrize("name", sorted(REAL))
def test_real_configs_have_the_published_parameter_counts(name):
    from mia.engine.plan import abstract_model

    hf, count = REAL[name]
    _, shapes = abstract_model(hf, "bfloat16")
    assert sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes)) == count


@pytest.mark.parametrize("named, real", [("llama-3.1-8b", "meta-llama/Llama-3.1-8B"),
                                         ("qwen2.5-7b", "Qwen/Qwen2.5-7B")])
def test_named_plan_shapes_are_the_published_configs(named, real):
    from mia.engine.plan import NAMED_SHAPES, abstract_model

    fam = FAMILIES[REAL[real][0]["model_type"]]
    assert read_config(fam.config_cls, NAMED_SHAPES[named]) == read_config(fam.config_cls, REAL[real][0], fam.harmless)
    a, b = (jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), abstract_model(hf, "bfloat16")[1])
            for hf in (NAMED_SHAPES[named], REAL[real][0]))
    assert a == b


@pytest.mark.slow  # (~15 s each on XLA:CPU: a 4096-wide step compiled; minutes with libtpu)
@pytest.mark.parametrize("name", ["meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B"])
def test_plan_of_the_real_config_for_one_v5e_chip(name, tmp_path, capsys):
    """``mia plan`` of the published config.json against one v5e chip (15.75 GiB): the bf16 parameters, 2 bytes
    each, exactly; with libtpu, compiled for ``v5e:1x1`` (8 x 2048 fits, docs/models.md#rope has the figures),
    without it XLA:CPU's estimate against ``--device-memory 15.75GiB`` (an upper bound: XLA:CPU widens bf16)."""
    import importlib.util

    from mia.cli import main

    hf, count = REAL[name]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    target = (["--topology", "v5e:1x1"] if importlib.util.find_spec("libtpu") else
              ["--device-memory", "15.75GiB", "--platform", "cpu"])
    capsys.readouterr()
    status = main(["plan", "--model", str(tmp_path / "config.json"), "--dtype", "bfloat16", "--batch", "8",
                   "--length", "2048", *target])
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    assert status == (0 if last["fits"] else 1), out  # mia plan exits 1 when the step does not fit
    assert last["params_bytes"] == 2 * count and last["device_bytes"] == int(15.75 * 2 ** 30)
    assert last["peak_bytes"] > last["params_bytes"]
    if "--topology" in target:
        assert last["fits"] is True and last["device_kind"] == "TPU v5 lite"
