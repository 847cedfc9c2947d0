"""Whether this environment already has every requirement of this checkout's setup.py (what `make setup` installs).

    python -m tests.install_check [EXTRA ...]     # default extra: test; exit 0 = all met, 1 = one line naming the first

`make setup` asks this first: when every requirement is met it re-installs only mia itself (editable, ``--no-deps``:
about 3 s), otherwise it runs the full ``pip install -e ".[test]"``, which re-checks every requirement through pip's
resolver (about 8 s even when nothing is missing). The requirements are read from setup.py as it is now (its
``setup()`` call is captured, never run), so a dependency added to setup.py and not yet installed is installed by the
next `make setup`, and a missing one fails CI exactly as before.
"""
from __future__ import annotations

import os
import runpy
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]


def declared_requirements(setup_py: Path = ROOT / "setup.py", extras=("test",)) -> list[str]:
    """The requirement strings ``setup.py`` passes to ``setup()`` (install_requires and the given extras), read by
    running the file with ``setuptools.setup`` replaced by a function that records its arguments."""
    import setuptools

    captured: dict = {}
    real_setup, cwd = setuptools.setup, os.getcwd()
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    try:
        os.chdir(setup_py.parent)  # setup.py opens README.md relative to itself
        runpy.run_path(str(setup_py), run_name="__main__")
    finally:
        setuptools.setup = real_setup
        os.chdir(cwd)
    reqs = list(captured.get("install_requires", []))
    for extra in extras:
        reqs += list(captured.get("extras_require", {}).get(extra, []))
    return reqs


def first_unmet(requirements: list[str], extras=("test",)) -> Optional[str]:
    """The first requirement that is not installed at a version its specifier allows (markers evaluated for this
    interpreter and ``extras``), as one line; None when every one is met."""
    from packaging.requirements import Requirement

    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras or ("",)):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            return f"{req.name} is not installed ({text})"
        if not req.specifier.contains(version, prereleases=True):
            return f"{req.name} {version} is installed; setup.py asks for {text}"
    return None


def main(argv=None) -> int:
    extras = tuple((sys.argv[1:] if argv is None else argv) or ("test",))
    try:
        unmet = first_unmet(declared_requirements(extras=extras), extras)
    except Exception as e:  # no setuptools or packaging, an unreadable setup.py: let pip decide
        unmet = f"cannot check ({type(e).__name__}: {e})"
    if unmet:
        print(f"install_check: {unmet}; running the full pip install", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
