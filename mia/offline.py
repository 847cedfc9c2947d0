"""mia reads local files only: Hugging Face libraries are put in offline mode whatever the environment says.

``force_offline()`` sets ``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE`` and ``TRANSFORMERS_OFFLINE`` to 1 (overriding a
user's 0: ``HF_DATASETS_OFFLINE=0`` would otherwise make ``datasets.load_dataset`` query the Hub for a builder
even for a local file) and, for modules a caller imported before mia, flips the flags those libraries read once at
import time. ``import mia`` calls it; so does every loader just before it uses ``datasets`` or ``transformers``.
"""
from __future__ import annotations

import os
import sys

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def force_offline() -> None:
    for name in OFFLINE_VARIABLES:
        os.environ[name] = "1"
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        hub.HF_HUB_OFFLINE = True
    ds = sys.modules.get("datasets.config")
    if ds is not None:
        ds.HF_HUB_OFFLINE = True
        ds.HF_DATASETS_OFFLINE = True
