"""mia: membership inference attacks on language models, in JAX/Flax.

Score convention everywhere: higher = more likely member. Labels: 1 = member, 0 = non-member.
"""
import os as _os

from .offline import force_offline as _force_offline

_force_offline()  # local files only, whatever HF_*_OFFLINE say (mia.offline)
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__version__ = "0.1.0"
