"""Llama as a Flax module, following transformers' ``modeling_llama.py``.

Layout notes:
- Separate ``q_proj``/``k_proj``/``v_proj``; k and v have ``num_key_value_heads`` heads (GQA), each ``head_dim`` wide
  (``head_dim`` may be set explicitly in config.json; otherwise hidden_size // num_attention_heads).
- Full rotary over each head, rotate_half layout; cos/sin cast to the activation dtype before use (as HF does).
- RMSNorm pre-norm residual blocks; SwiGLU MLP ``down(act(gate(x)) * up(x))``.
- ``lm_head`` untied by default; with ``tie_word_embeddings`` the checkpoint has no ``lm_head.weight``.
- RoPE scaling (``rope_scaling`` / ``rope_parameters``): ``linear`` and ``llama3`` (Llama 3.1 / 3.2), computed by
  ``rope.inv_freq``; other types are refused naming the field.

``LlamaLayer`` is also the layer of the families transformers builds from Llama's (Qwen2, Qwen3): they override
its hooks (``attention_biases``, ``project``, ``window``) instead of restating the block.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn

from .common import DecoderLayer, DecoderLM, KVCache, RMSNorm, apply_rotary, attend, decoder_maps, norm_maps
from .family import hf_field, register_family
from .gqa import HARMLESS_HF_FIELDS, IGNORED_HF_KEYS, GQAConfig, SwiGLU, attention_maps, mlp_maps
from .rope import SCALED_TYPES


@dataclasses.dataclass(frozen=True)
class LlamaConfig(GQAConfig):
    MODEL_TYPE, ARCHITECTURE = "llama", "LlamaForCausalLM"
    ROPE_TYPES = SCALED_TYPES

    rms_norm_eps: float = hf_field(1e-6)
    mlp_bias: bool = hf_field(False)
    bos_token_id: Optional[int] = hf_field(1)
    eos_token_id: Any = hf_field(2)


class LlamaLayer(DecoderLayer):
    """Pre-norm block: x + o_proj(attention(input_layernorm(x))), then x + mlp(post_attention_layernorm(x)).

    Hooks for the families built on it: ``attention_biases()`` -> (q/k/v bias, o bias); ``project(y, name,
    heads)`` -> one projection reshaped to heads [B, T, heads, E] (before rotary); ``window(layer)`` -> the local
    attention window of layer ``layer`` (a traced index), or None for full causal attention."""

    def attention_biases(self) -> tuple[bool, bool]:
        return self.config.attention_bias, self.config.attention_bias

    def project(self, y_btd, name: str, heads: int):
        (b, t, _), e = y_btd.shape, self.config.head_dim
        proj = self.dense(heads * e, f"self_attn_{name}_proj", self.attention_biases()[0])
        return proj(y_btd).reshape(b, t, heads, e)

    def window(self, layer):
        """Llama attends globally; Mistral and Qwen2 override this with their sliding windows."""
        return None

    def mlp(self) -> SwiGLU:
        cfg = self.config
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, getattr(cfg, "mlp_bias", False),
                      self.dtype, self.param_dtype, name="mlp")

    @nn.compact
    def __call__(self, x_btd, cos, sin, pos_bt, valid_bt, layer, cache: Optional[KVCache]):
        cfg, norm = self.config, lambda name: self.rms_norm(self.config.rms_norm_eps, name)
        b, t, _ = x_btd.shape
        h, kv, e = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

        y = norm("input_layernorm")(x_btd)
        q, k, v = self.project(y, "q", h), self.project(y, "k", kv), self.project(y, "v", kv)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = attend(q, k, v, pos_bt, valid_bt, cache, scale=e ** -0.5, window=self.window(layer))
        o_proj = self.dense(cfg.hidden_size, "self_attn_o_proj", self.attention_biases()[1])
        x_btd = x_btd + o_proj(attn.reshape(b, t, h * e))
        return x_btd + self.mlp()(norm("post_attention_layernorm")(x_btd)), (k, v)


class LlamaForCausalLM(DecoderLM):
    """Llama causal LM; ``setup``, ``hidden``, ``unembed`` and ``__call__`` come from ``common.DecoderLM``."""

    LAYER, FINAL_NORM, NORM_EPS = LlamaLayer, RMSNorm, "rms_norm_eps"


def layer_maps(hf: str, p: tuple, qkv_bias: bool, o_bias: bool, mlp_bias: bool) -> list:
    """One Llama-shaped layer's tensors: its two norms, the attention projections and the MLP."""
    return (norm_maps(f"{hf}.input_layernorm", p + ("input_layernorm",), bias=False)
            + norm_maps(f"{hf}.post_attention_layernorm", p + ("post_attention_layernorm",), bias=False)
            + attention_maps(hf, p, qkv_bias, o_bias) + mlp_maps(hf, p, mlp_bias))


def param_mappings(cfg: LlamaConfig):
    bias = cfg.attention_bias
    return decoder_maps(LlamaForCausalLM, cfg, lambda hf, p: layer_maps(hf, p, bias, bias, cfg.mlp_bias))


# the doctor's tiny model (``family.tiny_config``): grouped-query attention (4 query heads on 2 kv heads)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)

register_family(LlamaConfig.MODEL_TYPE, LlamaConfig, LlamaForCausalLM, param_mappings, ignored_keys=IGNORED_HF_KEYS,
                harmless=HARMLESS_HF_FIELDS, tiny=TINY)
