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

from .common import (
    DecoderLM,
    ConfigError,
    KVCache,
    LayerNorm,
    ParamMapping,
    at_layer,
    activation,
    refuse_values,
    dot_product_attention,
    join_cache,
    norm_maps,
)
from .family import register_family

MODEL_TYPE = "gpt2"

REFUSED = {"add_cross_attention": bool}


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_positions: int = 1024
    n_inner: Optional[int] = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: Optional[int] = 50256
    eos_token_id: Any = 50256

    # Names shared with the other families.
    @property
    def hidden_size(self) -> int:
        return self.n_embd

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layer

    @property
    def num_attention_heads(self) -> int:
        return self.n_head

    @property
    def max_position_embeddings(self) -> int:
        return self.n_positions

    @property
    def intermediate_size(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_hf(cls, hf: dict) -> "GPT2Config":
        refuse_values(MODEL_TYPE, hf, REFUSED)
        # transformers' attribute_map lets a config.json use the generic names too
        get = lambda name, alias, default: hf.get(name, hf.get(alias, default))
        d, h = get("n_embd", "hidden_size", 768), get("n_head", "num_attention_heads", 12)
        if d % h:
            raise ConfigError(f"{MODEL_TYPE}: n_embd={d} must be divisible by n_head={h}")
        act = hf.get("activation_function", "gelu_new")
        activation(act)
        return cls(
            vocab_size=hf["vocab_size"],
            n_embd=d,
            n_layer=get("n_layer", "num_hidden_layers", 12),
            n_head=h,
            n_positions=get("n_positions", "max_position_embeddings", 1024),
            n_inner=hf.get("n_inner"),
            activation_function=act,
            layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            scale_attn_weights=hf.get("scale_attn_weights", True),
            scale_attn_by_inverse_layer_idx=hf.get("scale_attn_by_inverse_layer_idx", False),
            tie_word_embeddings=hf.get("tie_word_embeddings", True),
            bos_token_id=hf.get("bos_token_id", 50256),
            eos_token_id=hf.get("eos_token_id", 50256),
        )

    def to_hf(self) -> dict:
        return {
            "model_type": MODEL_TYPE,
            "architectures": ["GPT2LMHeadModel"],
            "vocab_size": self.vocab_size,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_positions": self.n_positions,
            "n_inner": self.n_inner,
            "activation_function": self.activation_function,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "scale_attn_weights": self.scale_attn_weights,
            "scale_attn_by_inverse_layer_idx": self.scale_attn_by_inverse_layer_idx,
            "add_cross_attention": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }


def base_scale(cfg: GPT2Config) -> float:
    """Score scale before any per-layer division: 1/sqrt(E) if ``scale_attn_weights``, else 1."""
    return cfg.head_dim ** -0.5 if cfg.scale_attn_weights else 1.0


def inverse_layer_scales(cfg: GPT2Config) -> np.ndarray:
    """[L] float32 scales ``base_scale / (layer + 1)`` (``scale_attn_by_inverse_layer_idx``): divided in float64
    and rounded once, as the python-float division in transformers."""
    return (base_scale(cfg) / np.arange(1, cfg.n_layer + 1, dtype=np.float64)).astype(np.float32)


class GPT2Block(nn.Module):
    config: GPT2Config
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd, pos_bt, valid_bt, layer, cache: Optional[KVCache]):
        cfg = self.config
        b, t, d = x_btd.shape
        h, e = cfg.n_head, cfg.head_dim
        dense = lambda n, name: nn.Dense(n, dtype=self.dtype, param_dtype=self.param_dtype, name=name)
        norm = lambda name: LayerNorm(cfg.layer_norm_epsilon, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

        qkv = dense(3 * d, "attn_c_attn")(norm("ln_1")(x_btd))
        q, k, v = (a.reshape(b, t, h, e) for a in jnp.split(qkv, 3, axis=-1))
        scale = base_scale(cfg)
        if cfg.scale_attn_by_inverse_layer_idx:  # per layer: a lookup by the (traced) layer index
            scale = jnp.asarray(inverse_layer_scales(cfg))[layer]
        k_all, v_all, kpos, kvalid = join_cache(cache, k, v, pos_bt, valid_bt)
        attn = dot_product_attention(q, k_all, v_all, pos_bt, kpos, kvalid, scale=scale)
        x_btd = x_btd + dense(d, "attn_c_proj")(attn.reshape(b, t, d))

        y = activation(cfg.activation_function)(dense(cfg.intermediate_size, "mlp_c_fc")(norm("ln_2")(x_btd)))
        return x_btd + dense(d, "mlp_c_proj")(y), (k, v)


class GPT2LMHeadModel(DecoderLM):
    """GPT-2 causal LM; ``hidden``, ``unembed`` and ``__call__`` come from ``common.DecoderLM``."""

    EMBED, LAYERS, NORM, POSITION_EMBED, ROTARY_DIM = "wte", "h", "ln_f", "wpe", None
    LAYER = GPT2Block

    def setup(self):
        cfg = self.config
        self.wte = nn.Embed(cfg.vocab_size, cfg.n_embd, dtype=self.dtype, param_dtype=self.param_dtype)
        self.wpe = nn.Embed(cfg.n_positions, cfg.n_embd, dtype=self.dtype, param_dtype=self.param_dtype)
        self.h = self.layer_stack()
        self.ln_f = LayerNorm(cfg.layer_norm_epsilon, dtype=self.dtype, param_dtype=self.param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)


def _conv1d_maps(hf_prefix: str, path: tuple) -> list[ParamMapping]:
    """Conv1D weight is already [in, out]: no transpose."""
    return [
        ParamMapping(f"{hf_prefix}.weight", path + ("kernel",)),
        ParamMapping(f"{hf_prefix}.bias", path + ("bias",)),
    ]


def param_mappings(cfg: GPT2Config) -> list[ParamMapping]:
    m = [ParamMapping("transformer.wte.weight", ("wte", "embedding")),
         ParamMapping("transformer.wpe.weight", ("wpe", "embedding"))]
    for i in range(cfg.n_layer):
        hf, p = f"transformer.h.{i}", ("h",)
        layer: list[ParamMapping] = []
        layer += norm_maps(f"{hf}.ln_1", p + ("ln_1",))
        layer += _conv1d_maps(f"{hf}.attn.c_attn", p + ("attn_c_attn",))
        layer += _conv1d_maps(f"{hf}.attn.c_proj", p + ("attn_c_proj",))
        layer += norm_maps(f"{hf}.ln_2", p + ("ln_2",))
        layer += _conv1d_maps(f"{hf}.mlp.c_fc", p + ("mlp_c_fc",))
        layer += _conv1d_maps(f"{hf}.mlp.c_proj", p + ("mlp_c_proj",))
        m += at_layer(i, layer)
    m += norm_maps("transformer.ln_f", ("ln_f",))
    if not cfg.tie_word_embeddings:
        m.append(ParamMapping("lm_head.weight", ("lm_head", "kernel"), transpose=True))
    return m


# The causal-mask buffers that old checkpoints (e.g. the original ``gpt2``) carry.
IGNORED_HF_KEYS = (r"\.attn\.bias$", r"\.attn\.masked_bias$")

# summary_*: the sequence-classification head, which mia never builds; reorder_and_upcast_attn: computes the
# attention scores in float32, as mia's attention always does
HARMLESS_HF_FIELDS = ("summary_activation", "summary_first_dropout", "summary_proj_to_labels", "summary_type",
                      "summary_use_proj", "reorder_and_upcast_attn")

# the doctor's tiny model (``family.tiny_config``): learned positions, tied head, per-layer attention scale
TINY = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=512,
            scale_attn_by_inverse_layer_idx=True)

register_family(MODEL_TYPE, GPT2Config, GPT2LMHeadModel, param_mappings, ignored_keys=IGNORED_HF_KEYS,
                harmless=HARMLESS_HF_FIELDS, tiny=TINY)
