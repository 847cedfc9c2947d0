"""OPT and Phi-3 read from the config.json files real checkpoints publish (``tests/configs_opt_phi3.py``): parsed
field by field, equal to transformers at a tiny depth and width, and every field they do not compute refused by
name. (Their parity on the tiny configs, prefix cache, packing, bf16: ``tests/test_families_parity.py``.)"""
from __future__ import annotations

import json

import numpy as np
import pytest
import transformers as tf

import mia.models as mm
from mia.models.common import ConfigError
from mia.models.family import read_config

from configs_opt_phi3 import OPT_350M, PARAMETERS, PHI3_MINI_4K, REAL, tiny_depth_and_width
from hf_tiny import padded_batch, save_tiny, torch_logits


def parse(hf: dict):
    fam = mm.FAMILIES[hf["model_type"]]
    return read_config(fam.config_cls, hf, fam.harmless)  # strict: every field read, refused or known inert


def test_real_configs_parse_to_their_architecture():
    opt125, opt350, opt67, phi3 = (parse(REAL[n]) for n in ("opt-125m", "opt-350m", "opt-6.7b", "phi-3-mini-4k"))
    assert (opt125.final_norm, opt125.projects, opt125.tie_word_embeddings) == (True, False, True)
    assert (opt350.do_layer_norm_before, opt350.final_norm, opt350.projects) == (False, False, True)
    assert (opt350.word_embed_proj_dim, opt350.hidden_size, opt350.intermediate_size) == (512, 1024, 4096)
    assert (opt67.hidden_size, opt67.num_hidden_layers, opt67.head_dim, opt67.enable_bias) == (4096, 32, 128, True)
    assert (phi3.sliding_window, phi3.head_dim, phi3.num_key_value_heads, phi3.rotary_dim) == (2047, 96, 32, 96)
    assert (phi3.rope_theta, phi3.max_position_embeddings, phi3.tie_word_embeddings) == (10000.0, 4096, False)


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_configs_have_the_published_parameter_counts(name):
    import jax

    from mia.models.hub import abstract_params

    fam = mm.FAMILIES[REAL[name]["model_type"]]
    _, shapes = abstract_params(fam, parse(REAL[name]))
    assert sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes)) == PARAMETERS[name]


# OPT's remaining switches, off in every published checkpoint: no norm weights, no final norm, no biases
VARIANTS = {**REAL, "opt-125m-bare": {**REAL["opt-125m"], "layer_norm_elementwise_affine": False,
                                      "_remove_final_layer_norm": True, "enable_bias": False}}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_real_config_at_tiny_depth_and_width_matches_transformers(name, tmp_path):
    """transformers reads the published config.json (shrunk to 2 layers and width 16-24, every other field as
    published: the real vocabulary, positions, window, token ids) and builds the reference; mia loads the same
    config.json, not transformers' rewrite of it."""
    hf = tiny_depth_and_width(VARIANTS[name])
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(hf))
    ref = save_tiny(tf.AutoConfig.from_pretrained(str(src)), tmp_path / "ckpt", seed=4)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(hf))
    model = mm.load(tmp_path / "ckpt")
    tokens, mask = padded_batch(hf["vocab_size"], [13, 6], seed=5)
    got = np.asarray(model.logits(model.params, tokens, mask.astype(bool)))
    want = torch_logits(ref, tokens, mask)
    for i, n in enumerate(mask.sum(1)):
        np.testing.assert_allclose(got[i, :n], want[i, :n], atol=1e-4, rtol=0, err_msg=name)


def test_opt_350m_has_projections_and_no_final_norm(tmp_path):
    from mia.models.hub import abstract_params

    fam = mm.FAMILIES["opt"]
    _, shapes = abstract_params(fam, parse(tiny_depth_and_width(OPT_350M)))
    assert {"project_in", "project_out", "embed_positions"} <= set(shapes) and "final_layer_norm" not in shapes
    assert shapes["embed_tokens"]["embedding"].shape == (50272, 8)  # the embedding width, not the layers'
    assert shapes["embed_positions"]["embedding"].shape == (2048 + 2, 16)  # offset 2


@pytest.mark.parametrize("config_class", [tf.OPTConfig, tf.Phi3Config], ids=["opt", "phi3"])
def test_every_field_of_transformers_config_class_is_understood(config_class):
    """transformers' config class written whole (every field it has, at its defaults) reads without a field left
    unread: each is implemented, refused when its value is not computed, or known to be inert."""
    hf = config_class().to_dict()
    assert parse(hf).to_hf()["model_type"] == hf["model_type"]


LONGROPE = {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.5] * 48}  # Phi-3-mini-128k's shape


@pytest.mark.parametrize("base, extra, field", [
    (OPT_350M, dict(activation_function="swiglu"), "activation_function"),
    (OPT_350M, dict(hidden_size=1000), "hidden_size"),
    (OPT_350M, dict(scale_embedding=True), "scale_embedding"),  # a field OPT does not have: never ignored
    (PHI3_MINI_4K, dict(rope_scaling=LONGROPE), "rope_scaling"),
    (PHI3_MINI_4K, dict(rope_scaling=dict(LONGROPE, type="su")), "rope_scaling"),
    (PHI3_MINI_4K, dict(rope_scaling=dict(LONGROPE, type="yarn")), "rope_scaling"),
    (PHI3_MINI_4K, dict(rope_scaling=None, rope_parameters=dict(LONGROPE, rope_type="longrope", rope_theta=1e4)),
     "rope_type"),
    (PHI3_MINI_4K, dict(attention_bias=True), "attention_bias"),
    (PHI3_MINI_4K, dict(mlp_bias=True), "mlp_bias"),
    (PHI3_MINI_4K, dict(use_sliding_window=True), "use_sliding_window"),
    (PHI3_MINI_4K, dict(sliding_window=0), "sliding_window"),
    (PHI3_MINI_4K, dict(partial_rotary_factor=1.5), "partial_rotary_factor"),
    (PHI3_MINI_4K, dict(attention_logit_softcapping=50.0), "attention_logit_softcapping"),
    (PHI3_MINI_4K, dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
    (PHI3_MINI_4K, dict(lm_head_bias=True), "lm_head_bias"),  # a later phi3 checkpoint's field: never ignored
    (PHI3_MINI_4K, dict(num_key_value_heads=5), "num_key_value_heads"),
])
def test_fields_not_computed_are_refused_by_name(base, extra, field):
    with pytest.raises(ConfigError, match=field) as e:
        parse({**base, **extra})
    assert "\n" not in str(e.value)


def test_the_refused_values_are_accepted_when_inert():
    """The same fields at values that compute what transformers computes load (their refusal is by value)."""
    cfg = parse({**PHI3_MINI_4K, "mlp_bias": False, "use_sliding_window": False, "partial_rotary_factor": 0.5,
                 "rope_scaling": {"type": "default"}})
    assert cfg.rotary_dim == 48 and cfg.sliding_window == 2047
    assert parse({**OPT_350M, "enable_bias": False, "layer_norm_elementwise_affine": False}).enable_bias is False


@pytest.mark.slow  # (about 30 s: splash in interpret mode)
@pytest.mark.parametrize("name, shape", [
    ("opt", dict(ffn_dim=40, word_embed_proj_dim=16, do_layer_norm_before=False)),
    ("phi3", dict(intermediate_size=40, num_key_value_heads=2, sliding_window=20, partial_rotary_factor=0.5))])
def test_whole_model_every_kernel_equals_exact(name, shape, monkeypatch):
    """OPT (post-norm, projections; q scaled before the kernel, scale 1) and Phi-3 (sliding window 20 < 128
    positions, GQA): MIA_ATTENTION=splash (Pallas, interpret mode), xla and blocked equal exact on 128-token rows
    that are left padded, right padded or empty."""
    import jax

    from mia.models import attention as A

    from test_attention import _tiny

    t, rng = 128, np.random.default_rng(0)
    model = _tiny(name, vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=t, **shape)
    tokens, valid = rng.integers(0, 61, (3, t)), np.ones((3, t), bool)
    valid[0, :30], valid[1, 100:], valid[2] = False, False, False

    def run(kernel):
        monkeypatch.setenv(A.ENV_VAR, kernel)  # read when traced: a fresh function per kernel
        lowered = jax.jit(lambda p: model.hidden(p, tokens, valid)[0]).lower(model.params)
        return np.asarray(lowered.compile()(model.params)), lowered.as_text()

    exact, _ = run("exact")
    for kernel in ("splash", "xla", "blocked"):
        got, text = run(kernel)
        assert kernel != "splash" or "splash" in text
        np.testing.assert_allclose(got[valid], exact[valid], atol=2e-5, rtol=0, err_msg=kernel)
