"""The declarative config form (``mia.models.family.hf_field`` / ``HFConfig``): what the generic ``from_hf`` reads,
what ``to_hf`` writes, and that every family's ``to_hf`` is read back whole and equal."""
from __future__ import annotations

import dataclasses

import pytest

import mia.models  # noqa: F401  (registers the families)
from mia.models.common import ConfigError
from mia.models.family import FAMILIES, HFConfig, ReadTracker, hf_field, read_config, tiny_config


@dataclasses.dataclass(frozen=True)
class Toy(HFConfig):
    MODEL_TYPE, ARCHITECTURE = "toy", "ToyForCausalLM"
    REFUSED = {"cross": bool}

    width: int = hf_field(aliases=("hidden_size",))
    base: float = hf_field(1.0, key="rotary_base")
    kinds: tuple = hf_field((), derived=True)

    @classmethod
    def derive(cls, hf, values):
        if values["width"] < 1:
            raise ConfigError(f"toy: width={values['width']} must be positive")
        return {**values, "kinds": tuple(hf.get("layer_kinds") or ())}

    def hf_extra(self):
        return {"layer_kinds": list(self.kinds)}


def test_fields_are_read_by_key_then_alias_then_default():
    assert Toy.from_hf({"hidden_size": 4}) == Toy(width=4, base=1.0, kinds=())
    assert Toy.from_hf({"width": 3, "hidden_size": 4, "rotary_base": 2.0}).width == 3
    assert Toy.from_hf({"width": 3, "base": 9.0}).base == 1.0  # config.json's name is the key, not the field's


def test_every_name_of_a_field_counts_as_read():
    hf = ReadTracker({"width": 3, "hidden_size": 3, "layer_kinds": ["a"]})
    Toy.from_hf(hf)
    assert {"width", "hidden_size", "rotary_base", "layer_kinds", "cross"} <= hf.read
    with pytest.raises(ConfigError, match="other"):
        read_config(Toy, {"width": 3, "other": 1})


def test_required_refused_and_derived_checks():
    with pytest.raises(KeyError, match="width"):
        Toy.from_hf({"rotary_base": 2.0})
    with pytest.raises(ConfigError, match="cross"):
        Toy.from_hf({"width": 3, "cross": True})
    with pytest.raises(ConfigError, match="width=0"):
        Toy.from_hf({"width": 0})


def test_to_hf_writes_keys_and_extras_and_reads_back():
    cfg = Toy.from_hf({"width": 3, "rotary_base": 5.0, "layer_kinds": ["a", "b"]})
    assert cfg.to_hf() == {"model_type": "toy", "architectures": ["ToyForCausalLM"], "width": 3, "rotary_base": 5.0,
                           "layer_kinds": ["a", "b"]}
    assert Toy.from_hf(cfg.to_hf()) == cfg


def test_an_alias_is_an_attribute():
    cfg = Toy(width=5)
    assert cfg.hidden_size == 5
    with pytest.raises(AttributeError, match="nothing"):
        cfg.nothing


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_reads_its_own_to_hf_whole(model_type):
    """to_hf writes nothing from_hf would refuse as unread, and reading it back gives the same config."""
    fam = FAMILIES[model_type]
    cfg = read_config(fam.config_cls, tiny_config(model_type), fam.harmless)
    assert isinstance(cfg, HFConfig)
    assert read_config(fam.config_cls, cfg.to_hf(), fam.harmless) == cfg


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_config_finds_its_own_family_not_the_one_it_subclasses(model_type):
    """Mistral's config subclasses Llama's and Gemma 3's Gemma 2's: ``family_of_config`` (``from_config``, the doctor)
    must still give each its own module."""
    from mia.models.family import family_of_config

    fam = FAMILIES[model_type]
    cfg = read_config(fam.config_cls, tiny_config(model_type), fam.harmless)
    assert family_of_config(cfg) is fam


def test_a_bad_value_is_named_as_config_json_spells_the_field():
    """OPT's config.json says ``ffn_dim`` for what mia's config calls ``intermediate_size``: the error names the key
    the user can find in the file."""
    from mia.models.family import family, tiny_config
    from mia.validate import InputError, check_config

    cfg = family("opt").config_cls.from_hf({**tiny_config("opt"), "ffn_dim": 0})
    with pytest.raises(InputError, match=r"^config.json: config field 'ffn_dim' must be in \[1, "):
        check_config(cfg, "config.json")
