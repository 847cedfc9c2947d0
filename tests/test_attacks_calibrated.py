"""lowercase, surp, dcpdd, pac: each registered attack against a plain NumPy / Python reference."""
from __future__ import annotations

import math
import types

import numpy as np
import pytest

from mia.attacks import AttackContext, AttackError, get, pac as P, parse_attack
from mia.data.examples import Example, tokenize_examples

from attack_helpers import SETTINGS, ctx_with, stat_examples
from hf_tiny import log_softmax


# ------------------------------------------------------------------------------------------------ surp
def ref_surp(lp, ent, k, max_entropy):
    n = len(lp)
    kn = max(1, int(n * k))
    lowest = sorted(range(n), key=lambda i: (float(lp[i]), i))[:kn]
    chosen = [i for i in lowest if float(ent[i]) < max_entropy]
    return sum(float(lp[i]) for i in chosen) / len(chosen) if chosen else 0.0


@pytest.mark.parametrize("k,max_entropy", [(0.4, 2.0), (0.2, 1.5), (0.4, 1e-3)])
def test_surp_matches_reference(k, max_entropy):
    examples, stats = stat_examples(seed=3)
    ctx = ctx_with(examples, stats)
    got = get("surp").fn(ctx, **parse_attack(f"surp:k={k},max_entropy={max_entropy}")[1])
    want = [ref_surp(s["logprob"], s["entropy"], k, max_entropy) for s in stats]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if max_entropy < 0.01:  # nobody is confident: every score is the documented empty value, and it is said
        assert (got == 0.0).all() and any("no surprising token" in n for n in ctx.notes)
    with pytest.raises(AttackError, match="k must be in"):
        get("surp").fn(ctx, k=0.0, max_entropy=2.0)


# ------------------------------------------------------------------------------------------------ dcpdd
def ref_dcpdd(tokens, lp, docs, vocab, a):
    counts = [0] * vocab
    for d in docs:
        for t in list(d)[:1024]:
            counts[int(t)] += 1
    total = sum(counts)
    seen, ce = [], []
    for t, l in zip(tokens[1:], lp):
        if int(t) in seen:
            continue
        seen.append(int(t))
        f = (counts[int(t)] + 1) / (total + vocab)
        ce.append(min(math.exp(float(l)) * math.log(1 / f), a))
    return sum(ce) / len(ce)


def _vocab_model(v):
    return types.SimpleNamespace(vocab_size=v, tokenizer=None, max_length=1 << 16)


@pytest.mark.parametrize("a", [0.01, 0.5, 10.0])
def test_dcpdd_matches_reference_with_corpus_and_calib(a):
    examples, stats = stat_examples(seed=4)
    rng = np.random.default_rng(9)
    # skewed frequencies, one document longer than the 1024 counted tokens
    docs = [rng.choice(11, size=n, p=np.arange(1, 12) / 66).astype(np.int32) for n in (5, 40, 1500)]
    ctx = ctx_with(examples, stats, _vocab_model(11))
    ctx.options["freq_corpus"] = docs
    got = get("dcpdd").fn(ctx, a=a)
    want = [ref_dcpdd(e.tokens, s["logprob"], docs, 11, a) for e, s in zip(examples, stats)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # without a corpus: the calib partition's non-members
    ctx = ctx_with(examples, stats, _vocab_model(11))
    ctx.partitions["calib"] = [Example(f"c{i}", d, label=0, partition="calib") for i, d in enumerate(docs)]
    np.testing.assert_allclose(get("dcpdd").fn(ctx, a=a), want, rtol=1e-5, atol=1e-7)


def test_dcpdd_refuses_bad_corpora():
    examples, stats = stat_examples(seed=4)

    def run(docs, vocab=11):
        ctx = ctx_with(examples, stats, _vocab_model(vocab))
        if docs is not None:
            ctx.options["freq_corpus"] = docs
        return get("dcpdd").fn(ctx, a=0.01)

    with pytest.raises(AttackError, match="shares no token with the model's vocabulary"):
        run([np.array([50, 60, 70])])
    with pytest.raises(AttackError, match="outside the model's vocabulary"):
        run([np.array([1, 2, 70])])
    with pytest.raises(AttackError, match="shares no token with the evaluated examples"):
        run([np.array([20, 21])], vocab=30)
    with pytest.raises(AttackError, match="holds no token"):
        run([])
    with pytest.raises(AttackError, match="--freq-corpus FILE"):
        run(None)


def test_freq_corpus_reader_and_cli_error(tiny_model, tiny_neox_dir, tmp_path, capsys):
    from mia.cli import main
    from mia.data.freq_corpus import read_corpus

    tok = tiny_model.tokenizer
    text = tmp_path / "corpus.txt"
    text.write_text("import os\n\nreturn self.value\n")
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text('{"text": "import os"}\n{"tokens": [3, 4, 5]}\n')
    got = [d.tolist() for d in read_corpus(text, tok, tiny_model.vocab_size)]
    assert got == [tok("import os")["input_ids"], tok("return self.value")["input_ids"]]
    got = [d.tolist() for d in read_corpus(jsonl, tok, tiny_model.vocab_size)]
    assert got == [tok("import os")["input_ids"], [3, 4, 5]]
    # the CLI reads --freq-corpus before scoring: an id outside the vocabulary is one error line naming file:line
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "text": "def f(x): return x", "label": 1}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2]}\n{"tokens": [3, 99999]}\n')
    capsys.readouterr()
    assert main(["score", "--model", str(tiny_neox_dir), "--data", str(data), "--attacks", "dcpdd", "--no-cache",
                 "--freq-corpus", str(bad), "--out", str(tmp_path / "s.jsonl"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad}:2" in err[0] and "outside the model vocabulary" in err[0]


# ------------------------------------------------------------------------------------------------ model-calling
MIXED = ("The Data model Train member Loss token TEXT line File value of and to In is That for it As with").split()


@pytest.fixture(scope="module")
def cased(tiny_model):
    # 4 texts of <= 32 tokens, n = 4 copies: the engine shapes test_attacks_model's neighbor test compiles too
    rng = np.random.default_rng(5)
    ex = [Example(f"x{i}", text=" ".join(rng.choice(MIXED, int(rng.integers(3, 8)))), label=i % 2)
          for i in range(4)]
    ex = tokenize_examples(ex, tiny_model.tokenizer, 256)
    assert all(len(e.tokens) <= 32 and len(tiny_model.tokenizer(e.text.lower())["input_ids"]) <= 32 for e in ex)
    return ex


def _ctx(model, examples, **options):
    return AttackContext(model, list(examples), SETTINGS, {}, {"seed": 0, **options})


def np_lp(ref_logits, seq):
    lp = log_softmax(ref_logits(np.asarray(seq)))
    return np.array([lp[i - 1, seq[i]] for i in range(1, len(seq))])


def test_lowercase_matches_numpy(tiny_model, cased, ref_logits):
    got = get("lowercase").fn(_ctx(tiny_model, cased))
    tok = tiny_model.tokenizer
    want = [-np_lp(ref_logits, e.tokens).mean() / np_lp(ref_logits, tok(e.text.lower())["input_ids"]).mean()
            for e in cased]
    np.testing.assert_allclose(got, want, rtol=2e-4)


def ref_swaps(items, n_swaps, rng):
    """EDA's swap_word loop as written in the PAC repository (second index redrawn while equal, at most 3 draws)."""
    new = list(items)
    for _ in range(n_swaps):
        i = int(rng.integers(len(new)))
        j, draws = i, 0
        while j == i and draws < 3:
            j, draws = int(rng.integers(len(new))), draws + 1
        if j != i:
            new[i], new[j] = new[j], new[i]
    return new


def test_pac_augmentation_is_eda_swap_and_seeded():
    words = "a b c d e f g h i j".split()
    for seed in range(5):
        got = P.augment_words(" ".join(words), n=4, alpha=0.3, rng=np.random.default_rng(seed))
        rng = np.random.default_rng(seed)
        want = [" ".join(ref_swaps(words, max(1, int(0.3 * 10)), rng)) for _ in range(4)]
        assert got == want and all(sorted(g.split(" ")) == words for g in got)
    assert P.random_swaps(["only"], 3, np.random.default_rng(0)) == ["only"]
    toks = P.augment_tokens(np.arange(20, dtype=np.int32), n=2, alpha=0.3, rng=np.random.default_rng(1))
    assert all(sorted(t.tolist()) == list(range(20)) and (t != np.arange(20)).sum() <= 12 for t in toks)


def ref_pd(lp, k_max=0.05, k_min=0.3):
    s = np.sort(np.asarray(lp, np.float64))
    return s[::-1][:max(1, int(len(s) * k_max))].mean() - s[:max(1, int(len(s) * k_min))].mean()


@pytest.mark.parametrize("augment", ["words", "tokens"])
def test_pac_matches_numpy(tiny_model, cased, ref_logits, augment):
    ctx = _ctx(tiny_model, cased)
    got = get("pac").fn(ctx, n=4, alpha=0.3, k_max=0.05, k_min=0.3, augment=augment)
    copies = P.augmented_sequences(_ctx(tiny_model, cased), n=4, alpha=0.3, augment=augment)
    want = [np.mean([ref_pd(np_lp(ref_logits, c)) for c in cs]) - ref_pd(np_lp(ref_logits, e.tokens))
            for e, cs in zip(cased, copies)]
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    # a score does not depend on the example's position or its neighbours
    again = get("pac").fn(_ctx(tiny_model, cased[::-1]), n=4, alpha=0.3, k_max=0.05, k_min=0.3, augment=augment)
    np.testing.assert_allclose(again, got[::-1], rtol=1e-5)
    if augment == "words":  # the copies are word swaps of the text, re-tokenized
        assert all(sorted(tiny_model.tokenizer.decode(c.tolist()).split(" ")) == sorted(e.text.split(" "))
                   for e, cs in zip(cased, copies) for c in cs)


def test_pac_refuses_unknown_augmentation(tiny_model, cased):
    with pytest.raises(AttackError) as e:  # when --attacks is parsed (limits=), before any model is loaded
        parse_attack("pac:augment=synonyms")
    assert str(e.value) == "attack pac, parameter augment: must be one of words, tokens; got 'synonyms'"
    with pytest.raises(AttackError) as e:  # and by the attack itself, called directly
        get("pac").fn(_ctx(tiny_model, cased), **dict(parse_attack("pac")[1], augment="synonyms"))
    assert str(e.value) == "attack pac: unknown augmentation 'synonyms'; valid: words, tokens"


# ------------------------------------------------------------------------------------------------ the dial
@pytest.mark.slow
def test_calibrated_attacks_detect_the_memorization_dial(smoke_testbed, tmp_path):
    """On the smoke dial split (test_checkmia's: same members, seed and partitions, so the dial checkpoint and the
    token-stats cache are shared), each of the four attacks sees the memorized members. surp's default entropy
    threshold (2 nats, tuned on LLMs) leaves most smoke texts without a surprising token (docs/attacks.md): its
    default gets a weaker bar, and the threshold at the smoke model's entropy scale (4 nats) the full one. Slow:
    pac's 10 extra passes over 200 texts (~1-3 min on 2 busy cores)."""
    from experiments.checkmia import run

    attacks = "lowercase,surp,surp:max_entropy=4.0,dcpdd,pac"
    s = run("smoke", tmp_path / "dial", testbed_dir=smoke_testbed.root, attacks=attacks, blind=False, bootstrap=100,
            memorize_epochs=8, n_members=100, n_train=0, n_calib=30, n_prefix=4, seed=1, progress=False)
    auc = {r["method"]: r["auc"] for r in s["rows"] if r["kind"] == "attack"}
    print("dial AUCs:", auc)
    assert set(auc) == {"lowercase", "surp", "surp:max_entropy=4.0", "dcpdd", "pac"}, s["skipped"]
    assert auc.pop("surp") >= 0.6 and all(a >= 0.75 for a in auc.values()), auc
