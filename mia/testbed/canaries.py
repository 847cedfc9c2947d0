"""Canaries: random rows inserted into a testbed's training with exact, recorded membership.

A testbed built with ``canaries=m`` (``TestbedConfig``) holds a pool of ``m`` canaries, each one training row of
``seq_len + 1`` tokens drawn at random in the testbed's own tokenization:

- ``canary_kind="tokens"``: token ids uniform on [1, vocab) (id 0, EOD, never appears);
- ``canary_kind="words"``: words drawn uniformly from the corpus's most frequent words (letters only), joined by
  spaces, tokenized by the testbed tokenizer and cut to the row length.

Canary ``i`` is included with probability 1/2 (independently, seeded by the config's ``seed``) and, if included,
trained ``r_i = canary_reps[i % len(canary_reps)]`` times: each copy is an extra row appended to the batch of one
step, at ``r_i`` distinct steps drawn uniformly from [0, train_steps) (drawn for every canary, so that whether one
canary is included never changes where another's copies go). The natural rows of the training order are
untouched (``data/order.bin`` and the membership of every natural row at every checkpoint are exactly those of
the same testbed without canaries); the batch of step s is its ``batch_size`` natural rows followed by the copies
trained at s, in ascending canary id. Excluded canaries are never trained: exact non-members.

Everything about the pool is in ``data/canaries.json``: per canary its id, tokens, reps, included flag, and the
(step, slot) of each copy (slot = its row in that step's batch). Inclusion, reps and steps depend on the config
only (``plan_canaries``), so the privacy accountant can count the records without building anything.

Private testbeds (``mia.testbed.dp``) use the same pool; with ``dp_sampling="poisson"`` the recorded steps are not
used: every natural row of the first ``train_steps * batch_size`` and every canary copy is one record of the pool
that each step samples from.

Exposure (``canary_exposure``) ranks each canary's log-perplexity among fresh random rows of the same kind
(``candidate_rows``; see ``mia.exposure``).
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path
from typing import Sequence

import numpy as np

from ..atomic import write_text
from ..exposure import exposure_sampled, exposure_skewnorm
from .config import TestbedConfig, TestbedError

CANARY_FILE = "data/canaries.json"
CANARY_FORMAT = "mia-canaries/1"
MAX_WORDS = 5000  # the word canaries' vocabulary: this many most frequent corpus words
_WORD = re.compile(r"[A-Za-z]{3,12}")


# ----------------------------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True)
class CanaryPlan:
    """Who is trained and when: ``reps`` [m] insertions per canary, ``included`` [m] bool, ``steps`` (one sorted int
    array per canary: the steps its copies are trained at; empty when excluded)."""

    reps: np.ndarray
    included: np.ndarray
    steps: tuple

    @property
    def m(self) -> int:
        return len(self.reps)

    @property
    def n_copies(self) -> int:
        """Rows that the canaries add to training (the included canaries' reps, summed)."""
        return int(sum(len(s) for s in self.steps))


def plan_canaries(cfg: TestbedConfig) -> CanaryPlan:
    """The inclusion, repetitions and steps of ``cfg``'s canaries (a function of the config alone)."""
    m, T = int(cfg.canaries), int(cfg.train_steps)
    reps = np.array([cfg.canary_reps[i % len(cfg.canary_reps)] for i in range(m)], np.int64)
    included = np.random.default_rng([int(cfg.seed), 0xCA7A]).random(m) < 0.5
    rng = np.random.default_rng([int(cfg.seed), 0xCA7B])
    # every canary draws its steps, included or not, so that one canary's inclusion never moves another's copies
    drawn = [np.sort(rng.choice(T, int(r), replace=False)).astype(np.int64) for r in reps]
    steps = tuple(d if inc else np.zeros(0, np.int64) for d, inc in zip(drawn, included))
    plan = CanaryPlan(reps, included, steps)
    natural = T * cfg.batch_size
    if plan.n_copies > natural:
        raise TestbedError(f"{m} canaries with reps {list(cfg.canary_reps)} add {plan.n_copies} rows to training, more "
                           f"than its {natural} natural rows ({T} steps x batch {cfg.batch_size}); use fewer canaries "
                           "or smaller --canary-reps")
    return plan


# ----------------------------------------------------------------------------------------------- the pool
@dataclasses.dataclass(frozen=True)
class Canaries:
    """A testbed's canary pool. ``tokens`` [m, row_len] int64 (one training row each), ``reps`` [m], ``included``
    [m] bool, ``steps`` (per canary, sorted steps of its copies), ``batch_size`` (natural rows per step: a copy's
    slot in its step's batch is ``batch_size`` + its rank among that step's copies), ``kind``, ``words`` (the word
    canaries' vocabulary, else empty), ``seed``, ``vocab_size``."""

    tokens: np.ndarray
    reps: np.ndarray
    included: np.ndarray
    steps: tuple
    batch_size: int
    kind: str
    words: tuple
    seed: int
    vocab_size: int

    @property
    def m(self) -> int:
        return len(self.tokens)

    @property
    def row_len(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def n_copies(self) -> int:
        return int(sum(len(s) for s in self.steps))

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

    def to_json(self) -> dict:
        pos = self.positions()
        return {"format": CANARY_FORMAT, "m": self.m, "kind": self.kind, "seed": self.seed,
                "vocab_size": self.vocab_size, "row_len": self.row_len, "batch_size": self.batch_size,
                "n_included": int(self.included.sum()), "n_copies": self.n_copies, "slots": self.slots,
                "words": list(self.words),
                "canaries": [{"id": i, "reps": int(self.reps[i]), "included": bool(self.included[i]),
                              "positions": [list(p) for p in pos[i]], "tokens": self.tokens[i].tolist()}
                             for i in range(self.m)]}

    @classmethod
    def from_json(cls, d: dict, source: str = "canaries.json") -> "Canaries":
        if d.get("format") != CANARY_FORMAT:
            raise TestbedError(f"{source}: canary file of format {d.get('format')!r}, this mia reads {CANARY_FORMAT!r}")
        rows = d["canaries"]
        return cls(tokens=np.array([r["tokens"] for r in rows], np.int64).reshape(len(rows), d["row_len"]),
                   reps=np.array([r["reps"] for r in rows], np.int64),
                   included=np.array([r["included"] for r in rows], bool),
                   steps=tuple(np.array(sorted(p[0] for p in r["positions"]), np.int64) for r in rows),
                   batch_size=int(d["batch_size"]), kind=d["kind"], words=tuple(d["words"]), seed=int(d["seed"]),
                   vocab_size=int(d["vocab_size"]))


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


def _draw_rows(kind: str, n: int, row_len: int, vocab_size: int, words, tokenizer, rng) -> np.ndarray:
    if kind == "tokens":
        return random_token_rows(n, row_len, vocab_size, rng)
    return random_word_rows(n, row_len, words, tokenizer, rng)


def make_canaries(cfg: TestbedConfig, tokenizer, texts: Sequence[str] = ()) -> Canaries:
    """The canary pool of ``cfg`` in ``tokenizer``'s vocabulary (``texts``: the corpus, for word canaries)."""
    plan = plan_canaries(cfg)
    vocab = len(tokenizer)
    words = corpus_words(texts) if cfg.canary_kind == "words" else ()
    rng = np.random.default_rng([int(cfg.seed), 0xCA7C])
    tokens = _draw_rows(cfg.canary_kind, plan.m, cfg.row_len, vocab, words, tokenizer, rng)
    if len(np.unique(tokens, axis=0)) < plan.m:
        raise TestbedError(f"two of the {plan.m} {cfg.canary_kind} canaries drew the same row; use longer rows "
                           "(seq_len) or token canaries")
    return Canaries(tokens=tokens, reps=plan.reps, included=plan.included, steps=plan.steps,
                    batch_size=int(cfg.batch_size), kind=cfg.canary_kind, words=words, seed=int(cfg.seed),
                    vocab_size=vocab)


def candidate_rows(canaries: Canaries, n: int, seed: int = 0, tokenizer=None) -> np.ndarray:
    """[n, row_len] fresh random rows of the canaries' kind (the reference set of exposure), from a random stream
    independent of the canaries' own (``seed`` picks the sample). Word canaries need the testbed ``tokenizer``."""
    if canaries.kind == "words" and tokenizer is None:
        raise TestbedError("candidate rows of word canaries need the testbed's tokenizer")
    rng = np.random.default_rng([canaries.seed, 0xCA7D, int(seed)])
    return _draw_rows(canaries.kind, n, canaries.row_len, canaries.vocab_size, canaries.words, tokenizer, rng)


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
def sequence_nll(model, rows, batch_size: int = 64, params=None) -> np.ndarray:
    """[n] total next-token negative log-likelihood (nats, float64) of each row [n, L]: -sum_t log p(row[t] |
    row[:t]) over t = 1..L-1, the training loss of the row times L - 1. Rows are scored in fixed-size batches (the
    last one padded), so one compilation serves any n."""
    import jax  # local: the canary file and plan are read without loading JAX (as the testbed CLI does)
    import jax.numpy as jnp

    rows = np.asarray(rows, np.int32)
    params = model.params if params is None else params

    @jax.jit
    def nll(p, x):
        logp = jax.nn.log_softmax(model.logits(p, x[:, :-1]).astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, x[:, 1:, None], axis=-1)[..., 0].sum(-1)

    out = []
    b = max(1, min(int(batch_size), len(rows)))
    for lo in range(0, len(rows), b):
        chunk = rows[lo:lo + b]
        pad = b - len(chunk)
        if pad:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, axis=0)])
        out.append(np.asarray(nll(params, chunk), np.float64)[: b - pad])
    return np.concatenate(out) if out else np.zeros(0)


def canary_exposure(model, canaries: Canaries, *, n_candidates: int = 1000, seed: int = 0, method: str = "sampled",
                    tokenizer=None, batch_size: int = 64) -> np.ndarray:
    """[m] exposure (bits) of every canary under ``model``, ranked among ``n_candidates`` fresh rows of the same
    kind (``candidate_rows``). ``method``: "sampled" (rank estimate, at most log2(n_candidates + 1) bits) or
    "skewnorm" (the skew-normal extrapolation); see ``mia.exposure``."""
    if method not in ("sampled", "skewnorm"):
        raise TestbedError(f"exposure method must be 'sampled' or 'skewnorm', got {method!r}")
    cand = candidate_rows(canaries, n_candidates, seed, tokenizer)
    canary_loss = sequence_nll(model, canaries.tokens, batch_size)
    cand_loss = sequence_nll(model, cand, batch_size)
    return (exposure_sampled if method == "sampled" else exposure_skewnorm)(canary_loss, cand_loss)
