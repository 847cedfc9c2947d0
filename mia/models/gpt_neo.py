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

from .common import (ConfigError, KVCache, ParamMapping, activation, attend,
                     decoder_maps, layer_window, linear_maps, norm_maps)
from .family import HFConfig, hf_field, register_family
from .gpt2 import GPT2Block, GPT2LMHeadModel

DEFAULT_ATTENTION_TYPES = [[["global", "local"], 12]]  # GPTNeoConfig's default: 24 layers alternating


def expand_attention_types(attention_types) -> tuple[str, ...]:
    """[[["global", "local"], 2]] -> ("global", "local", "global", "local"), as GPTNeoConfig does."""
    try:
        return tuple(kind for kinds, n in attention_types for _ in range(n) for kind in kinds)
    except (TypeError, ValueError):
        raise ConfigError(f"gpt_neo: config field attention_types={attention_types!r} is malformed") from None


@dataclasses.dataclass(frozen=True)
class GPTNeoConfig(HFConfig):
    """``attention_layers``: the kind of each layer, "global" or "local", expanded from config.json's
    ``attention_types`` (transformers rebuilds it from there and ignores a stored ``attention_layers``)."""

    MODEL_TYPE, ARCHITECTURE = "gpt_neo", "GPTNeoForCausalLM"

    vocab_size: int = hf_field()
    hidden_size: int = hf_field(2048)
    num_layers: int = hf_field(24, aliases=("num_hidden_layers",))
    num_heads: int = hf_field(16, aliases=("num_attention_heads",))
    attention_layers: tuple = hf_field(expand_attention_types(DEFAULT_ATTENTION_TYPES), derived=True)
    window_size: int = hf_field(256)
    intermediate_size: Optional[int] = hf_field(None)
    max_position_embeddings: int = hf_field(2048)
    activation_function: str = hf_field("gelu_new")
    layer_norm_epsilon: float = hf_field(1e-5)
    tie_word_embeddings: bool = hf_field(True)
    bos_token_id: Optional[int] = hf_field(50256)
    eos_token_id: Any = hf_field(50256)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def inner_dim(self) -> int:
        return self.intermediate_size if self.intermediate_size is not None else 4 * self.hidden_size

    @classmethod
    def derive(cls, hf: dict, values: dict) -> dict:
        d, h, n = values["hidden_size"], values["num_heads"], values["num_layers"]
        if d % h:
            raise ConfigError(f"gpt_neo: hidden_size={d} must be divisible by num_heads={h}")
        types = hf.get("attention_types") or DEFAULT_ATTENTION_TYPES
        layers = expand_attention_types(types)
        if len(layers) != n or not set(layers) <= {"global", "local"}:
            raise ConfigError(f"gpt_neo: config field attention_types={types!r} must expand to {n} entries, "
                              f"each 'global' or 'local' (got {list(layers)})")
        activation(values["activation_function"])
        return {**values, "attention_layers": layers}

    def hf_extra(self) -> dict:
        return {"attention_types": [[[kind], 1] for kind in self.attention_layers],
                "attention_layers": list(self.attention_layers)}


def attention_window(cfg: GPTNeoConfig, layer):
    """The local-attention window of layer ``layer`` (a traced int32 index; ``common.layer_window``): ``window_size``
    on the local layers, none on the global ones."""
    return layer_window([cfg.window_size if kind == "local" else None for kind in cfg.attention_layers], layer)


class GPTNeoBlock(GPT2Block):
    """GPT-Neo's block: separate unbiased q/k/v, no 1/sqrt(E) scaling, a local window on the local layers; GPT-2's
    norms and MLP (``GPT2Block.mlp``)."""

    @nn.compact
    def __call__(self, x_btd, pos_bt, valid_bt, layer, cache: Optional[KVCache]):
        cfg, (b, t, d) = self.config, x_btd.shape
        y = self.norm("ln_1")(x_btd)
        q, k, v = (self.dense(d, f"attn_{n}_proj", False)(y).reshape(b, t, cfg.num_heads, cfg.head_dim) for n in "qkv")
        attn = attend(q, k, v, pos_bt, valid_bt, cache, scale=1.0, window=attention_window(cfg, layer))
        x_btd = x_btd + self.dense(d, "attn_out_proj")(attn.reshape(b, t, d))
        return self.mlp(x_btd, cfg.inner_dim), (k, v)


class GPTNeoForCausalLM(GPT2LMHeadModel):
    """GPT-Neo causal LM: GPT-2's (the same tensor names: ``wte``, ``wpe``, ``h``, ``ln_f`` under ``transformer``)
    with GPT-Neo's block; ``setup``, ``hidden``, ``unembed`` and ``__call__`` come from ``common.DecoderLM``."""

    LAYER = GPTNeoBlock



def param_mappings(cfg: GPTNeoConfig) -> list[ParamMapping]:
    def layer(hf: str, p: tuple):
        m = norm_maps(f"{hf}.ln_1", p + ("ln_1",))
        for n in "qkv":
            m += linear_maps(f"{hf}.attn.attention.{n}_proj", p + (f"attn_{n}_proj",), bias=False)
        m += linear_maps(f"{hf}.attn.attention.out_proj", p + ("attn_out_proj",), bias=True)
        m += norm_maps(f"{hf}.ln_2", p + ("ln_2",))
        return m + linear_maps(f"{hf}.mlp.c_fc", p + ("mlp_c_fc",), True) + linear_maps(f"{hf}.mlp.c_proj",
                                                                                        p + ("mlp_c_proj",), True)
    return decoder_maps(GPTNeoForCausalLM, cfg, layer, norm=("weight", "bias"))


# The (local) causal-mask buffers that older checkpoints carry.
IGNORED_HF_KEYS = (r"\.attention\.bias$", r"\.attention\.masked_bias$")

# attention_layers: attention_types expanded per layer (transformers recomputes it from attention_types)
HARMLESS_HF_FIELDS = ("attention_layers",)

# the doctor's tiny model (``family.tiny_config``): a global and a local layer, the window shorter than its rows
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, window_size=64,
            attention_types=[[["global", "local"], 1]], max_position_embeddings=512)

register_family(GPTNeoConfig.MODEL_TYPE, GPTNeoConfig, GPTNeoForCausalLM, param_mappings, ignored_keys=IGNORED_HF_KEYS,
                harmless=HARMLESS_HF_FIELDS, tiny=TINY)
