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
  member_prefix  known members for Con-ReCaLL's member prefix (partition "member_prefix" or --member-prefix-data,
           else the train partition's label-1 examples), disjoint from evaluation
  calib    calibration non-members (partition "calib" or --calib-data), disjoint from evaluation
  train    labelled training examples (partition "train" or --train-data), disjoint from evaluation
  ref      a reference model (--ref-model)
  mlm      a masked language model directory (--mlm)
  freq     a reference token-frequency corpus (--freq-corpus FILE), else the "calib" partition's non-members
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

NEEDS = ("stats", "model", "text", "prefix", "member_prefix", "calib", "train", "ref", "mlm", "freq")


class AttackError(ValueError):
    """Bad attack name, parameter or missing input. The message is one line meant for the user."""


@dataclasses.dataclass(frozen=True)
class AttackSpec:
    name: str
    fn: Callable[..., np.ndarray]
    needs: tuple
    defaults: dict
    doc: str
    limits: dict = dataclasses.field(default_factory=dict)  # param -> mia.validate.Range or a tuple of choices

    def describe(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.defaults.items()) or "no parameters"
        return f"{self.name} ({params}; needs {', '.join(self.needs)})"


REGISTRY: dict[str, AttackSpec] = {}


def register(name: str, *, needs: tuple = ("stats",), limits: dict | None = None, **defaults) -> Callable:
    """Decorator registering ``fn(ctx, **params) -> np.ndarray [N]`` under ``name``.

    ``limits``: param -> ``mia.validate.Range`` (numeric interval) or a tuple of allowed strings, checked when the
    ``--attacks`` text is parsed, before any model is loaded."""
    bad = [n for n in needs if n not in NEEDS]
    if bad:
        raise ValueError(f"unknown needs {bad}; valid: {NEEDS}")
    unknown = [k for k in (limits or {}) if k not in defaults]
    if unknown:
        raise ValueError(f"limits for unknown parameters {unknown}")

    def wrap(fn):
        REGISTRY[name] = AttackSpec(name, fn, tuple(needs), dict(defaults), (fn.__doc__ or "").strip(),
                                    dict(limits or {}))
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
            v = float(value)
            if not math.isfinite(v):
                raise AttackError(f"{where}: expected a finite number, got {value!r}")
            return v
    except ValueError as e:
        if isinstance(e, AttackError):
            raise
        raise AttackError(f"{where}: expected {'an integer' if isinstance(default, int) else 'a float'}, "
                          f"got {value!r}") from None
    return value


def _check_limit(value, limit, where: str):
    if isinstance(limit, tuple):
        if value not in limit:
            raise AttackError(f"{where}: must be one of {', '.join(map(str, limit))}; got {value!r}")
    else:
        limit.check(value, where, AttackError)


def parse_attack(text: str) -> tuple[str, dict]:
    """'name' or 'name:key=value,key=value' -> (name, params with defaults filled in, types and limits checked;
    a parameter given twice is an error, not "the last one wins")."""
    name, _, rest = text.strip().partition(":")
    spec = get(name)
    params = dict(spec.defaults)
    given: set = set()
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise AttackError(f"attack {name}: parameter {item!r} must be key=value")
        if key not in spec.defaults:
            valid = ", ".join(spec.defaults) or "none"
            raise AttackError(f"attack {name}: unknown parameter {key!r}; valid parameters: {valid}")
        if key in given:
            raise AttackError(f"attack {name}: parameter {key!r} given twice")
        given.add(key)
        where = f"attack {name}, parameter {key}"
        params[key] = _coerce(value.strip(), spec.defaults[key], where)
        if key in spec.limits:
            _check_limit(params[key], spec.limits[key], where)
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
    if not items:
        raise AttackError(f"--attacks {text!r}: no attack named; `mia attacks` lists them")
    out = []
    for item in items:
        name, params = parse_attack(item)
        label = item if ":" in item else name
        if any(label == o[0] for o in out):
            raise AttackError(f"--attacks: attack {label!r} given twice")
        out.append((label, name, params))
    return out
