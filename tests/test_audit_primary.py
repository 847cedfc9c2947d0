"""The audit's claims (issue 36): one pre-registered primary claim per privacy level that no result can move, the
family-wise correction of the exploratory rows, a seed of its own for every model (no shared inclusion or noise),
the exact Gaussian-DP check at sample rate 1, delta <= 1 / records, and (slow) the private-directory rule: what the
attacks read, and that nothing beside the model holds an un-noised statistic of the private set."""
from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

from experiments import audit, audit_models, audit_report
from experiments.harness import ExperimentError
from mia.metrics import MetricError
from mia.privacy import claims
from mia.privacy.one_run import one_run_epsilon, one_run_fdp_mu, one_run_fdp_p_value, one_run_fdp_rejects
from mia.testbed import TestbedError, dp, preset
from mia.testbed import finetune as ft


def _models(modes=("full", "lora"), targets=(1.0, 4.0, 16.0)):
    """Fake models (no testbed) as the fine-tune names them."""
    out = []
    for mode in modes:
        out.append(audit_models.Model(audit_models.model_name(None, mode), None, math.inf, None, 1e-5, mode))
        for t in targets:
            eps = t * 0.9997
            out.append(audit_models.Model(audit_models.model_name(eps, mode), None, eps, 1.0, 1e-5, mode, target=t))
    return out


# ----------------------------------------------------------------------------------------------- pre-registration
def test_every_preset_pre_registers_one_primary_per_level():
    """Every preset names its primary claims; each fine-tune level (non-private and each target epsilon) gets a grid
    with 2k <= m on the preset's canaries of that kind inserted once; and --help quotes them."""
    for name, p in audit_models.FT_PRESETS.items():
        m_once = sum(n for k, r, n in p.audit.canary_groups if k == p.primary.kind and r == 1)
        plan = claims.primary_plan(_models(targets=p.epsilons), p.primary)
        assert [e["level"] for e in plan] == [claims.NON_PRIVATE] + [f"{t:g}" for t in p.epsilons], name
        assert {e["mode"] for e in plan} == {p.primary.mode} and all(e["attack"] == p.primary.attack for e in plan)
        for e in plan:
            assert claims.checked_grid(m_once, e["k"]) == e["k"]
    for name, p in audit_models.PRESETS.items():
        assert p.primary.mode == "pretrain" and p.primary.kind in p.canary_kind.split(",")
    text = " ".join(audit.build_parser().format_help().split())
    assert "lora:contrast:new:non-private=400/1=100/4=50/16=100/*=50" in text.replace("non- private", "non-private")
    d = audit_models.FT_PRESETS["default"].primary
    assert (d.mode, d.attack, d.kind, d.grid(None), d.grid(4.0), d.grid(2.0)) == ("lora", "contrast", "new", (400,),
                                                                                   (50,), (50,))


def test_the_primary_cannot_be_chosen_from_results():
    """The plan is a function of the models' names, modes and levels and the preset alone; scores that make another
    row far stronger change neither which row is primary nor the number the targets quote."""
    rng = np.random.default_rng(0)
    models = _models()
    primary = audit_models.FT_PRESETS["default"].primary
    plan = claims.primary_plan(models, primary)
    assert [e["model"] for e in plan] == ["lora non-private", "lora eps=1", "lora eps=4", "lora eps=16"]
    inc = rng.random(1000) < 0.5
    weak = inc * 0.5 + rng.normal(size=1000)
    strong = inc * 3.0 + rng.normal(size=1000)
    runs_a, runs_b = {}, {}
    for e, m in zip(plan, [models[4 + i] for i in range(4)]):
        for runs, sc in ((runs_a, weak), (runs_b, strong)):
            runs[e["level"]] = [claims.primary_run(m, claims.primary_claim(sc, inc, 1e-5, e["k"], m.epsilon))]
    a, b = claims.summarize_primary(plan, runs_a), claims.summarize_primary(plan, runs_b)
    assert [e["row"] for e in a] == [e["row"] for e in b] and a[2]["eps_lower"] < b[2]["eps_lower"]
    assert claims.primary_plan(models, primary) == plan  # asked again after the results: the same
    # an exploratory row far above the primary is never what the targets quote
    t = audit_report.targets(a, "finetune")
    assert t["eps4"]["model"] == "lora eps=4" and t["eps4"]["eps_lower"] == a[2]["eps_lower"]
    assert t["nonprivate"]["model"] == "lora non-private"
    with pytest.raises(MetricError, match="mode 'lora'"):
        claims.primary_plan([m for m in models if m.mode == "full"], primary)


def test_the_primary_claim_is_tested_at_alpha_alone():
    """The primary's bound is the one-run bound of its own grid at alpha (Bonferroni inside the grid only): every
    guess right with k = 400 of 1,000 gives 5.56, where the exploratory grid (alpha / 5) gives 5.09."""
    inc = np.random.default_rng(1).random(1000) < 0.5
    perfect = inc.astype(float)
    claim = claims.primary_claim(perfect, inc, 1e-5, [400])
    assert claim["eps_lower"] == pytest.approx(one_run_epsilon(1000, 800, 800, delta=1e-5, alpha=0.05))
    assert claim["eps_lower"] == pytest.approx(5.56, abs=0.01) and claim["k_best"] == 400
    assert claims.audit_bound(perfect, inc, 1e-5).epsilon == pytest.approx(5.09, abs=0.01)
    two = claims.primary_claim(perfect, inc, 1e-5, [100, 400])
    assert two["eps_lower"] == pytest.approx(one_run_epsilon(1000, 800, 800, delta=1e-5, alpha=0.025))
    with pytest.raises(MetricError, match="2k <="):
        claims.primary_claim(perfect, inc, 1e-5, [501])


def test_parse_primary():
    d = audit_models.FT_PRESETS["default"].primary
    assert audit.parse_primary("full:loss:new", d) == claims.Primary("full", "loss", "new", d.k)
    p = audit.parse_primary("lora:contrast:new:non-private=300/4=25+50/*=40", d)
    assert p.grid(None) == (300,) and p.grid(4.0) == (25, 50) and p.grid(16.0) == (40,)
    assert audit.parse_primary(p.spec, d) == p
    for bad in ("lora:contrast", "lora:contrast:new:4=x", "lora:contrast:new:4=0"):
        with pytest.raises(ExperimentError, match="--primary"):
            audit.parse_primary(bad, d)
    with pytest.raises(MetricError, match="no k for level 4"):
        claims.Primary("lora", "contrast", "new", (("non-private", (4,)),)).grid(4.0)


@pytest.mark.parametrize("argv, needle", [
    (["--primary", "lora:contrast"], "--primary"),
    (["--primary", "lora:nosuchattack:new"], "nosuchattack"),
    (["--reps", "0"], "--reps"),
    (["--setting", "pretrain", "--reps", "2"], "--reps is for --setting finetune"),
    (["--delta", "0.01"], "1 / records"),
])
def test_bad_primary_reps_delta_are_one_line(argv, needle, tmp_path, capsys):
    assert audit.main(argv + ["--preset", "smoke", "--out", str(tmp_path / "o"), "--testbed-dir",
                              str(tmp_path / "t"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err
    assert not (tmp_path / "t").exists()  # refused before any model is built


# ----------------------------------------------------------------------------------------------- the family
def test_exploratory_rows_get_a_bonferroni_bound_over_the_family():
    rng = np.random.default_rng(2)
    items = []
    for j in range(6):
        inc = rng.random(400) < 0.5
        sc = inc * (0.5 * j) + rng.normal(size=400)
        row = {"eps_lower": claims.audit_bound(sc, inc, 1e-5).epsilon}
        items.append((row, sc, inc, 1e-5))
    assert claims.family_bounds(items) == 6
    for row, sc, inc, d in items:
        assert row["eps_lower_family"] == claims.audit_bound(sc, inc, d, alpha=0.05 / 6).epsilon
        assert row["eps_lower_family"] <= row["eps_lower"]
    assert items[-1][0]["eps_lower_family"] < items[-1][0]["eps_lower"]  # the correction costs something
    one = [(dict(items[-1][0]), *items[-1][1:])]
    claims.family_bounds(one)
    assert one[0][0]["eps_lower_family"] == pytest.approx(one[0][0]["eps_lower"])  # a family of one: no cost


# ----------------------------------------------------------------------------------------------- independent models
def test_every_model_has_its_own_seed_inclusion_and_noise(monkeypatch):
    """model_seed is a function of (run seed, repetition, model); two DP models of one run share neither their
    canaries' inclusion nor their noise draws, and the same run seed gives the same configs. (The noise multipliers
    are the accountant's, a bisection each: a fixed one here, since only the seeds are under test.)"""
    import jax

    monkeypatch.setattr(audit_models, "finetune_noise", lambda *a, **k: 1.0)
    p = audit_models.FT_PRESETS["default"]
    cfgs = audit_models.model_configs(p, epsilons=p.epsilons, delta=1e-5, seed=0)
    again = audit_models.model_configs(p, epsilons=p.epsilons, delta=1e-5, seed=0)
    assert [c.seed for _, _, c in cfgs] == [c.seed for _, _, c in again]
    seeds = [c.seed for _, _, c in cfgs]
    assert len(set(seeds)) == len(seeds) == 8
    assert seeds != [c.seed for _, _, c in audit_models.model_configs(p, epsilons=p.epsilons, delta=1e-5, seed=1)]
    again = audit_models.model_configs(p, epsilons=p.epsilons, delta=1e-5, seed=0, rep=1)
    assert not set(seeds) & {c.seed for _, _, c in again}
    private = [(mode, t, c) for mode, t, c in cfgs if c.private]
    assert len(private) == 6
    for i, (_, _, a) in enumerate(private):
        for _, _, b in private[i + 1:]:
            inc_a, inc_b = ft.plan_pool(a)[2], ft.plan_pool(b)[2]
            assert 0.4 < (inc_a == inc_b).mean() < 0.6  # independent coin flips agree about half the time
            za = np.asarray(jax.random.normal(dp.noise_key(a.seed, 0), (4000,)))
            zb = np.asarray(jax.random.normal(dp.noise_key(b.seed, 0), (4000,)))
            assert abs(np.corrcoef(za, zb)[0, 1]) < 0.1  # not one draw scaled by sigma
    with_seed = cfgs[0][2]
    assert not np.array_equal(ft.plan_pool(with_seed)[2], ft.plan_pool(with_seed.replace(seed=0))[2])


# ----------------------------------------------------------------------------------------------- exact GDP check
def test_fdp_p_value_is_the_test_behind_the_fdp_bound():
    rng = np.random.default_rng(3)
    for _ in range(30):
        m = int(rng.integers(50, 600))
        r = int(rng.integers(1, m // 2)) * 2
        v = int(rng.integers(r // 2, r + 1))
        mu = float(rng.uniform(0, 3))
        p = one_run_fdp_p_value(m, r, v, mu)
        for alpha in (0.01, 0.05, 0.2):
            if abs(p - alpha) > 2e-3 * alpha:
                assert (p <= alpha) == one_run_fdp_rejects(m, r, v, mu, alpha), (m, r, v, mu, alpha, p)
        bound = one_run_fdp_mu(m, r, v, alpha=0.05)
        assert (p <= 0.05) == (bound > mu) or abs(bound - mu) < 1e-6
    assert one_run_fdp_p_value(100, 10, 0, 0.0) == 1.0


def test_gdp_claims_join_the_violation_family():
    """At sample rate 1 the model's exact mu (sqrt(T) / sigma, r times that for r copies) is checked on the same
    guesses; a rejected one is a violation like an accountant's claim."""
    inc = np.random.default_rng(4).random(400) < 0.5
    sc = inc * 4.0 + np.random.default_rng(5).normal(size=400)
    p = claims.gdp_claim_p_value(sc, inc, 0.5)
    assert p < 1e-3 and claims.gdp_claim_p_value(sc, inc, 8.0) == 1.0
    grid = claims.audit_grid(400)
    assert p == pytest.approx(min(1.0, len(grid) * min(
        one_run_fdp_p_value(400, *claims.guess_counts(sc, inc, k, k), 0.5) for k in grid)), rel=1e-9)
    rows = [{"model": "lora eps=4", "attack": "contrast", "canary_kind": "new", "epsilon": 4.0, "eps_lower": 1.0,
             "p_accountant": 0.5, "mu": 0.5, "p_gdp": p}]
    check = claims.violation_check(rows, [])
    assert check["n_checks"] == 2 and len(check["violations"]) == 1 and "exact mu 0.5" in check["violations"][0]
    primary = [{"attack": "contrast", "canary_kind": "new", "runs": [
        {"model": "lora eps=4", "eps_lower": 1.2, "epsilon": 4.0, "p_accountant": 0.3, "mu": 0.93, "p_gdp": 0.001}]}]
    check = claims.violation_check([], [], primary=primary)
    assert check["n_checks"] == 2 and len(check["violations"]) == 1 and check["violations"][0].startswith("primary")
    bounds = claims.lower_bounds(sc, inc, 1e-5, 4.0, mu=0.5)
    assert bounds["p_gdp"] == p and bounds["mu"] == 0.5 and claims.lower_bounds(sc, inc, 1e-5, 4.0)["p_gdp"] is None


def test_exact_mu_holds_on_the_gaussian_mechanism():
    """The check is sound: on an exactly mu-GDP mechanism (a perfect attacker's scores), the claim of the true mu is
    rejected no more often than alpha (here: never in 40 draws)."""
    rng = np.random.default_rng(6)
    rejected = 0
    for _ in range(40):
        inc = rng.random(500) < 0.5
        rejected += claims.gdp_claim_p_value(inc * 1.0 + rng.normal(size=500), inc, 1.0) <= 0.05
    assert rejected <= 2


# ----------------------------------------------------------------------------------------------- delta
def test_delta_is_at_most_one_over_records_with_every_copy_counted():
    cfg = audit_models.preset_config(audit_models.PRESETS["default"])
    assert dp.default_delta(cfg) == 1 / dp.max_records(cfg) <= 1 / dp.n_records(cfg)
    assert dp.max_records(cfg) == cfg.train_steps * cfg.batch_size + 1000 * 1 + 1000 * 4
    plain = preset("smoke")
    assert dp.default_delta(plain) == 1 / (plain.train_steps * plain.batch_size)  # no canaries: unchanged
    for p in audit_models.FT_PRESETS.values():
        for c in (p.audit, p.kinds):
            assert ft.DEFAULT_DELTA <= 1 / ft.max_records(c)
            ft.check_delta(c.replace(dp_noise=1.0), ft.DEFAULT_DELTA)
    with pytest.raises(TestbedError, match="1 / records"):
        ft.check_delta(audit_models.FT_PRESETS["default"].audit, 1e-3)


# ----------------------------------------------------------------------------------------------- private/ (slow)
@pytest.mark.slow
def test_the_audit_reads_nothing_private(smoke_testbed, tmp_path):
    """A DP fine-tune's directory: no un-noised statistic of the private set outside ``private/``; the audit's
    reading of a model (its canaries, labels, checkpoint check and every attack) opens only the files listed here,
    and still works with ``private/`` gone."""
    from mia.checkpoints import check_checkpoints

    cfg = ft.FinetuneConfig(n_private=16, canary_groups=(("tokens", 1, 12), ("tokens", 4, 4)), canary_len=9, steps=2,
                            sample_rate=1.0, lr=0.1, dp_noise=2.0, seed=7)
    run = ft.build_finetune(smoke_testbed, tmp_path / "ft", cfg, progress=False, delta=1e-4)
    private_keys = {"loss", "first_loss", "final_loss", "clipped", "copies", "n_copies", "records", "n_included",
                    "train_s", "grad_norm"}

    def keys(x):
        if isinstance(x, dict):
            return set(x) | set().union(*(keys(v) for v in x.values()))
        if isinstance(x, list):
            return set().union(set(), *(keys(v) for v in x))
        return set()

    outside = sorted(p.relative_to(run.root).as_posix() for p in run.root.rglob("*") if p.is_file()
                     and not p.relative_to(run.root).as_posix().startswith("private/"))
    assert "data/canaries.json" in outside and "finetune.json" in outside and all(
        x.startswith("model/") or x in ("finetune.json", "data/canaries.json", "lora.safetensors") for x in outside), \
        outside
    assert not keys(json.loads((run.root / "finetune.json").read_text())) & private_keys
    rec = run.private_record()
    assert rec["n_copies"] == int(run.canaries().copies.sum()) and "final_loss" in rec
    assert len((run.private_dir / "train_log.jsonl").read_text().splitlines()) == 2
    import shutil

    shutil.rmtree(run.private_dir)  # the audit needs nothing from it
    opened = []
    root = str(run.root)

    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes)) and str(args[0]).startswith(root):
            opened.append(str(args[0])[len(root) + 1:])

    sys.addaudithook(hook)
    eps = run.dp_epsilon(delta=1e-4)
    m = audit_models.Model("full eps", ft.Finetune(run.root, cfg, json.loads((run.root / "finetune.json").read_text()),
                                            smoke_testbed), eps, 2.0, 1e-4, "full", target=eps, seed=7,
                    mu=math.sqrt(2) / 2.0)
    check_checkpoints({m.name: m.testbed.model_dir})
    c = m.testbed.canaries()
    to_run, _ = audit.select_attacks("loss,zlib", max_cost="stats", unavailable=(), preset="smoke")
    start, stop = run.natural_rows()
    natural = audit_models.natural_examples(smoke_testbed.dataset(), np.arange(start, stop),
                                      np.arange(stop, smoke_testbed.n_rows), 5, 0)
    audit_models.score_model("finetune", m, c, m.testbed.canary_membership(), natural, to_run, seed=0, bootstrap=10,
                      out=tmp_path / "out", progress=False, timings=audit.Timings())
    read = sorted(set(opened))
    assert not any(x.startswith("private") for x in read), read
    # every file the audit's reading of a model opens: the manifest, the canaries (the auditor's key), the model
    assert read == ["data/canaries.json", "finetune.json", "model/config.json", "model/model.safetensors",
                    "model/tokenizer.json", "model/tokenizer_config.json"], read
