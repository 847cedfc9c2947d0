"""Qwen3 (``model_type: qwen3``) as a Flax module, following transformers' ``modeling_qwen3.py``.

Layout notes (Qwen2's block, ``qwen2.Qwen2Layer``, with these differences):
- ``q_norm``/``k_norm``: RMSNorm over each head's ``head_dim`` channels (weights [E], shared by the heads), applied
  after the projection's reshape to heads and before rotary (unlike OLMo-2's norms over the full projected width).
- ``attention_bias`` (default false) gives all four projections a bias, o_proj included.
- ``head_dim`` defaults to 128, not hidden_size // num_attention_heads (Qwen3Config): Qwen3-0.6B has 16 heads of 128
  on a width of 1024.
- Sliding windows (``use_sliding_window``, ``max_window_layers``, ``layer_types``) and RoPE as for Qwen2.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from .common import DecoderLM, RMSNorm, decoder_maps, norm_maps
from .family import hf_field, register_family
from .gqa import HARMLESS_HF_FIELDS, IGNORED_HF_KEYS
from .llama import layer_maps
from .qwen2 import QWEN_REFUSED, Qwen2Config, Qwen2Layer


@dataclasses.dataclass(frozen=True)
class Qwen3Config(Qwen2Config):
    MODEL_TYPE, ARCHITECTURE = "qwen3", "Qwen3ForCausalLM"
    REFUSED = QWEN_REFUSED

    head_dim: Optional[int] = hf_field(128)
    attention_bias: bool = hf_field(False)


class Qwen3Layer(Qwen2Layer):
    """Qwen2's block with per-head q/k RMSNorm and ``attention_bias`` on all four projections."""

    def attention_biases(self) -> tuple[bool, bool]:
        return self.config.attention_bias, self.config.attention_bias

    def project(self, y_btd, name: str, heads: int):
        x = super().project(y_btd, name, heads)
        return self.rms_norm(self.config.rms_norm_eps, f"self_attn_{name}_norm")(x) if name in ("q", "k") else x


class Qwen3ForCausalLM(DecoderLM):
    """Qwen3 causal LM; ``setup``, ``hidden``, ``unembed`` and ``__call__`` come from ``common.DecoderLM``."""

    LAYER, FINAL_NORM, NORM_EPS = Qwen3Layer, RMSNorm, "rms_norm_eps"


def param_mappings(cfg: Qwen3Config):
    def layer(hf: str, p: tuple):
        norms = [m for n in "qk" for m in norm_maps(f"{hf}.self_attn.{n}_norm", p + (f"self_attn_{n}_norm",),
                                                    bias=False)]
        return layer_maps(hf, p, cfg.attention_bias, cfg.attention_bias, False) + norms
    return decoder_maps(Qwen3ForCausalLM, cfg, layer)


# the doctor's tiny model (``family.tiny_config``): per-head q/k norms, head_dim 32 != 64 / 4, grouped-query
# attention, linear RoPE scaling
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})

register_family(Qwen3Config.MODEL_TYPE, Qwen3Config, Qwen3ForCausalLM, param_mappings, ignored_keys=IGNORED_HF_KEYS,
                harmless=HARMLESS_HF_FIELDS, tiny=TINY)
