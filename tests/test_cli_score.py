"""`mia score` end to end on the tiny model, and one clear line for every kind of bad input."""
import json
import shutil

import numpy as np
import pytest

from mia.cli import main


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


TEXTS = ["def add(a, b):\n    return a + b\n", "import json\nprint(json.dumps({'a': 1}))\n",
         "class Point:\n    x: int\n    y: int\n", "for i in range(10):\n    print(i * i)\n"]


def test_score_writes_one_line_per_input_and_a_table(tiny_neox_dir, tmp_path, capsys):
    data = _write(tmp_path / "d.jsonl", [{"id": i, "text": t, "label": i % 2} for i, t in enumerate(TEXTS)]
                  + [{"id": "tok", "tokens": [5, 6, 7, 8, 9], "label": 1}])
    out = tmp_path / "o.jsonl"
    assert main(["score", "--model", str(tiny_neox_dir), "--data", str(data), "--attacks", "loss",
                 "--out", str(out), "--no-cache", "--no-progress", "--max-length", "8"]) == 0
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    assert [l["id"] for l in lines] == ["0", "1", "2", "3", "tok"]
    assert all(l["n_tokens"] <= 8 for l in lines)
    assert any(l["truncated"] for l in lines)
    assert all(np.isfinite(l["scores"]["loss"]) and l["scores"]["loss"] < 0 for l in lines)
    printed = capsys.readouterr().out
    assert "AUC" in printed and "loss" in printed


def test_delta_adds_the_epsilon_the_attack_rules_out(tiny_neox_dir, tmp_path, capsys):
    """--delta: an eps_lower column, equal to mia.metrics.epsilon_lower_bound of the written scores."""
    from mia.metrics import epsilon_lower_bound

    data = _write(tmp_path / "d.jsonl", [{"id": i, "text": t, "label": i % 2} for i, t in enumerate(TEXTS * 3)])
    out = tmp_path / "o.jsonl"
    assert main(["score", "--model", str(tiny_neox_dir), "--data", str(data), "--attacks", "loss",
                 "--out", str(out), "--no-cache", "--no-progress", "--delta", "1e-5", "--bootstrap", "20"]) == 0
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    s = np.array([l["scores"]["loss"] for l in lines])
    y = np.array([l["label"] for l in lines])
    printed = capsys.readouterr().out
    row = next(l for l in printed.splitlines() if l.startswith("loss "))
    assert "eps_lower" in printed and "delta=1e-05" in printed
    assert float(row.split()[-1]) == pytest.approx(epsilon_lower_bound(s, y, delta=1e-5), abs=1e-4)
    for bad in ("1", "-0.1", "x"):
        with pytest.raises(SystemExit) as e:  # argparse: status 2, one line naming the flag
            main(["score", "--model", str(tiny_neox_dir), "--data", str(data), "--out", str(out), "--delta", bad])
        assert e.value.code == 2 and "--delta" in capsys.readouterr().err


def test_bootstrap_zero_prints_the_table_without_se(tiny_neox_dir, tmp_path, capsys):
    """``--bootstrap 0`` (documented as valid): the metrics table is printed with the SE column empty."""
    data = _write(tmp_path / "d.jsonl", [{"id": i, "text": t, "label": i % 2} for i, t in enumerate(TEXTS)])
    assert main(["score", "--model", str(tiny_neox_dir), "--data", str(data), "--out", str(tmp_path / "o.jsonl"),
                 "--no-cache", "--no-progress", "--max-length", "8", "--bootstrap", "0"]) == 0
    row = [l for l in capsys.readouterr().out.splitlines() if l.startswith("loss")]
    assert len(row) == 1 and len(row[0].split()) == 4, row  # loss, AUC, TPR@1%, TPR@0.1%


def test_python_dash_m_entry_point(tiny_neox_dir, tmp_path):
    import subprocess
    import sys
    data = _write(tmp_path / "d.jsonl", [{"id": 1, "text": TEXTS[0]}])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mia",
            "score",
            "--model",
            str(tiny_neox_dir),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "o.jsonl"),
            "--no-cache",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "o.jsonl").read_text())["label"] is None


def _err(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err and err[-1].startswith("error: ")
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def _base(model, data, out):
    return ["score", "--model", str(model), "--data", str(data), "--out", str(out), "--no-cache", "--no-progress"]


@pytest.mark.parametrize("rows, expect", [
    (['{"id": 1, "text": "ok ok"}', '{"id": 2, "text": '], ":2: invalid JSON"),
    ([{"id": 1, "text": ""}], "empty text"),
    ([{"id": 1, "text": "hello", "label": 2}], "'label' must be 0 or 1"),
    ([{"id": 1}], "needs a 'text' or a 'tokens'"),
    ([{"id": 1, "tokens": [3]}], "only 1 token"),
    ([{"id": 1, "text": "abc"}, {"text": "abd"}], ":2: field 'id' is missing"),  # ids: on every line or none
    ([{"id": 1, "text": "a b"}, {"id": 1, "text": "c d"}], "duplicate id"),
    ([{"id": 1, "tokens": [1, 99999]}], "outside the model vocabulary"),
])
def test_bad_data_gives_one_line(tiny_neox_dir, tmp_path, capsys, rows, expect):
    data = _write(tmp_path / "d.jsonl", rows)
    msg = _err(capsys, _base(tiny_neox_dir, data, tmp_path / "o.jsonl"))
    assert expect in msg and "d.jsonl" in msg


def test_skip_invalid_records_reason(tiny_neox_dir, tmp_path):
    data = _write(tmp_path / "d.jsonl", [{"id": 1, "text": ""}, {"id": 2, "text": TEXTS[1]}])
    out = tmp_path / "o.jsonl"
    assert main(_base(tiny_neox_dir, data, out) + ["--skip-invalid"]) == 0
    first, second = [json.loads(l) for l in out.read_text().splitlines()]
    assert first["invalid"] == "empty text" and first["scores"] is None
    assert second["scores"]["loss"] < 0


def test_bad_model_dirs(tiny_neox_dir, tmp_path, capsys):
    data = _write(tmp_path / "d.jsonl", [{"id": 1, "text": TEXTS[0]}])
    assert "model directory not found" in _err(capsys, _base(tmp_path / "nope", data, tmp_path / "o"))

    bad = tmp_path / "m"
    shutil.copytree(tiny_neox_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, model_type="mamba")))
    msg = _err(capsys, _base(bad, data, tmp_path / "o"))
    assert "unsupported model_type 'mamba'" in msg and "gpt_neox" in msg

    (bad / "config.json").write_text(json.dumps(dict(cfg, rope_scaling={"rope_type": "linear", "factor": 2.0})))
    assert "rope_scaling" in _err(capsys, _base(bad, data, tmp_path / "o"))

    (bad / "config.json").write_text(json.dumps(dict(cfg, hidden_size=48)))
    assert "has shape" in _err(capsys, _base(bad, data, tmp_path / "o"))

    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").unlink()
    assert "no model.safetensors" in _err(capsys, _base(bad, data, tmp_path / "o"))


def test_missing_tensor_is_named(tiny_neox_dir, tmp_path, capsys):
    from mia.models.hub import read_safetensors, write_safetensors

    bad = tmp_path / "m"
    shutil.copytree(tiny_neox_dir, bad)
    tensors = {k: np.array(v) for k, v in read_safetensors(bad / "model.safetensors").items()}
    del tensors["gpt_neox.layers.1.mlp.dense_h_to_4h.weight"]
    write_safetensors(tensors, bad / "model.safetensors")
    data = _write(tmp_path / "d.jsonl", [{"id": 1, "text": TEXTS[0]}])
    assert "gpt_neox.layers.1.mlp.dense_h_to_4h.weight" in _err(capsys, _base(bad, data, tmp_path / "o"))


def test_unknown_attack_lists_valid(tiny_neox_dir, tmp_path, capsys):
    data = _write(tmp_path / "d.jsonl", [{"id": 1, "text": TEXTS[0]}])
    msg = _err(capsys, _base(tiny_neox_dir, data, tmp_path / "o") + ["--attacks", "nosuch"])
    assert "unknown attack 'nosuch'" in msg and "loss" in msg


def test_pack_and_bucket_step_change_speed_not_scores(tiny_neox_dir, tmp_path, capsys, monkeypatch):
    """--pack on / off / auto and --bucket-step give the same scores (packed rows are masked per text), --pack on
    does pack (the packed batch builder is called), and bad values are one argparse line naming the flag."""
    from mia.engine import loop

    rng = np.random.default_rng(3)
    data = _write(tmp_path / "d.jsonl", [{"id": i, "tokens": [int(t) for t in rng.integers(5, 90, n)], "label": i % 2}
                                         for i, n in enumerate([3, 17, 9, 30, 5, 12, 24, 2])])
    packed_calls = []
    real_put = loop.put_packed
    monkeypatch.setattr(loop, "put_packed", lambda *a: packed_calls.append(1) or real_put(*a))
    scores = {}
    for flags in (["--pack", "off"], ["--pack", "on"], ["--pack", "auto", "--bucket-step", "0"]):
        out = tmp_path / f"o{len(scores)}.jsonl"
        packed_calls.clear()
        assert main(["score", "--model", str(tiny_neox_dir), "--data", str(data), "--attacks", "loss,mink",
                     "--out", str(out), "--no-cache", "--no-progress", *flags]) == 0
        scores[" ".join(flags)] = np.array([[l["scores"]["loss"], l["scores"]["mink"]]
                                            for l in map(json.loads, out.read_text().splitlines())])
        assert bool(packed_calls) == (flags[1] == "on")  # auto: the tiny model is attention-bound, not packed
    for flags, s in scores.items():
        np.testing.assert_allclose(s, scores["--pack off"], atol=2e-5, err_msg=flags)
    for flag, bad in (("--pack", "yes"), ("--bucket-step", "-1"), ("--bucket-step", "x")):
        with pytest.raises(SystemExit) as e:
            main(["score", "--model", str(tiny_neox_dir), "--data", str(data), "--out", str(tmp_path / "x.jsonl"),
                  flag, bad])
        assert e.value.code == 2 and flag in capsys.readouterr().err
