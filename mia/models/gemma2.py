"""Gemma 2 (``model_type: gemma2``) as a Flax module, following transformers' ``modeling_gemma2.py``.

Layout notes:
- Token embeddings multiplied by sqrt(hidden_size), the factor rounded to the activation dtype (transformers casts
  it to the weights' dtype, which is the activation dtype of a model run in one dtype).
- RMSNorm scales by (1 + weight), in float32, then casts (``GemmaRMSNorm``); the weights are stored as offsets.
- Each layer: x + post_attention_layernorm(attn(input_layernorm(x))), then
  x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))). The MLP is GeGLU: Llama's gated MLP with
  ``hidden_activation`` (gelu_pytorch_tanh, the tanh approximation; config.json's ``hidden_act`` is not read by
  transformers' Gemma 2 and is inert).
- Scores scaled by ``query_pre_attn_scalar`` ** -0.5 (not head_dim), then soft-capped: ``attn_logit_softcapping``
  * tanh(s / ``attn_logit_softcapping``) before masking (every attention kernel does it, ``attention.soft_capped``).
- ``layer_types``: "sliding_attention" layers see keys with q_pos - k_pos < ``sliding_window``, "full_attention"
  layers see every earlier key; without ``layer_types`` they alternate, sliding first (transformers' default).
- Final logits soft-capped: ``final_logit_softcapping`` * tanh(logits / cap), in float32.
- Rotary as Llama's (cos/sin cast to the activation dtype); the head is tied to the embeddings by default.
Every default is transformers' ``Gemma2Config``'s, so a sparse config.json reads as transformers reads it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from .attention import soft_capped
from .common import (ConfigError, DecoderLayer, DecoderLM, apply_rotary, attend, checked_window, decoder_maps,
                     layer_window, norm_maps)
from .family import hf_field, register_family
from .gqa import GQA_REFUSED, IGNORED_HF_KEYS, GQAConfig, SwiGLU, attention_maps, mlp_maps

LAYER_TYPES = ("sliding_attention", "full_attention")

GEMMA_REFUSED = {**{k: v for k, v in GQA_REFUSED.items() if k not in ("sliding_window", "final_logit_softcapping")},
                 "use_bidirectional_attention": bool}

# hidden_act: transformers' Gemma 2/3 read hidden_activation only; cache_implementation: a generation default
GEMMA_HARMLESS = ("hidden_act", "cache_implementation", "pretraining_tp")


def positive(model_type: str, name: str, value, optional: bool = True):
    """``value`` checked to be a positive number (or None when ``optional``); ``ConfigError`` naming ``name``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{model_type}: config field {name}={value!r} must be a positive number"
                          + (" or null" if optional else ""))
    return value


def read_layer_types(model_type: str, hf: dict, n: int, default: tuple) -> tuple:
    """The kind of each of the ``n`` layers: config.json's ``layer_types`` (each one of LAYER_TYPES), else
    ``default``."""
    types = hf.get("layer_types")
    if types is None:
        return tuple(default)
    if not isinstance(types, (list, tuple)) or len(types) != n or not set(types) <= set(LAYER_TYPES):
        raise ConfigError(f"{model_type}: config field layer_types={types!r} must list {n} entries, each one of "
                          f"{', '.join(LAYER_TYPES)}")
    return tuple(types)


@dataclasses.dataclass(frozen=True)
class Gemma2Config(GQAConfig):
    """``layer_types``: the kind of each layer (``LAYER_TYPES``), from config.json or alternating (sliding first)."""

    MODEL_TYPE, ARCHITECTURE = "gemma2", "Gemma2ForCausalLM"
    REFUSED = GEMMA_REFUSED

    vocab_size: int = hf_field(256000)
    hidden_size: int = hf_field(2304)
    num_hidden_layers: int = hf_field(26)
    num_attention_heads: int = hf_field(8)
    intermediate_size: int = hf_field(9216)
    num_key_value_heads: Optional[int] = hf_field(4)
    head_dim: Optional[int] = hf_field(256)
    max_position_embeddings: int = hf_field(8192)
    hidden_act: str = hf_field("gelu_pytorch_tanh", key="hidden_activation")
    tie_word_embeddings: bool = hf_field(True)
    rms_norm_eps: float = hf_field(1e-6)
    query_pre_attn_scalar: float = hf_field(256)
    sliding_window: Optional[int] = hf_field(4096)
    layer_types: tuple = hf_field((), derived=True)
    attn_logit_softcapping: Optional[float] = hf_field(50.0)
    final_logit_softcapping: Optional[float] = hf_field(30.0)

    @classmethod
    def default_layer_types(cls, values: dict, n: int) -> tuple:
        """The layer kinds when config.json has no ``layer_types`` (``values``: the fields read)."""
        return tuple(LAYER_TYPES[i % 2] for i in range(n))

    @classmethod
    def derive(cls, hf: dict, values: dict) -> dict:
        name = cls.MODEL_TYPE
        for field in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            positive(name, field, values[field], optional=field != "query_pre_attn_scalar")
        checked_window(name, values["sliding_window"])
        legacy = hf.get("sliding_window_size")  # Gemma-2-9B's config.json also carries it; transformers reads neither
        if legacy is not None and legacy != values["sliding_window"]:  # it nor its disagreement: refuse that
            raise ConfigError(f"{name}: config fields sliding_window={values['sliding_window']!r} and "
                              f"sliding_window_size={legacy!r} disagree")
        n = values["num_hidden_layers"]
        types = read_layer_types(name, hf, n, cls.default_layer_types(values, n))
        return {**super().derive(hf, values), "layer_types": types}

    @property
    def layer_windows(self) -> tuple:
        """Per layer: ``sliding_window`` on the sliding layers, None (global) on the full ones."""
        return tuple(self.sliding_window if kind == "sliding_attention" else None for kind in self.layer_types)

    def hf_extra(self) -> dict:
        return {**super().hf_extra(), "layer_types": list(self.layer_types)}


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: normalise in float32, scale by (1 + weight) in float32, cast to the activation dtype."""

    eps: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("weight", nn.initializers.zeros, (x.shape[-1],), self.param_dtype)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + self.eps)
        return (y * (1.0 + w.astype(jnp.float32))).astype(self.dtype)


class Gemma2Layer(DecoderLayer):
    """One Gemma 2 layer; Gemma 3's adds q/k norms (``qk_norms``) and a rotary base per layer kind
    (``layer_rotary``). Called as ``layer(x, *rotary tables, positions, valid, layer index, cache view)``."""

    @nn.compact
    def __call__(self, x_btd, *args):
        *rotary, pos_bt, valid_bt, layer, cache = args
        cfg = self.config
        dense = lambda n, name: self.dense(n, name, cfg.attention_bias)
        norm = self.gemma_norm
        b, t, _ = x_btd.shape
        h, kv, e = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

        y = norm("input_layernorm")(x_btd)
        q = dense(h * e, "self_attn_q_proj")(y).reshape(b, t, h, e)
        k = dense(kv * e, "self_attn_k_proj")(y).reshape(b, t, kv, e)
        v = dense(kv * e, "self_attn_v_proj")(y).reshape(b, t, kv, e)
        q, k = self.qk_norms(q, k)
        cos, sin = self.layer_rotary(layer, *rotary)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = attend(q, k, v, pos_bt, valid_bt, cache, scale=float(cfg.query_pre_attn_scalar) ** -0.5,
                      window=layer_window(cfg.layer_windows, layer), softcap=self.attention_softcap())
        x_btd = x_btd + norm("post_attention_layernorm")(dense(cfg.hidden_size, "self_attn_o_proj")(
            attn.reshape(b, t, h * e)))

        mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, False, self.dtype, self.param_dtype,
                     name="mlp")
        y = norm("post_feedforward_layernorm")(mlp(norm("pre_feedforward_layernorm")(x_btd)))
        return x_btd + y, (k, v)

    def gemma_norm(self, name: str) -> GemmaRMSNorm:
        return GemmaRMSNorm(self.config.rms_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

    def qk_norms(self, q_bthe, k_btke):
        """Gemma 2: none."""
        return q_bthe, k_btke

    def layer_rotary(self, layer, cos, sin):
        """Gemma 2: one rotary base for every layer."""
        return cos, sin

    def attention_softcap(self) -> Optional[float]:
        return self.config.attn_logit_softcapping


class Gemma2ForCausalLM(DecoderLM):
    """Gemma 2 causal LM: ``common.DecoderLM`` with scaled embeddings (``embed``), Gemma's final norm and soft-capped
    logits (``unembed``)."""

    LAYER = Gemma2Layer

    def final_norm(self) -> nn.Module:
        return GemmaRMSNorm(self.config.rms_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype)

    def embed(self, tokens_bt, positions_bt):
        """Token embeddings times sqrt(hidden_size), the scale rounded to the activation dtype (as HF does)."""
        scale = jnp.asarray(math.sqrt(self.config.hidden_size), self.dtype)
        return super().embed(tokens_bt, positions_bt) * scale

    def unembed(self, h_btd):
        """Float32 logits [..., V], soft-capped by ``final_logit_softcapping`` (when set)."""
        return soft_capped(super().unembed(h_btd), self.config.final_logit_softcapping)


GEMMA2_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")


def gemma_mappings(lm, cfg, attention_norms: tuple = ()):
    """The checkpoint of a Gemma ``lm`` class: each layer's four norms, projections and MLP, plus the attention's
    own norms ``attention_norms`` (Gemma 3: q_norm, k_norm) at ``{layer}.self_attn.{name}``."""
    def layer(hf: str, p: tuple):
        norms = [(f"{hf}.{name}", name) for name in GEMMA2_NORMS]
        norms += [(f"{hf}.self_attn.{name}", f"self_attn_{name}") for name in attention_norms]
        return (attention_maps(hf, p, cfg.attention_bias)
                + [m for name, leaf in norms for m in norm_maps(name, p + (leaf,), bias=False)]
                + mlp_maps(hf, p, False))
    return decoder_maps(lm, cfg, layer)


def param_mappings(cfg: Gemma2Config):
    return gemma_mappings(Gemma2ForCausalLM, cfg)


# the doctor's tiny model (``family.tiny_config``): GQA, a sliding layer then a full one, the window shorter than
# its rows, both soft caps small enough to bite
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=64,
            query_pre_attn_scalar=16, attn_logit_softcapping=2.0, final_logit_softcapping=5.0)

register_family(Gemma2Config.MODEL_TYPE, Gemma2Config, Gemma2ForCausalLM, param_mappings,
                ignored_keys=IGNORED_HF_KEYS, harmless=GEMMA_HARMLESS, tiny=TINY)
