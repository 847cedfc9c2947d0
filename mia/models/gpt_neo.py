"""GPT-Neo as a Flax module, following transformers' ``modeling_gpt_neo.py``.

Layout notes:
- Layers alternate global and local attention as given by ``attention_types`` ([[["global", "local"], n], ...],
  expanded per layer exactly as transformers does). A local layer sees keys with q_pos - k_pos < ``window_size``.
- NO score scaling: scores are q . k, not q . k / sqrt(E) (scale=1.0).
- Separate ``q_proj``/``k_proj``/``v_proj`` without bias; ``out_proj`` with bias (torch Linear: transposed).
- Learned absolute position embeddings ``wpe``; pre-LayerNorm blocks; LM head tied to ``wte`` by default.
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
    dot_product_attention,
    join_cache,
    linear_maps,
    norm_maps,
)
from .family import register_family

MODEL_TYPE = "gpt_neo"


def expand_attention_types(attention_types) -> tuple[str, ...]:
    """[[["global", "local"], 2]] -> ("global", "local", "global", "local"), as GPTNeoConfig does."""
    try:
        return tuple(kind for kinds, n in attention_types for _ in range(n) for kind in kinds)
    except (TypeError, ValueError):
        raise ConfigError(f"{MODEL_TYPE}: config field attention_types={attention_types!r} is malformed") from None


@dataclasses.dataclass(frozen=True)
class GPTNeoConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    attention_layers: tuple
    window_size: int = 256
    intermediate_size: Optional[int] = None
    max_position_embeddings: int = 2048
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True
    bos_token_id: Optional[int] = 50256
    eos_token_id: Any = 50256

    @property
    def num_hidden_layers(self) -> int:
        return self.num_layers

    @property
    def num_attention_heads(self) -> int:
        return self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def inner_dim(self) -> int:
        return self.intermediate_size if self.intermediate_size is not None else 4 * self.hidden_size

    @classmethod
    def from_hf(cls, hf: dict) -> "GPTNeoConfig":
        d = hf.get("hidden_size", 2048)
        h = hf.get("num_heads", hf.get("num_attention_heads", 16))
        n = hf.get("num_layers", hf.get("num_hidden_layers", 24))
        if d % h:
            raise ConfigError(f"{MODEL_TYPE}: hidden_size={d} must be divisible by num_heads={h}")
        # transformers rebuilds attention_layers from attention_types and ignores a stored attention_layers
        types = hf.get("attention_types") or [[["global", "local"], 12]]
        layers = expand_attention_types(types)
        if len(layers) != n or not set(layers) <= {"global", "local"}:
            raise ConfigError(f"{MODEL_TYPE}: config field attention_types={types!r} must expand to {n} entries, "
                              f"each 'global' or 'local' (got {list(layers)})")
        act = hf.get("activation_function", "gelu_new")
        activation(act)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=d,
            num_layers=n,
            num_heads=h,
            attention_layers=layers,
            window_size=hf.get("window_size", 256),
            intermediate_size=hf.get("intermediate_size"),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            activation_function=act,
            layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=hf.get("tie_word_embeddings", True),
            bos_token_id=hf.get("bos_token_id", 50256),
            eos_token_id=hf.get("eos_token_id", 50256),
        )

    def to_hf(self) -> dict:
        return {
            "model_type": MODEL_TYPE,
            "architectures": ["GPTNeoForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "attention_types": [[[kind], 1] for kind in self.attention_layers],
            "attention_layers": list(self.attention_layers),
            "window_size": self.window_size,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "activation_function": self.activation_function,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }


GLOBAL_WINDOW = np.iinfo(np.int32).max  # q_pos - k_pos < this always holds: a global layer in the window table


def attention_window(cfg: GPTNeoConfig, layer):
    """The local-attention window of layer ``layer`` (a traced int32 index): None when every layer is global, the
    static ``window_size`` when every layer is local, else a lookup in the per-layer int32 table (global layers
    get ``GLOBAL_WINDOW``), so mixed stacks need no Python branch on the layer."""
    kinds = set(cfg.attention_layers)
    if kinds == {"global"}:
        return None
    if kinds == {"local"}:
        return cfg.window_size
    table = np.array([cfg.window_size if kind == "local" else GLOBAL_WINDOW for kind in cfg.attention_layers], np.int32)
    return jnp.asarray(table)[layer]


class GPTNeoBlock(nn.Module):
    config: GPTNeoConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_btd, pos_bt, valid_bt, layer, cache: Optional[KVCache]):
        cfg = self.config
        b, t, d = x_btd.shape
        h, e = cfg.num_heads, cfg.head_dim
        dense = lambda n, name, bias: nn.Dense(
            n, use_bias=bias, dtype=self.dtype, param_dtype=self.param_dtype, name=name
        )
        norm = lambda name: LayerNorm(cfg.layer_norm_epsilon, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

        y = norm("ln_1")(x_btd)
        q, k, v = (dense(d, f"attn_{n}_proj", False)(y).reshape(b, t, h, e) for n in "qkv")
        window = attention_window(cfg, layer)
        k_all, v_all, kpos, kvalid = join_cache(cache, k, v, pos_bt, valid_bt)
        attn = dot_product_attention(q, k_all, v_all, pos_bt, kpos, kvalid, scale=1.0, window=window)
        x_btd = x_btd + dense(d, "attn_out_proj", True)(attn.reshape(b, t, d))

        y = activation(cfg.activation_function)(dense(cfg.inner_dim, "mlp_c_fc", True)(norm("ln_2")(x_btd)))
        return x_btd + dense(d, "mlp_c_proj", True)(y), (k, v)


class GPTNeoForCausalLM(DecoderLM):
    """GPT-Neo causal LM; ``hidden``, ``unembed`` and ``__call__`` come from ``common.DecoderLM``."""

    EMBED, LAYERS, NORM, POSITION_EMBED, ROTARY_DIM = "wte", "h", "ln_f", "wpe", None
    LAYER = GPTNeoBlock

    def setup(self):
        cfg = self.config
        self.wte = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype)
        self.wpe = nn.Embed(
            cfg.max_position_embeddings, cfg.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype
        )
        self.h = self.layer_stack()
        self.ln_f = LayerNorm(cfg.layer_norm_epsilon, dtype=self.dtype, param_dtype=self.param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)


def param_mappings(cfg: GPTNeoConfig) -> list[ParamMapping]:
    m = [ParamMapping("transformer.wte.weight", ("wte", "embedding")),
         ParamMapping("transformer.wpe.weight", ("wpe", "embedding"))]
    for i in range(cfg.num_layers):
        hf, p = f"transformer.h.{i}", ("h",)
        layer: list[ParamMapping] = []
        layer += norm_maps(f"{hf}.ln_1", p + ("ln_1",))
        for n in "qkv":
            layer += linear_maps(f"{hf}.attn.attention.{n}_proj", p + (f"attn_{n}_proj",), bias=False)
        layer += linear_maps(f"{hf}.attn.attention.out_proj", p + ("attn_out_proj",), bias=True)
        layer += norm_maps(f"{hf}.ln_2", p + ("ln_2",))
        layer += linear_maps(f"{hf}.mlp.c_fc", p + ("mlp_c_fc",), bias=True)
        layer += linear_maps(f"{hf}.mlp.c_proj", p + ("mlp_c_proj",), bias=True)
        m += at_layer(i, layer)
    m += norm_maps("transformer.ln_f", ("ln_f",))
    if not cfg.tie_word_embeddings:
        m.append(ParamMapping("lm_head.weight", ("lm_head", "kernel"), transpose=True))
    return m


# The (local) causal-mask buffers that older checkpoints carry.
IGNORED_HF_KEYS = (r"\.attention\.bias$", r"\.attention\.masked_bias$")

# attention_layers: attention_types expanded per layer (transformers recomputes it from attention_types)
HARMLESS_HF_FIELDS = ("attention_layers",)

# the doctor's tiny model (``family.tiny_config``): a global and a local layer, the window shorter than its rows
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, window_size=64,
            attention_types=[[["global", "local"], 1]], max_position_embeddings=512)

register_family(MODEL_TYPE, GPTNeoConfig, GPTNeoForCausalLM, param_mappings, ignored_keys=IGNORED_HF_KEYS,
                harmless=HARMLESS_HF_FIELDS, tiny=TINY)
