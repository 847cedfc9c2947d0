"""Phi-3 (``model_type: phi3``) as a Flax module, following transformers' ``modeling_phi3.py``.

Layout notes:
- Llama-shaped (RMSNorm pre-norm blocks, GQA, rotate_half rotary with cos/sin cast to the activation dtype, SiLU
  gated MLP, untied head by default), with two fused projections and no biases anywhere:
  ``qkv_proj`` [D -> H*E + 2*K*E] split into contiguous q | k | v blocks, and ``gate_up_proj`` [D -> 2F] split into
  gate | up halves: ``down_proj(up * act(gate))``.
- ``sliding_window`` (Phi-3-mini-4k: 2047): every layer attends to keys with q_pos - k_pos < sliding_window.
- Partial rotary: ``partial_rotary_factor`` (in ``rope_parameters`` or flat) rotates the first
  int(E * factor) channels of each head.
- Only unscaled RoPE: ``longrope`` / ``su`` (the 128k-context models' ``rope_scaling``) are refused by name.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from .common import (ConfigError, DecoderLayer, DecoderLM, KVCache, RMSNorm, activation, apply_rotary, attend,
                     decoder_maps, linear_maps, norm_maps)
from .family import PartialRotary, hf_field, register_family
from .gqa import GQA_REFUSED, IGNORED_HF_KEYS, GQAConfig

# transformers' Phi3 builds its projections without biases whatever these say, so a checkpoint that sets them is not
# one it computes; sliding_window is implemented, not refused
REFUSED = {**{k: v for k, v in GQA_REFUSED.items() if k != "sliding_window"}, "attention_bias": bool, "mlp_bias": bool}


@dataclasses.dataclass(frozen=True)
class Phi3Config(PartialRotary, GQAConfig):
    MODEL_TYPE, ARCHITECTURE = "phi3", "Phi3ForCausalLM"
    REFUSED = REFUSED

    max_position_embeddings: int = hf_field(4096)
    rms_norm_eps: float = hf_field(1e-5)
    sliding_window: Optional[int] = hf_field(None)
    partial_rotary_factor: float = hf_field(1.0)
    bos_token_id: Optional[int] = hf_field(1)
    eos_token_id: Any = hf_field(32000)
    pad_token_id: Optional[int] = hf_field(32000)

    @classmethod
    def derive(cls, hf: dict, values: dict) -> dict:
        window = values["sliding_window"]
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ConfigError(f"phi3: config field sliding_window={window!r} must be a positive integer or null")
        factor = cls.rotary_fraction(hf, values["partial_rotary_factor"])
        if not 0 < factor <= 1:
            raise ConfigError(f"phi3: config field partial_rotary_factor={factor!r} must be in (0, 1]")
        return {**super().derive(hf, values), "partial_rotary_factor": factor}

    def hf_extra(self) -> dict:
        return {"rope_parameters": {**super().hf_extra()["rope_parameters"],
                                    "partial_rotary_factor": self.partial_rotary_factor}}


class Phi3DecoderLayer(DecoderLayer):
    @nn.compact
    def __call__(self, x_btd, cos, sin, pos_bt, valid_bt, layer, cache: Optional[KVCache]):
        cfg, norm = self.config, lambda name: self.rms_norm(self.config.rms_norm_eps, name)
        dense = lambda n, name: self.dense(n, name, False)
        b, t, _ = x_btd.shape
        h, kv, e = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

        qkv = dense(h * e + 2 * kv * e, "self_attn_qkv_proj")(norm("input_layernorm")(x_btd))
        q, k, v = jnp.split(qkv, [h * e, (h + kv) * e], axis=-1)
        q, k, v = q.reshape(b, t, h, e), k.reshape(b, t, kv, e), v.reshape(b, t, kv, e)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = attend(q, k, v, pos_bt, valid_bt, cache, scale=e ** -0.5, window=cfg.sliding_window)
        x_btd = x_btd + dense(cfg.hidden_size, "self_attn_o_proj")(attn.reshape(b, t, h * e))

        gate, up = jnp.split(dense(2 * cfg.intermediate_size, "mlp_gate_up_proj")(
            norm("post_attention_layernorm")(x_btd)), 2, axis=-1)
        return x_btd + dense(cfg.hidden_size, "mlp_down_proj")(up * activation(cfg.hidden_act)(gate)), (k, v)


class Phi3ForCausalLM(DecoderLM):
    """Phi-3 causal LM; ``setup``, ``hidden``, ``unembed`` and ``__call__`` come from ``common.DecoderLM``."""

    LAYER, FINAL_NORM, NORM_EPS, ROTARY_DIM = Phi3DecoderLayer, RMSNorm, "rms_norm_eps", "rotary_dim"


def param_mappings(cfg: Phi3Config):
    def layer(hf: str, p: tuple):
        m = []
        for name in ("input_layernorm", "post_attention_layernorm"):
            m += norm_maps(f"{hf}.{name}", p + (name,), bias=False)
        for proj in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            m += linear_maps(f"{hf}.{proj}", p + (proj.replace(".", "_"),), False)
        return m
    return decoder_maps(Phi3ForCausalLM, cfg, layer)


# original_max_position_embeddings: read by longrope scaling only, which is refused; auto_map: the repository's own
# modeling code, never run (mia computes transformers' Phi3ForCausalLM, which is what that code implements)
HARMLESS_HF_FIELDS = ("original_max_position_embeddings", "auto_map")

# the doctor's tiny model (``family.tiny_config``): GQA, a sliding window shorter than the check rows, half rotary
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, sliding_window=64, partial_rotary_factor=0.5, max_position_embeddings=512)

register_family(Phi3Config.MODEL_TYPE, Phi3Config, Phi3ForCausalLM, param_mappings, ignored_keys=IGNORED_HF_KEYS,
                harmless=HARMLESS_HF_FIELDS, tiny=TINY)
