"""What the Llama-shaped families share (Llama, OLMo, OLMo-2, and the ones built like them): grouped-query heads,
SwiGLU, float32 rotary, their config fields and their HF parameter names. Each family module keeps its own layer.

Conventions (``common``'s dimension legend): q has H heads, k/v have K (H = K * G), each E = ``head_dim`` wide;
config.json may omit ``num_key_value_heads`` (then K = H) and ``head_dim`` (then E = hidden_size // H).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import flax.linen as nn
import jax.numpy as jnp

from .common import ConfigError, ParamMapping, activation, apply_rotary, linear_maps
from .family import PartialRotary, TransformerConfig, hf_field
from .rope import UNSCALED, RopeScaling, read_rope

# Config fields that would change the math and that these families do not implement (value -> refuse?).
GQA_REFUSED = {
    "sliding_window": lambda v: v is not None,
    "use_sliding_window": bool,
    "attention_logit_softcapping": lambda v: v is not None,
    "final_logit_softcapping": lambda v: v is not None,
}


def gqa_heads(model_type: str, heads: int, kv_heads: Optional[int], head_dim: Optional[int],
              hidden_size: int) -> tuple[int, int]:
    """(K, E) from config.json's ``num_key_value_heads`` and ``head_dim`` (either may be None or 0: K = H,
    E = hidden_size // H); ``ConfigError`` when H is not a multiple of K."""
    kv = kv_heads or heads
    if heads % kv:
        raise ConfigError(f"{model_type}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    return kv, int(head_dim or hidden_size // heads)


@dataclasses.dataclass(frozen=True)
class GQAConfig(TransformerConfig):
    """The config fields of a Llama-shaped family (a base: each family subclasses it, adds its own fields and
    restates a default where its HF config differs). ``from_hf`` refuses ``GQA_REFUSED``, fills K and E
    (``gqa_heads``), reads the rotary base and scaling from either spelling (``rope.read_rope``: the rope_type
    values in ``ROPE_TYPES``, only "default" unless the family implements scaling) and checks the activation;
    ``to_hf`` writes the rotary base both ways (flat ``rope_theta`` and transformers>=5 ``rope_parameters``, which
    also holds the scaling)."""

    REFUSED = GQA_REFUSED
    ROPE_TYPES: ClassVar[tuple] = ("default",)

    num_key_value_heads: Optional[int] = hf_field(None)
    head_dim: Optional[int] = hf_field(None)
    rope_theta: float = hf_field(10000.0)
    max_position_embeddings: int = hf_field(2048)
    hidden_act: str = hf_field("silu")
    attention_bias: bool = hf_field(False)
    tie_word_embeddings: bool = hf_field(False)
    rope_scaling: RopeScaling = hf_field(UNSCALED, derived=True)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @classmethod
    def derive(cls, hf: dict, values: dict) -> dict:
        kv, e = gqa_heads(cls.MODEL_TYPE, values["num_attention_heads"], values["num_key_value_heads"],
                          values["head_dim"], values["hidden_size"])
        activation(values["hidden_act"])  # fail early on an unknown activation
        theta, scaling = read_rope(hf, types=cls.ROPE_TYPES, max_position_embeddings=values["max_position_embeddings"],
                                   partial=issubclass(cls, PartialRotary))  # Phi-3 reads its fraction itself
        return {**values, "num_key_value_heads": kv, "head_dim": e, "rope_theta": theta, "rope_scaling": scaling}

    def hf_extra(self) -> dict:
        return {"rope_parameters": self.rope_scaling.to_hf(self.rope_theta)}


class SwiGLU(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: [B, T, D] -> [B, T, D] through width F."""

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


def rotary_f32(x_bthe, cos, sin):
    """OLMo/OLMo-2 rotary: computed in float32 (cos/sin stay float32), then cast back to x's dtype (Llama's
    ``apply_rotary`` casts cos/sin down to x's dtype instead)."""
    return apply_rotary(x_bthe.astype(jnp.float32), cos, sin).astype(x_bthe.dtype)


def attention_maps(hf: str, p: tuple, bias: bool, o_bias: Optional[bool] = None) -> list[ParamMapping]:
    """``{hf}.self_attn.{q,k,v,o}_proj`` <-> ``self_attn_{q,k,v,o}_proj`` under ``p``; ``bias``: q/k/v have
    biases, ``o_bias`` (default: ``bias``) o_proj has one (Qwen2: q/k/v only)."""
    m = []
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        has = bias if proj != "o_proj" or o_bias is None else o_bias
        m += linear_maps(f"{hf}.self_attn.{proj}", p + (f"self_attn_{proj}",), has)
    return m


def mlp_maps(hf: str, p: tuple, bias: bool) -> list[ParamMapping]:
    """``{hf}.mlp.{gate,up,down}_proj`` <-> the ``SwiGLU`` named ``mlp`` under ``p``."""
    m = []
    for proj in ("gate_proj", "up_proj", "down_proj"):
        m += linear_maps(f"{hf}.mlp.{proj}", p + ("mlp", proj), bias)
    return m


# Old checkpoints carry the rotary buffer.
IGNORED_HF_KEYS = (r"rotary_emb\.inv_freq$",)

# pretraining_tp: a training-time split of the matmuls (the same products)
HARMLESS_HF_FIELDS = ("pretraining_tp",)
