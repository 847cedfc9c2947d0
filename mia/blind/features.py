"""Blind (model-free) features of examples, CheckMIABench §4 (docs/algorithms.md#blind). Every feature is FIT ON
THE TRAINING PARTITION ONLY and then applied to the evaluation partition.

Examples are split-file dicts with ``"tokens"`` (token ids, never decoded for BoW/TF-IDF) or ``"text"``.

| name   | tokens                                                    | text                                  |
|--------|-----------------------------------------------------------|---------------------------------------|
| bow    | counts over the token ids seen in training; unseen ignored | sklearn ``CountVectorizer()``          |
| tfidf  | tf = count/len(seq) · idf = ln((N+1)/(df+1)) + 1, no norm | sklearn ``TfidfVectorizer()``          |
| w2v    | mean word2vec vector of the token strings                 | mean word2vec vector of ``text.split()`` |
| bert   | decode (skip special tokens), then as text                | Flax encoder sentence embedding       |

Word2vec differs from the paper on purpose: the paper uses the pretrained ``word2vec-google-news-300`` vectors, which
cannot be downloaded here (no network), so we TRAIN gensim Word2Vec on the training partition only (skip-gram off,
CBOW, 100-d, window 5, min_count 1, 5 epochs, ``workers=1`` and a stable hash so the vectors are reproducible from
``seed``). Out-of-vocabulary words contribute zero vectors to the mean, as in the paper. Token strings are the
tokenizer's ``convert_ids_to_tokens`` output when a tokenizer is given, else the decimal ids.

BERT uses the encoder directory's own sentence embedding (the default all-MiniLM-L6-v2: mean pooling + L2 norm;
a plain BERT directory such as bert-base-uncased: the [CLS] state, as the paper), truncated at its max length.
"""
from __future__ import annotations

import abc

import zlib
from typing import Any, Optional, Sequence

import numpy as np
import scipy.sparse as sp


class FeatureError(ValueError):
    pass


FEATURE_NAMES = ("bow", "tfidf", "w2v", "bert")
DISPLAY = {"bow": "BoW", "tfidf": "TF-IDF", "w2v": "W2V", "bert": "BERT"}


def data_kind(examples: Sequence[dict]) -> str:
    """"tokens" when every example has token ids, "text" when every example has text; an error otherwise."""
    if examples and all(e.get("tokens") is not None for e in examples):
        return "tokens"
    if examples and all(isinstance(e.get("text"), str) for e in examples):
        return "text"
    bad = [str(e.get("id")) for e in examples if e.get("tokens") is None and not isinstance(e.get("text"), str)][:5]
    raise FeatureError("every example needs 'tokens' (or every example 'text'); "
                       + (f"id(s) {', '.join(bad)} have neither" if bad else "the split mixes tokens and text"))


def _stable_hash(s: str) -> int:
    """gensim seeds each word's initial vector with hashfxn(word + str(seed)); Python's hash() is salted per process."""
    return zlib.crc32(s.encode("utf-8"))


class Feature(abc.ABC):
    """A model-free feature map: ``fit`` on the training partition only, then ``transform`` any examples."""

    name = ""

    @abc.abstractmethod
    def fit(self, train: Sequence[dict]) -> "Feature":
        """Learn vocabulary / idf / vectors from training examples; returns self."""

    @abc.abstractmethod
    def transform(self, examples: Sequence[dict]):
        """[N, F] feature matrix (dense or scipy sparse)."""


class TokenBoW(Feature):
    """Count vectors over the token ids seen in training (``tfidf=True``: tf = count/len, smooth idf, no norm)."""

    def __init__(self, tfidf: bool = False):
        self.tfidf = tfidf
        self.name = "tfidf" if tfidf else "bow"

    def fit(self, train):
        vocab = np.unique(np.concatenate([np.asarray(e["tokens"], np.int64) for e in train] or [np.zeros(0, np.int64)]))
        self.vocab = vocab
        if self.tfidf:
            x = self._counts(train)
            df = np.asarray((x > 0).sum(0)).ravel()
            self.idf = np.log((len(train) + 1) / (df + 1)) + 1
        return self

    def _counts(self, examples) -> sp.csr_matrix:
        rows, cols = [], []
        for i, e in enumerate(examples):
            t = np.asarray(e["tokens"], np.int64)
            pos = np.searchsorted(self.vocab, t)
            ok = (pos < len(self.vocab)) & (self.vocab[np.minimum(pos, len(self.vocab) - 1)] == t)
            cols.append(pos[ok])
            rows.append(np.full(int(ok.sum()), i))
        r = np.concatenate(rows) if rows else np.zeros(0, int)
        c = np.concatenate(cols) if cols else np.zeros(0, int)
        x = sp.csr_matrix((np.ones(len(r), np.float64), (r, c)), shape=(len(examples), len(self.vocab)))
        x.sum_duplicates()
        return x

    def transform(self, examples):
        x = self._counts(examples)
        if not self.tfidf:
            return x
        lens = np.array([max(len(e["tokens"]), 1) for e in examples], np.float64)  # len counts unseen ids too
        return sp.csr_matrix(sp.diags(1 / lens) @ x @ sp.diags(self.idf))


class TextVectorizer(Feature):
    def __init__(self, tfidf: bool = False):
        from sklearn.feature_extraction.text import CountVectorizer, TfidfVectorizer

        self.name = "tfidf" if tfidf else "bow"
        self.vec = TfidfVectorizer() if tfidf else CountVectorizer()

    def fit(self, train):
        try:
            self.vec.fit([e["text"] for e in train])
        except ValueError as e:  # "empty vocabulary"
            raise FeatureError(f"{self.name} (text): {e}") from None
        return self

    def transform(self, examples):
        return self.vec.transform([e["text"] for e in examples]).astype(np.float64)


class Word2VecFeature(Feature):
    name = "w2v"

    def __init__(self, kind: str, seed: int = 0, tokenizer: Any = None, vector_size: int = 100, epochs: int = 5):
        self.kind, self.seed, self.tokenizer = kind, seed, tokenizer
        self.vector_size, self.epochs = vector_size, epochs

    def _words(self, e) -> list[str]:
        if self.kind == "text":
            return e["text"].split()
        ids = [int(t) for t in e["tokens"]]
        if self.tokenizer is not None:
            return list(self.tokenizer.convert_ids_to_tokens(ids))
        return [str(t) for t in ids]

    def fit(self, train):
        from gensim.models import Word2Vec

        sentences = [self._words(e) for e in train]
        if not any(sentences):
            raise FeatureError("w2v: the training partition has no words")
        self.model = Word2Vec(sentences=sentences, vector_size=self.vector_size, window=5, min_count=1, workers=1,
                              seed=self.seed, epochs=self.epochs, hashfxn=_stable_hash)
        return self

    def transform(self, examples):
        kv = self.model.wv
        out = np.zeros((len(examples), self.vector_size), np.float64)
        for i, e in enumerate(examples):
            words = self._words(e)
            if not words:
                continue
            known = [w for w in words if w in kv.key_to_index]
            if known:  # mean over ALL words, OOV words counting as zero vectors
                out[i] = kv[known].astype(np.float64).sum(0) / len(words)
        return out


class BertFeature(Feature):
    name = "bert"

    def __init__(self, kind: str, encoder: Any = None, encoder_dir: Optional[str] = None, tokenizer: Any = None,
                 batch_size: int = 32):
        self.kind, self.encoder, self.encoder_dir, self.tokenizer, self.batch_size = (
            kind,
            encoder,
            encoder_dir,
            tokenizer,
            batch_size,
        )

    def fit(self, train):  # nothing is learned: the encoder is pretrained
        if self.kind == "tokens" and self.tokenizer is None:
            raise FeatureError("bert features of token ids need the target model's tokenizer to decode them "
                               "(pass --tokenizer DIR, or a split whose header names source.tokenizer)")
        if self.encoder is None:
            from ..models.bert import load_encoder  # jax and flax load only when the BERT feature is asked for

            self.encoder = load_encoder(self.encoder_dir)
        return self

    def texts(self, examples) -> list[str]:
        if self.kind == "text":
            return [e["text"] for e in examples]
        return [self.tokenizer.decode([int(t) for t in e["tokens"]], skip_special_tokens=True) for e in examples]

    def transform(self, examples):
        return self.encoder.embed(self.texts(examples), batch_size=self.batch_size).astype(np.float64)


def make_feature(name: str, kind: str, *, seed: int = 0, tokenizer: Any = None, encoder: Any = None,
                 encoder_dir: Optional[str] = None) -> Feature:
    if name not in FEATURE_NAMES:
        raise FeatureError(f"unknown feature {name!r}; known: {', '.join(FEATURE_NAMES)}")
    if name in ("bow", "tfidf"):
        return TokenBoW(tfidf=name == "tfidf") if kind == "tokens" else TextVectorizer(tfidf=name == "tfidf")
    if name == "w2v":
        return Word2VecFeature(kind, seed=seed, tokenizer=tokenizer)
    return BertFeature(kind, encoder=encoder, encoder_dir=encoder_dir, tokenizer=tokenizer)


def display_name(name: str, kind: str) -> str:
    """"bow", "tokens" -> "BoW (tokens)", as the paper's Table 1."""
    return f"{DISPLAY[name]} ({kind})"
