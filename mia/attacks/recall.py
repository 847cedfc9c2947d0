"""ReCaLL (Xie et al. 2024, "ReCaLL: Membership Inference via Relative Conditional Log-Likelihoods").

  ReCaLL(x) = LL(x | P) / LL(x)

P is an n-shot prefix of known NON-members (partition "prefix" or ``--prefix-data``, checked disjoint from the
evaluated examples by id and token content). LL(x) is the unconditional mean token log-likelihood (T-1 terms,
ALGORITHMS.md 0). LL(x | P) averages over x's tokens only, x's tokens attending to P's cached keys/values
(``mia.conditional``); by default it includes x's first token predicted from P (L terms), as the ReCaLL and mimir
code do (``include_first=False`` gives em-mia's L-1 terms). Both LLs are negative, so the ratio is positive.
HIGHER = MEMBER, as the official code (ROC with member = 1 on the raw ratio); mimir returns -ratio.

Prefix (ALGORITHMS.md 1.1):
  - the FIRST n examples of the prefix partition, in file order (the official code takes the first n non-members
    after its shuffle); n = 12 by default (ReCaLL options);
  - text shots are joined with "" (no separator, official code) and the joined text is tokenized once with the
    target tokenizer; when any shot has only token ids (or was truncated), the shots' token ids are concatenated;
  - over-length: keep the LAST k shots (largest k) so that prefix + the LONGEST evaluated target fits the model
    context (ReCaLL/mimir fit the average target length; we fit every target, so no target is cut). A note says
    when k < n; an error when not even one shot fits.
"""
from __future__ import annotations

import numpy as np

from ..conditional import loglik_matrix
from .context import assert_disjoint
from .loss import mean_loglik
from .registry import AttackError, register


def memo(ctx) -> dict:
    """Per-run memo shared by the attacks of one ``AttackContext`` (conditional-LL matrices, reference model)."""
    return ctx.__dict__.setdefault("_memo", {})


def context_length(ctx) -> int:
    return int(ctx.model.max_length)


def unconditional_ll(ctx) -> np.ndarray:
    """[N] float64 LL(x): mean token log-likelihood from the shared stats pass."""
    p = ctx.padded()
    return np.asarray(mean_loglik(p["logprob"], p["mask"]), np.float64)


def build_prefix(shots: list, tokenizer, room: int) -> tuple[np.ndarray, int, str]:
    """(prefix token ids, shots kept k, mode "text"|"tokens"): the last k shots with len(prefix) <= ``room``."""
    as_text = tokenizer is not None and all(e.text is not None and not e.truncated for e in shots)
    for k in range(len(shots), 0, -1):
        kept = shots[len(shots) - k:]
        if as_text:
            ids = np.asarray(tokenizer("".join(e.text for e in kept))["input_ids"], np.int32)
        else:
            ids = np.concatenate([np.asarray(e.tokens, np.int32) for e in kept])
        if 0 < len(ids) <= room:
            return ids, k, "text" if as_text else "tokens"
    raise AttackError(f"recall: no room for a prefix: the longest evaluated example leaves {room} token(s) of the "
                      f"model context and the shortest last shot does not fit (lower --max-length)")


def recall_prefix(ctx, n: int) -> np.ndarray:
    if n < 1:
        raise AttackError(f"attack recall: n must be >= 1, got {n}")
    shots = ctx.partition("prefix", min_size=n, flag="--prefix-data")[:n]
    assert_disjoint(ctx.examples, shots, "recall: prefix data")
    longest = max(len(e.tokens) for e in ctx.examples)
    ids, k, mode = build_prefix(shots, ctx.model.tokenizer, context_length(ctx) - longest)
    note = (f"recall: prefix = {k} shot(s) "
            + ("joined as text with no separator" if mode == "text" else "as concatenated token ids")
            + f", {len(ids)} tokens" + (f" (kept the last {k} of {n} so that prefix + longest target fits the "
                                        f"{context_length(ctx)}-token context)" if k < n else ""))
    if note not in ctx.notes:
        ctx.notes.append(note)
    return ids


def recall_scores(ll_cond: np.ndarray, ll: np.ndarray) -> np.ndarray:
    """[N] LL(x|P) / LL(x) (higher = member)."""
    return np.asarray(ll_cond, np.float64) / np.asarray(ll, np.float64)


@register("recall", needs=("model", "stats", "prefix"), n=12, include_first=True)
def _recall(ctx, *, n: int, include_first: bool) -> np.ndarray:
    """ReCaLL: LL(x | n-shot non-member prefix) / LL(x) (higher = member). Xie et al. 2024."""
    prefix = recall_prefix(ctx, n)
    key = ("recall", prefix.tobytes(), bool(include_first))
    m = memo(ctx)
    if key not in m:
        m[key] = loglik_matrix(ctx.model, [prefix], [e.tokens for e in ctx.examples], include_first=include_first,
                               settings=ctx.settings, desc="recall: conditional LL")[0]
    return recall_scores(m[key], unconditional_ll(ctx))
