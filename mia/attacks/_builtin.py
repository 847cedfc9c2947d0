"""Imports every attack module in this package so that each registers itself."""
import importlib
import pkgutil

from . import __path__ as _path

for _mod in pkgutil.iter_modules(_path):
    if not _mod.name.startswith("_") and _mod.name not in ("registry", "context", "catalog"):
        importlib.import_module(f"{__package__}.{_mod.name}")
