"""Document-level MIA (mia.documents, ``mia score --documents``): features against plain NumPy loops, the classifier
against scikit-learn built here, the signal on shifted synthetic documents, and the CLI end to end on the tiny model."""
from __future__ import annotations

import json

import numpy as np
import pytest

from mia import documents as D


def _docs(rng, n_docs, shift=0.0, lo=1, hi=12):
    return [rng.normal(shift, 1.0, rng.integers(lo, hi)) for _ in range(n_docs)]


# ------------------------------------------------------------------------------------------------ features
def test_group_by_document_keeps_first_appearance_order():
    ids, groups = D.group_by_document(["b", "a", "b", "c", "a"])
    assert ids == ["b", "a", "c"]
    assert [g.tolist() for g in groups] == [[0, 2], [1, 4], [3]]
    vals = D.values_per_document(np.array([1.0, np.nan, 3.0, np.inf, 5.0]), groups)
    assert [v.tolist() for v in vals] == [[1.0, 3.0], [5.0], []]


def test_histogram_features_equal_numpy_histogram():
    rng = np.random.default_rng(0)
    train, test = _docs(rng, 9), _docs(rng, 7, shift=0.7) + [np.array([-50.0, 50.0, 0.0])]
    edges = D.histogram_edges(train, 6)
    np.testing.assert_array_equal(edges, np.histogram(np.concatenate(train), bins=6)[1])
    got = D.histogram_features(test, edges)
    for d, v in enumerate(test):
        # values outside the training range belong to the outermost bins
        ref = np.histogram(np.clip(v, edges[0], edges[-1]), bins=edges)[0] / len(v)
        np.testing.assert_allclose(got[d], ref, rtol=0, atol=1e-15)
    assert np.isnan(D.histogram_features([np.zeros(0)], edges)).all()


def test_aggregate_features_equal_numpy_loops():
    rng = np.random.default_rng(1)
    docs = _docs(rng, 8)
    got = D.aggregate_features(docs)
    assert got.shape == (8, 14)
    for d, v in enumerate(docs):
        ref = [np.mean(v), np.min(v), np.max(v), np.std(v), len(v)]
        ref += [np.quantile(v, q / 100) for q in (1, 5, 10, 25, 50, 75, 90, 95, 99)]
        np.testing.assert_allclose(got[d], ref, rtol=1e-12, atol=1e-12)
    both = D.document_features(docs, "both", D.histogram_edges(docs, 4))
    np.testing.assert_array_equal(both[:, 4:], got)


def test_chunk_tokens_cuts_consecutive_pieces():
    t = np.arange(10)
    assert [c.tolist() for c in D.chunk_tokens(t, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [c.tolist() for c in D.chunk_tokens(t[:9], 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a 1-token tail is dropped
    assert [c.tolist() for c in D.chunk_tokens(t[:3], 8)] == [[0, 1, 2]]


# ------------------------------------------------------------------------------------------------ classifier
@pytest.mark.parametrize("classifier", ["lr", pytest.param("rf", marks=pytest.mark.slow)])  # 500 trees: ~2 s
def test_classifier_equals_sklearn_built_here(classifier):
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(2)
    train = _docs(rng, 15) + _docs(rng, 15, shift=0.4)
    y = np.array([0] * 15 + [1] * 15)
    test = _docs(rng, 6) + _docs(rng, 6, shift=0.4)
    got = D.fit_and_score_documents(train, y, test, features="both", n_bins=5, classifier=classifier, seed=3)

    pooled = np.concatenate(train)
    edges = np.linspace(pooled.min(), pooled.max(), 6)

    def feats(v):
        h = np.histogram(np.clip(v, edges[0], edges[-1]), bins=edges)[0] / len(v)
        q = np.percentile(v, [1, 5, 10, 25, 50, 75, 90, 95, 99])
        return np.concatenate([h, [v.mean(), v.min(), v.max(), v.std(), len(v)], q])

    xt, xe = np.array([feats(v) for v in train]), np.array([feats(v) for v in test])
    lo, hi = xt.min(0), xt.max(0)
    span = np.where(hi > lo, hi - lo, 1.0)
    xt, xe = (xt - lo) / span * (hi > lo), (xe - lo) / span * (hi > lo)
    clf = (RandomForestClassifier(n_estimators=500, max_depth=5, min_samples_leaf=3, random_state=3)
           if classifier == "rf" else LogisticRegression(max_iter=1000, random_state=3))
    ref = clf.fit(xt, y).predict_proba(xe)[:, 1]
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("features, classifier", [("hist", "lr"), ("agg", "lr"),
                                                  pytest.param("hist", "rf", marks=pytest.mark.slow)])
def test_shifted_member_documents_are_found_and_runs_repeat(features, classifier):
    """Members' sequence scores shifted by 1 sd: each document holds 20 sequences (the best document AUC, from the
    mean, is Phi(sqrt(10)) = 0.999; one sequence gives Phi(sqrt(1/2)) = 0.76)."""
    from mia.metrics import auc

    rng = np.random.default_rng(4)
    make = lambda n, shift: [rng.normal(shift, 1.0, 20) for _ in range(n)]  # noqa: E731
    train, test = make(30, 0.0) + make(30, 1.0), make(30, 0.0) + make(30, 1.0)
    y = np.array([0] * 30 + [1] * 30)
    one_seq = auc(np.array([v[0] for v in test]), y)  # a single sequence sees little
    s = D.fit_and_score_documents(train, y, test, features=features, n_bins=10, classifier=classifier, seed=0)
    assert auc(s, y) >= 0.95 > one_seq + 0.1, (auc(s, y), one_seq)
    again = D.fit_and_score_documents(train, y, test, features=features, n_bins=10, classifier=classifier, seed=0)
    np.testing.assert_array_equal(s, again)


def test_documents_without_values_and_one_class():
    rng = np.random.default_rng(5)
    train = _docs(rng, 4) + [np.zeros(0)] + _docs(rng, 4, shift=1.0)
    y = [0] * 5 + [1] * 4
    s = D.fit_and_score_documents(train, y, [np.zeros(0), np.array([0.3])], classifier="lr")
    assert np.isnan(s[0]) and 0 <= s[1] <= 1
    with pytest.raises(D.DocumentError, match="one class"):
        D.fit_and_score_documents(train[:5], y[:5], [np.array([0.3])])


# ------------------------------------------------------------------------------------------------ the CLI
TEXTS = ["def add(a, b):\n    return a + b\n", "import json\nprint(json.dumps({'a': 1}))\n",
         "class Point:\n    x: int\n    y: int\n", "for i in range(10):\n    print(i * i)\n",
         "with open(path) as f:\n    data = f.read()\n", "try:\n    x = int(s)\nexcept ValueError:\n    x = 0\n"]


def _doc_rows():
    """12 documents of 2-3 sequences; documents 0-7 train, 8-11 eval; label = document number % 2."""
    rows, k = [], 0
    for d in range(12):
        for j in range(2 + d % 2):
            rows.append({"id": f"s{k}", "doc_id": f"doc{d}", "text": TEXTS[(d + j) % 6] + f"# {d}.{j}\n",
                         "label": d % 2, "partition": "train" if d < 8 else "eval"})
            k += 1
    return rows


def _torch_loss(model_dir, texts, max_length):
    """Independent reference: mean next-token log-prob of each text's first ``max_length`` tokens, transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    m = AutoModelForCausalLM.from_pretrained(str(model_dir)).float().eval()
    out = []
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([tok(t)["input_ids"][:max_length]])
            logp = torch.log_softmax(m(input_ids=ids).logits[0, :-1].double(), -1)
            out.append(float(logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]].mean()))
    return np.array(out)


def test_cli_documents_end_to_end(tiny_neox_dir, tmp_path, capsys):
    """--documents: one line per evaluation document, whose loss score equals fit_and_score_documents on sequence
    losses from transformers' PyTorch model (to float32 round-off)."""
    from mia.cli import main

    rows = _doc_rows()
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "docs.jsonl"
    capsys.readouterr()
    assert main(["score", "--model", str(tiny_neox_dir), "--data", str(data), "--out", str(out), "--documents",
                 "--doc-classifier", "lr", "--attacks", "loss,zlib", "--max-length", "8", "--no-cache",
                 "--no-progress", "--bootstrap", "50", "--seed", "1"]) == 0
    printed = capsys.readouterr().out
    assert "8 train document(s), 4 evaluation document(s)" in printed and "AUC" in printed and "zlib" in printed
    got = [json.loads(l) for l in out.read_text().splitlines()]
    assert [g["doc_id"] for g in got] == ["doc8", "doc9", "doc10", "doc11"]
    assert [g["label"] for g in got] == [0, 1, 0, 1] and [g["n_sequences"] for g in got] == [2, 3, 2, 3]
    assert all(0 <= g["scores"][a] <= 1 for g in got for a in ("loss", "zlib"))

    _, groups = D.group_by_document([r["doc_id"] for r in rows])
    vals = D.values_per_document(_torch_loss(tiny_neox_dir, [r["text"] for r in rows], 8), groups)
    ref = D.fit_and_score_documents(vals[:8], [d % 2 for d in range(8)], vals[8:], classifier="lr", seed=1)
    np.testing.assert_allclose([g["scores"]["loss"] for g in got], ref, atol=1e-4)


@pytest.mark.slow
def test_cli_seq_tokens_equals_prechunked_lines(tiny_neox_dir, tmp_path, capsys):
    """--seq-tokens 6 on whole documents (one line each, doc_id = id) gives the document scores of a run on the same
    documents cut into 6-token lines beforehand (token ids given, doc_id set)."""
    from mia.cli import main
    from mia.models.hub import load_tokenizer

    tok = load_tokenizer(tiny_neox_dir)
    # the documents share TEXTS, so a member and a non-member document hold equal 6-token pieces: allowed (the input
    # of document-level inference is the document), as it is when the whole documents are cut with --seq-tokens
    docs = [{"id": f"doc{d}", "text": "".join(TEXTS[(d + j) % 6] for j in range(2 + d % 3)), "label": d % 2,
             "partition": "train" if d < 8 else "eval"} for d in range(12)]
    pre = []
    for r in docs:
        ids = tok(r["text"])["input_ids"]
        pre += [{"id": f"{r['id']}-{k}", "doc_id": r["id"], "tokens": ids[i:i + 6], "label": r["label"],
                 "partition": r["partition"]} for k, i in enumerate(range(0, len(ids), 6)) if len(ids[i:i + 6]) >= 2]
    outs = []
    for name, rows, extra in (("whole", docs, ["--seq-tokens", "6"]), ("pre", pre, [])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert main(["score", "--model", str(tiny_neox_dir), "--data", str(tmp_path / f"{name}.jsonl"), "--out",
                     str(tmp_path / f"{name}.out"), "--documents", "--attacks", "loss", "--no-cache", "--no-progress",
                     "--bootstrap", "20", *extra]) == 0
        outs.append([json.loads(l) for l in (tmp_path / f"{name}.out").read_text().splitlines()])
    assert [o["doc_id"] for o in outs[0]] == [f"doc{d}" for d in range(8, 12)]
    assert [o["n_sequences"] for o in outs[0]] == [o["n_sequences"] for o in outs[1]]
    np.testing.assert_allclose([o["scores"]["loss"] for o in outs[0]], [o["scores"]["loss"] for o in outs[1]],
                               rtol=0, atol=1e-9)


@pytest.mark.slow
def test_documents_find_the_memorization_dial(smoke_testbed, tmp_path, capsys):
    """The smoke dial split (test_checkmia's members and seed, so the dial checkpoint is reused): its sequences
    grouped 4 to a document of one class; the document-level LOSS AUC is high."""
    from experiments.checkmia import run
    from mia.cli import main

    s = run("smoke", tmp_path / "dial", testbed_dir=smoke_testbed.root, attacks="loss", blind=False, bootstrap=100,
            memorize_epochs=8, n_members=100, n_train=0, n_calib=30, n_prefix=4, seed=1, progress=False)
    split = [json.loads(l) for l in (tmp_path / "dial" / "split.jsonl").read_text().splitlines()]
    seqs = [r for r in split if r.get("type") != "header" and r.get("partition", "eval") == "eval"]
    rows = []
    for label in (0, 1):
        mine = [r for r in seqs if r["label"] == label]
        for k, r in enumerate(mine[: len(mine) // 4 * 4]):
            d = k // 4
            rows.append(dict(r, doc_id=f"{label}-{d}", partition="train" if d % 2 == 0 else "eval"))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["score", "--model", s["memorize"]["path"], "--data", str(data), "--out", str(tmp_path / "o.jsonl"),
                 "--documents", "--attacks", "loss", "--no-cache", "--no-progress", "--bootstrap", "100"]) == 0
    table = capsys.readouterr().out
    print(table)
    doc_auc = float(next(l for l in table.splitlines() if l.startswith("loss")).split()[1])
    seq_auc = next(r["auc"] for r in s["rows"] if r["method"] == "loss")
    print(f"dial: sequence-level loss AUC {seq_auc:.4f} ({len(seqs)} sequences), document-level {doc_auc:.4f} "
          f"({len(rows) // 4} documents of 4)")
    assert doc_auc >= max(0.9, seq_auc - 0.05), (doc_auc, seq_auc)


def test_a_piece_shared_by_two_documents_is_allowed_a_document_labelled_both_is_not():
    """In document-level inference the input is the document: a member and a non-member document may share a piece
    (a licence header), as they do when whole documents are cut with --seq-tokens; two documents made of the same
    pieces with different labels are refused naming both, and so are two equal lines outside any document."""
    from mia.data.examples import DataError, Example, check_document_conflicts, check_label_conflicts

    def ex(i, doc, tokens, label):
        return Example(id=f"l{i}", tokens=np.array(tokens), label=label, doc_id=doc, source=f"d.jsonl:{i}")

    shared = [ex(1, "a", [1, 2, 3], 1), ex(2, "a", [4, 5], 1), ex(3, "b", [1, 2, 3], 0), ex(4, "b", [6, 7], 0)]
    check_label_conflicts(shared)
    check_document_conflicts(shared)
    same = shared[:2] + [ex(3, "b", [1, 2, 3], 0), ex(4, "b", [4, 5], 0)]
    with pytest.raises(DataError, match="document 'b', label 0\\): the same pieces as document 'a'"):
        check_document_conflicts(same)
    with pytest.raises(DataError, match="the same token ids"):
        check_label_conflicts([ex(1, None, [1, 2, 3], 1), ex(2, None, [1, 2, 3], 0)])
