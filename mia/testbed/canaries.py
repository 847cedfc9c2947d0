"""Canaries: designed rows inserted into a testbed's training with exact, recorded membership.

A testbed built with ``canaries=m`` (``TestbedConfig``) holds a pool of ``m`` canaries, each one training row of
``seq_len + 1`` tokens in the testbed's own tokenization, of one of these kinds (``canary_kind``: one, or several
comma-separated, cycled over the canaries in blocks of ``len(canary_reps)`` so that every (kind, reps) pair has as
many canaries):

- ``"tokens"``: token ids uniform on [1, corpus vocabulary) (id 0, EOD, never appears): a baseline;
- ``"words"``: words drawn uniformly from the corpus's most frequent words (letters only), joined by spaces,
  tokenized by the testbed tokenizer and cut to the row length: a baseline;
- ``"new"`` (after Panda et al. 2025): random corpus tokens, then the canary's secret: its own reserved token
  (``reserved_tokens``: ids the corpus never uses) repeated ``NEW_SECRET_LEN`` times. No other row uses that id,
  so the canary's training moves its token's embedding rows and nothing else's;
- ``"unigram"``: tokens drawn uniformly from the ``RARE_POOL`` least frequent tokens of the corpus (count >= 1);
- ``"bigram"``: a chain of the corpus's rarest pairs: each next token is drawn among the ``BIGRAM_CHOICES`` corpus
  tokens that least often follow the previous one in the corpus (ties in a seeded random order);
- ``"sampled"``: sampled at temperature ``SAMPLE_TEMPERATURE`` (over the corpus vocabulary, after EOD) from a model
  trained on the same order without canaries (the testbed of the same config without them, built beside it in
  ``sampler/``; for a fine-tune, its base).

A canary's **secret** is the part its kind designs: the whole row, or the last ``NEW_SECRET_LEN`` tokens of a
new-token canary (``Canaries.secret_start``). Fine-tuning (``mia.testbed.finetune``) trains a canary on its secret
only; pretraining trains every row whole.

Canary ``i`` is included with probability 1/2 (independently, seeded by the config's ``seed``) and, if included,
trained ``r_i = canary_reps[i % len(canary_reps)]`` times: each copy is an extra row appended to the batch of one
step, at ``r_i`` distinct steps drawn uniformly from [0, train_steps) (drawn for every canary, so that whether one
canary is included never changes where another's copies go). The natural rows of the training order are
untouched (``data/order.bin`` and the membership of every natural row at every checkpoint are exactly those of
the same testbed without canaries); the batch of step s is its ``batch_size`` natural rows followed by the copies
trained at s, in ascending canary id. Excluded canaries are never trained: exact non-members.

Everything about the pool is in ``data/canaries.json``: per canary its id, tokens, reps, included flag, and the
(step, slot) of each copy (slot = its row in that step's batch); with the newer kinds also each canary's kind and
secret start, and each kind's parameters (``kinds``). Inclusion, reps and steps depend on the config only
(``plan_canaries``), so the privacy accountant can count the records without building anything; the rows are a
function of the seed, the corpus and (sampled canaries) the sampling model.

Private testbeds (``mia.testbed.dp``) use the same pool; with ``dp_sampling="poisson"`` the recorded steps are not
used: every natural row of the first ``train_steps * batch_size`` and every canary copy is one record of the pool
that each step samples from.

Exposure (``canary_exposure``) ranks each canary's log-perplexity among fresh random rows of the same kind
(``candidate_rows``; see ``mia.privacy.exposure``).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..files.atomic import write_text
from ..privacy.exposure import exposure_sampled, exposure_skewnorm
from .config import TestbedConfig, TestbedError, canary_kinds
from .tokenizer import reserved_ids

CANARY_FILE = "data/canaries.json"
CANARY_FORMAT = "mia-canaries/1"
MAX_WORDS = 5000  # the word canaries' vocabulary: this many most frequent corpus words
NEW_SECRET_LEN = 1  # new-token canaries: the last this many tokens are the canary's own reserved token
RARE_POOL = 64  # unigram canaries: drawn from this many least frequent corpus tokens
BIGRAM_CHOICES = 8  # bigram canaries: each next token among this many rarest successors of the previous one
SAMPLE_TEMPERATURE = 1.5  # sampled canaries: softmax temperature
LEGACY_KINDS = ("tokens", "words")  # pools of one of these kinds are recorded exactly as before the other kinds
_WORD = re.compile(r"[A-Za-z]{3,12}")
# each kind draws its rows from its own random stream: [seed, 0xCA7C, stream] (a legacy single-kind pool: [seed,
# 0xCA7C], as before the other kinds existed)
_KIND_STREAM = {"tokens": 1, "words": 2, "new": 3, "unigram": 4, "bigram": 5, "sampled": 6}


# ----------------------------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True)
class CanaryPlan:
    """Who is trained and when: ``reps`` [m] insertions per canary, ``included`` [m] bool, ``steps`` (one sorted int
    array per canary: the steps its copies are trained at; empty when excluded), ``kinds`` [m] the kind of each."""

    reps: np.ndarray
    included: np.ndarray
    steps: tuple
    kinds: tuple = ()

    @property
    def m(self) -> int:
        return len(self.reps)

    @property
    def n_copies(self) -> int:
        """Rows that the canaries add to training (the included canaries' reps, summed)."""
        return int(sum(len(s) for s in self.steps))


def kinds_of(spec: str, m: int, n_reps: int) -> tuple:
    """The kind of each of ``m`` canaries: the kinds of ``spec`` cycled in blocks of ``n_reps`` (the length of the
    repetition list), so that every (kind, reps) pair has the same number of canaries."""
    kinds = canary_kinds(spec)
    return tuple(kinds[(i // n_reps) % len(kinds)] for i in range(int(m)))


def plan_canaries(cfg: TestbedConfig) -> CanaryPlan:
    """The inclusion, repetitions, kinds and steps of ``cfg``'s canaries (a function of the config alone).

    Copies are extra rows of their steps' batches, so a pool may add more rows than the natural ones (a step then
    trains its ``batch_size`` natural rows and all the copies drawn for it: ``Canaries.slots`` extra rows at most);
    membership and the accountant do not depend on how many there are."""
    m, T = int(cfg.canaries), int(cfg.train_steps)
    reps = np.array([cfg.canary_reps[i % len(cfg.canary_reps)] for i in range(m)], np.int64)
    included = np.random.default_rng([int(cfg.seed), 0xCA7A]).random(m) < 0.5
    rng = np.random.default_rng([int(cfg.seed), 0xCA7B])
    # every canary draws its steps, included or not, so that one canary's inclusion never moves another's copies
    drawn = [np.sort(rng.choice(T, int(r), replace=False)).astype(np.int64) for r in reps]
    steps = tuple(d if inc else np.zeros(0, np.int64) for d, inc in zip(drawn, included))
    return CanaryPlan(reps, included, steps, kinds_of(cfg.canary_kind, m, len(cfg.canary_reps)))


# ----------------------------------------------------------------------------------------------- the pool
@dataclasses.dataclass(frozen=True)
class Canaries:
    """A testbed's canary pool. ``tokens`` [m, row_len] int64 (one training row each), ``reps`` [m], ``included``
    [m] bool, ``steps`` (per canary, sorted steps of its copies), ``batch_size`` (natural rows per step: a copy's
    slot in its step's batch is ``batch_size`` + its rank among that step's copies), ``kind`` (the kind spec:
    one kind, or several comma-separated), ``words`` (the word canaries' vocabulary, else empty), ``seed``,
    ``vocab_size`` (the tokenizer's), ``kinds`` [m] (each canary's kind; empty: all ``kind``), ``secret_start`` [m]
    (where each canary's secret begins; None: 0, the whole row), ``params`` ({kind: its parameters}),
    ``corpus_vocab`` (ids below it are the corpus's; None: ``vocab_size``), ``spare_ids`` (reserved ids no canary
    uses: the untrained reference of new-token canaries), ``copies`` [m] (a fine-tune's pool, whose copies are
    records of the private set with no fixed step: how many each canary has; None: ``steps`` says)."""

    tokens: np.ndarray
    reps: np.ndarray
    included: np.ndarray
    steps: tuple
    batch_size: int
    kind: str
    words: tuple
    seed: int
    vocab_size: int
    kinds: tuple = ()
    secret_start: Optional[np.ndarray] = None
    params: Optional[dict] = None
    corpus_vocab: Optional[int] = None
    spare_ids: tuple = ()
    copies: Optional[np.ndarray] = None

    @property
    def m(self) -> int:
        return len(self.tokens)

    @property
    def row_len(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def n_copies(self) -> int:
        if self.copies is not None:
            return int(np.sum(self.copies))
        return int(sum(len(s) for s in self.steps))

    @property
    def kind_of(self) -> np.ndarray:
        """[m] str: each canary's kind."""
        return np.array(self.kinds if self.kinds else [self.kind] * self.m, dtype=object)

    @property
    def secrets(self) -> np.ndarray:
        """[m] int64: index of each canary's first secret token (0: the whole row is the secret)."""
        return np.zeros(self.m, np.int64) if self.secret_start is None else np.asarray(self.secret_start, np.int64)

    def secret_mask(self) -> np.ndarray:
        """[m, row_len - 1] float32: 1 at the next-token predictions of secret tokens (target t >= secret start, t >=
        1), the positions a secret-only loss sums over."""
        t = np.arange(1, self.row_len)
        return (t[None, :] >= np.maximum(self.secrets, 1)[:, None]).astype(np.float32)

    def new_token_ids(self) -> np.ndarray:
        """[m] int64: each new-token canary's reserved id (-1 for other kinds)."""
        out = np.full(self.m, -1, np.int64)
        new = self.kind_of == "new"
        out[new] = self.tokens[new, -1]
        return out

    def copies_at(self, step: int) -> np.ndarray:
        """Canary ids (ascending, repeated per copy) trained as extra rows of step ``step``'s batch."""
        return np.array([i for i, s in enumerate(self.steps) for x in s if x == step], np.int64)

    def copies_by_step(self, n_steps: int) -> list:
        """``copies_at`` of every step in [0, n_steps), in one pass."""
        out: list = [[] for _ in range(n_steps)]
        for i, s in enumerate(self.steps):
            for x in s:
                if x < n_steps:
                    out[int(x)].append(i)
        return [np.array(sorted(c), np.int64) for c in out]

    @property
    def slots(self) -> int:
        """The most copies any step trains (extra rows per batch to allow for)."""
        counts = Counter(int(x) for s in self.steps for x in s)
        return max(counts.values(), default=0)

    def seen_before(self, step: int) -> np.ndarray:
        """[m] copies of each canary trained in steps [0, ``step``) (ordinary training and DP with fixed batches)."""
        return np.array([int((s < step).sum()) for s in self.steps], np.int64)

    def positions(self) -> list:
        """Per canary, the (step, slot) of each of its copies (slot = row in that step's batch)."""
        slot: dict = {}
        out = [[] for _ in range(self.m)]
        for i, s in enumerate(self.steps):  # ascending id: the order of copies within a step's extra rows
            for x in s:
                k = slot.get(int(x), 0)
                slot[int(x)] = k + 1
                out[i].append((int(x), self.batch_size + k))
        return out

    @property
    def legacy(self) -> bool:
        """A pool of one of the kinds that existed first (tokens, words): recorded exactly as it was then."""
        return (self.kind in LEGACY_KINDS and not self.kinds and self.secret_start is None
                and self.corpus_vocab is None)

    def to_json(self) -> dict:
        pos = self.positions()
        d = {"format": CANARY_FORMAT, "m": self.m, "kind": self.kind, "seed": self.seed,
             "vocab_size": self.vocab_size, "row_len": self.row_len, "batch_size": self.batch_size,
             "n_included": int(self.included.sum()), "n_copies": self.n_copies, "slots": self.slots,
             "words": list(self.words)}
        if not self.legacy:
            d.update({"corpus_vocab": self.corpus_vocab, "spare_ids": [int(x) for x in self.spare_ids],
                      "kinds": {k: (self.params or {}).get(k, {}) for k in canary_kinds(self.kind)}})
        if self.copies is not None:
            d["copies"] = "records of the private set, Poisson-sampled at every step (no fixed steps)"
        rows = []
        kinds, secrets = self.kind_of, self.secrets
        for i in range(self.m):
            r = {"id": i, "reps": int(self.reps[i]), "included": bool(self.included[i]),
                 "positions": [list(p) for p in pos[i]], "tokens": self.tokens[i].tolist()}
            if not self.legacy:
                r.update({"kind": str(kinds[i]), "secret_start": int(secrets[i])})
            if self.copies is not None:
                r["copies"] = int(self.copies[i])
            rows.append(r)
        d["canaries"] = rows
        return d

    @classmethod
    def from_json(cls, d: dict, source: str = "canaries.json") -> "Canaries":
        if d.get("format") != CANARY_FORMAT:
            raise TestbedError(f"{source}: canary file of format {d.get('format')!r}, this mia reads {CANARY_FORMAT!r}")
        rows = d["canaries"]
        legacy = "kinds" not in d
        return cls(tokens=np.array([r["tokens"] for r in rows], np.int64).reshape(len(rows), d["row_len"]),
                   reps=np.array([r["reps"] for r in rows], np.int64),
                   included=np.array([r["included"] for r in rows], bool),
                   steps=tuple(np.array(sorted(p[0] for p in r["positions"]), np.int64) for r in rows),
                   batch_size=int(d["batch_size"]), kind=d["kind"], words=tuple(d["words"]), seed=int(d["seed"]),
                   vocab_size=int(d["vocab_size"]),
                   kinds=() if legacy else tuple(r["kind"] for r in rows),
                   secret_start=None if legacy else np.array([r["secret_start"] for r in rows], np.int64),
                   params=None if legacy else d["kinds"], corpus_vocab=None if legacy else d.get("corpus_vocab"),
                   spare_ids=() if legacy else tuple(d.get("spare_ids", ())),
                   copies=np.array([r["copies"] for r in rows], np.int64) if "copies" in d else None)


# ------------------------------------------------------------------------------------------- what rows are drawn from
@dataclasses.dataclass
class CanarySource:
    """What the kinds draw from: the testbed ``tokenizer``, ``corpus_vocab`` (ids below it are the corpus's; the
    reserved ids follow), ``reserved`` (the reserved ids), ``words`` (the corpus's most frequent words), ``counts``
    [corpus_vocab] (each token's count in the packed corpus), ``pairs`` [corpus_vocab, corpus_vocab] (count of each
    (previous, next) pair within rows; None unless bigram canaries need it) and ``sampler`` (a ``mia.models.Model``
    trained on the same order; None unless sampled canaries need it)."""

    tokenizer: object
    corpus_vocab: int
    reserved: range = range(0)
    words: tuple = ()
    counts: Optional[np.ndarray] = None
    pairs: Optional[np.ndarray] = None
    sampler: object = None


def canary_source(tokenizer, kinds: Sequence[str], *, texts: Sequence[str] = (), rows=None, sampler=None
                  ) -> CanarySource:
    """The :class:`CanarySource` of ``kinds``: corpus words from ``texts`` (words), token and pair counts from the
    packed ``rows`` [n, row_len] (unigram, bigram; EOD and the reserved ids left out), the ``sampler`` model
    (sampled)."""
    reserved = reserved_ids(tokenizer)
    vocab = reserved.start if len(reserved) else len(tokenizer)
    src = CanarySource(tokenizer, int(vocab), reserved)
    if "words" in kinds:
        src.words = corpus_words(texts)
    if "unigram" in kinds or "bigram" in kinds:
        if rows is None:
            raise TestbedError("unigram and bigram canaries need the corpus's packed rows")
        rows = np.asarray(rows, np.int64)
        src.counts = np.bincount(rows.ravel(), minlength=vocab)[:vocab]
        if "bigram" in kinds:
            a, b = rows[:, :-1].ravel(), rows[:, 1:].ravel()
            src.pairs = np.bincount(a * vocab + b, minlength=vocab * vocab)[: vocab * vocab].reshape(vocab, vocab)
    if "sampled" in kinds:
        if sampler is None:
            raise TestbedError("sampled canaries need a model trained on the same order (the sampler)")
        src.sampler = sampler
    return src


# ----------------------------------------------------------------------------------------------- random rows
def random_token_rows(n: int, row_len: int, vocab_size: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row_len] token ids uniform on [1, vocab_size) (no EOD)."""
    return rng.integers(1, int(vocab_size), size=(int(n), int(row_len)), dtype=np.int64)


def corpus_words(texts: Sequence[str], max_words: int = MAX_WORDS) -> tuple:
    """The ``max_words`` most frequent words (3-12 ASCII letters) of ``texts``, by count then alphabetically."""
    counts = Counter(w for t in texts for w in _WORD.findall(t))
    return tuple(w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:max_words])


def random_word_rows(n: int, row_len: int, words: Sequence[str], tokenizer, rng: np.random.Generator) -> np.ndarray:
    """[n, row_len] rows: ``row_len`` words drawn uniformly from ``words``, joined by spaces, tokenized (no special
    tokens; every word is at least one token) and cut to ``row_len`` tokens."""
    if len(words) < 2:
        raise TestbedError(f"word canaries need a corpus with at least 2 distinct words, found {len(words)}")
    backend = tokenizer.backend_tokenizer
    texts = [" ".join(words[j] for j in rng.integers(0, len(words), int(row_len))) for _ in range(int(n))]
    ids = [e.ids[:row_len] for e in backend.encode_batch(texts, add_special_tokens=False)]
    return np.array(ids, np.int64).reshape(int(n), int(row_len))


def new_token_rows(ids: np.ndarray, row_len: int, corpus_vocab: int, rng: np.random.Generator,
                   secret_len: int = NEW_SECRET_LEN) -> np.ndarray:
    """[n, row_len] rows: ``row_len - secret_len`` random corpus tokens, then ``ids[i]`` (row i's reserved token)
    ``secret_len`` times."""
    ids = np.asarray(ids, np.int64)
    if not 1 <= secret_len < row_len:
        raise TestbedError(f"new-token canaries need rows longer than their secret ({secret_len}), got {row_len}")
    prefix = random_token_rows(len(ids), row_len - secret_len, corpus_vocab, rng)
    return np.concatenate([prefix, np.repeat(ids[:, None], secret_len, axis=1)], axis=1)


def rare_tokens(counts: np.ndarray, pool: int = RARE_POOL) -> np.ndarray:
    """The ``pool`` least frequent tokens among those the corpus uses (count >= 1, EOD left out), by count then id."""
    used = np.flatnonzero(counts > 0)
    used = used[used != 0]
    if len(used) < 2:
        raise TestbedError(f"unigram canaries need a corpus of at least 2 distinct tokens, found {len(used)}")
    return used[np.lexsort((used, counts[used]))][:pool]


def unigram_rows(n: int, row_len: int, counts: np.ndarray, rng: np.random.Generator, pool: int = RARE_POOL
                 ) -> np.ndarray:
    """[n, row_len] tokens drawn uniformly from the corpus's ``pool`` rarest tokens (:func:`rare_tokens`)."""
    return rng.choice(rare_tokens(counts, pool), size=(int(n), int(row_len))).astype(np.int64)


def rare_successors(pairs: np.ndarray, counts: np.ndarray, choices: int, rng: np.random.Generator) -> np.ndarray:
    """[V, choices]: for each token, the ``choices`` corpus tokens (count >= 1, not EOD) that least often follow it
    in the corpus, by pair count, ties in a random order drawn from ``rng``."""
    used = np.flatnonzero(counts > 0)
    used = used[used != 0]
    tie = rng.random(len(used))
    return np.stack([used[np.lexsort((tie, pairs[a, used]))][:choices] for a in range(len(pairs))])


def bigram_rows(n: int, row_len: int, pairs: np.ndarray, counts: np.ndarray, rng: np.random.Generator,
                choices: int = BIGRAM_CHOICES) -> np.ndarray:
    """[n, row_len] chains of rare pairs: the first token uniform over the corpus's tokens, each next one uniform
    over the ``choices`` rarest successors of the previous one (:func:`rare_successors`)."""
    succ = rare_successors(pairs, counts, choices, rng)
    used = np.flatnonzero(counts > 0)
    used = used[used != 0]
    out = np.empty((int(n), int(row_len)), np.int64)
    out[:, 0] = rng.choice(used, int(n))
    pick = rng.integers(0, succ.shape[1], size=(int(n), int(row_len)))
    for t in range(1, int(row_len)):
        out[:, t] = succ[out[:, t - 1], pick[:, t]]
    return out


def sampled_rows(model, n: int, row_len: int, corpus_vocab: int, rng: np.random.Generator,
                 temperature: float = SAMPLE_TEMPERATURE, batch_size: int = 256) -> np.ndarray:
    """[n, row_len] rows sampled token by token from ``model`` at ``temperature`` after an EOD, over the corpus
    vocabulary [1, corpus_vocab) (EOD and reserved ids never drawn). Gumbel-max with noise from ``rng``: the same
    model and seed give the same rows."""
    from ..models.hub import program_model  # local, as jax below

    next_logits = _next_logits_fn(program_model(model))  # one program per architecture, not per checkpoint
    n, L = int(n), int(row_len)
    gumbel = rng.gumbel(size=(n, L, int(corpus_vocab) - 1))
    out = np.zeros((n, L + 1), np.int32)  # column 0: the EOD prompt
    for lo in range(0, n, batch_size):
        ctx = np.zeros((batch_size, L), np.int32)
        k = min(batch_size, n - lo)
        for t in range(L):
            ctx[:k, :t + 1] = out[lo:lo + k, :t + 1]
            lg = np.asarray(next_logits(model.params, ctx, t), np.float64)[:k, 1:corpus_vocab]
            out[lo:lo + k, t + 1] = 1 + np.argmax(lg / temperature + gumbel[lo:lo + k, t], axis=1)
    return out[:, 1:].astype(np.int64)


@functools.lru_cache(maxsize=2)
def _next_logits_fn(model):
    """jit((params, ctx [b, L], t) -> [b, V] float32 logits at position t) of ``model`` (a ``program_model``
    stand-in: compiled once per architecture)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def next_logits(params, ctx, t):
        lg = model.logits(params, ctx)  # causal: positions after t do not change position t
        return jax.lax.dynamic_index_in_dim(lg, t, axis=1, keepdims=False).astype(jnp.float32)

    return next_logits


def kind_params(kind: str) -> dict:
    """The parameters a kind's rows are drawn with (recorded in canaries.json)."""
    return {"tokens": {"ids": "uniform over the corpus vocabulary [1, corpus_vocab)"},
            "words": {"vocabulary": MAX_WORDS},
            "new": {"secret_len": NEW_SECRET_LEN, "prefix": "uniform corpus tokens"},
            "unigram": {"pool": RARE_POOL},
            "bigram": {"choices": BIGRAM_CHOICES},
            "sampled": {"temperature": SAMPLE_TEMPERATURE, "prompt": "EOD"}}[kind]


def draw_kind_rows(kind: str, n: int, row_len: int, source: CanarySource, rng: np.random.Generator,
                   new_ids: Optional[np.ndarray] = None) -> np.ndarray:
    """[n, row_len] rows of ``kind`` (``new_ids``: the reserved id of each new-token row)."""
    if kind == "tokens":
        return random_token_rows(n, row_len, source.corpus_vocab, rng)
    if kind == "words":
        return random_word_rows(n, row_len, source.words, source.tokenizer, rng)
    if kind == "new":
        return new_token_rows(new_ids, row_len, source.corpus_vocab, rng)
    if kind == "unigram":
        return unigram_rows(n, row_len, source.counts, rng)
    if kind == "bigram":
        return bigram_rows(n, row_len, source.pairs, source.counts, rng)
    if kind == "sampled":
        return sampled_rows(source.sampler, n, row_len, source.corpus_vocab, rng)
    raise TestbedError(f"unknown canary kind {kind!r}")


def _draw_rows(kind: str, n: int, row_len: int, vocab_size: int, words, tokenizer, rng) -> np.ndarray:
    if kind == "tokens":
        return random_token_rows(n, row_len, vocab_size, rng)
    return random_word_rows(n, row_len, words, tokenizer, rng)


def draw_pool(kinds: Sequence[str], spec: str, row_len: int, source: CanarySource, seed: int) -> tuple:
    """(tokens [m, row_len], secret_start [m], spare reserved ids) of canaries of ``kinds`` (one per canary;
    ``spec``: the kind spec they come from). Each kind draws its rows in canary-id order from its own stream; the
    new-token canaries take the reserved ids in canary-id order, the rest are spares."""
    kinds = np.asarray(kinds, dtype=object)
    m = len(kinds)
    tokens = np.zeros((m, int(row_len)), np.int64)
    secret = np.zeros(m, np.int64)
    n_new = int((kinds == "new").sum())
    if n_new and len(source.reserved) < n_new + 1:
        raise TestbedError(f"{n_new} new-token canaries need at least {n_new + 1} reserved token ids, the tokenizer "
                           f"has {len(source.reserved)}")
    for kind in canary_kinds(spec):
        sel = np.flatnonzero(kinds == kind)
        if not len(sel):
            continue
        rng = np.random.default_rng([int(seed), 0xCA7C, _KIND_STREAM[kind]])
        new_ids = np.arange(source.reserved.start, source.reserved.start + n_new) if kind == "new" else None
        tokens[sel] = draw_kind_rows(kind, len(sel), row_len, source, rng, new_ids)
        if kind == "new":
            secret[sel] = int(row_len) - NEW_SECRET_LEN
    spare = tuple(range(source.reserved.start + n_new, source.reserved.stop)) if len(source.reserved) else ()
    return tokens, secret, spare


def make_canaries(cfg: TestbedConfig, tokenizer, texts: Sequence[str] = (), rows=None, sampler=None) -> Canaries:
    """The canary pool of ``cfg`` in ``tokenizer``'s vocabulary (``texts``: the corpus, for word canaries; ``rows``:
    the packed corpus rows, for unigram and bigram canaries; ``sampler``: the model sampled canaries come from)."""
    plan = plan_canaries(cfg)
    vocab = len(tokenizer)
    kinds = canary_kinds(cfg.canary_kind)
    if cfg.canary_kind in LEGACY_KINDS:  # drawn exactly as before the other kinds existed
        words = corpus_words(texts) if cfg.canary_kind == "words" else ()
        rng = np.random.default_rng([int(cfg.seed), 0xCA7C])

        reserved = reserved_ids(tokenizer)
        corpus_vocab = reserved.start if len(reserved) else vocab
        tokens = _draw_rows(cfg.canary_kind, plan.m, cfg.row_len, corpus_vocab, words, tokenizer, rng)
        c = Canaries(tokens=tokens, reps=plan.reps, included=plan.included, steps=plan.steps,
                     batch_size=int(cfg.batch_size), kind=cfg.canary_kind, words=words, seed=int(cfg.seed),
                     vocab_size=vocab, corpus_vocab=None if corpus_vocab == vocab else corpus_vocab)
    else:
        source = canary_source(tokenizer, kinds, texts=texts, rows=rows, sampler=sampler)
        tokens, secret, spare = draw_pool(plan.kinds, cfg.canary_kind, cfg.row_len, source, cfg.seed)
        c = Canaries(tokens=tokens, reps=plan.reps, included=plan.included, steps=plan.steps,
                     batch_size=int(cfg.batch_size), kind=cfg.canary_kind, words=source.words, seed=int(cfg.seed),
                     vocab_size=vocab, kinds=plan.kinds, secret_start=secret,
                     params={k: kind_params(k) for k in kinds}, corpus_vocab=source.corpus_vocab, spare_ids=spare)
    check_distinct(c.tokens, cfg.canary_kind)
    return c


def check_distinct(tokens: np.ndarray, kind: str) -> None:
    """Refuse a pool in which two canaries drew the same row (their memberships could not be told apart)."""
    if len(np.unique(tokens, axis=0)) < len(tokens):
        raise TestbedError(f"two of the {len(tokens)} {kind} canaries drew the same row; use longer rows "
                           "(seq_len) or token canaries")


def candidate_rows(canaries: Canaries, n: int, seed: int = 0, tokenizer=None, kind: Optional[str] = None,
                   source: Optional[CanarySource] = None) -> np.ndarray:
    """[n, row_len] fresh random rows of the canaries' kind (the reference set of exposure), from a random stream
    independent of the canaries' own (``seed`` picks the sample). Word canaries need the testbed ``tokenizer``.
    A pool of several kinds: the rows of ``kind``, drawn from ``source`` (``canary_source``); new-token candidates
    end with the pool's spare reserved ids (never trained), sampled candidates need the source's sampler."""
    if canaries.legacy:
        if canaries.kind == "words" and tokenizer is None:
            raise TestbedError("candidate rows of word canaries need the testbed's tokenizer")
        rng = np.random.default_rng([canaries.seed, 0xCA7D, int(seed)])
        vocab = canaries.corpus_vocab or canaries.vocab_size
        return _draw_rows(canaries.kind, n, canaries.row_len, vocab, canaries.words, tokenizer, rng)
    kind = kind or canary_kinds(canaries.kind)[0]
    if source is None:
        raise TestbedError("candidate rows of a pool of the newer kinds need its canary source (canary_source)")
    rng = np.random.default_rng([canaries.seed, 0xCA7D, _KIND_STREAM[kind], int(seed)])
    new_ids = None
    if kind == "new":
        if not canaries.spare_ids:
            raise TestbedError("new-token candidates need spare reserved ids (reserve more tokens than canaries)")
        new_ids = rng.choice(np.asarray(canaries.spare_ids, np.int64), int(n))
    return draw_kind_rows(kind, n, canaries.row_len, source, rng, new_ids)


# ----------------------------------------------------------------------------------------------- file
def write_canaries(path, canaries: Canaries) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(canaries.to_json(), separators=(",", ":")))
    return path


def read_canaries(path) -> Canaries:
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TestbedError(f"{path}: cannot read the canary file ({e})") from None
    return Canaries.from_json(d, str(path))


# ----------------------------------------------------------------------------------------------- scoring
def sequence_nll(model, rows, batch_size: int = 64, params=None, mask=None) -> np.ndarray:
    """[n] total next-token negative log-likelihood (nats, float64) of each row [n, L]: -sum_t log p(row[t] |
    row[:t]) over t = 1..L-1, the training loss of the row times L - 1; with ``mask`` [n, L-1] (1 = counted) over
    the masked predictions only (``Canaries.secret_mask``: the secret). Rows are scored in fixed-size batches (the
    last one padded), so one compilation serves any n."""
    rows = np.asarray(rows, np.int32)
    mask = np.ones((len(rows), max(rows.shape[1] - 1, 0)), np.float32) if mask is None else \
        np.asarray(mask, np.float32)
    params = model.params if params is None else params
    from ..models.hub import program_model  # local, as jax below

    nll = _nll_fn(program_model(model))  # one program per architecture, not per checkpoint
    out = []
    b = max(1, min(int(batch_size), len(rows)))
    for lo in range(0, len(rows), b):
        chunk, w = rows[lo:lo + b], mask[lo:lo + b]
        pad = b - len(chunk)
        if pad:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, axis=0)])
            w = np.concatenate([w, np.repeat(w[-1:], pad, axis=0)])
        out.append(np.asarray(nll(params, chunk, w), np.float64)[: b - pad])
    return np.concatenate(out) if out else np.zeros(0)


@functools.lru_cache(maxsize=4)
def _nll_fn(model):
    """jit((params, rows [b, L], weights [b, L-1]) -> [b] weighted NLL) of ``model`` (a ``program_model`` stand-in:
    compiled once per architecture)."""
    import jax  # local: the canary file and plan are read without loading JAX (as the testbed CLI does)
    import jax.numpy as jnp

    @jax.jit
    def nll(p, x, w):
        logp = jax.nn.log_softmax(model.logits(p, x[:, :-1]).astype(jnp.float32), axis=-1)
        return -(jnp.take_along_axis(logp, x[:, 1:, None], axis=-1)[..., 0] * w).sum(-1)

    return nll


def secret_nll(model, canaries: Canaries, batch_size: int = 64, params=None) -> np.ndarray:
    """[m] negative log-likelihood of each canary's secret given what precedes it (``Canaries.secret_mask``)."""
    return sequence_nll(model, canaries.tokens, batch_size, params, canaries.secret_mask())


def new_token_contrast(model, canaries: Canaries, n_spare: int = 8, batch_size: int = 64, params=None) -> np.ndarray:
    """[m] membership score of new-token canaries (NaN for the other kinds): the mean secret NLL of the canary's row
    with its reserved id replaced by each of ``n_spare`` spare reserved ids, minus the canary's own secret NLL.

    The reserved ids start equal (``mia.testbed.build.zero_reserved_rows``) and a corpus that never uses them moves
    them alike, so an untrained canary's id behaves as a spare does: a score about 0 (0 up to float32 rounding without
    noise: the head's matmul may round one vocabulary column differently from another), and
    what training on the canary did to its own id's embedding rows shows as a positive score. The spares see the
    same prefix and the same model, so a change of the shared weights (fine-tuning, DP noise) cancels out."""
    new = canaries.kind_of == "new"
    out = np.full(canaries.m, np.nan)
    if not new.any():
        return out
    spare = np.asarray(canaries.spare_ids[:n_spare], np.int64)
    if not len(spare):
        raise TestbedError("the new-token contrast needs spare reserved ids (reserve more tokens than canaries)")
    rows, mask = canaries.tokens[new], canaries.secret_mask()[new]
    ids = canaries.new_token_ids()[new]
    variants = [rows]
    for sp in spare:
        r = rows.copy()
        r[r == ids[:, None]] = sp
        variants.append(r)
    nll = sequence_nll(model, np.concatenate(variants), batch_size, params, np.tile(mask, (len(variants), 1)))
    nll = nll.reshape(len(variants), len(rows))
    # differences first: bit-equal NLLs give exactly 0 (a mean of equal values need not round back to that value)
    out[new] = (nll[1:] - nll[0]).mean(axis=0)
    return out


def canary_exposure(model, canaries: Canaries, *, n_candidates: int = 1000, seed: int = 0, method: str = "sampled",
                    tokenizer=None, batch_size: int = 64) -> np.ndarray:
    """[m] exposure (bits) of every canary under ``model``, ranked among ``n_candidates`` fresh rows of the same
    kind (``candidate_rows``). ``method``: "sampled" (rank estimate, at most log2(n_candidates + 1) bits) or
    "skewnorm" (the skew-normal extrapolation); see ``mia.privacy.exposure``."""
    if method not in ("sampled", "skewnorm"):
        raise TestbedError(f"exposure method must be 'sampled' or 'skewnorm', got {method!r}")
    cand = candidate_rows(canaries, n_candidates, seed, tokenizer)
    canary_loss = sequence_nll(model, canaries.tokens, batch_size)
    cand_loss = sequence_nll(model, cand, batch_size)
    return (exposure_sampled if method == "sampled" else exposure_skewnorm)(canary_loss, cand_loss)
