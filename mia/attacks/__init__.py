"""Membership inference attacks. Every score: HIGHER = MORE LIKELY MEMBER. See ``registry`` for how to add one."""
from .context import AttackContext, assert_disjoint
from .registry import REGISTRY, AttackError, AttackSpec, available, get, parse_attack, parse_attacks, register

__all__ = ["AttackContext", "AttackError", "AttackSpec", "REGISTRY", "assert_disjoint", "available", "get",
           "parse_attack", "parse_attacks", "register"]
