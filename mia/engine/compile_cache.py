"""JAX's persistent compilation cache under the mia cache dir, so a second run does not recompile the same programs.

Every command-line entry point (``mia ...``, ``python -m mia.testbed``, ``python -m experiments.*``) turns it on
through ``enable_compile_cache`` before anything compiles (``mia.entry.run_for_user`` does it). Compiled executables
go to ``<mia cache dir>/xla`` (``$MIA_CACHE_DIR`` or ``~/.cache/mia``; see ``mia.files.hashing.default_cache_dir``). JAX
keys
each entry by the program, the compile options, the backend and the jax/jaxlib versions, so an entry is never used
for another program or another jax.

Its files count towards the mia cache's size limit (``mia.files.cache_limit``): JAX is given the limit too, so that it
records when an entry is read (``<key>-atime``), and mia evicts the least recently used programs with the rest.

Opt out with ``MIA_COMPILE_CACHE=0`` (also ``false``/``no``/``off``) or a command's ``--no-compile-cache``.
The cache is optional: a directory that cannot be used (a regular file in its place, not writable, cannot be
created) gives one ``warning:`` line on stderr and the command runs without it.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional

from ..files import cache_limit
from ..files.hashing import default_cache_dir
from ..validate import InputError, output_dir

ENV_SWITCH = "MIA_COMPILE_CACHE"
# JAX's default (1 s) skips most scoring programs of small models on CPU; below ~0.2 s reading an entry back
# costs about what compiling does.
MIN_COMPILE_SECONDS = 0.2


def compile_cache_wanted(flag: bool = True) -> bool:
    """False when the caller's flag is off or ``$MIA_COMPILE_CACHE`` is 0/false/no/off."""
    return bool(flag) and os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def default_compile_cache_dir() -> Path:
    return Path(default_cache_dir()) / "xla"


def enable_compile_cache(cache_dir=None, *, enabled: bool = True,
                         min_compile_seconds: float = MIN_COMPILE_SECONDS) -> Optional[Path]:
    """Point JAX's persistent compilation cache at ``cache_dir`` (default ``<mia cache dir>/xla``); programs that
    took at least ``min_compile_seconds`` to compile are stored.

    Returns the directory, or None when switched off (``enabled`` False or ``$MIA_COMPILE_CACHE=0``) or when the
    directory cannot be used (one ``warning:`` line, see the module docstring). Call it before the first
    compilation of the process: JAX fixes the cache directory when it first compiles.
    """
    if not compile_cache_wanted(enabled):
        return None
    path = Path(cache_dir) if cache_dir is not None else default_compile_cache_dir()
    try:
        output_dir(path, "compilation cache directory")
        path.mkdir(parents=True, exist_ok=True)
    except (InputError, OSError) as e:
        reason = str(e) if isinstance(e, InputError) else f"compilation cache directory {path}: {e.strerror or e}"
        print(f"warning: {reason}; running without the persistent compilation cache "
              f"(set MIA_CACHE_DIR, or {ENV_SWITCH}=0 to silence this)", file=sys.stderr)
        return None
    import jax  # here, not at the top: the CLI imports this module before it needs jax (fast --help)

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    if importlib.util.find_spec("filelock") is not None:  # JAX records reads (``-atime`` files) only with a size
        jax.config.update("jax_compilation_cache_max_size", cache_limit.max_bytes())  # limit; it needs filelock
    return path
