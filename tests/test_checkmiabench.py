"""experiments.checkmiabench and experiments.curves: the smoke preset end to end (shared with the notebook test),
byte-identical tables for the same seed, the real-model paths on tiny fake files in the real layouts, bad input,
and the curve/trend math against direct references."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from experiments import checkmiabench as cmb, curves
from experiments import checkmiabench_paper as cmb_paper

from notebook_runner import run_notebook
from order_files import LAYOUT_B, LAYOUT_END, LAYOUT_STEP, pythia_layout
from table_check import rendered_again

TABLE_FILES = [f"{stem}.{ext}" for stem in ("blind", "blind_runs", "attacks", "recency", "scale")
               for ext in ("md", "csv", "tex", "json")] + ["report.md", "summary.json"]


def _smoke_source(request) -> dict:
    """The smoke suite when this checkout has it, else the smoke testbed as a suite of one; the smoke run's bootstrap
    resamples (200) given explicitly, as before the experiments shared one default (1000)."""
    try:
        suite = request.getfixturevalue("smoke_suite")
        return {"suite_dir": suite.root, "bootstrap": 200}
    except pytest.FixtureLookupError:
        return {"testbeds": [request.getfixturevalue("smoke_testbed").root], "bootstrap": 200}


@pytest.fixture(scope="session")
def cmb_smoke(request, tmp_path_factory):
    """``--preset smoke`` run once -> (results dir, summary); shared by the end-to-end, table and notebook tests."""
    out = tmp_path_factory.mktemp("checkmiabench") / "a"
    return out, cmb.run("smoke", out, progress=False, **_smoke_source(request))


def test_smoke_end_to_end(cmb_smoke):
    out, s = cmb_smoke
    for f in TABLE_FILES + ["recency.png", "manifest.json", "timings.json"]:
        assert (out / f).exists() and (out / f).stat().st_size > 0, f
    models = [t["model"] for t in s["targets"]]
    steps = sorted({t["step"] for t in s["targets"]})
    assert len(steps) >= 2 and s["kind"] == "testbed"
    # Table 2 layout: every (model, step, attack) that ran has AUC, SE, TPR
    ran = s["attacks_run"]
    assert {"loss", "mink:k=0.1", "minkpp:k=0.1", cmb_paper.PAPER_ZLIB} <= set(ran)
    # the preset's last-checkpoint-only attacks (here the LL/zlib ratio and the paper's ReCaLL) run at the last
    # checkpoint only
    last_only = set(json.loads((out / "manifest.json").read_text())["config"]["attacks_last_checkpoint_only"])
    assert last_only == {"zlib", "recall:variant=checkmia"}

    def ran_at(step):
        return {m for m in ran if step == steps[-1] or m not in last_only}

    got = {(r["model"], r["step"], r["method"]) for r in s["attacks"] if r.get("auc") is not None}
    assert got == {(t["model"], t["step"], m) for t in s["targets"] for m in ran_at(t["step"])}
    for r in s["attacks"]:
        assert 0 <= r["auc"] <= 1 and r["auc_se"] > 0 and 0 <= r["tpr_at_1pct_fpr"] <= 1
    # the paper's ReCaLL runs when registered, else it is skipped with the registry's reason
    assert "recall:variant=checkmia" in ran or "recall:variant=checkmia" in s["skipped"]
    # Table 1 layout: BoW at the last checkpoint, with the classifier chosen and the verdict
    assert [(r["step"], r["method"]) for r in s["blind"]] == [(steps[-1], "BoW (tokens)")]
    assert s["blind"][0]["classifier"] in ("LR", "RF", "MLP")
    assert s["findings"]["blind"][str(steps[-1])].startswith(("PASS", "WARNING"))
    # recency: 8 bins per (model, step, attack), members counted once per curve
    for t in s["targets"]:
        rows = [r for r in s["recency"]
                if (r["model"], r["step"], r["method"]) == (t["model"], t["step"], "loss")]
        assert len(rows) == 8 and rows[0]["age_lo"] == 0 and rows[-1]["age_hi"] == t["step"]
        assert sum(r["n_members"] for r in rows) == 60
    # scale rows follow the attack table; the findings are the sentences of the computed trends
    assert len(curves.scale_rows(s["attacks"])) == len(s["scale"])
    assert s["findings"]["scale"] == curves.scale_sentence(s["scale_trends"], s["model_free"])
    assert s["findings"]["recency"] == curves.recency_sentence(s["recency_trends"], s["model_free"])
    if len(set(models)) > 1:
        assert (out / "scale.png").exists()
    report = (out / "report.md").read_text()
    assert "Table 2/4 layout" in report and "Findings" in report and s["findings"]["recency"] in report
    lines = [json.loads(l) for l in (out / s["targets"][0]["scores"]).read_text().splitlines()]
    assert len(lines) == 120 and set(lines[0]["scores"]) == ran_at(s["targets"][0]["step"])
    assert all(l["index"] < s["targets"][0]["step"] * 16 for l in lines if l["label"] == 1)


@pytest.mark.slow
def test_same_seed_same_tables_byte_for_byte(request, cmb_smoke, tmp_path):
    a = cmb_smoke[0]
    b = tmp_path / "b"
    cmb.run("smoke", b, progress=False, **_smoke_source(request))
    for f in TABLE_FILES + [p.relative_to(a).as_posix() for p in sorted((a / "splits").glob("*"))]:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert "timings" not in (a / "summary.json").read_text()


def test_tables_are_a_function_of_the_saved_rows(cmb_smoke):
    """report.md and every table CSV rendered again from summary/table rows, under another string-hash seed (by the
    experiment's renderer, without the experiment's jax)."""
    from experiments.checkmiabench_report import report_markdown

    assert cmb.report_markdown is report_markdown
    same = rendered_again("experiments.checkmiabench_report", cmb_smoke[0],
                          ["blind", "blind_runs", "attacks", "recency", "scale"])
    assert same and all(same.values()), same


def test_curves_rebinned_from_saved_scores(cmb_smoke, tmp_path, capsys):
    """python -m experiments.curves RESULTS --bins 4: the curves again from scores/*.jsonl alone, other bins."""
    out = tmp_path / "copy"
    shutil.copytree(cmb_smoke[0], out)
    assert curves.main([str(out), "--bins", "4", "--bootstrap", "50"]) == 0
    assert capsys.readouterr().out.startswith("Recency: ")
    rows = json.loads((out / "recency.json").read_text())["rows"]
    s = cmb_smoke[1]
    last = max(t["step"] for t in s["targets"])  # some attacks run at the last checkpoint only
    last_only = json.loads((out / "manifest.json").read_text())["config"]["attacks_last_checkpoint_only"]
    per_target = [len(s["attacks_run"]) - (t["step"] != last) * len(last_only) for t in s["targets"]]
    assert len(rows) == 4 * sum(per_target) and {r["bin"] for r in rows} == {0, 1, 2, 3}
    assert (out / "scale.json").read_bytes() == (cmb_smoke[0] / "scale.json").read_bytes()
    assert curves.main([str(tmp_path)]) == 2
    assert "not a checkmiabench results directory" in capsys.readouterr().err


def test_notebook_computes_the_tables(cmb_smoke, monkeypatch):
    """The notebook reads this run (not another), orders models by size, shows every AUC ± SE of the attack table
    and the blind rows, draws the plots, and its ROC scores give the saved AUC of their target."""
    out, s = cmb_smoke
    ns, shown, printed = run_notebook("checkmiabench", monkeypatch, {"MIA_CHECKMIABENCH_DIR": out})
    assert ns["S"] == json.loads((out / "summary.json").read_text())
    by_size = sorted(s["targets"], key=lambda t: t["params"])
    assert ns["models"] == list(dict.fromkeys(t["model"] for t in by_size))
    text = shown.text()
    for r in s["attacks"]:
        if r.get("auc") is not None:
            assert f"{r['auc']:.3f} ± {r['auc_se']:.3f}" in text, r
    for r in s["blind"]:
        assert r["method"] in text
    assert s["findings"]["scale"] in printed and s["findings"]["recency"] in printed
    assert len(shown.images()) >= 3  # recency, scale, ROC
    target = ns["target"]
    assert target == max(s["targets"], key=lambda t: (t["step"], t["params"]))
    saved = {r["method"]: r["auc"] for r in s["attacks"]
             if (r["model"], r["step"]) == (target["model"], target["step"]) and r.get("auc") is not None}
    for method, auc in saved.items():
        assert roc_auc_score(ns["labels"], ns["scores"][method]) == pytest.approx(auc, abs=1e-9), method
    # the notebook's last cells redo the target's split and LOSS score through mia.data.draw / mia.checkpoints /
    # mia.score: the same split row for row (asserted in the notebook); the AUC of that run's own scores (sklearn)
    # is the API's and the table's
    api = ns["api_run"]
    assert ns["table_auc"] == saved["loss"]  # the notebook's table row is the one read above
    redone = roc_auc_score(api.labels, api.scores["loss"])
    assert ns["api_auc"] == pytest.approx(redone, abs=1e-9) and ns["table_auc"] == pytest.approx(redone, abs=1e-9)


# ----------------------------------------------------------------------------------------------- curves math
def test_recency_rows_equal_a_direct_computation():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    c, n = 40, 400
    y = np.r_[np.ones(n // 2, int), np.zeros(n // 2, int)]
    steps = np.where(y == 1, rng.integers(0, c, n), -1)
    age = c - steps
    s = rng.normal(size=n) + (y == 1) * (1.0 - age / c)  # recent members score higher
    rows = curves.recency_rows({"x": s, "y": -s}, y, steps, c, 8, 50, 0, model="m", step=c)
    assert [r["bin"] for r in rows if r["method"] == "x"] == list(range(8))
    for r in rows:
        pick = (y == 0) | ((y == 1) & (age > r["age_lo"]) & (age <= r["age_hi"]))
        assert r["n_members"] == int(((y == 1) & pick).sum())
        sign = 1 if r["method"] == "x" else -1
        assert r["auc"] == pytest.approx(roc_auc_score(y[pick], sign * s[pick]))
        assert r["auc_ci_low"] <= r["auc"] <= r["auc_ci_high"]
    assert sum(r["n_members"] for r in rows if r["method"] == "x") == n // 2
    t = {x["method"]: x for x in curves.recency_trends(rows)}
    assert t["x"]["rho"] < 0 and t["x"]["delta"] < 0 and t["y"]["rho"] > 0
    with pytest.raises(ValueError, match="not before checkpoint"):
        curves.recency_rows({"x": s}, y, np.where(y == 1, c, -1), c, 8, 10, 0)


def test_trend_sentences_follow_the_numbers():
    def scale(aucs):
        return [{"step": 9, "method": "loss", "model": f"m{i}", "params": 10 ** (i + 3), "auc": a, "auc_se": 0.01}
                for i, a in enumerate(aucs)]

    up = curves.scale_sentence(curves.scale_trends(scale([0.5, 0.55, 0.6])))
    assert "as the papers report" in up and "for 1 of 1" in up and "NOT" not in up
    down = curves.scale_sentence(curves.scale_trends(scale([0.6, 0.55, 0.5])))
    assert "NOT higher on the largest model for 1 of 1" in down and "loss@step9" in down
    # a model-free method is left out of the trend
    assert "fewer than two" in curves.scale_sentence(curves.scale_trends(scale([0.6, 0.5])), model_free=["loss"])
    t = curves.trend([1, 2, 3], [0.5, 0.6, 0.7], [0.01, 0.01, 0.01])
    assert t["increasing"] and t["rho"] == pytest.approx(1.0) and t["z"] == pytest.approx(0.2 / np.hypot(.01, .01))


def test_paper_numbers_lookup():
    attack_ref, blind_ref = cmb_paper.paper_attack_reference, cmb_paper.paper_blind_reference
    assert attack_ref("pythia", "70m", 97_000, "loss", 98_500) == (0.513, 0.0130, 0.006, "Table 2, row 70m LOSS")
    assert attack_ref("pythia", "2.8b", 97_000, "mope:n=10,sigma=0.005")[:3] == (0.493, 0.0131, 0.006)
    assert attack_ref("olmo", "7b", 400_000, "recall:variant=checkmia")[3] == "Table 4, row 7b ReCaLL"
    assert attack_ref("pythia", "70m", 97_000, "mink") is None  # k = 0.2 is not the paper's k
    assert attack_ref("pythia", "70m", 90_000, "loss") is None  # another checkpoint
    assert attack_ref("testbed", "70m", 97_000, "loss") is None
    assert blind_ref("pythia", 97_000, "BoW (tokens)") == (0.505, 0.0128, 0.01, "Table 1, row BoW (tokens)")
    assert blind_ref("pythia", 97_000, "W2V (tokens)") is None  # our encoder differs
    paper = cmb.PRESETS["paper"]  # the paper's settings (App. A)
    assert paper.attacks == tuple(cmb_paper.PAPER_ATTACKS.values())
    assert (paper.sizes.eval, paper.sizes.train) == (1000, 4000)


def test_paper_setting_differences():
    """The paper's split: no gap, 1,000 evaluated and (blind) 4,000 training rows per class, at its checkpoint."""
    same = {"gap": 0, "end_step": 98_500, "eval_counts": (1000, 1000), "train_counts": (4000, 4000)}
    assert cmb_paper.paper_setting_differences("pythia", 97_000, **same) == []
    assert cmb_paper.paper_setting_differences("olmo", 400_000, gap=0, eval_counts=(1000, 1000)) == []
    assert cmb_paper.paper_setting_differences("pythia", 97_000, **{**same, "gap": 10}) == ["gap 10 (paper: 0)"]
    assert cmb_paper.paper_setting_differences("pythia", 97_000, **{**same, "eval_counts": (800, 800)}) == [
        "eval 800 + 800 (paper: 1,000 + 1,000)"]
    assert cmb_paper.paper_setting_differences("pythia", 90_000, gap=0) == ["step 90000 (paper: 97,000)"]
    assert cmb_paper.paper_setting_differences("testbed", 97_000, gap=0) == ["no paper numbers for kind testbed"]
    assert cmb.PRESETS["paper"].gap == 0  # the paper samples uniformly before and after the checkpoint
    assert cmb.build_parser().parse_args(["--paper", "--gap", "10"]).gap == 10


def test_paper_numbers_only_beside_the_papers_setting(tiny_neox_dir, tmp_path):
    """A Pythia layout at the paper's checkpoint (batch 1, so step 97,000 is 97,000 rows): with gap 0 and 1,000 +
    1,000 evaluated rows the paper's LOSS row stands beside ours; with --gap 10 it does not, and a note says why."""
    import transformers

    from mia.data.indexed import write_indexed

    vocab = len(transformers.AutoTokenizer.from_pretrained(str(tiny_neox_dir)))
    step, end = cmb_paper.PAPER_SETTING["pythia"]["step"], cmb_paper.PAPER_SETTING["pythia"]["end_step"]
    shutil.copytree(tiny_neox_dir, tmp_path / "models" / "pythia-70m-deduped" / f"step{step}")
    rows = np.random.default_rng(0).integers(1, vocab, size=(end + 3, 9))
    write_indexed(tmp_path / "document", rows)
    base = ["--pythia", str(tmp_path / "models"), "--data", str(tmp_path / "document.bin"), "--idx",
            str(tmp_path / "document.idx"), "--batch-size", "1", "--n-members", "1000", "--n-train", "0",
            "--n-prefix", "0", "--attacks", "loss", "--no-blind", "--bootstrap", "20", "--no-progress"]
    assert cmb.main(base + ["--out", str(tmp_path / "same")]) == 0
    s = json.loads((tmp_path / "same" / "summary.json").read_text())
    assert s["attacks"][0]["paper_source"] == "Table 2, row 70m LOSS"
    assert not any("Table 2 numbers are not shown" in n for n in s["notes"])
    assert cmb.main(base + ["--gap", "10", "--out", str(tmp_path / "gap")]) == 0
    s = json.loads((tmp_path / "gap" / "summary.json").read_text())
    assert "paper_auc" not in s["attacks"][0]
    note = (f"step{step}: the paper's Table 2 numbers are not shown beside ours: our setting differs from the paper's "
            "(gap 10 (paper: 0))")
    assert note in s["notes"] and note in (tmp_path / "gap" / "report.md").read_text()


def test_paper_numbers_match_the_paper_text():
    """The paper's numbers printed beside ours are the paper's: checked against its text when
    ``CHECKMIABENCH_TEXT`` names a plain-text copy of the paper (tab-separated tables, as pdftotext -layout writes)."""
    if not os.environ.get("CHECKMIABENCH_TEXT"):
        pytest.skip("CHECKMIABENCH_TEXT (the paper as text) is not set")
    paper = Path(os.environ["CHECKMIABENCH_TEXT"])
    lines = paper.read_text().splitlines()
    for model, row in cmb_paper.PAPER_TABLE2.items():
        for mia, nums in row.items():
            assert f"{model}\t{mia}\t{nums[0]:.3f}\t{nums[1]:.4f}\t{nums[2]:.3f}" in lines, (model, mia)
    t4 = lines[lines.index(next(l for l in lines if l.startswith("Table 4"))):]
    for mia, (a, se, tpr) in cmb_paper.PAPER_TABLE4["7b"].items():
        assert any(l.split("\t") == [mia, f"{a:.3f}", f"{se:.4f}", f"{tpr:g}"] for l in t4), mia
    for table, nums in (("Table 1", cmb_paper.PAPER_TABLE1), ("Table 3", cmb_paper.PAPER_TABLE3)):
        t = lines[lines.index(next(l for l in lines if l.startswith(table))):]
        for ours, paper_name in (("BoW (tokens)", "BoW (Tokens)"), ("TF-IDF (tokens)", "TFIDF (Tokens)")):
            a, se, tpr = nums[ours]
            assert f"{paper_name}\t{a:.3f}\t{se:.4f}\t{tpr:g}" in t, (table, ours)


# ----------------------------------------------------------------------------------------------- real layouts
def test_pythia_layout_end_to_end(tiny_neox_dir, tmp_path):
    import transformers

    vocab = len(transformers.AutoTokenizer.from_pretrained(str(tiny_neox_dir)))
    models, shards, idx, rows = pythia_layout(tmp_path, tiny_neox_dir, vocab)
    out = tmp_path / "out"
    argv = ["--pythia", str(models), "--data", *shards, "--idx", idx, "--steps", str(LAYOUT_STEP),
            "--batch-size", str(LAYOUT_B),
            "--end-step", str(LAYOUT_END), "--n-members", "20", "--n-train", "20", "--n-prefix", "0",
            "--attacks", "loss,mink:k=0.1", "--no-blind", "--bootstrap", "50", "--no-progress",
            "--out", str(out), "--delta", "1e-3"]
    assert cmb.main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    from mia.metrics import epsilon_lower_bound
    from mia.results import read_scores

    lines, scores = read_scores(out / s["targets"][0]["scores"])
    labels = np.array([l["label"] for l in lines])
    for r in s["attacks"]:  # --delta: eps_lower in the table, the bound of the saved scores
        assert r["eps_lower"] == pytest.approx(epsilon_lower_bound(scores[r["method"]], labels, delta=1e-3))
    assert "eps_lower" in (out / "attacks.csv").read_text().splitlines()[0]
    assert s["kind"] == "pythia" and [t["model"] for t in s["targets"]] == ["70m"]
    assert {r["method"] for r in s["attacks"]} == {"loss", "mink:k=0.1"}
    assert "paper_auc" not in s["attacks"][0]  # step 100 is not the paper's setting
    from mia.data.splits import read_split
    from mia.data.verify import check_split

    split = read_split(out / "splits" / f"step{LAYOUT_STEP}.jsonl")
    assert split.header["source"]["kind"] == "pythia" and check_split(out / "splits" / f"step{LAYOUT_STEP}.jsonl") == []
    for e in split.examples:  # rows read through the two shards equal the rows written
        assert e["tokens"] == rows[e["index"]].tolist()
        assert (e["index"] < LAYOUT_STEP * LAYOUT_B) == (e["label"] == 1) and e["index"] < LAYOUT_END * LAYOUT_B
    assert len(s["recency"]) == 2 * 8 and (out / "attacks.tex").exists()


def _run_with_planted_copy(tiny_neox_dir, tmp_path, copy_of, original) -> tuple:
    """Draw the tiny Pythia layout's split once, then write the layout again with the row of the drawn example
    picked by ``copy_of`` overwritten by the one picked by ``original`` (each: (partition, label)), and run
    checkmiabench on it -> (copy, original, results dir, summary)."""
    import transformers

    from mia.data.draw import draw_pythia_split

    vocab = len(transformers.AutoTokenizer.from_pretrained(str(tiny_neox_dir)))
    _, shards, idx, _ = pythia_layout(tmp_path / "clean", tiny_neox_dir, vocab)
    sizes = cmb.PRESETS["default"].sizes.replace(eval=20, train=20, prefix=0)
    _, drawn, _ = draw_pythia_split(shards, idx, LAYOUT_STEP, sizes, 0, end_step=LAYOUT_END, batch_size=LAYOUT_B)

    def pick(partition, label):
        return next(e for e in drawn if e["partition"] == partition and e["label"] == label)

    copy, orig = pick(*copy_of), pick(*original)
    models, shards, idx, _ = pythia_layout(tmp_path / "dup", tiny_neox_dir, vocab,
                                           copies=[(copy["index"], orig["index"])])
    out = tmp_path / "out"
    argv = ["--pythia", str(models), "--data", *shards, "--idx", idx, "--steps", str(LAYOUT_STEP),
            "--batch-size", str(LAYOUT_B), "--end-step", str(LAYOUT_END), "--n-members", "20", "--n-train", "20",
            "--n-prefix", "0", "--attacks", "loss", "--no-blind", "--bootstrap", "20", "--no-progress",
            "--out", str(out)]
    assert cmb.main(argv) == 0
    return copy, orig, out, json.loads((out / "summary.json").read_text())


def test_pythia_duplicate_of_a_learned_row_is_dropped_not_fatal(tiny_neox_dir, tmp_path):
    """Real orders hold exact duplicate rows: an evaluated row equal to a training row is left out (the training
    copy kept), counted in the summary and the report, and the run goes on; the split still checks clean."""
    from mia.data.splits import read_split
    from mia.data.verify import check_split

    ev, train, out, s = _run_with_planted_copy(tiny_neox_dir, tmp_path, ("eval", 1), ("train", 1))
    assert s["splits"][str(LAYOUT_STEP)]["duplicates_dropped"] == 1
    assert any("1 evaluated row(s) with the same tokens as a learned-from row dropped" in n and ev["id"] in n
               for n in s["notes"])
    assert "1 evaluated row(s) equal to a learned-from row dropped" in (out / "report.md").read_text()
    path = out / "splits" / f"step{LAYOUT_STEP}.jsonl"
    ids = [e["id"] for e in read_split(path).examples]
    assert ev["id"] not in ids and train["id"] in ids
    assert s["attacks"][0]["n"] == 20 + 20 - 1
    assert check_split(path) == []  # the dropped row is in the header, so the re-draw from the seed still agrees


def test_pythia_member_copy_among_nonmembers_is_dropped_not_fatal(tiny_neox_dir, tmp_path):
    """An evaluated non-member row equal to an evaluated member row (a real order's duplicate on both sides of the
    checkpoint): ``mia.score`` refuses one input labelled both, so the draw leaves the non-member copy out (the
    member kept), notes it, and the split still checks clean."""
    from mia.data.splits import read_split
    from mia.data.verify import check_split

    nonmember, member, out, s = _run_with_planted_copy(tiny_neox_dir, tmp_path, ("eval", 0), ("eval", 1))
    assert s["splits"][str(LAYOUT_STEP)]["label_conflicts_dropped"] == 1
    assert any("1 evaluated non-member row(s) with the same tokens as an evaluated member dropped" in n
               and nonmember["id"] in n for n in s["notes"])
    path = out / "splits" / f"step{LAYOUT_STEP}.jsonl"
    ids = [e["id"] for e in read_split(path).examples]
    assert nonmember["id"] not in ids and member["id"] in ids
    assert check_split(path) == []


def test_count_params_skips_buffers_of_old_pythia_checkpoints(tiny_neox_dir, tiny_neox_torch, tmp_path):
    """Old Pythia checkpoints carry the causal masks and rotary inv_freq as tensors: they are not parameters."""
    from safetensors.numpy import load_file, save_file

    import mia.models as mm
    from mia.checkpoints import count_params

    want = sum(p.numel() for p in tiny_neox_torch.parameters())
    assert count_params(tiny_neox_dir) == want
    ckpt = tmp_path / "old"
    shutil.copytree(tiny_neox_dir, ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    for i in range(2):
        tensors[f"gpt_neox.layers.{i}.attention.bias"] = np.tril(np.ones((1, 1, 256, 256), bool))
        tensors[f"gpt_neox.layers.{i}.attention.masked_bias"] = np.array(-1e9, np.float32)
        tensors[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    save_file(tensors, str(ckpt / "model.safetensors"))
    assert count_params(ckpt) == want  # not want + 2 * (65536 + 1 + 4)
    mm.load(ckpt)  # and the loader reads the same checkpoint, skipping the same tensors
    (ckpt / "config.json").unlink()  # no family named: every family's buffer names are skipped
    assert count_params(ckpt) == want


def test_pythia_bad_inputs_one_line_each(tiny_neox_dir, tmp_path, capsys):
    models, shards, idx, _ = pythia_layout(tmp_path / "bad", tiny_neox_dir, 300, bad_token=4000)
    base = ["--pythia", str(models), "--batch-size", str(LAYOUT_B), "--end-step", str(LAYOUT_END), "--n-members", "5",
            "--n-train", "5", "--attacks", "loss", "--no-blind", "--no-progress", "--out", str(tmp_path / "o")]

    def error(argv):
        assert cmb.main(base + argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        return err[0]

    e = error(["--data", *shards, "--idx", idx, "--steps", "999"])
    assert "no size has a checkpoint at step 999" in e and "pythia-70m-deduped: steps 100" in e
    e = error(["--data", *shards, "--idx", idx, "--steps", str(LAYOUT_STEP), "--member", "160m"])
    assert "no checkpoint pythia-160m-deduped/step100" in e and "pythia-70m-deduped: steps 100" in e
    e = error(["--data", *shards, "--idx", idx, "--steps", str(LAYOUT_STEP)])
    # caught as the split is drawn (naming the shard and row), before any model is loaded
    assert "is id 4000, outside the model vocabulary" in e and "do not match the model's tokenizer" in e
    assert ".bin: row " in e
    e = error(["--data", *shards, "--steps", str(LAYOUT_STEP)])
    assert "--idx missing" in e
    e = error(["--idx", idx, "--steps", str(LAYOUT_STEP)])
    assert "--data missing" in e


def test_memorization_dial_on_a_suite_member(request, smoke_suite, tmp_path):
    """--memorize-epochs on one member: the dial's LOSS sees the members; the clean reference row stays."""
    # 50 members (test_checkmia's slow dial test memorizes 100): the dial's signal, through the experiment, on the
    # smallest member (20k parameters: its dial trains at XLA level 0, 3-4 s instead of 9-12 s for the 64-wide one)
    small = min(smoke_suite.members, key=lambda m: m.n_params)
    s = cmb.run("smoke", tmp_path / "dial", testbeds=[small.root], steps=[100], attacks="loss", blind=False,
                n_members=50, n_train=0, n_prefix=0, memorize_epochs=8, seed=1, bootstrap=100, progress=False)
    loss = next(r for r in s["attacks"] if r["method"] == "loss")
    ref = next(r for r in s["attacks"] if r["kind"] == "reference")
    print(f"dial LOSS AUC {loss['auc']:.4f}, reference {ref['auc']:.4f}")  # docs/testing.md quotes it (pytest -s)
    assert loss["auc"] >= 0.8 and loss["auc"] > ref["auc"]
    assert s["memorize_epochs"] == 8 and "Memorization dial" in (tmp_path / "dial" / "report.md").read_text()


@pytest.mark.slow
def test_olmo_layout_end_to_end(tiny_neox_dir, tmp_path):
    """--olmo DIR (stepN-tokens... revisions) with a raw uint32 global_indices and raw uint16 token files."""
    import transformers

    from hf_tiny import save_tiny

    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_neox_dir))
    ckpt = tmp_path / "olmo" / "step20-tokens1M"
    save_tiny(transformers.OlmoConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64), ckpt)
    tok.save_pretrained(str(ckpt))
    seq, b, n_inst = 24, 4, 30 * 4
    rng = np.random.default_rng(0)
    names = []
    for k, n in enumerate((n_inst // 2 * seq + 5, n_inst // 2 * seq)):  # the first file's remainder is dropped
        rng.integers(1, len(tok), size=n).astype("<u2").tofile(tmp_path / f"part-{k}.npy")
        names.append(f"part-{k}.npy")
    (tmp_path / "paths.txt").write_text("\n".join(names) + "\n")
    rng.permutation(n_inst).astype("<u4").tofile(tmp_path / "global_indices.npy")
    out = tmp_path / "out"
    s = cmb.run("smoke", out, olmo=tmp_path / "olmo", global_indices=str(tmp_path / "global_indices.npy"),
                data_paths=str(tmp_path / "paths.txt"), steps=[20], batch_size=b, seq_len=seq, n_members=15,
                n_train=15, n_prefix=0, attacks="loss,minkpp:k=0.1", blind_features=("bow",), bootstrap=50,
                progress=False)
    assert s["kind"] == "olmo" and s["targets"][0]["step"] == 20
    assert {r["method"] for r in s["attacks"]} == {"loss", "minkpp:k=0.1"} and s["blind"][0]["method"] == "BoW (tokens)"
    from mia.data.verify import check_split

    assert check_split(out / "splits" / "step20.jsonl") == []
    assert cmb.main(["--olmo", str(tmp_path / "olmo"), "--global-indices", str(tmp_path / "global_indices.npy"),
                     "--data-paths", str(tmp_path / "paths.txt"), "--steps", "7", "--no-progress",
                     "--out", str(tmp_path / "o2")]) == 2


# ----------------------------------------------------------------------------------------------- checkpoints first
def _layout_argv(models, shards, idx, out, steps) -> list:
    return ["--pythia", str(models), "--data", *shards, "--idx", idx, "--steps", steps, "--batch-size", str(LAYOUT_B),
            "--end-step", str(LAYOUT_END), "--n-members", "10", "--n-train", "0", "--n-prefix", "0", "--attacks",
            "loss", "--no-blind", "--bootstrap", "10", "--no-progress", "--out", str(out)]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_pythia_identical_checkpoints_refused_unless_allowed(tiny_neox_dir, tmp_path, capsys):
    """A step whose weights are a copy of another step's (published repositories serve one step's weights under
    other steps' names) is refused naming both paths, before any split is drawn; --allow-identical-checkpoints runs
    and records the pair in the summary, the report and the manifest."""
    import transformers

    vocab = len(transformers.AutoTokenizer.from_pretrained(str(tiny_neox_dir)))
    models, shards, idx, _ = pythia_layout(tmp_path, tiny_neox_dir, vocab)
    a, b = models / "pythia-70m-deduped" / f"step{LAYOUT_STEP}", models / "pythia-70m-deduped" / "step110"
    shutil.copytree(a, b)
    out = tmp_path / "out"
    argv = _layout_argv(models, shards, idx, out, f"{LAYOUT_STEP},110")
    assert cmb.main(argv) == 2
    e = _one_error_line(capsys)
    assert str(a) in e and str(b) in e and "identical weights" in e and "--allow-identical-checkpoints" in e
    assert not (out / "splits").exists()
    assert cmb.main(argv + ["--allow-identical-checkpoints"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["allow_identical_checkpoints"] is True and s["identical_checkpoints"] == [[str(a), str(b)]]
    assert any("--allow-identical-checkpoints" in n and str(b) in n for n in s["notes"])
    assert "--allow-identical-checkpoints" in (out / "report.md").read_text()
    m = json.loads((out / "manifest.json").read_text())
    recs = m["hashes"]["checkpoints"]
    assert recs["70m-step100"]["digest"] == recs["70m-step110"]["digest"] and recs["70m-step100"]["n_params"] > 0
    assert m["config"]["allow_identical_checkpoints"] is True


def test_pythia_bad_checkpoint_fails_before_the_split(tiny_neox_dir, tmp_path, capsys):
    """A step with a missing tensor, a step with only a pickled file no reader applies to, and a config the family
    refuses: each one error line naming the checkpoint, and no split file written."""
    from safetensors.numpy import load_file, save_file

    import transformers

    vocab = len(transformers.AutoTokenizer.from_pretrained(str(tiny_neox_dir)))
    models, shards, idx, _ = pythia_layout(tmp_path, tiny_neox_dir, vocab)
    ckpt = models / "pythia-70m-deduped" / f"step{LAYOUT_STEP}"
    out = tmp_path / "out"
    argv = _layout_argv(models, shards, idx, out, str(LAYOUT_STEP))
    weights = ckpt / "model.safetensors"
    tensors = load_file(str(weights))
    gone = "gpt_neox.layers.1.mlp.dense_h_to_4h.weight"
    save_file({k: v for k, v in tensors.items() if k != gone}, str(weights))
    assert cmb.main(argv) == 2
    e = _one_error_line(capsys)
    assert str(ckpt) in e and gone in e and "missing" in e
    assert not (out / "splits").exists()
    weights.rename(ckpt / "model.bin")  # a .bin-only step under a name no reader applies to
    assert cmb.main(argv) == 2
    e = _one_error_line(capsys)
    assert str(ckpt) in e and "never loaded" in e and not (out / "splits").exists()
    save_file(tensors, str(weights))
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(cfg, num_attention_heads=5)))
    assert cmb.main(argv) == 2
    e = _one_error_line(capsys)
    assert "config.json" in e and str(ckpt) in e and not (out / "splits").exists()
