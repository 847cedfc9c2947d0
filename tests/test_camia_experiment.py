"""experiments.camia: CAMIA's Table 1 / Table 2 on the smoke suite, on MIMIR-layout files, and its bad-input lines."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from experiments import camia as exp
from mia.attacks import camia_protocol
from mia.data import mimir
from mia.testbed import row_documents

from notebook_runner import run_notebook
from table_check import rendered_again


def _testbed_args(request) -> dict:
    """The smoke suite when this checkout has it (``smoke_suite`` fixture), else the smoke testbed."""
    try:
        return {"suite_dir": request.getfixturevalue("smoke_suite").root}
    except pytest.FixtureLookupError:
        return {"testbeds": [request.getfixturevalue("smoke_testbed").root]}


@pytest.fixture(scope="session")
def camia_smoke(request, tmp_path_factory):
    """The smoke preset run once per session: (output directory, summary, the run's keyword arguments)."""
    out = tmp_path_factory.mktemp("camia_smoke") / "run"
    kw = {**_testbed_args(request), "bootstrap": 200}  # the smoke run's resamples before the shared default (1000)
    return out, exp.run("smoke", out, progress=False, **kw), kw


# ------------------------------------------------------------------------------------------------ pure parts
def test_majority_documents_by_hand():
    # documents of 3, 10, 2 and 5 stream tokens; rows of 4 tokens
    doc, share = row_documents.majority_documents(np.array([0, 1, 3, 4]), np.array([3, 10, 2, 5]), 4)
    # row 0 = [0, 4): doc0 3, doc1 1 | row 1 = [4, 8): doc1 | row 3 = [12, 16): doc1 1, doc2 2, doc3 1 |
    # row 4 = [16, 20): doc3
    assert doc.tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(share, [0.75, 1.0, 0.5, 1.0])


def test_domain_of():
    assert row_documents.domain_of("asyncio/base_events.py") == "asyncio"
    assert row_documents.domain_of("argparse.py") == "argparse"
    assert row_documents.domain_of("xml/etree/ElementTree.py") == "xml"


def test_calibration_draw_is_the_protocol():
    y = np.array([1] * 20 + [0] * 30)
    cal, rem, tgt = camia_protocol.calibration_draw(y, 0.3, 0, 3)
    assert len(cal) == 9 and (y[cal] == 0).all()  # 30% of the non-members, non-members only
    assert len(rem) == 6 and (y[rem] == 1).all()  # 30% of the members
    assert sorted(np.concatenate([cal, rem, tgt]).tolist()) == list(range(50))  # a partition
    again = camia_protocol.calibration_draw(y, 0.3, 0, 3)
    assert all((a == b).all() for a, b in zip((cal, rem, tgt), again))
    assert not (camia_protocol.calibration_draw(y, 0.3, 0, 4)[0] == cal).all()


def test_row_documents_decode_to_their_document(smoke_testbed):
    rd = row_documents.row_documents(smoke_testbed)
    assert len(rd.doc) == smoke_testbed.n_rows
    from mia.data.corpus import load_corpus

    cfg = smoke_testbed.config
    texts = {d.path: d.text for d in load_corpus(cfg.corpus, cfg.text_column, cfg.max_corpus_bytes).documents}
    tok = smoke_testbed.tokenizer()
    rows = np.flatnonzero(rd.share == 1.0)
    pick = np.random.default_rng(0).choice(rows, 40, replace=False)
    checked = 0
    for r in pick:
        text = tok.decode(smoke_testbed.dataset()[int(r)].tolist())
        if "\ufffd" in text:  # a row cut inside a multi-byte character
            continue
        assert text in texts[rd.paths[rd.doc[r]]], r
        checked += 1
    assert checked >= 30


# ------------------------------------------------------------------------------------------------ the smoke run
def _auc(s, y):
    """Mann-Whitney AUC, ties 1/2 (independent of sklearn)."""
    pos, neg = s[y == 1], s[y == 0]
    return ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (len(pos) * len(neg))


def _tpr_at_1pct(s, y):
    best = 0.0
    for t in np.unique(s):
        fpr, tpr = (s[y == 0] >= t).mean(), (s[y == 1] >= t).mean()
        if fpr <= 0.01:
            best = max(best, tpr)
    return best


def _rank_pvalues(target, calib):
    """scipy.stats.percentileofscore(kind='rank') / 100 per signal, written out."""
    less = (calib[None, :, :] < target[:, None, :]).sum(1)
    leq = (calib[None, :, :] <= target[:, None, :]).sum(1)
    return (less + leq + (less < leq)) / (2.0 * len(calib))


def test_smoke_table1_matches_an_independent_recomputation(camia_smoke):
    from mia.attacks.camia import orientation

    out, s, _ = camia_smoke
    assert len(s["datasets"]) == 2
    for f in ("report.md", "table1.md", "table1.csv", "table1.tex", "table1_values.csv", "table2.md", "summary.json",
              "manifest.json", "timings.json"):
        assert (out / f).exists(), f
    values = {(r["dataset"], r["method"]): r for r in json.loads((out / "table1_values.json").read_text())["rows"]}
    for d in s["datasets"]:
        lines = [json.loads(l) for l in (out / "scores" / f"{d}.jsonl").read_text().splitlines()]
        y = np.array([l["label"] for l in lines])
        loss = np.array([l["scores"]["loss"] for l in lines])
        z = np.load(out / "signals" / f"{d}.npz")
        assert z["ids"].tolist() == [l["id"] for l in lines]
        f = z["signals"] * orientation("low")
        aucs, tprs, cam = [], [], []
        for i in range(10):  # the protocol, written out: default_rng([seed, i]) permutations per class
            rng = np.random.default_rng([0, i])
            non, mem = rng.permutation(np.flatnonzero(y == 0)), rng.permutation(np.flatnonzero(y == 1))
            k0, k1 = int(0.3 * len(non)), int(0.3 * len(mem))
            cal, tgt = non[:k0], np.sort(np.concatenate([non[k0:], mem[k1:]]))
            aucs.append(_auc(loss[tgt], y[tgt]))
            tprs.append(_tpr_at_1pct(loss[tgt], y[tgt]))
            ok = np.isfinite(f[tgt]).all(1)
            calf = f[cal][np.isfinite(f[cal]).all(1)]
            p = _rank_pvalues(f[tgt][ok], calf).mean(1)
            cam.append(_auc(-p, y[tgt][ok]))
        v = values[(d, "loss")]
        assert v["auc"] == pytest.approx(np.mean(aucs), abs=1e-12)
        assert v["auc_sd"] == pytest.approx(np.std(aucs, ddof=1), abs=1e-12)
        assert v["tpr"] == pytest.approx(np.mean(tprs), abs=1e-12)
        assert values[(d, "camia:edgington")]["auc"] == pytest.approx(np.mean(cam), abs=1e-6)
        for m in ("zlib", "mink:k=0.2", "minkpp:k=0.2", "camia:fisher", "camia:pearson", "camia:george", "camia_lr",
                  "blind"):
            assert (d, m) in values, m
    md = (out / "table1.md").read_text()
    assert "CAMIA (George)" in md and "±" in md
    t2 = json.loads((out / "table2.json").read_text())["rows"]
    assert {r["split"] for r in t2} == {"all (Table 1)", "ngram_7_0.2", "ngram_13_0.2", "ngram_13_0.8"}


@pytest.mark.slow  # the whole run twice; the tables' determinism on fixed rows is checked in the default run
def test_smoke_same_seed_same_tables(camia_smoke, tmp_path):
    out, _, kw = camia_smoke
    exp.run("smoke", tmp_path, progress=False, **kw)
    for f in ("table1.md", "table1.csv", "table1.tex", "table1.json", "table1_values.csv", "table2.md", "table2.csv",
              "summary.json", "report.md"):
        assert (tmp_path / f).read_bytes() == (out / f).read_bytes(), f


def test_tables_are_a_function_of_the_saved_rows(camia_smoke):
    # the experiment's renderer (experiments.camia imports report_markdown from it), without the whole experiment
    from experiments.camia_report import report_markdown

    assert exp.report_markdown is report_markdown
    same = rendered_again("experiments.camia_report", camia_smoke[0], ["table1", "table1_values", "table2"])
    assert same == dict.fromkeys(["report.md", "table1.csv", "table1_values.csv", "table2.csv"], True)


def test_camia_notebook_computes_the_tables(camia_smoke, monkeypatch):
    """The notebook's AUC/TPR tables are the run's Table 1 values, and it draws its two figures."""
    out, _, _ = camia_smoke
    ns, shown, printed = run_notebook("camia", monkeypatch, {"MIA_CAMIA_RESULTS": out})
    values = json.loads((out / "table1_values.json").read_text())["rows"]
    assert len(values) > 0
    for r in values:  # cells read "mean ± sd": AUC to 3 decimals, TPR in percent to 2
        row = exp.DISPLAY.get(r["method"], r["method"])
        assert float(ns["auc"].loc[row, r["dataset"]].split(" ± ")[0]) == pytest.approx(r["auc"], abs=5.01e-4), r
        assert float(ns["tpr"].loc[row, r["dataset"]].split(" ± ")[0]) == pytest.approx(100 * r["tpr"], abs=5.01e-3), r
    assert ns["auc"].shape == (len({r["method"] for r in values}), len({r["dataset"] for r in values}))
    assert ns["summary"]["model"]["description"] in printed
    assert any(o is ns["auc"] for o in shown) and any(o is ns["tpr"] for o in shown)
    assert len(shown.images()) >= 2


# ------------------------------------------------------------------------------------------------ MIMIR files
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
         "phi chi psi omega").split()


def _fake_mimir(root: Path, files: dict) -> Path:
    """MIMIR's real layout: cache_100_200_1000_512/{train,test}/<domain>_<split>.jsonl, one JSON string per line."""
    rng = np.random.default_rng(0)
    base = root / "cache_100_200_1000_512"
    for name, (n_mem, n_non) in files.items():
        for sub, n in (("train", n_mem), ("test", n_non)):
            (base / sub).mkdir(parents=True, exist_ok=True)
            texts = [" ".join(rng.choice(WORDS, int(rng.integers(12, 20)))) for _ in range(n)]
            (base / sub / f"{name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts))
    return root


def test_blind_baseline_that_cannot_run_says_why(tmp_path):
    """Too few texts for BoW + LR's 80/20 split: no row, and the reason (recorded in ``skipped`` by the caller)."""
    ex = [{"id": f"t{i}", "label": i % 2, "text": f"some words {i}"} for i in range(4)]
    row, why = exp.blind_result(ex, tmp_path / "s.jsonl", {"kind": "text"}, 0, 10)
    assert row is None and why.startswith("BoW + LR did not run (bow: BlindError: ") and "need at least" in why


def test_mimir_layout_is_read(tmp_path):
    root = _fake_mimir(tmp_path, {"arxiv_ngram_7_0.2": (3, 2), "wikipedia_(en)_ngram_13_0.8": (2, 2)})
    idx = mimir.mimir_index(root)
    assert set(idx) == {("arxiv", "ngram_7_0.2"), ("wikipedia_(en)", "ngram_13_0.8")}
    from mia.data.text import load_mimir

    m, n = idx[("arxiv", "ngram_7_0.2")]
    ex, _ = load_mimir(member=str(m), nonmember=str(n))
    assert [e["label"] for e in ex] == [1, 1, 1, 0, 0] and all(isinstance(e["text"], str) for e in ex)


@pytest.mark.slow
def test_mimir_run_on_a_tiny_model(tmp_path, tiny_neox_dir, monkeypatch):
    """The whole --mimir path on fake files (about a minute on 2 busy cores: CAMIA compiles for new shapes)."""
    root = _fake_mimir(tmp_path / "mimir", {"arxiv_ngram_7_0.2": (36, 36), "arxiv_ngram_13_0.8": (12, 12),
                                            "github_ngram_7_0.2": (12, 12)})
    why = "ImportError: scikit-learn missing"  # the blind baseline cannot run: its reason stays, its row does not
    monkeypatch.setattr(exp, "run_blind_baselines", lambda *a, **k: ([], None, {"bow": why}))
    s = exp.run("smoke", tmp_path / "out", mimir=root, model_dir=tiny_neox_dir, draws=2, blind=True,
                progress=False)
    assert "blind" not in s["results"]["arxiv"] and why in s["skipped"]["arxiv/ngram_7_0.2: blind"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"- arxiv/ngram_7_0.2: blind: BoW + LR did not run (bow: {why})" in report
    assert s["datasets"] == ["arxiv", "github"]
    arxiv = s["results"]["arxiv"]
    assert "camia:george" in arxiv and arxiv["loss"]["n_draws"] == 2
    assert "camia:george" not in s["results"]["github"]  # 30% of 12 non-members < 10: skipped, with the reason
    assert any("github" in k and "camia" in k for k in s["skipped"])
    assert [(r["domain"], r["split"]) for r in s["table2"]] == [("arxiv", "ngram_13_0.8"), ("arxiv", "ngram_7_0.2")]


def test_mimir_bad_input_is_one_line(tmp_path, tiny_neox_dir, capsys):
    root = _fake_mimir(tmp_path / "mimir", {"arxiv_ngram_7_0.2": (2, 2), "github_ngram_13_0.8": (2, 2)})
    cases = [
        (["--mimir", str(root), "--model", str(tiny_neox_dir), "--domains", "pubmed_central"],
         "domains there: arxiv (ngram_7_0.2); github (ngram_13_0.8)"),
        (["--mimir", str(root), "--model", str(tmp_path / "nope")], "model directory not found"),
        (["--mimir", str(root)], "--mimir needs --model"),
        (["--mimir", str(tmp_path / "empty"), "--model", str(tiny_neox_dir)], "--mimir"),
    ]
    for argv, want in cases:
        assert exp.main(argv + ["--out", str(tmp_path / "o"), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and want in err[0], err


def test_mimir_model_and_ref_checked_first(tmp_path, tiny_neox_dir, capsys):
    """--model and --ref-model are opened and checked before any MIMIR file is read: identical weights refused
    naming both; a config the family refuses is one line naming the checkpoint; nothing is written."""
    import shutil

    root = _fake_mimir(tmp_path / "mimir", {"arxiv_ngram_7_0.2": (2, 2)})
    ref = tmp_path / "ref"
    shutil.copytree(tiny_neox_dir, ref)
    out = tmp_path / "o"
    argv = ["--mimir", str(root), "--model", str(tiny_neox_dir), "--ref-model", str(ref), "--out", str(out),
            "--no-progress"]
    assert exp.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "identical weights" in err[0] and str(tiny_neox_dir) in err[0] and str(ref) in err[0]
    assert "--allow-identical-checkpoints" in err[0] and not out.exists()
    cfg = json.loads((ref / "config.json").read_text())
    (ref / "config.json").write_text(json.dumps(dict(cfg, num_attention_heads=5)))
    assert exp.main(argv + ["--allow-identical-checkpoints"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(ref / "config.json") in err[0] and not out.exists()


def test_a_text_in_both_mimir_files_drops_the_non_member_with_a_note(tmp_path):
    """MIMIR's member and non-member files may share a text: the non-member copy is dropped (the member kept) with a
    counted note, as checkmiabench does, instead of ``mia.score`` refusing the whole domain."""
    from mia.data.draw import label_conflicts
    from mia import api

    root = _fake_mimir(tmp_path, {"arxiv_ngram_7_0.2": (3, 3)})
    m, n = mimir.mimir_index(root)[("arxiv", "ngram_7_0.2")]
    shared = json.loads(m.read_text().splitlines()[1])
    n.write_text(n.read_text() + json.dumps(shared) + "\n" + json.dumps("a b") + "\n")
    fake_tokenizer = lambda t: {"input_ids": [ord(c) for c in t]}  # noqa: E731
    ex, notes = mimir.mimir_examples(m, n, fake_tokenizer, None, 0)
    assert [e["label"] for e in ex] == [1, 1, 1, 0, 0, 0, 0] and label_conflicts(ex) == []
    assert [e["text"] for e in ex if e["label"] == 1][1] == shared and shared not in [e["text"] for e in ex
                                                                                       if e["label"] == 0]
    assert any("1 non-member text(s) with the same text or token ids as a member text dropped" in x for x in notes)
    api.check_data(api.read_data([{k: e[k] for k in ("id", "text", "label")} for e in ex]))


def test_without_label_conflicts_keeps_the_member_and_counts():
    from mia.data.draw import without_label_conflicts

    rows = [{"id": "a", "label": 1, "tokens": [1, 2, 3]}, {"id": "b", "label": 0, "tokens": [1, 2, 3]},
            {"id": "c", "label": 0, "tokens": [1, 2]}, {"id": "d", "label": 1, "tokens": [1, 2, 3]},
            {"id": "e", "label": 0, "text": "x", "tokens": [9, 9]}, {"id": "f", "label": 1, "text": "x"}]
    kept, n = without_label_conflicts(rows)
    assert [e["id"] for e in kept] == ["a", "c", "d", "f"] and n == 2
