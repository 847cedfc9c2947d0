"""experiments.em_mia: the EM-MIA OLMoMIA table on the smoke suite, and its bad-input lines."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from experiments import em_mia as exp, em_mia_report

from notebook_runner import run_notebook
from table_check import rendered_again


@pytest.fixture(scope="session")
def em_mia_smoke(request, tmp_path_factory):
    """The smoke preset run once per session: (output directory, summary, the run's keyword arguments)."""
    try:
        kw = {"suite_dir": request.getfixturevalue("smoke_suite").root}
    except pytest.FixtureLookupError:
        kw = {"testbeds": [request.getfixturevalue("smoke_testbed").root]}
    out = tmp_path_factory.mktemp("em_mia_smoke") / "run"
    return out, exp.run("smoke", out, progress=False, **kw), kw


def _auc(s, y):
    """Mann-Whitney AUC, ties 1/2 (independent of sklearn)."""
    pos, neg = s[y == 1], s[y == 0]
    return ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (len(pos) * len(neg))


def test_dedup_texts_drops_every_copy():
    ex = [{"tokens": [1, 2], "label": 1}, {"tokens": [1, 2], "label": 0}, {"tokens": [3], "label": 0}]
    kept, dropped = exp.dedup_texts(ex)
    assert kept == [{"tokens": [3], "label": 0}] and dropped == 2


def test_olmo_preset_is_never_switched_silently():
    """--olmo without --preset: the paper preset (OLMoMIA's recipe) and one line saying so; a preset given is kept."""
    assert exp.preset_for(None, None) == ("default", None)
    name, why = exp.preset_for(None, "/models/olmo-7b")
    assert name == "paper" and why.startswith("preset paper: --olmo without --preset runs OLMoMIA's recipe (pool 50")
    assert exp.preset_for("default", "/models/olmo-7b") == ("default", None)  # asked for: not replaced
    assert exp.build_parser().parse_args(["--olmo", "x"]).preset is None
    assert exp.build_parser().parse_args(["--olmo", "x", "--preset", "default"]).preset == "default"


def test_n_shots_fit_the_trained_context():
    assert exp.n_shots(128, 64) == 1  # one 64-token shot beside a 64-token text
    assert exp.n_shots(2048, 128) == 12  # OLMo: ReCaLL's default n (15 would fit)
    assert exp.n_shots(64, 32) == 1


def test_smoke_six_splits_and_tables(em_mia_smoke):
    from mia.data.splits import read_split

    out, s, _ = em_mia_smoke
    size = s["difficulty"]["params"]["size"]
    pairs = s["difficulty"]["info"]["pairs"]
    assert pairs["easy"][2] >= pairs["medium"][2] >= pairs["hard"][2]  # farthest ... closest cluster pair
    members = {}
    for name in exp.SPLITS:
        ex = read_split(out / "splits" / f"{name}.jsonl").examples
        y = [e["label"] for e in ex]
        assert y.count(1) == y.count(0) == size // 2, name  # non-degenerate: both classes, size/2 each
        assert len({tuple(e["tokens"]) for e in ex}) == size, name
        members[name] = {e["id"] for e in ex if e["label"] == 1}
    assert members["mix-1"] == members["random"] and members["mix-2"] == members["hard"]
    for f in ("report.md", "table_auc.md", "table_auc.csv", "table_auc.tex", "table_tpr.md", "values.csv",
              "summary.json", "manifest.json", "timings.json"):
        assert (out / f).exists(), f
    methods = {r["method"] for r in s["table_auc"]}
    for m in ("Loss", "Zlib", "Min-K% (k=0.2)", "Min-K%++ (k=0.2)", "ReCaLL (1-shot)", "ReCaLL-Avg",
              "EM-MIA (init Loss)", "EM-MIA (init Min-K%++)", "Blind: BoW + LR"):
        assert m in methods, m
    if len(s["models"]) > 1:  # the suite: the smallest member is the reference of the larger ones
        assert "Ref" in methods and "EM-MIA (init Ref)" in methods
    # every AUC in the table is the AUC of the scores written for that model and split
    model = s["models"][-1]["name"]
    for name in exp.SPLITS:
        lines = [json.loads(l) for l in (out / "scores" / model / f"{name}.jsonl").read_text().splitlines()]
        y = np.array([l["label"] for l in lines])
        for label, disp in (("loss", "Loss"), ("em_mia:init=loss", "EM-MIA (init Loss)")):
            sc = np.array([l["scores"][label] for l in lines])
            row = next(r for r in s["table_auc"] if r["model"] == model and r["method"] == disp)
            assert row[name] == pytest.approx(_auc(sc, y), abs=1e-12), (name, label)


def test_pool_and_prefix_headers_describe_their_rows(em_mia_smoke):
    """pool.jsonl and prefix.jsonl: each header's counts and partitions are its own rows', the rows' length is the
    header's cut, and ``mia split check`` finds nothing wrong (the rest of the draw is the header's dropped_rows)."""
    from mia.data.splits import partition_counts, read_split
    from mia.data.verify import verify_split

    out, s, _ = em_mia_smoke
    for name, partition in (("pool", "eval"), ("prefix", "prefix")):
        path = out / "splits" / f"{name}.jsonl"
        sp = read_split(path)
        now = partition_counts(sp.examples)
        assert sp.header["counts"] == now["counts"] and sp.header["partitions"] == now["partitions"], name
        assert set(sp.header["partitions"]) == {partition}, name
        assert {len(e["tokens"]) for e in sp.examples} == {sp.header["params"]["cut_len"]}, name
        check = verify_split(path)
        assert check.problems == [] and check.not_verified == [], (name, check)


@pytest.mark.slow  # the whole run twice; the tables' determinism on fixed rows is checked in the default run
def test_smoke_same_seed_same_tables(em_mia_smoke, tmp_path):
    """A second run gives the same tables byte for byte (the MiniLM embeddings of the pool are reused, for time: the
    pool itself is drawn again and must match their ids)."""
    out, _, kw = em_mia_smoke
    exp.run("smoke", tmp_path, progress=False, embeddings=str(out / "splits" / "embeddings.npz"), **kw)
    for f in ("table_auc.md", "table_auc.csv", "table_auc.tex", "table_tpr.md", "table_tpr.csv", "values.csv",
              "summary.json", "report.md"):
        assert (tmp_path / f).read_bytes() == (out / f).read_bytes(), f
    for name in exp.SPLITS:  # the same examples (the headers differ: encoder vs reused embeddings file)
        rows = lambda d: (d / "splits" / f"{name}.jsonl").read_text().splitlines()[1:]  # noqa: E731
        assert rows(tmp_path) == rows(out), name


def test_tables_are_a_function_of_the_saved_rows(em_mia_smoke):
    # the experiment's renderer (experiments.em_mia imports report_markdown from it), without the experiment's jax
    from experiments.em_mia_report import report_markdown

    assert exp.report_markdown is report_markdown
    same = rendered_again("experiments.em_mia_report", em_mia_smoke[0], ["table_auc", "table_tpr", "values"])
    assert same == dict.fromkeys(["report.md", "table_auc.csv", "table_tpr.csv", "values.csv"], True)


def test_em_mia_notebook_computes_the_tables(em_mia_smoke, monkeypatch):
    """The notebook's AUC table equals the AUC recomputed here from the run's scores files; TPR as in values.json."""
    out, s, _ = em_mia_smoke
    ns, shown, _ = run_notebook("em_mia", monkeypatch, {"MIA_EM_MIA_RESULTS": out})
    auc, tpr = ns["auc"], ns["tpr"]
    checked = 0
    for m in (t["name"] for t in s["models"]):
        for split in exp.SPLITS:
            lines = [json.loads(x) for x in (out / "scores" / m / f"{split}.jsonl").read_text().splitlines()]
            y = np.array([x["label"] for x in lines])
            for lbl in lines[0]["scores"]:
                v = np.array([np.nan if x["scores"][lbl] is None else x["scores"][lbl] for x in lines], float)
                ok = np.isfinite(v)
                assert auc.loc[(m, em_mia_report.display(lbl)), split] == pytest.approx(_auc(v[ok], y[ok]), abs=1e-12)
                checked += 1
    assert checked >= 6 * 2 and any(m.startswith("EM-MIA") for _, m in auc.index)
    for r in json.loads((out / "values.json").read_text())["rows"]:
        got = tpr.loc[(r["model"], r["method"]), r["split"]]
        assert (np.isnan(got) if r["tpr_at_1pct_fpr"] is None else got == r["tpr_at_1pct_fpr"]), r
    assert any(o is not None and getattr(o, "shape", None) == auc.shape for o in shown)
    assert len(shown.images()) >= 2


# ------------------------------------------------------------------------------------------------ bad input
def _fake_order(tmp_path: Path, n_indices: int, n_tokens: int) -> tuple:
    gi = tmp_path / "global_indices.npy"
    np.arange(n_indices, dtype=np.uint32).tofile(gi)
    tok = tmp_path / "part-0.npy"
    np.zeros(n_tokens, np.uint16).tofile(tok)
    paths = tmp_path / "paths.txt"
    paths.write_text(f"{tok}\n")
    return gi, paths


def test_bad_input_is_one_line(tmp_path, tiny_neox_dir, capsys):
    gi, paths = _fake_order(tmp_path, n_indices=10, n_tokens=7 * 64)  # 10 indices, 7 instances of 64 tokens
    common = ["--global-indices", str(gi), "--data-paths", str(paths), "--seq-len", "64", "--batch-size", "2",
              "--member-steps", "0:1", "--nonmember-steps", "2:4", "--steps", "1"]
    cases = [
        (["--olmo", str(tmp_path / "missing")] + common, "--olmo"),
        (["--olmo", str(tiny_neox_dir)] + common, "10 entries but the 1 token files hold 7 instances"),
        (["--olmo", str(tiny_neox_dir)] + common[:4] + ["--steps", "3"], "--steps 3: the checkpoint must have seen"),
        (["--olmo", str(tiny_neox_dir), "--global-indices", str(gi), "--steps", "1", "--member-steps", "0:1",
          "--nonmember-steps", "2:4"], "--data-paths FILE"),
        (["--olmo", str(tiny_neox_dir), "--member-steps", "5"] + common[:4], "expected START:END"),
        (["--testbed", str(tmp_path / "no-testbed")], "--testbed"),
    ]
    for argv, want in cases:
        assert exp.main(argv + ["--out", str(tmp_path / "o"), "--no-progress"]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and want in err[0], (argv, err)


@pytest.mark.slow
def test_olmo_recipe_end_to_end(tmp_path, tiny_neox_dir, capsys):
    """--olmo on a fake OLMo order (raw uint32 global_indices, one uint16 token file) and a tiny model: documents
    between EOS, the six splits, every attack (about a minute on 2 busy cores)."""
    rng = np.random.default_rng(0)
    seq, batch, steps, eos = 64, 4, 60, 0
    stream = []
    while len(stream) < seq * batch * steps:
        stream += [eos] + rng.integers(1, 300, int(rng.integers(9, 17))).tolist()
    tokens = np.array(stream[: seq * batch * steps], np.uint16)
    tok = tmp_path / "part-0.npy"
    tokens.tofile(tok)
    gi = tmp_path / "global_indices.npy"
    rng.permutation(batch * steps).astype(np.uint32).tofile(gi)
    paths = tmp_path / "paths.txt"
    paths.write_text(f"{tok}\n")
    s = exp.run(None, tmp_path / "out", olmo=tiny_neox_dir, global_indices=gi, data_paths=paths, step=20,
                member_steps="0:10", nonmember_steps="30:60", eos=eos, batch_size=batch, seq_len=seq, pool=30,
                size=12, k=2, threshold=0.0, doc_len=16, progress=False)
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("preset ")]
    assert said == [exp.preset_for(None, tiny_neox_dir)[1]] and said[0] in s["notes"]  # the paper preset, said once
    assert s["pool"] == {"members": 30, "nonmembers": 30, "doc_len": 16, "prefix_shots": 12, "prefix_pool": 12}
    from mia.data.splits import read_split

    for name in exp.SPLITS:
        ex = read_split(tmp_path / "out" / "splits" / f"{name}.jsonl").examples
        assert sorted(e["label"] for e in ex) == [0] * 6 + [1] * 6
        for e in ex:  # a whole document strictly between two EOS, 8 < length <= 16, from the right steps
            assert 8 < len(e["tokens"]) <= 16 and eos not in e["tokens"]
            assert (e["step"] < 10) if e["label"] == 1 else (30 <= e["step"] < 60)
    methods = {r["method"] for r in s["table_auc"]}
    assert {"Loss", "ReCaLL (12-shot)", "ReCaLL-Avg", "EM-MIA (init Loss)"} <= methods and "Ref" not in methods
    # nothing in the checkpoint directory states the order settings: said once, recorded in the manifest
    order = json.loads((tmp_path / "out" / "manifest.json").read_text())["hashes"]["olmo_order"]
    assert order["batch_size"] == batch and order["batch_size_from"] == "--batch-size" and order["unchecked"]
    assert [n for n in s["notes"] if n.startswith("OLMo order:")] == [order["unchecked"]]


def test_olmo_tokens_beyond_the_model_vocabulary(tmp_path, tiny_neox_dir, capsys):
    """OLMo token files of another tokenizer (ids up to 4000 for a model of a few hundred): one line naming
    --data-paths and the vocabulary, after the pool is drawn and before any split or score."""
    rng = np.random.default_rng(0)
    seq, batch, steps, eos = 64, 4, 60, 0
    stream = []
    while len(stream) < seq * batch * steps:
        stream += [eos] + rng.integers(1, 4000, int(rng.integers(9, 17))).tolist()
    np.array(stream[: seq * batch * steps], np.uint16).tofile(tmp_path / "part-0.npy")
    rng.permutation(batch * steps).astype(np.uint32).tofile(tmp_path / "global_indices.npy")
    (tmp_path / "paths.txt").write_text(f"{tmp_path / 'part-0.npy'}\n")
    argv = ["--olmo", str(tiny_neox_dir), "--global-indices", str(tmp_path / "global_indices.npy"), "--data-paths",
            str(tmp_path / "paths.txt"), "--steps", "20", "--member-steps", "0:10", "--nonmember-steps", "30:60",
            "--eos", "0", "--batch-size", str(batch), "--seq-len", str(seq), "--pool", "30", "--size", "12", "--k",
            "2", "--threshold", "0", "--doc-len", "16", "--out", str(tmp_path / "o"), "--no-progress"]
    assert exp.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --data-paths") and "the vocabulary size" in err[0], err
    assert not (tmp_path / "o" / "splits" / "random.jsonl").exists()


def test_olmo_checkpoints_checked_before_the_pool(tmp_path, tiny_neox_dir, capsys):
    """--olmo and --ref-model are opened and checked before the pool is drawn: identical weights are refused naming
    both (--allow-identical-checkpoints passes on to the order's own error), a missing tensor is one line."""
    import shutil

    from safetensors.numpy import load_file, save_file

    gi, paths = _fake_order(tmp_path, n_indices=10, n_tokens=7 * 64)
    ref = tmp_path / "ref"
    shutil.copytree(tiny_neox_dir, ref)
    argv = ["--olmo", str(tiny_neox_dir), "--ref-model", str(ref), "--global-indices", str(gi), "--data-paths",
            str(paths), "--seq-len", "64", "--batch-size", "2", "--member-steps", "0:1", "--nonmember-steps", "2:4",
            "--steps", "1", "--out", str(tmp_path / "o"), "--no-progress"]

    def error(extra=()):
        assert exp.main(argv + list(extra)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        return err[0]

    e = error()
    assert "identical weights" in e and str(tiny_neox_dir) in e and str(ref) in e
    assert not (tmp_path / "o" / "splits").exists()
    assert "10 entries but the 1 token files hold 7 instances" in error(["--allow-identical-checkpoints"])
    tensors = load_file(str(ref / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "embed_out.weight"}, str(ref / "model.safetensors"))
    e = error()
    assert str(ref) in e and "'embed_out.weight' is missing" in e
