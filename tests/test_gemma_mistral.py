"""Mistral, Gemma 2 and Gemma 3 text: the config.json files real checkpoints publish (as data), read whole and checked
for parity at tiny depth and width; every field not implemented refused by name; the tiny parity configs' windows
and soft caps shown to matter (so the parity tests in test_families_parity.py fail if one is dropped)."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import transformers as tf

import mia.models as mm
from mia.models.common import ConfigError

from hf_tiny import padded_batch, save_tiny, torch_logits
from tiny_configs import PARITY, V

# config.json as published on the Hub (the Gemma 3 4B entry: the text_config of its multimodal config.json)
REAL = {
    "mistralai/Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000},
    "mistralai/Mistral-7B-v0.3": {
        "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 32768},
    "google/gemma-2-2b": {
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
        "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
        "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
        "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000},
    "google/gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "gemma2",
        "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
        "sliding_window_size": 4096, "torch_dtype": "float32", "transformers_version": "4.42.0.dev0",
        "use_cache": True, "vocab_size": 256000},
    "google/gemma-3-1b-pt": {
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144},
    "google/gemma-3-4b-pt (text_config)": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
}

# what mia reads from each (the fields that shape the arithmetic), against transformers' own reading
EXPECTED = {
    "mistralai/Mistral-7B-v0.1": dict(sliding_window=4096, num_key_value_heads=8, rope_theta=1e4),
    "mistralai/Mistral-7B-v0.3": dict(sliding_window=None, num_key_value_heads=8, rope_theta=1e6),
    "google/gemma-2-2b": dict(head_dim=256, sliding_window=4096, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0, tie_word_embeddings=True),
    "google/gemma-2-9b": dict(head_dim=256, num_key_value_heads=8, query_pre_attn_scalar=256),
    "google/gemma-3-1b-pt": dict(num_key_value_heads=1, sliding_window=512, rope_theta=1e6,
                                 rope_local_base_freq=1e4, rope_factor=1.0, final_logit_softcapping=None),
    "google/gemma-3-4b-pt (text_config)": dict(vocab_size=262208, num_attention_heads=8, num_key_value_heads=4,
                                               head_dim=256, sliding_window=1024, rope_theta=1e6,
                                               rope_local_base_freq=1e4, rope_factor=8.0,
                                               max_position_embeddings=131072),
}

# tiny widths for the parity check of each real config (the window too, so that it matters at 13 tokens); depth 6
# keeps one full layer of Gemma 3's pattern of 6
SHRINK = dict(vocab_size=V, hidden_size=40, intermediate_size=52, num_attention_heads=4, num_key_value_heads=2)
SHRINK_DEPTH = {"mistral": 2, "gemma2": 3, "gemma3_text": 6}


def _write(path, hf):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    return path


def _hf_layer_types(hf_cfg):
    return tuple(getattr(hf_cfg, "layer_types", None) or ())


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_config_is_read_whole_as_transformers_reads_it(name, tmp_path):
    hf = REAL[name]
    _, cfg, _ = mm.load_config(_write(tmp_path, hf))
    for field, want in EXPECTED[name].items():
        assert getattr(cfg, field) == want, (field, getattr(cfg, field))
    ref = tf.AutoConfig.for_model(**copy.deepcopy(hf))
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(cfg, field) == getattr(ref, field), field
    if hf["model_type"] != "mistral":
        assert cfg.layer_types == _hf_layer_types(ref)
        assert cfg.head_dim == ref.head_dim and cfg.query_pre_attn_scalar == ref.query_pre_attn_scalar
    if hf["model_type"] == "gemma3_text":
        rope = ref.rope_parameters
        assert cfg.rope_theta == rope["full_attention"]["rope_theta"]
        assert cfg.rope_local_base_freq == rope["sliding_attention"]["rope_theta"]
        assert cfg.rope_factor == rope["full_attention"].get("factor", 1.0)


def _shrunk(hf: dict) -> dict:
    out = {**hf, **SHRINK, "num_hidden_layers": SHRINK_DEPTH[hf["model_type"]], "max_position_embeddings": 64}
    if out.get("sliding_window") is not None:
        out["sliding_window"] = 5
        out.update({"sliding_window_size": 5} if "sliding_window_size" in hf else {})
    if "head_dim" in hf or hf["model_type"] == "gemma3_text":
        out["head_dim"] = 12
    if "query_pre_attn_scalar" in hf or hf["model_type"] == "gemma3_text":
        out["query_pre_attn_scalar"] = 12
    return out


# the Mistral-7B-v0.1, Gemma-2-9B and Gemma-3-4B ones in make test-all only, for default-run time (their fields are
# read whole by the test above; v0.3, 2-2b and 1b carry every kind of field the others do)
SLOW_REAL = ("mistralai/Mistral-7B-v0.1", "google/gemma-2-9b", "google/gemma-3-4b-pt (text_config)")
PARITY_REAL = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_REAL else n for n in sorted(REAL)]


@pytest.mark.parametrize("name", PARITY_REAL)
def test_real_config_at_tiny_width_matches_transformers(name, tmp_path):
    hf = _shrunk(REAL[name])
    ref_cfg = tf.AutoConfig.for_model(**copy.deepcopy(hf))
    ref_cfg._attn_implementation = "eager"
    ref_cfg.dtype = "float32"  # built in bfloat16 (the published dtype), its embedding scale would be rounded to bf16
    ref = save_tiny(ref_cfg, tmp_path, seed=4)
    _write(tmp_path, hf)  # the published fields as they are, not transformers' re-serialisation
    model = mm.load(tmp_path)
    tokens, mask = padded_batch(V, [13, 9], seed=5)
    got = np.asarray(model.logits(model.params, tokens, mask.astype(bool)))
    want = torch_logits(ref, tokens, mask)
    for i, n in enumerate(mask.sum(1)):
        np.testing.assert_allclose(got[i, :n], want[i, :n], atol=1e-4, rtol=0)


BASE = {"mistral": REAL["mistralai/Mistral-7B-v0.3"], "gemma2": REAL["google/gemma-2-2b"],
        "gemma3_text": REAL["google/gemma-3-1b-pt"]}


@pytest.mark.parametrize("family, extra, field", [
    ("mistral", {"attention_bias": True}, "attention_bias"),
    ("mistral", {"mlp_bias": True}, "mlp_bias"),
    ("mistral", {"use_sliding_window": True}, "use_sliding_window"),
    ("mistral", {"sliding_window": 0}, "sliding_window"),
    ("mistral", {"layer_types": ["full_attention"] * 32}, "layer_types"),
    ("mistral", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ("mistral", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling"),  # linear, llama3: as Llama
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ("gemma2", {"layer_types": ["chunked_attention"] * 26}, "layer_types"),
    ("gemma2", {"sliding_window_size": 2048}, "sliding_window_size"),
    ("gemma2", {"attn_logit_softcapping": 0.0}, "attn_logit_softcapping"),
    ("gemma2", {"query_pre_attn_scalar": None}, "query_pre_attn_scalar"),
    ("gemma2", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ("gemma2", {"hidden_activation": "gelu_tanh_squared"}, "gelu_tanh_squared"),
    ("gemma2", {"use_sliding_window": True}, "use_sliding_window"),
    ("gemma2", {"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3_text", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_scaling.rope_type"),
    ("gemma3_text", {"rope_scaling": {"rope_type": "linear", "factor": 8.0, "partial_rotary_factor": 0.5}},
     "rope_scaling"),
    ("gemma3_text", {"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor"),
    ("gemma3_text", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_parameters"),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type"),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5}}},
     "rope_theta"),
    ("gemma3_text", {"sliding_window_pattern": 0}, "sliding_window_pattern"),
    ("gemma3_text", {"layer_types": ["full_attention"] * 25}, "layer_types"),
    ("gemma3_text", {"altup_num_inputs": 4}, "altup_num_inputs"),
])
def test_fields_not_implemented_are_refused_by_name(family, extra, field, tmp_path):
    with pytest.raises(ConfigError, match=field):
        mm.load_config(_write(tmp_path, {**BASE[family], **extra}))


def test_the_multimodal_gemma3_config_is_not_a_text_model(tmp_path):
    with pytest.raises(ConfigError, match="unsupported model_type 'gemma3'"):
        mm.load_config(_write(tmp_path, {"model_type": "gemma3", "text_config": REAL[
            "google/gemma-3-4b-pt (text_config)"]}))


def _torch_variant(model, **changes):
    """The same torch weights under a config with ``changes``."""
    cfg = copy.deepcopy(model.config)
    for k, v in changes.items():
        setattr(cfg, k, v)
    other = type(model)(cfg).float().eval()
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("name, changes", [
    ("mistral", {"sliding_window": None}),
    ("gemma2", {"sliding_window": 64}),
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"query_pre_attn_scalar": 12}),
    ("gemma3_text", {"sliding_window": 64}),
    ("gemma3_text", {"final_logit_softcapping": None}),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 30.0}}}),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "linear", "rope_theta": 1000.0,
                                                            "factor": 8.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}),
])
def test_the_parity_configs_distinctive_options_matter(name, changes, tmp_path):
    """Each window, soft cap, scale and rotary option of the tiny parity configs moves transformers' own logits by
    at least ten times the parity tolerance (1e-4) on the parity batch: a model that dropped it would fail parity."""
    import torch

    torch.manual_seed(0)
    model = save_tiny(PARITY[name](), tmp_path, seed=1)
    tokens, mask = padded_batch(V, [13, 7, 1, 10], seed=2)
    a, b = torch_logits(model, tokens, mask), torch_logits(_torch_variant(model, **changes), tokens, mask)
    worst = max(np.abs(a[i, :n] - b[i, :n]).max() for i, n in enumerate(mask.sum(1)))
    assert worst > 1e-3, (name, changes, worst)
