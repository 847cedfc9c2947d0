"""experiments.finetune_mia: full vs LoRA fine-tunes of a testbed base, every attack, one table; the LoRA fine-tune
as a real PEFT adapter (peft in torch gives the merged model's logits; ``--adapter`` gives its scores)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from experiments import finetune_mia as exp


def _auc(s, y):
    """Mann-Whitney AUC, ties 1/2 (independent of sklearn and mia.metrics)."""
    pos, neg = s[y == 1], s[y == 0]
    return ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (len(pos) * len(neg))


def _tpr_at(s, y, fpr):
    """TPR at the strictest threshold whose FPR is at most ``fpr`` (scores above the threshold are members)."""
    neg = np.sort(s[y == 0])[::-1]
    k = int(np.floor(fpr * len(neg)))  # non-members allowed above the threshold
    thr = neg[k] if k < len(neg) else -np.inf
    return float((s[y == 1] > thr).mean())


# ------------------------------------------------------------------------------------------------ default run
@pytest.mark.parametrize("argv,words", [
    (["--preset", "huge"], ("--preset", "huge")),
    (["--attacks", "nosuch"], ("--attacks", "nosuch")),
    (["--seed", "-1"], ("--seed",)),
    (["--out", "{file}"], ("--out",)),
])
def test_bad_input_is_one_line_before_any_work(argv, words, tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    argv = [a.replace("{file}", str(tmp_path / "f")) for a in argv]
    try:  # a usage error exits from the parser, a bad value found later returns the status
        status = exp.main(argv + ["--no-progress", "--models-dir", str(tmp_path / "m")]
                          + ([] if "--out" in argv else ["--out", str(tmp_path / "o")]))
    except SystemExit as e:
        status = e.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
    assert not (tmp_path / "m").exists()  # nothing built


def test_table_rows_put_full_and_lora_side_by_side():
    rng = np.random.default_rng(0)
    y = np.array([1] * 150 + [0] * 150)
    res = {m: SimpleNamespace(scores={"a": rng.normal(size=300) + y * shift, "b": rng.normal(size=300)}, labels=y,
                              ids=[f"r{i}" for i in range(300)]) for m, shift in (("full", 2.0), ("lora", 0.5))}
    rows, _ = exp.table_rows(res, 0, 0)
    assert [r["attack"] for r in rows] == ["a", "b"]
    for r in rows:
        for m in exp.MODES:
            s = res[m].scores[r["attack"]]
            assert r[f"{m}_auc"] == pytest.approx(_auc(s, y), abs=1e-12)
            assert r[f"{m}_tpr_1"] == pytest.approx(_tpr_at(s, y, 0.01), abs=1e-12)
    assert rows[0]["full_auc"] > rows[0]["lora_auc"] > 0.5


def test_gradient_attacks_are_opt_in():
    p = exp.PRESETS["default"]
    names = {a[1] for a in exp.choose_attacks(p, None, False)[0]}
    assert {"loss", "zlib", "mink", "minkpp", "ref", "ez_mia", "wbc"} <= names
    assert not names & {"gradnorm", "alora", "jl"}
    assert {"gradnorm", "alora", "jl"} <= {a[1] for a in exp.choose_attacks(p, None, True)[0]}


# ------------------------------------------------------------------------------------------------ the smoke run
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune_mia")
    s = exp.run("smoke", root / "run", models_dir=root / "models", progress=False, bootstrap=100)
    return root, s


@pytest.mark.slow
def test_smoke_table_is_every_attack_on_both_finetunes(smoke):
    root, s = smoke
    rows = {r["attack"]: r for r in s["rows"]}
    assert set(rows) == {"loss", "zlib", "mink", "minkpp", "ref", "ez_mia", "wbc"}
    for mode in exp.MODES:
        lines = [json.loads(x) for x in (root / "run" / "scores" / f"{mode}.jsonl").read_text().splitlines()]
        y = np.array([x["label"] for x in lines])
        assert (y == 1).sum() == (y == 0).sum() == exp.PRESETS["smoke"].eval
        for a, r in rows.items():
            sc = np.array([x["scores"][a] for x in lines])
            assert r[f"{mode}_auc"] == pytest.approx(_auc(sc, y), abs=1e-9)
    # the fine-tunes were trained on the members: comparing with the base separates them
    assert min(rows["ref"]["full_auc"], rows["ez_mia"]["full_auc"]) > 0.75
    assert (root / "run" / "table.md").read_text().count("\n|") >= 8


@pytest.mark.slow
def test_smoke_same_seed_same_tables(smoke, tmp_path):
    root, _ = smoke
    exp.run("smoke", tmp_path / "again", models_dir=root / "models", progress=False, bootstrap=100)
    for f in ("table.md", "table.csv", "table.json", "report.md"):
        assert (tmp_path / "again" / f).read_bytes() == (root / "run" / f).read_bytes(), f
    base = json.loads((tmp_path / "again" / "summary.json").read_text())["base"]
    assert not Path(base["root"]).is_absolute()  # paths from the output dir, not from where it happened to be
    assert (tmp_path / "again" / base["checkpoint"]).resolve() == (root / "models" / "base").resolve() / \
        Path(base["checkpoint"]).relative_to(base["root"])


@pytest.mark.slow
def test_adapter_in_peft_gives_the_merged_lora_model(smoke):
    """peft in torch (``PeftModel.from_pretrained`` on the base checkpoint) and ``mia.load(BASE, adapter=DIR)`` give
    the logits of the testbed's merged LoRA model; the adapter changes the base's."""
    pytest.importorskip("peft")
    import torch
    import transformers as tf
    from peft import PeftModel

    import mia
    from mia.testbed import build_testbed

    root, _ = smoke
    p = exp.PRESETS["smoke"]
    base = build_testbed(p.base, root / "models" / "base", progress=False, **dict(p.base_overrides))
    base_dir = base.checkpoint_dir(base.train_steps)
    adapter, merged_dir = root / "run" / "adapter", root / "models" / "lora" / "model"
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == p.lora.lora_rank
    tokens = np.asarray(base.dataset().get_rows(np.arange(650, 654)), np.int64).reshape(4, -1)
    torch_base = tf.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    wrapped = PeftModel.from_pretrained(torch_base, str(adapter)).eval()
    assert any(".lora_A." in n for n, _ in wrapped.named_parameters())
    with torch.no_grad():
        want = wrapped(torch.tensor(tokens)).logits.numpy()
    merged = mia.load(merged_dir, dtype="float32")
    got = np.asarray(merged.logits(merged.params, tokens))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    plain = mia.load(base_dir, dtype="float32")
    assert np.abs(np.asarray(plain.logits(plain.params, tokens)) - want).max() > 1e-2
    via = mia.load(base_dir, adapter=adapter, dtype="float32")
    np.testing.assert_allclose(np.asarray(via.logits(via.params, tokens)), got, atol=1e-5, rtol=0)
    ex = [{"id": f"r{i}", "tokens": t.tolist()} for i, t in enumerate(tokens)]
    a = mia.score(via, ex, "loss", cache=False, progress=False).scores["loss"]
    b = mia.score(merged_dir, ex, "loss", cache=False, progress=False).scores["loss"]
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_finetune_notebook_scores_the_adapter_and_compares_the_attacks(smoke, monkeypatch):
    """The notebook scores the evaluated rows through the adapter: its AUCs are the run's LoRA column; it shows the
    run's table and two figures."""
    from notebook_runner import run_notebook

    root, s = smoke
    ns, shown, printed = run_notebook("finetune", monkeypatch, {"MIA_FINETUNE_RESULTS": root / "run"})
    rows = {r["attack"]: r for r in s["rows"]}
    assert set(ns["aucs"].index) == {"loss", "mink", "ref", "ez_mia", "wbc"}
    for a in ns["aucs"].index:
        assert ns["aucs"].loc[a, "AUC"] == pytest.approx(rows[a]["lora_auc"], abs=1e-6), a
    assert any(o is ns["table"] for o in shown) and len(shown.images()) == 2
    assert "preset smoke" in printed


def test_peft_export_names_and_orients_the_factors_as_peft_saves_them(tiny_neox_dir, tmp_path):
    """A testbed LoRA (kernel W [in, out] + s A B, A [L, in, r], B [L, r, out]) exported to a PEFT directory: peft in
    torch on the base gives the numpy merge of the same factors; a transposed factor or a wrong scale would not."""
    pytest.importorskip("peft")
    import torch
    import transformers as tf
    from peft import PeftModel

    import mia
    from mia.models.hub import write_safetensors
    from mia.testbed import finetune as ft
    from mia.testbed.peft_export import write_peft_adapter

    cfg = ft.FinetuneConfig(lora_rank=2, lora_alpha=6.0, canary_groups=(("tokens", 1, 1),))
    rng = np.random.default_rng(0)
    shapes = {"attention_query_key_value": (32, 96), "attention_dense": (32, 32)}
    factors = {}
    for t, (i, o) in shapes.items():
        factors[f"{t}.A"] = rng.normal(size=(2, i, 2)).astype(np.float32)
        factors[f"{t}.B"] = rng.normal(size=(2, 2, o)).astype(np.float32) * 0.3
    (tmp_path / "ft").mkdir()
    write_safetensors(factors, tmp_path / "ft" / "lora.safetensors")
    base = SimpleNamespace(config=SimpleNamespace(reserved_tokens=0), train_steps=1,
                           checkpoint_dir=lambda step: tiny_neox_dir)
    run = SimpleNamespace(config=cfg, base=base, root=tmp_path / "ft")
    adapter = write_peft_adapter(run, tmp_path / "adapter")
    plain = mia.load(tiny_neox_dir, dtype="float32")
    layers = dict(plain.params["layers"])
    for t in shapes:  # the testbed's own merge (mia.testbed.finetune.merged_params), in numpy
        kernel = np.asarray(layers[t]["kernel"]) + cfg.lora_scale * np.einsum("lir,lro->lio", factors[f"{t}.A"],
                                                                              factors[f"{t}.B"])
        layers[t] = {**layers[t], "kernel": kernel}
    merged = {**plain.params, "layers": layers}
    tokens = rng.integers(0, 40, size=(2, 9))
    want = np.asarray(plain.logits(merged, tokens))
    torch_base = tf.AutoModelForCausalLM.from_pretrained(str(tiny_neox_dir), dtype=torch.float32)
    with torch.no_grad():
        got = PeftModel.from_pretrained(torch_base, str(adapter)).eval()(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.abs(np.asarray(plain.logits(plain.params, tokens)) - want).max() > 1e-2
