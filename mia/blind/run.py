"""Blind baselines on a split: features x classifiers trained on partition "train", scored on partition "eval",
and the distribution-shift verdict (CheckMIABench Table 1 sanity check).

Per feature, one classifier is CHOSEN on the training partition alone: the highest out-of-fold AUC of a seeded
stratified ``cv_folds``-fold cross-validation (default 3) over the training examples; its evaluation AUC is the
reported one. The paper instead reports the best evaluation AUC of the three classifiers, which selects on
evaluation data (optimistic); that row is also given, labelled ``best_eval``, for comparison with its Table 1.

A split whose members and non-members can be told apart WITHOUT the model (AUC significantly above 0.5) has a
distribution shift: attack AUCs on it do not measure membership.
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
from tqdm.auto import tqdm

from .. import metrics
from ..data.splits import Split, read_split
from .classifiers import CLASSIFIER_NAMES, DISPLAY as CLF_DISPLAY, fit_predict
from .features import FEATURE_NAMES, data_kind, display_name, make_feature

log = logging.getLogger(__name__)

PAPER_TRAIN_PER_CLASS = 4000  # CheckMIABench: 4,000 (Pythia) per class for training
PAPER_EVAL_PER_CLASS = 1000   # and 1,000 per class for testing (AUC SE ~ 0.0128)
MIN_PER_CLASS = 5             # below this a classifier or a bootstrap is meaningless
EVAL_FRACTION = PAPER_EVAL_PER_CLASS / (PAPER_TRAIN_PER_CLASS + PAPER_EVAL_PER_CLASS)


class BlindError(ValueError):
    """Bad input for the blind baselines (one line)."""


class BlindWarning(UserWarning):
    pass


def _labels(examples) -> np.ndarray:
    bad = [str(e.get("id")) for e in examples if e.get("label") not in (0, 1)][:5]
    if bad:
        raise BlindError(f"every example needs label 0 or 1; id(s) {', '.join(bad)} do not")
    return np.array([int(e["label"]) for e in examples])


def _stratified_subsample(examples, per_class: Optional[int], rng: np.random.Generator) -> list:
    if per_class is None:
        return list(examples)
    y = _labels(examples)
    keep = []
    for c in (0, 1):
        idx = np.flatnonzero(y == c)
        keep.extend(rng.choice(idx, min(per_class, len(idx)), replace=False).tolist())
    return [examples[i] for i in sorted(keep)]


def train_eval_sets(split: Split, seed: int = 0, n_train: Optional[int] = None, n_eval: Optional[int] = None,
                    warn: Callable[[str], Any] = None) -> tuple[list, list, list]:
    """(train examples, eval examples, warnings). Uses partitions "train"/"eval"; without a "train" partition, makes a
    seeded stratified split (EVAL_FRACTION per class to eval) of the "eval" examples (all examples if none)."""
    msgs: list[str] = []
    # noqa: E731
    say = lambda m: (msgs.append(m), (warn or (lambda s: warnings.warn(s, BlindWarning, stacklevel=3)))(m))
    rng = np.random.default_rng(seed)
    parts = split.partitions
    if "train" in parts:
        train, ev = split.partition("train"), split.partition("eval")
        if not ev:
            raise BlindError("the split has a 'train' partition but no 'eval' partition (partitions: "
                             f"{', '.join(parts)})")
    else:
        pool = split.partition("eval") or list(split.examples)
        if not pool:
            raise BlindError("the split has no examples")
        y = _labels(pool)
        tr_idx, ev_idx = [], []
        for c in (0, 1):
            idx = rng.permutation(np.flatnonzero(y == c))
            k = int(round(len(idx) * EVAL_FRACTION))
            ev_idx += idx[:k].tolist()
            tr_idx += idx[k:].tolist()
        train, ev = [pool[i] for i in sorted(tr_idx)], [pool[i] for i in sorted(ev_idx)]
        say(f"no 'train' partition: made a seeded (seed {seed}) stratified split of {len(pool)} examples, "
            f"{EVAL_FRACTION:.0%} of each class to eval")
    train = _stratified_subsample(train, n_train, rng)
    ev = _stratified_subsample(ev, n_eval, rng)
    for name, ex, paper in (("train", train, PAPER_TRAIN_PER_CLASS), ("eval", ev, PAPER_EVAL_PER_CLASS)):
        y = _labels(ex)
        n1, n0 = int(y.sum()), int(len(y) - y.sum())
        if n1 == 0 or n0 == 0:
            raise BlindError(f"the {name} set has one class only ({n1} members, {n0} non-members); need both")
        if min(n1, n0) < MIN_PER_CLASS:
            raise BlindError(f"the {name} set has {n1} members and {n0} non-members; need at least {MIN_PER_CLASS} of "
                             "each")
        if min(n1, n0) < paper:
            say(f"{name} set is smaller than the paper's {paper}+{paper} ({n1} members, {n0} non-members): "
                "scaled down, so standard errors are larger")
    return train, ev, msgs


def _load_tokenizer(tokenizer, split: Split):
    if tokenizer is None:
        tokenizer = (split.header.get("source") or {}).get("tokenizer")
    if tokenizer is None or not isinstance(tokenizer, (str, Path)):
        return tokenizer
    if not Path(tokenizer).exists():
        raise BlindError(f"tokenizer directory not found: {tokenizer}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)


def cross_validated_auc(name: str, x, y, *, folds: int, seed: int) -> float:
    """Pooled out-of-fold AUC of classifier ``name`` on (x, y): seeded stratified ``folds``-fold CV, every example
    scored once by the classifier trained on the other folds. Uses the training data only."""
    from sklearn.model_selection import StratifiedKFold

    y = np.asarray(y)
    oof = np.empty(len(y))
    for tr, te in StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed).split(np.zeros(len(y)), y):
        oof[te] = fit_predict(name, x[tr], y[tr], x[te], seed=seed)
    return float(metrics.auc(oof, y))


def choose_classifier(x, y, classifiers: Sequence[str], *, folds: int, seed: int) -> tuple[str, dict]:
    """(the classifier with the highest cross-validated AUC on the training data, {name: CV AUC}); ties go to the
    first in ``classifiers``. One classifier is chosen without CV."""
    if len(classifiers) == 1:
        return classifiers[0], {}
    cv = {c: cross_validated_auc(c, x, y, folds=folds, seed=seed) for c in classifiers}
    return max(classifiers, key=lambda c: (cv[c], -classifiers.index(c))), cv


def run_blind(split: Union[Split, str, Path, Sequence[dict]], features: Sequence[str] = ("bow", "tfidf", "w2v", "bert"),
              classifiers: Sequence[str] = CLASSIFIER_NAMES, seed: int = 0, *, encoder: Any = None,
              encoder_dir: Optional[str] = None, tokenizer: Any = None, n_resamples: int = 1000,
              n_train: Optional[int] = None, n_eval: Optional[int] = None, cv_folds: int = 3,
              warn: Optional[Callable[[str], Any]] = None, return_scores: bool = False, progress: bool = False):
    """Train each classifier on each feature of partition "train"; score partition "eval".

    Returns rows ``{"method", "feature", "classifier", "kind": "run", "auc", "auc_se", "tpr_at_1pct_fpr",
    "p_auc_gt_half", "n_train", "n_eval", ...}`` (one per feature x classifier, AUC SE from the pooled bootstrap as
    the paper), then per feature one ``"kind": "chosen"`` row (the classifier chosen by ``cv_folds``-fold
    cross-validation on the training partition, with ``cv_auc`` of every candidate; its eval AUC is what we report)
    and one ``"kind": "best_eval"`` row (the paper's Table 1 rule: the highest eval AUC of the classifiers, selected
    on evaluation data, so optimistic). With ``return_scores`` also returns {method: P(member) on eval} and the eval
    labels. ``progress``: a bar over the work (per feature: fit, transform, each classifier, the cross-validated
    choice), on stderr.
    """
    if not isinstance(split, Split):
        split = read_split(split) if isinstance(split, (str, Path)) else Split({}, [dict(e) for e in split])
    unknown = [f for f in features if f not in FEATURE_NAMES] + [c for c in classifiers if c not in CLASSIFIER_NAMES]
    if unknown:
        raise BlindError(f"unknown feature/classifier {', '.join(unknown)}; features: {', '.join(FEATURE_NAMES)}; "
                         f"classifiers: {', '.join(CLASSIFIER_NAMES)}")
    if not features or not classifiers:
        raise BlindError("need at least one feature and one classifier")
    if cv_folds < 2:
        raise BlindError(f"cv_folds must be at least 2, got {cv_folds}")
    train, ev, _ = train_eval_sets(split, seed, n_train, n_eval, warn)
    kind = data_kind(train + ev)
    y_tr, y_ev = _labels(train), _labels(ev)
    ids = [str(e.get("id")) for e in ev]
    tok = (
        _load_tokenizer(tokenizer, split) if any(f in ("w2v", "bert") for f in features) and kind == "tokens" else None
    )
    if "bert" in features:  # fail before any work: a missing encoder or tokenizer is a one-line error
        if kind == "tokens" and tok is None:
            raise BlindError("bert features of token ids need the target model's tokenizer to decode them "
                             "(pass --tokenizer DIR, or a split whose header names source.tokenizer)")
        if encoder is None:
            from ..models.bert import load_encoder  # jax and flax load only when the BERT feature is asked for

            encoder = load_encoder(encoder_dir)
    classifiers = list(classifiers)
    if len(classifiers) > 1 and min(int(y_tr.sum()), int(len(y_tr) - y_tr.sum())) < cv_folds:
        raise BlindError(f"choosing a classifier by {cv_folds}-fold cross-validation needs at least {cv_folds} "
                         f"training examples of each class")
    rows, chosen, best, scores = [], [], [], {}
    bar = tqdm(total=len(features) * (len(classifiers) + 3), desc="blind baselines", unit="step", leave=False,
               disable=not progress)
    step = _stepper(bar)
    for fname in features:
        t0 = time.perf_counter()
        with step(f"{fname}: fit"):
            feat = make_feature(fname, kind, seed=seed, tokenizer=tok, encoder=encoder,
                                encoder_dir=encoder_dir).fit(train)
        with step(f"{fname}: features of {len(train) + len(ev)} texts"):
            x_tr, x_ev = feat.transform(train), feat.transform(ev)
        log.info("blind: %s features %s in %.1fs", fname, x_tr.shape, time.perf_counter() - t0)
        frows = []
        for cname in classifiers:
            with step(f"{fname} + {cname}"):
                s = fit_predict(cname, x_tr, y_tr, x_ev, seed=seed)
            method = f"{display_name(fname, kind)} + {CLF_DISPLAY[cname]}"
            try:
                r = metrics.summary_row(method, s, y_ev, n_resamples=n_resamples, seed=seed, ids=ids)
            except metrics.MetricError as e:
                raise BlindError(f"{method}: {e}") from None
            r.update(feature=display_name(fname, kind), classifier=CLF_DISPLAY[cname], kind="run",
                     n_train=len(train), n_eval=len(ev))
            frows.append(r)
            scores[method] = s
        rows += frows
        with step(f"{fname}: {cv_folds}-fold choice"):
            pick, cv = choose_classifier(x_tr, y_tr, classifiers, folds=cv_folds, seed=seed)
        chosen.append(dict(frows[classifiers.index(pick)], method=display_name(fname, kind), kind="chosen",
                           selected_on=f"train ({cv_folds}-fold CV)" if cv else "train (only classifier)",
                           cv_auc={CLF_DISPLAY[c]: a for c, a in cv.items()},
                           cv=" / ".join(f"{CLF_DISPLAY[c]} {a:.3f}" for c, a in cv.items()) or "-"))
        top = max(frows, key=lambda r: r["auc"])
        best.append(dict(top, method=display_name(fname, kind), kind="best_eval",
                         selected_on="eval (the paper's rule: optimistic)"))
    bar.close()
    rows += chosen + best
    return (rows, scores, y_ev) if return_scores else rows


def _stepper(bar):
    """``with step(name):`` shows ``name`` on ``bar`` while it runs, then counts it done."""
    @contextlib.contextmanager
    def step(name: str):
        bar.set_postfix_str(name, refresh=True)
        yield
        bar.update(1)
    return step


def shift_verdict(rows: Sequence[dict], alpha: float = 0.05) -> dict:
    """Does any blind baseline beat chance? Bonferroni over the m feature x classifier runs.

    The split passes when the best blind AUC is not significantly above 0.5: its one-sided Mann-Whitney p-value
    (``metrics.auc_vs_chance``) is >= alpha / m. Returns ``{"passed", "text", "best_method", "best_auc",
    "best_auc_se", "p_value", "alpha", "m", "threshold", "significant": [methods with p < alpha/m]}``.
    """
    runs = [r for r in rows if r.get("kind", "run") == "run"]
    if not runs:
        raise BlindError("no blind runs to judge")
    m = len(runs)
    thr = alpha / m
    top = max(runs, key=lambda r: r["auc"])
    sig = [r["method"] for r in runs if r["p_auc_gt_half"] < thr]
    passed = top["p_auc_gt_half"] >= thr
    se = "" if top["auc_se"] is None else f" (SE {top['auc_se']:.4f})"  # None: --bootstrap 0
    head = (f"best blind AUC {top['auc']:.3f}{se} by {top['method']}, one-sided p = "
            f"{top['p_auc_gt_half']:.2g} vs alpha/m = {alpha:g}/{m} = {thr:.2g} (Bonferroni over {m} blind methods)")
    if passed:
        text = f"PASS: no blind baseline is significantly above AUC 0.5; {head}."
    else:
        text = (f"WARNING: distribution shift between members and non-members: {head}. "
                f"{len(sig)} of {m} blind methods are significant. Members can be told from non-members without "
                "the model, so attack AUCs on this split do not measure membership alone.")
    return {"passed": bool(passed), "text": text, "best_method": top["method"], "best_auc": top["auc"],
            "best_auc_se": top["auc_se"], "p_value": top["p_auc_gt_half"], "alpha": alpha, "m": m,
            "threshold": thr, "significant": sig}
