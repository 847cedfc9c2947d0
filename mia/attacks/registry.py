"""Attack registry: name -> (host function, what it needs, default hyperparameters).

An attack is registered with::

    @register("mink", needs=("stats",), k=0.2)
    def _mink(ctx: AttackContext, *, k: float) -> np.ndarray:   # one score per evaluated example
        ...

and used as ``mia score --attacks mink:k=0.1``. Every attack returns float scores, HIGHER = MORE LIKELY MEMBER.
The host function does I/O-free orchestration (it may ask ``ctx`` for token stats, the model, partitions);
the math lives in pure JAX functions next to it.

``needs`` vocabulary:
  stats    per-token statistics of the evaluated examples (one shared scoring pass; no extra model call)
  model    further target-model calls (conditional likelihoods, perturbed params, repeated text ...)
  text     the example's text (decoded from tokens when only tokens are given)
  prefix   non-member texts for ReCaLL prefixes (partition "prefix" or --prefix-data), disjoint from evaluation
  calib    calibration non-members (partition "calib" or --calib-data), disjoint from evaluation
  train    labelled training examples (partition "train" or --train-data), disjoint from evaluation
  ref      a reference model (--ref-model)
  mlm      a masked language model directory (--mlm)
  freq     a reference token-frequency corpus (--freq-corpus FILE), else the "calib" partition's non-members
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

NEEDS = ("stats", "model", "text", "prefix", "calib", "train", "ref", "mlm", "freq")


class AttackError(ValueError):
    """Bad attack name, parameter or missing input. The message is one line meant for the user."""


@dataclasses.dataclass(frozen=True)
class AttackSpec:
    name: str
    fn: Callable[..., np.ndarray]
    needs: tuple
    defaults: dict
    doc: str

    def describe(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.defaults.items()) or "no parameters"
        return f"{self.name} ({params}; needs {', '.join(self.needs)})"


REGISTRY: dict[str, AttackSpec] = {}


def register(name: str, *, needs: tuple = ("stats",), **defaults) -> Callable:
    """Decorator registering ``fn(ctx, **params) -> np.ndarray [N]`` under ``name``."""
    bad = [n for n in needs if n not in NEEDS]
    if bad:
        raise ValueError(f"unknown needs {bad}; valid: {NEEDS}")

    def wrap(fn):
        REGISTRY[name] = AttackSpec(name, fn, tuple(needs), dict(defaults), (fn.__doc__ or "").strip())
        return fn

    return wrap


def _load_builtin() -> None:
    from . import _builtin  # noqa: F401  (imports every attack module, which registers itself)


def available() -> list[str]:
    _load_builtin()
    return sorted(REGISTRY)


def get(name: str) -> AttackSpec:
    _load_builtin()
    if name not in REGISTRY:
        raise AttackError(f"unknown attack {name!r}; available: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def _coerce(value: str, default: Any, where: str):
    if isinstance(default, bool):
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("0", "false", "no"):
            return False
        raise AttackError(f"{where}: expected true/false, got {value!r}")
    try:
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except ValueError:
        raise AttackError(f"{where}: expected a {type(default).__name__}, got {value!r}") from None
    return value


def parse_attack(text: str) -> tuple[str, dict]:
    """'name' or 'name:key=value,key=value' -> (name, params with defaults filled in, types checked)."""
    name, _, rest = text.strip().partition(":")
    spec = get(name)
    params = dict(spec.defaults)
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise AttackError(f"attack {name}: parameter {item!r} must be key=value")
        if key not in spec.defaults:
            valid = ", ".join(spec.defaults) or "none"
            raise AttackError(f"attack {name}: unknown parameter {key!r}; valid parameters: {valid}")
        params[key] = _coerce(value, spec.defaults[key], f"attack {name}, parameter {key}")
    return name, params


def parse_attacks(text: str) -> list[tuple[str, str, dict]]:
    """Comma-separated attack list where each attack's own params follow ':' and are separated by ','.

    Attacks are separated by ';' or by ',' when the next item has no '=' (e.g. ``loss,mink:k=0.1,zlib``).
    Returns (label, name, params); label is the spec text unless it is a bare name.
    """
    items: list[str] = []
    for part in text.replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        if "=" in part and ":" not in part and items:
            items[-1] += "," + part
        else:
            items.append(part)
    out = []
    for item in items:
        name, params = parse_attack(item)
        out.append((item if ":" in item else name, name, params))
    return out
