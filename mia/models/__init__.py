"""Flax model families and the loading of real checkpoints.

Every family module (``gpt_neox``, ``llama``, ``gpt2``, ``gpt_neo``, ``olmo``, ``olmo2``, ``opt``, ``phi3``,
``qwen2``, ``qwen3``, ``mistral``, ``gemma2``, ``gemma3``) registers itself (``family.register_family``) when this
package is imported; ``gqa`` holds what the Llama-shaped ones share, ``rope`` every family's rotary frequencies
(RoPE scaling included), ``bert`` the BERT encoder and masked LM (not a decoder family).
"""
import importlib as _importlib
import pkgutil as _pkgutil

from .common import ConfigError, KVCache
from .family import FAMILIES, Family, family
from .hub import CheckpointError, Model, from_config, load, load_config, place, save
from .inspect import check_checkpoint

__all__ = ["ConfigError", "CheckpointError", "KVCache", "Model", "Family", "FAMILIES", "family", "load", "load_config",
           "save", "from_config", "place", "check_checkpoint"]

for _mod in _pkgutil.iter_modules(__path__):  # the family modules register themselves on import
    _importlib.import_module(f"{__name__}.{_mod.name}")
