"""experiments.audit: the pure parts by hand (bounds by repetitions, violations, findings), the command's edge, and
(slow) the smoke preset end to end: its numbers recomputed from the saved scores, the science checks, the notebook."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from experiments import audit, audit_models, audit_report
from mia.privacy import claims
from mia.privacy.one_run import AuditViolation
from mia.privacy.gdp import gdp_epsilon_estimate
from mia.metrics import epsilon_lower_bound
from mia.testbed import dp, preset

from notebook_runner import run_notebook
from table_check import rendered_again


def _model(eps=math.inf, noise=None, delta=1e-3, group=None):
    return audit_models.Model(audit_models.model_name(None if math.isinf(eps) else eps), None, eps, noise, delta,
                       group_epsilon=group)


def test_audit_grid_and_bound_by_hand():
    """The grid is fixed by m alone; the bound is the best one-run epsilon over it, each guess count k ("in" for the
    k highest scores, "out" for the k lowest) tested at alpha / (grid size), recomputed here from the counts."""
    from mia.privacy.one_run import one_run_epsilon

    assert claims.audit_grid(1000) == [12, 25, 50, 100, 400] and claims.audit_grid(40) == [1, 2, 4, 16]
    assert claims.audit_grid(2) == [1] and all(2 * k <= 7 for k in claims.audit_grid(7))
    rng = np.random.default_rng(0)
    included = rng.random(400) < 0.5
    scores = included * 2.0 + rng.normal(size=400)
    order = np.argsort(-scores, kind="stable")
    best = 0.0
    for k in claims.audit_grid(400):
        v = int(included[order[:k]].sum() + (~included[order[400 - k:]]).sum())
        best = max(best, one_run_epsilon(400, 2 * k, v, delta=1e-5, alpha=0.05 / len(claims.audit_grid(400))))
    res = claims.audit_bound(scores, included, 1e-5)
    assert res.epsilon == pytest.approx(best) and best > 0 and res.k_pos == res.k_neg
    perfect = claims.audit_bound(included.astype(float), included, 1e-5)  # every guess right: the largest k binds
    assert perfect.k_pos == 160 and perfect.v == perfect.r == 320


def test_bounds_by_reps_are_one_run_audits_per_group():
    """Each repetition count's bound is the audit of those canaries alone, at the group delta of r copies; the upper
    bound is the accountant's group epsilon (none for the non-private model)."""
    rng = np.random.default_rng(0)
    reps = np.tile([1, 4, 16], 40)
    included = rng.random(len(reps)) < 0.5
    scores = included * (reps / 4.0) + rng.normal(size=len(reps))
    cfg = preset("smoke", train_steps=40, canaries=120, canary_reps=(1, 4, 16), dp_noise=2.0)
    d = dp.default_delta(cfg)
    group = lambda r: dp.canary_epsilon(cfg, r, delta=d)  # noqa: E731
    rows = claims.bounds_by_reps(scores, included, reps, _model(1.0, 2.0, d, group), "loss", "tokens", d)
    assert [r["reps"] for r in rows] == [1, 4, 16] and {r["canary_kind"] for r in rows} == {"tokens"}
    for r in rows:
        sel = reps == r["reps"]
        eps_r, delta_r = dp.canary_epsilon(cfg, r["reps"], delta=d)
        assert (r["eps_upper"], r["delta"]) == (eps_r, delta_r)
        expected = claims.audit_bound(scores[sel], included[sel], delta_r).epsilon if delta_r < 1 else None
        assert r["eps_lower"] == expected and r["n"] == sel.sum() and r["n_included"] == included[sel].sum()
        p = claims.audit_claim_p_value(scores[sel], included[sel], eps_r, delta_r) if delta_r < 1 else None
        assert r["p_accountant"] == p
        if p is not None:  # the p-value and the bound tell the same story
            assert (p <= 0.05) == (r["eps_lower"] > eps_r)
    plain = claims.bounds_by_reps(scores, included, reps, _model(), "loss", "tokens", d)
    assert all(r["eps_upper"] is None and r["delta"] == d and r["eps_lower"] is not None for r in plain)
    assert all(r["p_accountant"] is None for r in plain)  # no claim to test
    assert plain[-1]["eps_lower"] > 0  # 16 copies with a strong signal: the non-private model is caught


def test_targets_and_kinds_table():
    """The targets quote the primary claims only (with their spread over repetitions), never the best row."""
    plan = [{"level": "non-private", "model": "lora non-private", "mode": "lora", "attack": "contrast",
             "canary_kind": "new", "k": [400]},
            {"level": "4", "model": "lora eps=3.99", "mode": "lora", "attack": "contrast", "canary_kind": "new",
             "k": [50]}]
    runs = {"non-private": [{"rep": i, "model": "lora non-private", "seed": i, "epsilon": None, "eps_lower": x,
                             "k_best": 400, "n": 1000} for i, x in enumerate((5.5, 5.4, 5.6))],
            "4": [{"rep": i, "model": "lora eps=3.99", "seed": i, "epsilon": 3.99, "eps_lower": x, "k_best": 50,
                   "n": 1000} for i, x in enumerate((0.9, 1.2, 1.5))]}
    primary = claims.summarize_primary(plan, runs)
    assert [e["eps_lower"] for e in primary] == [5.5, 0.9] and primary[1]["mean"] == pytest.approx(1.2)
    assert (primary[1]["min"], primary[1]["max"], primary[1]["n_reps"]) == (0.9, 1.5, 3)
    assert primary[1]["row"] == {"model": "lora eps=3.99", "attack": "contrast", "canary_kind": "new"}
    t = audit_report.targets(primary, "finetune")
    assert t["nonprivate"]["met"] and t["nonprivate"]["gap"] == pytest.approx(4 - 5.5)
    assert not t["eps4"]["met"] and t["eps4"]["gap"] == pytest.approx(0.1) and t["eps4"]["epsilon"] == 3.99
    lines = audit_report.targets_lines(t)
    assert "MISSED by 0.100" in lines[1] and "met" in lines[0] and "mean 1.200" in lines[1]
    assert "range 0.900-1.500" in lines[1] and "primary claim eps_lower 0.900" in lines[1]
    rows = [{"model": "kinds", "attack": "loss", "canary_kind": "tokens", "epsilon": None, "eps_lower": 1.0,
             "auc": 0.9, "tpr_at_1pct_fpr": 0.4, "tpr_at_0.1pct_fpr": 0.1, "n": 1000},
            {"model": "kinds", "attack": "ref", "canary_kind": "tokens", "epsilon": None, "eps_lower": 0.8,
             "auc": 0.95, "tpr_at_1pct_fpr": 0.3, "tpr_at_0.1pct_fpr": 0.2, "n": 1000}]
    kinds = audit_report.kinds_table(rows, "kinds")
    assert kinds == [{"canary_kind": "tokens", "attack": "loss", "n": 1000, "auc": 0.9, "tpr_at_1pct_fpr": 0.4,
                      "tpr_at_0.1pct_fpr": 0.1, "eps_lower": 1.0}]


def test_violations_are_holm_over_every_claim_tested():
    """Each private row and group tests the accountant's claim at 95% on its own; a violation is a claim Holm's
    procedure rejects at family-wise 5% over all of them (here 4 claims: 0.01 <= 0.05 / 4; 0.03 > 0.05 / 3)."""
    rows = [{"model": "eps=1", "attack": "loss", "epsilon": 1.0, "eps_lower": 1.4, "p_accountant": 0.01},
            {"model": "eps=1", "attack": "zlib", "epsilon": 1.0, "eps_lower": 1.1, "p_accountant": 0.03},
            {"model": "non-private", "attack": "loss", "epsilon": None, "eps_lower": 9.0, "p_accountant": None},
            {"model": "eps=4", "attack": "loss", "epsilon": 4.0, "eps_lower": None, "p_accountant": None},
            {"model": "eps=4", "attack": "zlib", "epsilon": 4.0, "eps_lower": 0.0, "p_accountant": 1.0}]
    reps = [{"model": "eps=1", "attack": "loss", "reps": 4, "eps_upper": 4.0, "eps_lower": 4.5, "p_accountant": 0.04},
            {"model": "eps=1", "attack": "loss", "reps": 16, "eps_upper": None, "eps_lower": 30.0,
             "p_accountant": None}]
    check = claims.violation_check(rows, reps)
    assert (check["method"], check["alpha"], check["n_checks"], check["n_above_per_row"]) == ("holm", 0.05, 4, 3)
    bad = claims.violations(rows, reps)
    assert len(bad) == 1 and bad[0].startswith("eps=1 loss: eps_lower 1.4 vs accountant epsilon 1 (p = 0.01, Holm")
    rows[1]["p_accountant"], reps[0]["p_accountant"] = 0.012, 0.02  # 0.012 <= 0.05 / 3, 0.02 <= 0.05 / 2
    assert [b.split(" (p")[0] for b in claims.violations(rows, reps)] == [
        "eps=1 loss: eps_lower 1.4 vs accountant epsilon 1", "eps=1 zlib: eps_lower 1.1 vs accountant epsilon 1",
        "eps=1 loss reps 4: eps_lower 4.5 vs group epsilon 4"]


def test_gaussian_curve_bounds_above_the_accountant_are_named_not_violations():
    rows = [{"model": "eps=1", "attack": "loss", "epsilon": 1.0, "eps_lower_fdp": 1.3, "eps_gdp": 0.4},
            {"model": "eps=1", "attack": "zlib", "epsilon": 1.0, "eps_lower_fdp": None, "eps_gdp": 2.0},
            {"model": "non-private", "attack": "loss", "epsilon": None, "eps_lower_fdp": 9.0, "eps_gdp": 9.0}]
    lines = claims.above_accountant(rows)
    assert [x.split(" (")[0] for x in lines] == ["eps=1 loss: eps_lower_fdp 1.3 > accountant epsilon 1",
                                                  "eps=1 zlib: eps_gdp 2 > accountant epsilon 1"]


def test_help_states_the_presets_defaults():
    """--help's defaults come from the presets (each pretrain preset's noises, each fine-tune preset's epsilons, both
    settings' attacks), and delta's is the code's rule."""
    text = " ".join(audit.build_parser().format_help().split())
    for name, p in audit_models.PRESETS.items():
        assert f"{name}: {','.join(f'{x:g}' for x in p.noises)}" in text
    for name, p in audit_models.FT_PRESETS.items():
        assert f"{name}: {','.join(f'{x:g}' for x in p.epsilons)}" in text
    for name, p in {**audit_models.PRESETS, **audit_models.FT_PRESETS}.items():
        assert f"{name}: {p.attacks}" in text or (p.attacks == "default" and f"up to cost '{p.max_cost}'" in text)
    assert "1 / (train_steps x batch_size + every canary copy)" in text and "at most 1 / records" in text
    assert "those of epsilon 1, 4, 16" not in text and "fine-tune 1e-05" in text
    cfg = audit_models.preset_config(audit_models.PRESETS["smoke"])
    assert 1 / dp.n_records(cfg) > dp.default_delta(cfg) == 1 / dp.max_records(cfg)
    assert "best" not in text  # --help quotes the primary claims, never a best row


def test_findings_follow_the_numbers():
    rows = [{"model": "non-private", "attack": "loss", "epsilon": None, "auc": 0.9},
            {"model": "eps=8", "attack": "loss", "epsilon": 8.0, "auc": 0.7},
            {"model": "eps=1", "attack": "loss", "epsilon": 1.0, "auc": 0.55},
            {"model": "non-private", "attack": "zlib", "epsilon": None, "auc": 0.52},
            {"model": "eps=1", "attack": "zlib", "epsilon": 1.0, "auc": 0.6}]
    ex = [{"model": "non-private", "reps": r, "skewnorm_mean": m} for r, m in ((1, 2.0), (4, 9.0), (16, 40.0))]
    f = audit_report.findings(rows, ex)
    assert f["auc"].startswith("Canary AUC moves towards 0.5 from the non-private model to epsilon 1 for 1 of 2")
    assert "loss (0.900 -> 0.550)" in f["auc"] and "not for zlib (0.520 -> 0.600)" in f["auc"]
    assert "(grows with repetitions)" in f["exposure"]
    ex[2]["skewnorm_mean"] = 1.0
    assert "does NOT grow" in audit_report.findings(rows, ex)["exposure"]


@pytest.mark.parametrize("argv, needle", [
    (["--noises", "-1"], "--noises"),
    (["--noises", "1,1"], "--noises"),
    (["--noises", "a"], "--noises"),
    (["--noises", "1", "--epsilons", "2"], "not both"),
    (["--epsilons", "0"], "--epsilons"),
    (["--attacks", "nosuchattack"], "nosuchattack"),
])
def test_bad_input_is_one_line(argv, needle, tmp_path, capsys):
    assert audit.main(argv + ["--out", str(tmp_path / "o"), "--testbed-dir", str(tmp_path / "t"),
                              "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err
    assert not (tmp_path / "t").exists()  # refused before any testbed is built


def test_a_violation_exits_3_with_every_line(monkeypatch, capsys):
    s = {"description": "d", "models": [], "rows": [], "by_reps": [], "exposure": [], "findings": {},
         "violations": ["eps=1 loss: eps_lower 2 > accountant epsilon 1", "eps=1 zlib: ..."], "skipped": {},
         "notes": []}
    monkeypatch.setattr(audit, "run", lambda *a, **kw: s)
    assert audit.main(["--no-progress"]) == 3
    err = capsys.readouterr().err
    assert err.count("PRIVACY AUDIT VIOLATION: ") == 2 and "eps_lower 2 > accountant epsilon 1" in err


@pytest.mark.parametrize("name, targets", [("smoke", (1.0, 8.0)),
                                           pytest.param("default", (1.0, 4.0, 16.0), marks=pytest.mark.slow)])
def test_preset_noises_give_their_target_epsilons(name, targets):
    """The presets' noise multipliers are those of their stated target epsilons (within the bisection's rounding)."""
    cfg = audit_models.preset_config(audit_models.PRESETS[name])
    got = sorted(dp.accountant_epsilon(cfg.replace(dp_noise=s)) for s in audit_models.PRESETS[name].noises)
    assert got == pytest.approx(sorted(targets), rel=2e-3)
    assert all(g <= t * (1 + 1e-9) for g, t in zip(got, sorted(targets)))


# ----------------------------------------------------------------------------------------------- smoke, slow
@pytest.fixture(scope="module")
def audit_smoke(tmp_path_factory):
    """The fine-tuning smoke preset (the default setting)."""
    root = tmp_path_factory.mktemp("audit")
    return root / "out", audit.run("smoke", root / "out", testbed_dir=root / "tb", progress=False, bootstrap=100)


@pytest.fixture(scope="module")
def pretrain_smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit-pretrain")
    return root / "out", audit.run("smoke", root / "out", setting="pretrain", testbed_dir=root / "tb",
                                   progress=False, bootstrap=100)


def _read_scores(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _recompute(out, s):
    """Every row's AUC and eps_lower again from the saved per-example scores, independently (sklearn, and the
    one-run audit on the canaries of the row's kind inserted once); and no bound above its accountant epsilon."""
    for r in s["rows"]:
        lines = _read_scores(out / "scores" / r["model"] / "canaries.jsonl")
        once = np.array([x["reps"] == 1 and x["kind"] == r["canary_kind"] for x in lines])
        y = np.array([x["label"] for x in lines])[once]
        sc = np.array([x["scores"][r["attack"]] for x in lines], float)[once]
        assert r["n"] == once.sum() and roc_auc_score(y, sc) == pytest.approx(r["auc"], abs=1e-12)
        delta = next(m["delta"] for m in s["models"] if m["model"] == r["model"])
        assert claims.audit_bound(sc, y.astype(bool), delta).epsilon == pytest.approx(r["eps_lower"])
        assert claims.audit_bound(sc, y.astype(bool), delta, bound="fdp").epsilon == pytest.approx(r["eps_lower_fdp"])
        if 0 < y.sum() < len(y):
            assert epsilon_lower_bound(sc, y, delta=delta) == pytest.approx(r["eps_lower_cp"])
            assert gdp_epsilon_estimate(sc, y, delta=delta) == pytest.approx(r["eps_gdp"])
        if r["epsilon"] is not None:  # science check 1: no bound above the accountant's epsilon
            assert r["eps_lower"] <= r["epsilon"]
            assert r["p_accountant"] == pytest.approx(claims.audit_claim_p_value(sc, y.astype(bool), r["epsilon"],
                                                                                delta))
    assert not s["violations"]


@pytest.mark.slow
def test_smoke_end_to_end_and_the_science_checks(audit_smoke):
    """The fine-tuning smoke preset: every output, every number again from the saved scores, the new-token contrast
    catching every canary of the non-private fine-tunes, the kinds table, the targets."""
    out, s = audit_smoke
    for f in ("report.md", "summary.json", "audit.csv", "audit.tex", "by_reps.md", "kinds.json", "kinds.png",
              "auc_vs_epsilon.png", "eps_lower_vs_epsilon.png", "manifest.json"):
        assert (out / f).stat().st_size > 0, f
    assert s["setting"] == "finetune" and all(r["setting"] == "finetune" for r in s["rows"])
    models = [m["model"] for m in s["models"]]
    assert models == ["full non-private", "full eps=0.999", "full eps=7.99", "lora non-private", "lora eps=0.999",
                      "lora eps=7.99", "kinds"]
    assert {r["canary_kind"] for r in s["rows"] if r["model"] != "kinds"} == {"new"}
    assert {r["canary_kind"] for r in s["rows"] if r["model"] == "kinds"} == set(audit_models.ALL_KINDS)
    _recompute(out, s)
    for name in ("full non-private", "lora non-private", "kinds"):  # untrained ids score 0 exactly, trained ones > 0
        lines = [x for x in _read_scores(out / "scores" / name / "canaries.jsonl") if x["kind"] == "new"]
        assert all((x["scores"]["contrast"] > 0) == (x["label"] == 1) for x in lines)
    assert [k["canary_kind"] for k in s["kinds"]] == list(audit_models.ALL_KINDS)
    assert s["kinds"][0]["attack"] == "contrast" and s["kinds"][0]["tpr_at_1pct_fpr"] == 1.0
    primary = {e["level"]: e for e in s["primary"]}
    assert list(primary) == ["non-private", "1", "8"] and all(e["mode"] == "lora" for e in primary.values())
    assert s["targets"]["nonprivate"]["eps_lower"] == primary["non-private"]["eps_lower"]
    assert all(r["eps_lower_family"] is not None and r["eps_lower_family"] <= r["eps_lower"] + 1e-12
               for r in s["rows"] if r["eps_lower"] is not None)
    for e in s["primary"]:  # the primary claims again from the saved scores, at alpha alone on their grid
        lines = [x for x in _read_scores(out / "scores" / e["model"] / "canaries.jsonl")
                 if x["reps"] == 1 and x["kind"] == e["canary_kind"]]
        sc = np.array([x["scores"][e["attack"]] for x in lines], float)
        inc = np.array([x["label"] == 1 for x in lines])
        assert claims.audit_bound(sc, inc, 1e-5, grid=e["k"]).epsilon == pytest.approx(e["eps_lower"])
    seeds = [m["seed"] for m in s["models"]]
    assert len(set(seeds)) == len(seeds)  # every model its own seed
    assert len({m["canaries_sha256"] for m in s["models"]}) == len(seeds)  # and its own pool
    same = rendered_again("experiments.audit", out, ["audit", "by_reps", "kinds"])
    assert same and all(same.values()), same


@pytest.mark.slow
def test_pretrain_smoke_end_to_end(pretrain_smoke):
    """The pretraining setting (today's audit): three testbeds, the science checks (AUC towards 0.5 as epsilon
    shrinks, exposure growing with repetitions), every number again from the saved scores."""
    out, s = pretrain_smoke
    for f in ("report.md", "summary.json", "exposure.json", "exposure_vs_reps.png", "eps_lower_vs_epsilon.png"):
        assert (out / f).stat().st_size > 0, f
    attacks = s["attacks_run"]
    models = [m["model"] for m in s["models"]]
    assert len(models) == 3 and models[0] == "non-private" and s["models"][0]["epsilon"] is None
    assert [(r["model"], r["attack"]) for r in s["rows"]] == [(m, a) for m in models for a in attacks]
    assert {r["canary_kind"] for r in s["rows"]} == {"tokens"} and s["setting"] == "pretrain"
    _recompute(out, s)
    assert s["violation_check"]["n_checks"] == len(claims.tested_claims(s["rows"], s["by_reps"], s["primary"])) == sum(
        r["p_accountant"] is not None for r in s["rows"] + s["by_reps"]) + sum(
        run["p_accountant"] is not None for e in s["primary"] for run in e["runs"])
    assert [e["level"] for e in s["primary"]][0] == "non-private" and len(s["primary"]) == 3
    smoke = audit_models.preset_config(audit_models.PRESETS["smoke"])
    assert s["delta"] == dp.default_delta(smoke)  # 1 / records, copies counted
    assert s["violation_check"]["method"] == "holm"
    for a in attacks:  # science check 2: AUC towards 0.5 as epsilon shrinks
        by_eps = {r["epsilon"]: r["auc"] for r in s["rows"] if r["attack"] == a}
        smallest = min(e for e in by_eps if e is not None)
        assert abs(by_eps[smallest] - 0.5) < abs(by_eps[None] - 0.5), a
    ex = sorted((e for e in s["exposure"] if e["model"] == "non-private"), key=lambda e: e["reps"])
    means = [e["skewnorm_mean"] for e in ex]  # science check 3: exposure grows with repetitions
    assert means == sorted(means) and means[-1] > means[0] + 5
    same = rendered_again("experiments.audit", out, ["audit", "by_reps", "exposure"])
    assert same and all(same.values()), same


@pytest.mark.slow
def test_notebook_computes_the_tables(audit_smoke, monkeypatch):
    """The notebook redraws the table, the kinds and the plots from summary.json alone."""
    out, s = audit_smoke
    ns, shown, printed = run_notebook("audit", monkeypatch, {"MIA_AUDIT_DIR": out})
    assert ns["S"] == json.loads((out / "summary.json").read_text())
    text = shown.text()
    for r in s["rows"]:
        if r["model"] != "kinds":
            assert f"{r['eps_lower']:.3f}" in text and f"{r['eps_lower_fdp']:.3f}" in text
    for k in s["kinds"]:
        assert f"{k['tpr_at_1pct_fpr']:.3f}" in text
    for v in s["findings"].values():
        assert v in printed
    assert len(shown.images()) >= 3
    # the notebook's own epsilon-vs-bound check, from the rows
    assert ns["worst_gap"] == max(r["eps_lower"] - r["epsilon"] for r in s["rows"] if r["epsilon"] is not None)
    assert f"{s['violation_check']['n_checks']} claims tested, Holm" in printed
    for e in s["primary"]:
        assert f"{e['eps_lower']:.3f}" in text
    assert "primary claim eps_lower" in printed and "best eps_lower" not in printed


@pytest.mark.slow
def test_strict_run_raises_after_writing(audit_smoke, monkeypatch, tmp_path):
    """strict=True (the Python API's default) raises AuditViolation, after every output is written."""
    out, _ = audit_smoke
    monkeypatch.setattr(audit, "violation_check", lambda rows, by_reps, **kw: {
        "method": "holm", "alpha": 0.05, "n_checks": 1, "n_above_per_row": 1,
        "violations": ["eps=1 loss: forced for the test"]})
    with pytest.raises(AuditViolation, match="forced for the test"):
        audit.run("smoke", tmp_path / "o", testbed_dir=out.parent / "tb", progress=False, bootstrap=20)
    assert "PRIVACY AUDIT VIOLATIONS" in (tmp_path / "o" / "report.md").read_text()
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["violations"]


@pytest.mark.parametrize("setting", ["pretrain", "finetune"])
def test_a_damaged_audit_checkpoint_stops_the_run_before_any_scoring(setting, smoke_testbed, tmp_path, monkeypatch):
    """The audit's testbeds (pretrain: the canary testbed and its twins; fine-tune: the base) are opened and checked
    like every checkpoint (``mia.checkpoints``) before anything is trained on them or scored: a damaged weights file
    is one line naming it. They used to be scored unchecked."""
    import shutil
    from pathlib import Path

    from mia.checkpoints import CheckpointError
    from mia.testbed import open_testbed

    copy = Path(shutil.copytree(smoke_testbed.root, tmp_path / "tb", ignore=shutil.ignore_patterns("*-mem*", "cache")))
    weights = copy / "checkpoints" / f"step{smoke_testbed.train_steps}" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 1
    weights.write_bytes(bytes(data))
    tb = open_testbed(copy)
    if setting == "pretrain":
        monkeypatch.setattr(audit, "pretrain_models",
                            lambda *a, **k: [audit_models.Model(claims.NON_PRIVATE, tb, math.inf, None, 1e-3)])
    else:
        monkeypatch.setattr(audit, "build_base", lambda *a, **k: tb)
    scored = []
    monkeypatch.setattr(audit, "score_model", lambda *a, **k: scored.append(a))
    monkeypatch.setattr(audit.ft, "build_finetune", lambda *a, **k: scored.append(a))
    with pytest.raises(CheckpointError, match="damaged: sha256") as e:
        audit.run("smoke", tmp_path / "out", setting=setting, testbed_dir=tmp_path / "t", progress=False)
    assert str(weights) in str(e.value) and scored == []
