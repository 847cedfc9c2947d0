import csv
import io
import json

import numpy as np

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


def test_write_tables_and_plots(tmp_path):
    paths = report.write_tables(ROWS, tmp_path, stem="t", extra_json={"verdict": "ok"})
    assert json.loads(paths["json"].read_text())["verdict"] == "ok"
    assert all(p.exists() for p in paths.values())
    rng = np.random.default_rng(0)
    y = np.r_[np.ones(100), np.zeros(100)]
    scores = {"a": y + rng.normal(size=200), "b": rng.normal(size=200)}
    report.plot_roc(scores, y, path=tmp_path / "roc.png")
    report.plot_histograms(scores, y, path=tmp_path / "hist.png")
    assert (tmp_path / "roc.png").stat().st_size > 1000 and (tmp_path / "hist.png").stat().st_size > 1000
