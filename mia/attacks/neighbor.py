"""Neighbourhood comparison (Mattern et al. 2023, "Membership Inference Attacks against Language Models via
Neighbourhood Comparison").

  neighbor(x) = LL(x) - mean_j LL(x~_j)

x~_1..x~_n are single-token replacements of x proposed by a masked LM (``--mlm DIR``, a local BertForMaskedLM
directory, run in Flax: ``mia.models.bert.load_mlm``; ``mia.attacks._mlm`` documents the search and its two small
deviations). LL is the target's mean token log-likelihood, each neighbour tokenized with the target tokenizer
(truncated to the context).
HIGHER = MEMBER: the source's statistic is loss(x) - mean loss(x~) with lower = member; ours is its negative.

Defaults: n = 10 neighbours, k = 5 candidates per position, dropout p = 0.7 on the replaced token's embedding
(the reference code's k and p; its n is 50, the paper sweeps n; 10 keeps the cost at 10 extra scoring passes).
Examples given as token ids are decoded once with the target tokenizer (noted). Neighbours depend on the MLM, the
text, n, k, p and the seed; they are cached on disk (``<cache_dir>/neighbors-<key>/``) and reused.

Definition and differences from the public code: docs/algorithms.md#neighbor.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import jax
import numpy as np

from ..files import cache_limit
from ..files.atomic import write_json
from ..engine.loop import compute_token_stats
from ..validate import Range
from ..models.bert import load_mlm
from ._mlm import neighbours
from .recall import memo, unconditional_ll
from .registry import AttackError, register

NEIGHBOR_VERSION = "1"


def load_masked_lm(ctx):
    m = memo(ctx)
    if "mlm" not in m:

        path = ctx.options.get("mlm")
        if not path:
            raise AttackError("attack neighbor needs a masked language model: give --mlm DIR (a local BERT MLM "
                              "directory)")
        try:
            m["mlm"] = load_mlm(path)
        except (FileNotFoundError, ValueError) as e:
            raise AttackError(f"--mlm {path}: {e}") from None
    return m["mlm"]


def neighbour_texts(ctx, *, n: int, k: int, p: float) -> list:
    """[N] lists of neighbour texts (disk-cached per text)."""
    from tqdm.auto import tqdm

    mlm = load_masked_lm(ctx)
    texts = ctx.texts()
    root = None
    if ctx.settings.cache_dir:  # the MLM's weights are hashed only for a cache that uses the key
        tag = hashlib.sha256(f"{mlm.fingerprint}|{n}|{k}|{p}|{ctx.seed}|{NEIGHBOR_VERSION}".encode()).hexdigest()[:20]
        root = Path(ctx.settings.cache_dir) / f"neighbors-{tag}"
    key = jax.random.PRNGKey(ctx.seed)
    out = []
    for text in tqdm(texts, desc="neighbor: MLM search", disable=not ctx.settings.progress, leave=False):
        h = hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]
        f = root / f"{h}.json" if root else None
        if f is not None and f.exists():
            try:
                entry = json.loads(f.read_text())
                if entry["text"] != text or not all(isinstance(x, str) for x in entry["neighbors"]):
                    raise ValueError("entry is for another text or not a list of texts")
                out.append(entry["neighbors"])
                cache_limit.touch(f)  # recency for LRU eviction
                continue
            except FileNotFoundError:
                pass  # evicted since it was looked for: recomputed below
            except (OSError, ValueError, KeyError, TypeError) as e:  # recomputed and rewritten below
                print(f"warning: cache file {f} is damaged ({type(e).__name__}: {e}); its entries are recomputed",
                      file=sys.stderr)
        # the text's hash picks the dropout stream, so a text's neighbours do not depend on its position in the data
        nb = neighbours(mlm, text, jax.random.fold_in(key, int(h[:7], 16)), n=n, k=k, p=p)
        if f is not None:
            cache_limit.write_in(root, lambda: write_json(f, {"text": text, "neighbors": nb}))
            cache_limit.note_write(root.parent, cache_limit.file_size(f))
        out.append(nb)
    return out


@register(
    "neighbor",
    needs=("stats", "text", "mlm"), stats=("logprob",),
    cost="heavy",
    cost_note="10 masked-LM neighbours of every example at the default n=10, 10 extra scoring passes",
    n=10,
    k=5,
    p=0.7,
    limits={"n": Range(1), "k": Range(1), "p": Range(0, 1, hi_open=True)},
)
def _neighbor(ctx, *, n: int, k: int, p: float) -> np.ndarray:
    """LL(x) - mean LL(masked-LM neighbours of x) (higher = member). Mattern et al. 2023."""
    if n < 1 or k < 1 or not 0 <= p < 1:
        raise AttackError(f"attack neighbor: need n >= 1, k >= 1, 0 <= p < 1; got n={n}, k={k}, p={p}")
    if ctx.model.tokenizer is None:
        raise AttackError("attack neighbor needs the target model's tokenizer to score neighbour texts")
    nbs = neighbour_texts(ctx, n=n, k=k, p=p)
    flat, owner = [], []
    for i, texts in enumerate(nbs):
        for t in texts:
            ids = np.asarray(ctx.model.tokenizer(t)["input_ids"], np.int32)[: ctx.model.max_tokens]
            if len(ids) >= 2:
                flat.append(ids)
                owner.append(i)
    stats = compute_token_stats(ctx.model, flat, ctx.settings, desc="neighbor: scoring neighbours",
                                stats=("logprob",)) if flat else []
    total, count = np.zeros(len(nbs)), np.zeros(len(nbs))
    for i, s in zip(owner, stats):
        total[i] += float(np.mean(s["logprob"], dtype=np.float64))
        count[i] += 1
    if (count == 0).any():
        ctx.notes.append(f"neighbor: {int((count == 0).sum())} example(s) got no usable neighbour; their score is NaN")
    with np.errstate(invalid="ignore", divide="ignore"):
        return unconditional_ll(ctx) - total / count
