"""Model families: ``model_type`` -> the config class, Flax module and parameter mapping that implement it.

Each family module registers itself at import (``register_family``, with its tiny config for ``mia doctor``);
``import mia.models`` imports them all, so adding a family is one module (and one entry in ``tests/tiny_configs.py``).
A family's config class reads ``config.json`` with ``from_hf(hf)``; every field it does not read must be one mia
knows to be harmless (``HARMLESS_FIELDS``, plus the family's own ``harmless``), or loading stops naming it
(``unread_fields``): a field that changes the model's arithmetic is never ignored silently.

A config class is declarative (``HFConfig``): a frozen dataclass whose fields say where they live in config.json
(``hf_field``); the generic ``from_hf``/``to_hf`` read and write them, and the family writes only what is its own:
the values it refuses (``REFUSED``), its derivations and checks (``derive``) and what it writes besides its fields
(``hf_extra``). Fields of the families, for instance::

    vocab_size: int = hf_field()                                  # required: a missing one is a KeyError
    n_embd: int = hf_field(768, aliases=("hidden_size",))         # GPT-2: n_embd, else hidden_size, else 768
    rope_theta: float = hf_field(10000.0, key="rotary_emb_base")  # GPT-NeoX: config.json names it otherwise
    attention_layers: tuple = hf_field(..., derived=True)         # GPT-Neo: derive and hf_extra handle it
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable, ClassVar, Iterable, Optional

from .common import ConfigError, refuse_values

# config.json fields that never change a forward pass: metadata, training-only settings (dropout, initialisation),
# generation defaults and classification heads mia does not use.
HARMLESS_FIELDS = frozenset({
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "_commit_hash",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "tokenizer_class", "initializer_range", "initializer_factor", "gradient_checkpointing",
    "attention_dropout", "hidden_dropout", "classifier_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "embed_dropout", "resid_dropout",
    "is_decoder", "is_encoder_decoder", "id2label", "label2id", "problem_type", "finetuning_task",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "task_specific_params", "prefix", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "chunk_size_feed_forward", "tie_encoder_decoder",
})


REQUIRED = dataclasses.MISSING  # hf_field's default when config.json must hold the field


@dataclasses.dataclass(frozen=True)
class HFKey:
    """Where a config field lives in config.json: written under ``key``, read from ``key`` or else the first of
    ``aliases`` present (transformers' ``attribute_map`` names: the config object answers to them as well), else
    ``default``; ``derived`` fields are left to the family's ``derive``/``hf_extra``."""

    key: str
    aliases: tuple
    default: Any  # REQUIRED: none
    derived: bool


def hf_field(default: Any = REQUIRED, *, key: Optional[str] = None, aliases: Iterable[str] = (),
             derived: bool = False) -> Any:
    """A config dataclass field declared with its config.json name (``key``, default: the field's own name), the
    other names it may be read from (``aliases``) and its ``default`` when config.json has none of them (also the
    dataclass default; ``REQUIRED``: a missing field is a KeyError naming ``key``). ``derived``: the generic
    reader and writer skip it; the family's ``derive`` sets it and ``hf_extra`` writes it."""
    meta = {"hf": HFKey(key or "", tuple(aliases), default, derived)}  # key "": the field's name (hf_key)
    if default is REQUIRED:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def hf_key(field: dataclasses.Field) -> HFKey:
    """The field's ``HFKey``, its key filled in (a field declared without hf_field: read and written by its name)."""
    spec = field.metadata.get("hf") or HFKey(field.name, (), field.default, False)
    return spec if spec.key else dataclasses.replace(spec, key=field.name)


def read_fields(config_cls, hf: dict) -> dict:
    """{field name: value} of every field of ``config_cls`` that is not derived, read from config.json ``hf`` as
    its ``HFKey`` says. Every name a field may have is looked at (so ``ReadTracker`` counts aliases read)."""
    values = {}
    for f in dataclasses.fields(config_cls):
        spec = hf_key(f)
        if spec.derived:
            continue
        present = [name for name in (spec.key, *spec.aliases) if name in hf]
        if present:
            values[f.name] = hf[present[0]]
        elif spec.default is REQUIRED:
            raise KeyError(spec.key)
        else:
            values[f.name] = spec.default
    return values


def write_fields(cfg) -> dict:
    """{config.json key: value} of every field of ``cfg`` that is not derived."""
    specs = ((f, hf_key(f)) for f in dataclasses.fields(cfg))
    return {spec.key: getattr(cfg, f.name) for f, spec in specs if not spec.derived}


@functools.lru_cache(maxsize=None)
def _alias_targets(config_cls) -> dict:
    return {alias: f.name for f in dataclasses.fields(config_cls) for alias in hf_key(f).aliases}


class HFConfig:
    """Base of a family config class (a frozen dataclass of ``hf_field``s).

    ``from_hf(hf)``: refuses ``REFUSED`` values (``common.refuse_values``), reads every declared field
    (``read_fields``), then ``derive(hf, values)`` (the family's derivations and checks) returns the constructor's
    arguments. ``to_hf()``: ``model_type``, ``architectures``, the declared fields under their keys, then
    ``hf_extra()``. An alias of a field is also an attribute (``GPT2Config.hidden_size`` is ``n_embd``).
    """

    MODEL_TYPE: ClassVar[str] = ""
    ARCHITECTURE: ClassVar[str] = ""
    REFUSED: ClassVar[dict] = {}  # config.json field -> predicate on its value: True refuses it

    @classmethod
    def from_hf(cls, hf: dict):
        refuse_values(cls.MODEL_TYPE, hf, cls.REFUSED)
        return cls(**cls.derive(hf, read_fields(cls, hf)))

    @classmethod
    def derive(cls, hf: dict, values: dict) -> dict:
        """The constructor's arguments from the declared fields' ``values``: derived fields set, values checked
        (``ConfigError``) or normalised; ``hf`` (config.json) for what no field declares."""
        return values

    def to_hf(self) -> dict:
        return {"model_type": self.MODEL_TYPE, "architectures": [self.ARCHITECTURE], **write_fields(self),
                **self.hf_extra()}

    def hf_extra(self) -> dict:
        """config.json entries besides the declared fields (derived ones, constants transformers needs)."""
        return {}

    def __getattr__(self, name: str):  # only for names that are not attributes: a field's alias
        target = _alias_targets(type(self)).get(name)
        if target is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self, target)


@dataclasses.dataclass(frozen=True)
class TransformerConfig(HFConfig):
    """The shape fields that config.json must hold under transformers' generic names (the base of the GQA families,
    GPT-NeoX and BERT; GPT-2 and GPT-Neo use their own names): V, D, L, H and the MLP width F."""

    vocab_size: int = hf_field()
    hidden_size: int = hf_field()
    num_hidden_layers: int = hf_field()
    num_attention_heads: int = hf_field()
    intermediate_size: int = hf_field()


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    config_cls: Any  # frozen dataclass with from_hf(hf) / to_hf()
    module_cls: Any  # Flax CausalLM with hidden / unembed
    param_mappings: Callable  # (config) -> [ParamMapping]
    ignored_keys: tuple = ()  # regexes of checkpoint tensors that are buffers, not parameters
    harmless: frozenset = frozenset()  # config.json fields of this family that never change a forward pass
    tiny: Optional[dict] = None  # config.json fields of a tiny model of the family (``tiny_config``)


FAMILIES: dict[str, Family] = {}


def register_family(model_type: str, config_cls, module_cls, param_mappings, *, ignored_keys: Iterable[str] = (),
                    harmless: Iterable[str] = (), tiny: Optional[dict] = None) -> Family:
    """Make ``model_type`` loadable (called once, at the end of the family's module). ``tiny``: the config.json
    fields of a tiny model of the family, with the family's distinctive options on (``tiny_config``)."""
    fam = Family(model_type, config_cls, module_cls, param_mappings, tuple(ignored_keys), frozenset(harmless),
                 None if tiny is None else dict(tiny))
    FAMILIES[model_type] = fam
    return fam


def tiny_config(model_type: str) -> dict:
    """config.json (a dict) of the family's tiny model: 2 layers, width 64, 4 heads of 16 (so a mesh axis of 2 or 4
    divides them), a 128-token vocabulary and 512 positions, and the family's distinctive options on. ``mia doctor``
    checks every family with it; ``ConfigError`` when the family registered none."""
    fam = family(model_type)
    if not fam.tiny:
        raise ConfigError(f"model family {model_type!r} registered no tiny config (register_family(..., tiny=...))")
    return {"model_type": model_type, **json.loads(json.dumps(fam.tiny))}


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ConfigError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def family_of_config(cfg) -> Family:
    """The family whose config class ``cfg`` is an instance of (its own class first: Qwen3Config subclasses
    Qwen2Config)."""
    for fam in sorted(FAMILIES.values(), key=lambda f: type(cfg) is not f.config_cls):
        if isinstance(cfg, fam.config_cls):
            return fam
    raise ConfigError(f"{type(cfg).__name__} is not the config of a registered family")


class ReadTracker(dict):
    """A config.json dict that records which fields were looked at (``from_hf`` reads it once)."""

    def __init__(self, hf: dict):
        super().__init__(hf)
        self.read: set = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def read_config(config_cls, hf: dict, harmless: Iterable[str] = ()):
    """``config_cls.from_hf(hf)``, refusing (``ConfigError``) every field of ``hf`` that ``from_hf`` did not look at
    and that is not harmless: the converter either implements a field, refuses its value, or knows it is inert."""
    tracked = ReadTracker(hf)
    cfg = config_cls.from_hf(tracked)
    unread = unread_fields(hf, tracked.read, harmless)
    if unread:
        raise ConfigError(f"config field(s) {', '.join(unread)} not understood by mia's "
                          f"{hf.get('model_type', config_cls.__name__)} family: they may change the model, so it is "
                          "not loaded (fields known to be inert, such as dropout rates and generation defaults, are "
                          "ignored)")
    return cfg


def unread_fields(hf: dict, read: Iterable[str], harmless: Iterable[str] = ()) -> list[str]:
    """Fields of ``hf`` neither read nor harmless, sorted."""
    return sorted(set(hf) - set(read) - HARMLESS_FIELDS - set(harmless))
