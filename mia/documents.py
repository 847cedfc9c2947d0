"""Document-level membership inference (Meeus et al. 2024, "Did the Neurons Read your Book? Document-level Membership
Inference for Large Language Models", USENIX Security 2024; code
computationalprivacy/document-level-membership-inference).

A document is a set of sequences (one JSONL record each, sharing a ``doc_id``). Each sequence has a score from any
registered attack (HIGHER = MEMBER); the scores of one document become a fixed-length feature vector, and a classifier
trained on labelled documents outputs P(member) for held-out documents: the document score, HIGHER = MEMBER.

  values of document d:  v_d = the finite sequence scores of d's sequences, in file order        [n_d]
  hist  (the paper's HistFE)  fraction of v_d in each of ``bins`` equal-width bins, the edges spanning the min..max
        of all training documents' values (``np.histogram_bin_edges``); values beyond the training range count in the
        outermost bin                                                                              [bins]
  agg   (the paper's AggFE)  mean, min, max, std (ddof 0), count n_d, and the percentiles 1, 5, 10, 25, 50, 75, 90,
        95, 99 (``np.percentile``, linear)                                                         [14]
  both  hist then agg                                                                              [bins + 14]

Features are min-max scaled with the training documents' column ranges (a constant column becomes 0), as the official
``scale_features``; then
  rf  RandomForestClassifier(500 trees, max_depth 5, min_samples_leaf 3), the paper's meta-classifier (seeded, 1 job)
  lr  LogisticRegression(lbfgs, C = 1; max_iter 1000 instead of sklearn's 100, so it converges)

Differences from the paper, on purpose: the paper aggregates TOKEN-level probabilities (optionally normalised by token
frequency or a "general probability"), so a document has thousands of values and its histograms use 1000 bins
(``hist_1000``); mia aggregates SEQUENCE-level scores of any attack (a document has tens of values), hence a default of
10 bins. The paper's histogram uses ``density=True`` over the in-range values only; our fractions over all values differ
by the constant bin width inside the range (removed by the min-max scaling) and never divide by zero when a document
falls outside the training range. The paper evaluates by 5-fold cross-validation over document chunks; here the
classifier is trained once on the ``train`` documents and scored on the held-out ones.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .files.atomic import atomic_write

FEATURES = ("hist", "agg", "both")
CLASSIFIERS = ("rf", "lr")
PAPER_PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99)
DEFAULT_BINS = 10


class DocumentError(ValueError):
    """Documents that cannot be aggregated or classified; one line for the user."""


def group_by_document(doc_ids: Sequence[str]) -> tuple[list[str], list[np.ndarray]]:
    """(document ids in order of first appearance, for each the int indices of its sequences in input order)."""
    order: dict[str, list[int]] = {}
    for i, d in enumerate(doc_ids):
        order.setdefault(d, []).append(i)
    return list(order), [np.asarray(ix, np.int64) for ix in order.values()]


def values_per_document(scores_n: np.ndarray, groups: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Sequence scores [N] -> for each document its finite scores, float64 [n_d] (n_d may be 0)."""
    s = np.asarray(scores_n, np.float64)
    return [s[ix][np.isfinite(s[ix])] for ix in groups]


def histogram_edges(values_per_doc: Sequence[np.ndarray], n_bins: int) -> np.ndarray:
    """[n_bins + 1] equal-width edges over the min..max of every value of the (training) documents."""
    if n_bins < 1:
        raise DocumentError(f"the histogram needs at least 1 bin, got {n_bins}")
    pooled = np.concatenate([np.asarray(v, np.float64) for v in values_per_doc]) if len(values_per_doc) else []
    if len(pooled) == 0:
        raise DocumentError("no finite sequence score in the training documents to place the histogram bins")
    return np.histogram_bin_edges(pooled, bins=n_bins)


def histogram_features(values_per_doc: Sequence[np.ndarray], edges: np.ndarray) -> np.ndarray:
    """[D, len(edges) - 1] fraction of each document's values per bin (bins as ``np.histogram``: half-open, the last
    closed; values below/above the edges count in the first/last bin). A document without values gets NaN."""
    n_bins = len(edges) - 1
    out = np.full((len(values_per_doc), n_bins), np.nan)
    for d, v in enumerate(values_per_doc):
        if len(v):
            b = np.clip(np.searchsorted(edges, v, side="right") - 1, 0, n_bins - 1)
            out[d] = np.bincount(b, minlength=n_bins) / len(v)
    return out


def aggregate_features(values_per_doc: Sequence[np.ndarray], percentiles: Sequence[float] = PAPER_PERCENTILES
                       ) -> np.ndarray:
    """[D, 5 + len(percentiles)]: mean, min, max, std, count, then the percentiles of each document's values
    (NaN row for a document without values)."""
    out = np.full((len(values_per_doc), 5 + len(percentiles)), np.nan)
    for d, v in enumerate(values_per_doc):
        if len(v):
            out[d] = [v.mean(), v.min(), v.max(), v.std(), len(v), *np.percentile(v, percentiles)]
    return out


def document_features(values_per_doc: Sequence[np.ndarray], kind: str = "hist", edges: np.ndarray | None = None
                      ) -> np.ndarray:
    """[D, F] features of ``kind`` (``FEATURES``); ``edges`` (from the training documents) for hist and both."""
    if kind not in FEATURES:
        raise DocumentError(f"unknown document features {kind!r}; valid: {', '.join(FEATURES)}")
    parts = []
    if kind in ("hist", "both"):
        if edges is None:
            raise DocumentError("histogram features need the bin edges of the training documents")
        parts.append(histogram_features(values_per_doc, edges))
    if kind in ("agg", "both"):
        parts.append(aggregate_features(values_per_doc))
    return np.concatenate(parts, axis=1)


def minmax_scale(train_df: np.ndarray, eval_ef: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both matrices scaled by the training columns' (x - min) / (max - min); a constant training column -> 0."""
    lo, hi = train_df.min(axis=0), train_df.max(axis=0)
    span = np.where(hi > lo, hi - lo, 1.0)
    keep = hi > lo
    return (train_df - lo) / span * keep, (eval_ef - lo) / span * keep


def make_classifier(name: str, seed: int):
    """An unfitted sklearn classifier: ``rf`` (the paper's) or ``lr``."""
    if name == "rf":
        from sklearn.ensemble import RandomForestClassifier

        return RandomForestClassifier(n_estimators=500, max_depth=5, min_samples_leaf=3, random_state=seed, n_jobs=1)
    if name == "lr":
        from sklearn.linear_model import LogisticRegression

        return LogisticRegression(solver="lbfgs", C=1.0, max_iter=1000, random_state=seed)
    raise DocumentError(f"unknown document classifier {name!r}; valid: {', '.join(CLASSIFIERS)}")


def fit_and_score_documents(train_values: Sequence[np.ndarray], train_labels: Sequence[int],
                            eval_values: Sequence[np.ndarray], *, features: str = "hist", n_bins: int = DEFAULT_BINS,
                            classifier: str = "rf", seed: int = 0) -> np.ndarray:
    """Document scores [D_eval] float64 = P(member) of each held-out document (HIGHER = MEMBER).

    ``train_values``/``eval_values``: per document its finite sequence scores (``values_per_document``); training
    documents without any value are left out of the fit, held-out ones without any value score NaN.
    ``train_labels``: 1 = member. Deterministic for a given ``seed``.
    """
    y = np.asarray(train_labels, np.int64)
    usable = np.array([len(v) > 0 for v in train_values], bool)
    if len(y) != len(train_values):
        raise DocumentError(f"{len(train_values)} training documents but {len(y)} labels")
    if len(np.unique(y[usable])) < 2:
        raise DocumentError("the training documents (with a finite score) are of one class only; the classifier "
                            "needs members (label 1) and non-members (label 0)")
    fit_values = [v for v, ok in zip(train_values, usable) if ok]
    edges = histogram_edges(fit_values, n_bins) if features in ("hist", "both") else None
    x_train = document_features(fit_values, features, edges)
    x_eval = document_features(eval_values, features, edges)
    out = np.full(len(eval_values), np.nan)
    has = np.array([len(v) > 0 for v in eval_values], bool)
    x_train, x_eval = minmax_scale(x_train, x_eval[has] if has.any() else x_train[:0])
    clf = make_classifier(classifier, seed)
    clf.fit(x_train, y[usable])
    if has.any():
        out[has] = clf.predict_proba(x_eval)[:, list(clf.classes_).index(1)]
    return out


def chunk_tokens(tokens: np.ndarray, seq_tokens: int) -> list[np.ndarray]:
    """Consecutive pieces of ``seq_tokens`` ids of ``tokens`` [T], the last one shorter; a last piece of a single id is
    dropped (a sequence needs 2 tokens to be scored)."""
    pieces = [tokens[i:i + seq_tokens] for i in range(0, len(tokens), seq_tokens)]
    return [p for p in pieces if len(p) >= 2]


def chunk_examples(examples: Sequence, seq_tokens: int, partitions: Sequence[str] = ("eval", "train")) -> list:
    """Each valid example of ``partitions`` replaced by its ``chunk_tokens`` pieces, in order: ids ``<id>#<k>``
    (k from 0), the same doc_id, label, partition and source; other examples as they are."""
    out = []
    for e in examples:
        if e.partition not in partitions or e.invalid is not None:
            out.append(e)
            continue
        out.extend(dataclasses.replace(e, id=f"{e.id}#{k}", tokens=piece, text=None, truncated=False)
                   for k, piece in enumerate(chunk_tokens(e.tokens, seq_tokens)))
    return out


def check_document_records(records: Sequence, partitions: Sequence[str] = ("eval", "train")) -> None:
    """Refuse records of ``partitions`` (objects with ``doc_id``, ``label``, ``partition``, ``source`` = "file:line")
    without a document id, or whose document's lines disagree on label or partition; one line naming file:line."""
    first: dict = {}
    for r in records:
        if r.partition not in partitions:
            continue
        if r.doc_id is None:
            raise DocumentError(f"{r.source}: document id missing (field 'doc_id', needed with --documents)")
        f = first.setdefault(r.doc_id, r)
        for field in ("label", "partition"):
            if getattr(r, field) != getattr(f, field):
                raise DocumentError(f"{r.source}: document {r.doc_id[:80]!r} has {field} {getattr(r, field)!r} here "
                                    f"but {getattr(f, field)!r} at {f.source}")
        if r.partition == "train" and r.label is None:
            raise DocumentError(f"{r.source}: document {r.doc_id[:80]!r} is in the train partition without a label "
                                "(the classifier learns from labelled documents)")


def check_train_documents(labels_by_doc: dict, where: str) -> None:
    """``labels_by_doc``: training document id -> label. Refuse none, or one class only."""
    if not labels_by_doc:
        raise DocumentError(f"{where}: --documents needs labelled documents in the 'train' partition to train the "
                            "classifier, got none")
    classes = set(labels_by_doc.values())
    if len(classes) < 2:
        kind = "members (label 1)" if classes == {1} else "non-members (label 0)"
        raise DocumentError(f"{where}: the {len(labels_by_doc)} train document(s) are all {kind}; the classifier needs "
                            "both members and non-members")


@dataclasses.dataclass
class DocumentScores:
    """Document-level scores of the evaluation documents: ``ids`` [D], ``labels`` [D] (-1 unlabelled),
    ``n_sequences`` [D], ``scores`` {attack label: [D] P(member)}; ``n_train`` documents trained the classifier."""

    ids: list
    labels: np.ndarray
    n_sequences: list
    scores: dict
    n_train: int


def score_documents(examples: Sequence, scores: Mapping[str, np.ndarray], *, features: str = "hist",
                    n_bins: int = DEFAULT_BINS, classifier: str = "rf", seed: int = 0) -> DocumentScores:
    """Sequence scores of ``examples`` (records with ``doc_id``, ``partition`` "train"/"eval", ``label``) grouped by
    document; per attack, a classifier trained on the train documents scores the eval ones
    (``fit_and_score_documents``). Documents in order of first appearance."""
    doc_ids, groups = group_by_document([e.doc_id for e in examples])
    first = [examples[ix[0]] for ix in groups]
    is_train = np.array([e.partition == "train" for e in first], bool)
    labels = np.array([-1 if e.label is None else e.label for e in first])
    doc_scores = {}
    for label, s in scores.items():
        values = values_per_document(np.asarray(s), groups)
        doc_scores[label] = fit_and_score_documents(
            [v for v, t in zip(values, is_train) if t], labels[is_train],
            [v for v, t in zip(values, is_train) if not t], features=features, n_bins=n_bins,
            classifier=classifier, seed=seed)
    keep = np.flatnonzero(~is_train)
    return DocumentScores([doc_ids[i] for i in keep], labels[keep], [len(groups[i]) for i in keep], doc_scores,
                          int(is_train.sum()))


def write_document_scores(path, docs: DocumentScores) -> Path:
    """One JSONL line per evaluation document: ``{"doc_id", "label", "n_sequences", "scores"}`` (null for a
    non-finite score)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        for r, doc in enumerate(docs.ids):
            label = None if docs.labels[r] < 0 else int(docs.labels[r])
            scores = {k: (float(v[r]) if np.isfinite(v[r]) else None) for k, v in docs.scores.items()}
            f.write(json.dumps({"doc_id": doc, "label": label, "n_sequences": docs.n_sequences[r],
                                "scores": scores}) + "\n")
    return path

