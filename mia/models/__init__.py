"""Flax decoder families that load local Hugging Face checkpoints exactly. See ``hub.load`` / ``hub.save``."""
from .common import ConfigError, KVCache
from .hub import FAMILIES, CheckpointError, Model, from_config, load, load_config, place, save

__all__ = ["ConfigError", "CheckpointError", "KVCache", "Model", "FAMILIES", "load", "load_config", "save", "from_config", "place"]
