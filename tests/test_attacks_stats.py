"""Min-K%, Min-K%++, zlib: each registered attack against a plain NumPy/Python version of docs/algorithms.md."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from mia.attacks import AttackContext, AttackError, get, mink as mink_mod, parse_attack
from mia.data.examples import Example

from attack_helpers import SETTINGS, ctx_with, make_examples, stat_examples
from hf_tiny import log_softmax


# ---------------------------------------------------------------------------------------------- references
def ref_mink(lp, k):
    vals = sorted(float(v) for v in lp)
    kn = max(1, int(len(vals) * k))
    total = 0.0
    for v in vals[:kn]:
        total += v
    return total / kn


def ref_minkpp(s, k):
    z = [(float(l) - float(m)) / float(sd) for l, m, sd in zip(s["logprob"], s["mean_logp"], s["std_logp"])]
    return ref_mink(z, k)


def ref_ll(lp):
    return sum(float(v) for v in lp) / len(lp)


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("k", [0.1, 0.2, 0.5, 0.7, 1.0])
def test_mink_matches_reference(k):
    examples, stats = stat_examples()
    got = get("mink").fn(ctx_with(examples, stats), k=k)
    want = [ref_mink(s["logprob"], k) for s in stats]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_mink_small_k_takes_the_single_lowest():
    examples, stats = stat_examples(lengths=(1, 3, 4))
    got = get("mink").fn(ctx_with(examples, stats), k=0.2)  # 0.2 * 4 = 0.8 < 1 -> k_n = 1
    np.testing.assert_allclose(got, [float(np.min(s["logprob"])) for s in stats], rtol=1e-6)


def test_mink_k_count_is_exact_float64_floor():
    # float32 0.7 * 10 would be 6.9999998; the reference's int(10 * 0.7) = 7 (0.7*10 = 7.000000000000001 in float64)
    assert mink_mod.k_count_table(0.7, 10)[10] == int(10 * 0.7) == 7
    assert mink_mod.k_count_table(0.29, 100)[100] == int(100 * 0.29) == 28  # 28.999999999999996
    assert list(mink_mod.k_count_table(0.2, 6)) == [1, 1, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("k", [0.1, 0.2, 1.0])
def test_minkpp_matches_reference(k):
    examples, stats = stat_examples(seed=1)
    got = get("minkpp").fn(ctx_with(examples, stats), k=k)
    want = [ref_minkpp(s, k) for s in stats]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_zlib_matches_reference():
    examples, stats = stat_examples(seed=2)
    ctx = ctx_with(examples, stats)
    got = get("zlib").fn(ctx)
    want = [ref_ll(s["logprob"]) / len(zlib.compress(e.text.encode("utf-8"))) for e, s in zip(examples, stats)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    ent = get("zlib_entropy").fn(ctx)
    # CheckMIABench's "Zlib" in the paper's orientation (tests/test_attacks_context.py checks it against pandora's rule)
    np.testing.assert_array_equal(ent, [len(zlib.compress(e.text.encode("utf-8"))) for e in examples])


def test_zlib_decodes_token_only_examples(tiny_model):
    tok = tiny_model.tokenizer
    text = "def wrap(text, width=70):\n    return text"
    ids = np.asarray(tok(text)["input_ids"], np.int32)
    ex = Example("t", ids)  # no text: decoded with the model tokenizer
    lp = np.linspace(-3, -1, len(ids) - 1).astype(np.float32)
    ctx = ctx_with([ex], [{"logprob": lp, "mean_logp": lp, "std_logp": lp, "entropy": lp}], model=tiny_model)
    want = ref_ll(lp) / len(zlib.compress(tok.decode(ids.tolist()).encode("utf-8")))
    np.testing.assert_allclose(get("zlib").fn(ctx), [want], rtol=1e-5)
    assert any("decoded" in n for n in ctx.notes)


@pytest.mark.parametrize("name,params", [("mink", {"k": 0.2}), ("minkpp", {"k": 0.2}), ("zlib", {})])
def test_batching_invariance(name, params):
    examples, stats = stat_examples(seed=3)
    batch = get(name).fn(ctx_with(examples, stats), **params)
    for i in range(len(examples)):
        alone = get(name).fn(ctx_with(examples[i:i + 1], stats[i:i + 1]), **params)
        np.testing.assert_allclose(alone, batch[i:i + 1], rtol=1e-6, atol=1e-7)


def test_mink_second_batch_of_another_length_does_not_recompile():
    pure = get("mink").pure
    assert pure is mink_mod.min_k  # the registered object is the pure jitted function
    a, sa = stat_examples(seed=4, lengths=(20, 25, 19))
    b, sb = stat_examples(seed=5, lengths=(30, 17, 9, 12))  # other size and max length, same power-of-two buckets
    get("mink").fn(ctx_with(a, sa), k=0.3)
    compiled = pure._cache_size()
    get("mink").fn(ctx_with(b, sb), k=0.3)
    assert pure._cache_size() == compiled
    get("mink").fn(ctx_with(b[:1], sb[:1]), k=0.3)  # another row bucket: one more program
    assert pure._cache_size() == compiled + 1


def test_bad_parameters_list_the_valid_ones():
    with pytest.raises(AttackError, match="valid parameters: k"):
        parse_attack("mink:kk=0.1")
    with pytest.raises(AttackError, match="expected a float"):
        parse_attack("minkpp:k=abc")
    examples, stats = stat_examples()
    with pytest.raises(AttackError, match=r"k must be in \(0, 1\]"):
        get("mink").fn(ctx_with(examples, stats), k=0.0)


# ------------------------------------------------------------------------------------------------ LOSS without EOS
def test_loss_and_zlib_skip_eos_targets(tiny_model, ref_logits):
    tok = tiny_model.tokenizer
    eos = int(tiny_model.config.eos_token_id)
    data = make_examples(tok, 4, 5, words=(6, 10))
    for i in (0, 2):  # an end-of-document token inside and at the end of two texts
        t = data[i].tokens
        data[i] = Example(data[i].id, np.concatenate([t[:3], [eos], t[3:], [eos]]).astype(np.int32), None, 1)
    data.append(Example("alleos", np.array([5, eos, eos], np.int32), None, 0))
    ctx = AttackContext(tiny_model, data, SETTINGS, {}, {})

    def ref(seq, skip):
        lp = log_softmax(ref_logits(seq))
        terms = [lp[i - 1, seq[i]] for i in range(1, len(seq)) if not (skip and seq[i] == eos)]
        return np.mean(terms) if terms else np.nan

    for skip in (False, True):
        want = np.array([ref(e.tokens, skip) for e in data])
        np.testing.assert_allclose(get("loss").fn(ctx, skip_eos=skip), want, rtol=1e-5, equal_nan=True)
        z = np.array([len(__import__("zlib").compress(t.encode())) for t in ctx.texts()])
        np.testing.assert_allclose(get("zlib").fn(ctx, skip_eos=skip), want / z, rtol=1e-5, equal_nan=True)
    assert np.isnan(get("loss").fn(ctx, skip_eos=True)[-1])
