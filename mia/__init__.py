"""mia: membership inference attacks on language models, in JAX/Flax.

    import mia
    model = mia.load("path/to/model")
    run = mia.score(model, "data.jsonl", attacks="loss,mink:k=0.2,zlib")
    print(run.metrics())

Score convention everywhere: higher = more likely member. Labels: 1 = member, 0 = non-member.
"""
import os as _os
import sys as _sys
import types as _types

from .offline import force_offline as _force_offline

_force_offline()  # local files only, whatever HF_*_OFFLINE say (mia.offline)
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from .version import __version__  # noqa: E402,F401
__all__ = ["load", "score", "ScoreRun", "doctor"]


def __getattr__(name):
    # ``mia.load`` / ``mia.score`` / ``mia.doctor`` import jax and the engine on first use, not on ``import mia``: the
    # CLI's --help and ``mia plan --topology`` (which must set JAX_PLATFORMS before jax is imported) start without them.
    if name in __all__:
        from . import api  # lazily: ``import mia`` stays light (see above)

        return getattr(api, name)
    raise AttributeError(f"module 'mia' has no attribute {name!r}")


class _Namespace(_types.ModuleType):
    """The package object's class: the API names of ``__all__`` are never bound to a submodule.

    ``mia.doctor`` is the function ``mia.api.doctor``, and ``mia/doctor.py`` is the module of its checks. Importing
    a submodule binds it as an attribute of its package, which would make ``mia.doctor`` the module from then on;
    here that binding is refused, so ``mia.doctor`` stays the function (``__getattr__`` above). The module is
    ``sys.modules["mia.doctor"]``: ``from mia.doctor import CHECKS`` or ``importlib.import_module("mia.doctor")``.
    """

    def __setattr__(self, name, value):
        if name in __all__ and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Namespace
