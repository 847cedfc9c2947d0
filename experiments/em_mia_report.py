"""The EM-MIA experiment's tables and report (``python -m experiments.em_mia``): AUC and TPR@1%FPR per model,
method and graded-difficulty split, the long numeric rows, and ``report.md``.
"""
from __future__ import annotations

from typing import Sequence

SPLITS = ("random", "easy", "medium", "hard", "mix-1", "mix-2")

DISPLAY = {"loss": "Loss", "ref": "Ref", "zlib": "Zlib", "mink:k=0.2": "Min-K% (k=0.2)",
           "minkpp:k=0.2": "Min-K%++ (k=0.2)", "recall_avg": "ReCaLL-Avg",
           **{f"em_mia:init={i}": f"EM-MIA (init {n})" for i, n in
              (("loss", "Loss"), ("ref", "Ref"), ("zlib", "Zlib"), ("mink", "Min-K%"), ("minkpp", "Min-K%++"))}}

BLIND_FEATURES = {"bow": "Blind: BoW + LR", "bert": "Blind: MiniLM + LR"}



def display(label: str) -> str:
    """The table name of an attack label (``recall:n=8`` -> "ReCaLL (8-shot)")."""
    if label.startswith("recall:n="):
        return f"ReCaLL ({label.split('=', 1)[1]}-shot)"
    return DISPLAY.get(label, label)


def table_rows(results: dict, models: Sequence[str], blind: dict, key: str) -> list:
    """Rows {"model", "method", <split>: value}: the blind rows first, then each model's methods."""
    rows = []
    for f, name in BLIND_FEATURES.items():
        if any(f in blind.get(s, {}) for s in SPLITS):
            rows.append({"model": "-", "method": name,
                         **{s: blind.get(s, {}).get(f, {}).get(key) for s in SPLITS}})
    for m in models:
        labels = list(dict.fromkeys(lbl for s in SPLITS for lbl in results[m].get(s, {})))
        for lbl in labels:
            rows.append({"model": m, "method": display(lbl),
                         **{s: results[m].get(s, {}).get(lbl, {}).get(key) for s in SPLITS}})
    return rows


def value_rows(results: dict, blind: dict) -> list:
    rows = []
    for s in SPLITS:
        for f, r in blind.get(s, {}).items():
            rows.append({"model": "-", "split": s, "method": BLIND_FEATURES[f], "auc": r["auc"], "auc_se": r["auc_se"],
                         "tpr_at_1pct_fpr": r["tpr_at_1pct_fpr"], "n": r["n"]})
    for m, per in results.items():
        for s in SPLITS:
            for lbl, r in per.get(s, {}).items():
                rows.append({"model": m, "split": s, "method": display(lbl), "auc": r.get("auc"),
                             "auc_se": r.get("auc_se"), "tpr_at_1pct_fpr": r.get("tpr_at_1pct_fpr"), "n": r.get("n")})
    return rows


def _md_table(rows: list, title: str, digits: int = 3) -> list:
    L = [f"### {title}", "", "| model | method | " + " | ".join(SPLITS) + " |", "|---|---|" + "---:|" * len(SPLITS)]
    for r in rows:
        L.append(f"| {r['model']} | {r['method']} | " + " | ".join(
            "" if r[s] is None else f"{r[s]:.{digits}f}" for s in SPLITS) + " |")
    return L + [""]


def report_markdown(s: dict) -> str:
    L = [f"# EM-MIA on graded-difficulty splits ({s['setting']})", "", s["description"], ""]
    d = s["difficulty"]
    L += [f"Splits: {d['params']['size']} texts each ({d['params']['size'] // 2} + {d['params']['size'] // 2}) from a "
          f"pool of {s['pool']['members']} members and {s['pool']['nonmembers']} non-members of {s['pool']['doc_len']} "
          f"tokens; K = {d['params']['k']}, filter {d['params']['threshold']}, {d['info']['valid_member_clusters']} "
          f"valid member and {d['info']['valid_nonmember_clusters']} valid non-member clusters, cluster pair mean "
          "distances: " + ", ".join(f"{k} {v[2]:.3f}" for k, v in d["info"]["pairs"].items()) + ".", ""]
    L += _md_table(s["table_auc"], "AUC")
    L += _md_table(s["table_tpr"], "TPR@1%FPR")
    L += ["Blind rows: logistic regression on bag-of-words / MiniLM features, trained on a seeded half of each split "
          "and evaluated on the other half: the higher, the easier the split is to tell apart without the model.", ""]
    if s.get("skipped"):
        L += ["## Skipped", ""] + [f"- {k}: {v}" for k, v in s["skipped"].items()] + [""]
    if s.get("notes"):
        L += ["## Notes", ""] + [f"- {n}" for n in s["notes"]] + [""]
    L += ["Bootstrap SEs: `values.csv`; timings: `timings.json`; inputs and hashes: `manifest.json`.", ""]
    return "\n".join(L)
