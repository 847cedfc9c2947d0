"""What every command-line entry point shares (``mia``, ``python -m mia.testbed``, ``python -m experiments.*``).

``run_for_user(fn)`` runs a command: a user-input error (a ``ValueError`` subclass with a one-line message, raised at
the edge by ``mia.validate`` and friends) is printed as one ``error: ...`` line with exit status 2; Ctrl-C prints
what was kept and gives 130. It also turns on JAX's persistent compilation cache (``mia.engine.compile_cache``)
unless ``--no-compile-cache`` (``add_compile_cache_flag``) or ``MIA_COMPILE_CACHE=0`` says otherwise; an unusable
compilation cache directory is one ``warning:`` line, and the command runs without it.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

from .engine.compile_cache import enable_compile_cache

USER_ERRORS = (ValueError, FileNotFoundError, KeyError)  # raised with a one-line message about the user's input


def add_compile_cache_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not use the persistent XLA compilation cache (<cache dir>/xla; also "
                             "MIA_COMPILE_CACHE=0)")


def run_for_user(fn: Callable[[], object], *, debug: bool = False, on_interrupt: str = "interrupted",
                 compile_cache: bool = True, check_first: Optional[Callable[[], object]] = None):
    """(exit status, result) of ``fn()``: a user-input error prints one ``error: ...`` line and gives status 2
    (``debug`` re-raises it with its traceback); Ctrl-C prints ``on_interrupt`` and gives 130.

    ``check_first`` (the command's cache directories) runs before the compilation cache is set up, so a cache
    directory the command needs is reported as its one error line, not after a compilation-cache warning about
    the same directory."""
    try:
        if check_first is not None:
            check_first()
        enable_compile_cache(enabled=compile_cache)
        return 0, fn()
    except USER_ERRORS as e:
        if debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2, None
    except KeyboardInterrupt:
        print(on_interrupt, file=sys.stderr)
        return 130, None
