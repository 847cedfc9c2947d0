"""PEFT LoRA adapters (``mia.models.adapter``): logits through ``mia.load(BASE, adapter=DIR)`` equal peft's
``merge_and_unload()`` in torch, for every decoder family; each refusal is one line naming the field.

Each case builds a tiny transformers model (tests/tiny_configs.py), wraps it with a peft ``LoraConfig`` whose factors
are random (``init_lora_weights=False``, so B != 0), saves the adapter with ``save_pretrained`` and merges it in torch.
"""
import importlib.util
import json

import numpy as np
import pytest

# skipped without peft, which is imported only by the tests that use it (importing it costs 2 s of
# collection on every worker)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")

import mia.models as mm  # noqa: E402
from mia.models.adapter import AdapterError, pattern_key, targeted  # noqa: E402

from hf_tiny import padded_batch, save_tiny, torch_logits  # noqa: E402
from tiny_configs import PARITY, V  # noqa: E402

LENGTHS = [9, 4]


def make_adapter(case: str, tmp_path, seed: int = 1, bin_file: bool = False, **lora):
    """(base dir, adapter dir, torch model with the adapter merged by peft) of PARITY[case] with ``LoraConfig(**lora)``
    (random factors, scaled up so that a wrong merge shows)."""
    import torch
    from peft import LoraConfig, get_peft_model

    base = tmp_path / "base"
    model = save_tiny(PARITY[case](), base, seed=seed)
    torch.manual_seed(seed + 1)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(str(adapter), safe_serialization=not bin_file)
    merged = peft_model.merge_and_unload().float().eval()
    return base, adapter, merged


def assert_same_logits(base, adapter, merged, atol=1e-4):
    model = mm.load(base, adapter=adapter, dtype="float32")
    tokens, mask = padded_batch(V, LENGTHS, seed=3)
    got = np.asarray(model.logits(model.params, tokens, mask.astype(bool)))
    want = torch_logits(merged, tokens, mask)
    plain = mm.load(base, dtype="float32")
    unchanged = np.asarray(plain.logits(plain.params, tokens, mask.astype(bool)))
    for i, n in enumerate(LENGTHS):
        np.testing.assert_allclose(got[i, :n], want[i, :n], atol=atol, rtol=0)
        assert np.abs(unchanged[i, :n] - want[i, :n]).max() > 100 * atol  # the adapter changes the model
    return model


# every family with LoRA on every linear layer (GPT-2's Conv1D included): gpt_neox (fused query_key_value) in the
# default run (GPT-2's fused c_attn Conv1D there too, below), the rest in make test-all
FAMILY_CASES = [n if n == "gpt_neox" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(PARITY)]


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_all_linear_lora_matches_peft_merge(case, tmp_path):
    assert_same_logits(*make_adapter(case, tmp_path, r=4, lora_alpha=8, target_modules="all-linear"))


def test_rslora_rank_and_alpha_patterns_match_peft(tmp_path):
    base, adapter, merged = make_adapter(
        "gpt_neox", tmp_path, r=4, lora_alpha=6, use_rslora=True,
        target_modules=["query_key_value", "dense", "dense_4h_to_h"],
        rank_pattern={"dense": 2, r"layers\.1\.mlp\.dense_4h_to_h": 3}, alpha_pattern={"query_key_value": 11})
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["use_rslora"] and conf["rank_pattern"]
    assert_same_logits(base, adapter, merged)


def test_gpt2_conv1d_fan_in_fan_out_with_layers_and_modules_to_save(tmp_path):
    base, adapter, merged = make_adapter(
        "gpt2", tmp_path, r=3, lora_alpha=5, fan_in_fan_out=True, target_modules=["c_attn", "c_proj"],
        layers_to_transform=[1], modules_to_save=["ln_f"])
    assert json.loads((adapter / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    model = assert_same_logits(base, adapter, merged)
    assert model.adapter == str(adapter) and model.path == str(base)


def test_adapter_bin_with_embedding_lora_is_read_without_pickle_and_fingerprint_covers_it(tmp_path):
    base, adapter, merged = make_adapter("gpt_neox", tmp_path, bin_file=True, r=2, lora_alpha=4,
                                         target_modules=["query_key_value", "dense_4h_to_h", "embed_in"])
    assert (adapter / "adapter_model.bin").exists() and not (adapter / "adapter_model.safetensors").exists()
    model = assert_same_logits(base, adapter, merged)
    assert model.fingerprint != mm.load(base).fingerprint  # the score cache key changes with the adapter


# ------------------------------------------------------------------------------------------------ refusals
@pytest.fixture(scope="module")
def neox_adapter(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("neox")
    base, adapter, _ = make_adapter("gpt_neox", tmp, r=2, lora_alpha=4, target_modules=["query_key_value"])
    return base, adapter


def _edited(src, tmp_path, conf_edit=None, tensors_edit=None):
    from safetensors.numpy import load_file, save_file

    out = tmp_path / "edited"
    out.mkdir(parents=True)
    conf = json.loads((src / "adapter_config.json").read_text())
    (conf_edit or (lambda c: None))(conf)
    (out / "adapter_config.json").write_text(json.dumps(conf))
    tensors = load_file(str(src / "adapter_model.safetensors"))
    (tensors_edit or (lambda t: None))(tensors)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def _refused(base, adapter, *words):
    with pytest.raises(AdapterError) as e:
        mm.load(base, adapter=adapter, tokenizer=False)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize("field,value", [("peft_type", "IA3"), ("peft_type", "PREFIX_TUNING"), ("use_dora", True)])
def test_non_lora_and_dora_are_refused(neox_adapter, tmp_path, field, value):
    base, adapter = neox_adapter
    _refused(base, _edited(adapter, tmp_path, lambda c: c.update({field: value})), field, repr(value))


def test_config_rank_disagreeing_with_tensors_is_refused(neox_adapter, tmp_path):
    base, adapter = neox_adapter
    _refused(base, _edited(adapter, tmp_path, lambda c: c.update(r=3)), "field r=3", "rank")
    _refused(base, _edited(adapter, tmp_path / "p", lambda c: c.update(rank_pattern={"query_key_value": 5})),
             "rank_pattern['query_key_value']=5")


def test_target_module_matching_nothing_is_refused(neox_adapter, tmp_path):
    base, adapter = neox_adapter
    edit = lambda c: c.update(target_modules=["query_key_value", "q_proj"])  # noqa: E731
    _refused(base, _edited(adapter, tmp_path, edit), "target_modules", "'q_proj'", "matches no module")


def test_tensor_shape_not_fitting_the_base_is_refused(neox_adapter, tmp_path):
    base, adapter = neox_adapter

    def widen(t):
        k = next(k for k in t if k.endswith("lora_B.weight"))
        t[k] = np.zeros((t[k].shape[0] + 1, t[k].shape[1]), t[k].dtype)

    _refused(base, _edited(adapter, tmp_path, tensors_edit=widen), "shape", "query_key_value")


def test_peft_matching_rules():
    conf = {"target_modules": ["q_proj"], "layers_to_transform": [1]}
    assert targeted(conf, "model.layers.1.self_attn.q_proj")
    assert not targeted(conf, "model.layers.0.self_attn.q_proj") and not targeted(conf, "model.layers.1.k_proj")
    assert targeted({"target_modules": r".*\.(q|v)_proj"}, "model.layers.0.self_attn.v_proj")
    assert not targeted({"target_modules": r"(q|v)_proj"}, "model.layers.0.self_attn.v_proj")  # full match
    assert not targeted({"target_modules": "all-linear"}, "lm_head")
    assert not targeted({"target_modules": ["q_proj"], "exclude_modules": ["q_proj"]}, "a.q_proj")
    assert pattern_key({"v_proj": 2}, "model.layers.0.self_attn.v_proj") == "v_proj"
    assert pattern_key({"v_proj": 2}, "model.layers.0.self_attn.qv_proj") is None


# ------------------------------------------------------------------------------------------------ mia score --adapter
def lora_on(model_dir, out, seed=0):
    """A LoRA adapter (query_key_value, random factors) of the checkpoint ``model_dir``, saved to ``out``."""
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = tf.AutoModelForCausalLM.from_pretrained(str(model_dir)).float()
    wrapped = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["query_key_value"],
                                              init_lora_weights=False))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    wrapped.save_pretrained(str(out))
    return out


def _scores(out):
    return [json.loads(line)["scores"] for line in out.read_text().splitlines()]


def test_cli_adapter_scores_another_model_under_its_own_cache_key(tiny_neox_dir, tmp_path, capsys):
    from mia.cli import main

    adapter = lora_on(tiny_neox_dir, tmp_path / "lora")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": i, "tokens": list(range(3 + i, 12 + 2 * i))}) + "\n" for i in range(3)))
    common = ["score", "--model", str(tiny_neox_dir), "--data", str(data), "--attacks", "loss", "--no-progress",
              "--cache-dir", str(tmp_path / "cache")]
    assert main(common + ["--out", str(tmp_path / "base.jsonl")]) == 0
    assert main(common + ["--adapter", str(adapter), "--out", str(tmp_path / "ft.jsonl")]) == 0
    base, ft = _scores(tmp_path / "base.jsonl"), _scores(tmp_path / "ft.jsonl")
    assert all(abs(a["loss"] - b["loss"]) > 1e-3 for a, b in zip(base, ft))  # not the base's cached stats
    capsys.readouterr()
    assert main(common + ["--adapter", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--adapter" in err[0]


@pytest.mark.slow  # the reference pass compiles a second model's program
def test_cli_adapter_runs_ref_ez_mia_and_wbc_without_ref_model(tiny_neox_dir, tmp_path):
    from mia.cli import main

    adapter = lora_on(tiny_neox_dir, tmp_path / "lora")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": i, "tokens": list(range(3 + i, 20 + 2 * i))}) + "\n" for i in range(3)))
    assert main(["score", "--model", str(tiny_neox_dir), "--adapter", str(adapter), "--data", str(data),
                 "--attacks", "ref,ez_mia,wbc", "--no-progress", "--no-cache", "--out", str(tmp_path / "o.jsonl")]) == 0
    got = _scores(tmp_path / "o.jsonl")
    assert all(np.isfinite(s[a]) for s in got for a in ("ref", "ez_mia", "wbc"))
    assert any(s["ref"] != 0 for s in got)
