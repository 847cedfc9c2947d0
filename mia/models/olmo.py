"""OLMo (v1, ``model_type: olmo``) as a Flax module, following transformers' ``modeling_olmo.py``.

Layout notes:
- Llama-shaped (separate q/k/v/o projections, GQA, full rotary rotate_half, SwiGLU), but every norm is a
  NON-parametric LayerNorm (no weight, no bias, eps fixed at 1e-5): the checkpoint has no norm tensors at all.
- ``clip_qkv``: when set, q, k and v are clamped to [-clip_qkv, clip_qkv] right after the projections.
- Rotary is applied in float32 and cast back (cos/sin are not cast down first, unlike Llama).
- ``lm_head`` untied by default (OLMo-1B ties it; OLMo-7B does not).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from .common import DecoderLayer, DecoderLM, KVCache, LayerNorm, attend, decoder_maps
from .family import hf_field, register_family
from .gqa import (HARMLESS_HF_FIELDS, IGNORED_HF_KEYS, GQAConfig, SwiGLU, attention_maps, mlp_maps,
                  rotary_f32)

LN_EPS = 1e-5  # hard-coded in transformers' OlmoLayerNorm


@dataclasses.dataclass(frozen=True)
class OlmoConfig(GQAConfig):
    MODEL_TYPE, ARCHITECTURE = "olmo", "OlmoForCausalLM"

    clip_qkv: Optional[float] = hf_field(None)
    bos_token_id: Optional[int] = hf_field(None)
    eos_token_id: Any = hf_field(50279)
    pad_token_id: Optional[int] = hf_field(1)

    @classmethod
    def derive(cls, hf: dict, values: dict) -> dict:
        clip = values["clip_qkv"]
        return {**super().derive(hf, values), "clip_qkv": None if clip is None else float(clip)}


def non_parametric_norm(dtype) -> LayerNorm:
    """OLMo's LayerNorm: no weight, no bias, eps ``LN_EPS``; stateless, so one instance serves every place."""
    return LayerNorm(LN_EPS, use_scale=False, use_bias=False, dtype=dtype)


class OlmoLayer(DecoderLayer):
    @nn.compact
    def __call__(self, x_btd, cos, sin, pos_bt, valid_bt, layer, cache: Optional[KVCache]):
        cfg, norm = self.config, non_parametric_norm(self.dtype)
        dense = lambda n, name: self.dense(n, name, cfg.attention_bias)
        b, t, _ = x_btd.shape
        h, kv, e = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        clip = (lambda a: jnp.clip(a, -cfg.clip_qkv, cfg.clip_qkv)) if cfg.clip_qkv is not None else (lambda a: a)

        y = norm(x_btd)
        q = clip(dense(h * e, "self_attn_q_proj")(y)).reshape(b, t, h, e)
        k = clip(dense(kv * e, "self_attn_k_proj")(y)).reshape(b, t, kv, e)
        v = clip(dense(kv * e, "self_attn_v_proj")(y)).reshape(b, t, kv, e)
        q, k = rotary_f32(q, cos, sin), rotary_f32(k, cos, sin)
        attn = attend(q, k, v, pos_bt, valid_bt, cache, scale=e ** -0.5)
        x_btd = x_btd + dense(cfg.hidden_size, "self_attn_o_proj")(attn.reshape(b, t, h * e))

        mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, False, self.dtype, self.param_dtype,
                     name="mlp")
        return x_btd + mlp(norm(x_btd)), (k, v)


class OlmoForCausalLM(DecoderLM):
    """OLMo causal LM; ``setup``, ``hidden``, ``unembed`` and ``__call__`` come from ``common.DecoderLM``."""

    LAYER = OlmoLayer

    def final_norm(self):
        return non_parametric_norm(self.dtype)


def param_mappings(cfg: OlmoConfig):
    layer = lambda hf, p: attention_maps(hf, p, cfg.attention_bias) + mlp_maps(hf, p, False)
    return decoder_maps(OlmoForCausalLM, cfg, layer, norm=())  # the norms have no parameters


# the doctor's tiny model (``family.tiny_config``): clip_qkv, grouped-query attention
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, clip_qkv=0.25, max_position_embeddings=512)

register_family(OlmoConfig.MODEL_TYPE, OlmoConfig, OlmoForCausalLM, param_mappings, ignored_keys=IGNORED_HF_KEYS,
                harmless=HARMLESS_HF_FIELDS, tiny=TINY)
