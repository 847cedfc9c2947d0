"""Checkpoint layouts other than transformers' own, each read into an existing family by a mapping.

A layout is chosen by config.json's ``model_type`` (``native_layout``). It turns the native config into the
family's transformers config dict (``hf_config``) and the native tensors into the family's transformers tensor
names (``hf_tensors``, views only), so that everything after it (strict name/shape checks, sharded placement,
fingerprints over the files) is the ordinary loading path. ``tokenizer_class`` names the transformers class that
reads its tokenizer files when ``AutoTokenizer`` would need the repository's own (remote) code.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from . import olmo_native


@dataclasses.dataclass(frozen=True)
class NativeLayout:
    model_type: str  # config.json's model_type
    family: str  # the family it loads into
    hf_config: Callable[[dict, str], dict]  # (native config, source) -> transformers config dict
    hf_tensors: Callable[[dict, Any, str, type], dict]  # (native tensors, family config, source, error) -> HF names
    tokenizer_class: Optional[str] = None  # None: AutoTokenizer


LAYOUTS = {
    olmo_native.MODEL_TYPE: NativeLayout(olmo_native.MODEL_TYPE, olmo_native.FAMILY, olmo_native.hf_config,
                                         olmo_native.hf_tensors, olmo_native.TOKENIZER_CLASS),
}


def native_layout(hf: dict) -> Optional[NativeLayout]:
    """The layout of a raw config.json object, or None for transformers' own layout."""
    return LAYOUTS.get(hf.get("model_type"))
