"""Gemma 3 text (``model_type: gemma3_text``, ``Gemma3ForCausalLM``) as a Flax module, following transformers'
``modeling_gemma3.py``: Gemma 2's model (``gemma2``) with these differences.

- q/k norms: Gemma RMSNorm over each head's E channels (``q_norm``, ``k_norm``), after the projections and before
  rotary.
- A rotary base per layer kind: full-attention layers ``rope_theta`` (default 1e6), sliding layers
  ``rope_local_base_freq`` (default 1e4), or transformers>=5's ``rope_parameters`` keyed by layer type. The full
  layers may carry ``rope_scaling`` linear (Gemma 3 4B and larger: factor 8); other scalings are refused.
- Without ``layer_types``, every ``sliding_window_pattern``-th layer (default 6) is full, the others sliding.
- No attention-logit soft cap: transformers' Gemma 3 attention ignores ``attn_logit_softcapping``, so a value
  other than null is refused rather than guessed at; ``final_logit_softcapping`` (default null) is applied.
Every default is transformers' ``Gemma3TextConfig``'s: the text config of a multimodal checkpoint (Gemma 3 4B)
publishes only the fields that differ from them.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from .common import ConfigError, rotary_tables
from .family import ReadTracker, hf_field, register_family
from .gemma2 import (GEMMA_HARMLESS, GEMMA_REFUSED, LAYER_TYPES, Gemma2Config, Gemma2ForCausalLM, Gemma2Layer,
                     gemma_mappings, positive)
from .gqa import IGNORED_HF_KEYS
from .rope import UNSCALED, RopeScaling

GEMMA3_REFUSED = {**GEMMA_REFUSED, "attn_logit_softcapping": lambda v: v is not None}
ROPE_FIELDS = ("rope_theta", "rope_local_base_freq", "rope_parameters", "rope_scaling")  # read by read_gemma3_rope
ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor"}  # what a layer type's rope_parameters may hold


def _rope_spec(model_type: str, field: str, spec, allowed: tuple) -> dict:
    if spec is None:
        return {}
    if not isinstance(spec, dict) or set(spec) - ROPE_KEYS:
        raise ConfigError(f"{model_type}: config field {field}={spec!r} is not supported (keys: "
                          f"{', '.join(sorted(ROPE_KEYS))})")
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind not in allowed:
        raise ConfigError(f"{model_type}: config field {field}.rope_type={kind!r} is not supported "
                          f"(only {' or '.join(allowed)})")
    return spec


def _agreed(model_type: str, given: list, default: float) -> float:
    """The one value of [(field, value)] (they must agree), else ``default``."""
    if len({float(v) for _, v in given}) > 1:
        raise ConfigError(f"{model_type}: config fields " + ", ".join(f"{k}={v!r}" for k, v in given) + " disagree")
    return float(given[0][1]) if given else float(default)


def read_gemma3_rope(model_type: str, hf: dict) -> tuple[float, float, float]:
    """(full-attention rotary base, sliding rotary base, linear factor of the full layers) from the flat keys
    (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``) and/or ``rope_parameters`` keyed by layer type."""
    params = hf.get("rope_parameters")
    if params is not None and (not isinstance(params, dict) or not set(params) <= set(LAYER_TYPES)):
        raise ConfigError(f"{model_type}: config field rope_parameters={params!r} must be keyed by layer type "
                          f"({', '.join(LAYER_TYPES)})")
    params = params or {}
    full = dict(_rope_spec(model_type, "rope_parameters.full_attention", params.get("full_attention"),
                           ("default", "linear")))
    scaling = _rope_spec(model_type, "rope_scaling", hf.get("rope_scaling"), ("default", "linear"))
    full.update(scaling)  # transformers merges rope_scaling into the full layers' parameters
    local = _rope_spec(model_type, "rope_parameters.sliding_attention", params.get("sliding_attention"),
                       ("default",))
    linear = full.get("rope_type", full.get("type", "default")) == "linear"
    factor = positive(model_type, "rope_scaling.factor", full.get("factor"), optional=False) if linear else 1.0
    theta = [(k, hf[k]) for k in ("rope_theta",) if k in hf]
    local_theta = [(k, hf[k]) for k in ("rope_local_base_freq",) if k in hf]
    theta += [("rope_parameters.full_attention.rope_theta", full["rope_theta"])] if "rope_theta" in full else []
    local_theta += [("rope_parameters.sliding_attention.rope_theta", local["rope_theta"])] if "rope_theta" in local \
        else []
    return _agreed(model_type, theta, 1e6), _agreed(model_type, local_theta, 1e4), float(factor)


@dataclasses.dataclass(frozen=True)
class Gemma3TextConfig(Gemma2Config):
    """``rope_theta`` / ``rope_local_base_freq``: the rotary bases of the full / sliding layers; ``rope_factor``:
    the full layers' linear RoPE scaling (1.0: none)."""

    MODEL_TYPE, ARCHITECTURE = "gemma3_text", "Gemma3ForCausalLM"
    REFUSED = GEMMA3_REFUSED

    vocab_size: int = hf_field(262208)
    max_position_embeddings: int = hf_field(131072)
    rope_theta: float = hf_field(1e6, derived=True)
    rope_local_base_freq: float = hf_field(1e4, derived=True)
    rope_factor: float = hf_field(1.0, derived=True)
    sliding_window_pattern: int = hf_field(6)
    attn_logit_softcapping: Optional[float] = hf_field(None)
    final_logit_softcapping: Optional[float] = hf_field(None)

    @classmethod
    def default_layer_types(cls, values: dict, n: int) -> tuple:
        pattern = values["sliding_window_pattern"]
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ConfigError(f"{cls.MODEL_TYPE}: config field sliding_window_pattern={pattern!r} must be a positive "
                              "integer")
        return tuple(LAYER_TYPES[0] if (i + 1) % pattern else LAYER_TYPES[1] for i in range(n))

    @classmethod
    def derive(cls, hf: dict, values: dict) -> dict:
        theta, local, factor = read_gemma3_rope(cls.MODEL_TYPE, hf)
        # Gemma 2's (and GQA's) checks on config.json without the rotary keys, whose reading is replaced here
        rest = ReadTracker({k: dict.__getitem__(hf, k) for k in hf if k not in ROPE_FIELDS})
        out = super().derive(rest, values)
        if isinstance(hf, ReadTracker):
            hf.read |= rest.read
        return {**out, "rope_theta": theta, "rope_local_base_freq": local, "rope_factor": factor}

    def hf_extra(self) -> dict:
        full = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_factor != 1.0:
            full = {"rope_type": "linear", "rope_theta": self.rope_theta, "factor": self.rope_factor}
        return {**super().hf_extra(), "rope_theta": self.rope_theta, "rope_local_base_freq": self.rope_local_base_freq,
                "rope_parameters": {"full_attention": full,
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": self.rope_local_base_freq}}}


class Gemma3Layer(Gemma2Layer):
    """Gemma 2's layer with q/k norms and the rotary tables of its layer kind."""

    def qk_norms(self, q_bthe, k_btke):
        return self.gemma_norm("self_attn_q_norm")(q_bthe), self.gemma_norm("self_attn_k_norm")(k_btke)

    def layer_rotary(self, layer, cos_full, sin_full, cos_local, sin_local):
        kinds = self.config.layer_types
        if len(set(kinds)) == 1:
            local = kinds[0] == "sliding_attention"
            return (cos_local, sin_local) if local else (cos_full, sin_full)
        is_local = jnp.asarray(np.array([kind == "sliding_attention" for kind in kinds]))[layer]
        return jnp.where(is_local, cos_local, cos_full), jnp.where(is_local, sin_local, sin_full)

    def attention_softcap(self) -> Optional[float]:
        return None  # transformers' Gemma 3 attention has none (a set attn_logit_softcapping is refused)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text causal LM: Gemma 2's with ``Gemma3Layer`` and two rotary tables (full layers, sliding layers)."""

    LAYER = Gemma3Layer

    def _rotary(self, positions_bt) -> tuple:
        cfg = self.config
        scaling = UNSCALED if cfg.rope_factor == 1.0 else RopeScaling("linear", factor=cfg.rope_factor)
        full = rotary_tables(positions_bt, cfg.head_dim, cfg.rope_theta, scaling)
        return (*full, *rotary_tables(positions_bt, cfg.head_dim, cfg.rope_local_base_freq))


def param_mappings(cfg: Gemma3TextConfig):
    return gemma_mappings(Gemma3ForCausalLM, cfg, attention_norms=("q_norm", "k_norm"))


# the doctor's tiny model (``family.tiny_config``): GQA, sliding layers and a full one (pattern 2: sliding, full),
# the window shorter than its rows, a linear-scaled full rotary and a final soft cap
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=64,
            sliding_window_pattern=2, query_pre_attn_scalar=16, final_logit_softcapping=5.0, rope_theta=1e4,
            rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 8.0})

# _sliding_window_pattern: transformers' private copy of sliding_window_pattern, written by its to_dict, never read
register_family(Gemma3TextConfig.MODEL_TYPE, Gemma3TextConfig, Gemma3ForCausalLM, param_mappings,
                ignored_keys=IGNORED_HF_KEYS, harmless=(*GEMMA_HARMLESS, "_sliding_window_pattern"), tiny=TINY)
