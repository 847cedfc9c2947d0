import csv
import io
import json

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from mia import report

ROWS = [
    {"method": "LOSS", "auc": 0.5131, "auc_se": 0.01301, "tpr_at_1pct_fpr": 0.006, "n": 2000},
    {"method": "Min-K%_20 & co", "auc": 0.5, "auc_se": 0.013, "tpr_at_1pct_fpr": 0.012, "n": 2000},
]


def test_markdown_table():
    md = report.markdown(ROWS, title="Pythia 70m")
    lines = md.strip().splitlines()
    assert lines[0] == "### Pythia 70m"
    assert lines[2] == "| Method | AUC | AUC SE | TPR@1%FPR |"
    assert lines[4] == "| LOSS | 0.513 | 0.0130 | 0.006 |"
    assert len(lines) == 6


def test_csv_full_precision():
    rows = list(csv.DictReader(io.StringIO(report.csv_text(ROWS))))
    assert rows[0]["auc"] == "0.5131" and rows[1]["method"] == "Min-K%_20 & co" and rows[0]["n"] == "2000"


def test_latex_escapes():
    tex = report.latex(ROWS, caption="a_b")
    assert r"\begin{tabular}{lrrr}" in tex and r"Min-K\%\_20 \& co & 0.500 & 0.0130 & 0.012 \\" in tex
    assert r"\caption{a\_b}" in tex and r"\toprule" in tex


def _brute_roc_points(s, y):
    """Every (FPR, TPR) of the rule 'member iff score >= t', over all thresholds t (plus the (0, 0) corner)."""
    pts = {(0.0, 0.0)}
    for t in np.unique(s):
        pts.add((((s >= t) & (y == 0)).sum() / (y == 0).sum(), ((s >= t) & (y == 1)).sum() / (y == 1).sum()))
    return pts


def test_write_tables_and_plots(tmp_path):
    paths = report.write_tables(ROWS, tmp_path, stem="t", title="Pythia 70m", extra_json={"verdict": "ok"})
    assert {k: p.name for k, p in paths.items()} == {"md": "t.md", "csv": "t.csv", "tex": "t.tex", "json": "t.json"}
    doc = json.loads(paths["json"].read_text())
    assert doc == {"rows": ROWS, "verdict": "ok"}
    md = paths["md"].read_text().strip().splitlines()
    assert md[0] == "### Pythia 70m" and md[2] == "| Method | AUC | AUC SE | TPR@1%FPR |"
    assert md[4:] == ["| LOSS | 0.513 | 0.0130 | 0.006 |", "| Min-K%_20 & co | 0.500 | 0.0130 | 0.012 |"]
    rows = list(csv.DictReader(io.StringIO(paths["csv"].read_text())))
    assert [(r["method"], float(r["auc"]), float(r["auc_se"]), int(r["n"])) for r in rows] == [
        (r["method"], r["auc"], r["auc_se"], r["n"]) for r in ROWS]
    tex = paths["tex"].read_text()
    assert r"LOSS & 0.513 & 0.0130 & 0.006 \\" in tex and r"Min-K\%\_20 \& co & 0.500 & 0.0130 & 0.012 \\" in tex

    rng = np.random.default_rng(0)
    y = np.r_[np.ones(100), np.zeros(100)]
    scores = {"a": y + rng.normal(size=200), "b": rng.normal(size=200)}
    fig = report.plot_roc(scores, y, path=tmp_path / "roc.png")
    assert (tmp_path / "roc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (ax,) = fig.axes
    # log-log axes down to half a non-member (0.5 / 100) so the low-FPR regime is visible
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_xlim() == pytest.approx((0.005, 1)) and ax.get_ylim() == pytest.approx((0.005, 1))
    assert ax.get_xlabel() == "False positive rate" and ax.get_ylabel() == "True positive rate"
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    want = {f"{k} (AUC {roc_auc_score(y, v):.3f})" for k, v in scores.items()} | {"chance"}
    assert set(lines) == want
    for name, s in scores.items():
        (ln,) = [ln for label, ln in lines.items() if label.startswith(f"{name} (")]
        xy = ln.get_xydata()
        assert ln.get_drawstyle() == "steps-post" and np.all(np.diff(xy[:, 0]) >= 0) and tuple(xy[-1]) == (1, 1)
        brute = _brute_roc_points(s, y)
        assert all(any(abs(f - bf) < 1e-12 and abs(t - bt) < 1e-12 for bf, bt in brute) for f, t in xy)
        # the step curve's best TPR at FPR <= 1% is the brute-force one
        assert xy[xy[:, 0] <= 0.01, 1].max() == pytest.approx(max(t for f, t in brute if f <= 0.01))
    np.testing.assert_allclose(lines["chance"].get_xydata(), [[0.005, 0.005], [1, 1]])

    fig = report.plot_histograms(scores, y, path=tmp_path / "hist.png")
    assert (tmp_path / "hist.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [ax.get_title() for ax in fig.axes] == ["a", "b"]
    for ax, (name, s) in zip(fig.axes, scores.items()):  # members, non-members: 40 bins each, a density (area 1)
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["member", "non-member"]
        for c, cls in zip(ax.containers, (1, 0)):
            assert len(c.patches) == 40
            w = np.array([p.get_width() for p in c.patches])
            h = np.array([p.get_height() for p in c.patches])
            mid = np.array([p.get_x() for p in c.patches]) + w / 2
            assert (w * h).sum() == pytest.approx(1.0)
            assert abs((mid * w * h).sum() - s[y == cls].mean()) < w[0] / 2  # this class's scores, binned
