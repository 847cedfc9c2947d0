"""Llama as a Flax module, following transformers' ``modeling_llama.py``.

Layout notes:
- Separate ``q_proj``/``k_proj``/``v_proj``; k and v have ``num_key_value_heads`` heads (GQA), each ``head_dim`` wide
  (``head_dim`` may be set explicitly in config.json; otherwise hidden_size // num_attention_heads).
- Full rotary over each head, rotate_half layout; cos/sin cast to the activation dtype before use (as HF does).
- RMSNorm pre-norm residual blocks; SwiGLU MLP ``down(act(gate(x)) * up(x))``.
- ``lm_head`` untied by default; with ``tie_word_embeddings`` the checkpoint has no ``lm_head.weight``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn

from .common import DecoderLayer, DecoderLM, KVCache, RMSNorm, apply_rotary, attend, decoder_maps, norm_maps
from .family import hf_field, register_family
from .gqa import HARMLESS_HF_FIELDS, IGNORED_HF_KEYS, GQAConfig, SwiGLU, attention_maps, mlp_maps

@dataclasses.dataclass(frozen=True)
class LlamaConfig(GQAConfig):
    MODEL_TYPE, ARCHITECTURE = "llama", "LlamaForCausalLM"

    rms_norm_eps: float = hf_field(1e-6)
    mlp_bias: bool = hf_field(False)
    bos_token_id: Optional[int] = hf_field(1)
    eos_token_id: Any = hf_field(2)


class LlamaLayer(DecoderLayer):
    @nn.compact
    def __call__(self, x_btd, cos, sin, pos_bt, valid_bt, layer, cache: Optional[KVCache]):
        cfg, dense, norm = self.config, self.dense, lambda name: self.rms_norm(self.config.rms_norm_eps, name)
        b, t, _ = x_btd.shape
        h, kv, e, bias = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.attention_bias

        y = norm("input_layernorm")(x_btd)
        q = dense(h * e, "self_attn_q_proj", bias)(y).reshape(b, t, h, e)
        k = dense(kv * e, "self_attn_k_proj", bias)(y).reshape(b, t, kv, e)
        v = dense(kv * e, "self_attn_v_proj", bias)(y).reshape(b, t, kv, e)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = attend(q, k, v, pos_bt, valid_bt, cache, scale=e ** -0.5, window=self.window(layer))
        x_btd = x_btd + dense(cfg.hidden_size, "self_attn_o_proj", bias)(attn.reshape(b, t, h * e))

        mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias, self.dtype,
                     self.param_dtype, name="mlp")
        return x_btd + mlp(norm("post_attention_layernorm")(x_btd)), (k, v)

    def window(self, layer):
        """The local-attention window of layer ``layer`` (``common.layer_window``): Llama attends globally; Mistral
        overrides it with its sliding window."""
        return None


class LlamaForCausalLM(DecoderLM):
    """Llama causal LM; ``setup``, ``hidden``, ``unembed`` and ``__call__`` come from ``common.DecoderLM``."""

    LAYER, FINAL_NORM, NORM_EPS = LlamaLayer, RMSNorm, "rms_norm_eps"


def param_mappings(cfg: LlamaConfig):
    def layer(hf: str, p: tuple):
        return (norm_maps(f"{hf}.input_layernorm", p + ("input_layernorm",), bias=False)
                + norm_maps(f"{hf}.post_attention_layernorm", p + ("post_attention_layernorm",), bias=False)
                + attention_maps(hf, p, cfg.attention_bias) + mlp_maps(hf, p, cfg.mlp_bias))
    return decoder_maps(LlamaForCausalLM, cfg, layer)


# the doctor's tiny model (``family.tiny_config``): grouped-query attention (4 query heads on 2 kv heads)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)

register_family(LlamaConfig.MODEL_TYPE, LlamaConfig, LlamaForCausalLM, param_mappings, ignored_keys=IGNORED_HF_KEYS,
                harmless=HARMLESS_HF_FIELDS, tiny=TINY)
