"""Stacked (scanned) decoder layers: the params layout, strict HF mapping onto layer slices, the per-layer
``layer_transform`` hook, a traced program that does not grow with depth, and what the layout means for testbed
training (weight-decay mask, train-state format). Family parity lives in test_families_parity.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mia.models.gpt_neox import GPTNeoXConfig
from mia.models.hub import CheckpointError, abstract_params, family, params_from_hf, params_to_hf
from hf_tiny import padded_batch


def _neox(layers, hidden=32):
    return GPTNeoXConfig(vocab_size=61, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                         intermediate_size=48, max_position_embeddings=64)


@pytest.fixture(scope="module")
def model(tiny_model):
    """The session's 2-layer GPT-NeoX (hidden 32, 4 heads, MLP 64), loaded from an HF checkpoint."""
    assert tiny_model.config.num_hidden_layers == 2 and tiny_model.config.hidden_size == 32
    return tiny_model


def test_layers_are_stacked_leaves(model):
    layers = model.params["layers"]
    assert set(model.params) == {"embed_in", "layers", "final_layer_norm", "embed_out"}
    assert layers["attention_query_key_value"]["kernel"].shape == (2, 32, 96)
    assert layers["input_layernorm"]["weight"].shape == (2, 32)
    assert layers["mlp_dense_4h_to_h"]["bias"].shape == (2, 32)


def test_hf_names_map_onto_layer_slices(model):
    fam = family("gpt_neox")
    hf = params_to_hf(model.params, fam, model.config)
    np.testing.assert_array_equal(hf["gpt_neox.layers.1.attention.dense.weight"],
                                  np.asarray(model.params["layers"]["attention_dense"]["kernel"][1]).T)
    assert not np.array_equal(
        hf["gpt_neox.layers.0.attention.dense.weight"], hf["gpt_neox.layers.1.attention.dense.weight"]
    )
    assert not any(".layers.2." in k for k in hf)
    _, shapes = abstract_params(fam, model.config)
    back = params_from_hf(hf, fam, model.config, shapes, jnp.float32)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, model.params)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("gpt_neox.layers.1.mlp.dense_h_to_4h.bias"),
     "'gpt_neox.layers.1.mlp.dense_h_to_4h.bias' is missing"),
    (lambda t: t.update({"gpt_neox.layers.2.mlp.dense_h_to_4h.bias": np.zeros(64, np.float32)}),
     "unexpected tensor(s) not used by gpt_neox: gpt_neox.layers.2.mlp.dense_h_to_4h.bias"),
    (lambda t: t.update({"gpt_neox.layers.1.attention.dense.weight": np.zeros((32, 31), np.float32)}),
     "'gpt_neox.layers.1.attention.dense.weight' has shape (32, 31), expected (32, 32) for this config"),
], ids=["missing", "extra-layer", "misshaped"])
def test_per_layer_tensors_stay_strict(model, edit, message):
    fam = family("gpt_neox")
    tensors = params_to_hf(model.params, fam, model.config)
    edit(tensors)
    _, shapes = abstract_params(fam, model.config)
    with pytest.raises(CheckpointError) as e:
        params_from_hf(tensors, fam, model.config, shapes, jnp.float32, source="ckpt")
    assert str(e.value).startswith("ckpt: ") and message in str(e.value) and "\n" not in str(e.value)


def test_layer_transform_identity_and_offsets(model):
    tokens, mask = padded_batch(model.vocab_size, [9, 4, 7])
    valid = mask.astype(bool)

    def offset(i, p):  # layer i: every param + 0.01 * (i + 1), drawn inside the scan
        return jax.tree_util.tree_map(lambda a: a + 0.01 * (i + 1).astype(a.dtype), p)

    def shifted(params):  # the same offsets applied to the stacked params up front
        bump = 0.01 * jnp.arange(1, 3, dtype=jnp.float32)
        layers = jax.tree_util.tree_map(lambda a: a + bump.reshape((2,) + (1,) * (a.ndim - 1)), params["layers"])
        return {**params, "layers": layers}

    @jax.jit  # one compile for all passes
    def passes(params):
        return (
            model.logits(params, tokens, valid),
            model.logits(params, tokens, valid, layer_transform=lambda i, p: p),
            model.hidden(params, tokens, valid)[0],
            model.hidden(params, tokens, valid, layer_transform=offset),
            model.hidden(shifted(params), tokens, valid),
        )

    plain, same, h_plain, (h, kv), (h_want, kv_want) = jax.device_get(passes(model.params))
    np.testing.assert_array_equal(same, plain)
    assert np.abs(h - h_plain).max() > 1e-2  # the offsets matter
    np.testing.assert_allclose(h, h_want, atol=1e-6, rtol=0)
    np.testing.assert_allclose(kv.keys, kv_want.keys, atol=1e-6, rtol=0)
    assert kv.keys.shape == (2, 3, tokens.shape[1], 4, 8)  # [L, B, S, K, E]


def test_traced_program_does_not_grow_with_depth():
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    sizes = []
    for layers in (1, 6):
        module, shapes = abstract_params(family("gpt_neox"), _neox(layers))
        sizes.append(len(jax.make_jaxpr(lambda p, t: module.apply({"params": p}, t))(shapes, tokens).eqns))
    assert sizes[0] == sizes[1]


# ------------------------------------------------------------------------------------------------ testbed training
def test_weight_decay_mask_ignores_the_layer_axis(model):
    from mia.testbed.train import _decay_mask

    mask = _decay_mask(model.params)
    want = {  # matrices only, judged per layer (a stacked norm scale is [L, D] but still a vector)
        path: leaf.ndim - (path[0].key == "layers") >= 2
        for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]}
    got = dict(jax.tree_util.tree_flatten_with_path(mask)[0])
    assert got == want
    assert mask["layers"]["input_layernorm"]["weight"] is False and mask["layers"]["attention_dense"]["kernel"] is True


def test_train_state_of_the_unstacked_layout_is_never_read(model, tmp_path):
    from mia.models.hub import write_safetensors
    from mia.testbed.config import TestbedError
    from mia.testbed.train import STATE_FILE, latest_state, load_train_state

    old = tmp_path / "resume" / STATE_FILE
    old.parent.mkdir()
    write_safetensors({"params['layers_0']['attention_dense']['bias']": np.zeros(32, np.float32)}, old,
                      metadata={"format": "mia-train-state/1", "step": "5", "config_hash": "h"})
    assert latest_state(tmp_path, "h", upto=10) is None
    with pytest.raises(TestbedError, match="format 'mia-train-state/1'"):
        load_train_state(old, model.params, {}, "h")


@pytest.mark.parametrize("model_type", ["llama", "opt"])
def test_a_tied_heads_stored_copy_is_accepted_only_when_it_equals_the_embedding(model_type):
    """Some conversions store a tied model's head beside its embedding (transformers drops it): an exact copy
    loads as if absent; a head that differs is refused naming both tensors (config.json says they are one)."""
    from mia.doctor import random_params
    from mia.models.family import tiny_config

    fam = family(model_type)
    cfg = fam.config_cls.from_hf({**tiny_config(model_type), "tie_word_embeddings": True})
    module, shapes = abstract_params(fam, cfg)
    params = random_params(module, 0)
    tensors = params_to_hf(params, fam, cfg)
    head = f"{fam.module_cls.HEAD}.weight"
    embedding = next(k for k in tensors if k.endswith(f"{fam.module_cls.EMBED}.weight"))
    assert head not in tensors
    back = params_from_hf({**tensors, head: tensors[embedding].copy()}, fam, cfg, shapes, jnp.float32)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, params_from_hf(tensors, fam, cfg, shapes, jnp.float32))
    changed = tensors[embedding].copy()
    changed[3, 1] += 1.0
    with pytest.raises(CheckpointError) as e:
        params_from_hf({**tensors, head: changed}, fam, cfg, shapes, jnp.float32, source="ckpt")
    assert str(e.value).startswith(f"ckpt: tensor '{head}' differs from the token embedding '{embedding}'")


def test_stacked_layers_of_the_wrong_shape_are_refused_before_and_after_a_good_call():
    """The stacked layers' shape check (traced once per config) still refuses params of another depth or width,
    both on the first apply of a config and after a correct call has filled the per-config shapes."""
    import flax.errors

    fresh = _neox(3, hidden=16)  # a config no other test applies
    tokens, _ = padded_batch(fresh.vocab_size, [5, 3], seed=0)
    module = family("gpt_neox").module_cls(fresh)
    _, shapes = abstract_params(family("gpt_neox"), fresh)
    good = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    one_layer_short = {**good, "layers": jax.tree_util.tree_map(lambda x: x[:2], good["layers"])}
    for params in (one_layer_short, good, one_layer_short):
        if params is good:
            module.apply({"params": params}, jnp.asarray(tokens))
            continue
        with pytest.raises(flax.errors.ScopeParamShapeError):
            module.apply({"params": params}, jnp.asarray(tokens))
