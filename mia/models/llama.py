"""Llama as a Flax module, following transformers' ``modeling_llama.py``.

Layout notes:
- Separate ``q_proj``/``k_proj``/``v_proj``; k and v have ``num_key_value_heads`` heads (GQA), each ``head_dim`` wide
  (``head_dim`` may be set explicitly in config.json; otherwise hidden_size // num_attention_heads).
- Full rotary over each head, rotate_half layout; cos/sin cast to the activation dtype before use (as HF does).
- RMSNorm pre-norm residual blocks; SwiGLU MLP ``down(act(gate(x)) * up(x))``.
- ``lm_head`` untied by default; with ``tie_word_embeddings`` the checkpoint has no ``lm_head.weight``.

``SwiGLU`` and ``LLAMA_REFUSED`` are reused by the OLMo families.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from .common import (
    DecoderLM,
    ConfigError,
    KVCache,
    ParamMapping,
    at_layer,
    RMSNorm,
    activation,
    apply_rotary,
    refuse_values,
    dot_product_attention,
    join_cache,
    linear_maps,
    norm_maps,
    rope_theta_from,
)
from .family import register_family

MODEL_TYPE = "llama"

# Config fields that would change the math and that we do not implement (value -> refuse?).
LLAMA_REFUSED = {
    "sliding_window": lambda v: v is not None,
    "use_sliding_window": bool,
    "attention_logit_softcapping": lambda v: v is not None,
    "final_logit_softcapping": lambda v: v is not None,
}


def gqa_heads(model_type: str, hf: dict) -> tuple[int, int, int]:
    """(num_attention_heads, num_key_value_heads, head_dim) from an HF config dict, checked."""
    h = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or h
    if h % kv:
        raise ConfigError(f"{model_type}: num_attention_heads={h} is not a multiple of num_key_value_heads={kv}")
    e = hf.get("head_dim") or hf["hidden_size"] // h
    return h, kv, int(e)


class SwiGLU(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``; param names ``mlp_{gate,up,down}_proj``."""

    hidden_size: int
    intermediate_size: int
    hidden_act: str = "silu"
    use_bias: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd):
        dense = lambda n, name: nn.Dense(
            n, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype, name=name
        )
        gate = activation(self.hidden_act)(dense(self.intermediate_size, "gate_proj")(x_btd))
        return dense(self.hidden_size, "down_proj")(gate * dense(self.intermediate_size, "up_proj")(x_btd))


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = 1
    eos_token_id: Any = 2

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        refuse_values(MODEL_TYPE, hf, LLAMA_REFUSED)
        h, kv, e = gqa_heads(MODEL_TYPE, hf)
        activation(hf.get("hidden_act", "silu"))  # fail early on an unknown activation
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
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            hidden_act=hf.get("hidden_act", "silu"),
            attention_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id", 1),
            eos_token_id=hf.get("eos_token_id", 2),
        )

    def to_hf(self) -> dict:
        return {
            "model_type": MODEL_TYPE,
            "architectures": ["LlamaForCausalLM"],
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
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }


class LlamaLayer(nn.Module):
    config: LlamaConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd, cos, sin, pos_bt, valid_bt, layer, cache: Optional[KVCache]):
        cfg = self.config
        b, t, _ = x_btd.shape
        h, kv, e = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        dense = lambda n, name, bias: nn.Dense(
            n, use_bias=bias, dtype=self.dtype, param_dtype=self.param_dtype, name=name
        )
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

        y = norm("input_layernorm")(x_btd)
        q = dense(h * e, "self_attn_q_proj", cfg.attention_bias)(y).reshape(b, t, h, e)
        k = dense(kv * e, "self_attn_k_proj", cfg.attention_bias)(y).reshape(b, t, kv, e)
        v = dense(kv * e, "self_attn_v_proj", cfg.attention_bias)(y).reshape(b, t, kv, e)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_all, v_all, kpos, kvalid = join_cache(cache, k, v, pos_bt, valid_bt)
        attn = dot_product_attention(q, k_all, v_all, pos_bt, kpos, kvalid, scale=e ** -0.5)
        x_btd = x_btd + dense(cfg.hidden_size, "self_attn_o_proj", cfg.attention_bias)(attn.reshape(b, t, h * e))

        mlp = SwiGLU(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.hidden_act,
            cfg.mlp_bias,
            self.dtype,
            self.param_dtype,
            name="mlp",
        )
        return x_btd + mlp(norm("post_attention_layernorm")(x_btd)), (k, v)


class LlamaForCausalLM(DecoderLM):
    """Llama causal LM; ``hidden``, ``unembed`` and ``__call__`` come from ``common.DecoderLM``."""

    LAYER = LlamaLayer

    def setup(self):
        cfg = self.config
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype)
        self.layers = self.layer_stack()
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)


def attention_maps(hf: str, p: tuple, bias: bool) -> list[ParamMapping]:
    """Llama-style ``self_attn.{q,k,v,o}_proj`` (shared with the OLMo families)."""
    m = []
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        m += linear_maps(f"{hf}.self_attn.{proj}", p + (f"self_attn_{proj}",), bias)
    return m


def mlp_maps(hf: str, p: tuple, bias: bool) -> list[ParamMapping]:
    m = []
    for proj in ("gate_proj", "up_proj", "down_proj"):
        m += linear_maps(f"{hf}.mlp.{proj}", p + ("mlp", proj), bias)
    return m


def param_mappings(cfg: LlamaConfig) -> list[ParamMapping]:
    m = [ParamMapping("model.embed_tokens.weight", ("embed_tokens", "embedding"))]
    for i in range(cfg.num_hidden_layers):
        hf, p = f"model.layers.{i}", ("layers",)
        layer: list[ParamMapping] = []
        layer += norm_maps(f"{hf}.input_layernorm", p + ("input_layernorm",), bias=False)
        layer += norm_maps(f"{hf}.post_attention_layernorm", p + ("post_attention_layernorm",), bias=False)
        layer += attention_maps(hf, p, cfg.attention_bias)
        layer += mlp_maps(hf, p, cfg.mlp_bias)
        m += at_layer(i, layer)
    m += norm_maps("model.norm", ("norm",), bias=False)
    if not cfg.tie_word_embeddings:
        m.append(ParamMapping("lm_head.weight", ("lm_head", "kernel"), transpose=True))
    return m


# Old checkpoints carry the rotary buffer.
IGNORED_HF_KEYS = (r"rotary_emb\.inv_freq$",)

# pretraining_tp: a training-time split of the matmuls (the same products)
HARMLESS_HF_FIELDS = ("pretraining_tp",)

# the doctor's tiny model (``family.tiny_config``): grouped-query attention (4 query heads on 2 kv heads)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)

register_family(MODEL_TYPE, LlamaConfig, LlamaForCausalLM, param_mappings, ignored_keys=IGNORED_HF_KEYS,
                harmless=HARMLESS_HF_FIELDS, tiny=TINY)
