"""The CAMIA experiment's tables and report (``python -m experiments.camia``): Table 1 / 13 (methods x domains, "mean
± sd" over the calibration draws), the long numeric rows, Table 2 (n-gram splits) and ``report.md``.
"""
from __future__ import annotations

from typing import Sequence

from mia.attacks.camia_protocol import COMBINERS

BASELINES = ("loss", "zlib", "mink:k=0.2", "minkpp:k=0.2", "ref", "neighbor")  # the paper's K = 20 for Min-K%
DISPLAY = {"blind": "Blind (BoW + LR, 80/20)", "loss": "LOSS", "zlib": "Zlib", "mink:k=0.2": "Min-K% (k=0.2)",
           "minkpp:k=0.2": "Min-K%++ (k=0.2)", "ref": "Reference", "neighbor": "Neighborhood",
           "camia:edgington": "CAMIA (Edgington)", "camia:fisher": "CAMIA (Fisher)",
           "camia:pearson": "CAMIA (Pearson)", "camia:george": "CAMIA (George)",
           "camia_lr": "CAMIA (LR + group PCA, c=2; members too)"}
TABLE2_METHODS = ("loss", "zlib", "mink:k=0.2", "minkpp:k=0.2", "camia:edgington", "camia:george")


def cell(mean, sd, scale: float = 1.0, digits: int = 3) -> str:
    """A table cell "mean ± sd" (``scale`` x, ``digits`` decimals; '' without a mean, no ± without an sd)."""
    if mean is None:
        return ""
    s = f"{mean * scale:.{digits}f}"
    return s + (f" ± {sd * scale:.{digits}f}" if sd is not None else "")


def method_order(results: dict) -> list:
    """Methods in the paper's row order (blind, baselines, CAMIA combiners, LR), those present anywhere."""
    seen = {m for r in results.values() for m in r}
    order = ["blind"] + list(BASELINES) + [f"camia:{c}" for c in COMBINERS] + ["camia_lr"]
    return [m for m in order if m in seen] + sorted(m for m in seen if m not in order)


def table1_rows(results: dict, datasets: Sequence[str]) -> list:
    """Wide rows: method, then per dataset "<d> AUC" and "<d> TPR%" cells "mean ± sd"."""
    rows = []
    for m in method_order(results):
        row = {"method": DISPLAY.get(m, m)}
        for d in datasets:
            r = results[d].get(m)
            row[f"{d} AUC"] = cell(r["auc"], r["auc_sd"]) if r else ""
            row[f"{d} TPR%"] = cell(r["tpr"], r["tpr_sd"], 100.0, 2) if r else ""
        rows.append(row)
    return rows


def value_rows(results: dict, counts: dict) -> list:
    """Long numeric rows: dataset, method, auc, auc_sd, tpr, tpr_sd, n_draws, n_members, n_nonmembers."""
    rows = []
    for d, res in results.items():
        for m in method_order({d: res}):
            r = res[m]
            rows.append({"dataset": d, "method": m, **{k: r[k] for k in ("auc", "auc_sd", "tpr", "tpr_sd", "n_draws")},
                         **counts.get(d, {})})
    return rows


def table2_rows(t2: dict) -> list:
    """Rows per (domain, n-gram split): non-members kept, then TPR% and AUC of the Table 2 methods."""
    rows = []
    for (d, split), (res, n_non) in t2.items():
        row = {"domain": d, "split": split, "n non-members": n_non}
        for m in TABLE2_METHODS:
            r = res.get(m)
            row[f"{DISPLAY.get(m, m)} TPR%"] = cell(r["tpr"], r["tpr_sd"], 100.0, 2) if r else ""
        for m in TABLE2_METHODS:
            r = res.get(m)
            row[f"{DISPLAY.get(m, m)} AUC"] = cell(r["auc"], r["auc_sd"]) if r else ""
        rows.append(row)
    return rows


def report_markdown(s: dict) -> str:
    L = [f"# CAMIA Table 1 / Table 2 ({s['setting']})", "", s["model"]["description"], ""]
    L += [f"Protocol: {s['protocol']}", ""]
    ds = s["datasets"]
    L += ["## Table 1: TPR@1%FPR (%), mean ± sd over the calibration draws", ""]
    L += ["| Attack | " + " | ".join(ds) + " |", "|---|" + "---:|" * len(ds)]
    for r in s["table1_values_wide"]:
        L.append(f"| {r['method']} | " + " | ".join(r["tpr"].get(d, "") for d in ds) + " |")
    L += ["", "## Table 13: AUC, mean ± sd over the calibration draws", ""]
    L += ["| Attack | " + " | ".join(ds) + " |", "|---|" + "---:|" * len(ds)]
    for r in s["table1_values_wide"]:
        L.append(f"| {r['method']} | " + " | ".join(r["auc"].get(d, "") for d in ds) + " |")
    L += ["", "| dataset | members | non-members | " + " | ".join(k for k in s.get("dataset_info_keys", [])) + " |",
          "|---|---:|---:|" + "---:|" * len(s.get("dataset_info_keys", []))]
    for d in ds:
        c = s["counts"][d]
        extra = [str(s["dataset_info"].get(d, {}).get(k, "")) for k in s.get("dataset_info_keys", [])]
        L.append(f"| {d} | {c['n_members']} | {c['n_nonmembers']} | " + " | ".join(extra) + " |")
    if s.get("table2"):
        L += ["", "## Table 2: n-gram overlap splits (TPR@1%FPR %, then AUC)", ""]
        cols = list(s["table2"][0])
        L += ["| " + " | ".join(cols) + " |", "|" + "---|" * 2 + "---:|" * (len(cols) - 2)]
        for r in s["table2"]:
            L.append("| " + " | ".join(str(r[c]) for c in cols) + " |")
    if s.get("skipped"):
        L += ["", "## Skipped", ""] + [f"- {k}: {v}" for k, v in s["skipped"].items()]
    if s.get("notes"):
        L += ["", "## Notes", ""] + [f"- {n}" for n in s["notes"]]
    L += ["", "Numbers: `table1_values.csv`; timings: `timings.json`; inputs and hashes: `manifest.json`.", ""]
    return "\n".join(L)
