"""Membership inference attacks. Every score: HIGHER = MORE LIKELY MEMBER.

One module per attack (or family of attacks); each registers itself (``registry.register`` / ``register_stats``)
when this package is imported, which happens before any use of the registry. Adding an attack: one module here and
one test module (``docs/attacks.md``, "Writing an attack").
"""
import importlib as _importlib
import pkgutil as _pkgutil

from .context import AttackContext, assert_disjoint
from .registry import (COSTS, REGISTRY, AttackError, AttackInputs, AttackSpec, available, check_attack_inputs, get,
                       parse_attack, parse_attacks, register, register_stats)

__all__ = ["AttackContext", "AttackError", "AttackInputs", "AttackSpec", "COSTS", "REGISTRY", "assert_disjoint",
           "available", "check_attack_inputs", "get", "parse_attack", "parse_attacks", "register", "register_stats"]

for _mod in _pkgutil.iter_modules(__path__):  # every attack module registers itself on import
    if not _mod.name.startswith("_") and _mod.name not in ("registry", "context", "catalog"):
        _importlib.import_module(f"{__name__}.{_mod.name}")
