"""Mistral (``model_type: mistral``) as a Flax module, following transformers' ``modeling_mistral.py``.

Layout notes:
- Llama's layer (``llama.LlamaLayer``: GQA, rotary, RMSNorm, SwiGLU) with a sliding window on every layer: a query
  sees the keys with q_pos - k_pos < ``sliding_window`` (transformers' ``sliding_window_overlay``); a null
  ``sliding_window`` (Mistral-7B-v0.3) attends globally. A field left out of config.json takes transformers'
  default: ``sliding_window`` 4096, 8 key/value heads.
- No biases: transformers' Mistral layers take none, so ``attention_bias``/``mlp_bias`` true are refused.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from .common import checked_window
from .family import hf_field, register_family
from .gqa import GQA_REFUSED, HARMLESS_HF_FIELDS, IGNORED_HF_KEYS
from .llama import LlamaConfig, LlamaForCausalLM, LlamaLayer
from .llama import param_mappings as llama_mappings

MISTRAL_REFUSED = {**{k: v for k, v in GQA_REFUSED.items() if k != "sliding_window"},
                   "attention_bias": bool, "mlp_bias": bool}


@dataclasses.dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    MODEL_TYPE, ARCHITECTURE = "mistral", "MistralForCausalLM"
    REFUSED = MISTRAL_REFUSED

    num_key_value_heads: Optional[int] = hf_field(8)
    max_position_embeddings: int = hf_field(4096 * 32)
    sliding_window: Optional[int] = hf_field(4096)

    @classmethod
    def derive(cls, hf: dict, values: dict) -> dict:
        checked_window(cls.MODEL_TYPE, values["sliding_window"])
        return super().derive(hf, values)


class MistralLayer(LlamaLayer):
    def window(self, layer):
        return self.config.sliding_window


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral causal LM: Llama's, with ``MistralLayer``."""

    LAYER = MistralLayer


param_mappings = llama_mappings  # the same tensors under the same names as Llama's (no biases: refused above)


# the doctor's tiny model (``family.tiny_config``): grouped-query attention and a window shorter than its rows
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, sliding_window=64)

register_family(MistralConfig.MODEL_TYPE, MistralConfig, MistralForCausalLM, param_mappings,
                ignored_keys=IGNORED_HF_KEYS, harmless=HARMLESS_HF_FIELDS, tiny=TINY)
