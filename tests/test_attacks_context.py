"""Prefix attacks never run beyond the trained context (mia.attacks.fit); CheckMIABench's ReCaLL and Zlib orientation.

NumPy references on the smoke testbed (trained context 64, rows of 65 tokens, as Pythia's 2048 / 2049) and, slow, on
the tiny random GPT-NeoX (context 256) with targets as long as the context.
"""
import numpy as np
import pytest

import mia.engine.conditional as C
from mia.attacks import AttackError, em_mia as E, get
from mia.attacks.fit import prefix_room
from mia.data.examples import Example

from attack_helpers import ctx_for, make_examples, np_ll

CONTEXT = 256  # tiny_neox_dir's max_position_embeddings


def full_rows(n=6, seed=3, lengths=(200, 256)):
    """Token-id examples up to the whole context, the longest exactly CONTEXT tokens."""
    rng = np.random.default_rng(seed)
    lens = [CONTEXT] + [int(x) for x in rng.integers(*lengths, n - 1)]
    return [Example(f"r{i}", tokens=rng.integers(1, 300, L).astype(np.int32), label=i % 2) for i, L in enumerate(lens)]


@pytest.fixture
def longest_fed(monkeypatch):
    """Records the longest prefix + target the conditional engine is given."""
    seen = []
    real = C.loglik_matrix

    def spy(model, prefixes, targets, **kw):
        seen.append(max(len(p) for p in prefixes) + max(len(t) for t in targets))
        return real(model, prefixes, targets, **kw)

    for mod in ("mia.attacks.recall", "mia.attacks.em_mia"):
        monkeypatch.setattr(f"{mod}.loglik_matrix", spy)
    return seen


def test_prefix_room_rule():
    assert prefix_room(2048, 100, 500) == 500          # fits beside the longest target: unchanged
    assert prefix_room(2048, 1800, 500) == 500         # shortened targets: the prefix keeps up to half the context
    assert prefix_room(2048, 1700, 1500) == 1024       # ... shortened, but never below half (targets get cut)
    assert prefix_room(2048, 1700, 1000) == 1000       # ... or below its own length
    assert prefix_room(2048, 900, 2000) == 1148        # C - L when that is more than half
    assert prefix_room(2048, 2048, 2048) == 1024       # full rows: half and half
    assert prefix_room(64, 65, 65) == 32               # a testbed row (seq_len + 1 tokens)


@pytest.mark.slow
def test_recall_on_full_context_rows_cuts_targets_and_matches_numpy(tiny_model, ref_logits, longest_fed):
    data = full_rows()
    rng = np.random.default_rng(5)
    shots = [Example(f"t{i}", tokens=rng.integers(1, 300, 30).astype(np.int32), partition="prefix") for i in range(12)]
    ctx = ctx_for(tiny_model, data, shots)
    got = get("recall").fn(ctx, n=12, include_first=True)
    # room = min(360, max(256 - 256, 128)) = 128: the last 4 shots (120 tokens); targets cut to 256 - 120 = 136
    p = np.concatenate([e.tokens for e in shots[8:]])
    want = [np_ll(ref_logits, np.concatenate([p, e.tokens[:136]]), start=len(p)) / np_ll(ref_logits, e.tokens[:136])
            for e in data]
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert longest_fed == [CONTEXT]
    assert any("kept the last 4 of 12" in n for n in ctx.notes)
    assert any("recall: 6 target(s) cut to their first 136 tokens (LL(x) on the same tokens)" in n for n in ctx.notes)


@pytest.mark.slow
def test_recall_single_long_shot_is_cut_to_the_room(tiny_model, ref_logits, longest_fed):
    data = full_rows(n=3)
    shot = [Example("s0", tokens=np.arange(1, 301, dtype=np.int32) % 299 + 1, partition="prefix")]
    ctx = ctx_for(tiny_model, data, shot)
    got = get("recall").fn(ctx, n=1, include_first=True)
    p = shot[0].tokens[-128:]
    want = [np_ll(ref_logits, np.concatenate([p, e.tokens[:128]]), start=128) / np_ll(ref_logits, e.tokens[:128])
            for e in data]
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert longest_fed == [CONTEXT] and any("the last 128 tokens of the last shot" in n for n in ctx.notes)


@pytest.mark.slow
def test_em_mia_on_full_context_rows_matches_numpy(tiny_model, ref_logits, longest_fed):
    """Before: 'no room for a prefix'. Now prefixes keep their last 128 tokens, targets their first 128."""
    data = full_rows(n=5)
    ctx = ctx_for(tiny_model, data)
    R = E.recall_matrix(ctx)
    want = np.array([[np_ll(ref_logits, np.concatenate([p.tokens[-128:], x.tokens[:128]]), start=129)
                      / np_ll(ref_logits, x.tokens[:128]) for x in data] for p in data])
    np.testing.assert_allclose(R, want, rtol=1e-4)
    np.testing.assert_allclose(get("recall_avg").fn(ctx), want.mean(0), rtol=1e-4)
    assert longest_fed == [CONTEXT]
    assert any("em_mia: 5 prefix(es) cut to their last 128 tokens" in n for n in ctx.notes)
    assert any("em_mia: 5 target(s) cut to their first 128 tokens" in n for n in ctx.notes)


def test_prefix_attacks_fit_the_smoke_testbeds_trained_context(smoke_testbed, longest_fed):
    """Rows of seq_len + 1 = 65 tokens on a model trained at 64: before, ReCaLL ran a 12-shot prefix at positions up to
    ~840 (the testbed declared 2048) and EM-MIA stopped with "no room"; now every attack feeds <= 64 positions, prefix
    and target get 32 tokens each, and each score equals its NumPy statement on the cut targets."""
    from sklearn.metrics import roc_auc_score
    from transformers import AutoModelForCausalLM

    from hf_tiny import torch_sequence_logits

    model = smoke_testbed.load_model()
    ctxlen = model.max_length
    assert ctxlen == 64
    # the reference: transformers' PyTorch implementation of the same trained checkpoint
    torch_model = AutoModelForCausalLM.from_pretrained(str(smoke_testbed.checkpoint_dir()), local_files_only=True)
    torch_model = torch_model.float().eval()

    def ref(seq):
        return torch_sequence_logits(torch_model, seq)

    rows = smoke_testbed.dataset().get_rows(np.arange(18)).astype(np.int32)
    data = [Example(f"r{i}", tokens=rows[i], label=i % 2) for i in range(4)]
    shots = [Example(f"s{i}", tokens=rows[4 + i], partition="prefix") for i in range(12)]
    ctx = ctx_for(model, data, shots)
    half = [e.tokens[:32] for e in data]
    ll = np.array([np_ll(ref, x) for x in half])
    # ReCaLL, 12 shots of 65 tokens: the last 32 tokens of the last shot, targets' first 32 tokens
    p = shots[-1].tokens[-32:]
    want = np.array([np_ll(ref, np.concatenate([p, x]), start=32) for x in half]) / ll
    np.testing.assert_allclose(get("recall").fn(ctx, n=12, include_first=True), want, rtol=1e-4)
    # EM-MIA: each text's last 32 tokens as a prefix of the others' first 32
    R = np.array([[np_ll(ref, np.concatenate([q.tokens[-32:], x]), start=33) / np_ll(ref, x, start=1)
                   for x in half] for q in data])
    np.testing.assert_allclose(E.recall_matrix(ctx), R, rtol=1e-4)
    # CheckMIABench's ReCaLL: the first 32 of its 100 prefix tokens; pandora's statistic with the paper's sign
    q = np.concatenate([e.tokens for e in shots])[:32]
    stat = np.array([pandora_recall_statistic(ref, q, x) for x in half])
    got = get("recall").fn(ctx, variant="checkmia", tokens=100)
    np.testing.assert_allclose(got, -stat, rtol=1e-4, atol=1e-6)
    labels = np.array([e.label for e in data])
    assert roc_auc_score(labels, got) == pytest.approx(roc_auc_score(labels, -stat))
    assert longest_fed and max(longest_fed) <= ctxlen
    assert any("the last 32 tokens of the last shot" in n and "64-token context" in n for n in ctx.notes)
    assert any("em_mia: 4 target(s) cut to their first 32 tokens" in n for n in ctx.notes)


def pandora_recall_statistic(ref_logits, prefix, x):
    """pandora's ReCaLL feature (features/ReCaLL.py): NLL over every predicted position of [prefix; x] (prefix tokens
    included) minus NLL(x); the paper's ROC assumes members have the LOWER statistic (plot_ROC)."""
    return -np_ll(ref_logits, np.concatenate([prefix, x]), start=1) + np_ll(ref_logits, x)


@pytest.mark.slow
def test_checkmia_recall_is_pandoras_statistic_with_the_papers_orientation(tiny_model, ref_logits, longest_fed):
    from sklearn.metrics import roc_auc_score

    data = make_examples(tiny_model.tokenizer, 8, 0)
    shots = make_examples(tiny_model.tokenizer, 30, 1, words=(5, 12), partition="prefix", prefix="p")
    ctx = ctx_for(tiny_model, data, shots)
    got = get("recall").fn(ctx, n=12, include_first=True, variant="checkmia", tokens=100)
    prefix = np.concatenate([e.tokens for e in shots])[:100]  # the first 100 tokens of the non-member stream
    stat = np.array([pandora_recall_statistic(ref_logits, prefix, e.tokens) for e in data])
    np.testing.assert_allclose(got, -stat, rtol=1e-4, atol=1e-6)  # prediction = -statistic: higher = member
    labels = np.array([e.label for e in data])
    assert roc_auc_score(labels, got) == pytest.approx(roc_auc_score(labels, -stat))
    assert any("first 100 tokens" in n for n in ctx.notes)
    # full-context targets: prefix 100 tokens kept, targets cut to 156, the statistic on the cut targets
    rows = full_rows(n=4)
    ctx = ctx_for(tiny_model, rows, shots)
    got = get("recall").fn(ctx, variant="checkmia", tokens=100)
    stat = np.array([pandora_recall_statistic(ref_logits, prefix, e.tokens[:156]) for e in rows])
    np.testing.assert_allclose(got, -stat, rtol=1e-4, atol=1e-6)
    assert max(longest_fed) <= CONTEXT
    with pytest.raises(AttackError, match="variant must be one of official, checkmia"):
        get("recall").fn(ctx, variant="pandora")


def test_zlib_entropy_has_the_papers_orientation(tiny_model):
    """CheckMIABench's "Zlib" (pandora's feature -z, members predicted by the LOWER feature, i.e. -feature):
    members with the larger compressed size are detected, AUC = the paper's (the old -z gave 1 - AUC)."""
    import zlib

    from sklearn.metrics import roc_auc_score

    from mia.metrics import auc

    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta"], int(n))) for n in rng.integers(5, 200, 40)]
    z = np.array([len(zlib.compress(t.encode("utf-8"))) for t in texts])
    labels = (z > np.median(z)).astype(int)  # members: the less compressible texts
    feature = -z  # pandora's ZLIB.compute_features
    paper_auc = roc_auc_score(labels, -feature)  # plot_ROC: members have the lower statistic
    ex = [Example(f"z{i}", text=t, tokens=np.array([1, 2], np.int32), label=int(y)) for i, (t, y) in
          enumerate(zip(texts, labels))]
    scores = get("zlib_entropy").fn(ctx_for(tiny_model, ex))
    assert paper_auc == 1.0 and auc(scores, labels) == pytest.approx(paper_auc)
    np.testing.assert_array_equal(scores, z)
