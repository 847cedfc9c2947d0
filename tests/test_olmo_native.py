"""OLMo's native ``hf_olmo`` checkpoints through the OLMo family (``mia.models.olmo_native``).

Parity: a tiny transformers ``OlmoForCausalLM`` is written out in the native layout by the inverse mapping below
(written here with torch.cat, independently of mia's reader) and must give transformers' logits through mia.
"""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from conftest import build_tiny_tokenizer  # noqa: E402
from hf_tiny import padded_batch, torch_logits  # noqa: E402

import mia.models as mm  # noqa: E402
from mia.models import olmo_native  # noqa: E402
from mia.models.common import ConfigError  # noqa: E402
from mia.models.hub import CheckpointError, write_safetensors  # noqa: E402

V, D, L, H, KV, F = 96, 32, 2, 4, 2, 24


def _torch_olmo(tied: bool, clip, seed: int = 0):
    cfg = tf.OlmoConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
                        num_key_value_heads=KV, max_position_embeddings=64, clip_qkv=clip, tie_word_embeddings=tied,
                        rope_theta=500.0, pad_token_id=1, eos_token_id=V - 1, bos_token_id=None)
    torch.manual_seed(seed)
    model = tf.OlmoForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def native_state_dict(model, prefix: str = "model.") -> dict:
    """transformers OLMo -> OLMo's native tensor names: q|k|v rows fused into att_proj, up|gate rows into ff_proj
    (OLMo's SwiGLU: ``x, gate = ff_proj(h).chunk(2)``; ``silu(gate) * x``)."""
    sd = model.state_dict()
    out = {f"{prefix}transformer.wte.weight": sd["model.embed_tokens.weight"]}
    for i in range(model.config.num_hidden_layers):
        hf, nat = f"model.layers.{i}.", f"{prefix}transformer.blocks.{i}."
        out[nat + "att_proj.weight"] = torch.cat([sd[hf + f"self_attn.{p}_proj.weight"] for p in "qkv"], dim=0)
        out[nat + "attn_out.weight"] = sd[hf + "self_attn.o_proj.weight"]
        out[nat + "ff_proj.weight"] = torch.cat([sd[hf + "mlp.up_proj.weight"], sd[hf + "mlp.gate_proj.weight"]], dim=0)
        out[nat + "ff_out.weight"] = sd[hf + "mlp.down_proj.weight"]
    if not model.config.tie_word_embeddings:
        out[f"{prefix}transformer.ff_out.weight"] = sd["lm_head.weight"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def native_config(model, **over) -> dict:
    """An hf_olmo config.json for ``model``, with the fields allenai's repositories write."""
    c = model.config
    cfg = {
        "model_type": "hf_olmo", "architectures": ["OLMoForCausalLM"], "activation_type": "swiglu", "alibi": False,
        "alibi_bias_max": 8.0, "attention_dropout": 0.0, "attention_layer_norm": False,
        "attention_layer_norm_with_affine": False, "bias_for_layer_norm": False, "block_group_size": 1,
        "block_type": "sequential", "clip_qkv": c.clip_qkv, "d_model": c.hidden_size, "embedding_dropout": 0.0,
        "embedding_size": c.vocab_size, "eos_token_id": c.eos_token_id, "flash_attention": False,
        "include_bias": False, "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell",
        "init_std": 0.02, "layer_norm_type": "default", "layer_norm_with_affine": False,
        "max_sequence_length": c.max_position_embeddings, "mlp_hidden_size": 2 * c.intermediate_size, "mlp_ratio": 4,
        "multi_query_attention": None, "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads,
        "n_layers": c.num_hidden_layers, "pad_token_id": c.pad_token_id, "precision": "amp_bf16",
        "residual_dropout": 0.0, "rope": True, "rope_full_precision": True,
        "rope_theta": c.rope_parameters["rope_theta"],
        "scale_logits": False, "transformers_version": "4.36.2", "use_cache": True, "vocab_size": c.vocab_size - 6,
        "weight_tying": c.tie_word_embeddings,
    }
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not _DROP}


_DROP = object()


def write_native(model, path: Path, fmt: str = "safetensors", prefix: str = "model.", **config_over) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(native_config(model, **config_over)))
    sd = native_state_dict(model, prefix)
    if fmt == "safetensors":
        write_safetensors({k: v.numpy() for k, v in sd.items()}, path / "model.safetensors")
    else:
        torch.save(sd, path / "pytorch_model.bin")
    return path


@pytest.fixture(scope="module")
def untied():
    return _torch_olmo(tied=False, clip=0.4)


@pytest.mark.parametrize("tied, clip, fmt, prefix", [
    (False, 0.4, "safetensors", "model."),  # OLMo-7B's shape: untied head, clip_qkv as in OLMo 1.7
    (True, None, "bin", "model."),  # OLMo-1B's: tied embeddings; a torch.save'd pytorch_model.bin
    (False, None, "bin", ""),  # OLMo's own state dict names (no "model." prefix)
])
def test_native_checkpoint_matches_transformers_logits(tmp_path, tied, clip, fmt, prefix):
    ref = _torch_olmo(tied, clip, seed=int(tied))
    d = write_native(ref, tmp_path / "native", fmt, prefix)
    model = mm.load(d, tokenizer=False)
    assert model.model_type == "olmo" and model.config.num_key_value_heads == KV
    tokens, mask = padded_batch(V, [9, 6, 2], seed=1)
    want = torch_logits(ref, tokens, mask)
    got = np.asarray(model.logits(model.params, tokens, mask.astype(bool)))
    keep = mask.astype(bool)
    assert np.abs(got[keep] - want[keep]).max() < 1e-4


def test_native_params_equal_the_converted_checkpoints(untied, tmp_path):
    """The native checkpoint and transformers' own save of the same model load to the same params, bit for bit
    (the mapping moves bytes, it computes nothing)."""
    import jax

    untied.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    a = mm.load(tmp_path / "hf", tokenizer=False)
    b = mm.load(write_native(untied, tmp_path / "native"), tokenizer=False)
    assert a.config == b.config
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_olmo_7b_config_maps_to_the_converted_repository_config():
    """allenai/OLMo-7B's native config.json (public) against the config of its transformers conversion,
    allenai/OLMo-7B-hf: the same architecture."""
    native = {
        "model_type": "hf_olmo", "activation_type": "swiglu", "alibi": False, "alibi_bias_max": 8.0,
        "architectures": ["OLMoForCausalLM"], "attention_dropout": 0.0, "attention_layer_norm": False,
        "attention_layer_norm_with_affine": False, "bias_for_layer_norm": False, "block_group_size": 1,
        "block_type": "sequential", "clip_qkv": None, "d_model": 4096, "embedding_dropout": 0.0,
        "embedding_size": 50304, "eos_token_id": 50279, "flash_attention": False, "include_bias": False,
        "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02,
        "layer_norm_type": "default", "layer_norm_with_affine": False, "max_sequence_length": 2048,
        "mlp_hidden_size": 22016, "mlp_ratio": 4, "multi_query_attention": False, "n_heads": 32, "n_kv_heads": None,
        "n_layers": 32, "pad_token_id": 1, "precision": "amp_bf16", "residual_dropout": 0.0, "rope": True,
        "rope_full_precision": True, "scale_logits": False, "transformers_version": "4.36.2", "use_cache": True,
        "vocab_size": 50280, "weight_tying": False,
    }
    converted = {  # allenai/OLMo-7B-hf config.json, the fields that define the model
        "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 32, "max_position_embeddings": 2048, "vocab_size": 50304, "tie_word_embeddings": False,
        "clip_qkv": None, "rope_theta": 10000.0, "attention_bias": False, "hidden_act": "silu", "eos_token_id": 50279,
        "pad_token_id": 1,
    }
    got = olmo_native.hf_config(native, "config.json")
    assert {k: got[k] for k in converted} == converted
    assert got["model_type"] == "olmo"


def test_tokenizer_naming_remote_code_loads_without_it(untied, tmp_path):
    """allenai's native repositories name their own tokenizer class (remote code, never run): the tokenizer.json
    loads through PreTrainedTokenizerFast and gives the same ids."""
    d = write_native(untied, tmp_path / "native")
    tok = build_tiny_tokenizer(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="OLMoTokenizerFast",
               auto_map={"AutoTokenizer": ["hf_olmo.OLMoTokenizerFast", "hf_olmo.OLMoTokenizerFast"]})
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    model = mm.load(d)
    text = "def native(x):\n    return x + 1\n"
    assert model.tokenizer(text)["input_ids"] == tok(text)["input_ids"]
    assert model.tokenizer.eos_token == tok.eos_token


@pytest.mark.parametrize("field, value", [
    ("rope", False), ("alibi", True), ("activation_type", "gelu"), ("block_type", "llama"), ("block_group_size", 2),
    ("include_bias", True), ("layer_norm_type", "rms"), ("layer_norm_type", "low_precision"),
    ("layer_norm_with_affine", True), ("attention_layer_norm", True), ("embedding_layer_norm", True),
    ("norm_after", True), ("scale_logits", True), ("rope_full_precision", False), ("layer_norm_eps", 1e-6),
])
def test_settings_the_family_does_not_compute_are_refused(untied, tmp_path, field, value):
    d = write_native(untied, tmp_path / "n", **{field: value})
    with pytest.raises(ConfigError) as e:
        mm.load(d, tokenizer=False)
    assert field in str(e.value) and "config.json" in str(e.value)


@pytest.mark.parametrize("field", ["rope", "include_bias", "layer_norm_with_affine"])
def test_an_absent_field_takes_olmos_default_and_is_refused_when_unsupported(untied, tmp_path, field):
    d = write_native(untied, tmp_path / "n", **{field: _DROP})
    with pytest.raises(ConfigError, match=f"{field}=.*OLMo's default, the field is absent"):
        mm.load_config(d)


@pytest.mark.parametrize("over, expect", [
    ({"some_new_option": 1}, "some_new_option are unknown to mia"),
    ({"n_kv_heads": 2, "multi_query_attention": True}, "contradicts multi_query_attention"),
    ({"n_kv_heads": 2, "multi_query_attention": False}, "contradicts multi_query_attention"),  # as OLMo refuses it
    ({"n_kv_heads": 3}, "not a multiple of the key/value heads"),
    ({"d_model": 30}, "not a multiple of n_heads"),
    ({"mlp_hidden_size": 47}, "is odd"),
    ({"embedding_size": 50}, "smaller than vocab_size"),
    ({"clip_qkv": -1.0}, "clip_qkv"),
    ({"n_layers": "2"}, "'n_layers'"),
])
def test_bad_native_configs_are_one_error(untied, tmp_path, over, expect):
    d = write_native(untied, tmp_path / "n", **over)
    with pytest.raises(ValueError, match=expect):
        mm.load_config(d)


def test_mlp_ratio_and_multi_query_defaults_map(untied):
    base = native_config(untied, mlp_hidden_size=None, mlp_ratio=3, n_kv_heads=None, multi_query_attention=True)
    got = olmo_native.hf_config(base, "c")
    assert got["intermediate_size"] == 3 * D // 2 and got["num_key_value_heads"] == 1
    got = olmo_native.hf_config(native_config(untied, n_kv_heads=None, multi_query_attention=_DROP), "c")
    assert got["num_key_value_heads"] == H


@pytest.mark.parametrize("edit, expect", [
    (lambda sd: sd.pop("model.transformer.blocks.1.ff_out.weight"),
     "'model.transformer.blocks.1.ff_out.weight' is missing"),
    (lambda sd: sd.pop("model.transformer.ff_out.weight"), "'model.transformer.ff_out.weight' is missing"),
    (lambda sd: sd.update({"model.transformer.blocks.0.att_proj.weight": torch.zeros(3 * D, D)}),
     r"'model.transformer.blocks.0.att_proj.weight' has shape \(96, 32\), expected \(64, 32\)"),
    (lambda sd: sd.update({"model.transformer.ln_f.weight": torch.ones(D)}), "unexpected tensor.*ln_f.weight"),
    (lambda sd: sd.update({"model.transformer.blocks.2.ff_out.weight": torch.ones(D, F)}), "unexpected.*blocks.2"),
])
def test_tensor_problems_name_the_native_tensor(untied, tmp_path, edit, expect):
    d = write_native(untied, tmp_path / "n")
    sd = native_state_dict(untied)
    edit(sd)
    (d / "model.safetensors").unlink()
    write_safetensors({k: v.numpy() for k, v in sd.items()}, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=expect):
        mm.load(d, tokenizer=False)


def test_native_checkpoint_from_the_hf_cache(untied, tmp_path, monkeypatch):
    """``allenai/OLMo-7B@step1000-tokens4B`` style: a native revision resolved through the cache."""
    snap = tmp_path / "hub" / "models--allenai--OLMo-tiny" / "snapshots" / ("d" * 40)
    write_native(untied, snap, "bin")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "step1000-tokens4B").write_text("d" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    model = mm.load("allenai/OLMo-tiny@step1000-tokens4B", tokenizer=False)
    tokens, mask = padded_batch(V, [5], seed=2)
    got = np.asarray(model.logits(model.params, tokens, mask.astype(bool)))
    assert np.abs(got - torch_logits(untied, tokens, mask)).max() < 1e-4
    shutil.rmtree(tmp_path / "hub")
