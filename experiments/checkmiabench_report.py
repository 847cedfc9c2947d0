"""The CheckMIABench experiment's report (``python -m experiments.checkmiabench``): its markdown and the columns of
its tables, from the run's summary alone, so that a saved run is rendered again without the experiment's jax."""
from __future__ import annotations

ATTACK_COLUMNS = ("model", "step", "method", "auc", "auc_se", "tpr_at_1pct_fpr")
PAPER_COLUMNS = ("paper_auc", "paper_auc_se", "paper_tpr_at_1pct_fpr", "paper_source")
BLIND_COLUMNS = ("step", "method", "classifier", "auc", "auc_se", "tpr_at_1pct_fpr")


def report_markdown(s: dict) -> str:
    """The run's report: setup, both tables, the computed findings, skipped attacks and notes (no timings)."""
    from mia.report import markdown

    paper = PAPER_COLUMNS if any("paper_auc" in r for r in s["attacks"] + s["blind"]) else ()
    eps = ("eps_lower",) if any("eps_lower" in r for r in s["attacks"]) else ()
    blind_columns, attack_columns = BLIND_COLUMNS + paper, ATTACK_COLUMNS + eps + paper

    L = [f"# CheckMIABench ({s['kind']}, {s['preset']} preset)", "", s["description"] + ".", ""]
    for c, sp in s["splits"].items():
        parts = ", ".join(f"{k} {v['members']}+{v['nonmembers']}" for k, v in sp["partitions"].items())
        L.append(f"- step{c}: members from steps [{sp['member_steps'][0]}, {sp['member_steps'][1]}), non-members "
                 f"from [{sp['nonmember_steps'][0]}, {sp['nonmember_steps'][1]}); partitions (members+non-members) "
                 f"{parts}; seed {sp['seed']}"
                 + (f"; {sp['duplicates_dropped']} evaluated row(s) equal to a learned-from row dropped."
                    if sp.get("duplicates_dropped") else "."))
    if s.get("memorize_epochs"):
        L.append(f"- Memorization dial: every checkpoint trained {s['memorize_epochs']} more epochs on its split's "
                 "members only; the clean checkpoint's LOSS is a reference row.")
    L.append("")
    L += ["## Findings (computed from the numbers below)", ""]
    for c, text in s["findings"]["blind"].items():
        L.append(f"- Blind baselines, step{c}: {text}")
    L += [f"- {s['findings']['scale']}", f"- {s['findings']['recency']}"]
    if s["model_free"]:
        L.append(f"- Model-free (expected flat, left out of the trends): {', '.join(s['model_free'])}.")
    L.append("")
    if s["blind"]:
        L += [markdown(s["blind"], blind_columns,
                       "Table 1/3 layout: blind baselines (best of LR/RF/MLP per feature)"), ""]
    L += [markdown(s["attacks"], attack_columns, "Table 2/4 layout: attacks per model size and checkpoint"), ""]
    L += ["Curves: `recency.md` / `recency.png` (AUC by steps since seen, "
          f"{s['bins']} bins, 95% bootstrap bands) and `scale.md` / `scale.png` (AUC by model size).", ""]
    if s.get("skipped"):
        L += ["## Skipped", ""] + [f"- {k}: {v}" for k, v in s["skipped"].items()] + [""]
    if s.get("notes"):
        L += ["## Notes", ""] + [f"- {n}" for n in s["notes"]] + [""]
    L += ["Inputs, seeds and hashes: `manifest.json`; timings: `timings.json`.", ""]
    return "\n".join(L)
