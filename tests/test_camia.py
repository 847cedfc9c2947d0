"""CAMIA: every signal family against plain NumPy/Python loops (docs/algorithms.md#camia), p-values and combinations
against scipy and explicit formulas, compile/batching invariance, and end-to-end runs on the tiny model."""
from __future__ import annotations

import json
import math

import chex
import jax
import numpy as np
import pytest
import scipy.stats

from mia.attacks import AttackContext, AttackError, camia, camia_signals as cs, get, parse_attack
from mia.data.examples import Example
from mia.engine.batching import ScoringSettings
from mia.engine.loop import compute_token_stats

from attack_helpers import SETTINGS, make_examples

RNG = np.random.default_rng(0)


def series(n, rng=RNG):
    return (-rng.exponential(2.0, size=n)).astype(np.float32)


# ---------------------------------------------------------------------------------------------- references (loops)
def sl(x, cut):
    """x[0:T'] as the code slices it."""
    if cut == "T*":
        return list(x[0:-1])
    if cut is None:
        return list(x)
    return list(x[0:cut])


def mean(v):
    return sum(float(a) for a in v) / len(v)


def ref_loss(x, cut):
    return mean(sl(x, cut))


def ref_ppl(x, cut):
    return math.exp(-ref_loss(x, cut))


def ref_count_above(x, tau):
    s = sl(x, 200)
    return sum(1 for v in s if v >= -tau) / len(s)


def ref_count_mean(x, cut):
    s = sl(x, cut)
    m = mean(s)
    return sum(1 for v in s if v > m)


def ref_cbpm(x, cut):
    stop = len(x) if cut is None else min(cut, len(x))
    hits = [float(x[t]) > mean(x[:t]) for t in range(1, stop)]
    return sum(hits) / len(hits)


def ref_diversity(ids, cut):
    s = sl(ids, cut)
    return len(set(int(v) for v in s)) / len(s)


def ref_slope(x, cut):
    s = sl(x, cut)
    return float(np.polyfit(range(len(s)), s, 1)[0])


def ref_apen(x, cut, m=8, r=0.8):
    x = [float(v) for v in sl(x, cut)]
    n = len(x)
    mu = sum(x) / n
    r = r * math.sqrt(sum((v - mu) ** 2 for v in x) / n)
    if n <= m + 1:
        return 0.0

    def phi(mm):
        count = n - mm + 1
        total = 0.0
        for i in range(count):
            c = 0
            for j in range(count):
                if max(abs(x[i + k] - x[j + k]) for k in range(mm)) <= r:
                    c += 1
            total += math.log(c / count)
        return total / count

    return abs(phi(m) - phi(m + 1))


def ref_apen_vectorized(x, cut, m=8, r=0.8):
    """The released code's vectorized form (util_features.approximate_entropy) on x[:cut]."""
    s = np.asarray(x[:cut], np.float64)
    n, r = s.size, r * np.std(s)
    if n <= m + 1:
        return 0.0

    def phi(mm):
        w = np.array([s[i:i + mm] for i in range(n - mm + 1)])
        c = np.sum(np.max(np.abs(w[:, None] - w[None, :]), axis=2) <= r, axis=0) / (n - mm + 1)
        return np.sum(np.log(c)) / (n - mm + 1.0)

    return abs(phi(m) - phi(m + 1))


def ref_lz(x, bins):
    x = np.asarray(x, np.float64)
    d = np.digitize(x, np.linspace(min(x), 0, 100), right=True)
    s = np.searchsorted(np.linspace(np.min(d), np.max(d), bins + 1)[1:], d, side="left").tolist()
    phrases, i, w = set(), 0, 1
    while i + w <= len(s):
        p = tuple(s[i:i + w])
        if p in phrases:
            w += 1
        else:
            phrases.add(p)
            i, w = i + w, 1
    return len(phrases) / len(s)


def ref_features(x, ids, xrep, copies):
    """All 75 in FEATURE_NAMES order, code units."""
    cuts = ("T*", 200, 300)
    d = [ref_diversity(ids, c) for c in cuts]

    def keys(s):
        k = {"loss": [ref_loss(s, c) for c in cuts], "ppl": [ref_ppl(s, c) for c in cuts],
             "count_above": [ref_count_above(s, t) for t in (1, 2, 3)],
             "lz": [ref_lz(s[:200], b) for b in (3, 4, 5)], "count_mean": [ref_count_mean(s, c) for c in cuts]}
        k["cal_loss"] = [a / b for a, b in zip(k["loss"], d)]
        k["cal_ppl"] = [a / b for a, b in zip(k["ppl"], d)]
        return k

    base, c0, c1, c2 = keys(x), keys(copies[0]), keys(copies[1]), keys(copies[2])
    out = []
    for key in camia.KEYS:
        out += base[key] + [a - b for a, b in zip(c0[key], c1[key])] + [a - b for a, b in zip(c0[key], c2[key])]
    out += d + [ref_slope(xrep, c) for c in (600, 800, 1000)] + [ref_apen_vectorized(xrep, c) for c in (600, 800, 1000)]
    out += [ref_cbpm(x, c) for c in (None, 200, 300)]
    return np.array(out)


def batch(rows, dtype=np.float32):
    return cs.pad_rows(rows, dtype)


# ---------------------------------------------------------------------------------------------- signal families
LENS = (2, 3, 9, 150, 201, 260, 333)


def test_series_keys_match_loops():
    xs = [series(n) for n in LENS]
    got = np.asarray(cs.series_keys(*batch(xs)))[: len(xs)]
    for x, row in zip(xs, got):
        want = ([ref_loss(x, c) for c in cs.CUTS] + [ref_ppl(x, c) for c in cs.CUTS]
                + [ref_count_above(x, t) for t in cs.TAUS] + [ref_count_mean(x, c) for c in cs.CUTS])
        np.testing.assert_allclose(row, want, rtol=1e-5, atol=1e-5)


def test_count_above_prefix_mean_and_diversity_match_loops():
    xs = [series(n) for n in LENS]
    ids = [RNG.integers(0, 50, size=n + 1).astype(np.int32) for n in LENS]
    got = np.asarray(cs.original_keys(*batch(xs), *batch(ids, np.int32)))[: len(xs)]
    for x, t, row in zip(xs, ids, got):
        want = [ref_diversity(t, c) for c in cs.CUTS] + [ref_cbpm(x, c) for c in cs.CBPM_CUTS]
        np.testing.assert_allclose(row, want, rtol=1e-6, atol=1e-6)


def test_slope_matches_polyfit():
    xs = [series(n) for n in (2, 5, 599, 600, 750, 1100)]
    for cut in cs.REP_CUTS:
        got = np.asarray(cs.slope(*batch(xs), cut=cut))[: len(xs)]
        np.testing.assert_allclose(got, [ref_slope(x, cut) for x in xs], rtol=1e-4, atol=1e-6)


def test_apen_matches_plain_loop():
    xs = [series(n) for n in (5, 9, 10, 11, 37, 80)]  # N <= m+1 gives 0
    got = np.asarray(cs.approximate_entropy(*batch(xs), cut=50))[: len(xs)]
    want = [ref_apen(x, 50) for x in xs]
    assert want[0] == want[1] == 0.0
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)  # |Phi^m - Phi^m+1| of float32 log sums


def test_apen_long_series_matches_vectorized_code_form():
    x = series(700)
    for cut in (600, 800):
        got = float(np.asarray(cs.approximate_entropy(*batch([x]), cut=cut))[0])
        np.testing.assert_allclose(got, ref_apen_vectorized(x, cut), rtol=0, atol=1e-5)


def test_lz_hand_worked():
    # the reference's docstring example: "100111" parses as 1, 0, 01, 11 -> 4 phrases
    assert cs.lz_phrase_count([1, 0, 0, 1, 1, 1]) == 4
    # a trailing incomplete phrase is ignored: 0, 00, then "0" (seen) is dropped
    assert cs.lz_phrase_count([0, 0, 0, 0]) == 2
    # binning by hand: 100 edges on [-4, 0] give bin indices [0, 50, 99, 75, 25]; 3 groups with upper edges
    # [33, 66, 99] give symbols [0, 1, 2, 2, 0]; phrases 0, 1, 2, 20 -> 4 / 5
    x = np.array([-4.0, -2.0, 0.0, -1.0, -3.0])
    assert cs.lz_symbols(x, 3).tolist() == [0, 1, 2, 2, 0]
    assert cs.lempel_ziv(x, 3) == pytest.approx(0.8)
    for n in (3, 50, 200):
        x = series(n)
        for bins in cs.LZ_BINS:
            assert cs.lempel_ziv(x, bins) == pytest.approx(ref_lz(x, bins))


def test_locate_copies():
    ids = np.array([5, 6, 7, 8, 9])
    rep = np.array([5, 6, 7, 8, 9] + [11, 7, 8, 9] * 5)  # copies after the first merge " 5 6" into 11
    starts, length = cs.locate_copies(ids, rep)
    assert length == 3 and starts == [2, 6, 10]  # b = ids[2:] = [7, 8, 9]; 6 hits, last two dropped
    rep2 = np.array([5, 6, 7, 8, 9] + [11, 12, 8, 9] * 5)  # the boundary swallows one more token: b shortened
    starts, length = cs.locate_copies(ids, rep2)
    assert length == 2 and starts == [3, 7, 11]
    assert cs.locate_copies(ids, np.array([5, 6, 7, 8, 9, 1, 2])) is None


def test_full_feature_vector_matches_reference():
    cases = []
    for t in (12, 20, 230):  # x shorter than 200, between 200 and 300; xrep below 600 and above 1000
        x = series(t - 1)
        ids = RNG.integers(0, 30, size=t).astype(np.int32)
        xrep = series(6 * t - 3)
        copies = [xrep[s:s + t - 2] for s in (1, t + 1, 2 * t + 1)]
        cases.append((x, ids, xrep, copies))
    got = camia.raw_features(*[list(c) for c in zip(*cases)])
    assert got.shape == (3, 75)
    for row, case in zip(got, cases):
        want = ref_features(*case)
        for name, g, w in zip(camia.FEATURE_NAMES, row, want):
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5, err_msg=name)


def test_feature_table_and_orientation():
    names, groups = camia.FEATURE_NAMES, camia.FEATURE_GROUPS
    assert len(names) == len(set(names)) == 75
    sizes = np.bincount(groups)
    assert sizes.tolist() == [9] * 7 + [3] * 4
    sign = dict(zip(names, camia.orientation("low")))
    for name, s in [("loss@T*", -1), ("rep1_loss@200", -1), ("ppl@300", 1), ("rep2_cal_ppl@T*", 1),
                    ("cal_loss@200", -1), ("count_above@tau2", -1), ("rep1_count_mean@300", -1), ("lz@bins4", 1),
                    ("slope@800", -1), ("apen@1000", 1), ("count_above_pre@inf", -1), ("token_diversity@T*", 1)]:
        assert sign[name] == s, name
    assert dict(zip(names, camia.orientation("high")))["token_diversity@200"] == -1


def _case(t, n_rep):
    xrep = series(n_rep)
    return series(t - 1), RNG.integers(0, 30, size=t).astype(np.int32), xrep, [xrep[:t - 2], xrep[1:t - 1], xrep[2:t]]


def _features(cases):
    return camia.raw_features(*[list(c) for c in zip(*cases)])


def test_second_batch_of_other_lengths_does_not_recompile(monkeypatch):
    for name in ("series_keys", "original_keys", "repeat_keys"):
        monkeypatch.setattr(cs, name, jax.jit(chex.assert_max_traces(getattr(cs, "_" + name), n=1)))
    _features([_case(t, r) for t, r in ((20, 100), (25, 110), (30, 127))])
    _features([_case(t, r) for t, r in ((18, 90), (31, 120), (22, 70), (17, 80))])  # other sizes, same buckets


def test_batching_invariance():
    cases = [_case(t, r) for t, r in ((5, 100), (25, 110), (240, 1300))]
    together = _features(cases)
    for i, c in enumerate(cases):
        # equal up to float32 summation order: padding to another bucket regroups the sums (the Rep differences of
        # ppl, ~7 each, cancel to ~0.2 and so carry ~1e-5 absolute error)
        np.testing.assert_allclose(_features([c])[0], together[i], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- p-values, combination
def test_pvalues_match_percentileofscore_with_ties():
    calib = RNG.integers(0, 6, size=(25, 4)).astype(np.float32)  # many ties
    target = np.concatenate([RNG.integers(-1, 8, size=(9, 4)), calib[:3]]).astype(np.float32)
    got = np.asarray(cs.empirical_pvalues(target, calib))
    for i in range(target.shape[0]):
        for j in range(target.shape[1]):
            want = scipy.stats.percentileofscore(calib[:, j], target[i, j], kind="rank") / 100
            assert got[i, j] == pytest.approx(want, abs=1e-6)


def test_combinations_match_formulas():
    p = RNG.uniform(size=(6, 75))
    p[0, :3] = 0.0
    p[1, :2] = 1.0
    k = p.shape[1]
    q = np.where(p == 0, 1e-10, np.where(p == 1, 1 - 1e-10, p))
    np.testing.assert_allclose(camia.combine(p, "edgington"), p.mean(axis=1))
    fisher = scipy.stats.chi2.sf(-2 * np.log(q).sum(1), 2 * k)
    np.testing.assert_allclose(camia.combine(p, "fisher"), fisher, rtol=1e-10)
    pearson = scipy.stats.chi2.cdf(-2 * np.log(1 - q).sum(1), 2 * k)
    np.testing.assert_allclose(camia.combine(p, "pearson"), pearson, rtol=1e-10)
    nu = 5 * k + 4
    g = -np.log(q).sum(1) + np.log(1 - q).sum(1)
    george = scipy.stats.t.sf(g * math.sqrt(3 / k) / math.pi * math.sqrt(nu / (nu - 2)), nu)
    np.testing.assert_allclose(camia.combine(p, "george"), george, rtol=1e-10)


# ---------------------------------------------------------------------------------------------- model-based
WORDS = ("the model reads every token and the data loader keeps a window of text while members of the "
         "training set look familiar to the network so their loss stays low but fresh text looks new").split()


def texts(n, seed, tok):
    """n distinct texts whose tokens (33..64) and repeated-text tokens (129..256) each fall in one length bucket, so
    every scoring pass of a test reuses one compiled model function."""
    rng, out = np.random.default_rng(seed), []
    while len(out) < n:
        t = " ".join(rng.choice(WORDS, size=int(rng.integers(8, 15)))) + "."
        t_len, r_len = len(tok(t)["input_ids"]), len(tok(camia.repeated_text(t))["input_ids"])
        if 33 <= t_len <= 64 and 129 <= r_len <= 256 and t not in out:
            out.append(t)
    return out


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sliding_window_matches_per_position_passes(tiny_model):
    tokens = np.random.default_rng(1).integers(1, tiny_model.vocab_size, size=75).astype(np.int32)
    settings = ScoringSettings(progress=False, min_bucket=128)  # one length bucket: fewer compiles
    got = camia.repeated_logprobs(tiny_model, [tokens], settings, max_length=32)[0]
    assert got.shape == (74,)
    stride, windows = 16, []
    for j in range(74):  # value j predicts token j + 1 with context back to its window's begin
        i = (j + 1) // stride * stride
        begin = max(i + stride - 32, 0)
        windows.append(tokens[begin:j + 2])
    want = [s["logprob"][-1] for s in compute_token_stats(tiny_model, windows, settings)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    full = camia.repeated_logprobs(tiny_model, [tokens], settings, max_length=256)[0]
    np.testing.assert_allclose(full, compute_token_stats(tiny_model, [tokens], settings)[0]["logprob"])


def test_cli_end_to_end(tiny_neox_dir, tiny_model, tmp_path, capsys):
    from mia.cli import main

    ev = [{"id": f"e{i}", "text": t, "label": i % 2} for i, t in enumerate(texts(20, 0, tiny_model.tokenizer))]
    cal = [{"id": f"c{i}", "text": t} for i, t in enumerate(texts(20, 1, tiny_model.tokenizer))]
    data, calib = write_jsonl(tmp_path / "data.jsonl", ev), write_jsonl(tmp_path / "calib.jsonl", cal)
    out = tmp_path / "scores.jsonl"
    common = ["score", "--model", str(tiny_neox_dir), "--data", str(data), "--out", str(out), "--no-cache",
              "--no-progress", "--bootstrap", "10"]
    assert main(common + ["--attacks", "loss,mink:k=0.1,minkpp,zlib,camia", "--calib-data", str(calib)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 20
    for r in rows:
        assert set(r["scores"]) == {"loss", "mink:k=0.1", "minkpp", "zlib", "camia"}
        assert all(v is not None for v in r["scores"].values())
        assert -1.0 <= r["scores"]["camia"] <= 0.0

    small = write_jsonl(tmp_path / "small.jsonl", cal[:5])
    assert main(common + ["--attacks", "camia", "--calib-data", str(small)]) == 2
    assert "needs at least 10 'calib' example(s), got 5 (give --calib-data FILE" in capsys.readouterr().err


@pytest.mark.slow  # ~7 s more than the default run's CLI test; make test-all runs it
def test_cli_camia_lr_matches_sklearn(tiny_neox_dir, tiny_model, tmp_path):
    """camia_lr through ``mia score --train-data`` = the scikit-learn pipeline on the same texts' signals."""
    from mia.cli import main

    ev = [{"id": f"e{i}", "text": t, "label": i % 2} for i, t in enumerate(texts(20, 0, tiny_model.tokenizer))]
    tr = [{"id": f"t{i}", "text": t, "label": i % 2} for i, t in enumerate(texts(10, 4, tiny_model.tokenizer))]
    data, train = write_jsonl(tmp_path / "data.jsonl", ev), write_jsonl(tmp_path / "train.jsonl", tr)
    out = tmp_path / "scores.jsonl"
    assert main(["score", "--model", str(tiny_neox_dir), "--data", str(data), "--out", str(out), "--no-cache",
                 "--no-progress", "--bootstrap", "10", "--attacks", "camia_lr", "--train-data", str(train)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [e["id"] for e in ev]
    tok = tiny_model.tokenizer
    ev_x = _examples(tok, [(e["text"], e["label"]) for e in ev], "e")
    tr_x = _examples(tok, [(e["text"], e["label"]) for e in tr], "t")
    ctx = _ctx(tiny_model, ev_x, train=tr_x)
    sign = camia.orientation("low")
    f_tr = camia.features(ctx, tr_x, ctx.stats_for(tr_x, desc="t"), "training") * sign
    f_ev = camia.features(ctx, ev_x, ctx.stats(), "evaluated") * sign
    want = _sklearn_group_pca_lr(f_tr, [e["label"] for e in tr], f_ev, 2)
    np.testing.assert_allclose([r["scores"]["camia_lr"] for r in rows], want, atol=1e-4)


def _ctx(model, evaluated, **partitions):
    return AttackContext(model, evaluated, ScoringSettings(progress=False), partitions, {})


def _examples(tok, rows, prefix):
    out = []
    for i, (t, label) in enumerate(rows):
        out.append(Example(f"{prefix}{i}", np.asarray(tok(t)["input_ids"], np.int32), t, label))
    return out


def test_camia_methods_and_lr_on_tiny_model(tiny_model):
    tok = tiny_model.tokenizer
    ev = _examples(tok, [(t, i % 2) for i, t in enumerate(texts(9, 2, tok))], "e")
    # a 3-token example has no Rep signals: a NaN score and a note, not a crash
    ev.append(Example("short", np.asarray(tok("the model")["input_ids"][:3], np.int32), None, 1))
    cal = _examples(tok, [(t, 0) for t in texts(10, 3, tok)], "c")
    train = _examples(tok, [(t, i % 2) for i, t in enumerate(texts(10, 4, tok))], "t")
    ctx = _ctx(tiny_model, ev, calib=cal, train=train)
    for method in camia.METHODS:
        s = get("camia").fn(ctx, method=method, min_calib=10, diversity="low")
        assert s.shape == (10,) and np.isfinite(s[:9]).all() and (s[:9] <= 0).all() and np.isnan(s[9])
    assert any("fewer than 4 tokens" in n for n in ctx.notes)
    lr = get("camia_lr").fn(ctx, components=2, diversity="low")
    assert lr.shape == (10,) and ((lr[:9] >= 0) & (lr[:9] <= 1)).all() and np.isnan(lr[9])
    # the same scores from a scikit-learn pipeline built here: per-group PCA(2) on the oriented training signals
    # (a ColumnTransformer, one PCA per signal group), then LogisticRegression(liblinear), P(member)
    f_tr = camia.features(ctx, train, ctx.stats_for(train, desc="t"), "training") * camia.orientation("low")
    f_ev = camia.features(ctx, ev, ctx.stats(), "evaluated") * camia.orientation("low")
    assert np.isfinite(f_tr).all() and np.isfinite(f_ev[:9]).all() and np.isnan(f_ev[9]).any()
    np.testing.assert_allclose(lr[:9], _sklearn_group_pca_lr(f_tr, [e.label for e in train], f_ev[:9], 2),
                               rtol=1e-9, atol=1e-12)
    lr1 = get("camia_lr").fn(ctx, components=1, diversity="low")
    np.testing.assert_allclose(lr1[:9], _sklearn_group_pca_lr(f_tr, [e.label for e in train], f_ev[:9], 1),
                               rtol=1e-9, atol=1e-12)
    assert not np.allclose(lr1[:9], lr[:9])


def _sklearn_group_pca_lr(f_train, y_train, f_eval, components):
    """CAMIA App. B with stock scikit-learn: one PCA per signal group (the 11 groups of 3..9 columns named in
    ``camia.FEATURE_NAMES``), concatenated, then liblinear logistic regression; returns P(member) of ``f_eval``."""
    from sklearn.compose import ColumnTransformer
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression

    groups = {g: [] for g in camia.GROUPS}  # in this order: liblinear's coordinate descent sees columns in order
    for col in range(len(camia.FEATURE_NAMES)):
        groups[camia.GROUPS[camia.FEATURE_GROUPS[col]]].append(col)
    assert len(groups) == 11 and sum(map(len, groups.values())) == 75 and min(map(len, groups.values())) >= 3
    pca = ColumnTransformer([(g, PCA(n_components=components), cols) for g, cols in groups.items()]).fit(f_train)
    # the training projection is transform(X) = (X - mean) V, not fit_transform's U S: on the tiny model's nearly
    # degenerate groups the two differ by ~1e-8 and liblinear turns that into ~1e-7 in P(member)
    lr = LogisticRegression(solver="liblinear", max_iter=5000).fit(pca.transform(f_train), np.asarray(y_train))
    return lr.predict_proba(pca.transform(f_eval))[:, 1]


def test_bad_input_messages(tiny_model):
    with pytest.raises(AttackError, match="valid parameters: method, min_calib, diversity"):
        parse_attack("camia:alpha=0.1")
    tok = tiny_model.tokenizer
    ev = _examples(tok, [(t, 1) for t in texts(3, 5, tok)], "e")
    cal = _examples(tok, [(t, 0) for t in texts(12, 6, tok)], "c")
    ctx = _ctx(tiny_model, ev, calib=cal)
    with pytest.raises(AttackError, match="needs at least 20 'calib' example"):
        get("camia").fn(ctx, method="edgington", min_calib=20, diversity="low")
    with pytest.raises(AttackError, match="min_calib must be at least 10"):
        get("camia").fn(ctx, method="edgington", min_calib=5, diversity="low")
    with pytest.raises(AttackError, match="unknown method 'stouffer'; valid: edgington, fisher, pearson, george"):
        get("camia").fn(ctx, method="stouffer", min_calib=10, diversity="low")
    with pytest.raises(AttackError, match="needs a labelled 'train' partition with both members and non-members"):
        get("camia_lr").fn(ctx, components=2, diversity="low")
    one_class = _ctx(tiny_model, ev, train=cal)
    with pytest.raises(AttackError, match="got 0 member"):
        get("camia_lr").fn(one_class, components=2, diversity="low")


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
    ev = make_examples(tok, 6, 7, words=(8, 14))
    cal = make_examples(tok, 10, 8, words=(8, 14), partition="calib", prefix="c", label=0)
    train = make_examples(tok, 6, 9, words=(8, 14), partition="train", prefix="t")
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
