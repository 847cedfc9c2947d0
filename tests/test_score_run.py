"""A ``ScoreRun`` that reads well in a notebook: its repr (one line and the metrics table, never the arrays), its HTML,
``plot_roc`` and ``compare``. Runs are built from seeded synthetic scores (no model); numbers are checked against
NumPy references."""
from __future__ import annotations

import numpy as np
import pytest

from mia.data.examples import Example
from mia.metrics import metric_rows
from mia.results import OVERVIEW_LINES, OVERVIEW_RESAMPLES, ScoreRun


def ref_auc(s, y) -> float:
    """Pairwise definition: P(member score > non-member score) + 1/2 P(tie)."""
    pos, neg = s[y == 1][:, None], s[y == 0][None, :]
    return float(((pos > neg) + 0.5 * (pos == neg)).mean())


def ref_roc_points(s, y) -> set:
    """Every ROC point (FPR, TPR) of "member when score >= t", t over the scores and +inf, rounded to 12 decimals."""
    points = {(0.0, 0.0)}
    for t in np.unique(s):
        called = s >= t
        points.add((round(float(called[y == 0].mean()), 12), round(float(called[y == 1].mean()), 12)))
    return points


def ref_paired_bootstrap(a, b, y, n_resamples: int, seed: int) -> tuple:
    """(p-value, CI low, CI high) of the paired, class-stratified bootstrap of AUC(a) - AUC(b), written out: each
    resample redraws the members and the non-members with replacement (the seeded generator's draws: one [R, n1]
    block of members, then one [R, n0] block of non-members), the same rows for both attacks; the null is the
    centred replicates, p = (1 + #{|D_r - D| >= |D|}) / (R + 1); the 95% percentile interval. AUCs are multiples
    of 1 / (n1 n0), so a tolerance of 1e-9 only absorbs rounding."""
    rng = np.random.default_rng(seed)
    pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
    members = pos[rng.integers(0, len(pos), (n_resamples, len(pos)))]
    others = neg[rng.integers(0, len(neg), (n_resamples, len(neg)))]
    delta = ref_auc(a, y) - ref_auc(b, y)
    d = np.array([ref_auc(a[r], y[r]) - ref_auc(b[r], y[r]) for r in np.concatenate([members, others], axis=1)])
    p = (1 + int(np.sum(np.abs(d - delta) >= abs(delta) - 1e-9))) / (n_resamples + 1)
    return (p, *np.quantile(d, [0.025, 0.975]))


def _run(n=60, attacks=("loss", "zlib"), labels=True, seed=0, **kw) -> ScoreRun:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    examples = [Example(f"ex{i}", np.arange(2000, dtype=np.int32), "t" * 50, int(y[i]) if labels else None)
                for i in range(n)]
    scores = {a: rng.normal(size=n) + (0.8 - 0.3 * k) * y for k, a in enumerate(attacks)}
    return ScoreRun(examples, scores, **kw)


def test_repr_is_one_line_and_the_metrics_table():
    run = _run(skipped={"ref": "needs --ref-model <dir>"}, notes=["one note"])
    text = repr(run)
    lines = text.splitlines()
    assert lines[0] == "ScoreRun: 60 examples (30 members, 30 non-members), 2 attacks, 1 skipped (ref)"
    assert lines[1].split() == ["attack", "AUC", "AUC", "SE", "TPR@1%FPR", "TPR@0.1%FPR"]
    y = run.labels
    for attack, s in run.scores.items():
        row = next(line for line in lines if line.startswith(attack + " "))
        assert float(row.split()[1]) == pytest.approx(ref_auc(s, y), abs=5e-5)
    assert "skipped ref: needs --ref-model <dir>" in lines and "1 note: run.notes" in lines
    assert f"{OVERVIEW_RESAMPLES} bootstrap resamples" in lines[-1]
    assert len(lines) <= OVERVIEW_LINES and len(text) < 2000  # never the token arrays
    assert "array" not in text and "Example(" not in text


def test_repr_stays_short_with_many_attacks_and_without_labels():
    many = repr(_run(attacks=[f"attack{i}" for i in range(60)]))
    assert len(many.splitlines()) <= OVERVIEW_LINES and "more attacks: run.metrics()" in many
    run = _run(labels=False)
    run.scores["zlib"][3] = np.nan
    lines = repr(run).splitlines()
    assert lines[0] == "ScoreRun: 60 examples (unlabelled), 2 attacks" and "AUC" not in repr(run)
    row = next(line for line in lines if line.startswith("zlib ")).split()
    finite = run.scores["zlib"][np.isfinite(run.scores["zlib"])]
    assert int(row[1]) == 59 and float(row[2]) == pytest.approx(finite.mean(), abs=5e-5)
    assert float(row[5]) == pytest.approx(np.median(finite), abs=5e-5)


def test_repr_metrics_are_cached_by_content_and_leave_metrics_alone():
    run = _run()
    before = run.metrics(n_resamples=100)
    first = repr(run)
    assert repr(run) == first and run.metrics(n_resamples=100) == before
    assert before == metric_rows(run.scores, run.labels, run.ids, 100, 0)
    run.scores["loss"] = -run.scores["loss"]  # other scores: the cache must not serve the old table
    row = next(line for line in repr(run).splitlines() if line.startswith("loss ")).split()
    assert float(row[1]) == pytest.approx(ref_auc(run.scores["loss"], run.labels), abs=5e-5)


def test_notebook_shows_the_summary_as_text_and_html():
    """What a notebook cell ``run`` displays (IPython's display formatter): the repr as text/plain, an HTML table with
    every text escaped."""
    from IPython.core.formatters import DisplayFormatter

    run = _run(attacks=("loss", "<b>x</b>"), skipped={"ref": "needs <a> & more"})
    data, _ = DisplayFormatter().format(run)
    assert data["text/plain"] == repr(run)
    page = data["text/html"]
    assert "<table>" in page and page.count("<tr>") == 3  # head + two attacks
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "needs &lt;a&gt; &amp; more" in page and "<b>x</b>" not in page
    auc = f"{ref_auc(run.scores['loss'], run.labels):.4f}"
    assert f"<td>{auc}</td>" in page


def test_plot_roc_draws_every_attack_on_log_axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = _run()
    run.scores["zlib"][0] = np.nan  # dropped from its curve, as from the metrics
    ax = run.plot_roc()
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log" and ax.get_xlim()[0] == pytest.approx(0.5 / 30)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    ok = np.isfinite(run.scores["zlib"])
    # every drawn vertex is a (FPR, TPR) point of the curve, counted by hand at each threshold; axes swapped, the
    # points above the diagonal would fall below it and out of the set
    for line, name in zip(ax.get_lines(), ("loss", "zlib")):
        keep = np.isfinite(run.scores[name])
        want = ref_roc_points(run.scores[name][keep], run.labels[keep])
        got = set(zip(np.round(line.get_xdata(), 12), np.round(line.get_ydata(), 12)))
        assert got <= want and any(y > x for x, y in got), name
    assert legend == [f"loss (AUC {ref_auc(run.scores['loss'], run.labels):.3f})",
                      f"zlib (AUC {ref_auc(run.scores['zlib'][ok], run.labels[ok]):.3f})", "chance"]
    fig, own = plt.subplots()
    assert run.plot_roc(ax=own, log=False) is own and own.get_xscale() == "linear"
    plt.close("all")
    with pytest.raises(ValueError, match="plot_roc needs"):
        _run(labels=False).plot_roc()


def test_compare_two_attacks_and_two_runs():
    run = _run(attacks=("loss", "zlib", "mink"))
    y = run.labels
    table = run.compare("loss")  # every other attack against loss
    assert [(r["attack"], r["against"]) for r in table] == [("zlib", "loss"), ("mink", "loss")]
    for r in table:
        a = run.scores[r["attack"]]
        assert r["delta"] == pytest.approx(ref_auc(a, y) - ref_auc(run.scores["loss"], y), abs=1e-12)
        assert r["value"] == pytest.approx(ref_auc(a, y), abs=1e-12)
        p, lo, hi = ref_paired_bootstrap(a, run.scores["loss"], y, n_resamples=200, seed=3)
        (one,) = run.compare("loss", r["attack"], n_resamples=200, seed=3)
        assert one["p_value"] == p and 1 / 201 < p < 1
        assert (one["ci_low"], one["ci_high"]) == pytest.approx((lo, hi), abs=1e-12)
    assert "delta = attack - against" in str(table) and "zlib" in repr(table)
    other = ScoreRun(run.examples, {"loss": run.scores["loss"] + 0.5 * y, "ref": run.scores["mink"]})
    (row,) = other.compare(run)  # the one attack both have
    assert (row["attack"], row["against"]) == ("loss", "loss (other run)")
    assert row["delta"] == pytest.approx(ref_auc(other.scores["loss"], y) - ref_auc(run.scores["loss"], y))


def test_compare_refuses_runs_on_other_examples():
    run = _run()
    shifted = ScoreRun(run.examples[1:] + run.examples[:1], run.scores)
    with pytest.raises(ValueError, match=r"position 0 is id 'ex0' here and 'ex1' in the other run"):
        run.compare(shifted)
    with pytest.raises(ValueError, match=r"different examples \(60 and 59\)"):
        run.compare(ScoreRun(run.examples[:59], {k: v[:59] for k, v in run.scores.items()}))
    relabelled = [Example(e.id, e.tokens, e.text, 1 - e.label) for e in run.examples]
    with pytest.raises(ValueError, match=r"example 'ex0' is labelled 0 here and 1 in the other run"):
        run.compare(ScoreRun(relabelled, run.scores))
    with pytest.raises(ValueError, match=r"no attack 'mink' in this run \(attacks: loss, zlib\)"):
        run.compare("mink")
    with pytest.raises(ValueError, match=r"no attack 'zlib' in the other run"):
        run.compare(ScoreRun(run.examples, {"loss": run.scores["loss"]}), "zlib")
    with pytest.raises(ValueError, match="compare needs"):
        _run(labels=False).compare("loss")


def test_to_pandas_stays():
    run = _run()
    df = run.to_pandas()
    assert list(df.columns) == ["id", "label", "loss", "zlib"] and df["loss"].tolist() == run.scores["loss"].tolist()


def test_summary_counts_lines_set_aside_and_runs_without_attacks():
    run = _run(n=4)
    bad = Example("bad", None, "", None)
    bad.invalid = "empty text"
    run.rows = [*run.examples, bad]
    assert repr(run).splitlines()[0] == ("ScoreRun: 4 examples (2 members, 2 non-members; 1 more set aside as "
                                         "invalid), 2 attacks")
    empty = ScoreRun(run.examples, {}, skipped={"ref": "needs --ref-model"})
    assert repr(empty).splitlines() == ["ScoreRun: 4 examples (2 members, 2 non-members), 0 attacks, 1 skipped (ref)",
                                        "skipped ref: needs --ref-model"]
