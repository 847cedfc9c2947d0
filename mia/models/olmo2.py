"""OLMo-2 (``model_type: olmo2``) as a Flax module, following transformers' ``modeling_olmo2.py``.

Layout notes:
- Llama-shaped projections (GQA, full rotary rotate_half in float32 as in OLMo, SwiGLU), RMSNorm everywhere.
- ``q_norm``/``k_norm``: RMSNorm over the full projected q / k width (H*E and K*E), BEFORE the reshape to heads.
- Post-norm residuals, no input norm: x + post_attention_layernorm(attn(x)), then x +
post_feedforward_layernorm(mlp(x)).
- RMSNorm multiplies by the weight in float32 and then casts (``(w * x).to(dtype)``), which is what common.RMSNorm does.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from .common import (
    DecoderLM,
    KVCache,
    ParamMapping,
    at_layer,
    RMSNorm,
    activation,
    refuse_values,
    dot_product_attention,
    join_cache,
    norm_maps,
    rope_theta_from,
)
from .family import register_family
from .llama import LLAMA_REFUSED, SwiGLU, attention_maps, gqa_heads, mlp_maps
from .olmo import rotary_f32

MODEL_TYPE = "olmo2"


@dataclasses.dataclass(frozen=True)
class Olmo2Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Any = 50279
    pad_token_id: Optional[int] = 1

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @classmethod
    def from_hf(cls, hf: dict) -> "Olmo2Config":
        refuse_values(MODEL_TYPE, hf, LLAMA_REFUSED)
        h, kv, e = gqa_heads(MODEL_TYPE, hf)
        activation(hf.get("hidden_act", "silu"))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=h,
            intermediate_size=hf["intermediate_size"],
            num_key_value_heads=kv,
            head_dim=e,
            rope_theta=rope_theta_from(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            hidden_act=hf.get("hidden_act", "silu"),
            attention_bias=hf.get("attention_bias", False),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id", 50279),
            pad_token_id=hf.get("pad_token_id", 1),
        )

    def to_hf(self) -> dict:
        return {
            "model_type": MODEL_TYPE,
            "architectures": ["Olmo2ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }


class Olmo2Layer(nn.Module):
    config: Olmo2Config
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd, cos, sin, pos_bt, valid_bt, layer, cache: Optional[KVCache]):
        cfg = self.config
        b, t, _ = x_btd.shape
        h, kv, e = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        dense = lambda n, name: nn.Dense(
            n, use_bias=cfg.attention_bias, dtype=self.dtype, param_dtype=self.param_dtype, name=name
        )
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

        q = norm("self_attn_q_norm")(dense(h * e, "self_attn_q_proj")(x_btd)).reshape(b, t, h, e)
        k = norm("self_attn_k_norm")(dense(kv * e, "self_attn_k_proj")(x_btd)).reshape(b, t, kv, e)
        v = dense(kv * e, "self_attn_v_proj")(x_btd).reshape(b, t, kv, e)
        q, k = rotary_f32(q, cos, sin), rotary_f32(k, cos, sin)
        k_all, v_all, kpos, kvalid = join_cache(cache, k, v, pos_bt, valid_bt)
        attn = dot_product_attention(q, k_all, v_all, pos_bt, kpos, kvalid, scale=e ** -0.5)
        attn = dense(cfg.hidden_size, "self_attn_o_proj")(attn.reshape(b, t, h * e))
        x_btd = x_btd + norm("post_attention_layernorm")(attn)

        mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, False, self.dtype, self.param_dtype,
                     name="mlp")
        return x_btd + norm("post_feedforward_layernorm")(mlp(x_btd)), (k, v)


class Olmo2ForCausalLM(DecoderLM):
    """OLMo-2 causal LM; ``hidden``, ``unembed`` and ``__call__`` come from ``common.DecoderLM``."""

    LAYER = Olmo2Layer

    def setup(self):
        cfg = self.config
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype)
        self.layers = self.layer_stack()
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)


def param_mappings(cfg: Olmo2Config) -> list[ParamMapping]:
    m = [ParamMapping("model.embed_tokens.weight", ("embed_tokens", "embedding"))]
    for i in range(cfg.num_hidden_layers):
        hf, p = f"model.layers.{i}", ("layers",)
        layer: list[ParamMapping] = []
        layer += attention_maps(hf, p, cfg.attention_bias)
        layer += norm_maps(f"{hf}.self_attn.q_norm", p + ("self_attn_q_norm",), bias=False)
        layer += norm_maps(f"{hf}.self_attn.k_norm", p + ("self_attn_k_norm",), bias=False)
        layer += norm_maps(f"{hf}.post_attention_layernorm", p + ("post_attention_layernorm",), bias=False)
        layer += norm_maps(f"{hf}.post_feedforward_layernorm", p + ("post_feedforward_layernorm",), bias=False)
        layer += mlp_maps(hf, p, False)
        m += at_layer(i, layer)
    m += norm_maps("model.norm", ("norm",), bias=False)
    if not cfg.tie_word_embeddings:
        m.append(ParamMapping("lm_head.weight", ("lm_head", "kernel"), transpose=True))
    return m


IGNORED_HF_KEYS = (r"rotary_emb\.inv_freq$",)

# pretraining_tp: a training-time split of the matmuls (the same products)
HARMLESS_HF_FIELDS = ("pretraining_tp",)

# the doctor's tiny model (``family.tiny_config``): q/k norms, grouped-query attention
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)

register_family(MODEL_TYPE, Olmo2Config, Olmo2ForCausalLM, param_mappings, ignored_keys=IGNORED_HF_KEYS,
                harmless=HARMLESS_HF_FIELDS, tiny=TINY)
