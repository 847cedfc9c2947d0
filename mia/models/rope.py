"""Rotary position embedding (RoPE) frequencies, read from config.json as transformers reads them
(``modeling_rope_utils.py``): one place for every family's rotary base and scaling.

A config.json states RoPE in one of two spellings:

- transformers < 5: a flat ``rope_theta`` (GPT-NeoX: ``rotary_emb_base``) and an optional ``rope_scaling`` dict
  (``{"rope_type" or "type": ..., "factor": ..., ...}``), as the published Llama 3.x and Qwen files carry;
- transformers >= 5: a ``rope_parameters`` dict holding ``rope_type``, ``rope_theta`` and the scaling keys.

``read_rope(hf)`` accepts both (``rope_scaling`` wins over ``rope_parameters`` where both are given, as in
transformers) and returns ``(theta, RopeScaling)``; ``inv_freq(dim, theta, scaling)`` gives the [dim / 2] float32
inverse frequencies, computed in float32 in the order transformers computes them. Implemented ``rope_type`` values:

  default  inv_freq_i = 1 / theta^(2i / dim)
  linear   default / factor (position interpolation)
  llama3   Llama 3.1's banded scaling: wavelengths 2 pi / inv_freq above original_max_position_embeddings /
           low_freq_factor are divided by ``factor``, those below original / high_freq_factor are kept, and the
           band between is interpolated linearly in original / wavelength

Refused by name (``REFUSED_TYPES`` says why): ``dynamic`` (transformers recomputes its frequencies from the longest
sequence its module has seen so far, a state across calls, so a text's logits would depend on what was scored
before it), ``yarn``, ``longrope`` (its frequencies also switch on the run-time length) and any other type.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from .errors import ConfigError

DEFAULT_THETA = 10000.0
SCALED_TYPES = ("default", "linear", "llama3")  # every rope_type implemented here

# rope_type -> why it is refused (the ConfigError says it)
REFUSED_TYPES = {
    "dynamic": "dynamic NTK scaling recomputes the frequencies from the longest sequence transformers' module has "
               "seen so far (a state kept across calls), so a text's logits would depend on the texts scored before it",
    "longrope": "LongRoPE switches its frequencies on the run-time sequence length",
    "yarn": "YaRN scaling is not implemented",
}

# the keys each implemented rope_type reads (besides rope_type / type and rope_theta)
_TYPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """The scaling of the rotary frequencies (``rope_type`` and its keys; None where the type has none).

    ``default``: no scaling. ``linear``: ``factor``. ``llama3``: ``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``. Frozen and hashable (a config field)."""

    rope_type: str = "default"
    factor: Optional[float] = None
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    original_max_position_embeddings: Optional[int] = None

    def to_hf(self, theta: float) -> dict:
        """The transformers >= 5 ``rope_parameters`` dict of this scaling with base ``theta``."""
        keys = {k: getattr(self, k) for k in _TYPE_KEYS[self.rope_type]}
        return {"rope_type": self.rope_type, "rope_theta": theta, **keys}


UNSCALED = RopeScaling()


def _number(value, where: str, *, integer: bool = False) -> float:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not math.isfinite(value) or value <= 0:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"config field {where}={value!r} must be {kind} > 0")
    return int(value) if integer else float(value)


def scaling_from(params: dict, where: str, *, types=SCALED_TYPES, partial: bool = False,
                 max_position_embeddings: Optional[int] = None) -> RopeScaling:
    """The ``RopeScaling`` of one flat rope dict (a ``rope_scaling`` or ``rope_parameters`` value, or one per-layer
    entry of a nested ``rope_parameters``); ``where`` names it in errors ("rope_scaling").

    ``types``: the rope_type values the caller implements (a family without scaled RoPE passes ("default",)).
    ``partial``: the caller reads ``partial_rotary_factor`` itself (GPT-NeoX); otherwise the key is accepted only
    when it is 1 (a fully rotated head). ``max_position_embeddings``: the config's, which stands in for a missing
    ``original_max_position_embeddings`` of a llama3 dict (transformers' ``standardize_rope_params``).
    ``ConfigError`` naming the key on a refused type, a missing or bad value, or a key this type does not read."""
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in types:
        why = REFUSED_TYPES.get(rope_type) or (f"the family implements {', '.join(map(repr, types))}"
                                               if rope_type in SCALED_TYPES else "unknown rope_type")
        raise ConfigError(f"config field {where}.rope_type={rope_type!r} is not supported ({why}); "
                          f"supported: {', '.join(types)}")
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor", *_TYPE_KEYS[rope_type]}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ConfigError(f"config field {where}.{unknown[0]}={params[unknown[0]]!r} is not read by rope_type "
                          f"{rope_type!r}: it may change the model, so it is not loaded")
    prf = params.get("partial_rotary_factor")
    if not partial and prf is not None and prf != 1:
        raise ConfigError(f"config field {where}.partial_rotary_factor={prf!r} is not supported (only 1: the "
                          "whole head rotates)")
    if rope_type == "llama3" and params.get("original_max_position_embeddings") is None:
        params = {**params, "original_max_position_embeddings": max_position_embeddings}
    values = {}
    for key in _TYPE_KEYS[rope_type]:
        if params.get(key) is None:
            raise ConfigError(f"config field {where}.{key} is missing (rope_type {rope_type!r} needs it)")
        values[key] = _number(params[key], f"{where}.{key}", integer=key == "original_max_position_embeddings")
    if rope_type == "llama3" and values["high_freq_factor"] <= values["low_freq_factor"]:
        raise ConfigError(f"config fields {where}.high_freq_factor={values['high_freq_factor']!r} must be above "
                          f"{where}.low_freq_factor={values['low_freq_factor']!r}")
    return RopeScaling(rope_type, **values)


def read_rope(hf: dict, *, legacy_key: str = "rope_theta", default_theta: float = DEFAULT_THETA,
              types=SCALED_TYPES, partial: bool = False,
              max_position_embeddings: Optional[int] = None) -> tuple[float, RopeScaling]:
    """(theta, scaling) of a config.json dict in either spelling (module docstring).

    The base: ``rope_parameters.rope_theta``, the flat ``legacy_key`` and ``rope_theta`` must agree where several
    are given (``ConfigError`` naming them: which one trained the model?); none: ``default_theta``. The scaling:
    ``rope_scaling`` when it is a non-empty dict (transformers prefers it), else ``rope_parameters``
    (``scaling_from`` with ``types``, ``partial`` and ``max_position_embeddings``)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    where, spec = ("rope_scaling", scaling) if scaling else ("rope_parameters", params)
    flat = [(k, hf[k]) for k in dict.fromkeys((legacy_key, "rope_theta")) if k in hf]
    given = [(f"{w}.rope_theta", d["rope_theta"]) for w, d in (("rope_scaling", scaling), ("rope_parameters", params))
             if d.get("rope_theta") is not None] + flat
    if len({float(v) for _, v in given}) > 1:
        raise ConfigError("config fields " + ", ".join(f"{k}={v!r}" for k, v in given) + " disagree")
    theta = _number(given[0][1], given[0][0]) if given else float(default_theta)
    return theta, scaling_from(spec, where, types=types, partial=partial,
                               max_position_embeddings=max_position_embeddings)


def inv_freq(dim: int, theta: float, scaling: RopeScaling = UNSCALED) -> np.ndarray:
    """[dim // 2] float32 inverse frequencies of a ``dim``-wide rotary (rotate_half layout: channel i and
    i + dim/2 share frequency i), each step in float32 as transformers' ``_compute_*_parameters`` does."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    base = np.float32(1.0) / (np.float32(theta) ** exponents)
    if scaling.rope_type == "default":
        return base
    factor = np.float32(scaling.factor)
    if scaling.rope_type == "linear":
        return base / factor
    if scaling.rope_type == "llama3":
        return _llama3(base, factor, scaling)
    raise ConfigError(f"rope_type {scaling.rope_type!r} is not implemented")


def _llama3(base: np.ndarray, factor: np.float32, s: RopeScaling) -> np.ndarray:
    """``_compute_llama3_parameters``: three bands by wavelength against the original context."""
    old, low, high = s.original_max_position_embeddings, s.low_freq_factor, s.high_freq_factor
    wavelen = np.float32(2 * math.pi) / base
    low_wavelen, high_wavelen = np.float32(old / low), np.float32(old / high)
    scaled = np.where(wavelen > low_wavelen, base / factor, base)  # long wavelengths: divided by factor
    smooth = (np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (np.float32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def bands(dim: int, theta: float, scaling: RopeScaling) -> tuple[int, int, int]:
    """(high, medium, low) counts of a llama3 scaling's frequencies: kept, interpolated, divided by factor."""
    wavelen = np.float32(2 * math.pi) / inv_freq(dim, theta)
    old = scaling.original_max_position_embeddings
    high = int((wavelen < np.float32(old / scaling.high_freq_factor)).sum())
    low = int((wavelen > np.float32(old / scaling.low_freq_factor)).sum())
    return high, len(wavelen) - high - low, low
