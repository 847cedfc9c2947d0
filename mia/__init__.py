"""mia: membership inference attacks on language models, in JAX/Flax.

Score convention everywhere: higher = more likely member. Labels: 1 = member, 0 = non-member.
"""
import os as _os

_os.environ.setdefault("HF_HUB_OFFLINE", "1")
_os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
_os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__version__ = "0.1.0"
