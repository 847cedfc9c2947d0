"""GPT-2 as a Flax module, following transformers' ``modeling_gpt2.py``.

Layout notes:
- Projections are ``Conv1D``, whose weight is stored [in, out] (x @ W + b), like a flax Dense kernel: NO transpose.
  Only an untied ``lm_head`` (a torch Linear) is transposed.
- ``c_attn`` is fused as three contiguous D-wide blocks q | k | v (unlike GPT-NeoX's per-head interleave).
- Learned absolute position embeddings ``wpe``; no rotary. Pre-LayerNorm blocks, final ``ln_f``.
- Score scale: 1/sqrt(E) if ``scale_attn_weights``, further divided by (layer + 1) if
  ``scale_attn_by_inverse_layer_idx``.
- The LM head is tied to ``wte`` by default.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from .common import (ConfigError, DecoderLayer, DecoderLM, KVCache, LayerNorm, ParamMapping, activation, attend,
                     decoder_maps, norm_maps)
from .family import HFConfig, hf_field, register_family


@dataclasses.dataclass(frozen=True)
class GPT2Config(HFConfig):
    """GPT-2's own field names; the generic ones (transformers' ``attribute_map``) are read as aliases and answer as
    attributes (``cfg.hidden_size`` is ``n_embd``)."""

    MODEL_TYPE, ARCHITECTURE = "gpt2", "GPT2LMHeadModel"
    REFUSED = {"add_cross_attention": bool}

    vocab_size: int = hf_field()
    n_embd: int = hf_field(768, aliases=("hidden_size",))
    n_layer: int = hf_field(12, aliases=("num_hidden_layers",))
    n_head: int = hf_field(12, aliases=("num_attention_heads",))
    n_positions: int = hf_field(1024, aliases=("max_position_embeddings",))
    n_inner: Optional[int] = hf_field(None)
    activation_function: str = hf_field("gelu_new")
    layer_norm_epsilon: float = hf_field(1e-5)
    scale_attn_weights: bool = hf_field(True)
    scale_attn_by_inverse_layer_idx: bool = hf_field(False)
    tie_word_embeddings: bool = hf_field(True)
    bos_token_id: Optional[int] = hf_field(50256)
    eos_token_id: Any = hf_field(50256)

    @property
    def intermediate_size(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def derive(cls, hf: dict, values: dict) -> dict:
        if values["n_embd"] % values["n_head"]:
            raise ConfigError(f"gpt2: n_embd={values['n_embd']} must be divisible by n_head={values['n_head']}")
        activation(values["activation_function"])
        return values

    def hf_extra(self) -> dict:
        return {"add_cross_attention": False}


def base_scale(cfg: GPT2Config) -> float:
    """Score scale before any per-layer division: 1/sqrt(E) if ``scale_attn_weights``, else 1."""
    return cfg.head_dim ** -0.5 if cfg.scale_attn_weights else 1.0


def inverse_layer_scales(cfg: GPT2Config) -> np.ndarray:
    """[L] float32 scales ``base_scale / (layer + 1)`` (``scale_attn_by_inverse_layer_idx``): divided in float64
    and rounded once, as the python-float division in transformers."""
    return (base_scale(cfg) / np.arange(1, cfg.n_layer + 1, dtype=np.float64)).astype(np.float32)


class GPT2Block(DecoderLayer):
    """Pre-norm block: x + c_proj(attention(ln_1(x))), then ``mlp`` (GPT-Neo's block shares it)."""

    def norm(self, name: str):
        return self.layer_norm(self.config.layer_norm_epsilon, name)

    def mlp(self, x_btd, width: int):
        """x + c_proj(act(c_fc(ln_2(x)))) for x [B, T, D], ``width`` the MLP's inner width."""
        y = activation(self.config.activation_function)(self.dense(width, "mlp_c_fc")(self.norm("ln_2")(x_btd)))
        return x_btd + self.dense(x_btd.shape[-1], "mlp_c_proj")(y)

    @nn.compact
    def __call__(self, x_btd, pos_bt, valid_bt, layer, cache: Optional[KVCache]):
        cfg, (b, t, d) = self.config, x_btd.shape
        qkv = self.dense(3 * d, "attn_c_attn")(self.norm("ln_1")(x_btd))
        q, k, v = (a.reshape(b, t, cfg.n_head, cfg.head_dim) for a in jnp.split(qkv, 3, axis=-1))
        scale = base_scale(cfg)
        if cfg.scale_attn_by_inverse_layer_idx:  # per layer: a lookup by the (traced) layer index
            scale = jnp.asarray(inverse_layer_scales(cfg))[layer]
        attn = attend(q, k, v, pos_bt, valid_bt, cache, scale=scale)
        x_btd = x_btd + self.dense(d, "attn_c_proj")(attn.reshape(b, t, d))
        return self.mlp(x_btd, cfg.intermediate_size), (k, v)


class GPT2LMHeadModel(DecoderLM):
    """GPT-2 causal LM; ``setup``, ``hidden``, ``unembed`` and ``__call__`` come from ``common.DecoderLM``."""

    EMBED, LAYERS, NORM, POSITION_EMBED, ROTARY_DIM = "wte", "h", "ln_f", "wpe", None
    LAYER = GPT2Block
    FINAL_NORM, NORM_EPS, HF_PREFIX = LayerNorm, "layer_norm_epsilon", "transformer"



def _conv1d_maps(hf_prefix: str, path: tuple) -> list[ParamMapping]:
    """Conv1D weight is already [in, out]: no transpose."""
    return [
        ParamMapping(f"{hf_prefix}.weight", path + ("kernel",)),
        ParamMapping(f"{hf_prefix}.bias", path + ("bias",)),
    ]


def param_mappings(cfg: GPT2Config) -> list[ParamMapping]:
    def layer(hf: str, p: tuple):
        conv = lambda name: _conv1d_maps(f"{hf}.{name}", p + (name.replace(".", "_"),))
        return (norm_maps(f"{hf}.ln_1", p + ("ln_1",)) + conv("attn.c_attn") + conv("attn.c_proj")
                + norm_maps(f"{hf}.ln_2", p + ("ln_2",)) + conv("mlp.c_fc") + conv("mlp.c_proj"))
    return decoder_maps(GPT2LMHeadModel, cfg, layer, norm=("weight", "bias"))


# The causal-mask buffers that old checkpoints (e.g. the original ``gpt2``) carry.
IGNORED_HF_KEYS = (r"\.attn\.bias$", r"\.attn\.masked_bias$")

# summary_*: the sequence-classification head, which mia never builds; reorder_and_upcast_attn: computes the
# attention scores in float32, as mia's attention always does
HARMLESS_HF_FIELDS = ("summary_activation", "summary_first_dropout", "summary_proj_to_labels", "summary_type",
                      "summary_use_proj", "reorder_and_upcast_attn")

# the doctor's tiny model (``family.tiny_config``): learned positions, tied head, per-layer attention scale
TINY = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=512,
            scale_attn_by_inverse_layer_idx=True)

register_family(GPT2Config.MODEL_TYPE, GPT2Config, GPT2LMHeadModel, param_mappings, ignored_keys=IGNORED_HF_KEYS,
                harmless=HARMLESS_HF_FIELDS, tiny=TINY)
