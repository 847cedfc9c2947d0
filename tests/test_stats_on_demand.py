"""Statistics on demand: a run computes only the token statistics its attacks read, with the same bits as the
all-statistics pass; the score cache serves any subset of what a part holds and recomputes what it lacks; and an
attack written in a module of one's own is a first-class attack (``mia attacks``, ``mia.score``, the cache)."""
from __future__ import annotations

import importlib.util
import json
import textwrap

import numpy as np
import pytest

from mia.engine.batching import ScoringSettings
from mia.engine.loop import compute_token_stats
from mia.engine.stats import STAT_NAMES

LENGTHS = [5, 40, 17, 3, 64, 33, 8, 21]


def _lists(vocab, lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).astype(np.int32) for n in lengths]


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_the_logprob_only_pass_has_the_all_statistics_bits(tiny_model, pack):
    seqs = _lists(tiny_model.vocab_size)
    s = ScoringSettings(progress=False, token_budget=128, pack=pack)
    only = compute_token_stats(tiny_model, seqs, s, stats=("logprob",))
    every = compute_token_stats(tiny_model, seqs, s)
    moments = compute_token_stats(tiny_model, seqs, s, stats=("std_logp", "mean_logp"))
    for a, b, c in zip(only, every, moments):
        assert sorted(a) == ["logprob"] and sorted(b) == sorted(STAT_NAMES) and sorted(c) == ["mean_logp", "std_logp"]
        np.testing.assert_array_equal(a["logprob"], b["logprob"])
        np.testing.assert_array_equal(c["mean_logp"], b["mean_logp"])
    with pytest.raises(ValueError, match="subset of logprob"):
        compute_token_stats(tiny_model, seqs, s, stats=("logprobs",))


def _scores(model, rows, attack, stat_names):
    from mia.api import run_attacks
    from mia.attacks import AttackContext
    from mia.attacks.registry import parse_attacks
    from mia.data.examples import Example

    examples = [Example(str(i), tokens=t, text=" ".join(map(str, t.tolist()))) for i, t in enumerate(rows)]
    ctx = AttackContext(model, examples, ScoringSettings(progress=False), stat_names=stat_names)
    scores, _ = run_attacks(ctx, parse_attacks(attack), {}, progress=False)
    return scores[attack], ctx


@pytest.mark.parametrize("attack", ["loss", "loss:skip_eos=true", "mink", "minkpp", "zlib", "surp"])
def test_every_stats_attack_scores_the_same_bits_on_demand(tiny_model, attack):
    """Each attack alone (the run computes what it declares) against the same attack on the all-statistics pass."""
    from mia.attacks.registry import get, parse_attacks

    rows = _lists(tiny_model.vocab_size, seed=3)
    rows[2][5] = tiny_model.config.eos_token_id  # an inner end-of-document target for skip_eos
    demand, ctx = _scores(tiny_model, rows, attack, None)
    every, _ = _scores(tiny_model, rows, attack, STAT_NAMES)
    name = parse_attacks(attack)[0][1]
    assert ctx.stat_names == get(name).model_stats and sorted(ctx.stats()[0]) == sorted(get(name).model_stats)
    np.testing.assert_array_equal(demand, every)


def test_an_attack_that_reads_what_it_did_not_declare_is_told_so(tiny_model):
    rows = _lists(tiny_model.vocab_size)
    _, ctx = _scores(tiny_model, rows, "mink", None)
    with pytest.raises(KeyError, match="'entropy' was not computed in this run.*stats="):
        ctx.padded()["entropy"]


def test_the_cache_serves_subsets_and_recomputes_supersets(tiny_model, tmp_path, monkeypatch):
    """A logprob-only part serves logprob; a request for more recomputes those examples whole (a new part with the
    statistics asked for), which then serves any subset; nothing is ever served from a part that lacks a column."""
    import mia.engine.loop as loop

    seqs = _lists(tiny_model.vocab_size)
    s = ScoringSettings(progress=False, cache_dir=str(tmp_path), token_budget=128)
    real, passes = loop.jitted_token_stats, []

    def counting(model, *args):
        fn, stats = real(model, *args), args[-1] if len(args) > 1 else STAT_NAMES
        return lambda *a: passes.append(stats) or fn(*a)

    monkeypatch.setattr(loop, "jitted_token_stats", counting)

    def parts():
        return sorted(tuple(json.loads(p.read_text())["stats"]) for p in tmp_path.rglob("part-*.json"))

    first = compute_token_stats(tiny_model, seqs, s, stats=("logprob",))
    assert set(passes) == {("logprob",)} and set(parts()) == {("logprob",)}
    passes.clear()
    every = compute_token_stats(tiny_model, seqs, s, stats=("logprob", "mean_logp", "std_logp", "entropy"))
    assert set(passes) == {STAT_NAMES} and set(parts()) == {("logprob",), STAT_NAMES}
    passes.clear()
    again = compute_token_stats(tiny_model, seqs, s, stats=("logprob",))
    sub = compute_token_stats(tiny_model, seqs, s, stats=("mean_logp", "std_logp"))
    assert passes == []  # both served from the parts on disk
    for a, b, c, d in zip(first, every, again, sub):
        np.testing.assert_array_equal(a["logprob"], b["logprob"])
        np.testing.assert_array_equal(c["logprob"], b["logprob"])
        assert sorted(d) == ["mean_logp", "std_logp"]
        np.testing.assert_array_equal(d["std_logp"], b["std_logp"])


TOY = '''
import jax.numpy as jnp

from mia.attacks.registry import register_stats


@register_stats("toy_confidence", stats=("entropy",), scale=1.0)
def toy_confidence(entropy_bl, mask_bl, *, scale=1.0):
    """Minus the largest token entropy (a confident model everywhere: member), times scale."""
    return -scale * jnp.max(jnp.where(mask_bl, entropy_bl, -jnp.inf), axis=1)
'''


def test_a_toy_attack_in_a_module_of_ones_own(tiny_model, tmp_path, monkeypatch, capsys):
    """Written in a temporary file, it is listed by ``mia attacks``, scored by ``mia.score`` (against a NumPy
    reference on the all-statistics pass), and its run computes (and caches) the pass its declaration asks for: a
    moment, so every statistic, where a log-prob-only attack's run computes the log-prob alone."""
    import mia
    import mia.attacks.registry
    from mia.attacks.registry import REGISTRY
    from mia.cli import main

    monkeypatch.setattr("mia.attacks.registry.REGISTRY", dict(REGISTRY))
    path = tmp_path / "my_attack.py"
    path.write_text(textwrap.dedent(TOY))
    spec = importlib.util.spec_from_file_location("my_attack", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))

    assert main(["attacks"]) == 0
    assert "toy_confidence" in capsys.readouterr().out
    rows = _lists(tiny_model.vocab_size, seed=5)
    data = [{"id": str(i), "tokens": t.tolist(), "label": i % 2} for i, t in enumerate(rows)]
    cache = tmp_path / "cache"
    run = mia.score(tiny_model, data, attacks="toy_confidence:scale=2", cache_dir=str(cache), progress=False)
    every = compute_token_stats(tiny_model, rows, ScoringSettings(progress=False))
    want = [-2.0 * float(np.max(s["entropy"])) for s in every]
    np.testing.assert_allclose(run.scores["toy_confidence:scale=2"], want, rtol=1e-6)
    assert {tuple(json.loads(p.read_text())["stats"]) for p in cache.rglob("part-*.json")} == {STAT_NAMES}
    assert REGISTRY is not mia.attacks.registry.REGISTRY and "toy_confidence" not in REGISTRY
