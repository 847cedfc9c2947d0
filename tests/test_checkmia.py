"""The main job (experiments.checkmia) on the smoke testbed: the split by construction, outputs, bad inputs."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from experiments.checkmia import draw_split, main, run
from mia.data.splits import SplitError


def test_split_correct_by_construction(smoke_testbed, tmp_path):
    from mia.data.splits import read_split, write_split
    from mia.data.verify import check_split

    tb = smoke_testbed
    c, B, end = 50, tb.batch_size, tb.epoch_steps
    header, ex = draw_split(tb, c, 60, 70, 40, 20, 5, seed=3)
    mem = [e for e in ex if e["label"] == 1]
    non = [e for e in ex if e["label"] == 0]
    assert len(mem) == 60 + 40 and len(non) == 70 + 40 + 20 + 5
    assert all(0 <= e["index"] < c * B for e in mem)
    assert all(c * B <= e["index"] < end * B for e in non)
    idx = [e["index"] for e in ex]
    assert len(set(idx)) == len(idx)  # disjoint, no repeats
    assert all(e["index"] == e["step"] * B + e["batch_pos"] and e["id"] == f"row{e['index']}" for e in ex)
    rows = tb.dataset().get_rows(idx)
    np.testing.assert_array_equal(np.array([e["tokens"] for e in ex]), rows)
    parts = {(e["partition"], e["label"]) for e in ex}
    assert ("calib", 1) not in parts and ("prefix", 1) not in parts  # learned-from non-member partitions
    assert header["partitions"] == {
        "eval": {"members": 60, "nonmembers": 70},
        "train": {"members": 40, "nonmembers": 40},
        "calib": {"members": 0, "nonmembers": 20},
        "prefix": {"members": 0, "nonmembers": 5},
    }
    assert header["source"]["kind"] == "testbed" and header["params"]["member_rows"] == [0, c * B]
    assert header["params"]["nonmember_rows"] == [c * B, end * B]
    again = draw_split(tb, c, 60, 70, 40, 20, 5, seed=3)[1]
    assert again == ex
    other = draw_split(tb, c, 60, 70, 40, 20, 5, seed=4)[1]
    assert [e["index"] for e in other] != idx
    path = write_split(tmp_path / "s.jsonl", header, ex)
    assert check_split(path) == []
    back = read_split(path)
    assert [e["tokens"] for e in back.examples] == [e["tokens"] for e in ex]
    # check_split re-reads the testbed's .bin: a changed token and a member moved past c are caught, by line
    bad = [dict(e, tokens=list(e["tokens"])) for e in ex]
    bad[2]["tokens"][5] = (bad[2]["tokens"][5] + 1) % 50
    moved = next(i for i, e in enumerate(bad) if e["label"] == 0)
    bad[moved]["label"] = 1
    problems = check_split(write_split(tmp_path / "bad.jsonl", header, bad))
    assert any(p.startswith("line 4:") and "tokens differ" in p for p in problems), problems
    assert any(p.startswith(f"line {moved + 2}:") for p in problems), problems


def test_split_errors(smoke_testbed):
    tb = smoke_testbed
    with pytest.raises(SplitError, match=r"checkpoint step 5000 is beyond the run: the testbed trained 100 steps"):
        draw_split(tb, 5000, 10, 10, 0, 0, 0, seed=0)
    with pytest.raises(SplitError, match=r"asks for 2000 members .* has seen only 1600 rows"):
        draw_split(tb, 100, 2000, 10, 0, 0, 0, seed=0)
    with pytest.raises(SplitError, match=r"non-members .* hold only \d+ rows"):
        draw_split(tb, 100, 10, 100_000, 0, 0, 0, seed=0)
    with pytest.raises(SplitError, match="no members"):
        draw_split(tb, 0, 10, 10, 0, 0, 0, seed=0)


def test_testbed_rows_are_scored_whole(smoke_testbed):
    """A testbed row holds seq_len + 1 tokens (the training target of its last position included); scored, it keeps
    every token and makes seq_len predictions, each one within the trained context. The experiments used to cut
    rows to seq_len, so one target token per row was never scored."""
    import mia
    from mia.data.draw import SplitSizes, draw_testbed_split

    tb = smoke_testbed
    _, examples, _ = draw_testbed_split(tb, tb.train_steps, SplitSizes(eval=3), seed=0)
    run = mia.score(tb.load_model(tb.train_steps), [e for e in examples if e["partition"] == "eval"], "loss",
                    progress=False, cache=False)
    assert [e.n_tokens for e in run.examples] == [tb.row_len] * 6 and tb.row_len == tb.config.seq_len + 1
    assert not any(e.truncated for e in run.examples) and not any("truncated" in n for n in run.notes)
    stats = run.context.stats()
    assert all(len(s["logprob"]) == tb.config.seq_len and np.isfinite(s["logprob"]).all() for s in stats)


def test_main_job_end_to_end(smoke_testbed, tmp_path):
    out = tmp_path / "run"
    s = run("smoke", out, testbed_dir=smoke_testbed.root, attacks="loss,mink,zlib", blind_features=("bow",),
            bootstrap=200, progress=False)
    for f in ("report.md", "summary.json", "scores.jsonl", "split.jsonl", "roc.png", "manifest.json"):
        assert (out / f).exists() and (out / f).stat().st_size > 0, f
    summary = json.loads((out / "summary.json").read_text())
    methods = [r["method"] for r in summary["rows"]]
    assert methods[0] == "BoW (tokens)" and {"loss", "mink", "zlib"} <= set(methods)
    for r in summary["rows"]:
        assert set(r) >= {"method", "auc", "auc_se", "tpr_at_1pct_fpr"} and 0 <= r["auc"] <= 1
    assert summary["split"]["step"] == 100 and summary["split"]["n_eval_members"] == 100
    # the smoke split is drawn i.i.d. from one corpus, so no blind baseline may beat chance: the verdict is PASS,
    # and it judges the best of the blind runs written next to it (Bonferroni over all of them)
    v, blind = summary["blind_verdict"], summary["blind"]
    assert v["passed"] is True and v["text"].startswith("PASS: no blind baseline is significantly above AUC 0.5")
    assert v["significant"] == [] and v["m"] == len(blind) >= 1 and v["threshold"] == pytest.approx(0.05 / len(blind))
    top = max(blind, key=lambda r: r["auc"])
    assert v["best_method"] == top["method"] and v["best_auc"] == top["auc"]
    assert v["p_value"] == top["p_auc_gt_half"] >= v["threshold"] and abs(v["best_auc"] - 0.5) < 0.15
    assert [r["group"] for r in summary["recency"]] == ["last 5% of steps", "5-25% of steps", "older (>25%)"]
    assert sum(r["n_members"] for r in summary["recency"]) == 100
    lines = [json.loads(l) for l in (out / "scores.jsonl").read_text().splitlines()]
    assert len(lines) == 200 and set(lines[0]["scores"]) == {"loss", "mink", "zlib"}
    assert all(l["index"] < 100 * 16 for l in lines if l["label"] == 1)
    man = json.loads((out / "manifest.json").read_text())
    assert man["hashes"]["corpus_sha256"] == smoke_testbed.manifest["corpus"]["sha256"]
    assert len(man["hashes"]["checkpoint_sha256"]) == 64 and man["seeds"]["split"] == 0
    report = (out / "report.md").read_text()
    assert "| loss |" in report and "Recency" in report and f"**Blind baselines:** {v['text']}" in report
    # reusing the same testbed and seed gives the same split file
    s2 = run("smoke", tmp_path / "run2", testbed_dir=smoke_testbed.root, attacks="loss", blind=False, bootstrap=50,
             progress=False)
    assert (tmp_path / "run2" / "split.jsonl").read_text() == (out / "split.jsonl").read_text()
    assert s2["rows"][0]["auc"] == next(r["auc"] for r in s["rows"] if r["method"] == "loss")


def test_main_job_default_attacks_skip_what_the_testbed_lacks():
    from experiments.checkmia import select_attacks

    from mia.attacks import available

    run_, skipped = select_attacks(None)
    names = [n for _, n, _ in run_]
    budget = "not in the default preset's time budget: "
    again = "; run with --attacks all or name it in --attacks"
    pairwise = "pairwise N x N conditional likelihoods (O(N^2) model calls)" + again
    expected = {  # the testbed has no reference model and no MLM; the rest is left out for time only
        **dict.fromkeys(("ref", "ez_mia", "wbc"),
                        "needs a reference model (--ref-model), which this experiment does not have"),
        "neighbor": "needs a masked language model (--mlm), which this experiment does not have",
        "em_mia": pairwise, "recall_avg": pairwise,
        "camia": budget + "~0.2 s per example", "camia_lr": budget + "CAMIA signals of the train partition",
        "samia": budget + "10 sampled continuations per example", "samia_zlib": budget + "10 sampled continuations per "
                                                                                         "example",
        "pac": budget + "10 augmented copies of every example",
        **dict.fromkeys(("gradnorm", "alora", "jl"), budget + "one forward and one backward pass per example"),
        "combine": budget + "every combined attack runs on the train partition too"}
    assert set(skipped) == set(expected)
    for name, reason in expected.items():
        assert skipped[name].startswith(reason), (name, skipped[name])
        assert skipped[name].endswith(again) or name in ("ref", "ez_mia", "wbc", "neighbor"), (name, skipped[name])
    # every other registered attack runs, once, under its own name with its defaults
    assert sorted(names) == sorted(set(available()) - set(expected)) and len(names) == len(set(names))
    assert {"loss", "mink", "minkpp", "zlib", "recall", "conrecall", "mope"} <= set(names)
    assert all(label == name for label, name, _ in run_)
    # "all" keeps only what the testbed cannot run; an explicit list is taken as asked
    run_all, skipped_all = select_attacks("all")
    assert set(skipped_all) == {"ref", "ez_mia", "wbc", "neighbor"}
    assert {"em_mia", "camia", "pac"} <= {n for _, n, _ in run_all}
    run_two, skipped_two = select_attacks("camia,ref")
    assert [n for _, n, _ in run_two] == ["camia"] and set(skipped_two) == {"ref"}


def test_main_job_bad_inputs(smoke_testbed, tmp_path, capsys):
    base = ["--preset", "smoke", "--testbed", str(smoke_testbed.root), "--no-progress", "--no-blind", "--attacks",
            "loss"]
    assert main(base + ["--out", str(tmp_path / "a"), "--steps", "900"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint step 900 is beyond the run" in err[0]
    assert main(base + ["--out", str(tmp_path / "b"), "--n-members", "5000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "asks for 5100 members" in err[0] and "1600 rows" in err[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--preset", "smoke", "--testbed", str(tmp_path / "tb"), "--corpus", str(empty), "--no-progress",
                 "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "empty" in err[0]


@pytest.mark.slow  # default-run time; make test-all runs it
def test_main_job_with_memorization_dial(smoke_testbed, tmp_path):
    # same members and seed as test_testbed's dial test, so the dial checkpoint is reused when both run
    s = run("smoke", tmp_path / "mem", testbed_dir=smoke_testbed.root, attacks="loss", blind=False, bootstrap=100,
            memorize_epochs=8, n_members=100, n_train=0, n_calib=0, n_prefix=0, seed=1, progress=False)
    loss = next(r for r in s["rows"] if r["method"] == "loss")
    ref = next(r for r in s["rows"] if r["kind"] == "reference")
    assert loss["auc"] >= 0.8 and loss["auc"] > ref["auc"]
    assert s["memorize"]["epochs"] == 8 and s["memorize"]["n_rows"] == 100


@pytest.mark.slow  # default-run time; make test-all runs it
def test_quickstart_notebook_runs(smoke_testbed, monkeypatch):
    from pathlib import Path

    import nbformat
    from nbclient import NotebookClient

    nb_path = Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"
    nb = nbformat.read(nb_path, as_version=4)
    monkeypatch.setenv("MIA_TESTBED_DIR", str(smoke_testbed.root))
    # the kernel imports the mia under test (this checkout), not whichever one is installed
    root = str(Path(__file__).resolve().parent.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(nb_path.parent)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "loss" in outputs and "AUC" in outputs
    images = [
        o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if "image/png" in o.get("data", {})
    ]
    assert len(images) >= 2  # ROC and the per-token traces
    # a cell ending with `run` shows the summary line and the metrics table (text and HTML), not the arrays
    shown = next(o["data"] for c in nb.cells if c.cell_type == "code" and c.source.startswith("import mia")
                 for o in c.outputs if o.get("output_type") == "execute_result")
    text = shown["text/plain"]
    assert text.startswith("ScoreRun: 300 examples (150 members, 150 non-members), 4 attacks"), text
    assert len(text.splitlines()) <= 40 and "AUC" in text and "<table>" in shown["text/html"]


@pytest.mark.slow
def test_default_main_job_from_nothing(tmp_path):
    """The README main job on the default preset: < 15 min on 2 CPU cores from nothing (measured ~5 min idle)."""
    import time

    t0 = time.perf_counter()
    s = run("default", tmp_path / "run", testbed_dir=tmp_path / "tb", progress=False)
    assert time.perf_counter() - t0 < 15 * 60
    for f in ("report.md", "summary.json", "scores.jsonl", "split.jsonl", "roc.png", "manifest.json"):
        assert (tmp_path / "run" / f).exists()
    loss = next(r for r in s["rows"] if r["method"] == "loss")
    assert abs(loss["auc"] - 0.5) < 3 * loss["auc_se"], loss  # clean one-epoch split: no real signal expected
    assert s["blind_verdict"]["passed"]
    mem = run("default", tmp_path / "mem", testbed_dir=tmp_path / "tb", attacks="loss", blind=False,
              memorize_epochs=4, progress=False)
    assert next(r for r in mem["rows"] if r["method"] == "loss")["auc"] >= 0.8


@pytest.mark.slow  # (20 s) the default run keeps the dial on a suite member (test_checkmiabench)
def test_attacks_detect_the_memorization_dial(smoke_testbed, tmp_path):
    """Issue 'attack suite': on the dial split, every attack the testbed supports sees the signal."""
    attacks = "loss,mink,minkpp,zlib,recall:n=4,mope,camia"
    s = run("smoke", tmp_path / "dial", testbed_dir=smoke_testbed.root, attacks=attacks, blind=False, bootstrap=100,
            memorize_epochs=8, n_members=100, n_train=0, n_calib=30, n_prefix=4, seed=1, progress=False)
    auc = {r["method"]: r["auc"] for r in s["rows"] if r["kind"] == "attack"}
    assert set(auc) == {"loss", "mink", "minkpp", "zlib", "recall:n=4", "mope", "camia"}, s["skipped"]
    assert all(a >= 0.7 for a in auc.values()), auc
