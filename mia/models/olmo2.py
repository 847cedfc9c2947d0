"""OLMo-2 (``model_type: olmo2``) as a Flax module, following transformers' ``modeling_olmo2.py``.

Layout notes:
- Llama-shaped projections (GQA, full rotary rotate_half in float32 as in OLMo, SwiGLU), RMSNorm everywhere.
- ``q_norm``/``k_norm``: RMSNorm over the full projected q / k width (H*E and K*E), BEFORE the reshape to heads.
- Post-norm residuals, no input norm: x + post_attention_layernorm(attn(x)), then
  x + post_feedforward_layernorm(mlp(x)).
- RMSNorm multiplies by the weight in float32 and then casts (``(w * x).to(dtype)``), which is what common.RMSNorm does.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn

from .common import DecoderLayer, DecoderLM, KVCache, RMSNorm, attend, decoder_maps, norm_maps
from .family import hf_field, register_family
from .gqa import (HARMLESS_HF_FIELDS, IGNORED_HF_KEYS, GQAConfig, SwiGLU, attention_maps, mlp_maps,
                  rotary_f32)


@dataclasses.dataclass(frozen=True)
class Olmo2Config(GQAConfig):
    MODEL_TYPE, ARCHITECTURE = "olmo2", "Olmo2ForCausalLM"

    rms_norm_eps: float = hf_field(1e-5)
    bos_token_id: Optional[int] = hf_field(None)
    eos_token_id: Any = hf_field(50279)
    pad_token_id: Optional[int] = hf_field(1)


class Olmo2Layer(DecoderLayer):
    @nn.compact
    def __call__(self, x_btd, cos, sin, pos_bt, valid_bt, layer, cache: Optional[KVCache]):
        cfg, norm = self.config, lambda name: self.rms_norm(self.config.rms_norm_eps, name)
        dense = lambda n, name: self.dense(n, name, cfg.attention_bias)
        b, t, _ = x_btd.shape
        h, kv, e = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

        q = norm("self_attn_q_norm")(dense(h * e, "self_attn_q_proj")(x_btd)).reshape(b, t, h, e)
        k = norm("self_attn_k_norm")(dense(kv * e, "self_attn_k_proj")(x_btd)).reshape(b, t, kv, e)
        v = dense(kv * e, "self_attn_v_proj")(x_btd).reshape(b, t, kv, e)
        q, k = rotary_f32(q, cos, sin), rotary_f32(k, cos, sin)
        attn = attend(q, k, v, pos_bt, valid_bt, cache, scale=e ** -0.5)
        attn = dense(cfg.hidden_size, "self_attn_o_proj")(attn.reshape(b, t, h * e))
        x_btd = x_btd + norm("post_attention_layernorm")(attn)

        mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, False, self.dtype, self.param_dtype,
                     name="mlp")
        return x_btd + norm("post_feedforward_layernorm")(mlp(x_btd)), (k, v)


class Olmo2ForCausalLM(DecoderLM):
    """OLMo-2 causal LM; ``setup``, ``hidden``, ``unembed`` and ``__call__`` come from ``common.DecoderLM``."""

    LAYER, FINAL_NORM, NORM_EPS = Olmo2Layer, RMSNorm, "rms_norm_eps"


def param_mappings(cfg: Olmo2Config):
    def layer(hf: str, p: tuple):
        norms = [(f"{hf}.self_attn.q_norm", "self_attn_q_norm"), (f"{hf}.self_attn.k_norm", "self_attn_k_norm"),
                 (f"{hf}.post_attention_layernorm", "post_attention_layernorm"),
                 (f"{hf}.post_feedforward_layernorm", "post_feedforward_layernorm")]
        return (attention_maps(hf, p, cfg.attention_bias)
                + [m for name, leaf in norms for m in norm_maps(name, p + (leaf,), bias=False)]
                + mlp_maps(hf, p, False))
    return decoder_maps(Olmo2ForCausalLM, cfg, layer)


# the doctor's tiny model (``family.tiny_config``): q/k norms, grouped-query attention
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)

register_family(Olmo2Config.MODEL_TYPE, Olmo2Config, Olmo2ForCausalLM, param_mappings, ignored_keys=IGNORED_HF_KEYS,
                harmless=HARMLESS_HF_FIELDS, tiny=TINY)
