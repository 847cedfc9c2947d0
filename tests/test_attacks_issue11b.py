"""Con-ReCaLL, EM-MIA's Kendall-tau prefix score, LOSS/zlib without EOS targets and CAMIA's learned orientation,
each against an independent NumPy/Python reference on small inputs (issue 11, items 4, 8, 9)."""
import json
from itertools import combinations

import numpy as np
import pytest

from mia.attacks import AttackContext, AttackError, get, parse_attack
from mia.attacks import camia
from mia.attacks import em_mia as E
from mia.data.examples import Example, tokenize_examples
from mia.engine.batching import ScoringSettings

from hf_tiny import log_softmax

WORDS = "the of and to in is that for it as with was on be by this are from not but data model train member".split()
SETTINGS = ScoringSettings(progress=False, min_bucket=32)


def examples(tok, n, seed, words=(3, 14), partition="eval", prefix="e", label=None):
    rng = np.random.default_rng(seed)
    ex = [Example(f"{prefix}{i}", text=" ".join(rng.choice(WORDS, int(rng.integers(*words)))),
                  label=(i % 2) if label is None else label, partition=partition) for i in range(n)]
    return tokenize_examples(ex, tok, 256)


@pytest.fixture(scope="module")
def ref_lp(tiny_neox_torch):
    """seq -> [T, V] float64 log-softmax over the whole sequence (one plain causal pass) of transformers' PyTorch
    model of the same checkpoint: independent of mia's Flax model."""
    from hf_tiny import torch_sequence_logits

    return lambda seq: log_softmax(torch_sequence_logits(tiny_neox_torch, seq))


def np_ll(ref_lp, seq, start=1):
    """mean over i >= start of log p(seq[i] | seq[:i])."""
    lp = ref_lp(np.asarray(seq))
    return np.mean([lp[i - 1, seq[i]] for i in range(start, len(seq))])


# ------------------------------------------------------------------------------------------------ Con-ReCaLL
def test_conrecall_matches_numpy(tiny_model, ref_lp):
    tok = tiny_model.tokenizer
    data = examples(tok, 4, 0)
    nm = examples(tok, 3, 1, words=(2, 5), partition="prefix", prefix="n", label=0)
    train = examples(tok, 6, 2, words=(2, 5), partition="train", prefix="t")  # labels 0, 1, ...: members t1, t3, t5
    ctx = AttackContext(tiny_model, data, SETTINGS, {"prefix": nm, "train": train}, {})
    got = get("conrecall").fn(ctx, n=3, gamma=0.6)
    p_nm = np.asarray(tok("".join(e.text for e in nm))["input_ids"])
    p_m = np.asarray(tok("".join(e.text for e in train[1::2]))["input_ids"])
    want = [(np_ll(ref_lp, np.concatenate([p_nm, e.tokens]), len(p_nm))
             - 0.6 * np_ll(ref_lp, np.concatenate([p_m, e.tokens]), len(p_m))) / np_ll(ref_lp, e.tokens)
            for e in data]
    np.testing.assert_allclose(got, want, rtol=1e-4)
    # gamma = 0 is ReCaLL with the same non-member prefix (and shares its conditional pass)
    np.testing.assert_allclose(get("conrecall").fn(ctx, n=3, gamma=0.0), get("recall").fn(ctx, n=3), rtol=1e-6)
    assert any("member prefix shots from the members of the train partition" in n for n in ctx.notes)


def test_conrecall_bad_input(tiny_model):
    """Every refusal comes before any model call, as one line."""
    tok = tiny_model.tokenizer
    data = examples(tok, 4, 0)
    nm = examples(tok, 4, 1, partition="prefix", prefix="n", label=0)
    train = examples(tok, 6, 3, partition="train", prefix="t")  # 3 members
    ctx = AttackContext(tiny_model, data, SETTINGS, {"prefix": nm, "train": train}, {})
    with pytest.raises(AttackError, match="needs at least 4 member prefix example.*got 3 from the members of the train"):
        get("conrecall").fn(ctx, n=4, gamma=1.0)
    with pytest.raises(AttackError, match="needs at least 5 non-member 'prefix' example"):
        get("conrecall").fn(ctx, n=5, gamma=1.0)
    with pytest.raises(AttackError, match="gamma must be a finite number >= 0"):
        get("conrecall").fn(ctx, n=3, gamma=-1.0)
    bad = AttackContext(tiny_model, data, SETTINGS, {"prefix": nm, "member_prefix": nm}, {})
    with pytest.raises(AttackError, match="member prefix data hold non-members"):
        get("conrecall").fn(bad, n=3, gamma=1.0)
    copies = [Example(f"x{i}", tokens=data[0].tokens, label=1) for i in range(3)]
    clash = AttackContext(tiny_model, data, SETTINGS, {"prefix": nm, "member_prefix": copies}, {})
    with pytest.raises(AttackError, match=r"conrecall \(member\): prefix data overlaps the evaluated examples"):
        get("conrecall").fn(clash, n=3, gamma=1.0)
    with pytest.raises(AttackError, match="valid parameters: n, gamma"):
        parse_attack("conrecall:alpha=1")


@pytest.mark.slow
def test_conrecall_cli_and_listing(tiny_neox_dir, tmp_path, capsys):
    from mia.cli import main

    def write(path, rows):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    rng = np.random.default_rng(0)
    text = lambda: " ".join(rng.choice(WORDS, 8))  # noqa: E731
    data = write(tmp_path / "d.jsonl", [{"id": f"e{i}", "text": text(), "label": i % 2} for i in range(6)])
    pre = write(tmp_path / "p.jsonl", [{"id": f"p{i}", "text": text()} for i in range(2)])
    mem = write(tmp_path / "m.jsonl", [{"id": f"m{i}", "text": text(), "label": 1} for i in range(2)])
    base = ["score", "--model", str(tiny_neox_dir), "--data", data, "--out", str(tmp_path / "o.jsonl"), "--no-cache",
            "--no-progress", "--bootstrap", "10", "--prefix-data", pre, "--attacks", "conrecall:n=2"]
    assert main(base + ["--member-prefix-data", mem]) == 0
    rows = [json.loads(line) for line in open(tmp_path / "o.jsonl")]
    assert len(rows) == 6 and all(np.isfinite(r["scores"]["conrecall:n=2"]) for r in rows)
    capsys.readouterr()
    assert main(base) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs at least 2 member prefix example(s), got 0" in err[0]
    # the same member shots as a member_prefix partition of the data file give the same scores
    inline = write(tmp_path / "d2.jsonl", [json.loads(line) for line in open(data)] +
                   [dict(json.loads(line), partition="member_prefix") for line in open(mem)])
    assert main([a if a != data else inline for a in base] + ["--out", str(tmp_path / "o2.jsonl")]) == 0
    rows2 = [json.loads(line) for line in open(tmp_path / "o2.jsonl")]
    assert [r["scores"] for r in rows2] == [r["scores"] for r in rows]


def test_attacks_listing_names_the_new_parameters(capsys):
    from mia.cli import main

    assert main(["attacks"]) == 0
    listing = capsys.readouterr().out
    assert "conrecall (n=12, gamma=1.0; needs model, stats, prefix, member_prefix; cost model)" in listing
    assert "orient='label_free'" in listing and "prefix_score='auc'" in listing and "skip_eos=False" in listing
    assert get("camia").defaults["min_calib"] <= 18  # accepts the official protocol's 30% of 60 non-members


# ------------------------------------------------------------------------------------------------ EM-MIA Kendall
def kendall_tau_b(x, y):
    """Kendall's tau-b by its definition over all pairs: (C - D) / sqrt((n0 - n1)(n0 - n2))."""
    c = d = tx = ty = 0
    for i, j in combinations(range(len(x)), 2):
        a, b = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
        if a == 0 and b == 0:
            continue
        if a == 0:
            tx += 1
        elif b == 0:
            ty += 1
        elif a == b:
            c += 1
        else:
            d += 1
    den = np.sqrt((c + d + tx) * (c + d + ty))
    return np.nan if den == 0 else (c - d) / den


def test_em_mia_kendall_prefix_score_matches_definition():
    rng = np.random.default_rng(0)
    R = rng.integers(0, 4, size=(7, 7)).astype(float)  # many ties
    R[3] = 2.0  # a constant row: tau undefined (NaN) -> membership 0
    f0 = rng.integers(0, 3, size=7).astype(float)
    np.testing.assert_allclose(E.rowwise_kendall_tau(R, f0), [kendall_tau_b(r, f0) for r in R], equal_nan=True)
    f = f0.copy()
    for _ in range(3):  # the official loop: r_p = tau(R[p], f); f = -r; NaN -> 0
        f = np.nan_to_num(-np.array([kendall_tau_b(r, f) for r in R]), nan=0.0)
    np.testing.assert_allclose(E.em_mia_scores(R, f0, iters=3, prefix_score="kendall"), f)
    with pytest.raises(AttackError, match="prefix_score must be one of auc, kendall, rankdist; got 'tau'"):
        E.em_mia_scores(R, f0, prefix_score="tau")


# ------------------------------------------------------------------------------------------------ LOSS without EOS
def test_loss_and_zlib_skip_eos_targets(tiny_model, ref_lp):
    tok = tiny_model.tokenizer
    eos = int(tiny_model.config.eos_token_id)
    data = examples(tok, 4, 5, words=(6, 10))
    for i in (0, 2):  # an end-of-document token inside and at the end of two texts
        t = data[i].tokens
        data[i] = Example(data[i].id, np.concatenate([t[:3], [eos], t[3:], [eos]]).astype(np.int32), None, 1)
    data.append(Example("alleos", np.array([5, eos, eos], np.int32), None, 0))
    ctx = AttackContext(tiny_model, data, SETTINGS, {}, {})

    def ref(seq, skip):
        lp = ref_lp(seq)
        terms = [lp[i - 1, seq[i]] for i in range(1, len(seq)) if not (skip and seq[i] == eos)]
        return np.mean(terms) if terms else np.nan

    for skip in (False, True):
        want = np.array([ref(e.tokens, skip) for e in data])
        np.testing.assert_allclose(get("loss").fn(ctx, skip_eos=skip), want, rtol=1e-5, equal_nan=True)
        z = np.array([len(__import__("zlib").compress(t.encode())) for t in ctx.texts()])
        np.testing.assert_allclose(get("zlib").fn(ctx, skip_eos=skip), want / z, rtol=1e-5, equal_nan=True)
    assert np.isnan(get("loss").fn(ctx, skip_eos=True)[-1])


# ------------------------------------------------------------------------------------------------ CAMIA orient=train
def official_orientation(f_raw, y):
    """The official rule on named blocks: for each key's [3, N] block, negate when members' mean > non-members'."""
    names = [n.split("@")[0] for n in camia.FEATURE_NAMES]
    sign = {}
    for key in dict.fromkeys(names):
        cols = [j for j, n in enumerate(names) if n == key]
        block = f_raw[:, cols].T
        sign[key] = -1.0 if block.T[y == 1].mean() > block.T[y == 0].mean() else 1.0
    return np.array([sign[n] for n in names])


def test_camia_train_orientation_matches_official_rule():
    rng = np.random.default_rng(1)
    y = np.array([0, 1] * 6)
    f = rng.normal(size=(12, 75)) + np.where(y[:, None] == 1, rng.normal(size=75), 0.0)
    np.testing.assert_array_equal(camia.train_orientation(f, y), official_orientation(f, y))
    f[0, 5] = np.nan  # rows with an undefined signal are left out
    np.testing.assert_array_equal(camia.train_orientation(f, y), official_orientation(f[1:], y[1:]))
    with pytest.raises(AttackError, match="orient=train needs training members and non-members"):
        camia.train_orientation(f[y == 1], y[y == 1])


@pytest.mark.slow
def test_camia_orient_train_on_tiny_model(tiny_model):
    tok = tiny_model.tokenizer
    ev = examples(tok, 6, 7, words=(8, 14))
    cal = examples(tok, 10, 8, words=(8, 14), partition="calib", prefix="c", label=0)
    train = examples(tok, 6, 9, words=(8, 14), partition="train", prefix="t")
    ctx = AttackContext(tiny_model, ev, SETTINGS, {"calib": cal, "train": train}, {})
    got = get("camia").fn(ctx, method="edgington", min_calib=10, diversity="low", orient="train")
    f_tr = camia.features(ctx, train, ctx.stats_for(train), "training")
    sign = official_orientation(f_tr, np.array([e.label for e in train]))
    f_ev = camia.features(ctx, ev, ctx.stats(), "evaluated")
    f_cal = camia.features(ctx, cal, ctx.stats_for(cal), "calibration")
    np.testing.assert_allclose(got, camia.pvalue_scores(f_ev * sign, f_cal * sign, "edgington"))
    assert any("orientation learned from 6 labelled 'train' example(s)" in n for n in ctx.notes)
    with pytest.raises(AttackError, match="orient must be one of label_free, train; got 'labels'"):
        get("camia").fn(ctx, method="edgington", min_calib=10, diversity="low", orient="labels")
    no_train = AttackContext(tiny_model, ev, SETTINGS, {"calib": cal}, {})
    with pytest.raises(AttackError, match="camia:orient=train needs a labelled 'train' partition"):
        get("camia").fn(no_train, method="edgington", min_calib=10, diversity="low", orient="train")
