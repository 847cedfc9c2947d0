"""Qwen2 / Qwen2.5 (``model_type: qwen2``) as a Flax module, following transformers' ``modeling_qwen2.py``.

Layout notes (Llama's block, ``llama.LlamaLayer``, with these differences):
- q/k/v projections ALWAYS have biases and o_proj never has one; the MLP has none (transformers' Qwen2 reads neither
  ``attention_bias`` nor ``mlp_bias``: an ``attention_bias`` other than true is refused, ``mlp_bias`` is unknown).
- Sliding-window attention per layer: with ``use_sliding_window`` the layers listed "sliding_attention" in
  ``layer_types`` (default: those with index >= ``max_window_layers``) attend to keys with q_pos - k_pos <
  ``sliding_window``; without it (every published Qwen2.5 checkpoint) ``sliding_window`` is ignored and every layer
  is global, as in transformers.
- ``num_key_value_heads`` defaults to 32 and ``head_dim`` to hidden_size // num_attention_heads (Qwen2Config).
- RoPE scaling: ``linear`` and ``llama3`` as for Llama (``rope.inv_freq``); YaRN (Qwen2.5's long-context recipe)
  and the others are refused naming the field.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .common import ConfigError, DecoderLM, RMSNorm, decoder_maps, layer_window
from .family import hf_field, register_family
from .gqa import GQA_REFUSED, HARMLESS_HF_FIELDS, IGNORED_HF_KEYS, GQAConfig
from .llama import LlamaLayer, layer_maps
from .rope import SCALED_TYPES

LAYER_TYPES = ("full_attention", "sliding_attention")

# Qwen reads its own sliding-window fields; multimodal RoPE (Qwen2-VL's) is not a Qwen2 model
QWEN_REFUSED = {**{k: v for k, v in GQA_REFUSED.items() if k not in ("sliding_window", "use_sliding_window")},
                "use_mrope": bool}


@dataclasses.dataclass(frozen=True)
class Qwen2Config(GQAConfig):
    """``layer_types``: the kind of each layer, "full_attention" or "sliding_attention" (config.json's, else
    derived from ``use_sliding_window``, ``sliding_window`` and ``max_window_layers`` as Qwen2Config does);
    ``layer_windows``: the window each layer attends within (None: global)."""

    MODEL_TYPE, ARCHITECTURE = "qwen2", "Qwen2ForCausalLM"
    ROPE_TYPES = SCALED_TYPES
    REFUSED = {**QWEN_REFUSED, "attention_bias": lambda v: v is not True}

    num_key_value_heads: Optional[int] = hf_field(32)
    max_position_embeddings: int = hf_field(32768)
    attention_bias: bool = hf_field(True)
    rms_norm_eps: float = hf_field(1e-6)
    use_sliding_window: bool = hf_field(False)
    sliding_window: Optional[int] = hf_field(4096)
    max_window_layers: int = hf_field(28)
    layer_types: tuple = hf_field(None, derived=True)
    bos_token_id: Optional[int] = hf_field(None)
    eos_token_id: Any = hf_field(None)

    @property
    def layer_windows(self) -> tuple:
        window = self.sliding_window if self.use_sliding_window else None
        return tuple(window if kind == "sliding_attention" else None for kind in self.layer_types)

    @classmethod
    def derive(cls, hf: dict, values: dict) -> dict:
        values = super().derive(hf, values)
        n, window = values["num_hidden_layers"], values["sliding_window"] if values["use_sliding_window"] else None
        given = hf.get("layer_types")
        kinds = tuple(given) if given is not None else tuple(
            "sliding_attention" if window is not None and i >= values["max_window_layers"] else "full_attention"
            for i in range(n))
        if len(kinds) != n or not set(kinds) <= set(LAYER_TYPES):
            raise ConfigError(f"{cls.MODEL_TYPE}: config field layer_types={given!r} must list {n} entries, each "
                              f"one of {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in kinds and window is None:
            raise ConfigError(f"{cls.MODEL_TYPE}: config field layer_types names sliding_attention layers but "
                              f"use_sliding_window={values['use_sliding_window']!r}, "
                              f"sliding_window={values['sliding_window']!r} give them no window")
        return {**values, "layer_types": kinds}

    def hf_extra(self) -> dict:
        return {**super().hf_extra(), "layer_types": list(self.layer_types)}


class Qwen2Layer(LlamaLayer):
    """Llama's block with q/k/v biases (no o_proj bias) and the layer's sliding window."""

    def attention_biases(self) -> tuple[bool, bool]:
        return True, False

    def window(self, layer):
        return layer_window(self.config.layer_windows, layer)


class Qwen2ForCausalLM(DecoderLM):
    """Qwen2 causal LM; ``setup``, ``hidden``, ``unembed`` and ``__call__`` come from ``common.DecoderLM``."""

    LAYER, FINAL_NORM, NORM_EPS = Qwen2Layer, RMSNorm, "rms_norm_eps"


def param_mappings(cfg: Qwen2Config):
    return decoder_maps(Qwen2ForCausalLM, cfg, lambda hf, p: layer_maps(hf, p, True, False, False))


# the doctor's tiny model (``family.tiny_config``): q/k/v biases, grouped-query attention, a sliding layer (window 8)
# after a global one, tied head
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, use_sliding_window=True, sliding_window=8,
            max_window_layers=1, tie_word_embeddings=True)

register_family(Qwen2Config.MODEL_TYPE, Qwen2Config, Qwen2ForCausalLM, param_mappings, ignored_keys=IGNORED_HF_KEYS,
                harmless=HARMLESS_HF_FIELDS, tiny=TINY)
