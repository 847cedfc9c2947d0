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
from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from .common import (
    DecoderLM,
    ConfigError,
    KVCache,
    LayerNorm,
    ParamMapping,
    at_layer,
    activation,
    apply_rotary,
    dot_product_attention,
    join_cache,
    linear_maps,
    norm_maps,
    rope_theta_from,
)
from .family import register_family

MODEL_TYPE = "gpt_neox"


@dataclasses.dataclass(frozen=True)
class GPTNeoXConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    rotary_pct: float = 0.25
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    layer_norm_eps: float = 1e-5
    hidden_act: str = "gelu"
    use_parallel_residual: bool = True
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = 0
    eos_token_id: Optional[int] = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    @classmethod
    def from_hf(cls, hf: dict) -> "GPTNeoXConfig":
        rope = hf.get("rope_parameters") or {}
        rotary_pct = rope.get("partial_rotary_factor", hf.get("rotary_pct", hf.get("partial_rotary_factor", 0.25)))
        if hf.get("hidden_size", 0) % hf.get("num_attention_heads", 1):
            raise ConfigError("gpt_neox: hidden_size must be divisible by num_attention_heads")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            rotary_pct=float(rotary_pct),
            rope_theta=rope_theta_from(hf, legacy_key="rotary_emb_base"),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-5),
            hidden_act=hf.get("hidden_act", "gelu"),
            use_parallel_residual=hf.get("use_parallel_residual", True),
            attention_bias=hf.get("attention_bias", True),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id", 0),
            eos_token_id=hf.get("eos_token_id", 0),
        )

    def to_hf(self) -> dict:
        return {
            "model_type": MODEL_TYPE,
            "architectures": ["GPTNeoXForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "rotary_pct": self.rotary_pct,
            "rotary_emb_base": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.rotary_pct},
            "max_position_embeddings": self.max_position_embeddings,
            "layer_norm_eps": self.layer_norm_eps,
            "hidden_act": self.hidden_act,
            "use_parallel_residual": self.use_parallel_residual,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }


class GPTNeoXLayer(nn.Module):
    config: GPTNeoXConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd, cos, sin, pos_bt, valid_bt, layer, cache: Optional[KVCache]):
        cfg = self.config
        b, t, _ = x_btd.shape
        h, e = cfg.num_attention_heads, cfg.head_dim
        dense = lambda n, name, bias=True: nn.Dense(
            n, use_bias=bias, dtype=self.dtype, param_dtype=self.param_dtype, name=name
        )
        norm = lambda name: LayerNorm(cfg.layer_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

        attn_in = norm("input_layernorm")(x_btd)
        qkv = dense(3 * cfg.hidden_size, "attention_query_key_value", cfg.attention_bias)(attn_in)
        q, k, v = jnp.split(qkv.reshape(b, t, h, 3 * e), 3, axis=-1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_all, v_all, kpos, kvalid = join_cache(cache, k, v, pos_bt, valid_bt)
        attn = dot_product_attention(q, k_all, v_all, pos_bt, kpos, kvalid, scale=e ** -0.5)
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
    """GPT-NeoX (Pythia) causal LM; ``hidden``, ``unembed`` and ``__call__`` come from ``common.DecoderLM``."""

    EMBED, LAYERS, NORM, HEAD = "embed_in", "layers", "final_layer_norm", "embed_out"
    LAYER = GPTNeoXLayer
    ROTARY_DIM = "rotary_dim"

    def setup(self):
        cfg = self.config
        self.embed_in = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype)
        self.layers = self.layer_stack()
        self.final_layer_norm = LayerNorm(cfg.layer_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype)
        if not cfg.tie_word_embeddings:
            self.embed_out = nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)


def param_mappings(cfg: GPTNeoXConfig) -> list[ParamMapping]:
    m = [ParamMapping("gpt_neox.embed_in.weight", ("embed_in", "embedding"))]
    for i in range(cfg.num_hidden_layers):
        hf, p = f"gpt_neox.layers.{i}", ("layers",)
        layer: list[ParamMapping] = []
        layer += norm_maps(f"{hf}.input_layernorm", p + ("input_layernorm",))
        layer += norm_maps(f"{hf}.post_attention_layernorm", p + ("post_attention_layernorm",))
        layer += linear_maps(f"{hf}.attention.query_key_value", p + ("attention_query_key_value",), cfg.attention_bias)
        layer += linear_maps(f"{hf}.attention.dense", p + ("attention_dense",), cfg.attention_bias)
        layer += linear_maps(f"{hf}.mlp.dense_h_to_4h", p + ("mlp_dense_h_to_4h",), True)
        layer += linear_maps(f"{hf}.mlp.dense_4h_to_h", p + ("mlp_dense_4h_to_h",), True)
        m += at_layer(i, layer)
    m += norm_maps("gpt_neox.final_layer_norm", ("final_layer_norm",))
    if not cfg.tie_word_embeddings:
        m.append(ParamMapping("embed_out.weight", ("embed_out", "kernel"), transpose=True))
    return m


# HF buffers and tensors that carry no learned state we need.
IGNORED_HF_KEYS = (r"\.attention\.bias$", r"\.attention\.masked_bias$", r"rotary_emb\.inv_freq$")

# the doctor's tiny model (``family.tiny_config``): Pythia's options (partial rotary, parallel residual, untied head)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            rotary_pct=0.25, max_position_embeddings=512, tie_word_embeddings=False)

register_family(MODEL_TYPE, GPTNeoXConfig, GPTNeoXForCausalLM, param_mappings, ignored_keys=IGNORED_HF_KEYS,
                tiny=TINY)
