"""GPT-NeoX (Pythia) as a Flax module, following transformers' ``modeling_gpt_neox.py``.

Layout notes (the places a port usually goes wrong):
- ``query_key_value`` is fused and interleaved *per head*: its output reshapes to [B, T, H, 3*E] and splits
  into q, k, v along the last axis (not three contiguous D-blocks).
- Partial rotary: only the first ``int(E * rotary_pct)`` channels of each head rotate, rotate_half layout.
- Parallel residual (Pythia): x + attn(ln1(x)) + mlp(ln2(x)); sequential otherwise.
- The LM head ``embed_out`` is untied by default.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from .common import (ConfigError, DecoderLayer, DecoderLM, KVCache, LayerNorm, ParamMapping, activation, apply_rotary,
                     attend, decoder_maps, linear_maps, norm_maps, rope_theta_from)
from .family import PartialRotary, TransformerConfig, hf_field, register_family


@dataclasses.dataclass(frozen=True)
class GPTNeoXConfig(PartialRotary, TransformerConfig):
    """``rotary_pct``: the rotating fraction of each head (``rope_parameters.partial_rotary_factor`` when given);
    ``rope_theta``: written as ``rotary_emb_base`` (either spelling is read, ``rope_theta_from``)."""

    MODEL_TYPE, ARCHITECTURE = "gpt_neox", "GPTNeoXForCausalLM"
    ROTARY_FRACTION = "rotary_pct"

    rotary_pct: float = hf_field(0.25, aliases=("partial_rotary_factor",))
    rope_theta: float = hf_field(10000.0, key="rotary_emb_base")
    max_position_embeddings: int = hf_field(2048)
    layer_norm_eps: float = hf_field(1e-5)
    hidden_act: str = hf_field("gelu")
    use_parallel_residual: bool = hf_field(True)
    attention_bias: bool = hf_field(True)
    tie_word_embeddings: bool = hf_field(False)
    bos_token_id: Optional[int] = hf_field(0)
    eos_token_id: Optional[int] = hf_field(0)

    @classmethod
    def derive(cls, hf: dict, values: dict) -> dict:
        if values["hidden_size"] % values["num_attention_heads"]:
            raise ConfigError("gpt_neox: hidden_size must be divisible by num_attention_heads")
        return {**values, "rotary_pct": cls.rotary_fraction(hf, values["rotary_pct"]),
                "rope_theta": rope_theta_from(hf, legacy_key="rotary_emb_base")}

    def hf_extra(self) -> dict:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                    "partial_rotary_factor": self.rotary_pct}}


class GPTNeoXLayer(DecoderLayer):
    @nn.compact
    def __call__(self, x_btd, cos, sin, pos_bt, valid_bt, layer, cache: Optional[KVCache]):
        cfg, dense, norm = self.config, self.dense, lambda name: self.layer_norm(self.config.layer_norm_eps, name)
        b, t, _ = x_btd.shape
        h, e = cfg.num_attention_heads, cfg.head_dim

        attn_in = norm("input_layernorm")(x_btd)
        qkv = dense(3 * cfg.hidden_size, "attention_query_key_value", cfg.attention_bias)(attn_in)
        q, k, v = jnp.split(qkv.reshape(b, t, h, 3 * e), 3, axis=-1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = attend(q, k, v, pos_bt, valid_bt, cache, scale=e ** -0.5)
        attn = dense(cfg.hidden_size, "attention_dense", cfg.attention_bias)(attn.reshape(b, t, h * e))

        act = activation(cfg.hidden_act)
        mlp = lambda y: dense(cfg.hidden_size, "mlp_dense_4h_to_h")(act(dense(cfg.intermediate_size,
                                                                              "mlp_dense_h_to_4h")(y)))
        if cfg.use_parallel_residual:
            out = x_btd + attn + mlp(norm("post_attention_layernorm")(x_btd))
        else:
            x_btd = x_btd + attn
            out = x_btd + mlp(norm("post_attention_layernorm")(x_btd))
        return out, (k, v)


class GPTNeoXForCausalLM(DecoderLM):
    """GPT-NeoX (Pythia) causal LM; ``setup``, ``hidden``, ``unembed`` and ``__call__`` come from
    ``common.DecoderLM``."""

    EMBED, LAYERS, NORM, HEAD = "embed_in", "layers", "final_layer_norm", "embed_out"
    LAYER = GPTNeoXLayer
    FINAL_NORM, NORM_EPS, HF_PREFIX = LayerNorm, "layer_norm_eps", "gpt_neox"
    ROTARY_DIM = "rotary_dim"



def param_mappings(cfg: GPTNeoXConfig) -> list[ParamMapping]:
    def layer(hf: str, p: tuple):
        bias = cfg.attention_bias
        return (norm_maps(f"{hf}.input_layernorm", p + ("input_layernorm",))
                + norm_maps(f"{hf}.post_attention_layernorm", p + ("post_attention_layernorm",))
                + linear_maps(f"{hf}.attention.query_key_value", p + ("attention_query_key_value",), bias)
                + linear_maps(f"{hf}.attention.dense", p + ("attention_dense",), bias)
                + linear_maps(f"{hf}.mlp.dense_h_to_4h", p + ("mlp_dense_h_to_4h",), True)
                + linear_maps(f"{hf}.mlp.dense_4h_to_h", p + ("mlp_dense_4h_to_h",), True))
    return decoder_maps(GPTNeoXForCausalLM, cfg, layer, norm=("weight", "bias"))


# HF buffers and tensors that carry no learned state we need.
IGNORED_HF_KEYS = (r"\.attention\.bias$", r"\.attention\.masked_bias$", r"rotary_emb\.inv_freq$")

# the doctor's tiny model (``family.tiny_config``): Pythia's options (partial rotary, parallel residual, untied head)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            rotary_pct=0.25, max_position_embeddings=512, tie_word_embeddings=False)

register_family(GPTNeoXConfig.MODEL_TYPE, GPTNeoXConfig, GPTNeoXForCausalLM, param_mappings,
                ignored_keys=IGNORED_HF_KEYS, tiny=TINY)
