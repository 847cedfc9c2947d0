"""Attack registry: name -> the attack and every fact about it that the rest of mia needs.

A token-statistics attack is one pure function of the shared per-token arrays, registered with ``register_stats``
(``mia/attacks/loss.py`` is the template to copy)::

    @register_stats("mink", stats=("logprob",), k=0.2, limits={"k": Range(0, 1, lo_open=True)})
    def min_k(logprob_bl, mask_bl, *, k):          # [B, L] arrays -> [B] scores, HIGHER = MORE LIKELY MEMBER
        ...

The decorator returns the jitted function itself (hyperparameters static), so ``min_k`` is what the design card
promises: a pure, jit-compiled function of arrays. ``stats`` names what it reads, in argument order (then the
mask): the model's statistics (``STAT_NAMES``: the scoring pass computes only those the run's attacks read) and the
host fields (``HOST_FIELDS``). Any other attack is a host function of an ``AttackContext``::

    @register("recall", needs=("model", "stats", "prefix"), stats=("logprob",), cost="model", n=12)
    def _recall(ctx: AttackContext, *, n: int) -> np.ndarray:    # one score per evaluated example
        ...

Either way the registration carries what the runner, the CLI, the experiments and the docs read:
  ``needs``         the inputs (vocabulary below); a missing one stops the run before any model is loaded
  ``cost``          ``COSTS``: "stats" (no model call beyond the shared pass), "model" (a few more passes),
                    "heavy" (many passes per example), "quadratic" (N x N model calls); experiment presets skip the
                    costly ones by this field, with ``cost_note`` as the reason
  ``check_inputs``  ``fn(params, inputs: AttackInputs)`` raising ``AttackError``: the attack's own input rule beyond
                    ``needs`` (e.g. Con-ReCaLL's member shots), checked before any model is loaded
  ``limits``        param -> ``mia.validate.Range`` or a tuple of choices, checked when the attack is parsed
  ``stats``         the token statistics it reads from the shared pass (``ctx.padded()`` / ``ctx.stats()``); a host
                    attack that needs "stats" and names none reads all of ``STAT_NAMES``
and is used as ``mia score --attacks mink:k=0.1`` or ``mia.score(model, data, attacks="mink:k=0.1")``.

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
from typing import Any, Callable, Optional

import jax
import numpy as np

from ..engine.batching import pad_pow2
from ..engine.stats import STAT_NAMES

NEEDS = ("stats", "model", "text", "prefix", "member_prefix", "calib", "train", "ref", "mlm", "freq")
COSTS = ("stats", "model", "heavy", "quadratic")  # in increasing order
NEED_DESCRIPTIONS = {  # what a missing need is called in messages: "needs <description>"
    "ref": "a reference model (--ref-model)", "mlm": "a masked language model (--mlm)",
    "prefix": "non-member prefix examples (--prefix-data or a 'prefix' partition)",
    "member_prefix": "member prefix examples (--member-prefix-data or members of a 'train' partition)",
    "calib": "calibration non-members (--calib-data or a 'calib' partition)",
    "train": "labelled training examples (--train-data or a 'train' partition)",
    "freq": "a token-frequency corpus (--freq-corpus or a 'calib' partition)"}
_PARTITION_FLAGS = {"prefix": "--prefix-data", "calib": "--calib-data", "train": "--train-data"}
# per-token fields an attack may read besides the model's statistics, made on the host (``AttackContext.padded``):
#   eos_target  [N, L] bool: the position's target token is the model's end-of-document token (config.eos_token_id;
#               every id when it is a list; all False when the config has none)
HOST_FIELDS = ("eos_target",)
TOKEN_FIELDS = STAT_NAMES + HOST_FIELDS


class AttackError(ValueError):
    """Bad attack name, parameter or missing input. The message is one line meant for the user."""


@dataclasses.dataclass(frozen=True)
class AttackInputs:
    """What a run offers the attacks: the learned-from partitions (None before the data are read) and the options
    (``ref_model``, ``mlm``, ``freq_corpus``: given or not)."""

    partitions: Optional[dict] = None
    ref_model: Any = None
    mlm: Any = None
    freq_corpus: Any = None


@dataclasses.dataclass(frozen=True)
class AttackSpec:
    name: str
    fn: Callable[..., np.ndarray]  # host function: (ctx, **params) -> [N]
    needs: tuple
    defaults: dict
    doc: str
    limits: dict = dataclasses.field(default_factory=dict)  # param -> mia.validate.Range or a tuple of choices
    cost: str = "stats"
    cost_note: str = ""
    check_inputs: Optional[Callable] = None  # (params, AttackInputs) -> None, raising AttackError
    pure: Optional[Callable] = None  # register_stats: the jitted pure function of stats arrays
    stats: tuple = ()  # the token fields it reads (register_stats: in argument order, then the mask)

    @property
    def model_stats(self) -> tuple:
        """The model's token statistics it reads: what the shared scoring pass must compute for it."""
        return tuple(s for s in STAT_NAMES if s in self.stats)

    def describe(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.defaults.items()) or "no parameters"
        reads = f"; reads {', '.join(self.stats)}" if self.stats else ""
        return f"{self.name} ({params}; needs {', '.join(self.needs)}{reads}; cost {self.cost})"


REGISTRY: dict[str, AttackSpec] = {}


def _default_cost(needs) -> str:
    return "model" if set(needs) & {"model", "ref", "mlm"} else "stats"


def register(name: str, *, needs: tuple = ("stats",), cost: Optional[str] = None, cost_note: str = "",
             check_inputs: Optional[Callable] = None, limits: Optional[dict] = None, stats: Optional[tuple] = None,
             **defaults) -> Callable:
    """Decorator registering ``fn(ctx, **params) -> np.ndarray [N]`` under ``name`` (see the module docstring)."""
    bad = [n for n in needs if n not in NEEDS]
    if bad:
        raise ValueError(f"unknown needs {bad}; valid: {NEEDS}")
    stats = _checked_fields(name, (STAT_NAMES if "stats" in needs else ()) if stats is None else stats)
    cost = cost or _default_cost(needs)
    if cost not in COSTS:
        raise ValueError(f"unknown cost {cost!r}; valid: {COSTS}")
    unknown = [k for k in (limits or {}) if k not in defaults]
    if unknown:
        raise ValueError(f"limits for unknown parameters {unknown}")

    def wrap(fn):
        REGISTRY[name] = AttackSpec(name, fn, tuple(needs), dict(defaults), (fn.__doc__ or "").strip(),
                                    dict(limits or {}), cost, cost_note, check_inputs, stats=stats)
        return fn

    return wrap


def _checked_fields(name: str, fields) -> tuple:
    fields = tuple(fields)
    bad = [f for f in fields if f not in TOKEN_FIELDS]
    if bad or len(set(fields)) != len(fields):
        raise ValueError(f"attack {name}: stats must be distinct names among {', '.join(TOKEN_FIELDS)}; got {fields}")
    return fields


def register_stats(name: str, *, stats: tuple = ("logprob",), check: Optional[Callable] = None,
                   note: Optional[Callable] = None, limits: Optional[dict] = None, **defaults) -> Callable:
    """Decorator registering a pure function ``f(*[B, L] arrays, mask_bl, **params) -> [B]`` of the shared token
    statistics (``stats`` names them, in argument order: ``STAT_NAMES`` and ``HOST_FIELDS``). Returns ``jax.jit(f)``
    with the hyperparameters static; the registered host function pads the run's arrays to power-of-two shapes (so
    other batch sizes reuse the compiled function) and calls it.

    ``check(ctx, **params)``: an optional host check raising ``AttackError`` before anything is computed (e.g. a
    model fact the parameters need). ``note(aux, **params) -> str | None``: when ``f`` returns ``(scores, aux)``
    (``aux`` [B], e.g. how many tokens an example's score used), a line said to the user with the results."""
    stats = _checked_fields(name, stats)

    def wrap(fn):
        jitted = jax.jit(fn, static_argnames=tuple(defaults))

        def host(ctx, **params) -> np.ndarray:
            params = check_params(name, params)
            if check is not None:
                check(ctx, **params)
            p = ctx.padded(stats)
            padded, n = pad_pow2({s: p[s] for s in (*stats, "mask")})
            out = jitted(*(padded[s] for s in stats), padded["mask"], **params)
            scores, aux = out if isinstance(out, tuple) else (out, None)
            said = note(np.asarray(aux)[:n], **params) if note is not None and aux is not None else None
            if said and said not in ctx.notes:
                ctx.notes.append(said)
            return np.asarray(scores, np.float64)[:n]

        host.__doc__ = fn.__doc__
        register(name, needs=("stats",), cost="stats", limits=limits, stats=stats, **defaults)(host)
        REGISTRY[name] = dataclasses.replace(REGISTRY[name], pure=jitted)
        return jitted

    return wrap


def stats_read_by(names) -> tuple:
    """The model's token statistics that the attacks ``names`` read, in ``STAT_NAMES`` order (empty when none
    reads any): what a run's one scoring pass computes."""
    wanted = {s for n in names for s in get(n).model_stats}
    return tuple(s for s in STAT_NAMES if s in wanted)


def available() -> list[str]:
    return sorted(REGISTRY)


def get(name: str) -> AttackSpec:
    if name not in REGISTRY:
        raise AttackError(f"unknown attack {name!r}; available: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def missing_need(spec: AttackSpec, inputs: AttackInputs) -> Optional[str]:
    """The first of ``spec.needs`` that ``inputs`` cannot provide (partition needs only once the partitions are
    known), or None."""
    given = {"ref": inputs.ref_model, "mlm": inputs.mlm}
    for need in spec.needs:
        if need in given and not given[need]:
            return need
        if inputs.partitions is None:
            continue
        if need in _PARTITION_FLAGS and not inputs.partitions.get(need):
            return need
        if need == "freq" and not inputs.freq_corpus and not inputs.partitions.get("calib"):
            return need
    return None


def check_attack_inputs(label: str, name: str, params: dict, inputs: AttackInputs) -> None:
    """Every input the attack needs is there (``needs``, then the attack's own ``check_inputs``), or one
    ``AttackError`` naming the attack and what to give."""
    spec = get(name)
    need = missing_need(spec, inputs)
    if need in ("ref", "mlm"):
        what = "a reference model: give --ref-model DIR (a local model directory)" if need == "ref" else \
            "a masked language model: give --mlm DIR (a local BERT MLM directory)"
        raise AttackError(f"attack {label} needs {what}")
    if need in _PARTITION_FLAGS:
        raise AttackError(f"attack {label} needs '{need}' examples, got none (give {_PARTITION_FLAGS[need]} FILE or "
                          f"a split with a '{need}' partition)")
    if need == "freq":
        raise AttackError(f"attack {label} needs a token-frequency corpus, got none (give --freq-corpus FILE, or "
                          "--calib-data / a split with a 'calib' partition)")
    if spec.check_inputs is not None:
        spec.check_inputs(params, inputs)


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


def check_params(name: str, params: dict) -> dict:
    """``params`` of attack ``name`` given as Python values: unknown names refused, defaults filled in, types and
    ``limits`` checked (as ``parse_attack`` does for text)."""
    spec = get(name)
    unknown = [k for k in params if k not in spec.defaults]
    if unknown:
        raise AttackError(f"attack {name}: unknown parameter {unknown[0]!r}; valid parameters: "
                          f"{', '.join(spec.defaults) or 'none'}")
    out = dict(spec.defaults)
    for key, value in params.items():
        where = f"attack {name}, parameter {key}"
        default = spec.defaults[key]
        out[key] = _coerce(str(value), default, where) if isinstance(value, str) and not isinstance(default, str) \
            else _typed(value, default, where)
        if key in spec.limits:
            _check_limit(out[key], spec.limits[key], where)
    return out


def _typed(value, default, where: str):
    """A Python value of the default's type (an int where a float is expected is taken as a float)."""
    if isinstance(default, bool):
        ok = isinstance(value, (bool, np.bool_))
    elif isinstance(default, int):
        ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) \
            and math.isfinite(value)
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise AttackError(f"{where}: expected {type(default).__name__}, got {value!r}")
    return type(default)(value)


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
