"""The supervised combiner: trained on the labelled train partition only, never on a scored row."""
import dataclasses

import numpy as np
import pytest

import mia.blind.classifiers as C
from mia.attacks import AttackContext, AttackError, AttackInputs, check_attack_inputs, get, parse_attack
from mia.attacks.registry import REGISTRY, register

from attack_helpers import SETTINGS, make_examples


@pytest.fixture(scope="module")
def parts(tiny_model):
    tok = tiny_model.tokenizer
    evaluated = make_examples(tok, 8, 0)
    train = make_examples(tok, 12, 1, partition="train", prefix="t")
    return evaluated, train


@pytest.fixture
def probe():
    """A registered attack that records the example ids of every context it scores (its score: the token count)."""
    seen = []

    def fn(ctx):
        seen.append([e.id for e in ctx.examples])
        return np.array([len(e.tokens) for e in ctx.examples], np.float64)

    register("probe_rows", needs=("stats",), stats=("logprob",))(fn)
    yield seen
    REGISTRY.pop("probe_rows")


def run(model, evaluated, train, attacks="loss+zlib+probe_rows", classifier="lr"):
    ctx = AttackContext(model, list(evaluated), SETTINGS, {"train": list(train)}, {"seed": 0})
    return get("combine").fn(ctx, attacks=attacks, classifier=classifier)


def test_trains_on_train_rows_and_scores_the_evaluated(tiny_model, parts, probe, monkeypatch):
    evaluated, train = parts
    calls = []
    real = C.fit_predict

    def spy(name, x_train, y_train, x_eval, *, seed=0):
        calls.append((np.array(x_train), np.array(y_train), np.array(x_eval)))
        return real(name, x_train, y_train, x_eval, seed=seed)

    monkeypatch.setattr(C, "fit_predict", spy)
    scores = run(tiny_model, evaluated, train)
    assert scores.shape == (len(evaluated),) and ((0 <= scores) & (scores <= 1)).all()
    # the probe saw the train rows once and the evaluated rows once: disjoint sets, nothing else
    assert sorted(map(sorted, probe)) == sorted([sorted(e.id for e in train), sorted(e.id for e in evaluated)])
    (x_train, y, x_eval), = calls
    assert list(y) == [e.label for e in train]
    # the columns are the attacks' own scores of those rows
    for rows, x in ((train, x_train), (evaluated, x_eval)):
        ctx = AttackContext(tiny_model, list(rows), SETTINGS, {}, {"seed": 0})
        for j, name in enumerate(("loss", "zlib")):
            np.testing.assert_allclose(x[:, j], get(name).fn(ctx, **get(name).defaults), rtol=1e-6)
        assert list(x[:, 2]) == [len(e.tokens) for e in rows]


def test_scored_labels_are_never_read(tiny_model, parts, probe):
    evaluated, train = parts
    base = run(tiny_model, evaluated, train, classifier="rf")
    poisoned = [dataclasses.replace(e, label=1 - e.label) for e in evaluated]
    np.testing.assert_array_equal(run(tiny_model, poisoned, train, classifier="rf"), base)
    flipped = [dataclasses.replace(e, label=1 - e.label) if i < 4 else e for i, e in enumerate(train)]
    assert not np.array_equal(run(tiny_model, evaluated, flipped, classifier="rf"), base)  # train labels count


def test_refusals(tiny_model, parts):
    evaluated, train = parts
    with pytest.raises(AttackError, match="camia_lr learns from the train partition"):
        check_attack_inputs("combine", *parse_attack("combine:attacks=loss+camia_lr"), AttackInputs())
    with pytest.raises(AttackError, match="unknown attack 'nope'"):
        run(tiny_model, evaluated, train, attacks="loss+nope")
    with pytest.raises(AttackError, match="both members and non-members"):
        run(tiny_model, evaluated, [e for e in train if e.label == 1], attacks="loss")


@pytest.mark.slow
def test_gradient_features_and_jl_end_to_end(tiny_model, parts):
    """combine over gradnorm's per-tensor norms and jl's projections; jl's own classifier; both P(member)."""
    from mia.attacks import gradients as G

    evaluated, train = parts
    n_tensors = len(G.tensor_names(tiny_model.params, tiny_model.module.LAYERS))
    ctx = AttackContext(tiny_model, list(evaluated), SETTINGS, {"train": list(train)}, {"seed": 0})
    from mia.attacks.combine import columns

    assert columns(ctx, "gradnorm", train, False).shape == (len(train), n_tensors * 3)
    assert columns(ctx, "jl", evaluated, True).shape == (len(evaluated), n_tensors * 8)
    for name, params in (("combine", dict(attacks="loss+gradnorm+jl", classifier="lr")),
                         ("jl", dict(get("jl").defaults))):
        s = get(name).fn(ctx, **params)
        assert s.shape == (len(evaluated),) and ((0 <= s) & (s <= 1)).all()
