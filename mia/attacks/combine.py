"""A supervised combiner: the scores and features of any attacks feed one classifier trained on --train-data only.
docs/algorithms.md#combine.

  combine:attacks=loss+zlib+gradnorm,classifier=lr

For each named attack, every example gets its columns: the attack's features where it registers some
(``register_features``: gradnorm's per-tensor norms, jl's projections), else its one score. The columns of the
labelled "train" partition's examples (label 0/1) train the classifier (``mia.blind.classifiers``: lr, rf, mlp, as
the blind stage trains them); the evaluated examples' columns are scored with it: P(member), HIGHER = MEMBER.

Never a scored row: the train partition is checked disjoint from the evaluated examples before any attack runs
(``assert_disjoint``), the classifier is fitted on train rows only, and the evaluated examples' labels are never
read. An attack that itself learns from the train partition (``needs`` "train": camia_lr, jl, combine) cannot be
combined, since its train-row columns would be fitted on those very rows; name its features instead (jl's are
registered).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from ..blind import classifiers as blind_classifiers
from .registry import AttackError, check_attack_inputs, get, register

FEATURES: dict[str, Callable] = {}  # attack name -> fn(ctx, examples, **params) -> [N, F] float
CLASSIFIERS = blind_classifiers.CLASSIFIER_NAMES  # lr, rf, mlp


def register_features(name: str, fn: Callable) -> Callable:
    """Register ``fn(ctx, examples, **the attack's params) -> [N, F]``: the features attack ``name`` offers the
    combiner in place of its one score."""
    FEATURES[name] = fn
    return fn


def labelled_rows(ctx, attack: str) -> tuple[list, np.ndarray]:
    """(the train partition's examples labelled 0/1, their labels [M]); an error unless both classes are there."""
    train = [e for e in (ctx.partitions.get("train") or []) if e.label in (0, 1)]
    y = np.array([e.label for e in train], np.int64)
    if not ((y == 1).any() and (y == 0).any()):
        raise AttackError(f"attack {attack} needs a labelled 'train' partition with both members and non-members "
                          f"(give --train-data FILE with label 0/1); got {int((y == 1).sum())} member(s), "
                          f"{int((y == 0).sum())} non-member(s)")
    return train, y


def supervised_scores(classifier: str, x_train, y_train, x_eval, seed: int = 0) -> np.ndarray:
    """P(member) [N] of the evaluated rows from ``classifier`` fitted on (x_train, y_train). Non-finite entries
    become 0 (a column the classifier cannot use), as pandora's nan_to_num does."""
    clean = lambda x: np.nan_to_num(np.asarray(x, np.float64), nan=0.0, posinf=0.0, neginf=0.0)  # noqa: E731
    try:
        return blind_classifiers.fit_predict(classifier, clean(x_train), np.asarray(y_train), clean(x_eval),
                                             seed=seed)
    except blind_classifiers.ClassifierError as e:
        raise AttackError(f"classifier {classifier}: {e}") from None


def parse_names(text: str) -> list[str]:
    """'loss+zlib+gradnorm' -> the attack names (each registered, none learning from the train partition)."""
    names = [n.strip() for n in text.split("+") if n.strip()]
    if not names:
        raise AttackError("attack combine: attacks must name at least one attack, e.g. attacks=loss+zlib")
    for n in names:
        spec = get(n)
        if "train" in spec.needs and n not in FEATURES:
            raise AttackError(f"attack combine: {n} learns from the train partition itself, so it cannot be "
                              f"combined (its train rows would be scored by a model fitted on them)")
    if len(set(names)) != len(names):
        raise AttackError(f"attack combine: an attack is named twice in {text!r}")
    return names


def columns(ctx, name: str, examples: list, evaluated: bool) -> np.ndarray:
    """[N, F] columns of attack ``name`` (default parameters) for ``examples``: its registered features, else its
    score computed on a context whose evaluated examples are ``examples`` (and nothing else changed)."""
    spec = get(name)
    if name in FEATURES:
        return np.asarray(FEATURES[name](ctx, examples, **spec.defaults), np.float64).reshape(len(examples), -1)
    sub = ctx if evaluated else dataclasses.replace(ctx, examples=list(examples), _stats=None, _padded=None)
    return np.asarray(spec.fn(sub, **spec.defaults), np.float64).reshape(len(examples), 1)


def _check_combine(params: dict, inputs) -> None:
    """Every combined attack is known, combinable and has the inputs it needs (before any model is loaded)."""
    for n in parse_names(params.get("attacks", "")):
        check_attack_inputs(f"combine/{n}", n, dict(get(n).defaults), inputs)


@register("combine", needs=("stats", "model", "train"), cost="heavy", check_inputs=_check_combine,
          cost_note="every combined attack runs on the train partition too",
          attacks="loss+zlib", classifier="lr", limits={"classifier": CLASSIFIERS})
def _combine(ctx, *, attacks: str, classifier: str) -> np.ndarray:
    """Supervised combiner: the named attacks' scores and features (attacks=a+b+...) feed a classifier trained on
    labelled --train-data only (higher = member)."""
    names = parse_names(attacks)
    train, y = labelled_rows(ctx, "combine")
    x_train = np.concatenate([columns(ctx, n, train, False) for n in names], axis=1)
    x_eval = np.concatenate([columns(ctx, n, ctx.examples, True) for n in names], axis=1)
    return supervised_scores(classifier, x_train, y, x_eval, ctx.seed)
