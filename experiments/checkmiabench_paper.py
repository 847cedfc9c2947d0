"""The CheckMIABench paper's numbers and setting (``python -m experiments.checkmiabench``): its attacks with their
parameters (App. A), its published Tables 1-4, the split behind them (Sec. 4), and when a run of ours has the
paper's setting so that its numbers may stand beside ours (``paper_setting_differences``,
``paper_attack_reference``, ``paper_blind_reference``, ``paper_notes``).
"""
from __future__ import annotations

from typing import Optional, Sequence

# The paper's attacks with its settings (App. A): Min-K / Min-K++ at k = 0.1, MoPe n = 10, sigma = 0.005, its own
# ReCaLL (a ~100-token non-member prefix) and its Zlib (pandora's model-free -zlib length).
PAPER_ZLIB = "zlib_entropy"
PAPER_ATTACKS = {"LOSS": "loss", "Min-K": "mink:k=0.1", "Min-K++": "minkpp:k=0.1", "Zlib": PAPER_ZLIB,
                 "MoPe": "mope:n=10,sigma=0.005", "ReCaLL": "recall:variant=checkmia"}
# Published numbers, read from the CheckMIABench paper's Tables 1-4: (AUC, AUC SE, TPR@1%FPR).
PAPER_TABLE2 = {  # Table 2: Pythia (deduped) at step 97,000; rows "<model>  <MIA>"
    "70m": {"LOSS": (0.513, 0.0130, 0.006), "Min-K": (0.500, 0.0130, 0.012), "Min-K++": (0.496, 0.0128, 0.011),
            "Zlib": (0.499, 0.0129, 0.016), "MoPe": (0.487, 0.0126, 0.025), "ReCaLL": (0.490, 0.0130, 0.010)},
    "160m": {"LOSS": (0.513, 0.0130, 0.007), "Min-K": (0.500, 0.0127, 0.011), "Min-K++": (0.499, 0.0126, 0.014),
             "Zlib": (0.499, 0.0127, 0.016), "MoPe": (0.495, 0.0132, 0.015), "ReCaLL": (0.490, 0.0124, 0.006)},
    "410m": {"LOSS": (0.512, 0.0128, 0.007), "Min-K": (0.498, 0.0132, 0.006), "Min-K++": (0.496, 0.0126, 0.014),
             "Zlib": (0.499, 0.0127, 0.016), "MoPe": (0.504, 0.0130, 0.014), "ReCaLL": (0.493, 0.0131, 0.008)},
    "1b": {"LOSS": (0.513, 0.0122, 0.007), "Min-K": (0.502, 0.0125, 0.007), "Min-K++": (0.498, 0.0126, 0.013),
           "Zlib": (0.500, 0.0129, 0.016), "MoPe": (0.495, 0.0126, 0.015), "ReCaLL": (0.487, 0.0123, 0.008)},
    "2.8b": {"LOSS": (0.506, 0.0131, 0.007), "Min-K": (0.489, 0.0124, 0.006), "Min-K++": (0.489, 0.0126, 0.014),
             "Zlib": (0.499, 0.0129, 0.016), "MoPe": (0.493, 0.0131, 0.006), "ReCaLL": (0.498, 0.0131, 0.010)},
}
PAPER_TABLE4 = {  # Table 4: OLMo-7B at step 400,000
    "7b": {"LOSS": (0.505, 0.0125, 0.01), "Min-K": (0.504, 0.0129, 0.013), "Min-K++": (0.490, 0.0124, 0.009),
           "Zlib": (0.499, 0.0128, 0.019), "ReCaLL": (0.521, 0.0130, 0.011)},
}
PAPER_TABLE1 = {"BoW (tokens)": (0.505, 0.0128, 0.01), "TF-IDF (tokens)": (0.503, 0.0127, 0.006)}  # Pythia
PAPER_TABLE3 = {"BoW (tokens)": (0.491, 0.0131, 0.01), "TF-IDF (tokens)": (0.491, 0.0128, 0.008)}  # OLMo
PAPER_BLIND_NOT_SAME = ("W2V and BERT: the paper's numbers (W2V on GoogleNews vectors, BERT = bert-base-uncased [CLS]) "
                        "are not shown beside ours, whose encoders differ (word2vec trained on the train partition; "
                        "the MiniLM encoder)")
PAPER_SETTING = {"pythia": {"step": 97_000, "end_step": 98_500, "table_blind": ("Table 1", PAPER_TABLE1),
                            "table_attacks": ("Table 2", PAPER_TABLE2)},
                 "olmo": {"step": 400_000, "end_step": None, "table_blind": ("Table 3", PAPER_TABLE3),
                          "table_attacks": ("Table 4", PAPER_TABLE4)}}
# The split behind the paper's numbers (Sec. 4): points sampled uniformly before and after the checkpoint (no gap);
# 1,000 evaluated per class; the blind classifiers trained on 4,000 per class.
PAPER_SPLIT = {"gap": 0, "eval": 1000, "train": 4000}


def paper_setting_differences(kind: str, step: int, *, gap: int, end_step: Optional[int] = None,
                              eval_counts: Optional[tuple] = None, train_counts: Optional[tuple] = None) -> list:
    """What of a ``kind`` run's setting at checkpoint ``step`` differs from the paper's (``PAPER_SETTING``,
    ``PAPER_SPLIT``), one phrase each (``"gap 10 (paper: 0)"``); empty: the same, so the paper's numbers may stand
    beside ours. ``eval_counts`` / ``train_counts``: (members, non-members) of the split as drawn (train: blind rows
    only). A kind the paper did not run (the testbed): ``["no paper numbers for kind testbed"]``."""
    setting = PAPER_SETTING.get(kind)
    if setting is None:
        return [f"no paper numbers for kind {kind}"]
    out = []
    if int(step) != setting["step"]:
        out.append(f"step {step} (paper: {setting['step']:,})")
    if setting["end_step"] is not None and end_step is not None and int(end_step) != setting["end_step"]:
        out.append(f"non-members up to step {end_step} (paper: {setting['end_step']:,})")
    if int(gap) != PAPER_SPLIT["gap"]:
        out.append(f"gap {gap} (paper: {PAPER_SPLIT['gap']})")
    for what, counts in (("eval", eval_counts), ("train", train_counts)):
        want = PAPER_SPLIT[what]
        if counts is not None and tuple(counts) != (want, want):
            out.append(f"{what} {counts[0]:,} + {counts[1]:,} (paper: {want:,} + {want:,})")
    return out


def paper_attack_reference(kind: str, model: str, step: int, method: str, end_step: Optional[int] = None):
    """``(auc, auc_se, tpr, "Table 2, row 70m LOSS")`` when our run has the paper's setting for this row, else None.

    Same setting = the same model family and size at the paper's checkpoint (Pythia step 97,000 with non-members
    up to 98,500; OLMo-7B step 400,000) and the attack with the paper's parameters (``PAPER_ATTACKS``)."""
    setting = PAPER_SETTING.get(kind)
    if setting is None or int(step) != setting["step"]:
        return None
    if setting["end_step"] is not None and end_step is not None and int(end_step) != setting["end_step"]:
        return None
    name = next((k for k, v in PAPER_ATTACKS.items() if v == method), None)
    table, numbers = setting["table_attacks"]
    if name is None or name not in numbers.get(model, {}):
        return None
    return (*numbers[model][name], f"{table}, row {model} {name}")


def paper_blind_reference(kind: str, step: int, feature: str):
    setting = PAPER_SETTING.get(kind)
    if setting is None or int(step) != setting["step"]:
        return None
    table, numbers = setting["table_blind"]
    if feature not in numbers:
        return None
    return (*numbers[feature], f"{table}, row {feature}")


def paper_notes(kind: str, step: int, differs: list, differs_blind: list, blind: bool, models: Sequence[str]) -> list:
    """Report notes on the paper's numbers at checkpoint ``step`` of a ``kind`` run (one the paper ran): why they are
    not shown beside ours (``differs``: attacks, ``differs_blind``: blind baselines, from
    ``paper_setting_differences``), and which of our ``models`` the paper's table has no row for."""
    setting = PAPER_SETTING[kind]
    (t_att, numbers), (t_blind, _) = setting["table_attacks"], setting["table_blind"]
    out = []
    if differs:
        out.append(f"step{step}: the paper's {t_att} numbers are not shown beside ours: our setting differs from the "
                   f"paper's ({'; '.join(differs)})")
    if blind and differs_blind and differs_blind != differs:
        out.append(f"step{step}: the paper's {t_blind} numbers are not shown beside our blind baselines: our setting "
                   f"differs from the paper's ({'; '.join(differs_blind)})")
    missing = sorted({m for m in models if m not in numbers})
    if missing and not differs:
        out.append(f"step{step}: the paper's {t_att} has no row for {', '.join(missing)}")
    return out
